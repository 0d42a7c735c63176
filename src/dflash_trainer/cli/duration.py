"""The demo's expected duration, printed at start-up: the dtype probe's step time on this
machine, measured at start-up, scaled by measured ratios.

A demo step is not a probe step (the probe is an eighth of the demo's tokens, one layer per
side, no data pipeline), so the estimate is ``probe seconds x ratio``: training seconds per
optimizer step over probe seconds, and seconds per evaluation over probe seconds. Every
finished demo records its own ratios for this machine and these settings
(``demo-durations.json`` in the user cache directory, next to the probe's cache); until one
has, the ratios of :data:`DEFAULT_RATIOS` are used and the estimate says so. The ratios carry
the load of the run that measured them: an estimate is as good as the machine is as busy as it
was then.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trainer.core.fsutil import atomic_write_text, read_json_cache

log = logging.getLogger(__name__)

_CACHE_NAME = "demo-durations.json"


@dataclass(frozen=True, kw_only=True)
class DurationRatios:
    """How much longer the demo's parts take than one probe step, measured by a demo run."""

    step_per_probe: float
    """Training seconds per optimizer step (in-training evaluations and checkpoints included)
    over probe seconds."""
    eval_per_probe: float
    """Seconds of one evaluation of the drafter (the untrained and the trained one) over probe
    seconds."""
    source: str
    """Where the ratios come from, for the console line."""


DEFAULT_RATIOS = DurationRatios(
    step_per_probe=2.56, eval_per_probe=461.0,
    source="ratios of a 300-step demo on a quiet 2-core Xeon with AVX-512 bf16 "
           "(benchmarks/results/demo-duration-avx512bf16.json)")
"""Used until a demo on this machine has recorded its own ratios. Measured with the demo config
and ``training.max_steps=300``: 191 s of training, evaluations of 118 and 111 s, probe step
0.248 s, 1-minute load 0.5-2.0."""


def durations_cache_path() -> Path:
    """``demo-durations.json`` in the user cache directory."""
    from dflash_trainer.core.assets import cache_root

    return cache_root() / _CACHE_NAME


def settings_key(*, probe_key: str, settings: dict[str, Any]) -> str:
    """The cache key of a machine (``probe_key``: CPU, torch, threads, target) and the settings
    that decide a demo step's and an evaluation's cost."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return f"{probe_key} | settings {digest}"


@dataclass(frozen=True, kw_only=True)
class DurationEstimate:
    """The expected seconds of a demo's training and its two evaluations."""

    steps: int
    probe_s: float
    ratios: DurationRatios

    @property
    def step_s(self) -> float:
        """Expected training seconds per optimizer step."""
        return self.probe_s * self.ratios.step_per_probe

    @property
    def eval_s(self) -> float:
        """Expected seconds of one evaluation."""
        return self.probe_s * self.ratios.eval_per_probe

    @property
    def total_s(self) -> float:
        """Expected seconds from now to the end: two evaluations and the training."""
        return 2 * self.eval_s + self.steps * self.step_s

    def describe(self) -> str:
        """The start-up line."""
        return (f"demo: expected about {_minutes(self.total_s)} ({self.steps} steps at "
                f"~{self.step_s:.2f} s, two evaluations of ~{_minutes(self.eval_s)}), from this "
                f"machine's probe step ({self.probe_s:.3f} s) and the {self.ratios.source}; "
                f"longer when the machine is busier than it was then")


def _minutes(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"


def recorded_ratios(key: str, *, cache_path: Path | None = None) -> DurationRatios | None:
    """The ratios the last demo with this key recorded, or None."""
    path = cache_path or durations_cache_path()
    entry = read_json_cache(path, what="demo durations cache").get(key)
    try:
        step, evaluation = float(entry["step_per_probe"]), float(entry["eval_per_probe"])
    except (TypeError, KeyError, ValueError):
        return None
    if not (math.isfinite(step) and math.isfinite(evaluation) and step > 0 and evaluation > 0):
        return None
    return DurationRatios(step_per_probe=step, eval_per_probe=evaluation,
                          source="ratios the last demo on this machine measured (demo-durations.json "
                                 "in the user cache)")


def estimate(key: str, *, steps: int, probe_s: float,
             cache_path: Path | None = None) -> DurationEstimate:
    """The expected duration: this machine's recorded ratios, else :data:`DEFAULT_RATIOS`."""
    ratios = recorded_ratios(key, cache_path=cache_path) or DEFAULT_RATIOS
    return DurationEstimate(steps=steps, probe_s=probe_s, ratios=ratios)


def measured_ratios(*, probe_s: float, train_s: float, steps: int,
                    eval_s: list[float]) -> dict[str, float]:
    """The ratios a finished demo measured (for its results and the cache)."""
    return {"step_per_probe": round(train_s / max(steps, 1) / probe_s, 3),
            "eval_per_probe": round(sum(eval_s) / len(eval_s) / probe_s, 1)}


def record(key: str, ratios: dict[str, float], *, cache_path: Path | None = None) -> None:
    """Keep a finished demo's ratios for the next estimate on this machine (best effort: a cache
    that cannot be written costs only the next estimate's accuracy)."""
    path = cache_path or durations_cache_path()
    data = read_json_cache(path, what="demo durations cache")
    data[key] = ratios
    try:
        atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True))
    except OSError as exc:
        log.warning("could not record the demo's durations in %s (%s)", path, exc)
