"""Decode speedup measured side by side, with the machine's load recorded around it.

A speedup is a quotient of two timings, so both must be taken under the same conditions: for
each prompt the target-only decode and the speculative decode run back to back (which goes
first alternates from prompt to prompt), under one torch thread count. Nothing else can make a
speedup: :class:`TimingRun` times the pairs itself and :class:`SpeedupMeasurement` is built only
from its pairs, so a baseline timed at another moment has no way in.

Definitions (prefill excluded, see :mod:`dflash_trainer.evaluation.spec_decode`), over the pairs i whose
decodes both produced a token after the prefill::

    speedup = (sum_i T_i / sum_i n_i) / (sum_i S_i / sum_i m_i)

T_i, n_i: target-only decode seconds and tokens; S_i, m_i: speculative decode seconds and
tokens. At temperature 0 the outputs are equal, so n_i = m_i and the speedup is sum T / sum S.

The figure is marked unreliable when

- *the machine was busy*: the work of other processes, ``other``, is the largest of the mean
  number of runnable threads besides the caller sampled just before and just after the run
  (``/proc/stat``), and the 1-minute load average after the run minus the evaluation's own
  threads; busy means ``other > cpus - threads + BUSY_MARGIN``: other work wanted more than
  the cores the evaluation left free, by over half a core;
- *the per-prompt timings scatter*: the cost of one speculative verify step in units of one
  target-only decode step, ``(S_i / steps_i) / (T_i / n_i)``, should not depend on the prompt
  (a per-prompt speedup does, through the prompt's acceptance length, so it is not compared);
  over prompts with at least ``MIN_STEPS`` of both, max / min above ``SCATTER_BOUND`` means
  the two arms ran under different conditions. Quiet runs measured 1.05-1.23, loaded ones
  up to 5.7.

The thread count is chosen once, at the start, from the cores that are free then
(:func:`free_core_threads`); one busy neighbour on a 2-core machine leaves the evaluation one
thread instead of two threads fighting it for one core.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash_trainer.evaluation.spec_decode import Decoded

__all__ = ["BUSY_MARGIN", "MIN_STEPS", "SCATTER_BOUND", "Clock", "LoadSample", "MachineProbe", "PairedTiming",
           "PairedTimer", "SpeedupMeasurement", "TimingRun", "describe_measurement", "format_speedup",
           "free_core_threads", "load_average", "others_running", "usable_cpus"]

Clock = Callable[[], float]
"""Seconds, monotonic (``time.perf_counter``); injectable for tests."""

SCATTER_BOUND = 1.5
"""Largest max / min of the per-prompt verify-step cost that still counts as one condition."""
BUSY_MARGIN = 0.5
"""Cores of other work beyond the free ones that are tolerated (load averages are noisy)."""
MIN_STEPS = 4
"""Prompts with fewer verify steps or target decode steps are too short for the scatter check."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average; None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def others_running(samples: int = 10, interval_s: float = 0.05) -> float | None:
    """Mean number of runnable threads besides the calling one, sampled ``samples`` times.

    Read from ``/proc/stat`` (``procs_running``, which counts the reading thread too); unlike
    the load average it does not lag, so work that just ended does not count. None off Linux.
    """
    counts = []
    for k in range(samples):
        try:
            with open("/proc/stat", encoding="ascii") as stat:
                line = next((row for row in stat if row.startswith("procs_running ")), None)
        except OSError:
            return None
        if line is None:
            return None
        counts.append(int(line.split()[1]) - 1)
        if k + 1 < samples:
            time.sleep(interval_s)
    return sum(counts) / len(counts)


def free_core_threads(cpus: int, others: float | None) -> int:
    """Threads for an evaluation: the cores other work leaves free, rounded, at least 1 (all
    ``cpus`` when the other work is unknown)."""
    if others is None:
        return cpus
    return max(1, min(cpus, math.floor(cpus - others + 0.5)))


@dataclass(frozen=True, kw_only=True)
class MachineProbe:
    """Where a run reads the machine's state; replaced in tests."""

    cpus: Callable[[], int] = usable_cpus
    load_average: Callable[[], float | None] = load_average
    others_running: Callable[[], float | None] = others_running


@dataclass(frozen=True, kw_only=True)
class LoadSample:
    """The machine at one moment."""

    load_1m: float | None
    """1-minute load average."""
    others_running: float | None
    """Mean runnable threads besides the caller (see :func:`others_running`)."""

    @classmethod
    def read(cls, probe: MachineProbe) -> LoadSample:
        """Sample the machine through ``probe``."""
        return cls(load_1m=probe.load_average(), others_running=probe.others_running())


