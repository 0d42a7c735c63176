"""Pipelined training vs the same steps run sequentially in one thread, in one run.

    python -m benchmarks.pipeline [--config FILE] [--steps 8] [--warmup 2] [--threads 2/2 1/1 1/2 2/1]
                                 [--repeats 1] [--target smollm2] [--data sharegpt] [--out pipeline.json]
                                 [--set key=value ...]

Real components: everything from ``components.build`` (the trainer's one assembly: token
store, plans, target with its ``FeatureExtractor``, drafter objective, ``DrafterStep``),
and for the pipelined run the trainer's own ``TrainingPipeline`` (prefetcher -> target stage
-> the drafter step on the main thread), without checkpoints or trackers.

The sequential run does the same steps (same plan positions, same anchors) in the main
thread: collate, target forward, drafter step, one after the other. Each run skips
``--warmup`` steps before timing. ``--threads T/D`` sets torch intra-op threads of the target
thread (T) and of the drafter thread (D) of a pipelined run; a sequential run uses D.

Printed: tokens/s of each run and its ratio to the best sequential setting, the CPU time
the run got (on a shared machine the wall clock alone misleads), the drafter step's
``perf/data_wait_frac``, the busy fraction of each stage over the timed window, then medians
per setting over ``--repeats`` (runs alternate their order between repeats).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from dflash_trainer.training.components import Components, build
from dflash_trainer.config import Config, load_config
from dflash_trainer.core.distributed import DistInfo, resolve_device
from dflash_trainer.model.batch import StepInput
from dflash_trainer.training.pipeline.drafter_step import DrafterStep
from dflash_trainer.training.pipeline.metrics import combine
from dflash_trainer.training.pipeline.pipeline import PipelineSettings, TrainingPipeline

DEFAULTS = ("data.max_samples=200", "data.max_length=512", "model.num_layers=1",
            "training.num_anchors=32", "pipeline.tokens_per_batch=1024", "pipeline.device=cpu")
"""The benchmark's settings; ``--set`` overrides them (and any other config key)."""


@dataclass(kw_only=True)
class Parts:
    """What every run shares: the built components and the pipeline settings."""

    components: Components
    settings: PipelineSettings
    info: dict[str, Any] = field(default_factory=dict)
    """Settings to print with the results (model sizes, batch shapes, ...)."""

    @property
    def drafter_step(self) -> DrafterStep:
        """The trainer's drafter step."""
        return self.components.drafter_step

    @property
    def device(self) -> torch.device:
        """The device every run uses."""
        return self.components.device

    def epochs_for(self, num_steps: int) -> int:
        """Epochs of the plan needed to supply ``num_steps`` steps."""
        epochs, available = 0, 0
        while available < num_steps:
            length = self.components.plans.num_steps(epochs)
            if length == 0:
                raise ValueError("the batch plan has no steps: the data set is empty")
            available += length
            epochs += 1
        return epochs

    def pipeline(self, steps: int, target_threads: int | None = None) -> TrainingPipeline:
        """The trainer's pipeline over enough epochs for ``steps`` (not started), its target
        stage on ``target_threads`` torch threads (``pipeline.target_threads``)."""
        c = self.components
        settings = PipelineSettings(**{**asdict(self.settings), "epochs": self.epochs_for(steps),
                                       "target_threads": target_threads})
        return TrainingPipeline(data=c.data, plans=c.plans, extract=c.extractor,
                                drafter_step=c.drafter_step, dist=c.dist, settings=settings)


