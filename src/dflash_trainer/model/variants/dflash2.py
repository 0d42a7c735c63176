"""DFlash2 (z-lab/Inco AI ``DFlash2DraftModel``; ``model.variant: dflash2``): the DFlash backbone
plus a two-tap dynamic depthwise convolution around each attention and MLP sublayer and a
candidate selector that picks each draft among the top-k tokens of its slot given the token
before it. The modules, their identity init and the selector's left-to-right walk (its drafting
step, ``propose``) are in the standalone modeling file :mod:`dflash_trainer.model.modeling.dflash2`;
this module holds the rest: options, export keys, and the selector's training terms.

Selector training terms. For block slot k of a block anchored at a, the selector sees the top-k
candidates of the drafter's logits at that slot and the token before the slot: the true
previous token ``x_{a+k-1}`` (the label of slot k-1; the anchor token for slot 1), as in teacher
forcing. Its loss is the cross-entropy of ``softmax_b S(x_{a+k-1}, b)`` over the candidates
against the label ``x_{a+k}``, weighted by the slot's decay weight, times
``training.selector_weight``. A label outside the candidates either drops the slot from this
term (``exclude``) or takes the place of the lowest candidate in the loss only (``insert``: the
selector also learns to rank a token the logits missed; decoding never sees it).

The candidates' logits in the scores keep their gradient (the backbone learns from the
selector term too); they are gathered for the k candidates only, chunk by chunk, so neither
``[slots, k, H]`` head rows nor ``[slots, k, vocab]`` scores are ever held.

The path metrics walk each block as decoding does (greedy, from the anchor, each slot's
predecessor being the walk's own previous choice) and compare the path with the labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.nn import functional as F

from dflash_trainer.config import ModelConfig, TrainingConfig
from dflash_trainer.core.errors import ConfigError
from dflash_trainer.model.loss import MetricSpec
from dflash_trainer.model.variants.base import LossTerms, ReportLines, SlotInputs, TermSums, Variant

if TYPE_CHECKING:  # the modeling file is imported on first use (variants.base)
    from transformers import PretrainedConfig

    from dflash_trainer.model.modeling.dflash import DFlashDraftModel
    from dflash_trainer.model.modeling.dflash2 import CandidateSelector

__all__ = ["DFlash2", "SelectorSums", "SelectorTerms", "gathered_logits", "selector_terms"]


def _head_rows(head_weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``head_weight[ids]`` ``[..., H]``; ``index_select`` copies rows about twice as fast on CPU."""
    return head_weight.index_select(0, ids.reshape(-1)).view(*ids.shape, head_weight.shape[1])


class _GatheredLogits(torch.autograd.Function):
    """``out[m, j] = hidden[m] . head[ids[m, j]]`` under a frozen head, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head_weight: torch.Tensor, ids: torch.Tensor,
                chunk_size: int) -> torch.Tensor:
        out = torch.empty(ids.shape, dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = _head_rows(head_weight, ids[start:start + chunk_size])
            out[start:start + chunk_size] = torch.matmul(
                rows, hidden[start:start + chunk_size].to(head_weight.dtype)[..., None])[..., 0].float()
        ctx.save_for_backward(ids)
        ctx.head_weight, ctx.chunk_size, ctx.hidden_dtype = head_weight, chunk_size, hidden.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (ids,) = ctx.saved_tensors
        head_weight, chunk = ctx.head_weight, ctx.chunk_size
        grad = torch.empty(ids.shape[0], head_weight.shape[1], dtype=ctx.hidden_dtype, device=ids.device)
        for start in range(0, ids.shape[0], chunk):
            rows = _head_rows(head_weight, ids[start:start + chunk])
            grad[start:start + chunk] = torch.matmul(
                grad_out[start:start + chunk, None].to(head_weight.dtype), rows)[:, 0].to(grad.dtype)
        return grad, None, None, None


def gathered_logits(hidden: torch.Tensor, head_weight: torch.Tensor, ids: torch.Tensor,
                    chunk_size: int) -> torch.Tensor:
    """The logits ``[M, k]`` (float32) of the tokens ``ids`` ``[M, k]`` for the rows ``hidden``
    ``[M, H]`` under a frozen LM head ``[V, H]``; differentiable with respect to ``hidden``
    only. At most ``chunk_size`` rows' ``[k, H]`` head rows are held at a time."""
    if head_weight.requires_grad:
        raise ValueError("the target LM head must be frozen (requires_grad=False)")
    return _GatheredLogits.apply(hidden, head_weight, ids, chunk_size)


