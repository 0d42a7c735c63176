"""The drafter-variant interface: what a variant adds to the DFlash backbone.

Every variant shares the backbone (``fc`` + ``hidden_norm`` over the tapped target layers,
non-causal Qwen3-style layers, the target's embedding and LM head) and its decay-weighted block
loss. A :class:`Variant` declares the rest, in one module of :mod:`dflash_trainer.model.variants`:

* its extra modules and their identity-safe init: :attr:`Variant.model_class` (a
  :class:`~dflash_trainer.model.modeling.dflash.DFlashDraftModel` subclass in the standalone
  modeling file exported next to the weights, so ``trust_remote_code`` users run the same
  modules), configured by :meth:`Variant.settings`; which drafters may warm-start it:
  :attr:`Variant.warm_starts_from`;
* its loss terms and metrics: :meth:`Variant.loss_terms` gives the :class:`LossTerms` the
  objective adds to the backbone's loss (named terms, weights, count sums and the
  :class:`~dflash_trainer.model.loss.MetricSpec` of each logged metric);
  :attr:`Variant.report` says how the report draws them;
* its export schema: :meth:`Variant.config_fields` and :meth:`Variant.export_fields`
  (top-level ``config.json`` keys), :meth:`Variant.export_section` (``dflash_config`` keys),
  :attr:`Variant.export_prefixes` (its tensors) and :attr:`Variant.modeling_files` (the files
  shipped);
* how the engines serve its exports: :attr:`Variant.llama_cpp_spec_type` and
  :attr:`Variant.vllm_method` (the engines' code reads them from the caller, never the registry);
* its drafting step in the decoding loop (eval, generate, the demo): ``propose`` of
  :attr:`Variant.model_class`, which ``spec_generate`` calls once per block with the block's
  hidden states and its verified anchor token, and which returns the drafts and, when
  sampling, the distributions they were drawn from (for lossless rejection sampling).

The common path (objective, loss sums, drafter step, export, decoding loop, report) reads a
variant only through this interface, from :mod:`dflash_trainer.model.variants` (the registry).

Reading the registry imports no modeling file (transformers' model code takes seconds to
import): :attr:`Variant.model_class` is imported on first use, from the declared
:attr:`Variant.modeling_files` and :attr:`Variant.architecture`, so the report, which only reads
names and metrics, stays quick.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from dflash_trainer.config import ModelConfig, TrainingConfig
from dflash_trainer.model import modeling
from dflash_trainer.model.loss import MetricSpec

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from dflash_trainer.model.modeling.dflash import DFlashDraftModel

__all__ = ["LossTerms", "ReportLines", "SlotInputs", "TermSums", "Variant"]


@dataclass(frozen=True, kw_only=True)
class SlotInputs:
    """What a variant's loss terms read of one micro-batch: N blocks of K supervised slots."""

    hidden: torch.Tensor
    """``[B, N, K, H]`` the drafter's states (after the final norm) of slots 1..K (differentiable)."""
    head_weight: torch.Tensor
    """The frozen LM head ``[V, H]``: the target's, or the drafter's rows of a pruned draft
    vocabulary (then ``V`` is ``draft_vocab_size``)."""
    labels: torch.Tensor
    """``[B, N, K]`` each slot's label (the data's token, or the target's greedy one), as a row
    of :attr:`head_weight` (with a pruned draft vocabulary, its draft row; 0 outside it)."""
    previous_ids: torch.Tensor
    """``[B, N, K]`` the target token before each slot: the block's anchor token, then the
    labels of slots 1..K-1."""
    weights: torch.Tensor
    """``[B, N, K]`` decay weights, 0 where a slot is not supervised (or its label is outside a
    pruned draft vocabulary)."""
    keep: torch.Tensor
    """``[B, N]`` real (True) or padding blocks."""
    anchor_ids: torch.Tensor
    """``[B, N]`` the token at each block's anchor (what slot 1 follows)."""
    hits: torch.Tensor
    """``[B, N, K]`` supervised slots whose backbone argmax is the label (no gradient)."""
    candidates: tuple[torch.Tensor, torch.Tensor] | None
    """With :attr:`LossTerms.top_k` = k: each slot's top-k backbone logits and their token ids
    ``[B, N, K, k]`` (no gradient), from the backbone loss's chunks."""
    soft_hidden: torch.Tensor | None
    """``[B, N, K, H]`` the target's final states for ``training.labels: kl``, else None."""
    chunk_size: int
    """``training.loss_chunk_size``: rows per LM-head chunk, which bounds the logits memory."""


