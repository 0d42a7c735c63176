"""``dflash-trainer report RUN_DIR``: plots and an index.html from a run's own files.

Reads ``metrics.jsonl`` (written by the JSONL tracker), ``eval/*.json`` and
``eval/*/results.json`` (final evaluations: ``tau``, ``acceptance_hist`` = counts for
acceptance lengths 1..B, per-prompt results with their acceptance traces) and ``config.yaml``;
writes ``report/*.png`` and ``report/index.html``.

The page opens with the answer to "did it work?": tau before and after training (with what it
was measured on, and tau per domain for a suite evaluation), the lossless check, the decode
speedup (marked when the evaluation found it unreliable), and the loss (with the length bucket
of every step underneath) and tau curves side by side. Then
a few evaluated answers with the accepted draft tokens highlighted, a per-prompt table, and
the remaining plots in a grid, each captioned with what a healthy curve looks like. A metric
the run did not log gives a "no data" plot, not an error. Figures are drawn without pyplot,
so the process-wide pyplot backend is left alone.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib
import yaml
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure

from dflash_trainer.config import Config
from dflash_trainer.evaluation.speedup import describe_measurement, format_speedup
from dflash_trainer.model.variants import VARIANTS

Series = tuple[list[int], list[float]]

QUEUE_DEPTH = r"pipe/queue/([^/]+)"
"""Channel depths; ``pipe/queue/{channel}/put_wait_s`` and the like are not depths."""


@dataclass(kw_only=True)
class MetricsLog:
    """``metrics.jsonl`` as one merged record per step, in step order."""

    records: list[dict[str, Any]]
    bad_lines: list[int] = field(default_factory=list)
    """1-based numbers of lines that were not a JSON object with an integer "step"."""
    rewinds: int = 0
    """Times the step went back (a resume from an earlier checkpoint)."""
    first_time: float | None = None
    last_time: float | None = None

    def series(self, key: str) -> Series:
        """(steps, values) of a scalar metric, finite values only."""
        steps, values = [], []
        for record in self.records:
            value = record.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                steps.append(record["step"])
                values.append(float(value))
        return steps, values

    def family(self, pattern: str) -> dict[str, Series]:
        """Series of every key matching ``pattern`` (one group: the label), sorted naturally."""
        regex = re.compile(pattern)
        labels: dict[str, str] = {}
        for record in self.records:
            for key in record:
                match = regex.fullmatch(key)
                if match and key not in labels:
                    labels[key] = match.group(1)
        ordered = sorted(labels.items(), key=lambda kv: _natural_key(kv[1]))
        found = {label: self.series(key) for key, label in ordered}
        return {label: s for label, s in found.items() if s[0]}

    def last(self, key: str) -> Any:
        """The value of ``key`` in the last record that has it, or None."""
        for record in reversed(self.records):
            if key in record:
                return record[key]
        return None

    def step_buckets(self) -> tuple[list[float], list[int]]:
        """(edges, buckets) of every logged micro-batch (``data/step_buckets``): micro-batch i
        spans steps ``edges[i]..edges[i + 1]``; a window's micro-batches share its steps evenly."""
        edges: list[float] = []
        buckets: list[int] = []
        previous = 0
        for record in self.records:
            values = record.get("data/step_buckets")
            step = record["step"]
            if isinstance(values, list) and values and step > previous:
                if not edges or edges[-1] != previous:
                    if edges:  # a gap (windows without the list): no colour there
                        edges.append(float(previous))
                        buckets.append(-1)
                    else:
                        edges.append(float(previous))
                width = (step - previous) / len(values)
                edges.extend(previous + width * (i + 1) for i in range(len(values)))
                buckets.extend(int(v) for v in values)
            previous = step
        return edges, buckets


