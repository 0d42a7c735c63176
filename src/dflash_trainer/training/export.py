"""Export a drafter in z-lab's format (``DFlashDraftModel`` and its variants), and load it back.

An exported folder holds ``config.json`` (Qwen3 fields + DFlash keys, written both at the top
level and in ``dflash_config`` so z-lab, SGLang, vLLM and MLX loaders all find them),
``model.safetensors`` (draft-only weights, no embedding, LM head or rotary buffers) and the
standalone modeling files that ``trust_remote_code`` loads (``dflash.py``, and a variant's own
file, which imports it). The drafter's variant (:mod:`dflash_trainer.model.variants`) adds its
top-level keys, its ``dflash_config`` keys and its tensors. Loading picks the class from
``architectures``. The folder is written
to a temporary sibling and renamed into place, so a reader never sees a half-written export.

``config.json`` also holds, under ``dflash_trainer``, the signature of the target the drafter
was trained for (vocabulary and hidden size, a fingerprint of the tokenizer's chat template and
special ids: :func:`~dflash_trainer.model.drafter.target_signature`); transformers keeps the
unknown top-level key as a config attribute, and z-lab, SGLang and vLLM ignore it.
:func:`check_fits_target` compares it with a target before a drafter is used.

``export`` reads a training checkpoint only after checking every file against its manifest's
sha256, and loading checks ``config.json`` against the weights' shapes first: a corrupted or
edited folder is refused with one line naming it (:class:`~dflash_trainer.core.errors.CheckpointError`).
``export --out`` writes a new or empty folder; it replaces an earlier export only with
``--overwrite`` and never a file or a folder holding anything else.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
import yaml
from safetensors import SafetensorError, safe_open
from transformers import PretrainedConfig

from dflash_trainer.core.assets import first_line
from dflash_trainer.training.checkpoint import MANIFEST, validate_checkpoint
from dflash_trainer.config import Config
from dflash_trainer.core.assets import resolve_target
from dflash_trainer.core.errors import CheckpointError, ConfigError, TargetError, UserError
from dflash_trainer.features.target_parts import weights_hash
from dflash_trainer.core.units import format_count
from dflash_trainer.training.model_card import CARD_FILE, RunFacts, model_card, run_facts
from dflash_trainer.core.fsutil import save_safetensors, write_dir_atomically
from dflash_trainer.core.inputs import check_input
from dflash_trainer.model import modeling
from dflash_trainer.model.drafter import SIGNATURE_KEY, check_compatible, text_config
from dflash_trainer.model.modeling.dflash import DFlashDraftModel
from dflash_trainer.model.variants import Variant, architectures, drafter_class, get_variant, titles, variant_of

__all__ = ["check_export_destination", "check_fits_target", "check_variant", "export_config", "export_drafter",
           "load_checkpoint_drafter", "load_drafter", "main"]

MODELING_FILE = Path(modeling.__file__).parent / "dflash.py"
"""The backbone's modeling file, which every export ships (a variant's own file imports it)."""
_WEIGHT_NAMES = ("fc.weight", "hidden_norm.weight", "norm.weight")
_DRAFT_VOCAB_NAMES = ("lm_head.weight", "d2t")
"""A pruned draft vocabulary's tensors, under the names vLLM and llama.cpp load."""


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
    signature = getattr(c, SIGNATURE_KEY, None)
    variant = variant_of(c)
    section = {"mask_token_id": model.mask_token_id, "target_layer_ids": list(model.target_layer_ids),
               "block_size": model.block_size, **variant.export_section(model)}
    return {
        "architectures": [variant.architecture],
        "auto_map": {"AutoModel": f"{variant.modeling_paths()[-1].stem}.{variant.architecture}"},
        "model_type": "qwen3",
        **variant.export_fields(model),
        "block_size": model.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": section,
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
        **({"draft_vocab_size": model.draft_vocab_size} if model.lm_head is not None else {}),
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
        **({SIGNATURE_KEY: signature} if signature else {}),
    }


