"""How each metric combines across data-parallel ranks, declared by the stage that reports it.

A stage's ``get_metrics()`` returns plain floats (each rank's own value; the ranks' values
are averaged: rates, fractions, values equal on every rank) or one of the kinds below. The
monitor gathers every rank's window once per log step and :func:`combine` applies each
metric's rule, so there is one cross-rank reduction and its rules are stated where the
metric is produced, not guessed from its name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Max", "MeanSpread", "Metric", "Min", "Ratio", "Sum", "combine"]


@dataclass(frozen=True)
class Sum:
    """Counted on each rank; the job's value is the sum (tokens, samples)."""

    value: float


@dataclass(frozen=True)
class Max:
    """The job's value is the largest rank's (grad_norm_max)."""

    value: float


@dataclass(frozen=True)
class Min:
    """The job's value is the smallest rank's (shortest sequence)."""

    value: float


@dataclass(frozen=True)
class Ratio:
    """``num / den`` over every rank's numerators and denominators (0 when ``den`` is 0):
    the loss over every rank's tokens, not a mean of per-rank means."""

    num: float
    den: float


@dataclass(frozen=True)
class MeanSpread:
    """Averaged over ranks; ``spread`` names a second metric, max minus min over ranks."""

    value: float
    spread: str


Metric = float | Sum | Max | Min | Ratio | MeanSpread


def combine(windows: Sequence[Mapping[str, Metric]]) -> dict[str, float]:
    """One float per metric from every rank's window (a single window: no other rank).

    A metric missing on some ranks is combined over the ranks that report it; a metric
    reported with different kinds by different ranks is an error.
    """
    out: dict[str, float] = {}
    for key in sorted({k for w in windows for k in w}):
        column = [w[key] for w in windows if key in w]
        kinds = {type(v) if not isinstance(v, (int, float)) else float for v in column}
        if len(kinds) > 1:
            raise TypeError(f"metric {key!r} is reported as {sorted(k.__name__ for k in kinds)}")
        first = column[0]
        if isinstance(first, Ratio):
            den = sum(v.den for v in column)  # type: ignore[union-attr]
            out[key] = sum(v.num for v in column) / den if den else 0.0  # type: ignore[union-attr]
        elif isinstance(first, Sum):
            out[key] = sum(v.value for v in column)  # type: ignore[union-attr]
        elif isinstance(first, Max):
            out[key] = max(v.value for v in column)  # type: ignore[union-attr]
        elif isinstance(first, Min):
            out[key] = min(v.value for v in column)  # type: ignore[union-attr]
        elif isinstance(first, MeanSpread):
            values = [v.value for v in column]  # type: ignore[union-attr]
            out[key] = sum(values) / len(values)
            if len(windows) > 1:
                out[first.spread] = max(values) - min(values)
        else:
            out[key] = sum(float(v) for v in column) / len(column)  # type: ignore[arg-type]
    return out
