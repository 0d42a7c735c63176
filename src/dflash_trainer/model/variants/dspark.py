"""DSpark (DeepSeek; ``model.variant: dspark``): the DFlash backbone plus a low-rank Markov head
that adds a transition bias from the previously drafted token, the block drafted left to right,
and an optional confidence head that estimates each draft's acceptance. The modules, their
identity init and the left-to-right walk (its drafting step, ``propose``) are in the standalone
modeling file :mod:`dflash_trainer.model.modeling.dspark`; this module holds the rest: options,
export keys (as vLLM's ``qwen3_dspark.py`` and llama.cpp's ``DSparkModel`` converter read
them), and the training terms.

Training terms, beside the backbone's loss on its own logits (the main loss, unchanged):

* the Markov-corrected loss (``markov_loss``, times ``training.markov_weight``): the same
  decay-weighted cross-entropy (KL with ``training.labels: kl``) on the corrected logits
  ``head(h_k) + markov_w2 @ markov_w1[x_{a+k-1}]``, with the true previous token (the label of
  slot k-1; the anchor token for slot 1), as SpecForge's, speculators' and DeepSpec's DSpark
  losses are. Its gradient reaches the backbone too. It runs the LM head over the slots a second
  time, chunk by chunk (``training.loss_chunk_size`` rows, the gradient computed in the same pass
  as the backbone's), so no ``[slots, vocab]`` tensor is held beyond one chunk;
* the confidence loss (``confidence_loss``, weight 1): binary cross-entropy of the confidence
  head's logit against whether the slot's corrected argmax (with the true previous token) is its
  label, i.e. whether greedy verification accepts that draft given that the slots before it were
  accepted; decay-weighted like the others. The head reads the drafter's states and the Markov
  embedding detached, so it learns to estimate acceptance without changing what is drafted.

The Markov path's simulated acceptance is exact: the greedy left-to-right walk's previous tokens
equal the true ones up to its first miss, so its leading correct slots are those of the
teacher-forced corrected argmax (``train/tau_sim_markov``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F

from dflash_trainer.config import ModelConfig, TrainingConfig
from dflash_trainer.model.loss import MetricSpec
from dflash_trainer.model.variants.base import LossTerms, ReportLines, SlotInputs, TermSums, Variant

if TYPE_CHECKING:  # the modeling file is imported on first use (variants.base)
    from transformers import PretrainedConfig

    from dflash_trainer.model.modeling.dflash import DFlashDraftModel
    from dflash_trainer.model.modeling.dspark import DSparkDraftModel

__all__ = ["DSpark", "DSparkTerms", "MarkovSums", "markov_corrected_loss"]


def _chunk(hidden: torch.Tensor, head_weight: torch.Tensor, embed: torch.Tensor, w2: torch.Tensor,
           labels: torch.Tensor, weights: torch.Tensor, soft: torch.Tensor | None,
           need_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row loss, top-1 correctness and ``w * d(loss)/d(logits)`` (if needed) of one chunk of
    corrected logits ``head(hidden) + embed @ w2.T``."""
    logits = (hidden.to(head_weight.dtype) @ head_weight.T).float()
    logits += (embed.to(w2.dtype) @ w2.T).float()
    log_probs = torch.log_softmax(logits, dim=-1)
    del logits
    if soft is None:
        correct = log_probs.argmax(dim=-1) == labels
        loss = -log_probs.gather(1, labels[:, None])[:, 0]
        if not need_grad:
            return loss, correct, None
        grad = log_probs.exp_().mul_(weights[:, None])
        grad[torch.arange(labels.shape[0], device=labels.device), labels] -= weights
        return loss, correct, grad
    target_log_probs = torch.log_softmax((soft.to(head_weight.dtype) @ head_weight.T).float(), dim=-1)
    correct = log_probs.argmax(dim=-1) == target_log_probs.argmax(dim=-1)
    target_probs = target_log_probs.exp()
    loss = (target_probs * (target_log_probs - log_probs)).sum(dim=-1)  # KL(target || corrected)
    if not need_grad:
        return loss, correct, None
    return loss, correct, log_probs.exp_().sub_(target_probs).mul_(weights[:, None])


