"""Chunked LM-head cross-entropy with decay weights, and the DFlash training metrics.

The target's LM head is applied to ``loss_chunk_size`` slots at a time inside one autograd
Function that also computes the gradient with respect to the hidden states in the same pass
(the head is frozen, so that is the only gradient). Neither forward nor backward ever holds
more than one chunk of ``[slots, vocab]`` logits, and the head matmul runs twice per slot
(logits, then grad), the same as an unchunked forward + backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

__all__ = ["LossSums", "chunked_head_loss", "dflash_loss", "reference_head_loss"]


def _chunk_terms(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                 soft_hidden: torch.Tensor | None,
                 need_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-slot loss, top-1 correctness and ``w * d(loss)/d(logits)`` (if needed) for one chunk."""
    logits = hidden.to(head_weight.dtype) @ head_weight.T
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
                chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        need_grad = ctx.needs_input_grad[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            w = weights[start:end]
            soft = None if soft_hidden is None else soft_hidden[start:end]
            loss, hits, grad_logits = _chunk_terms(hidden[start:end], head_weight, labels[start:end], w,
                                                   soft, need_grad)
            total += (w * loss).sum()
            correct[start:end] = hits
            if need_grad:
                grad_hidden[start:end] = (grad_logits.to(head_weight.dtype) @ head_weight).to(hidden.dtype)
        ctx.mark_non_differentiable(correct)
        ctx.save_for_backward(grad_hidden)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, grad_correct: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None, None


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
    return _ChunkedHeadLoss.apply(hidden, head_weight, labels, weights.float(), soft_hidden, chunk_size)


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


@dataclass(frozen=True, kw_only=True)
class LossSums:
    """One micro-batch's loss and metric sums, on the device (no host sync).

    Sums, not means, so that micro-batches and ranks add up: the train loop divides
    :attr:`loss` by the weight summed over every rank, once. The logged metrics are ratios of
    these sums under the same names: ``train/loss`` = loss / weight, ``train/acc`` = correct /
    count, ``train/acc_pos/{k}`` = correct_per_slot / count_per_slot, ``train/tau_sim`` =
    accepted / blocks.
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

    def mean_loss(self) -> torch.Tensor:
        """``loss / weight``: the micro-batch's own weighted mean (0 when nothing is supervised)."""
        return self.loss / self.weight.clamp_min(1e-6)


def dflash_loss(block_hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                weights: torch.Tensor, keep: torch.Tensor, *, chunk_size: int,
                soft_hidden: torch.Tensor | None = None) -> LossSums:
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

    Returns:
        :class:`LossSums`; the top-1 predictions come from the loss chunks already in memory.
    """
    batch, num, slots = labels.shape
    rows = block_hidden.shape[1] // num
    # K < Bk, so K rows per block are the selected slots and Bk rows a whole block.
    first = 0 if rows == slots else 1
    hidden = block_hidden.view(batch, num, rows, -1)[:, :, first:first + slots].reshape(batch * num * slots, -1)
    soft = None if soft_hidden is None else soft_hidden.reshape(batch * num * slots, -1)
    total, correct = chunked_head_loss(hidden, head_weight, labels.reshape(-1), weights.reshape(-1),
                                       chunk_size, soft)
    supervised = weights > 0
    hits = correct.view(batch, num, slots) & supervised
    leading = hits.long().cumprod(dim=-1).sum(dim=-1)
    return LossSums(loss=total, weight=weights.float().sum(), correct=hits.sum(),
                    count=supervised.sum(), correct_per_slot=hits.sum(dim=(0, 1)),
                    count_per_slot=supervised.sum(dim=(0, 1)),
                    accepted=((leading + 1) * keep).sum(), blocks=keep.sum())
