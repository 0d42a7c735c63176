"""The padded training batch that travels from the prefetcher to the target stage."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch


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
    num_loss_tokens: int
    """Supervised positions in the batch (``loss_mask`` count)."""

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
