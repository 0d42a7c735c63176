"""What one training step consumes: the padded :class:`Batch` (the prefetcher builds it, the
target stage and the objective read it) and the :class:`StepInput` (the batch with the target's
outputs for it, what the drafter step trains on).

It lives in the model layer so that the objective can read it without importing the pipeline
that carries it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dflash_trainer.model.target import TargetOutputs


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

    _TENSORS = ("input_ids", "loss_mask", "attention_mask", "seq_lens", "anchors", "keep")

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch with its tensors on ``device`` (``non_blocking`` needs pinned memory)."""
        moved = {name: getattr(self, name).to(device, non_blocking=non_blocking)
                 for name in self._TENSORS}
        return dataclasses.replace(self, **moved)

    def pin_memory(self) -> Batch:
        """The batch with its tensors in page-locked memory, for asynchronous H2D copies."""
        return dataclasses.replace(self, **{name: getattr(self, name).pin_memory()
                                            for name in self._TENSORS})

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


@dataclass(frozen=True, kw_only=True)
class StepInput:
    """What the target stage hands the drafter step: the batch (on the device) and the
    target's outputs for it."""

    batch: Batch
    target: TargetOutputs
    ready: Any = None
    """A CUDA event recorded on the target stream after ``target`` was written (None on CPU)."""

    def tensors(self) -> list[torch.Tensor]:
        """The target's tensors, for ``record_stream`` on the consuming stream."""
        t = self.target
        return [x for x in (t.features, t.target_labels, t.final_hidden) if x is not None]