@dataclass(frozen=True, kw_only=True)
class SelectorSums:
    """One micro-batch's selector sums (on the device; ratios are logged, as for
    :class:`~dflash_trainer.model.loss.LossSums`)."""

    loss: torch.Tensor
    """``sum_i w_i * CE_i`` of the selector over the supervised slots (differentiable); a slot
    whose label is not a candidate adds 0 under ``exclude``."""
    in_top_k: torch.Tensor
    """Supervised slots whose label is among the candidates (``train/candidate_recall`` =
    in_top_k / count)."""
    path_correct_per_slot: torch.Tensor
    """``[K]`` supervised slots where the selector's greedy path equals the label."""
    path_accepted: torch.Tensor
    """Sum over kept blocks of 1 + the number of leading correct slots of the path
    (``train/tau_sim_selector`` = path_accepted / blocks)."""


def selector_terms(selector: CandidateSelector, hidden: torch.Tensor, head_weight: torch.Tensor,
                   candidates: torch.Tensor, unary: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                   anchor_ids: torch.Tensor, keep: torch.Tensor, *,
                   missing: Literal["exclude", "insert"] = "exclude", chunk_size: int = 256) -> SelectorSums:
    """The selector's loss and path metrics for N blocks of K supervised slots.

    Args:
        selector: the drafter's ``candidate_selector``.
        hidden: ``[B, N, K, H]`` drafter states (after the final norm) of slots 1..K.
        head_weight: the target's frozen LM head ``[V, H]``.
        candidates, unary: ``[B, N, K, k]`` the top-k token ids of each slot's logits and those
            logits (their values; the loss recomputes them with gradient).
        labels, weights: ``[B, N, K]`` labels and decay weights (0 = unsupervised).
        anchor_ids: ``[B, N]`` the token at each block's anchor (slot 1's predecessor).
        keep: ``[B, N]`` real blocks.
        missing: what a label outside the candidates does in the loss (module docstring).
        chunk_size: rows per gathered-logit chunk.
    """
    batch, num, slots, top_k = candidates.shape
    supervised = weights > 0
    match = candidates == labels[..., None]
    in_top = match.any(dim=-1)
    index = match.int().argmax(dim=-1)
    scored = candidates
    if missing == "insert":
        inserted = torch.cat([candidates[..., :-1], labels[..., None]], dim=-1)
        scored = torch.where(in_top[..., None], candidates, inserted)
        index = torch.where(in_top, index, top_k - 1)
        used = weights
    elif missing == "exclude":
        used = weights * in_top
    else:
        raise ValueError(f"missing must be 'exclude' or 'insert', got {missing!r}")
    predecessors = torch.cat([anchor_ids[..., None], labels[..., :-1]], dim=-1)
    rows = hidden.reshape(-1, hidden.shape[-1])
    logits = gathered_logits(rows, head_weight, scored.reshape(-1, top_k), chunk_size)
    scores = selector.pair_scores(rows, logits, scored.reshape(-1, top_k), predecessors.reshape(-1))
    loss = (used.reshape(-1).float() * F.cross_entropy(scores, index.reshape(-1), reduction="none")).sum()
    with torch.no_grad():
        path, _ = selector.walk_candidates(hidden.reshape(batch * num, slots, -1).detach(),
                                           unary.reshape(batch * num, slots, top_k),
                                           candidates.reshape(batch * num, slots, top_k),
                                           anchor_ids.reshape(-1), 0.0)
        hits = (path.view(batch, num, slots) == labels) & supervised
        leading = hits.long().cumprod(dim=-1).sum(dim=-1)
    return SelectorSums(loss=loss, in_top_k=(in_top & supervised).sum(),
                        path_correct_per_slot=hits.sum(dim=(0, 1)), path_accepted=((leading + 1) * keep).sum())


