"""What one training step consumes: the padded :class:`Batch` (the prefetcher builds it, the
target stage and the objective read it) and the :class:`StepInput` (the batch with the target's
outputs for it, what the drafter step trains on).

It lives in the model layer so that the objective can read it without importing the pipeline
that carries it."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from dflash_trainer.model.target import TargetOutputs


def tensor_fields(cls: type) -> tuple[str, ...]:
    """Names of the fields of dataclass ``cls`` annotated as a tensor (optional or not).

    Derived from the annotations, so a tensor field added to :class:`Batch` or
    :class:`~dflash_trainer.model.target.TargetOutputs` is moved to the device and kept alive
    across streams without being listed anywhere else.
    """
    hints = typing.get_type_hints(cls)

    def holds_tensor(hint: Any) -> bool:
        return hint is torch.Tensor or torch.Tensor in typing.get_args(hint)

    return tuple(f.name for f in dataclasses.fields(cls) if holds_tensor(hints[f.name]))


@dataclass(frozen=True, kw_only=True)
class Batch:
    """One rank's batch for one step, right-padded with id 0.

    Padded positions have ``loss_mask`` False and ``attention_mask`` False. Host-side
    bookkeeping (ids, counts, position in the plan) is plain Python / numpy, so reading it
    never synchronizes with the device.
    """

    input_ids: torch.Tensor
    """[B, S] int64 token ids."""
    loss_mask: torch.Tensor
    """[B, S] bool: supervised (assistant) positions."""
    attention_mask: torch.Tensor
    """[B, S] bool: real (non-padding) positions."""
    seq_lens: torch.Tensor
    """[B] int64 real lengths."""
    anchors: torch.Tensor
    """[B, N] int64 anchor positions from the anchor sampler."""
    keep: torch.Tensor
    """[B, N] bool: which anchors are real (rows with few valid positions have fewer)."""
    sample_ids: np.ndarray
    """[B] dataset indices of the rows."""
    bucket: int
    epoch: int
    step: int
    """Step index inside the epoch's plan."""
    stream_index: int
    """Position in the prefetcher's output stream across epochs (round-robin dispatch key)."""
    num_tokens: int
    """Real tokens in the batch."""

    TENSORS: ClassVar[tuple[str, ...]]
    """The tensor fields (:func:`tensor_fields`): what :meth:`to` moves and pins."""

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch with its tensors on ``device`` (``non_blocking`` needs pinned memory)."""
        moved = {name: getattr(self, name).to(device, non_blocking=non_blocking)
                 for name in self.TENSORS}
        return dataclasses.replace(self, **moved)

    def pin_memory(self) -> Batch:
        """The batch with its tensors in page-locked memory, for asynchronous H2D copies."""
        return dataclasses.replace(self, **{name: getattr(self, name).pin_memory()
                                            for name in self.TENSORS})

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, padded length)."""
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    @classmethod
    def of_rows(cls, input_ids: torch.Tensor, loss_mask: torch.Tensor, *, anchors: torch.Tensor,
                keep: torch.Tensor, seq_lens: torch.Tensor | None = None) -> Batch:
        """A batch outside any plan (benchmarks, tests): rows of ``seq_lens`` (default: full
        width) real tokens, bucket/epoch/step 0."""
        rows, width = input_ids.shape
        if seq_lens is None:
            seq_lens = torch.full((rows,), width, dtype=torch.long, device=input_ids.device)
        attention = torch.arange(width, device=input_ids.device)[None, :] < seq_lens[:, None]
        return cls(input_ids=input_ids, loss_mask=loss_mask, attention_mask=attention,
                   seq_lens=seq_lens, anchors=anchors, keep=keep, sample_ids=np.arange(rows),
                   bucket=0, epoch=0, step=0, stream_index=0,
                   num_tokens=int(seq_lens.sum()))


Batch.TENSORS = tensor_fields(Batch)
_TARGET_TENSORS = tensor_fields(TargetOutputs)


@dataclass(frozen=True, kw_only=True)
class StepInput:
    """What the target stage hands the drafter step: the batch (on the device) and the
    target's outputs for it."""

    batch: Batch
    target: TargetOutputs
    ready: Any = None
    """A CUDA event recorded on the target stream after ``target`` was written (None on CPU)."""

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this input holds: the batch's and the target's (those set).

        The target stage writes all of them on its own CUDA stream (the batch's by its copy
        to the device, the target's by the forward) and the drafter step reads them on
        another; each needs ``record_stream`` there, or the caching allocator may hand a
        block still read by step N to the copy of batch N + 1.
        """
        values = [getattr(self.batch, name) for name in Batch.TENSORS]
        values += [getattr(self.target, name) for name in _TARGET_TENSORS]
        return [x for x in values if x is not None]
