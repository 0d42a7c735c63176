"""Pipelined training vs the same steps run sequentially in one thread, in one run.

    python benchmarks/pipeline.py [--steps 8] [--warmup 2] [--threads 2/2 1/1 1/2 2/1]
                                  [--repeats 1] [--target smollm2] [--data sharegpt] [--out pipeline.json]
                                  [--set key=value ...]

Real components: the token store from ``data.prepare.build_dataset``, the plan from
``data.buckets.build_plan``, the target from ``model.target.load_target`` with a
``FeatureExtractor``, the drafter objective, ``DrafterTrainLoop`` with its optimizer and
schedule, and for the pipelined run ``BatchPrefetcher`` -> ``TargetStage`` -> the loop on
the main thread, wired as ``train.Trainer.train`` wires them (no monitor or checkpoints).

The sequential run does the same steps (same plan positions, same anchors) in the main
thread: collate, target forward, drafter step, one after the other. Each run skips
``--warmup`` steps before timing. ``--threads T/D`` sets torch intra-op threads of the target
thread (T) and of the drafter thread (D) of a pipelined run; a sequential run uses D.

Printed: tokens/s of each run and its ratio to the best sequential setting, the CPU time
the run got (on a shared machine the wall clock alone misleads), the drafter loop's
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
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from dflash_trainer import assets
from dflash_trainer.config import Config, load_config
from dflash_trainer.data.buckets import Plan, build_plan
from dflash_trainer.data.prepare import build_dataset
from dflash_trainer.distributed import DistInfo, resolve_device
from dflash_trainer.model.blocks import sample_anchors
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.target import FeatureExtractor, load_target, resolve_mask_token_id
from dflash_trainer.optim import LRSchedule, build_optimizer
from dflash_trainer.pipeline.batch import Batch
from dflash_trainer.pipeline.channel import Channel
from dflash_trainer.pipeline.prefetch import BatchPrefetcher, TokenDataset
from dflash_trainer.pipeline.stage import Supervisor
from dflash_trainer.pipeline.target_stage import FeatureFn, TargetStage
from dflash_trainer.pipeline.train_loop import DrafterTrainLoop, StepInput

DEFAULTS = ("data.max_samples=200", "data.max_length=512", "model.num_layers=1",
            "training.num_anchors=32", "pipeline.tokens_per_batch=1024", "pipeline.device=cpu")
"""The benchmark's settings; ``--set`` overrides them (and any other config key)."""


@dataclass(kw_only=True)
class Parts:
    """What every run shares: data, plan, target feature function and the drafter loop."""

    dataset: TokenDataset
    plan_for: Callable[[int], Plan]
    extract: FeatureFn
    loop: DrafterTrainLoop
    device: torch.device
    num_anchors: int
    block_size: int
    seed: int
    prefetch_workers: int = 2
    batch_queue_size: int = 4
    feature_queue_size: int = 2
    info: dict[str, Any] = field(default_factory=dict)
    """Settings to print with the results (model sizes, batch shapes, ...)."""

    def epochs_for(self, num_steps: int) -> int:
        """Epochs of the plan needed to supply ``num_steps`` steps."""
        epochs, available = 0, 0
        while available < num_steps:
            length = len(self.plan_for(epochs))
            if length == 0:
                raise ValueError("the batch plan has no steps: the data set is empty")
            available += length
            epochs += 1
        return epochs

    def positions(self, num_steps: int) -> list[tuple[int, int]]:
        """(epoch, step) of the first ``num_steps`` steps, in stream order."""
        out = []
        epoch = 0
        while len(out) < num_steps:
            out += [(epoch, s) for s in range(len(self.plan_for(epoch)))]
            epoch += 1
        return out[:num_steps]


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


class _WithThreads:
    """The feature function, setting torch intra-op threads of the calling thread first.

    ``torch.set_num_threads`` is per thread once a thread ran a parallel op, so the target
    thread sets its own count here, on its first call.
    """

    def __init__(self, fn: FeatureFn, threads: int | None) -> None:
        self.fn = fn
        self.threads = threads
        self._local = threading.local()

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        if self.threads and not getattr(self._local, "set", False):
            torch.set_num_threads(self.threads)
            self._local.set = True
        return self.fn(input_ids, attention_mask)


def _extras(out: Any) -> dict[str, torch.Tensor]:
    return {name: value for name in ("target_labels", "final_hidden")
            if (value := getattr(out, name, None)) is not None}


