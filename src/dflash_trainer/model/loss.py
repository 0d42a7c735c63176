"""Chunked LM-head cross-entropy with decay weights, and the DFlash training metrics.

The target's LM head is applied to ``loss_chunk_size`` slots at a time inside one autograd
Function that also computes the gradient with respect to the hidden states in the same pass
(the head is frozen, so that is the only gradient). Neither forward nor backward ever holds
more than one chunk of ``[slots, vocab]`` logits, and the head matmul runs twice per slot
(logits, then grad), the same as an unchunked forward + backward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

__all__ = ["BACKBONE_METRICS", "BackbonePass", "LossSums", "MetricSpec", "backbone_loss", "chunked_head_loss",
           "dflash_loss", "reference_head_loss", "slot_rows"]


def _chunk_terms(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                 soft_hidden: torch.Tensor | None, need_grad: bool,
                 top: tuple[torch.Tensor, torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-slot loss, top-1 correctness and ``w * d(loss)/d(logits)`` (if needed) for one chunk;
    with ``top`` (value and id tensors ``[chunk, k]``), also the chunk's top-k logits."""
    logits = hidden.to(head_weight.dtype) @ head_weight.T
    if top is not None:
        values, ids = logits.topk(top[0].shape[1], dim=-1)
        top[0].copy_(values)
        top[1].copy_(ids)
    if soft_hidden is None:
        correct = logits.argmax(dim=-1) == labels
        # Fused upcast + log_softmax, then w * softmax in place (log 0 = -inf gives exact zeros).
        log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        del logits
        loss = -log_probs.gather(1, labels[:, None])[:, 0]
        if not need_grad:
            return loss, correct, None
        grad = log_probs.add_(weights.log()[:, None]).exp_()
        grad[torch.arange(labels.shape[0], device=labels.device), labels] -= weights
        return loss, correct, grad
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    target_logits = (soft_hidden.to(head_weight.dtype) @ head_weight.T).float()
    correct = logits.argmax(dim=-1) == target_logits.argmax(dim=-1)
    target_log_probs = torch.log_softmax(target_logits, dim=-1)
    target_probs = target_log_probs.exp()
    loss = (target_probs * (target_log_probs - logits)).sum(dim=-1) + lse  # KL(target || drafter)
    if not need_grad:
        return loss, correct, None
    grad = logits.sub_(lse[:, None]).exp_().sub_(target_probs).mul_(weights[:, None])
    return loss, correct, grad


class _ChunkedHeadLoss(torch.autograd.Function):
    """``sum_i w_i * loss_i`` over slots, LM head and loss computed chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                weights: torch.Tensor, soft_hidden: torch.Tensor | None,
                chunk_size: int, top_k: int) -> tuple[torch.Tensor, ...]:
        need_grad = ctx.needs_input_grad[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        top_values = torch.empty(hidden.shape[0], top_k, dtype=head_weight.dtype, device=hidden.device)
        top_ids = torch.empty(hidden.shape[0], top_k, dtype=torch.long, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            w = weights[start:end]
            soft = None if soft_hidden is None else soft_hidden[start:end]
            top = (top_values[start:end], top_ids[start:end]) if top_k else None
            loss, hits, grad_logits = _chunk_terms(hidden[start:end], head_weight, labels[start:end], w,
                                                   soft, need_grad, top)
            total += (w * loss).sum()
            correct[start:end] = hits
            if need_grad:
                grad_hidden[start:end] = (grad_logits.to(head_weight.dtype) @ head_weight).to(hidden.dtype)
        ctx.mark_non_differentiable(correct, top_values, top_ids)
        ctx.save_for_backward(grad_hidden)
        return total, correct, top_values, top_ids

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, *_unused: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None, None, None


def chunked_head_loss(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                      weights: torch.Tensor, chunk_size: int,
                      soft_hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_i w_i * loss_i, correct [M] bool)`` for ``[M, H]`` slots under a frozen ``[V, H]`` head.

    ``loss_i`` is cross-entropy against ``labels``, or with ``soft_hidden`` (target final hidden
    states of the same slots) KL(target || drafter) under the same head; ``correct`` compares
    the drafter's argmax with the label (or the target's argmax). Only ``hidden`` gets a gradient.
    """
    if head_weight.requires_grad:
        raise ValueError("the target LM head must be frozen (requires_grad=False): the chunked loss "
                         "computes no gradient for it")
    if chunk_size < 1:
        raise ValueError(f"training.loss_chunk_size must be >= 1, got {chunk_size}")
    total, correct, _, _ = _ChunkedHeadLoss.apply(hidden, head_weight, labels, weights.float(), soft_hidden,
                                                  chunk_size, 0)
    return total, correct