@dataclass(kw_only=True)
class RunResult:
    """One timed run: the window after the warmup steps."""

    mode: str
    threads: str
    steps: int
    tokens: int
    seconds: float
    tokens_per_s: float
    cpu_s: float
    """Process CPU time (all threads) in the window: on a shared machine, what this run got."""
    load_avg: float
    """1-minute load average at the end of the window (other processes included)."""
    data_wait_frac: float | None = None
    busy: dict[str, float] = field(default_factory=dict)
    """Busy fraction per stage over the timed window (prefetch, target, drafter)."""
    stage_s: dict[str, float] = field(default_factory=dict)
    """Sequential runs: seconds spent in collate, target and drafter over the window."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _StageTimer:
    """Seconds per named section; CUDA events on the current stream, no sync until ``total``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: list[tuple[str, Any, Any]] = []
        self.seconds: dict[str, float] = {}

    def start(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        """Host time measured by the caller."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def stop(self, name: str, began: Any) -> None:
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((name, began, end))
        else:
            self.add(name, time.perf_counter() - began)

    def total(self) -> dict[str, float]:
        _sync(self.device)
        for name, began, end in self._pending:
            self.add(name, began.elapsed_time(end) / 1e3)
        self._pending = []
        return dict(self.seconds)


def run_pipelined(parts: Parts, *, steps: int, warmup: int, target_threads: int | None = None,
                  drafter_threads: int | None = None) -> RunResult:
    """The trainer's pipeline: prefetch workers -> target stage thread -> the drafter step on
    this thread, as ``Trainer.train`` runs it."""
    previous = torch.get_num_threads()
    if drafter_threads:
        torch.set_num_threads(drafter_threads)
    drafter_step = parts.drafter_step
    start_step = drafter_step.optimizer_step
    pipe = parts.pipeline(steps + warmup, target_threads)
    tokens = 0
    try:
        with pipe:
            window_start, cpu_start = time.perf_counter(), time.process_time()
            inputs = pipe.step_inputs(
                until=lambda: drafter_step.optimizer_step - start_step >= steps + warmup)
            for i, item in enumerate(inputs):
                drafter_step.train_micro_batch(item)
                pipe.acknowledge(item.batch)
                if i >= warmup:
                    tokens += item.batch.num_tokens
                if i + 1 == warmup:
                    # Start the timed window: reset every stage's and the step's counters.
                    _sync(parts.device)
                    pipe.stage_metrics()
                    drafter_step.get_metrics()
                    window_start, cpu_start = time.perf_counter(), time.process_time()
            done = drafter_step.optimizer_step - start_step
            if done < steps + warmup:
                raise RuntimeError(f"the pipeline ended after {done} of {steps + warmup} steps")
            _sync(parts.device)
            seconds = time.perf_counter() - window_start
            cpu_s = time.process_time() - cpu_start
            stage_metrics = combine([pipe.stage_metrics()])
            step_metrics = combine([drafter_step.get_metrics()])
            pipe.close()  # the plan has more steps; stop the stages instead of draining them
    finally:
        torch.set_num_threads(previous)
    busy = {"prefetch": stage_metrics["pipe/prefetch/busy_frac"],
            "target": stage_metrics["pipe/target/busy_frac"],
            "drafter": min(1.0, step_metrics["perf/step_time_s"] * steps / seconds)}
    return RunResult(mode="pipelined", threads=f"{target_threads or previous}/"
                     f"{drafter_threads or previous}", steps=steps, tokens=tokens,
                     seconds=seconds, tokens_per_s=tokens / seconds, cpu_s=cpu_s,
                     load_avg=os.getloadavg()[0],
                     data_wait_frac=step_metrics["perf/data_wait_frac"], busy=busy)


def run_sequential(parts: Parts, *, steps: int, warmup: int,
                   threads: int | None = None) -> RunResult:
    """The same steps, collate -> target -> drafter, one after the other on this thread."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    # A pipeline that is never started: its prefetcher's collate (the real one) is used.
    collater = parts.pipeline(steps + warmup).prefetcher
    c = parts.components
    plans, extract, drafter_step = c.plans, c.extractor, c.drafter_step
    tokens = 0
    timer = _StageTimer(parts.device)
    positions = [(e, s) for e in range(parts.epochs_for(steps + warmup))
                 for s in range(plans.num_steps(e))][:steps + warmup]
    try:
        window_start, cpu_start = time.perf_counter(), time.process_time()
        for i, (epoch, step) in enumerate(positions):
            timed = i >= warmup
            began = time.perf_counter()
            batch = collater.collate(plans(epoch), step, i)
            if timed:
                timer.add("collate", time.perf_counter() - began)  # host work on any device
            began = timer.start()
            batch = batch.to(parts.device, non_blocking=True)
            target = extract(batch.input_ids, batch.attention_mask)
            if timed:
                timer.stop("target", began)
            began = timer.start()
            drafter_step.train_micro_batch(StepInput(batch=batch, target=target))
            if timed:
                timer.stop("drafter", began)
                tokens += batch.num_tokens
            if i + 1 == warmup:
                _sync(parts.device)
                drafter_step.get_metrics()
                window_start, cpu_start = time.perf_counter(), time.process_time()
        _sync(parts.device)
        seconds = time.perf_counter() - window_start
        cpu_s = time.process_time() - cpu_start
        drafter_step.get_metrics()
    finally:
        torch.set_num_threads(previous)
    stage_s = timer.total()
    busy = {name: min(1.0, s / seconds) for name, s in stage_s.items()}
    return RunResult(mode="sequential", threads=str(threads or previous), steps=steps,
                     tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, cpu_s=cpu_s,
                     load_avg=os.getloadavg()[0], busy=busy,
                     stage_s=stage_s)


def build_parts(cfg: Config) -> Parts:
    """The trainer's components for ``cfg`` (``components.build``, one rank)."""
    device = resolve_device(cfg.pipeline)
    c = build(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=device))
    plan = c.plans(0)
    rows_per_step = [len(s.batches[0]) for s in plan.steps]
    info = {
        "target": cfg.model.target, "target_layers": c.target.config.num_hidden_layers,
        "target_layer_ids": c.drafter.target_layer_ids,
        "drafter_layers": cfg.model.num_layers, "hidden": c.drafter.config.hidden_size,
        "num_anchors": cfg.training.num_anchors, "block_size": c.drafter.block_size,
        "samples": len(c.data), "mean_len": float(np.mean(c.data.lengths)),
        "tokens_per_batch": cfg.pipeline.tokens_per_batch,
        "mean_rows_per_step": float(np.mean(rows_per_step)), "steps_per_epoch": len(plan),
        "padding_efficiency": plan.stats.padding_efficiency,
        "prefetch_workers": cfg.pipeline.prefetch_workers, "device": str(device),
        "cpu_cores": os.cpu_count(), "torch_default_threads": torch.get_num_threads(),
    }
    return Parts(components=c, info=info,
                 settings=PipelineSettings.from_config(cfg, block_size=c.drafter.block_size))