def _prefetcher(parts: Parts, stop: threading.Event, outputs: Sequence[Channel],
                epochs: int) -> BatchPrefetcher:
    return BatchPrefetcher(
        parts.dataset, parts.plan_for, rank=0, num_workers=parts.prefetch_workers,
        out_channels=outputs, sample_anchors=sample_anchors, num_anchors=parts.num_anchors,
        block_size=parts.block_size, seed=parts.seed, pin_memory=parts.device.type == "cuda",
        stop=stop, epochs=epochs)


def run_pipelined(parts: Parts, *, steps: int, warmup: int, target_threads: int | None = None,
                  drafter_threads: int | None = None) -> RunResult:
    """Prefetch workers -> target stage thread -> drafter loop on this thread, as in training."""
    previous = torch.get_num_threads()
    if drafter_threads:
        torch.set_num_threads(drafter_threads)
    stop = threading.Event()
    batches = Channel("batches", parts.batch_queue_size, stop)
    features = Channel("features", parts.feature_queue_size, stop)
    prefetcher = _prefetcher(parts, stop, [batches], parts.epochs_for(steps + warmup))
    target = TargetStage(extract=_WithThreads(parts.extract, target_threads), inputs=batches,
                         output=features, device=parts.device, stop=stop)
    loop = parts.loop
    tokens, busy_drafter = 0, 0.0
    try:
        with Supervisor(stop) as sup:
            sup.add(prefetcher)
            sup.add(target)
            sup.start()
            items = sup.iterate(features)
            window_start, cpu_start = time.perf_counter(), time.process_time()
            for i in range(steps + warmup):
                wait_start = time.perf_counter()
                item = next(items, None)
                loop.note_wait(time.perf_counter() - wait_start)
                if item is None:
                    raise RuntimeError(f"the pipeline ended after {i} of {steps + warmup} steps")
                step_start = time.perf_counter()
                loop.train_micro_batch(item)
                prefetcher.acknowledge(item.batch)
                if i >= warmup:
                    tokens += item.batch.num_tokens
                    busy_drafter += time.perf_counter() - step_start
                if i + 1 == warmup:
                    # Start the timed window: reset every stage's and the loop's counters.
                    _sync(parts.device)
                    sup.get_metrics()
                    loop.get_metrics()
                    window_start, cpu_start = time.perf_counter(), time.process_time()
            _sync(parts.device)
            seconds = time.perf_counter() - window_start
            cpu_s = time.process_time() - cpu_start
            stage_metrics = sup.get_metrics()
            loop_metrics = loop.get_metrics()
            stop.set()  # the plan has more steps; stop the stages instead of draining them
    finally:
        torch.set_num_threads(previous)
    busy = {"prefetch": stage_metrics["pipe/prefetch/busy_frac"],
            "target": stage_metrics["pipe/target/busy_frac"],
            "drafter": min(1.0, busy_drafter / seconds)}
    return RunResult(mode="pipelined", threads=f"{target_threads or previous}/"
                     f"{drafter_threads or previous}", steps=steps, tokens=tokens,
                     seconds=seconds, tokens_per_s=tokens / seconds, cpu_s=cpu_s,
                     load_avg=os.getloadavg()[0],
                     data_wait_frac=loop_metrics["perf/data_wait_frac"], busy=busy)