def _natural_key(text: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


def read_metrics(path: str | Path) -> MetricsLog:
    """Parse ``metrics.jsonl``; lines for the same step merge (e.g. an eval logged after the
    step's metrics). When the step goes back (a resumed run re-running steps), the records
    from that step on are dropped: the resumed run's lines replace them. Unreadable lines
    (e.g. one cut short by a crash) are counted in ``bad_lines``, never silently dropped.
    """
    by_step: dict[int, dict[str, Any]] = {}
    log = MetricsLog(records=[])
    max_step: int | None = None
    with Path(path).open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                log.bad_lines.append(number)
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if not isinstance(step, int) or isinstance(step, bool):
                log.bad_lines.append(number)
                continue
            if max_step is not None and step < max_step:
                log.rewinds += 1
                by_step = {s: r for s, r in by_step.items() if s < step}
                max_step = step
            max_step = step if max_step is None else max(max_step, step)
            by_step.setdefault(step, {"step": step}).update(record)
            t = record.get("time")
            if isinstance(t, (int, float)):
                log.first_time = t if log.first_time is None else min(log.first_time, t)
                log.last_time = t if log.last_time is None else max(log.last_time, t)
    log.records = [by_step[s] for s in sorted(by_step)]
    return log


@dataclass(kw_only=True)
class EvalResult:
    """One ``eval/*.json`` file."""

    name: str
    data: dict[str, Any]

    @property
    def tau(self) -> float | None:
        tau = self.data.get("tau")
        return float(tau) if isinstance(tau, (int, float)) else None

    @property
    def traced_requests(self) -> list[dict[str, Any]]:
        """``per_prompt`` entries that carry an acceptance trace with texts."""
        requests = self.data.get("per_prompt")
        if not isinstance(requests, list):
            return []
        return [r for r in requests if isinstance(r, dict) and isinstance(r.get("trace"), list)
                and r["trace"] and all(isinstance(e, dict) and "text" in e for e in r["trace"])]

    def speedup_label(self, prefix: str = "") -> str | None:
        """``{prefix}speedup`` with its reliability mark (``0.78 (unreliable: ...)``); None when
        the file has no such field."""
        if f"{prefix}speedup" not in self.data:
            return None
        return format_speedup(self.data[f"{prefix}speedup"], self.data.get(f"{prefix}speedup_reliable"),
                              self.data.get(f"{prefix}speedup_unreliable_reasons"))

    @property
    def measured_on(self) -> str | None:
        """What the tau was measured on, e.g. ``8 mtbench prompts x 64 tokens`` or ``suite:
        mtbench, humaneval, math``: a tau means little without its domain. None when the file
        does not say."""
        if self.domains:
            return "suite: " + ", ".join(self.domains)
        # eval writes prompts_source and a prompt count in prompts; the demo the source in prompts.
        source = self.data.get("prompts_source", self.data.get("prompts"))
        count = self.data.get("num_prompts", self.data.get("prompts"))
        if not isinstance(source, str):
            return None
        label = f"{count} {source} prompts" if isinstance(count, int) else f"{source} prompts"
        tokens = self.data.get("max_new_tokens")
        return label + (f" x {tokens} tokens" if isinstance(tokens, int) else "")

    @property
    def domains(self) -> dict[str, dict[str, Any]]:
        """The per-domain summaries of a suite evaluation (``domains``); empty for other files."""
        domains = self.data.get("domains")
        if not isinstance(domains, dict):
            return {}
        return {str(k): v for k, v in domains.items() if isinstance(v, dict)}

    @property
    def engines(self) -> dict[str, dict[str, Any]]:
        """The ``engines`` section of an ``eval --engine`` result: per engine its per-domain rows,
        totals, or ``error``; empty for other files."""
        engines = self.data.get("engines")
        if not isinstance(engines, dict):
            return {}
        return {str(k): v for k, v in engines.items() if isinstance(v, dict)}

    @property
    def acceptance_hist(self) -> list[float] | None:
        hist = self.data.get("acceptance_hist")
        if isinstance(hist, list) and hist and all(isinstance(c, (int, float)) for c in hist):
            return [float(c) for c in hist]
        return None


def read_evals(eval_dir: Path) -> tuple[list[EvalResult], list[str]]:
    """Eval results in ``eval_dir`` and, for files that are not one, why (shown in the report)."""
    results: list[EvalResult] = []
    skipped: list[str] = []
    if not eval_dir.is_dir():
        return results, skipped
    paths = [(path.stem, path) for path in sorted(eval_dir.glob("*.json"))]
    paths += [(path.parent.name, path) for path in sorted(eval_dir.glob("*/results.json"))]
    for name, path in paths:
        shown = path.relative_to(eval_dir)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            skipped.append(f"{shown}: not readable JSON ({exc})")
            continue
        if not isinstance(data, dict) or ("tau" not in data and "acceptance_hist" not in data):
            skipped.append(f"{shown}: no 'tau' or 'acceptance_hist' field")
            continue
        results.append(EvalResult(name=name, data=data))
    return results, skipped


# --- plots ---------------------------------------------------------------------------------

def _figure(title: str, xlabel: str = "step", ylabel: str = "") -> tuple[Figure, Any]:
    fig = Figure(figsize=(7.0, 4.0), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _maybe_log_scale(ax: Any, values: list[float]) -> None:
    """Log y axis when the values are positive and span more than a decade and a half."""
    if values and min(values) > 0 and max(values) / min(values) > 30:
        ax.set_yscale("log")


def _no_data(path: Path, title: str, wanted: str) -> None:
    fig, ax = _figure(title)
    ax.set_axis_off()
    ax.text(0.5, 0.5, f"no data\n({wanted})", ha="center", va="center", fontsize=14,
            color="gray", transform=ax.transAxes)
    fig.savefig(path)


def _lines(path: Path, title: str, series: dict[str, Series], *, wanted: str,
           ylabel: str = "", logy: bool = False) -> None:
    """One line per series; a "no data" plot when there is none."""
    series = {label: s for label, s in series.items() if s[0]}
    if not series:
        _no_data(path, title, wanted)
        return
    fig, ax = _figure(title, ylabel=ylabel)
    for label, (steps, values) in series.items():
        ax.plot(steps, values, label=label, marker="." if len(steps) < 50 else None)
    if logy:
        _maybe_log_scale(ax, [v for _, values in series.values() for v in values])
    if len(series) > 1:
        ax.legend(fontsize=8, ncol=2 if len(series) > 8 else 1)
    fig.savefig(path)


def _plot_acc_pos(path: Path, log: MetricsLog) -> None:
    slots = log.family(r"train/acc_pos/(\d+)")
    if not slots:
        _no_data(path, "Accuracy per block slot", "train/acc_pos/{k}")
        return
    fig, ax = _figure("Accuracy per block slot", ylabel="accuracy")
    cmap = matplotlib.colormaps["viridis"]
    # A variant's own per-slot accuracies (of its drafting path), dashed beside each slot's.
    paths = [(log.family(re.escape(name).replace(re.escape("{k}"), r"(\d+)")), suffix)
             for variant in VARIANTS.values() for name, suffix in variant.report.slot_paths.items()]
    for i, (k, (steps, values)) in enumerate(slots.items()):
        ax.plot(steps, values, color=cmap(i / max(1, len(slots) - 1)), label=f"slot {k}")
        for family, suffix in paths:
            if k in family:
                ax.plot(*family[k], color=cmap(i / max(1, len(slots) - 1)), linestyle="--",
                        label=f"slot {k}, {suffix}")
    steps, values = log.series("train/acc")
    if steps:
        ax.plot(steps, values, color="black", linewidth=2.0, label="mean (train/acc)")
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(path)


def _plot_grad_norm(path: Path, log: MetricsLog) -> None:
    series = {"mean": log.series("train/grad_norm"), "max": log.series("train/grad_norm_max")}
    series = {label: s for label, s in series.items() if s[0]}
    if not series:
        _no_data(path, "Gradient norm", "train/grad_norm, train/grad_norm_max")
        return
    # A running total: a window skipped steps where the total grew.
    steps_logged, totals = log.series("train/skipped_nonfinite")
    skipped = [s for s, v, before in zip(steps_logged, totals, [0.0, *totals]) if v > before]
    title = "Gradient norm" + (" (red: windows with steps skipped as non-finite)"
                               if skipped else "")
    fig, ax = _figure(title, ylabel="L2 norm before clipping")
    for label, (steps, values) in series.items():
        ax.plot(steps, values, label=label)
    for step in skipped:
        ax.axvline(step, color="red", alpha=0.4, linewidth=1)
    _maybe_log_scale(ax, [v for _, values in series.values() for v in values])
    ax.legend(fontsize=8)
    fig.savefig(path)


def _plot_tau(path: Path, log: MetricsLog, evals: list[EvalResult]) -> None:
    sim, ev = log.series("train/tau_sim"), log.series("eval/tau")
    finals = [(e.name, e.tau) for e in evals if e.tau is not None]
    if not sim[0] and not ev[0] and not finals:
        _no_data(path, "Acceptance length (tau)", "train/tau_sim, eval/tau")
        return
    fig, ax = _figure("Acceptance length (tau)", ylabel="tau")
    if sim[0]:
        ax.plot(*sim, label="train/tau_sim (simulated, training batches)")
    for variant in VARIANTS.values():
        for name, label in variant.report.tau.items():
            series = log.series(name)
            if series[0]:
                ax.plot(*series, label=label)
    if ev[0]:
        ax.plot(*ev, marker="o", linestyle="--", label="eval/tau (in training)")
    greys = ("#555555", "#999999", "#bbbbbb")
    for i, (name, tau) in enumerate(finals):
        # In the legend, not as text on the line: final evals often sit at the same tau.
        ax.axhline(tau, linestyle=(0, (1, 1 + i)), color=greys[i % len(greys)],
                   label=f"eval/{name} (final): {tau:.2f}")
    ax.legend(fontsize=8)
    fig.savefig(path)


def _plot_acceptance(path: Path, log: MetricsLog, evals: list[EvalResult]) -> None:
    hists = {e.name: e.acceptance_hist for e in evals if e.acceptance_hist}
    for e in evals:  # a suite's domains side by side
        for domain, d in e.domains.items():
            hist = d.get("acceptance_hist")
            if isinstance(hist, list) and hist and all(isinstance(c, (int, float)) for c in hist):
                hists[f"{e.name}/{domain}"] = [float(c) for c in hist]
    if not hists:
        for record in reversed(log.records):
            hist = record.get("eval/acceptance_hist")
            if (isinstance(hist, list) and hist
                    and all(isinstance(c, (int, float)) for c in hist) and sum(hist) > 0):
                hists = {f"step {record['step']} (in training)": [float(c) for c in hist]}
                break
    hists = {name: h for name, h in hists.items() if sum(h) > 0}
    if not hists:
        _no_data(path, "Acceptance length histogram", "eval/*.json acceptance_hist")
        return
    fig, ax = _figure("Acceptance length histogram",
                      xlabel="acceptance length (tokens per verification step)",
                      ylabel="fraction of steps")
    ax.set_xticks(range(1, max(len(h) for h in hists.values()) + 1))
    width = 0.8 / len(hists)
    for i, (name, hist) in enumerate(hists.items()):
        total = sum(hist)
        xs = [k + (i - (len(hists) - 1) / 2) * width for k in range(1, len(hist) + 1)]
        ax.bar(xs, [c / total for c in hist], width=width, label=name)
    ax.legend(fontsize=8)
    fig.savefig(path)


def _plot_loss(path: Path, log: MetricsLog, evals: list[EvalResult]) -> None:
    """The training loss, and under it a strip with the length bucket of every micro-batch."""
    steps, values = log.series("train/loss")
    if not steps:
        _no_data(path, "Training loss", "train/loss")
        return
    fig = Figure(figsize=(7.0, 4.4), dpi=100, layout="constrained")
    ax, strip = fig.subplots(2, 1, sharex=True, height_ratios=[6, 1])
    ax.plot(steps, values, marker="." if len(steps) < 50 else None)
    ax.set_title("Training loss")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    _maybe_log_scale(ax, values)
    edges, buckets = log.step_buckets()
    strip.set_yticks([])
    strip.set_xlabel("step")
    strip.set_ylabel("bucket", rotation=0, ha="right", va="center")
    if not buckets:
        strip.text(0.5, 0.5, "no per-step bucket ids (data/step_buckets) in metrics.jsonl",
                   ha="center", va="center", fontsize=8, color="gray", transform=strip.transAxes)
        fig.savefig(path)
        return
    count = max(buckets) + 1
    palette = matplotlib.colormaps["tab10"]
    colours = ["#ffffff"] + [palette(i % 10) for i in range(count)]
    norm = BoundaryNorm([b - 0.5 for b in range(-1, count + 1)], len(colours))
    strip.pcolormesh(edges, [0, 1], [buckets], cmap=ListedColormap(colours), norm=norm)
    from matplotlib.patches import Patch

    labels = [f"{b}" + (" shortest" if b == 0 and count > 1 else " longest" if b == count - 1 and count > 1
                         else "") for b in range(count)]
    strip.legend([Patch(color=colours[b + 1]) for b in range(count)], labels, loc="upper center",
                 bbox_to_anchor=(0.5, -0.9), ncol=min(count, 8), fontsize=7, frameon=False,
                 handlelength=1.0, columnspacing=1.0)
    fig.savefig(path)


@dataclass(kw_only=True)
class Plot:
    """One image of the report."""

    file: str
    title: str
    draw: Callable[[Path, MetricsLog, list[EvalResult]], None]
    healthy: str = ""
    """One line: what a healthy curve looks like."""


def _simple(title: str, keys: dict[str, str], *, ylabel: str = "", logy: bool = False
            ) -> Callable[[Path, MetricsLog, list[EvalResult]], None]:
    def draw(path: Path, log: MetricsLog, evals: list[EvalResult]) -> None:
        _lines(path, title, {label: log.series(key) for label, key in keys.items()},
               wanted=", ".join(keys.values()), ylabel=ylabel, logy=logy)
    return draw


def _family(title: str, pattern: str, wanted: str, *, ylabel: str = "", prefix: str = ""
            ) -> Callable[[Path, MetricsLog, list[EvalResult]], None]:
    def draw(path: Path, log: MetricsLog, evals: list[EvalResult]) -> None:
        _lines(path, title, {prefix + k: s for k, s in log.family(pattern).items()},
               wanted=wanted, ylabel=ylabel)
    return draw


def _utilization(path: Path, log: MetricsLog, evals: list[EvalResult]) -> None:
    series = {f"{k} busy": s for k, s in log.family(r"pipe/([^/]+)/busy_frac").items()}
    series["data wait (train loop)"] = log.series("perf/data_wait_frac")
    # Training from a feature store: the reader's wait for batches (its busy time is above).
    series["store reader waits for batches"] = log.series("pipe/store/wait_frac")
    _lines(path, "Pipeline utilization", series,
           wanted="pipe/{stage}/busy_frac, perf/data_wait_frac", ylabel="fraction of time")


PLOTS: list[Plot] = [
    Plot(file="loss.png", title="Loss", draw=_plot_loss,
         healthy="Falls fast, then slowly. The strip shows the length bucket of each step: a jump that "
                 "lines up with a bucket change is a length effect, not instability."),
    Plot(file="tau.png", title="Acceptance length", draw=_plot_tau,
         healthy="Rises above 1.0 (1.0 = no draft accepted); tau_sim estimates it on training batches, "
                 "eval tau measures real speculative decoding."),
    Plot(file="acc_pos.png", title="Accuracy per block slot",
         draw=lambda p, log, e: _plot_acc_pos(p, log),
         healthy="Every slot rises; slot 1 highest, later slots lower (they draft further ahead)."),
    Plot(file="grad_norm.png", title="Gradient norm",
         draw=lambda p, log, e: _plot_grad_norm(p, log),
         healthy="Settles after warm-up; isolated spikes are fine, a steady climb or red lines "
                 "(non-finite steps) are not."),
    Plot(file="lr.png", title="Learning rate",
         draw=_simple("Learning rate", {"lr": "train/lr"}, ylabel="lr"),
         healthy="The configured schedule: a short warm-up, then constant or decaying."),
    Plot(file="tokens_per_s.png", title="Throughput",
         draw=_simple("Throughput", {"tokens/s": "perf/tokens_per_s"}, ylabel="tokens/s"),
         healthy="Flat after the first windows; dips are windows where the pipeline waited or an "
                 "evaluation ran."),
    Plot(file="padding_efficiency.png", title="Padding efficiency",
         draw=_simple("Padding efficiency (real / padded tokens)",
                      {"padding efficiency": "data/padding_efficiency"}, ylabel="fraction"),
         healthy="Close to 1: length buckets keep padding low."),
    Plot(file="seq_len.png", title="Sequence length",
         draw=_simple("Sequence length per batch",
                      {"mean": "data/seq_len_mean", "max": "data/seq_len_max"},
                      ylabel="tokens"),
         healthy="Varies with the buckets the window trained on; no trend over the run."),
    Plot(file="buckets.png", title="Batches per bucket",
         draw=_family("Batches dispatched per bucket (cumulative)",
                      r"data/bucket/(\d+)/dispatched", "data/bucket/{i}/dispatched",
                      ylabel="batches", prefix="bucket "),
         healthy="Straight lines: every bucket is drawn at a steady rate, in proportion to its size."),
    Plot(file="queues.png", title="Queue depths",
         draw=_family("Channel depth at log time", QUEUE_DEPTH, "pipe/queue/{channel}",
                      ylabel="items"),
         healthy="Queues not empty: the stages before the drafter keep up with it."),
    Plot(file="utilization.png", title="Pipeline utilization", draw=_utilization,
         healthy="Data wait of the train loop near 0; the target stage busy, the prefetcher mostly idle."),
    Plot(file="acceptance_hist.png", title="Acceptance histogram", draw=_plot_acceptance,
         healthy="Mass moves right with training: more verify steps commit several tokens."),
]
HEADLINE = ("loss.png", "tau.png")
"""Plots on the first screen, side by side; the others go to the grid."""


# --- summary and html ----------------------------------------------------------------------

def _fmt(value: Any, spec: str = "{:.4g}") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return spec.format(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def summarize(log: MetricsLog, evals: list[EvalResult],
              config: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(label, value) rows of the run summary; ``config`` (the run's config.yaml) names the
    configured bound next to the measured same-bucket run."""
    final_taus = [(e.name, e.tau) for e in evals if e.tau is not None]
    if len(final_taus) == 1:
        eval_tau = _fmt(final_taus[0][1])
    elif final_taus:
        eval_tau = ", ".join(f"{name}: {_fmt(tau)}" for name, tau in final_taus)
    else:
        eval_tau = _fmt(log.last("eval/tau"))
    wall = (None if log.first_time is None or log.last_time is None
            else log.last_time - log.first_time)
    skipped = max(log.series("train/skipped_nonfinite")[1], default=0)  # a running total
    runs = log.series("data/max_same_bucket_run")[1]
    pipeline = (config or {}).get("pipeline") or {}
    longest = _fmt(max(runs) if runs else None, "{:.0f}")
    if "max_run" in pipeline:
        longest += (f" (configured max_run {pipeline['max_run']}, order "
                    f"{pipeline.get('order', 'interleave')}; larger only when one bucket holds "
                    f"most batches)")
    rows = [
        ("steps", _fmt(log.records[-1]["step"] if log.records else None, "{:d}")),
        ("tokens", _fmt(log.last("train/tokens_total"), "{:,.0f}")),
        ("samples", _fmt(log.last("train/samples_total"), "{:,.0f}")),
        ("wall time (first to last log)", _duration(wall)),
        ("final loss", _fmt(log.last("train/loss"))),
        ("final acc", _fmt(log.last("train/acc"))),
        ("final tau_sim", _fmt(log.last("train/tau_sim"))),
        ("eval tau", eval_tau),
        ("tokens/s (last window)", _fmt(log.last("perf/tokens_per_s"), "{:,.0f}")),
        ("steps skipped (non-finite)", _fmt(skipped, "{:.0f}")),
        ("longest same-bucket run", longest),
    ]
    # A variant's own summary metrics, after the backbone's tau_sim, where the run logged them.
    at = rows.index(("final tau_sim", _fmt(log.last("train/tau_sim")))) + 1
    rows[at:at] = [(f"final {name.removeprefix('train/')} ({variant.title})", _fmt(log.last(name)))
                   for variant in VARIANTS.values() for name in variant.report.summary
                   if log.last(name) is not None]
    if log.last("train/label_in_vocab") is not None:
        rows.insert(at, ("labels in the draft vocabulary (last window)", _fmt(log.last("train/label_in_vocab"))))
    diverged = log.series("train/diverged_from_step")
    if diverged[0]:
        at, first = diverged[0][-1], diverged[1][-1]
        rows.append(("diverged", f"non-finite loss or gradient norm from step {first:.0f} to step {at}, where "
                                 "the run stopped (the console's last line names the source)"))
    if log.rewinds:
        rows.append(("resumes that re-ran logged steps", str(log.rewinds)))
    if log.bad_lines:
        shown = ", ".join(str(n) for n in log.bad_lines[:10])
        more = f" (+{len(log.bad_lines) - 10} more)" if len(log.bad_lines) > 10 else ""
        rows.append(("unreadable metrics.jsonl lines (skipped)", shown + more))
    return rows


@dataclass(kw_only=True)
class Verdict:
    """The first screen's numbers: tau before and after training, and the lossless check."""

    untrained_tau: float | None
    trained_tau: float | None
    trained_source: str
    lossless: bool | None
    lossless_source: str


def verdict(log: MetricsLog, evals: list[EvalResult]) -> Verdict:
    """Untrained tau: an eval file's ``untrained_tau`` (the demo) or the in-training eval at step
    0. Trained tau: the first eval file's ``tau``, else the last in-training eval. Lossless:
    every eval file (and the in-training evals) identical to the target's greedy output."""
    untrained = next((float(e.data["untrained_tau"]) for e in evals
                      if isinstance(e.data.get("untrained_tau"), (int, float))), None)
    steps, taus = log.series("eval/tau")
    if untrained is None and steps and steps[0] == 0:
        untrained = taus[0]
    final = next((e for e in evals if e.tau is not None), None)
    if final is not None:
        trained, source = final.tau, f"eval/{final.name}" + (f", {final.measured_on}" if final.measured_on else "")
    elif steps and steps[-1] > 0:
        trained, source = taus[-1], f"in-training eval, step {steps[-1]}"
    else:
        trained, source = None, "no evaluation"
    checks = [bool(v) for e in evals for k, v in e.data.items()
              if k in ("lossless", "untrained_lossless") and isinstance(v, bool)]
    sources = [f"eval/{e.name}" for e in evals if isinstance(e.data.get("lossless"), bool)]
    if not checks:
        checks = [bool(v) for v in log.series("eval/lossless")[1]]
        sources = ["in-training evals"] if checks else []
    return Verdict(untrained_tau=untrained, trained_tau=trained, trained_source=source,
                   lossless=all(checks) if checks else None,
                   lossless_source=", ".join(sources) or "not checked")


def _table(rows: Iterable[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                   for k, v in rows)
    return f"<table>{body}</table>"


def _card(label: str, value: str, note: str, css: str = "") -> str:
    return (f"<div class='card {css}'><div class='label'>{html.escape(label)}</div>"
            f"<div class='value'>{html.escape(value)}</div><div class='note'>{html.escape(note)}</div></div>")


def _first_screen(log: MetricsLog, evals: list[EvalResult]) -> str:
    v = verdict(log, evals)
    tau = f"{_fmt(v.untrained_tau, '{:.2f}')} \u2192 {_fmt(v.trained_tau, '{:.2f}')}"
    gained = (v.trained_tau is not None and v.untrained_tau is not None
              and v.trained_tau > v.untrained_tau)
    lossless = {True: "yes", False: "NO", None: "not checked"}[v.lossless]
    steps = log.records[-1]["step"] if log.records else None
    wall = (None if log.first_time is None or log.last_time is None
            else log.last_time - log.first_time)
    cards = [
        _card("acceptance length tau, untrained \u2192 trained", tau,
              f"tokens per target forward; 1.0 = no draft accepted ({v.trained_source})",
              "good" if gained else "bad" if v.trained_tau is not None else ""),
        _card("lossless", lossless, f"speculative output identical to the target's greedy output, or apart "
              f"only by numerics at a near tie{_lossless_counts(evals)} ({v.lossless_source})",
              {True: "good", False: "bad", None: ""}[v.lossless]),
        _card("training", f"{_fmt(steps, '{:d}')} steps",
              f"{_duration(wall)} wall time, final loss {_fmt(log.last('train/loss'))}"),
    ]
    speedup = next((e for e in evals if e.speedup_label() is not None), None)
    if speedup is not None:
        data = speedup.data
        reliable, reasons = data.get("speedup_reliable"), data.get("speedup_unreliable_reasons")
        value = format_speedup(data["speedup"], True)  # the bare figure; the mark goes below
        if reliable is False:
            value += " (unreliable)"
            note = "unreliable: " + ("; ".join(map(str, reasons)) if isinstance(reasons, list) else "see below")
        elif reliable is True:
            note = "target-only and speculative decodes timed side by side"
        else:
            note = "reliability not recorded"
        cards.append(_card("decode speedup", value, f"{note} (eval/{speedup.name})",
                           "bad" if reliable is False else ""))
    figures = "".join(_figure_html(p) for p in PLOTS if p.file in HEADLINE)
    domains = "".join(f"<h3>Tau per domain (eval/{html.escape(e.name)})</h3>{_domains_table(e)}"
                      for e in evals if e.domains)
    domains += "".join(f"<h3>Tau per domain and engine (eval/{html.escape(e.name)})</h3>{_engines_table(e)}"
                       for e in evals if e.engines)
    return (f"<h2>Did it work?</h2><div class='cards'>{''.join(cards)}</div>{domains}"
            f"<div class='pair'>{figures}</div>")


def _lossless_counts(evals: list[EvalResult]) -> str:
    """``: 3 identical, 7 by numerics, 0 wrong acceptances`` of the first evaluation that counted them."""
    for e in evals:
        counts = [e.data.get(k) for k in ("lossless_identical", "lossless_numerics", "lossless_failures")]
        if all(isinstance(c, int) for c in counts):
            return f": {counts[0]} identical, {counts[1]} by numerics, {counts[2]} wrong acceptances"
    return ""


def _domains_table(e: EvalResult) -> str:
    """A suite evaluation's tau per domain, with its prompts, tokens, speedup and lossless count."""
    def row(name: str, d: dict[str, Any]) -> str:
        requests, failures = d.get("requests"), d.get("lossless_failures")
        lossless = (f"{requests - failures}/{requests}" if isinstance(requests, int) and isinstance(failures, int)
                    and d.get("lossless") is not None else "-")
        speedup = format_speedup(d.get("speedup"), d.get("speedup_reliable"))
        cells = [name, _fmt(d.get("prompts"), "{:d}"), _fmt(d.get("tokens"), "{:d}"), _fmt(d.get("tau"), "{:.3f}"),
                 speedup, lossless]
        return "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"

    rows = "".join(row(name, d) for name, d in e.domains.items()) + row("all", e.data)
    return ("<table><tr><th>domain</th><th>prompts</th><th>tokens</th><th>tau</th><th>speedup</th>"
            f"<th>lossless</th></tr>{rows}</table>")


ENGINE_LABELS = {"llama.cpp": "llama.cpp", "vllm": "vLLM"}


def _engines_table(e: EvalResult) -> str:
    """``eval --engine``: tau per domain of the project's loop and of each engine, the outputs
    identical to plain serving and the engine's speedup; below, per engine its tokens/s, load,
    or why it did not run."""
    ran = {name: s for name, s in e.engines.items() if isinstance(s.get("domains"), dict)}
    domains = list(dict.fromkeys(d for s in ran.values() for d in s["domains"]))
    head = "<tr><th>domain</th><th>project tau</th>" + "".join(
        f"<th>{html.escape(ENGINE_LABELS.get(n, n))} tau</th><th>identical</th><th>speedup</th>" for n in ran) + "</tr>"
    rows = []
    for domain in domains:
        project = e.domains.get(domain, e.data if not e.domains else {})
        cells = [domain, _fmt(project.get("tau"), "{:.3f}")]
        for s in ran.values():
            d = s["domains"].get(domain)
            if not isinstance(d, dict):
                cells += ["-", "-", "-"]
                continue
            cells += [_fmt(d.get("tau"), "{:.3f}"), f"{_fmt(d.get('identical'))}/{_fmt(d.get('prompts'))}",
                      _fmt(d.get("speedup"), "{:.2f}x")]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    notes = []
    for name, s in e.engines.items():
        label = html.escape(ENGINE_LABELS.get(name, name))
        if "error" in s:
            notes.append(f"<li><b>{label}</b> did not run: {html.escape(str(s['error']).partition(chr(10))[0])}</li>")
            continue
        reliable = " (unreliable: " + "; ".join(map(str, s.get("speedup_unreliable_reasons") or [])) + ")" \
            if s.get("speedup_reliable") is False else ""
        notes.append(f"<li><b>{label}</b> ({html.escape(str(s.get('engine')))}): tokens/s plain "
                     f"{_fmt(s.get('plain_tokens_per_s'), '{:.1f}')}, with the drafter "
                     f"{_fmt(s.get('drafter_tokens_per_s'), '{:.1f}')}, speedup {_fmt(s.get('speedup'), '{:.2f}x')}"
                     f"{html.escape(reliable)} ({html.escape(str(s.get('timing')))}; 1-min load "
                     f"{_fmt(s.get('load_before'), '{:.2f}')} to {_fmt(s.get('load_after'), '{:.2f}')}); "
                     f"identical to plain serving {_fmt(s.get('identical'))}/{_fmt(s.get('prompts'))}</li>")
    table = f"<table>{head}{''.join(rows)}</table>" if ran else ""
    return f"{table}<ul>{''.join(notes)}</ul>"


def _figure_html(plot: Plot) -> str:
    return (f'<figure><img src="{html.escape(plot.file)}" alt="{html.escape(plot.title)}">'
            f"<figcaption><b>{html.escape(plot.title)}.</b> Healthy: {html.escape(plot.healthy)}"
            f"</figcaption></figure>")


ACCEPT_LEVELS = ((2, "a1"), (5, "a2"), (9, "a3"), (None, "a4"))
"""Highlight classes by accepted drafts in one step: 1-2, 3-5, 6-9, 10 or more."""


def _accept_class(accepted: int) -> str:
    return next(css for upper, css in ACCEPT_LEVELS if upper is None or accepted <= upper)


def _answer_html(request: dict[str, Any]) -> str:
    parts = []
    for entry in request["trace"]:
        text, bonus = str(entry.get("text", "")), str(entry.get("bonus", ""))
        accepted = int(entry.get("accepted", 0))
        if text:
            tip = (f"step {entry.get('step')}: {accepted} of {len(entry.get('drafted') or [])} drafts "
                   f"accepted; rejected: {entry.get('rejected', '')!r}")
            parts.append(f"<span class='acc {_accept_class(accepted)}' title='{html.escape(tip)}'>"
                         f"{html.escape(text)}</span>")
        parts.append(html.escape(bonus))
    return "".join(parts)


def _legend() -> str:
    items = []
    lower = 1
    for upper, css in ACCEPT_LEVELS:
        label = f"{lower}+" if upper is None else f"{lower}-{upper}"
        items.append(f"<span class='acc {css}'>&nbsp;{label}&nbsp;</span>")
        lower = (upper or lower) + 1
    return ("<p class='legend'>Highlighted: draft tokens the target accepted, darker for more "
            f"accepted in one verify step: {' '.join(items)}. Plain: the token the target produced "
            "itself at each step (the prefill's first token, and the bonus after each verify). "
            "Hover a span for its step and the rejected drafts.</p>")


def _prompts_section(evals: list[EvalResult], shown: int = 4) -> str:
    source = next((e for e in evals if e.traced_requests), None)
    if source is None:
        return ("<h2>Answers</h2><p>No per-prompt acceptance traces in eval/ "
                "(<code>dflash-trainer eval --drafter RUN/drafter --out RUN/eval/NAME</code> writes them).</p>")
    requests = source.traced_requests
    answers = "".join(
        f"<div class='answer'><div class='q'>{html.escape(str(r.get('id')))}, turn {int(r.get('turn', 0)) + 1}: "
        f"{html.escape(str(r.get('prompt_text', ''))[:300])}</div>"
        f"<div class='a'>{_answer_html(r)}</div></div>" for r in requests[:shown])
    rows = "".join(
        f"<tr><td>{html.escape(str(r.get('id')))}</td><td>{int(r.get('turn', 0)) + 1}</td>"
        f"<td>{_fmt(r.get('tau'), '{:.2f}')}</td><td>{_fmt(r.get('tokens'), '{:d}')}</td>"
        f"<td>{_fmt(r.get('steps'), '{:d}')}</td>"
        f"<td>{ {True: 'yes', False: 'NO', None: '-'}.get(r.get('lossless'), '-') }</td></tr>"
        for r in requests)
    table = ("<table><tr><th>prompt</th><th>turn</th><th>tau</th><th>tokens</th><th>verify steps</th>"
             f"<th>lossless</th></tr>{rows}</table>")
    return (f"<h2>Answers</h2><p>The first {min(shown, len(requests))} of {len(requests)} answers of "
            f"eval/{html.escape(source.name)}.</p>{_legend()}{answers}<h3>Per prompt</h3>{table}")


def _eval_section(evals: list[EvalResult], skipped: list[str]) -> str:
    parts = []
    for e in evals:
        rows = []
        for key, value in e.data.items():
            if key.endswith(("speedup_reliable", "speedup_unreliable_reasons")):
                continue  # folded into the speedup row
            if key in ("speedup", "untrained_speedup"):
                rows.append((key, e.speedup_label(key.removesuffix("speedup")) or "-"))
            elif key.endswith("speedup_measurement"):
                rows.append((key, describe_measurement(value)))
            elif isinstance(value, list) and key != "acceptance_hist":
                rows.append((key, f"{len(value)} entries"))
            elif not isinstance(value, (list, dict)):
                rows.append((key, _fmt(value)))
        hist = e.acceptance_hist
        if hist:
            rows.append(("acceptance_hist", ", ".join(f"{c:g}" for c in hist)))
        domains = f"<p>Per domain:</p>{_domains_table(e)}" if e.domains else ""
        if e.engines:
            domains += f"<p>Per domain and engine:</p>{_engines_table(e)}"
        parts.append(f"<h3>{html.escape(e.name)}</h3>{_table(rows)}{domains}")
    if skipped:
        parts.append("<p>Skipped files:</p><ul>"
                     + "".join(f"<li>{html.escape(s)}</li>" for s in skipped) + "</ul>")
    return "".join(parts) or "<p>No eval results in eval/.</p>"


_CSS = """body{font-family:sans-serif;margin:1.5em 2em;max-width:1500px;color:#222}
h1{font-size:1.5em;margin:0}.path{color:#777;font-size:.85em;margin:.2em 0 1em}
h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:3px 10px;text-align:left}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin-bottom:12px}
.card{flex:1;min-width:260px;border:1px solid #ccc;border-radius:6px;padding:10px 14px}
.card .label{color:#555;font-size:.9em}.card .value{font-size:2em;font-weight:bold;margin:.1em 0}
.card .note{color:#666;font-size:.8em}.card.good{border-color:#3a3;background:#f3fbf3}
.card.bad{border-color:#c33;background:#fdf3f3}
.pair,.grid{display:grid;grid-template-columns:1fr 1fr;gap:14px}
figure{margin:0}img{width:100%}figcaption{font-size:.85em;color:#444;margin-top:2px}
.answer{border:1px solid #ddd;border-radius:6px;margin:8px 0;padding:8px 12px}
.answer .q{color:#555;font-size:.85em;margin-bottom:4px}
.answer .a{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:.85em;line-height:1.5}
.acc{border-radius:3px}.a1{background:#d7f5d0}.a2{background:#a6e59a}.a3{background:#6fcf62}
.a4{background:#3ea637;color:#fff}.legend{font-size:.9em}
pre{background:#f6f6f6;padding:1em;overflow:auto}"""


def _html(run_dir: Path, *, first_screen: str, answers: str, rows: list[tuple[str, str]],
          evals: str, config_text: str | None) -> str:
    figures = "".join(_figure_html(p) for p in PLOTS if p.file not in HEADLINE)
    config = (f"<details><summary>config.yaml</summary><pre>{html.escape(config_text)}</pre></details>"
              if config_text is not None else "<p>No config.yaml in the run folder.</p>")
    title = html.escape(f"dflash-trainer run {run_dir.resolve().name}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
            f"<style>{_CSS}</style></head><body><h1>{title}</h1>"
            f"<p class='path'>{html.escape(str(run_dir))}</p>"
            f"{first_screen}{answers}<h2>Training</h2><div class='grid'>{figures}</div>"
            f"<h2>Summary</h2>{_table(rows)}"
            f"<h2>Evaluation</h2>{evals}<h2>Config</h2>{config}</body></html>\n")


def write_report(run_dir: str | Path) -> Path:
    """Write ``run_dir/report/`` (PNG plots and index.html); return the index.html path."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} does not exist: pass the run folder of a "
                                f"training run (the run_dir it was started with)")
    log = read_metrics(metrics_path)
    if log.bad_lines:
        warnings.warn(f"{metrics_path}: skipped {len(log.bad_lines)} unreadable line(s): "
                      f"{log.bad_lines[:10]}", stacklevel=2)
    evals, skipped = read_evals(run_dir / "eval")
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    for plot in PLOTS:
        plot.draw(out / plot.file, log, evals)
    config_path = run_dir / "config.yaml"
    config_text = config_path.read_text(encoding="utf-8") if config_path.is_file() else None
    try:
        config = yaml.safe_load(config_text) if config_text is not None else None
    except yaml.YAMLError:
        config = None  # shown as text below all the same
    index = out / "index.html"
    index.write_text(_html(run_dir, first_screen=_first_screen(log, evals), answers=_prompts_section(evals),
                           rows=summarize(log, evals, config if isinstance(config, dict) else None),
                           evals=_eval_section(evals, skipped), config_text=config_text),
                     encoding="utf-8")
    return index


def main(cfg: Config, args: argparse.Namespace) -> int:
    """``dflash-trainer report RUN_DIR``; ``cfg`` is unused (the run's own config.yaml is read)."""
    try:
        index = write_report(args.run)
    except FileNotFoundError as exc:
        print(f"dflash-trainer report: {exc}", file=sys.stderr)
        return 2
    print(f"report written to {index}")
    return 0