@dataclass(frozen=True, kw_only=True)
class TermSums:
    """A variant's sums for one micro-batch (on the device)."""

    losses: Mapping[str, torch.Tensor]
    """Differentiable ``sum_i w_i * loss_i`` terms by name, each added to the objective times
    its :attr:`LossTerms.weights` entry."""
    counts: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Metric sums by name (one value, or ``[K]`` one per block slot)."""


class LossTerms:
    """A variant's training terms for one drafter, beside the backbone's loss.

    The objective runs the backbone's chunked loss, then calls the terms with
    :class:`SlotInputs`; their sums are logged through :attr:`metrics`. Subclasses set the
    attributes and implement :meth:`__call__`.
    """

    top_k: int = 0
    """Candidates per slot the backbone loss keeps for :attr:`SlotInputs.candidates` (0: none)."""
    weights: Mapping[str, float] = {}
    """The factor of each of :attr:`TermSums.losses` in the objective."""
    metrics: tuple[MetricSpec, ...] = ()
    """The metrics of the sums (names of :attr:`TermSums.losses` and :attr:`TermSums.counts`,
    or the backbone's: ``weight``, ``count``, ``blocks``, ``count_per_slot``)."""

    def __call__(self, inputs: SlotInputs) -> TermSums:
        """The terms' sums for one micro-batch."""
        raise NotImplementedError


@dataclass(frozen=True)
class ReportLines:
    """How the report shows a variant's metrics (each only where the run logged it)."""

    tau: Mapping[str, str] = field(default_factory=dict)
    """Metric -> legend: series drawn beside ``train/tau_sim`` in the acceptance-length plot."""
    slot_paths: Mapping[str, str] = field(default_factory=dict)
    """Per-slot metric (a :class:`~dflash_trainer.model.loss.MetricSpec` name) -> legend suffix:
    dashed beside each slot's accuracy in the per-slot plot."""
    summary: tuple[str, ...] = ()
    """Metrics whose final value is a row of the run summary."""


class Variant:
    """One drafter variant (module docstring). The defaults are the plain DFlash drafter's:
    a variant overrides what it adds."""

    name: ClassVar[str]
    """``model.variant``."""
    title: ClassVar[str]
    """How messages and the report name it."""
    architecture: ClassVar[str]
    """The name of the modeling class (:attr:`model_class`), which is the ``architectures``
    entry of the variant's configs and exports."""
    modeling_files: ClassVar[tuple[str, ...]] = ("dflash.py",)
    """Files of :mod:`dflash_trainer.model.modeling` an export ships, the class's own last."""
    warm_starts_from: ClassVar[tuple[str, ...]] = ()
    """Variants whose exports or checkpoints may start this one (``model.init_from``): their
    weights are copied by name, this variant's own modules keep their identity init."""
    export_prefixes: ClassVar[tuple[str, ...]] = ()
    """State-dict prefixes of the variant's own tensors, exported beside ``layers.*``, ``fc``
    and the norms."""
    report: ClassVar[ReportLines] = ReportLines()
    llama_cpp_spec_type: ClassVar[str] = "draft-dflash"
    """``llama-server --spec-type`` that drafts with this variant's exports (converted to GGUF
    by llama.cpp's ``convert_hf_to_gguf.py``)."""
    prunes_vocab: ClassVar[bool] = True
    """Whether its drafters may draft from a pruned vocabulary (``model.draft_vocab_size``:
    their own LM head rows and the ``d2t`` table)."""
    llama_cpp_prunes_vocab: ClassVar[bool] = False
    """Whether llama.cpp's ``convert_hf_to_gguf.py`` converts its exports with a pruned
    draft vocabulary (the ``d2t`` table)."""
    vllm_method: ClassVar[str] = "dflash"
    """vLLM's ``--speculative-config`` ``method`` for this variant's exports (with
    ``num_speculative_tokens`` = the block size - 1: the block's first row is the verified
    token)."""

    @property
    def model_class(self) -> type[DFlashDraftModel]:
        """The modeling class: its modules, their init (``_init_weights``) and its drafting step
        (``propose``); :attr:`architecture` in the last of :attr:`modeling_files`."""
        module = importlib.import_module(f"{modeling.__name__}.{Path(self.modeling_files[-1]).stem}")
        return getattr(module, self.architecture)

    def modeling_paths(self) -> tuple[Path, ...]:
        """The paths of :attr:`modeling_files`."""
        folder = Path(modeling.__file__).parent
        return tuple(folder / name for name in self.modeling_files)

    def settings(self, model_cfg: ModelConfig, target: PretrainedConfig) -> dict[str, Any]:
        """The ``dflash_config`` keys :attr:`model_class` reads beyond the backbone's, from the
        run's ``model`` section (defaults filled in, checked against the target's text config:
        a :class:`~dflash_trainer.core.errors.ConfigError` names the option)."""
        del model_cfg, target
        return {}

    def config_fields(self) -> dict[str, Any]:
        """Top-level config keys of this variant's drafters (set on a built drafter's config
        and written to ``config.json`` after ``model_type``)."""
        return {}

    def export_fields(self, model: DFlashDraftModel) -> dict[str, Any]:
        """Top-level ``config.json`` keys of an export of ``model`` (after ``model_type``):
        :meth:`config_fields`, and keys read off the drafter where an engine reads them at the
        top level."""
        del model
        return self.config_fields()

    def export_section(self, model: DFlashDraftModel) -> dict[str, Any]:
        """The ``dflash_config`` keys an export adds to the backbone's, read off ``model``."""
        del model
        return {}

    def loss_terms(self, drafter: DFlashDraftModel, training: TrainingConfig) -> LossTerms | None:
        """The training terms of ``drafter`` under the ``training`` section, or None (the
        backbone's loss alone). May freeze the variant's modules that a zero weight leaves
        untrained (DDP refuses parameters that get no gradient)."""
        del drafter, training
        return None
