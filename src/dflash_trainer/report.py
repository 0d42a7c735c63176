"""``dflash-trainer report RUN_DIR``: plots and an index.html from a run's own files.

Reads ``metrics.jsonl`` (written by the JSONL tracker), ``eval/*.json`` (final evaluations:
``tau``, ``acceptance_hist`` = counts for acceptance lengths 1..B, per-prompt results) and
``config.yaml``; writes ``report/*.png`` and ``report/index.html``. A metric the run did not
log gives a "no data" plot, not an error. Figures are drawn without pyplot, so the
process-wide pyplot backend is left alone.
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
from matplotlib.figure import Figure

from dflash_trainer.config import Config

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
    for path in sorted(eval_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            skipped.append(f"{path.name}: not readable JSON ({exc})")
            continue
        if not isinstance(data, dict) or ("tau" not in data and "acceptance_hist" not in data):
            skipped.append(f"{path.name}: no 'tau' or 'acceptance_hist' field")
            continue
        results.append(EvalResult(name=path.stem, data=data))
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
    for i, (k, (steps, values)) in enumerate(slots.items()):
        ax.plot(steps, values, color=cmap(i / max(1, len(slots) - 1)), label=f"slot {k}")
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
    skipped = [s for s, v in zip(*log.series("train/skipped_nonfinite")) if v > 0]
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
    if ev[0]:
        ax.plot(*ev, marker="o", linestyle="--", label="eval/tau (in training)")
    for name, tau in finals:
        ax.axhline(tau, linestyle=":", color="gray")
        ax.annotate(f"{name}: {tau:.2f}", (0.01, tau), xycoords=("axes fraction", "data"),
                    fontsize=8, va="bottom")
    ax.legend(fontsize=8)
    fig.savefig(path)


def _plot_acceptance(path: Path, log: MetricsLog, evals: list[EvalResult]) -> None:
    hists = {e.name: e.acceptance_hist for e in evals if e.acceptance_hist}
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


@dataclass(kw_only=True)
class Plot:
    """One image of the report."""

    file: str
    title: str
    draw: Callable[[Path, MetricsLog, list[EvalResult]], None]


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
    _lines(path, "Pipeline utilization", series,
           wanted="pipe/{stage}/busy_frac, perf/data_wait_frac", ylabel="fraction of time")


PLOTS: list[Plot] = [
    Plot(file="loss.png", title="Loss", draw=_simple("Training loss", {"loss": "train/loss"},
                                                     ylabel="loss", logy=True)),
    Plot(file="acc_pos.png", title="Accuracy per block slot",
         draw=lambda p, log, e: _plot_acc_pos(p, log)),
    Plot(file="grad_norm.png", title="Gradient norm",
         draw=lambda p, log, e: _plot_grad_norm(p, log)),
    Plot(file="lr.png", title="Learning rate",
         draw=_simple("Learning rate", {"lr": "train/lr"}, ylabel="lr")),
    Plot(file="tokens_per_s.png", title="Throughput",
         draw=_simple("Throughput", {"tokens/s": "perf/tokens_per_s"}, ylabel="tokens/s")),
    Plot(file="padding_efficiency.png", title="Padding efficiency",
         draw=_simple("Padding efficiency (real / padded tokens)",
                      {"padding efficiency": "data/padding_efficiency"}, ylabel="fraction")),
    Plot(file="seq_len.png", title="Sequence length",
         draw=_simple("Sequence length per batch",
                      {"mean": "data/seq_len_mean", "max": "data/seq_len_max"},
                      ylabel="tokens")),
    Plot(file="buckets.png", title="Batches per bucket",
         draw=_family("Batches dispatched per bucket (cumulative)",
                      r"data/bucket/(\d+)/dispatched", "data/bucket/{i}/dispatched",
                      ylabel="batches", prefix="bucket ")),
    Plot(file="queues.png", title="Queue depths",
         draw=_family("Channel depth at log time", QUEUE_DEPTH, "pipe/queue/{channel}",
                      ylabel="items")),
    Plot(file="utilization.png", title="Pipeline utilization", draw=_utilization),
    Plot(file="tau.png", title="Acceptance length", draw=_plot_tau),
    Plot(file="acceptance_hist.png", title="Acceptance histogram", draw=_plot_acceptance),
]


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


def summarize(log: MetricsLog, evals: list[EvalResult]) -> list[tuple[str, str]]:
    """(label, value) rows of the run summary."""
    final_taus = [(e.name, e.tau) for e in evals if e.tau is not None]
    if len(final_taus) == 1:
        eval_tau = _fmt(final_taus[0][1])
    elif final_taus:
        eval_tau = ", ".join(f"{name}: {_fmt(tau)}" for name, tau in final_taus)
    else:
        eval_tau = _fmt(log.last("eval/tau"))
    wall = (None if log.first_time is None or log.last_time is None
            else log.last_time - log.first_time)
    skipped = sum(log.series("train/skipped_nonfinite")[1])
    runs = log.series("data/max_same_bucket_run")[1]
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
        ("longest same-bucket run", _fmt(max(runs) if runs else None, "{:.0f}")),
    ]
    if log.rewinds:
        rows.append(("resumes that re-ran logged steps", str(log.rewinds)))
    if log.bad_lines:
        shown = ", ".join(str(n) for n in log.bad_lines[:10])
        more = f" (+{len(log.bad_lines) - 10} more)" if len(log.bad_lines) > 10 else ""
        rows.append(("unreadable metrics.jsonl lines (skipped)", shown + more))
    return rows


def _table(rows: Iterable[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                   for k, v in rows)
    return f"<table>{body}</table>"


def _eval_section(evals: list[EvalResult], skipped: list[str]) -> str:
    parts = []
    for e in evals:
        rows = []
        for key, value in e.data.items():
            if isinstance(value, list) and key != "acceptance_hist":
                rows.append((key, f"{len(value)} entries"))
            elif not isinstance(value, (list, dict)):
                rows.append((key, _fmt(value)))
        hist = e.acceptance_hist
        if hist:
            rows.append(("acceptance_hist", ", ".join(f"{c:g}" for c in hist)))
        parts.append(f"<h3>{html.escape(e.name)}</h3>{_table(rows)}")
    if skipped:
        parts.append("<p>Skipped files:</p><ul>"
                     + "".join(f"<li>{html.escape(s)}</li>" for s in skipped) + "</ul>")
    return "".join(parts) or "<p>No eval results in eval/.</p>"


_CSS = """body{font-family:sans-serif;margin:2em;max-width:1500px}
table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:3px 10px;text-align:left}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(620px,1fr));gap:12px}
figure{margin:0}img{width:100%}pre{background:#f6f6f6;padding:1em;overflow:auto}"""


def _html(run_dir: Path, rows: list[tuple[str, str]], evals: str, config_text: str | None
          ) -> str:
    figures = "".join(
        f'<figure><img src="{html.escape(p.file)}" alt="{html.escape(p.title)}">'
        f"<figcaption>{html.escape(p.title)}</figcaption></figure>" for p in PLOTS)
    config = (f"<pre>{html.escape(config_text)}</pre>" if config_text is not None
              else "<p>No config.yaml in the run folder.</p>")
    title = html.escape(f"dflash-trainer run {run_dir.resolve().name}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
            f"<style>{_CSS}</style></head><body><h1>{title}</h1>"
            f"<p>{html.escape(str(run_dir.resolve()))}</p>"
            f"<h2>Summary</h2>{_table(rows)}<h2>Plots</h2><div class='grid'>{figures}</div>"
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
    index = out / "index.html"
    index.write_text(_html(run_dir, summarize(log, evals), _eval_section(evals, skipped),
                           config_text), encoding="utf-8")
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
