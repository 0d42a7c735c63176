"""The monitor: on the main thread, between steps, turns stage counters into logged metrics.

Every log interval it calls ``get_metrics()`` on each stage (which returns, and resets, what
the stage counted since its previous call), samples channel depths, gathers every rank's
window and combines each metric by the rule its stage declared
(:mod:`dflash_trainer.training.pipeline.metrics`; the one cross-rank reduction), derives rates and run
totals, and writes one dict to the trackers.

Kinds of values (the names are those of the README's metrics glossary):

- windowed, passed through: everything a stage reports except the counters below; means,
  maxima or last values over the window as the stage defines them (``train/loss``,
  ``train/grad_norm`` (mean), ``train/grad_norm_max``, ``train/lr`` (last),
  ``train/skipped_nonfinite`` (the run's running total, not the window's count),
  ``pipe/{stage}/busy_frac``, ...).
- windowed counters consumed by the monitor: ``train/tokens`` (non-padding tokens the train
  loop trained on in the window) and ``train/samples`` (sequences). They become
  ``perf/tokens_per_s`` and ``perf/samples_per_s`` (divided by the window's wall time) and the
  run totals ``train/tokens_total`` and ``train/samples_total``; they are not logged as such.
- accumulated: stages report ``data/bucket/{i}/dispatched`` (batches the prefetcher sent
  on) and ``data/bucket/{i}/trained`` (batches the drafter trained on) per window; the
  monitor logs the run total per bucket, every log, also for buckets idle in the window.
- sampled: ``pipe/queue/{channel}``, the items in each channel at log time.
- once: values handed to :meth:`Monitor.add_once` (the epoch's plan statistics) go into the
  next log only; they are the same on every rank and are not combined.

Run totals are part of ``state_dict()`` so they continue across a resume.
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from dflash_trainer.training.pipeline.metrics import Metric, combine
from dflash_trainer.training.trackers import Tracker

TOKENS = "train/tokens"
SAMPLES = "train/samples"
_ACCUMULATED = re.compile(r"data/bucket/\d+/(dispatched|trained)")


class HasMetrics(Protocol):
    """A pipeline stage as the monitor sees it."""

    def get_metrics(self) -> Mapping[str, Metric]:
        """Metrics since the previous call, under their logged names; resets the window."""
        ...


class HasDepth(Protocol):
    """A channel as the monitor sees it."""

    name: str
    capacity: int

    def qsize(self) -> int:
        """Items currently queued."""
        ...


class Monitor:
    """Polls stages and channels every ``every_steps`` steps (or ``every_s`` seconds).

    ``gather`` returns every rank's raw window (a collective, so it must be called at the same
    steps on every rank); so with a ``gather`` the time trigger, which ranks cannot agree on
    without a per-step collective, is ignored with a warning. ``clock`` is for tests.
    """

    def __init__(self, stages: Mapping[str, HasMetrics], channels: Mapping[str, HasDepth],
                 trackers: Tracker, *, every_steps: int, every_s: float | None = None,
                 gather: Callable[[dict[str, Metric]], list[dict[str, Metric]]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1 (logging.every_steps), got {every_steps}")
        if every_s is not None and every_s <= 0:
            raise ValueError(f"every_s must be > 0 (logging.every_s), got {every_s}")
        if every_s is not None and gather is not None:
            warnings.warn("logging.every_s has no effect in a multi-rank run: every rank must "
                          "log at the same steps; logging every logging.every_steps steps",
                          stacklevel=2)
            every_s = None
        self.stages = dict(stages)
        self.channels = dict(channels)
        self.trackers = trackers
        self.every_steps = every_steps
        self.every_s = every_s
        self.gather = gather
        self._clock = clock
        self._window_start = clock()
        self._last_step: int | None = None
        self._totals: dict[str, float] = {}
        self._once: dict[str, float] = {}

    def should_log(self, step: int) -> bool:
        """Whether ``maybe_log(step)`` would log."""
        if step == self._last_step:
            return False
        if step % self.every_steps == 0:
            return True
        return self.every_s is not None and self._clock() - self._window_start >= self.every_s

    def maybe_log(self, step: int) -> dict[str, float] | None:
        """Log the window ending at ``step`` (steps done) if an interval passed; return it."""
        if not self.should_log(step):
            return None
        return self._log(step)

    def final(self, step: int) -> dict[str, float] | None:
        """Log what is left since the last log (nothing if ``step`` was just logged).

        The trackers stay open: their owner closes them.
        """
        if step == self._last_step:
            return None
        return self._log(step)

    def add_once(self, metrics: Mapping[str, float]) -> None:
        """Log ``metrics`` with the next window, once (one record per logged step)."""
        self._once.update(metrics)

    def _poll(self) -> dict[str, Metric]:
        raw: dict[str, Metric] = {}
        owner: dict[str, str] = {}
        for stage_name, stage in self.stages.items():
            for key, value in stage.get_metrics().items():
                if key in raw:
                    raise ValueError(f"metric {key!r} is reported by both stage "
                                     f"{owner[key]!r} and stage {stage_name!r}")
                owner[key] = stage_name
                raw[key] = value
        for channel_name, channel in self.channels.items():
            raw[f"pipe/queue/{channel_name}"] = float(channel.qsize())
        return raw

    def _log(self, step: int) -> dict[str, float]:
        raw = self._poll()
        window = combine(self.gather(raw) if self.gather is not None else [raw])
        now = self._clock()
        elapsed = now - self._window_start
        self._window_start = now
        self._last_step = step

        metrics: dict[str, float] = {}
        for key, value in window.items():
            if key in (TOKENS, SAMPLES):
                continue
            if _ACCUMULATED.fullmatch(key):
                self._totals[key] = self._totals.get(key, 0.0) + value
            else:
                metrics[key] = value
        for counter, rate in ((TOKENS, "perf/tokens_per_s"), (SAMPLES, "perf/samples_per_s")):
            if counter in window:
                total = counter + "_total"
                self._totals[total] = self._totals.get(total, 0.0) + window[counter]
                if elapsed > 0:
                    metrics[rate] = window[counter] / elapsed
        metrics.update(self._totals)
        metrics.update(self._once)
        self._once = {}
        self.trackers.log(metrics, step)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """Run totals, so a resumed run keeps counting from them."""
        return {"totals": dict(self._totals), "last_step": self._last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``; the window restarts now."""
        self._totals = {str(k): float(v) for k, v in state["totals"].items()}
        self._last_step = state["last_step"]
        self._window_start = self._clock()
