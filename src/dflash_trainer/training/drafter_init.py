"""A fresh drafter's first weights: ``model.init_from`` (a warm start from an exported or
checkpointed drafter) or ``model.drafter_init`` (copied from the target's layers).

Here rather than in :mod:`dflash_trainer.model.drafter` because a warm start reads checkpoints
and exports (:mod:`dflash_trainer.training.export`), which build drafters themselves.

A run without a config file (:func:`fit_drafter_defaults`) gets the drafter the evidence in
docs/quality.md favours, sized to the target: ``model.drafter_init: target`` (twice the slot-1
agreement of a random init after 150 steps) with as many layers as that init can copy after the
reference rule's last tapped layer, at most the recipe's 5 (:data:`RECIPE_LAYERS`): 2 on a target
of 5 or more layers (the rule taps layers 1 and L-3, leaving L-2 and L-1 to copy), 1 on a smaller
one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from dflash_trainer.config import Config, ModelConfig
from dflash_trainer.core.assets import resolve_target
from dflash_trainer.core.errors import CheckpointError, UserError
from dflash_trainer.training.export import load_checkpoint_drafter
from dflash_trainer.model.drafter import (check_compatible, default_target_layer_ids, init_drafter_from_target,
                                         init_from_last_layers)
from dflash_trainer.model.modeling.dflash import DFlashDraftModel
from dflash_trainer.model.variants import VARIANTS, Variant, titles, variant_of

__all__ = ["RECIPE_LAYERS", "drafter_layers_for", "fit_drafter_defaults", "initialise_drafter", "warm_start"]

RECIPE_LAYERS = 5
"""Drafter layers of the paper recipe (configs/qwen3-8b.yaml, configs/llama-3.1-8b.yaml)."""

log = logging.getLogger(__name__)


@torch.no_grad()
def warm_start(drafter: DFlashDraftModel, path: str, target_config: PretrainedConfig, *,
               tokenizer: Any = None) -> list[str]:
    """``model.init_from``: copy the weights of the drafter exported or checkpointed at ``path``
    into ``drafter``; the names copied.

    The drafter's variant says which variants may start it
    (:attr:`~dflash_trainer.model.variants.Variant.warm_starts_from`): a variant that adds
    modules to the backbone takes a plain DFlash drafter's backbone, its own modules keeping
    their identity initialisation. Raises :class:`CheckpointError` (one line) for the wrong
    variant, another target (vocabulary, hidden size, and given the target's ``tokenizer`` its
    chat template and special ids), other target layers or other layer sizes.
    """
    where = f"model.init_from={path}"
    accepted = variant_of(drafter.config).warm_starts_from

    def fix(found: Variant) -> str:
        takers = [v.name for v in VARIANTS.values() if found.name in v.warm_starts_from]
        return f"warm-start it with model.variant={' or '.join(takers)}, or give a {titles(accepted)} drafter"

    source = load_checkpoint_drafter(path, variant=accepted, fix=fix)
    try:
        check_compatible(source.config, target_config, tokenizer=tokenizer)
    except ValueError as exc:
        raise CheckpointError(f"{where} does not fit the target: {exc}; give a drafter trained for it") from exc
    if list(source.target_layer_ids) != list(drafter.target_layer_ids):
        raise CheckpointError(f"{where} reads target layers {list(source.target_layer_ids)}, this drafter "
                              f"{list(drafter.target_layer_ids)} (model.target_layer_ids); set them equal")
    # A drafter of the whole vocabulary gives a pruned one its backbone (the pruned head stays the
    # target's rows); a pruned source keeps its own tokens, so the sizes must agree.
    if source.lm_head is not None and source.draft_vocab_size != drafter.draft_vocab_size:
        raise CheckpointError(f"{where} drafts from {source.draft_vocab_size} tokens, this drafter from "
                              f"{drafter.draft_vocab_size} (model.draft_vocab_size); set "
                              f"model.draft_vocab_size={source.draft_vocab_size}")
    own = drafter.state_dict()
    mismatched = [f"{k} {list(v.shape)} vs {list(own[k].shape) if k in own else 'absent'}"
                  for k, v in source.state_dict().items() if k not in own or own[k].shape != v.shape]
    if mismatched:
        more = f" (and {len(mismatched) - 2} more)" if len(mismatched) > 2 else ""
        raise CheckpointError(f"{where} does not match this drafter's shapes: {'; '.join(mismatched[:2])}{more}; "
                              "set model.num_layers and the layer sizes to the source's")
    copied = []
    for name, value in source.state_dict().items():
        own[name].copy_(value.to(own[name].dtype))
        copied.append(name)
    return copied


def initialise_drafter(drafter: DFlashDraftModel, target_model: nn.Module, model_cfg: ModelConfig, *,
                       tokenizer: Any = None) -> list[str]:
    """Apply ``model.init_from`` or ``model.drafter_init`` to a fresh drafter; the names of the
    parameters copied (empty for a random init). ``tokenizer``: the target's, checked against
    the one a warm-start source recorded."""
    if model_cfg.init_from is not None:
        copied = warm_start(drafter, model_cfg.init_from, target_model.config, tokenizer=tokenizer)
        log.info("warm-started the drafter from %s: %d tensors", model_cfg.init_from, len(copied))
        return copied
    if model_cfg.drafter_init == "target":
        copied = init_drafter_from_target(drafter, target_model)
    elif model_cfg.drafter_init == "last_layers":
        copied = init_from_last_layers(drafter, target_model)
    else:
        return []
    log.info("initialised the drafter from the target: %s", ", ".join(copied))
    return copied


def _target_layers(cfg: Config) -> int | None:
    try:
        config = json.loads((resolve_target(cfg.model.target) / "config.json").read_text(encoding="utf-8"))
    except (UserError, OSError, ValueError):
        return None  # the command that loads the target names why
    config = config.get("text_config") or config
    layers = config.get("num_hidden_layers")
    return layers if isinstance(layers, int) and layers > 0 else None


def drafter_layers_for(num_target_layers: int) -> int:
    """The most drafter layers, at most :data:`RECIPE_LAYERS`, that ``drafter_init: target`` can
    copy after the last layer the reference rule taps for them (each tapped once)."""
    for n in range(RECIPE_LAYERS, 1, -1):
        taps = default_target_layer_ids(num_target_layers, n)
        if len(set(taps)) == n and max(taps) + n < num_target_layers:
            return n
    return 1


def fit_drafter_defaults(cfg: Config, *, given: set[str], log: Callable[[str], None]) -> Config:
    """``cfg`` of a run without a config file with the drafter shape and init of the module's
    docstring where the command line left them unset; one ``log`` line."""
    model = cfg.model
    if given & {"model.num_layers", "model.drafter_init", "model.init_from", "model.target_layer_ids"}:
        return cfg
    layers = _target_layers(cfg)
    if layers is None or layers < 2:
        return cfg
    n = drafter_layers_for(layers)
    taps = default_target_layer_ids(layers, n)
    if max(taps) + n >= layers:  # a 2- or 3-layer target: nothing after the tap to copy
        return cfg
    copies = list(range(max(taps) + 1, max(taps) + 1 + n))
    log(f"drafter: {n} layer(s) starting as copies of the target's layers {copies} over its layers {taps}"
        f" (model.num_layers={n}, model.drafter_init=target: the default without a config "
        "file, sized to this target; see docs/quality.md)")
    return dataclasses.replace(cfg, model=dataclasses.replace(model, num_layers=n, drafter_init="target"))
