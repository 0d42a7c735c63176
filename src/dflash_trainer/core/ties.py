"""Exact ties among a position's top candidates.

``argmax`` and ``topk`` each break a tie between equal scores their own way, and which index
each lists first depends on the kernel (and so on the CPU's instruction set). Whoever checks that
a token "is the argmax" of some scores therefore asks whether it ties with the top score, never
whether it is the first index one function happened to list.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["top_ties"]


def top_ties(candidates: Sequence[tuple[int, float]]) -> list[int]:
    """The tokens of ``candidates`` (``(token, score)`` pairs, any order) whose score equals the
    highest one: every token an argmax over those scores may return. Empty for no candidates."""
    if not candidates:
        return []
    best = max(score for _, score in candidates)
    return [token for token, score in candidates if score == best]