class _MarkovCorrectedLoss(torch.autograd.Function):
    """``sum_i w_i * loss_i`` of the corrected logits, chunk by chunk, with the gradients of the
    states, the Markov embeddings and ``markov_w2`` computed in the forward pass."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head_weight: torch.Tensor, embed: torch.Tensor, w2: torch.Tensor,
                labels: torch.Tensor, weights: torch.Tensor, soft_hidden: torch.Tensor | None,
                chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        grad_h, _, grad_e, grad_w, *_ = ctx.needs_input_grad
        need_grad = grad_h or grad_e or grad_w
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if grad_h else None
        grad_embed = torch.empty_like(embed) if grad_e else None
        grad_w2 = torch.zeros(w2.shape, dtype=torch.float32, device=w2.device) if grad_w else None
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            w = weights[start:end]
            soft = None if soft_hidden is None else soft_hidden[start:end]
            loss, hits, grad_logits = _chunk(hidden[start:end], head_weight, embed[start:end], w2, labels[start:end],
                                             w, soft, need_grad)
            total += (w * loss).sum()
            correct[start:end] = hits
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_logits.to(head_weight.dtype) @ head_weight).to(hidden.dtype)
            if grad_embed is not None:
                grad_embed[start:end] = (grad_logits.to(w2.dtype) @ w2).to(embed.dtype)
            if grad_w2 is not None:
                grad_w2 += (grad_logits.T.to(w2.dtype) @ embed[start:end].to(w2.dtype)).float()
        ctx.mark_non_differentiable(correct)
        ctx.present = tuple(g is not None for g in (grad_hidden, grad_embed, grad_w2))
        ctx.save_for_backward(*(g for g in (grad_hidden, grad_embed, grad_w2) if g is not None))
        ctx.w2_dtype = w2.dtype
        return total, correct

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, *_unused: torch.Tensor):
        saved = iter(ctx.saved_tensors)
        grad_hidden, grad_embed, grad_w2 = (next(saved) if present else None for present in ctx.present)
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_total.to(grad_hidden.dtype)
        if grad_embed is not None:
            grad_embed = grad_embed * grad_total.to(grad_embed.dtype)
        if grad_w2 is not None:
            grad_w2 = (grad_w2 * grad_total).to(ctx.w2_dtype)
        return grad_hidden, None, grad_embed, grad_w2, None, None, None, None


def markov_corrected_loss(hidden: torch.Tensor, head_weight: torch.Tensor, embed: torch.Tensor, w2: torch.Tensor,
                          labels: torch.Tensor, weights: torch.Tensor, *, chunk_size: int,
                          soft_hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_i w_i * loss_i, correct [M] bool)`` of the corrected logits
    ``hidden @ head_weight.T + embed @ w2.T`` of ``[M, H]`` rows under a frozen ``[V, H]`` head,
    their Markov embeddings ``embed`` ``[M, rank]`` and ``markov_w2`` ``[V, rank]``.

    ``loss_i`` is cross-entropy against ``labels``, or with ``soft_hidden`` (the target's final
    states of the same rows) KL(target || corrected) under the same head; ``correct`` compares the
    corrected argmax with the label (or the target's argmax). ``hidden``, ``embed`` and ``w2`` get
    gradients; at most ``chunk_size`` rows of logits are held at a time.
    """
    if head_weight.requires_grad:
        raise ValueError("the target LM head must be frozen (requires_grad=False)")
    return _MarkovCorrectedLoss.apply(hidden, head_weight, embed, w2, labels, weights.float(), soft_hidden,
                                      chunk_size)