@dataclass(frozen=True, kw_only=True)
class PairedTiming:
    """The two decodes of one prompt, timed back to back by a :class:`TimingRun`."""

    index: int
    """Position in the run (0-based)."""
    target_first: bool
    threads: int
    target_s: float
    target_tokens: int
    spec_s: float
    spec_tokens: int
    spec_steps: int
    """Target verify steps of the speculative decode."""

    @property
    def speedup(self) -> float | None:
        """Target-only seconds per decode token / speculative seconds per decode token."""
        if min(self.target_tokens, self.spec_tokens) == 0 or self.spec_s <= 0 or self.target_s <= 0:
            return None
        return (self.target_s / self.target_tokens) / (self.spec_s / self.spec_tokens)

    @property
    def step_cost(self) -> float | None:
        """One verify step in units of one target-only decode step (the scatter check's ratio)."""
        if min(self.target_tokens, self.spec_steps) == 0 or self.target_s <= 0:
            return None
        return (self.spec_s / self.spec_steps) / (self.target_s / self.target_tokens)


@dataclass(frozen=True, kw_only=True)
class SpeedupMeasurement:
    """The speedup of one run of paired timings and whether it can be trusted."""

    speedup: float | None
    """Ratio of sums over the pairs (module docstring); None without a usable pair."""
    reliable: bool | None
    """None when there is no speedup."""
    reasons: list[str] = field(default_factory=list)
    """Why it is unreliable, one short line each."""
    pairs: int
    threads: int
    cpus: int
    before: LoadSample
    after: LoadSample
    step_cost_scatter: float | None
    """max / min of the per-prompt verify-step cost; None with fewer than two long prompts."""
    step_cost: float | None
    """One verify step (drafting included) in target-only decode steps, pooled over the pairs:
    the speedup is tau / step_cost, so this is the break-even tau."""

    @classmethod
    def from_pairs(cls, timings: list[PairedTiming], *, threads: int, cpus: int, before: LoadSample,
                   after: LoadSample) -> SpeedupMeasurement:
        """Apply the definitions and the reliability rule of the module docstring."""
        used = [t for t in timings if t.speedup is not None]
        speedup = step_cost = None
        if used:
            target_rate = sum(t.target_s for t in used) / sum(t.target_tokens for t in used)
            spec_rate = sum(t.spec_s for t in used) / sum(t.spec_tokens for t in used)
            speedup = target_rate / spec_rate
            spec_steps = sum(t.spec_steps for t in used)
            if spec_steps:
                step_cost = sum(t.spec_s for t in used) / spec_steps / target_rate
        costs = [t.step_cost for t in used if min(t.spec_steps, t.target_tokens) >= MIN_STEPS]
        costs = [c for c in costs if c is not None and c > 0]
        scatter = max(costs) / min(costs) if len(costs) >= 2 else None
        reasons = []
        other = _other_load(before, after, threads)
        if other is not None and other > cpus - threads + BUSY_MARGIN:
            reasons.append(f"busy: load {other:.1f} from other work beside {threads} eval "
                           f"thread{'s' if threads > 1 else ''} on {cpus} cores")
        if scatter is not None and scatter > SCATTER_BOUND:
            reasons.append(f"scatter: per-prompt step cost varies {scatter:.2f}x (bound {SCATTER_BOUND:g}x)")
        return cls(speedup=speedup, reliable=None if speedup is None else not reasons, reasons=reasons,
                   pairs=len(timings), threads=threads, cpus=cpus, before=before, after=after,
                   step_cost_scatter=scatter, step_cost=step_cost)

    def summary_fields(self) -> dict[str, Any]:
        """The fields of ``results.json``: ``speedup``, ``speedup_reliable``,
        ``speedup_unreliable_reasons`` and the conditions in ``speedup_measurement``."""
        return {"speedup": self.speedup, "speedup_reliable": self.reliable,
                "speedup_unreliable_reasons": list(self.reasons),
                "speedup_measurement": {"method": "paired, alternating order", "pairs": self.pairs,
                                        "torch_threads": self.threads, "cpus": self.cpus,
                                        "load_1m_before": self.before.load_1m,
                                        "load_1m_after": self.after.load_1m,
                                        "others_running_before": self.before.others_running,
                                        "others_running_after": self.after.others_running,
                                        "step_cost": self.step_cost,
                                        "step_cost_scatter": self.step_cost_scatter,
                                        "scatter_bound": SCATTER_BOUND, "busy_margin": BUSY_MARGIN}}

    def label(self, spec: str = ".2f", *, short: bool = False) -> str:
        """The speedup for a console cell, with why it is unreliable when it is (``short``: only
        that it is, for a table whose notes give the reasons)."""
        return format_speedup(self.speedup, self.reliable, () if short else self.reasons, spec)


def _other_load(before: LoadSample, after: LoadSample, threads: int) -> float | None:
    candidates = [before.others_running, after.others_running]
    if after.load_1m is not None:
        candidates.append(after.load_1m - threads)
    known = [c for c in candidates if c is not None]
    return max(known) if known else None


def format_speedup(speedup: Any, reliable: Any, reasons: Any = (), spec: str = ".2f") -> str:
    """``0.42``, ``0.42 (unreliable: busy: ...)`` (``0.42 (unreliable)`` without reasons),
    ``n/a``; a figure from a file without a reliability mark (written before speedups were
    paired) says so."""
    if not isinstance(speedup, (int, float)) or isinstance(speedup, bool) or not math.isfinite(speedup):
        return "n/a"
    value = format(speedup, spec)
    if reliable is True:
        return value
    if reliable is False:
        if isinstance(reasons, (list, tuple)) and reasons:
            return f"{value} (unreliable: {'; '.join(str(r) for r in reasons)})"
        return f"{value} (unreliable)"
    return f"{value} (reliability not recorded)"


