"""Export a drafter in the z-lab ``DFlashDraftModel`` format, and load it back.

An exported folder holds ``config.json`` (Qwen3 fields + DFlash keys, written both at the top
level and in ``dflash_config`` so z-lab, SGLang, vLLM and MLX loaders all find them),
``model.safetensors`` (draft-only weights, no embedding, LM head or rotary buffers) and the
standalone ``dflash.py`` modeling file that ``trust_remote_code`` loads. The folder is written
to a temporary sibling and renamed into place, so a reader never sees a half-written export.
"""

from __future__ import annotations

import argparse
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file
from transformers import PretrainedConfig, Qwen3Config

from dflash_trainer.config import Config
from dflash_trainer.model import modeling
from dflash_trainer.model.drafter import check_compatible, text_config
from dflash_trainer.model.modeling.dflash import DFlashDraftModel

__all__ = ["export_config", "export_drafter", "load_checkpoint_drafter", "load_drafter", "main"]

MODELING_FILE = Path(modeling.__file__).parent / "dflash.py"
_WEIGHT_NAMES = ("fc.weight", "hidden_norm.weight", "norm.weight")


def export_config(model: DFlashDraftModel, *, num_target_layers: int, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` dict of an exported drafter."""
    c = model.config
    rope = dict(getattr(c, "rope_parameters", None) or {})
    rope_theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    rope.setdefault("rope_type", "default")
    rope["rope_theta"] = rope_theta
    # transformers 4.x reads rope_theta/rope_scaling; 5.x reads rope_parameters: write both.
    scaling = None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": model.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": model.mask_token_id,
                          "target_layer_ids": list(model.target_layer_ids),
                          "block_size": model.block_size},
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": model.layers[0].self_attn.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * c.num_hidden_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": c.num_hidden_layers,
        "tie_word_embeddings": False,
        "initializer_range": c.initializer_range,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        "use_cache": True,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
        "transformers_version": transformers.__version__,
    }


def _draft_weights(model: DFlashDraftModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    unexpected = [k for k in state if not (k.startswith("layers.") or k in _WEIGHT_NAMES)]
    missing = [k for k in _WEIGHT_NAMES if k not in state]
    if unexpected or missing:
        raise ValueError(f"drafter state does not match the z-lab format: unexpected {unexpected}, "
                         f"missing {missing}")
    return {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}


def export_drafter(model: DFlashDraftModel, out_dir: str | Path, *, target_config: PretrainedConfig | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``config.json``, ``model.safetensors`` and ``dflash.py`` to ``out_dir`` atomically.

    ``target_config`` (checked for compatibility) gives ``num_target_layers``; without it the
    drafter config's own ``num_target_layers`` is used. An existing ``out_dir`` is replaced
    only if it is empty or a previous drafter export.
    """
    out = Path(out_dir)
    num_target_layers = getattr(model.config, "num_target_layers", None)
    if target_config is not None:
        check_compatible(model.config, target_config)
        num_target_layers = text_config(target_config).num_hidden_layers
    if num_target_layers is None:
        raise ValueError("export needs target_config or a drafter config with num_target_layers")
    if out.exists() and any(out.iterdir()) and not _is_export(out):
        raise FileExistsError(f"{out} exists and is not a drafter export; choose an empty or new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        config = export_config(model, num_target_layers=int(num_target_layers), dtype=dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(_draft_weights(model, dtype), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.copyfile(MODELING_FILE, tmp / "dflash.py")
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _is_export(path: Path) -> bool:
    try:
        return "DFlashDraftModel" in json.loads((path / "config.json").read_text()).get("architectures", [])
    except (OSError, ValueError):
        return False


def load_drafter(path: str | Path, *, dtype: torch.dtype = torch.float32) -> DFlashDraftModel:
    """Load an exported drafter folder with the in-project class; every weight must be present."""
    model, info = DFlashDraftModel.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa",
                                                   output_loading_info=True)
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise ValueError(f"{path}: drafter weights do not match its config.json: {problems}")
    return model


def load_checkpoint_drafter(path: str | Path, *, dtype: torch.dtype = torch.float32) -> DFlashDraftModel:
    """A drafter from an exported folder, a training checkpoint ``step-N/`` (its ``drafter/``
    export), or ``drafter.pt`` (state_dict) + ``drafter_config.json``."""
    path = Path(path)
    if (path / "manifest.json").is_file() and (path / "drafter" / "config.json").is_file():
        path = path / "drafter"
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return load_drafter(path, dtype=dtype)
    if (path / "drafter.pt").is_file() and (path / "drafter_config.json").is_file():
        config = Qwen3Config.from_dict(json.loads((path / "drafter_config.json").read_text()))
        config._attn_implementation = "sdpa"
        model = DFlashDraftModel(config)
        state = torch.load(path / "drafter.pt", map_location="cpu", weights_only=True)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"{path / 'drafter.pt'} does not match {path / 'drafter_config.json'}: {exc}") from exc
        return model.to(dtype)
    raise FileNotFoundError(f"{path}: expected an exported drafter (config.json + model.safetensors) or a "
                            f"checkpoint folder with drafter.pt + drafter_config.json")


def main(cfg: Config, args: argparse.Namespace) -> int:
    """``dflash-trainer export --checkpoint CKPT --out DIR``."""
    del cfg  # the drafter config inside the checkpoint is authoritative
    model = load_checkpoint_drafter(args.checkpoint)
    out = export_drafter(model, args.out)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"exported drafter ({num_params / 1e6:.1f}M parameters, block {model.block_size}, "
          f"target layers {model.target_layer_ids}, mask id {model.mask_token_id}) to {out}")
    return 0
