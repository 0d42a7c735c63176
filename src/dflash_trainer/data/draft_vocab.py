"""A pruned draft vocabulary chosen from the training data (``model.draft_vocab_size``).

The drafter's LM head then holds only the rows of the ``size`` tokens most frequent among the
data's supervised tokens (the tokens the loss mask trains on), so each step's loss and each
draft's head cost ``size / vocab`` of the full head's. Ties are broken by the lower token id,
so the same data always gives the same vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DraftVocab", "choose_draft_vocab", "supervised_token_counts"]


@dataclass(frozen=True, kw_only=True)
class DraftVocab:
    """The chosen tokens and how much of the data's supervision they cover."""

    token_ids: np.ndarray
    """The draft tokens' target ids, ascending (draft row i drafts ``token_ids[i]``)."""
    vocab_size: int
    """The target's vocabulary."""
    covered: int
    """Supervised tokens of the data that are draft tokens."""
    supervised: int
    """Supervised tokens of the data."""

    @property
    def coverage(self) -> float:
        """``covered / supervised`` (1 for data without supervised tokens)."""
        return self.covered / self.supervised if self.supervised else 1.0

    def describe(self) -> str:
        """One line: size, coverage and what the rest means."""
        return (f"draft vocabulary: the {len(self.token_ids):,} most frequent of {self.vocab_size:,} tokens "
                f"cover {100 * self.coverage:.2f}% of the training data's {self.supervised:,} supervised "
                f"tokens (model.draft_vocab_size); labels outside it are never drafted and are left "
                f"out of the loss")


def supervised_token_counts(data: Any, vocab_size: int) -> np.ndarray:
    """``[vocab_size]`` int64: how often each token is a supervised (loss-mask) token of
    ``data`` (a token store, or any sequence of ``(input_ids, loss_mask)`` samples)."""
    if hasattr(data, "supervised_token_counts"):
        return data.supervised_token_counts(vocab_size)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i in range(len(data)):
        ids, loss_mask = data[i]
        counts += np.bincount(np.asarray(ids)[np.asarray(loss_mask).astype(bool)],
                              minlength=vocab_size)[:vocab_size]
    return counts


def choose_draft_vocab(data: Any, size: int, vocab_size: int) -> DraftVocab:
    """The ``size`` tokens most frequent among ``data``'s supervised tokens (ties: lower id
    first; tokens the data never supervises fill the rest by id)."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"a draft vocabulary of {size} tokens does not fit a vocabulary of {vocab_size}")
    counts = supervised_token_counts(data, vocab_size)
    # A stable sort of -counts keeps equal counts in ascending id order.
    chosen = np.sort(np.argsort(-counts, kind="stable")[:size])
    return DraftVocab(token_ids=chosen, vocab_size=vocab_size, covered=int(counts[chosen].sum()),
                      supervised=int(counts.sum()))