def run_sequential(parts: Parts, *, steps: int, warmup: int,
                   threads: int | None = None) -> RunResult:
    """The same steps, collate -> target -> drafter, one after the other on this thread."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    # A prefetcher that is never started: only its collate (the real one) is used.
    collater = _prefetcher(parts, threading.Event(), [Channel("unused", 1, threading.Event())],
                           parts.epochs_for(steps + warmup))
    loop = parts.loop
    tokens = 0
    timer = _StageTimer(parts.device)
    try:
        window_start, cpu_start = time.perf_counter(), time.process_time()
        for i, (epoch, step) in enumerate(parts.positions(steps + warmup)):
            timed = i >= warmup
            began = time.perf_counter()
            batch: Batch = collater.collate(parts.plan_for(epoch), step, i)
            if timed:
                timer.add("collate", time.perf_counter() - began)  # host work on any device
            began = timer.start()
            batch = batch.to(parts.device, non_blocking=True)
            with torch.no_grad():
                out = parts.extract(batch.input_ids, batch.attention_mask)
            if timed:
                timer.stop("target", began)
            began = timer.start()
            loop.train_micro_batch(StepInput(batch=batch, features=out.features,
                                             extras=_extras(out)))
            if timed:
                timer.stop("drafter", began)
                tokens += batch.num_tokens
            if i + 1 == warmup:
                _sync(parts.device)
                loop.get_metrics()
                window_start, cpu_start = time.perf_counter(), time.process_time()
        _sync(parts.device)
        seconds = time.perf_counter() - window_start
        cpu_s = time.process_time() - cpu_start
        loop.get_metrics()
    finally:
        torch.set_num_threads(previous)
    stage_s = timer.total()
    busy = {name: min(1.0, s / seconds) for name, s in stage_s.items()}
    return RunResult(mode="sequential", threads=str(threads or previous), steps=steps,
                     tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, cpu_s=cpu_s,
                     load_avg=os.getloadavg()[0], busy=busy,
                     stage_s=stage_s)


def build_parts(cfg: Config) -> Parts:
    """The trainer's components for ``cfg``, built as ``train.Trainer`` builds them (1 rank)."""
    device = resolve_device(cfg.pipeline)
    bf16 = cfg.model.dtype == "bfloat16" or (cfg.model.dtype == "auto" and device.type == "cuda")
    dtype = torch.bfloat16 if bf16 else torch.float32
    torch.manual_seed(cfg.training.seed)
    target, tokenizer = load_target(str(assets.resolve_target(cfg.model.target)), device=device,
                                    dtype=dtype)
    store, _ = build_dataset(cfg, tokenizer=tokenizer, log=None)
    if len(store) == 0:
        raise ValueError("no training samples: check data.paths and data.max_samples")
    rows = target.get_input_embeddings().weight.shape[0]
    data_ids = np.unique(np.concatenate([np.asarray(store[i][0]) for i in range(len(store))]))
    mask_id = resolve_mask_token_id(tokenizer, rows, explicit=cfg.model.mask_token_id,
                                    forbidden_in_data=data_ids.tolist())
    drafter = build_drafter(cfg.model, target.config, mask_token_id=mask_id).to(device)
    extractor = FeatureExtractor(target, drafter.target_layer_ids, labels=cfg.training.labels,
                                 label_chunk_size=cfg.training.loss_chunk_size)
    objective = DFlashObjective.from_config(drafter, extractor.embed_weight,
                                            extractor.head_weight, cfg)
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.training)
    schedule = LRSchedule(optimizer, total_steps=10_000, cfg=cfg.training)
    loop = DrafterTrainLoop(
        objective=objective, parameters=params, optimizer=optimizer, schedule=schedule,
        cfg=cfg.training, dist_info=DistInfo(rank=0, world_size=1, local_rank=0, device=device),
        block_size=drafter.block_size,
        autocast_dtype=torch.bfloat16 if dtype == torch.bfloat16 else None)
    plans: dict[int, Plan] = {}

    def plan_for(epoch: int) -> Plan:
        if epoch not in plans:
            plans[epoch] = build_plan(store.lengths, cfg.pipeline, seed=cfg.training.seed,
                                      epoch=epoch, world_size=1)
        return plans[epoch]

    plan = plan_for(0)
    rows_per_step = [len(s.batches[0]) for s in plan.steps]
    info = {
        "target": cfg.model.target, "target_layers": len(target.model.layers),
        "target_layer_ids": drafter.target_layer_ids,
        "drafter_layers": cfg.model.num_layers, "hidden": drafter.config.hidden_size,
        "num_anchors": cfg.training.num_anchors, "block_size": drafter.block_size,
        "samples": len(store), "mean_len": float(np.mean(store.lengths)),
        "tokens_per_batch": cfg.pipeline.tokens_per_batch,
        "mean_rows_per_step": float(np.mean(rows_per_step)), "steps_per_epoch": len(plan),
        "padding_efficiency": plan.stats.padding_efficiency,
        "prefetch_workers": cfg.pipeline.prefetch_workers, "device": str(device),
        "cpu_cores": os.cpu_count(), "torch_default_threads": torch.get_num_threads(),
    }
    return Parts(dataset=store, plan_for=plan_for, extract=extractor, loop=loop, device=device,
                 num_anchors=cfg.training.num_anchors, block_size=drafter.block_size,
                 seed=cfg.training.seed, prefetch_workers=cfg.pipeline.prefetch_workers,
                 batch_queue_size=cfg.pipeline.batch_queue_size,
                 feature_queue_size=cfg.pipeline.feature_queue_size, info=info)


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
    parser.add_argument("--target", default="smollm2", help="model.target")
    parser.add_argument("--data", default="sharegpt", help="data.paths (one path)")
    parser.add_argument("--cache-dir", default=None, help="data.cache_dir")
    parser.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help=f"config overrides after the defaults {' '.join(DEFAULTS)}")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1, --warmup >= 0")

    overrides = [*DEFAULTS, f"model.target={args.target}", f"data.paths=[{args.data}]"]
    if args.cache_dir:
        overrides.append(f"data.cache_dir={args.cache_dir}")
    cfg = load_config(None, [*overrides, *args.overrides])
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