@dataclass(frozen=True, kw_only=True)
class MarkovSums:
    """One micro-batch's DSpark sums (on the device; ratios are logged, as for
    :class:`~dflash_trainer.model.loss.LossSums`)."""

    loss: torch.Tensor | None
    """``sum_i w_i * loss_i`` of the corrected logits (differentiable); None when not computed."""
    hits: torch.Tensor
    """``[B, N, K]`` supervised slots whose corrected argmax (true previous token) is the label;
    the backbone's hits when the corrected loss is not computed (the bias is then 0)."""
    confidence_loss: torch.Tensor | None = None
    """``sum_i w_i * BCE_i`` of the confidence head against :attr:`hits` (differentiable)."""
    confidence: torch.Tensor | None = None
    """``[B, N, K]`` the confidence head's estimated acceptance (no gradient)."""


class DSparkTerms(LossTerms):
    """The Markov-corrected loss (``markov_loss``, times ``training.markov_weight``), the
    confidence loss (``confidence_loss``, weight 1, with a confidence head) and their metrics:
    the corrected path's accuracy (overall and per slot) and simulated acceptance, the mean
    estimated acceptance (overall and per slot) to set beside the actual one."""

    def __init__(self, drafter: DSparkDraftModel, *, markov_weight: float = 1.0) -> None:
        self.drafter = drafter
        self.markov_weight = markov_weight
        self.has_confidence = drafter.confidence_head is not None
        weights, metrics = {}, []
        if markov_weight > 0:
            weights["markov_loss"] = markov_weight
            metrics += [MetricSpec("train/markov_loss", "markov_loss", "weight"),
                        MetricSpec("train/markov_acc", "markov_correct", "count"),
                        MetricSpec("train/tau_sim_markov", "markov_accepted", "blocks"),
                        MetricSpec("train/acc_markov_pos/{k}", "markov_correct_per_slot", "count_per_slot")]
        else:
            # Untrained, so not an optimizer (or DDP) parameter: DDP refuses parameters
            # that get no gradient. The bias stays 0: the backbone's drafts are DSpark's.
            drafter.markov_head.requires_grad_(False)
        if self.has_confidence:
            weights["confidence_loss"] = 1.0
            metrics += [MetricSpec("train/confidence_loss", "confidence_loss", "weight"),
                        MetricSpec("train/confidence_mean", "confidence_sum", "count"),
                        MetricSpec("train/confidence_pos/{k}", "confidence_per_slot", "count_per_slot")]
        self.weights = weights
        self.metrics = tuple(metrics)

    def sums(self, inputs: SlotInputs) -> MarkovSums:
        """The corrected loss and hits, and the confidence loss and estimates, of one micro-batch."""
        head = self.drafter.markov_head
        labels, weights = inputs.labels, inputs.weights
        supervised = weights > 0
        previous = inputs.previous_ids
        loss = None
        hits = inputs.hits
        if self.markov_weight > 0:
            rows = inputs.hidden.reshape(-1, inputs.hidden.shape[-1])
            soft = None if inputs.soft_hidden is None else inputs.soft_hidden.reshape(rows.shape[0], -1)
            loss, correct = markov_corrected_loss(rows, inputs.head_weight, head.embed(previous.reshape(-1)),
                                                  head.markov_w2.weight, labels.reshape(-1), weights.reshape(-1),
                                                  chunk_size=inputs.chunk_size, soft_hidden=soft)
            hits = correct.view(labels.shape) & supervised
        if not self.has_confidence:
            return MarkovSums(loss=loss, hits=hits)
        # Detached inputs: the head estimates acceptance, it does not change the drafts.
        logits = self.drafter.confidence_head(inputs.hidden.detach(), head.embed(previous).detach())
        bce = F.binary_cross_entropy_with_logits(logits, hits.float(), reduction="none")
        return MarkovSums(loss=loss, hits=hits, confidence_loss=(weights.float() * bce).sum(),
                          confidence=torch.sigmoid(logits.detach()) * supervised)

    def __call__(self, inputs: SlotInputs) -> TermSums:
        """:meth:`sums` as named loss terms and metric counts."""
        sums = self.sums(inputs)
        losses, counts = {}, {}
        if sums.loss is not None:
            leading = sums.hits.long().cumprod(dim=-1).sum(dim=-1)
            losses["markov_loss"] = sums.loss
            counts.update(markov_correct=sums.hits.sum(), markov_correct_per_slot=sums.hits.sum(dim=(0, 1)),
                          markov_accepted=((leading + 1) * inputs.keep).sum())
        if sums.confidence_loss is not None and sums.confidence is not None:
            losses["confidence_loss"] = sums.confidence_loss
            counts.update(confidence_sum=sums.confidence.sum(), confidence_per_slot=sums.confidence.sum(dim=(0, 1)))
        return TermSums(losses=losses, counts=counts)