def _parse_threads(text: str) -> tuple[int, int]:
    try:
        target, drafter = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--threads takes TARGET/DRAFTER thread counts such "
                                         f"as 2/2, got {text!r}") from None
    if target < 1 or drafter < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be >= 1, got {text!r}")
    return target, drafter


def format_table(results: Sequence[RunResult], reference_tokens_per_s: float | None) -> str:
    """Every run as a fixed-width table; ``vs seq`` is against ``reference_tokens_per_s``.

    ``cores`` is process CPU seconds per wall second (what the run got on a shared machine),
    ``tok/cpu-s`` the tokens per CPU second (throughput per core actually used), ``load``
    the 1-minute load average at the end of the run (this process included).
    """
    best_seq = reference_tokens_per_s
    header = (f"{'run':<11}{'threads':>8}{'tokens':>7}{'s':>7}{'tok/s':>7}{'vs seq':>7}"
              f"{'cores':>6}{'tok/cpu-s':>10}{'load':>6}{'wait':>7}  busy")
    lines = [header, "-" * (len(header) + 40)]
    for r in results:
        ratio = f"{r.tokens_per_s / best_seq:.2f}x" if best_seq else "-"
        wait = "-" if r.data_wait_frac is None else f"{r.data_wait_frac:.3f}"
        if r.mode == "sequential":
            busy = "collate {collate:.2f} target {target:.2f} drafter {drafter:.2f}".format(
                **{k: r.busy.get(k, 0.0) for k in ("collate", "target", "drafter")})
        else:
            busy = "prefetch {prefetch:.2f} target {target:.2f} drafter {drafter:.2f}".format(
                **r.busy)
        lines.append(f"{r.mode:<11}{r.threads:>8}{r.tokens:>7}{r.seconds:>7.1f}"
                     f"{r.tokens_per_s:>7.0f}{ratio:>7}{r.cpu_s / r.seconds:>6.2f}"
                     f"{r.tokens / max(r.cpu_s, 1e-9):>10.0f}{r.load_avg:>6.1f}{wait:>7}  {busy}")
    return "\n".join(lines)


