"""The DFlash training objective: one micro-batch -> loss and metrics.

:class:`DFlashObjective` owns the drafter and borrows the target's frozen embedding and LM
head. The train loop calls ``objective(batch, target, step)`` and backpropagates the loss sum
divided by the weight summed over every rank.

A drafter variant adds its own terms (:class:`~dflash_trainer.model.variants.LossTerms`): the
objective hands them the backbone pass's slot states, labels and (if they ask) each slot's top-k
candidates from the loss chunks, and the sums carry their named losses and metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from dflash_trainer.config import Config, TrainingConfig, default_gamma
from dflash_trainer.model.batch import Batch
from dflash_trainer.model.blocks import (build_block_inputs, dense_block_mask, flex_block_mask,
                                         label_positions, labels_and_weights, position_ids)
from dflash_trainer.model.loss import LossSums, MetricSpec, backbone_loss, slot_rows
from dflash_trainer.model.modeling.dflash import BlockLayout, DFlashDraftModel
from dflash_trainer.model.shapes import ShapeSizes, pad_blocks, shape_sizes
from dflash_trainer.model.target import TargetOutputs
from dflash_trainer.model.variants import LossTerms, SlotInputs, variant_of

__all__ = ["DFlashObjective", "LABEL_IN_VOCAB", "noise_scale"]

LABEL_IN_VOCAB = MetricSpec("train/label_in_vocab", "label_in_vocab", "count")
"""With a pruned draft vocabulary: the share of supervised labels that are in it."""


def noise_scale(step: int, noise_std: float, warmup_steps: int) -> float:
    """Hidden-state noise std at ``step``: ramps linearly from 0 to ``noise_std`` over the warmup."""
    if warmup_steps <= 0:
        return noise_std
    return noise_std * min(1.0, step / warmup_steps)


class DFlashObjective(nn.Module):
    """Drafter + frozen target embedding/LM head -> decay-weighted block loss.

    The embedding and head tensors are kept as plain attributes (not parameters or buffers),
    so they are shared with the target, never copied, and stay out of ``state_dict()`` and
    out of DDP/FSDP parameter sets. For DDP, wrap the objective itself (its only parameters
    are the drafter's), so ``self.drafter`` stays the plain module.

    ``shape_sizes`` pads the drafter's context width and anchor count up to a fixed set of
    sizes (:mod:`dflash_trainer.model.shapes`) when ``round_shapes`` is ``always``, or ``auto``
    and the attention is FlexAttention (compiled, so specialised on shapes); the loss is the
    same either way.

    ``terms``: the variant's training terms (:meth:`~dflash_trainer.model.variants.Variant.loss_terms`);
    by default those of the drafter's variant under the default ``training`` options.
    """

    def __init__(self, drafter: DFlashDraftModel, embed_weight: torch.Tensor, head_weight: torch.Tensor, *,
                 gamma: float | None, loss_chunk_size: int, loss_slots: int | None = None,
                 labels: Literal["data", "target_greedy", "kl"] = "data",
                 attention: Literal["auto", "sdpa", "blockwise", "flex"] = "auto",
                 noise_std: float = 0.0, noise_warmup_steps: int = 0, terms: LossTerms | None = None,
                 shape_sizes: ShapeSizes | None = None,
                 round_shapes: Literal["auto", "always", "never"] = "auto") -> None:
        super().__init__()
        if embed_weight.requires_grad or head_weight.requires_grad:
            raise ValueError("the target embedding and LM head must be frozen (requires_grad=False)")
        if drafter.mask_token_id is None:
            raise ValueError("the drafter config has no dflash_config.mask_token_id")
        self.drafter = drafter
        self.embed_weight = embed_weight
        self.head_weight = head_weight
        self.block_size = drafter.block_size
        self.mask_token_id = int(drafter.mask_token_id)
        self.gamma = gamma
        self.loss_chunk_size = loss_chunk_size
        if loss_slots is not None and not 1 <= loss_slots < self.block_size:
            raise ValueError(f"loss_slots must be in 1..{self.block_size - 1}, got {loss_slots}")
        self.loss_slots = loss_slots or self.block_size - 1
        self.labels = labels
        self.attention = attention
        self.noise_std = noise_std
        self.noise_warmup_steps = noise_warmup_steps
        self.shape_sizes = shape_sizes
        self.round_shapes = round_shapes
        # A plain attribute, not a submodule: the modules it uses are the drafter's own.
        self.terms = terms if terms is not None else variant_of(drafter.config).loss_terms(drafter, TrainingConfig())

    @classmethod
    def from_config(cls, drafter: DFlashDraftModel, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                    cfg: Config) -> DFlashObjective:
        """Objective with ``training.*`` and ``model.attention`` settings from the run config."""
        t = cfg.training
        gamma = t.gamma if t.gamma is not None else default_gamma(drafter.block_size)
        return cls(drafter, embed_weight, head_weight, gamma=gamma, loss_chunk_size=t.loss_chunk_size,
                   loss_slots=t.loss_slots,
                   labels=t.labels, attention=cfg.model.attention, noise_std=t.noise_std,
                   noise_warmup_steps=t.noise_warmup_steps,
                   terms=variant_of(drafter.config).loss_terms(drafter, t),
                   shape_sizes=shape_sizes(max_width=cfg.data.max_length,
                                           num_anchors=t.num_anchors,
                                           block_size=drafter.block_size),
                   round_shapes=cfg.pipeline.round_shapes)

    def noise_scale(self, step: int) -> float:
        """Std of the Gaussian noise added to the target features at ``step``."""
        return noise_scale(step, self.noise_std, self.noise_warmup_steps)

    def _use_flex(self, device: torch.device) -> bool:
        if self.attention == "auto":
            return device.type == "cuda"
        if self.attention == "flex" and device.type != "cuda" and torch.is_grad_enabled():
            raise ValueError("model.attention=flex needs CUDA for training (FlexAttention has no CPU "
                             "backward); use model.attention=sdpa or auto")
        return self.attention == "flex"

    def rounds_shapes(self, device: torch.device) -> bool:
        """Whether batches on ``device`` are padded up to :attr:`shape_sizes`."""
        if self.shape_sizes is None or self.round_shapes == "never":
            return False
        return self.round_shapes == "always" or self._use_flex(device)

    def forward(self, batch: Batch, target: TargetOutputs, step: int) -> LossSums:
        """Loss and metric sums for one micro-batch.

        Args:
            batch: the micro-batch on the device (right-padded ``input_ids``, ``loss_mask``,
                ``seq_lens``, ``anchors``, ``keep``).
            target: the target's outputs for it: ``features`` ``[B, S, K*H]``; with
                ``labels="target_greedy"`` also ``target_labels``, with ``labels="kl"`` also
                ``final_hidden`` (see :class:`~dflash_trainer.model.target.TargetOutputs`).
            step: optimizer step, for the noise ramp.
        """
        input_ids, anchors, keep = batch.input_ids, batch.anchors, batch.keep
        features = target.features
        context_len = input_ids.shape[1]
        block = self.block_size
        label_ids = input_ids
        if self.labels == "target_greedy":
            label_ids = _required(target.target_labels, "target_labels")
        slots = self.loss_slots
        labels, weights = labels_and_weights(label_ids, batch.loss_mask, anchors, keep, block, self.gamma,
                                             batch.seq_lens, num_slots=slots)
        dtype = self.drafter.fc.weight.dtype
        context = features.to(dtype)
        scale = self.noise_scale(step)
        if scale > 0:
            context = context + torch.randn_like(context) * scale
        # The drafter's blocks and context, padded (after the noise: the same draws either way).
        block_anchors, block_keep = anchors, keep
        if self.rounds_shapes(features.device):
            assert self.shape_sizes is not None
            padded = pad_blocks(self.shape_sizes, anchors, keep, context)
            block_anchors, block_keep, context = padded.anchors, padded.keep, padded.context
            context_len = context.shape[1]
        noise_ids, block_positions = build_block_inputs(input_ids, block_anchors, block_keep,
                                                        self.mask_token_id, block)
        mask: Any
        if self._use_flex(features.device):
            mask = flex_block_mask(block_anchors, block_keep, context_len, block)
        elif self.attention == "sdpa":
            mask = dense_block_mask(block_anchors, block_keep, context_len, block)
        else:
            mask = BlockLayout(block_anchors, block_keep, context_len, block)
        hidden = self.drafter(position_ids(block_positions, context_len),
                              F.embedding(noise_ids, self.embed_weight).to(dtype), context,
                              attention_mask=mask, output_slots=slots)
        # The padded blocks come last: the first N blocks' rows are the real ones.
        hidden = hidden[:, :anchors.shape[1] * slots]
        soft_hidden = None
        if self.labels == "kl":
            final_hidden = _required(target.final_hidden, "final_hidden")
            # The target's distribution for slot k (position a + k) comes from position a + k - 1.
            prev = label_positions(anchors, slots, final_hidden.shape[1], shift=-1).flatten(1)
            soft_hidden = final_hidden.gather(1, prev[..., None].expand(-1, -1, final_hidden.shape[-1]))
            soft_hidden = soft_hidden.view(*labels.shape, -1)
        target_labels = labels
        head_weight = self.drafter.output_head(self.head_weight)
        supervised = weights > 0
        counts: dict[str, torch.Tensor] = {}
        metrics: tuple[MetricSpec, ...] = ()
        if self.drafter.lm_head is not None:
            # A pruned draft vocabulary: the loss runs over its rows. A label outside it cannot
            # be drafted: out of the loss, still a supervised slot (a miss in acc and tau_sim).
            labels, in_vocab = self.drafter.to_draft_ids(labels)
            if soft_hidden is None:
                weights = weights * in_vocab
            counts["label_in_vocab"] = (in_vocab & supervised).sum()
            metrics = (LABEL_IN_VOCAB,)
        backbone = backbone_loss(hidden, head_weight, labels, weights, keep, chunk_size=self.loss_chunk_size,
                                 soft_hidden=soft_hidden, top_k=0 if self.terms is None else self.terms.top_k,
                                 supervised=supervised)
        sums = dataclasses.replace(backbone.sums, counts=counts, metrics=backbone.sums.metrics + metrics)
        if self.terms is None:
            return sums
        anchor_ids = input_ids.gather(1, anchors)
        previous = torch.cat([anchor_ids[..., None], target_labels[..., :-1]], dim=-1)
        extra = self.terms(SlotInputs(
            hidden=slot_rows(hidden, anchors.shape[1], slots), head_weight=head_weight, labels=labels,
            previous_ids=previous, weights=weights, keep=keep, anchor_ids=anchor_ids, hits=backbone.hits,
            candidates=backbone.candidates, soft_hidden=soft_hidden, chunk_size=self.loss_chunk_size))
        return dataclasses.replace(sums, terms=dict(extra.losses), term_weights=dict(self.terms.weights),
                                   counts={**counts, **extra.counts}, metrics=sums.metrics + self.terms.metrics)


def _required(value: torch.Tensor | None, name: str) -> torch.Tensor:
    if value is None:
        raise ValueError(f"the target outputs have no {name}; it is needed for training.labels and "
                         f"comes from FeatureExtractor(labels=...) (TargetOutputs)")
    return value