class DSpark(Variant):
    """DSpark (module docstring): ``model.markov_rank`` and ``model.enable_confidence_head``;
    ``training.markov_weight``."""

    name = "dspark"
    title = "DSpark"
    # llama.cpp converts DSparkDraftModel; vLLM serves it as Qwen3DSparkModel (it renames a
    # DSparkDraftModel config whose model_type is qwen3).
    architecture = "DSparkDraftModel"
    modeling_files = ("dflash.py", "dspark.py")
    # A DFlash drafter gives a DSpark one its backbone; the Markov head keeps its identity init,
    # so the warm-started drafter first drafts what the DFlash one drafts.
    warm_starts_from = ("dflash", "dspark")
    export_prefixes = ("markov_head.", "confidence_head.")
    llama_cpp_spec_type = "draft-dspark"
    llama_cpp_prunes_vocab = True
    vllm_method = "dspark"
    report = ReportLines(tau={"train/tau_sim_markov": "train/tau_sim_markov (DSpark's Markov path, "
                                                      "training batches)"},
                         slot_paths={"train/acc_markov_pos/{k}": "Markov path",
                                     "train/confidence_pos/{k}": "estimated acceptance"},
                         summary=("train/tau_sim_markov", "train/markov_acc", "train/confidence_mean"))

    def settings(self, model_cfg: ModelConfig, target: PretrainedConfig) -> dict[str, Any]:
        """The Markov rank and whether there is a confidence head (which always reads the Markov
        embedding too: llama.cpp loads no other kind)."""
        from dflash_trainer.model.modeling.dspark import DEFAULT_MARKOV_RANK

        del target
        confidence = True if model_cfg.enable_confidence_head is None else model_cfg.enable_confidence_head
        return {"markov_rank": model_cfg.markov_rank or DEFAULT_MARKOV_RANK, "markov_head_type": "vanilla",
                "enable_confidence_head": confidence, "confidence_head_with_markov": True}

    def config_fields(self) -> dict[str, Any]:
        """Non-causal blocks, and the fill-in block layout (the anchor is the verified token, not
        a prediction): vLLM and llama.cpp assume the other layout without ``sample_from_anchor``."""
        return {"is_causal": False, "sample_from_anchor": False}

    def export_fields(self, model: DFlashDraftModel) -> dict[str, Any]:
        """:meth:`config_fields` and the heads' keys, at the top level where vLLM reads them."""
        return {**self.config_fields(), **self.export_section(model)}

    def export_section(self, model: DFlashDraftModel) -> dict[str, Any]:
        """The Markov rank and head type, and the confidence head's presence and inputs."""
        confidence = model.confidence_head
        return {"markov_rank": model.markov_head.rank, "markov_head_type": "vanilla",
                "enable_confidence_head": confidence is not None,
                "confidence_head_with_markov": confidence is None or confidence.with_markov}

    def loss_terms(self, drafter: DFlashDraftModel, training: TrainingConfig) -> DSparkTerms:
        """:class:`DSparkTerms` of the drafter's heads (Markov weight 1 by default)."""
        return DSparkTerms(drafter, markov_weight=1.0 if training.markov_weight is None else training.markov_weight)
