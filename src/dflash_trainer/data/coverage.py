"""Which supervised tokens the anchor rule can train: slot-k label coverage of a token store.

A block starts at a valid anchor a (``loss_mask[a]``, ``loss_mask[a + 1]``, ``a <= len - 2``;
see :func:`dflash_trainer.model.blocks.valid_anchors`) and its slot k is trained on token
``a + k`` when that token is supervised and inside the sample. A supervised token p can be a
slot-k label iff ``p - k`` is a valid anchor in the same sample. ``prepare`` prints these shares,
so a rule or a data set that leaves tokens untrained (answer endings, short answers) shows up
before training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dflash_trainer.data.cache import TokenStore

__all__ = ["DEFAULT_SLOTS", "SlotCoverage", "format_coverage", "mask_coverage", "store_coverage"]

DEFAULT_SLOTS = (1, 3, 15)
_CHUNK_TOKENS = 1 << 24


@dataclass(frozen=True)
class SlotCoverage:
    """Counts over a set of samples; :meth:`share` gives the fractions."""

    samples: int
    supervised_tokens: int
    labelled: dict[int, int]
    """Slot k -> supervised tokens that can be a slot-k label."""
    samples_without_anchor: int
    """Samples with no two consecutive supervised tokens: no block can start in them."""

    def share(self, slot: int) -> float:
        """Fraction of the supervised tokens that can be a label of ``slot`` (0 with none)."""
        return self.labelled[slot] / self.supervised_tokens if self.supervised_tokens else 0.0

    def __add__(self, other: SlotCoverage) -> SlotCoverage:
        if self.labelled.keys() != other.labelled.keys():
            raise ValueError(f"cannot add coverage of slots {sorted(self.labelled)} and "
                             f"{sorted(other.labelled)}")
        return SlotCoverage(samples=self.samples + other.samples,
                            supervised_tokens=self.supervised_tokens + other.supervised_tokens,
                            labelled={k: n + other.labelled[k] for k, n in self.labelled.items()},
                            samples_without_anchor=self.samples_without_anchor
                            + other.samples_without_anchor)


def mask_coverage(loss_mask: np.ndarray, lengths: np.ndarray, slots: Sequence[int]) -> SlotCoverage:
    """Coverage of samples stored back to back: ``loss_mask`` is their concatenated masks and
    ``lengths`` their token counts (``lengths.sum() == len(loss_mask)``)."""
    mask = np.asarray(loss_mask).astype(bool)
    lengths = np.asarray(lengths, dtype=np.int64)
    if int(lengths.sum()) != len(mask):
        raise ValueError(f"sample lengths sum to {int(lengths.sum())}, the mask has {len(mask)} tokens")
    starts = np.cumsum(lengths) - lengths
    position = np.arange(len(mask)) - np.repeat(starts, lengths)
    # a + 1 stays in a's sample iff a is not its sample's last token.
    last = np.zeros(len(mask), dtype=bool)
    last[(starts + lengths - 1)[lengths > 0]] = True
    anchor = mask & ~last
    anchor[:-1] &= mask[1:]
    labelled = {}
    for k in slots:
        if k < 1:
            raise ValueError(f"slot numbers start at 1, got {k}")
        # Token p is a slot-k label iff supervised, p - k in the same sample, p - k a valid anchor.
        hit = mask[k:] & anchor[:-k] & (position[k:] >= k)
        labelled[k] = int(hit.sum())
    sample_of = np.repeat(np.arange(len(lengths)), lengths)
    anchors_per_sample = np.bincount(sample_of[anchor], minlength=len(lengths))
    return SlotCoverage(samples=len(lengths), supervised_tokens=int(mask.sum()), labelled=labelled,
                        samples_without_anchor=int((anchors_per_sample == 0).sum()))


def store_coverage(store: TokenStore, block_size: int,
                   slots: Sequence[int] = DEFAULT_SLOTS) -> SlotCoverage:
    """Coverage of every sample of ``store`` for the ``slots`` a block of ``block_size`` has
    (k <= block_size - 1; larger k are left out), read in chunks of about 16 M tokens."""
    slots = [k for k in slots if k <= block_size - 1]
    total = SlotCoverage(samples=0, supervised_tokens=0, labelled=dict.fromkeys(slots, 0),
                         samples_without_anchor=0)
    lengths = store.lengths
    ends = np.cumsum(lengths)
    first = 0
    while first < len(store):
        start = int(ends[first - 1]) if first else 0
        last = min(len(store), max(first + 1, int(np.searchsorted(ends, start + _CHUNK_TOKENS, "right"))))
        masks = [store[i][1] for i in range(first, last)]
        total = total + mask_coverage(np.concatenate(masks), lengths[first:last], slots)
        first = last
    return total


def format_coverage(coverage: SlotCoverage) -> str:
    """One line for ``prepare``: the share of supervised tokens each slot can train."""
    shares = ", ".join(f"slot {k} {100 * coverage.share(k):.1f}%" for k in coverage.labelled)
    line = f"supervised tokens that can be a slot-k label: {shares or 'no slots'}"
    if coverage.samples_without_anchor:
        line += (f"; {coverage.samples_without_anchor:,} of {coverage.samples:,} samples have no two "
                 f"consecutive supervised tokens and train nothing")
    return line