def summarize(results: Sequence[RunResult]) -> dict[str, Any]:
    """Medians per setting, best pipelined vs best sequential, and the ideal overlap bound.

    Settings are compared by their median tokens/s over the repeats; ``per_cpu_ratio``
    compares tokens per CPU second, which does not depend on how much of a shared machine
    each run got.
    """
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.mode, r.threads), []).append(r)
    settings = []
    for (mode, threads), runs in groups.items():
        stage_names = sorted({k for r in runs for k in r.stage_s})
        settings.append({
            "mode": mode, "threads": threads, "runs": len(runs),
            "tokens_per_s": float(np.median([r.tokens_per_s for r in runs])),
            "tokens_per_cpu_s": float(np.median([r.tokens / max(r.cpu_s, 1e-9) for r in runs])),
            "data_wait_frac": (None if mode == "sequential" else
                               float(np.median([r.data_wait_frac for r in runs]))),
            "stage_s": {k: float(np.median([r.stage_s.get(k, 0.0) for r in runs]))
                        for k in stage_names},
        })
    out: dict[str, Any] = {"settings": settings}
    seq = [g for g in settings if g["mode"] == "sequential"]
    pipe = [g for g in settings if g["mode"] == "pipelined"]
    if seq and pipe:
        best_seq = max(seq, key=lambda g: g["tokens_per_s"])
        best_pipe = max(pipe, key=lambda g: g["tokens_per_s"])
        stages = best_seq["stage_s"]
        longest = max(stages.values()) if stages else 0.0
        out.update({
            "best_sequential": best_seq["threads"], "best_pipelined": best_pipe["threads"],
            "pipelined_vs_sequential": best_pipe["tokens_per_s"] / best_seq["tokens_per_s"],
            "per_cpu_ratio": best_pipe["tokens_per_cpu_s"] / best_seq["tokens_per_cpu_s"],
            # Perfect overlap on separate resources: the slowest stage alone sets the pace.
            "ideal_overlap_bound": (sum(stages.values()) / longest) if longest else math.nan,
            "data_wait_frac": best_pipe["data_wait_frac"],
        })
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """Medians per setting and the headline ratio."""
    lines = [f"{'median of':<11}{'threads':>8}{'runs':>5}{'tok/s':>8}{'tok/cpu-s':>10}{'wait':>7}"]
    for g in summary["settings"]:
        wait = "-" if g["data_wait_frac"] is None else f"{g['data_wait_frac']:.3f}"
        lines.append(f"{g['mode']:<11}{g['threads']:>8}{g['runs']:>5}{g['tokens_per_s']:>8.0f}"
                     f"{g['tokens_per_cpu_s']:>10.0f}{wait:>7}")
    if "pipelined_vs_sequential" in summary:
        lines.append(
            f"pipelined ({summary['best_pipelined']}) / sequential "
            f"({summary['best_sequential']}): {summary['pipelined_vs_sequential']:.2f}x tokens/s, "
            f"{summary['per_cpu_ratio']:.2f}x tokens per CPU second; ideal overlap bound from "
            f"the sequential stage times {summary['ideal_overlap_bound']:.2f}x; data_wait_frac "
            f"{summary['data_wait_frac']:.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Build the parts, run the sequential and pipelined variants, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each run")
    parser.add_argument("--threads", type=_parse_threads, nargs="+",
                        default=[(2, 2), (1, 1), (1, 2), (2, 1)],
                        help="TARGET/DRAFTER torch threads of each pipelined run")
    parser.add_argument("--sequential-threads", type=int, nargs="+", default=None,
                        help="torch threads of each sequential run (default: the distinct "
                             "drafter counts of --threads)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every setting this many times, in alternating order; the "
                             "summary uses medians")
    parser.add_argument("--config", default=None,
                        help="start from this config file (e.g. configs/demo-cpu.yaml) instead of "
                             "the benchmark's settings; --target/--data/--set still apply")
    parser.add_argument("--target", default="smollm2", help="model.target")
    parser.add_argument("--data", default="sharegpt", help="data.paths (one path)")
    parser.add_argument("--cache-dir", default=None, help="data.cache_dir")
    parser.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help=f"config overrides after the defaults {' '.join(DEFAULTS)}")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1, --warmup >= 0")

    overrides = [*(DEFAULTS if args.config is None else ()), f"model.target={args.target}",
                 f"data.paths=[{args.data}]"]
    if args.cache_dir:
        overrides.append(f"data.cache_dir={args.cache_dir}")
    cfg = load_config(args.config, [*overrides, *args.overrides])
    parts = build_parts(cfg)
    seq_threads = args.sequential_threads or sorted({d for _, d in args.threads}, reverse=True)
    results: list[RunResult] = []
    for repeat in range(args.repeats):
        runs: list[Callable[[], RunResult]] = [
            functools.partial(run_sequential, parts, steps=args.steps, warmup=args.warmup,
                              threads=t) for t in seq_threads]
        runs += [functools.partial(run_pipelined, parts, steps=args.steps, warmup=args.warmup,
                                   target_threads=t, drafter_threads=d) for t, d in args.threads]
        # Alternate the order, so a drift in machine load does not favour one mode.
        for run in runs if repeat % 2 == 0 else runs[::-1]:
            results.append(run())
    summary = summarize(results)

    info = parts.info
    print(f"target {info['target']} ({info['target_layers']} layers, features from "
          f"{info['target_layer_ids']}), drafter {info['drafter_layers']} layer(s), hidden "
          f"{info['hidden']}, {info['num_anchors']} anchors x block {info['block_size']}")
    print(f"{info['samples']} samples, mean length {info['mean_len']:.0f}, tokens_per_batch "
          f"{info['tokens_per_batch']} ({info['mean_rows_per_step']:.1f} rows/step, padding "
          f"efficiency {info['padding_efficiency']:.2f}), {info['prefetch_workers']} prefetch "
          f"workers, device {info['device']}, {info['cpu_cores']} cores, torch default "
          f"{info['torch_default_threads']} threads; {args.warmup} warmup + {args.steps} timed "
          f"steps per run")
    reference = max((g["tokens_per_s"] for g in summary["settings"]
                     if g["mode"] == "sequential"), default=None)
    print(format_table(results, reference))
    print(format_summary(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"info": info, "results": [asdict(r) for r in results],
                       "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