def _draft_weights(model: DFlashDraftModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    prefixes = ("layers.", *variant_of(model.config).export_prefixes)
    names = _WEIGHT_NAMES + (_DRAFT_VOCAB_NAMES if model.lm_head is not None else ())
    unexpected = [k for k in state if not (k.startswith(prefixes) or k in names)]
    missing = [k for k in _WEIGHT_NAMES if k not in state]
    if unexpected or missing:
        raise ValueError(f"drafter state does not match the z-lab format: unexpected {unexpected}, "
                         f"missing {missing}")
    # d2t stays int64: the engines read it as token offsets.
    return {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
            for k, v in state.items()}


def export_drafter(model: DFlashDraftModel, out_dir: str | Path, *, target_config: PretrainedConfig | None = None,
                   dtype: torch.dtype = torch.bfloat16, target: dict[str, Any] | None = None,
                   card: Callable[[dict[str, Any], int], str] | None = None) -> Path:
    """Write ``config.json``, ``model.safetensors`` and ``dflash.py`` to ``out_dir`` atomically.

    ``target_config`` (checked for compatibility) gives ``num_target_layers``; without it the
    drafter config's own ``num_target_layers`` is used. ``target`` (:func:`target_record`) is
    recorded in ``config.json`` under ``dflash_trainer``; a drafter loaded from an export keeps
    the record it had. ``card(config, num_params)`` gives the text of a ``README.md`` model card.
    An existing ``out_dir`` is replaced only if it is empty or a previous drafter export
    (:class:`ConfigError` otherwise).
    """
    out = Path(out_dir)
    num_target_layers = getattr(model.config, "num_target_layers", None)
    if target_config is not None:
        check_compatible(model.config, target_config)
        num_target_layers = text_config(target_config).num_hidden_layers
    if num_target_layers is None:
        raise ValueError("export needs target_config or a drafter config with num_target_layers")
    check_export_destination(out, overwrite=True)
    config = export_config(model, num_target_layers=int(num_target_layers), dtype=dtype)
    if target is not None:
        config[SIGNATURE_KEY] = {**config.get(SIGNATURE_KEY, {}), "target": target}
    weights = _draft_weights(model, dtype)

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if card is not None:
            num_params = sum(t.numel() for k, t in weights.items() if t.is_floating_point())
            (tmp / CARD_FILE).write_text(card(config, num_params), encoding="utf-8")
        save_safetensors(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        for source in variant_of(model.config).modeling_paths():
            shutil.copyfile(source, tmp / source.name)

    write_dir_atomically(out, write, replace=True)
    return out


def target_record(name: str, folder: str | Path) -> dict[str, Any]:
    """What an export records of its target: ``name`` (``model.target`` as given: ``smollm2``, a
    hub id or a folder), the ``folder`` it was loaded from, the Hugging Face ``revision`` (the
    commit of a hub snapshot) and ``weights_sha256`` (:func:`~dflash_trainer.features.target_parts.weights_hash`),
    each None where unknown."""
    if not str(folder):
        return {"name": name, "folder": None, "revision": None, "weights_sha256": None}
    path = Path(folder).resolve()
    revision = path.name if path.parent.name == "snapshots" else None
    try:
        weights = weights_hash(path)
    except (UserError, OSError):
        weights = None  # no weight files there (a target served by an engine from elsewhere)
    return {"name": name, "folder": str(path), "revision": revision, "weights_sha256": weights}


def recorded_target(drafter_dir: str | Path) -> tuple[str, dict[str, Any]] | None:
    """(model.target to use, the record) of the target an export recorded, when it is available
    here: its name if that resolves (``smollm2``, a folder, a hub id in the local cache), else the
    folder it was loaded from. None for an export without a record; :class:`TargetError` when the
    recorded target is not available."""
    try:
        config = json.loads((Path(drafter_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None  # the loader names what is wrong with the folder
    record = (config.get(SIGNATURE_KEY) or {}).get("target") if isinstance(config, dict) else None
    if not isinstance(record, dict) or not record.get("name"):
        return None
    for candidate in (record["name"], record.get("folder")):
        if not candidate:
            continue
        try:
            resolve_target(str(candidate))
        except UserError:
            continue
        return str(candidate), record
    raise TargetError(f"--drafter {drafter_dir} was trained for the target {record['name']!r} (loaded from "
                      f"{record.get('folder')}), which is not available here; pass --target with that model's "
                      "folder or hub id")


def check_export_destination(out: Path, *, overwrite: bool, flag: str = "") -> None:
    """Refuse (:class:`ConfigError`) to export into a file, a folder holding anything but an
    earlier export, or an earlier export unless ``overwrite``; a new or empty folder is fine.
    ``flag`` (``"--out "``) prefixes the folder in the message."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"{flag}{out} is an existing file, not a folder; give the path of a new or "
                          "empty folder for the drafter export")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if not _is_export(out):
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise ConfigError(f"{flag}{out} is a folder that holds other files ({shown}), not a drafter "
                          "export; choose a new or empty folder (nothing was written)")
    if not overwrite:
        raise ConfigError(f"{flag}{out} holds a drafter export already; pass --overwrite to replace it, "
                          "or choose a new folder")


def _is_export(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    names = config.get("architectures") if isinstance(config, dict) else None
    return isinstance(names, list) and any(name in names for name in architectures())


def _weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    try:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            names = f.keys()  # a safetensors handle, not a dict: it has no __iter__
            return {k: tuple(f.get_slice(k).get_shape()) for k in names}
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path / 'model.safetensors'} is not a readable safetensors file "
                              f"({exc}); export the drafter again") from exc


def check_drafter_folder(path: str | Path) -> None:
    """Refuse (CheckpointError, one line) an exported drafter folder whose ``config.json`` is
    unreadable or does not describe the tensors of its ``model.safetensors``."""
    path = Path(path)
    missing = [n for n in ("config.json", "model.safetensors") if not (path / n).is_file()]
    if missing:
        raise CheckpointError(f"{path}: not an exported drafter (no {' or '.join(missing)}); "
                              "give the folder written by `dflash-trainer export` or train")
    try:
        config = DFlashDraftModel.config_class.from_pretrained(str(path))
        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in drafter_class(config)(config).state_dict().items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CheckpointError(f"{path / 'config.json'} is not a valid drafter config ({exc}); "
                              "restore the config.json written by export") from exc
    found = _weight_shapes(path)
    problems = [f"{k}: file {list(found[k])} vs config {list(expected[k])}"
                for k in sorted(expected.keys() & found.keys()) if found[k] != expected[k]]
    problems += [f"{k} missing from the file" for k in sorted(expected.keys() - found.keys())]
    problems += [f"{k} not in the config" for k in sorted(found.keys() - expected.keys())]
    if problems:
        more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
        raise CheckpointError(f"{path}: config.json does not match model.safetensors: "
                              f"{'; '.join(problems[:2])}{more}; restore the config.json written "
                              "by export, or export the checkpoint again")


Fix = str | Callable[[Variant], str]
"""What to do about a drafter of the wrong variant: a text, or one made from the variant found."""


def check_variant(config: PretrainedConfig, expected: str | Sequence[str], *, where: str, fix: Fix) -> None:
    """Refuse (:class:`CheckpointError`, one line) a drafter whose variant (by its
    ``architectures``) is not ``expected`` (a ``model.variant`` name, or several); ``where``
    names the folder or flag, ``fix`` says what to do."""
    names = [expected] if isinstance(expected, str) else list(expected)
    found = variant_of(config)
    if found.name not in names:
        wanted = " or ".join(get_variant(name).architecture for name in names)
        raise CheckpointError(f"{where} holds a {found.title} drafter (architectures {found.architecture}), "
                              f"but a {titles(names)} one ({wanted}) is expected here; "
                              f"{fix(found) if callable(fix) else fix}")


def load_drafter(path: str | Path, *, dtype: torch.dtype = torch.float32,
                 variant: str | Sequence[str] | None = None, fix: Fix = "") -> DFlashDraftModel:
    """Load an exported drafter folder with the in-project class of its variant (a
    :class:`DFlashDraftModel` or a subclass); every weight must be present and match
    ``config.json`` (checked first: :func:`check_drafter_folder`). With ``variant`` (a name or
    several), a drafter of another variant is refused (:func:`check_variant`, ``fix`` saying
    what to do)."""
    check_drafter_folder(path)
    config = read_drafter_config(path)
    if variant is not None:
        names = [variant] if isinstance(variant, str) else list(variant)
        check_variant(config, names, where=str(path), fix=fix or f"give a {titles(names)} export")
    try:
        model, info = drafter_class(config).from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa",
                                          output_loading_info=True)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: the drafter weights do not load ({first_line(exc)}); the export "
                              "is damaged: export the checkpoint again") from exc
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise CheckpointError(f"{path}: drafter weights do not match its config.json: {problems}")
    return model


def check_fits_target(drafter_config: PretrainedConfig, target_config: PretrainedConfig, tokenizer: Any,
                      *, drafter: str, target: str, fix: str,
                      error: type[CheckpointError] = CheckpointError) -> None:
    """Refuse (``error``, one line) a saved drafter that does not fit a target:
    :func:`~dflash_trainer.model.drafter.check_compatible` with the target's tokenizer, the
    message naming the drafter (``drafter``: a flag and folder), the target and ``fix``."""
    try:
        check_compatible(drafter_config, target_config, tokenizer=tokenizer)
    except ValueError as exc:
        raise error(f"{drafter} does not fit the target {target}: {exc}; {fix}") from exc


def read_drafter_config(path: str | Path) -> PretrainedConfig:
    """The ``config.json`` of an exported drafter folder, or :class:`CheckpointError`."""
    path = Path(path)
    try:
        return DFlashDraftModel.config_class.from_pretrained(str(path))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"{path / 'config.json'} is not a valid drafter config ({first_line(exc)}); "
                              "restore the config.json written by export") from exc


def load_checkpoint_drafter(path: str | Path, *, dtype: torch.dtype = torch.float32,
                            variant: str | Sequence[str] | None = None, fix: Fix = "") -> DFlashDraftModel:
    """A drafter from a training checkpoint ``step-N/`` or its ``drafter/`` folder (every file
    of the checkpoint checked against its manifest first) or from an exported drafter folder;
    ``variant`` and ``fix`` as in :func:`load_drafter`."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such folder; give a checkpoint (RUN_DIR/checkpoints/"
                              "step-N) or an exported drafter folder")
    if (path / MANIFEST).is_file():
        validate_checkpoint(path)
        return load_drafter(path / "drafter", dtype=dtype, variant=variant, fix=fix)
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        if (path.parent / MANIFEST).is_file():  # step-N/drafter: its checkpoint's manifest covers it
            validate_checkpoint(path.parent)
        return load_drafter(path, dtype=dtype, variant=variant, fix=fix)
    raise CheckpointError(f"{path}: neither a training checkpoint (no {MANIFEST}) nor an exported "
                          "drafter (no config.json + model.safetensors); give a step-N folder of "
                          "RUN_DIR/checkpoints")


def _run_of(checkpoint: Path) -> RunFacts | None:
    """The facts of the run a checkpoint (``RUN/checkpoints/step-N``, or its ``drafter/``) or a
    run's exported ``drafter/`` belongs to, for the model card; None when it is neither."""
    for folder in (checkpoint, checkpoint.parent):
        if (folder / MANIFEST).is_file() and folder.name.startswith("step-"):
            step = folder.name.removeprefix("step-")
            config = None
            try:
                config = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
            except (OSError, yaml.YAMLError):
                pass
            return run_facts(folder.parent.parent, step=int(step) if step.isdigit() else None, config=config)
    if (checkpoint.parent / "config.yaml").is_file() and (checkpoint.parent / "metrics.jsonl").is_file():
        return run_facts(checkpoint.parent, step=None)
    return None


def main(cfg: Config, args: argparse.Namespace) -> int:
    """``dflash-trainer export --checkpoint CKPT --out DIR [--overwrite]``."""
    del cfg  # the drafter config inside the checkpoint is authoritative
    out, checkpoint = Path(args.out), Path(args.checkpoint)
    if os.path.lexists(checkpoint):
        check_input(checkpoint, what="--checkpoint", kind="folder", error=CheckpointError)
    # Checked before the checkpoint is read: a wrong --out costs nothing and writes nothing.
    check_export_destination(out, overwrite=args.overwrite, flag="--out ")
    root = next((c for c in (checkpoint, checkpoint.parent) if (c / MANIFEST).is_file()), None)
    if root is not None and (out.resolve() == root.resolve() or root.resolve() in out.resolve().parents):
        raise ConfigError(f"--out {out} is inside the checkpoint {root}; its files are covered by the "
                          "checkpoint's manifest, so choose a folder outside it")
    model = load_checkpoint_drafter(checkpoint)
    run = _run_of(checkpoint)
    out = export_drafter(model, out, card=lambda config, num_params: model_card(config, num_params=num_params, run=run))
    num_params = sum(p.numel() for p in model.parameters())
    print(f"exported drafter ({variant_of(model.config).title}, {format_count(num_params)} parameters, "
          f"block {model.block_size}, "
          f"target layers {model.target_layer_ids}, mask id {model.mask_token_id}) to {out}")
    return 0