def reference_head_loss(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                        weights: torch.Tensor,
                        soft_hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unchunked autograd version of :func:`chunked_head_loss` (tests and the memory benchmark)."""
    logits = (hidden.to(head_weight.dtype) @ head_weight.T).float()
    if soft_hidden is None:
        loss = F.cross_entropy(logits, labels, reduction="none")
        correct = logits.argmax(dim=-1) == labels
    else:
        target_logits = (soft_hidden.to(head_weight.dtype) @ head_weight.T).float()
        target_log_probs = torch.log_softmax(target_logits, dim=-1)
        loss = (target_log_probs.exp() * (target_log_probs - torch.log_softmax(logits, -1))).sum(-1)
        correct = logits.argmax(dim=-1) == target_logits.argmax(dim=-1)
    return (weights.float() * loss).sum(), correct


@dataclass(frozen=True)
class MetricSpec:
    """One logged training metric: the ratio of two window sums, named as in
    :meth:`LossSums.count_sums` / :attr:`LossSums.terms` (``loss`` and ``weight`` included).

    Sums of one value give the metric ``name``; sums with one value per block slot (``[K]``)
    give ``name`` with its ``{k}`` field set to 1 .. K (``train/acc_pos/{k}``: the name in the
    source is the name in the README's glossary).
    """

    name: str
    """The metric's name, ``train/...``."""
    numerator: str
    """The sum divided."""
    denominator: str
    """The sum it is divided by (a ratio over every rank's sums, 0 where it is 0)."""


BACKBONE_METRICS = (
    MetricSpec("train/loss", "loss", "weight"),
    MetricSpec("train/acc", "correct", "count"),
    MetricSpec("train/tau_sim", "accepted", "blocks"),
    MetricSpec("train/acc_pos/{k}", "correct_per_slot", "count_per_slot"),
)
"""The metrics every drafter logs; a variant's come after them (:attr:`LossSums.metrics`)."""


@dataclass(frozen=True, kw_only=True)
class LossSums:
    """One micro-batch's loss and metric sums, on the device (no host sync).

    Sums, not means, so that micro-batches and ranks add up: the train loop divides
    :meth:`objective` by the weight summed over every rank, once. The logged metrics are
    ratios of these sums, as :attr:`metrics` declares: ``train/loss`` = loss / weight,
    ``train/acc`` = correct / count, ``train/acc_pos/{k}`` = correct_per_slot / count_per_slot,
    ``train/tau_sim`` = accepted / blocks, and those of the drafter's variant over its own named
    :attr:`terms` and :attr:`counts`.
    """

    loss: torch.Tensor
    """``sum_i w_i * loss_i`` over the supervised slots (differentiable)."""
    weight: torch.Tensor
    """``sum_i w_i``."""
    correct: torch.Tensor
    """Supervised slots whose top-1 prediction is the label."""
    count: torch.Tensor
    """Supervised slots (weight > 0)."""
    correct_per_slot: torch.Tensor
    """``[K]`` correct per block slot 1..K."""
    count_per_slot: torch.Tensor
    """``[K]`` supervised per block slot 1..K."""
    accepted: torch.Tensor
    """Sum over kept blocks of 1 + the number of leading correct supervised slots."""
    blocks: torch.Tensor
    """Kept (real) blocks."""
    terms: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """The variant's own loss sums by name (differentiable; :meth:`objective` adds each, times
    its :attr:`term_weights` entry, to :attr:`loss`)."""
    term_weights: Mapping[str, float] = field(default_factory=dict)
    """The factor of each of :attr:`terms` in :meth:`objective`."""
    counts: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """The variant's own metric sums by name (no gradient): one value, or one per block slot."""
    metrics: tuple[MetricSpec, ...] = BACKBONE_METRICS
    """How the sums are logged: :data:`BACKBONE_METRICS`, then the variant's."""

    def __post_init__(self) -> None:
        # Windows add sums up by name: a variant's name equal to another sum's would merge them.
        names = [*LossSums.backbone_shapes(0), *self.terms, *self.counts]
        if len(names) != len(set(names)):
            raise ValueError(f"a variant's sums {sorted(self.terms)} + {sorted(self.counts)} reuse a name "
                             f"of another sum: {sorted({n for n in names if names.count(n) > 1})}")

    def mean_loss(self) -> torch.Tensor:
        """``loss / weight``: the micro-batch's own weighted mean (0 when nothing is supervised)."""
        return self.loss / self.weight.clamp_min(1e-6)

    def objective(self) -> torch.Tensor:
        """What training minimises (before the division by the weight): :attr:`loss`, plus each
        of the variant's :attr:`terms` times its weight."""
        total = self.loss
        for name, value in self.terms.items():
            total = total + self.term_weights[name] * value
        return total

    def count_sums(self) -> dict[str, torch.Tensor]:
        """Every metric sum that is not a loss, by name: the backbone's and the variant's."""
        return {"correct": self.correct, "count": self.count, "accepted": self.accepted, "blocks": self.blocks,
                "correct_per_slot": self.correct_per_slot, "count_per_slot": self.count_per_slot, **self.counts}

    @staticmethod
    def backbone_shapes(slots: int) -> dict[str, tuple[int, ...]]:
        """The shape of each backbone sum (``loss``, ``weight`` and :meth:`count_sums` without
        a variant's) for ``slots`` supervised block slots: what a window starts from."""
        return {"loss": (), "weight": (), "correct": (), "count": (), "accepted": (), "blocks": (),
                "correct_per_slot": (slots,), "count_per_slot": (slots,)}


@dataclass(frozen=True, kw_only=True)
class BackbonePass:
    """The backbone's loss pass over N blocks of K supervised slots: its sums, and what a
    variant's terms may read of it (no gradient)."""

    sums: LossSums
    hits: torch.Tensor
    """``[B, N, K]`` supervised slots whose top-1 prediction is the label."""
    candidates: tuple[torch.Tensor, torch.Tensor] | None
    """With ``top_k=k``: each slot's top-k logits and their token ids ``[B, N, K, k]``, taken
    from the loss chunks already in memory."""


def slot_rows(block_hidden: torch.Tensor, num: int, slots: int) -> torch.Tensor:
    """``[B, N, K, H]``: the rows of block slots 1..K in ``[B, N*Bk, H]`` (whole blocks) or
    ``[B, N*K, H]`` (the drafter's ``output_slots=K``; since K < Bk, the row count tells)."""
    batch = block_hidden.shape[0]
    rows = block_hidden.shape[1] // num
    first = 0 if rows == slots else 1
    return block_hidden.view(batch, num, rows, -1)[:, :, first:first + slots]


def dflash_loss(block_hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                weights: torch.Tensor, keep: torch.Tensor, *, chunk_size: int,
                soft_hidden: torch.Tensor | None = None) -> LossSums:
    """Decay-weighted loss over block slots 1..K and the metric sums of the same pass: the
    sums of :func:`backbone_loss`."""
    return backbone_loss(block_hidden, head_weight, labels, weights, keep, chunk_size=chunk_size,
                         soft_hidden=soft_hidden).sums


def backbone_loss(block_hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                  weights: torch.Tensor, keep: torch.Tensor, *, chunk_size: int,
                  soft_hidden: torch.Tensor | None = None, top_k: int = 0,
                  supervised: torch.Tensor | None = None) -> BackbonePass:
    """Decay-weighted loss over block slots 1..K (K <= B-1) and the metric sums of the same pass.

    Args:
        block_hidden: ``[B, N*Bk, H]`` drafter output for N blocks of Bk slots, or
            ``[B, N*K, H]`` for slots 1..K only (the drafter's ``output_slots=K``).
        head_weight: frozen target LM head ``[V, H]``.
        labels, weights: ``[B, N, K]`` for slots 1..K, from
            :func:`~dflash_trainer.model.blocks.labels_and_weights` (K = Bk-1, or fewer to
            supervise only the first slots: the LM head then runs on those slots only).
        keep: ``[B, N]`` real (True) or padding blocks.
        chunk_size: slots per LM-head chunk.
        soft_hidden: ``[B, N, K, H]`` target final hidden states at positions ``a + k - 1``
            for KL distillation; None for hard labels.
        top_k: also return each slot's top-k logits (:attr:`BackbonePass.candidates`).
        supervised: ``[B, N, K]`` the slots the metrics count, when they are more than those
            with weight > 0 (a label outside a pruned draft vocabulary: counted, never a hit).

    Returns:
        :class:`BackbonePass`; the top-1 (and top-k) predictions come from the loss chunks
        already in memory.
    """
    batch, num, slots = labels.shape
    hidden = slot_rows(block_hidden, num, slots).reshape(batch * num * slots, -1)
    soft = None if soft_hidden is None else soft_hidden.reshape(batch * num * slots, -1)
    if head_weight.requires_grad:
        raise ValueError("the target LM head must be frozen (requires_grad=False): the chunked loss "
                         "computes no gradient for it")
    if chunk_size < 1:
        raise ValueError(f"training.loss_chunk_size must be >= 1, got {chunk_size}")
    total, correct, top_values, top_ids = _ChunkedHeadLoss.apply(
        hidden, head_weight, labels.reshape(-1), weights.reshape(-1).float(), soft, chunk_size, top_k)
    hits = correct.view(batch, num, slots) & (weights > 0)
    if supervised is None:
        supervised = weights > 0
    leading = hits.long().cumprod(dim=-1).sum(dim=-1)
    candidates = None
    if top_k:
        candidates = (top_values.view(batch, num, slots, top_k), top_ids.view(batch, num, slots, top_k))
    sums = LossSums(loss=total, weight=weights.float().sum(), correct=hits.sum(),
                    count=supervised.sum(), correct_per_slot=hits.sum(dim=(0, 1)),
                    count_per_slot=supervised.sum(dim=(0, 1)),
                    accepted=((leading + 1) * keep).sum(), blocks=keep.sum())
    return BackbonePass(sums=sums, hits=hits, candidates=candidates)