class SelectorTerms(LossTerms):
    """The selector's loss (``selector_loss``, times ``training.selector_weight``) and its
    metrics: candidate recall, and the accuracy and simulated acceptance of its greedy path."""

    metrics = (
        MetricSpec("train/selector_loss", "selector_loss", "weight"),
        MetricSpec("train/candidate_recall", "in_top_k", "count"),
        MetricSpec("train/tau_sim_selector", "path_accepted", "blocks"),
        MetricSpec("train/acc_sel_pos/{k}", "path_correct_per_slot", "count_per_slot"),
    )

    def __init__(self, selector: CandidateSelector, *, weight: float = 1.0,
                 missing: Literal["exclude", "insert"] = "exclude") -> None:
        self.selector = selector
        self.top_k = selector.top_k
        self.weight = weight
        self.weights = {"selector_loss": weight}
        self.missing = missing
        if weight == 0:
            # Untrained, so not an optimizer (or DDP) parameter: DDP refuses parameters
            # that get no gradient.
            selector.requires_grad_(False)

    def __call__(self, inputs: SlotInputs) -> TermSums:
        """:func:`selector_terms` on the backbone's candidates (no gradient when the weight is 0)."""
        assert inputs.candidates is not None
        values, ids = inputs.candidates
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.weight > 0):
            terms = selector_terms(self.selector, inputs.hidden, inputs.head_weight, ids, values, inputs.labels,
                                   inputs.weights, inputs.anchor_ids, inputs.keep, missing=self.missing,
                                   chunk_size=inputs.chunk_size)
        return TermSums(losses={"selector_loss": terms.loss},
                        counts={"in_top_k": terms.in_top_k, "path_correct_per_slot": terms.path_correct_per_slot,
                                "path_accepted": terms.path_accepted})


class DFlash2(Variant):
    """DFlash2 (module docstring): ``model.selector_rank``, ``model.selector_top_k`` and
    ``model.conv_group_size``; ``training.selector_weight`` and ``training.selector_missing``."""

    name = "dflash2"
    title = "DFlash2"
    architecture = "DFlash2DraftModel"
    modeling_files = ("dflash.py", "dflash2.py")
    # A DFlash drafter gives a DFlash2 one its backbone; the convolutions and the selector keep
    # their identity init, so the warm-started drafter first drafts what the DFlash one drafts.
    warm_starts_from = ("dflash", "dflash2")
    # The selector's codebooks and candidates index the target's vocabulary, and vLLM's
    # DFlash2 model reads no d2t table.
    prunes_vocab = False
    export_prefixes = ("candidate_selector.",)
    report = ReportLines(tau={"train/tau_sim_selector": "train/tau_sim_selector (DFlash2 selector's path, "
                                                        "training batches)"},
                         slot_paths={"train/acc_sel_pos/{k}": "selector path"},
                         summary=("train/tau_sim_selector", "train/candidate_recall"))

    def settings(self, model_cfg: ModelConfig, target: PretrainedConfig) -> dict[str, Any]:
        """The convolution and selector keys, defaults filled in and checked against the target."""
        from dflash_trainer.model.modeling.dflash2 import (DEFAULT_CONV_GROUP_SIZE, DEFAULT_CONV_KERNEL_SIZE,
                                                           DEFAULT_SELECTOR_RANK, DEFAULT_SELECTOR_TOP_K)

        settings = {
            "conv_kernel_size": DEFAULT_CONV_KERNEL_SIZE,
            "conv_group_size": model_cfg.conv_group_size or DEFAULT_CONV_GROUP_SIZE,
            "selector_rank": model_cfg.selector_rank or DEFAULT_SELECTOR_RANK,
            "selector_top_k": model_cfg.selector_top_k or DEFAULT_SELECTOR_TOP_K,
        }
        if target.hidden_size % settings["conv_group_size"]:
            raise ConfigError(f"model.conv_group_size={settings['conv_group_size']} does not divide the target's "
                              f"hidden size {target.hidden_size}; choose a divisor of it (16 if it divides)")
        if settings["selector_top_k"] > target.vocab_size:
            raise ConfigError(f"model.selector_top_k={settings['selector_top_k']} is larger than the target's "
                              f"vocabulary ({target.vocab_size} tokens); choose at most {target.vocab_size}")
        return settings

    def config_fields(self) -> dict[str, Any]:
        """``is_causal: false``, as z-lab's fixture has it."""
        return {"is_causal": False}

    def export_section(self, model: DFlashDraftModel) -> dict[str, Any]:
        """The convolution's kernel and group sizes and the selector's rank and top-k."""
        conv, selector = model.layers[0].attention_conv, model.candidate_selector
        return {"conv_kernel_size": conv.kernel_size, "conv_group_size": conv.group_size,
                "selector_rank": selector.predecessor_codebook.shape[1], "selector_top_k": selector.top_k}

    def loss_terms(self, drafter: DFlashDraftModel, training: TrainingConfig) -> SelectorTerms:
        """:class:`SelectorTerms` of the drafter's selector (weight 1 and ``exclude`` by default)."""
        return SelectorTerms(drafter.candidate_selector,
                             weight=1.0 if training.selector_weight is None else training.selector_weight,
                             missing=training.selector_missing or "exclude")
