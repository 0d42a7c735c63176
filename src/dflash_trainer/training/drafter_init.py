"""A fresh drafter's first weights: ``model.init_from`` (a warm start from an exported or
checkpointed drafter) or ``model.drafter_init`` (copied from the target's layers).

Here rather than in :mod:`dflash_trainer.model.drafter` because a warm start reads checkpoints
and exports (:mod:`dflash_trainer.training.export`), which build drafters themselves.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from dflash_trainer.config import ModelConfig
from dflash_trainer.core.errors import CheckpointError
from dflash_trainer.training.export import load_checkpoint_drafter
from dflash_trainer.model.drafter import check_compatible, init_drafter_from_target, init_from_last_layers
from dflash_trainer.model.modeling.dflash import DFlashDraftModel
from dflash_trainer.model.variants import VARIANTS, Variant, titles, variant_of

__all__ = ["initialise_drafter", "warm_start"]

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
