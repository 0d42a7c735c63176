"""The parts of the frozen target that training from a feature store needs, without the rest.

Training from a store runs no target forward: the objective only reads the target's embedding
and LM head (and the final norm, for a drafter initialised from it), and ``drafter_init=target``
or ``last_layers`` copies a few decoder layers. :func:`load_target_parts` builds the model on
the meta device and materialises just those tensors from the safetensors files, so a run from
the store holds a fraction of the target in memory. :func:`weights_hash` identifies the
target's weights by content, for the store's manifest.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Collection
from pathlib import Path

import torch
from torch import nn

from dflash_trainer.core.assets import first_line, load_tokenizer
from dflash_trainer.config import ModelConfig
from dflash_trainer.core.errors import TargetError
from dflash_trainer.core.fsutil import sha256_file
from dflash_trainer.model.target import WEIGHT_PATTERNS, decoder_layers, load_target

__all__ = ["init_layers", "load_target_parts", "weights_hash"]

log = logging.getLogger(__name__)

_ALWAYS = ("model.embed_tokens.", "model.norm.", "lm_head.")
"""Tensors every run from a store needs: the shared embedding and LM head, the final norm."""


def init_layers(model_cfg: ModelConfig, num_target_layers: int, layer_ids: Collection[int]) -> list[int]:
    """The target decoder layers that ``model.drafter_init`` copies into the drafter."""
    if model_cfg.init_from is not None:
        return []
    if model_cfg.drafter_init == "target":
        first = max(layer_ids) + 1
        return [i for i in range(first, first + model_cfg.num_layers) if i < num_target_layers]
    if model_cfg.drafter_init == "last_layers":
        return list(range(max(0, num_target_layers - model_cfg.num_layers), num_target_layers))
    return []


def weight_files(folder: Path) -> list[Path]:
    """The files a model folder's weights are read from (shards and their index), sorted."""
    return sorted({p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern) if p.is_file()})


_HASHES: dict[tuple[str, tuple[tuple[str, int, int, int, int], ...]], str] = {}
"""In-process memo of :func:`weights_hash` by folder and each file's (name, size, mtime, inode,
ctime): ctime changes on every write, whatever a copy tool puts back."""


def weights_hash(folder: Path) -> str:
    """sha256 (hex) over the names and bytes of the target's weight files: the same weights give
    the same hash wherever the folder lies."""
    files = weight_files(folder)
    if not files:
        raise TargetError(f"target {folder}: no model weights in the folder")
    key = (str(folder.resolve()), tuple((p.name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
                                        for p, st in ((p, p.stat()) for p in files)))
    if key not in _HASHES:
        digest = hashlib.sha256(b"dflash target weights v1\n")
        for path in files:
            digest.update(f"{path.name}\n{sha256_file(path)}\n".encode())
        _HASHES[key] = digest.hexdigest()
    return _HASHES[key]


def _safetensors_map(folder: Path) -> dict[str, Path] | None:
    """Tensor name -> safetensors file of the folder's weights (None: not safetensors)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            out.update({name: path for name in f.keys()})  # noqa: SIM118 - safe_open has no iteration
    return out


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def load_target_parts(path: str, *, device: torch.device | str, dtype: torch.dtype,
                      layers: Collection[int]) -> tuple[nn.Module, object]:
    """The target of ``path`` with only its embedding, final norm, LM head and decoder
    ``layers`` in memory (every other tensor on the meta device), and its tokenizer.

    The module cannot run a forward; it serves the objective (embedding, head), the drafter's
    initialisation (``layers``) and everything that reads the config. A folder whose weights are
    not safetensors is loaded whole.
    """
    from safetensors import SafetensorError, safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(path)
    tensors = _safetensors_map(folder)
    if tensors is None:
        log.warning("target %s has no safetensors weights: loading it whole", path)
        return load_target(path, device=device, dtype=dtype)
    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise TargetError(f"target {path}: the model does not load ({type(exc).__name__}: "
                          f"{first_line(exc)})") from exc
    decoder_layers(model)
    wanted = _ALWAYS + tuple(f"model.layers.{i}." for i in layers)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False) if n.startswith(wanted)]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    by_file: dict[Path, list[str]] = {}
    for name in names:
        if name not in tensors:
            if tied and name.startswith("lm_head."):
                continue
            raise TargetError(f"target {path}: tensor {name} is not in its weight files; copy or "
                              "download the model again")
        by_file.setdefault(tensors[name], []).append(name)
    try:
        for file, file_names in by_file.items():
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for name in file_names:
                    _set_tensor(model, name, f.get_tensor(name).to(dtype))
    except (SafetensorError, OSError) as exc:
        raise TargetError(f"target {path}: the weights do not load ({type(exc).__name__}: "
                          f"{first_line(exc)}); copy or download the model again") from exc
    if tied or "lm_head.weight" not in tensors:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval().requires_grad_(False)
    return model, load_tokenizer(path)