def pay_off_line(speedup: Any, step_cost: Any, tau: Any) -> str | None:
    """Whether the drafter pays in this measurement, and from which tau it would: the speedup is
    tau / step_cost (one verify step, drafting included, in target-only decode steps), so
    decoding gets faster from tau = step_cost, 1.3x at 1.3 x that and 2x at 2 x. None when the
    measurement lacks a figure."""
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
               for v in (speedup, step_cost, tau)):
        return None
    costs = (f"one verify step costs {step_cost:.2f} plain decode steps here, so a drafter pays from "
             f"tau {step_cost:.2f} (1.3x at {1.3 * step_cost:.2f}, 2x at {2 * step_cost:.2f})")
    if speedup < 1:
        return f"the drafter does not pay on this machine: {costs}; this drafter's tau is {tau:.3f}"
    return f"the drafter pays on this machine ({speedup:.2f}x): {costs}; this drafter's tau is {tau:.3f}"


def describe_measurement(fields: Any) -> str:
    """One line on how a ``speedup_measurement`` entry of ``results.json`` was taken."""
    if not isinstance(fields, dict):
        return "not recorded"

    def num(key: str, spec: str = ".2f") -> str:
        value = fields.get(key)
        return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"

    return (f"{num('pairs', 'd')} prompts side by side in alternating order, {num('torch_threads', 'd')} "
            f"torch threads on {num('cpus', 'd')} cores, 1-min load {num('load_1m_before')} before and "
            f"{num('load_1m_after')} after, step-cost scatter {num('step_cost_scatter')}x "
            f"(bound {num('scatter_bound', 'g')}x)")


class TimingRun:
    """One run of paired timings under a fixed thread count; made by :meth:`PairedTimer.run`."""

    def __init__(self, *, clock: Clock, threads: int, cpus: int, before: LoadSample,
                 speculative_first: bool = False) -> None:
        self.clock = clock
        self.speculative_first = speculative_first
        self.threads = threads
        self.cpus = cpus
        self.before = before
        self.timings: list[PairedTiming] = []
        self._measurement: SpeedupMeasurement | None = None

    def pair(self, target: Callable[[Clock], Decoded],
             speculative: Callable[[Clock], Decoded]) -> tuple[Decoded, Decoded, PairedTiming]:
        """Run the target-only arm and the speculative arm of one prompt back to back, the
        target first on even pairs (odd ones with ``speculative_first``); each arm gets the
        run's clock and returns its decode."""
        import torch

        assert self._measurement is None, "the run is closed"
        target_first = (len(self.timings) % 2 == 0) != self.speculative_first
        results: dict[str, Decoded] = {}
        for name in (("target", "spec") if target_first else ("spec", "target")):
            # The same thread count for both arms, whatever ran in between.
            if torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
            results[name] = (target if name == "target" else speculative)(self.clock)
        baseline, spec = results["target"], results["spec"]
        timing = PairedTiming(index=len(self.timings), target_first=target_first, threads=self.threads,
                              target_s=baseline.decode_s, target_tokens=baseline.decode_tokens,
                              spec_s=spec.decode_s, spec_tokens=spec.decode_tokens,
                              spec_steps=len(spec.acceptance_lengths))
        self.timings.append(timing)
        return baseline, spec, timing

    def close(self, after: LoadSample) -> None:
        """End the run with the machine's state after it."""
        self._measurement = SpeedupMeasurement.from_pairs(self.timings, threads=self.threads, cpus=self.cpus,
                                                          before=self.before, after=after)

    @property
    def measurement(self) -> SpeedupMeasurement:
        """The run's speedup; available once the ``with`` block of :meth:`PairedTimer.run` ended."""
        assert self._measurement is not None, "the run is still open"
        return self._measurement


@dataclass(frozen=True, kw_only=True)
class PairedTimer:
    """How paired timings are taken: the thread count (None: the free cores at the start of
    each run), the clock and where the machine's load is read."""

    threads: int | None = None
    clock: Clock = time.perf_counter
    probe: MachineProbe = field(default_factory=MachineProbe)

    @contextmanager
    def run(self, *, speculative_first: bool = False) -> Iterator[TimingRun]:
        """Sample the load, set the torch threads, yield a :class:`TimingRun`; afterwards sample
        the load again, close the run and restore the previous thread count."""
        import torch

        cpus = self.probe.cpus()
        before = LoadSample.read(self.probe)
        threads = self.threads or free_core_threads(cpus, before.others_running)
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            run = TimingRun(clock=self.clock, threads=threads, cpus=cpus, before=before,
                            speculative_first=speculative_first)
            yield run
            run.close(LoadSample.read(self.probe))
        finally:
            torch.set_num_threads(previous)

