"""The batch plan: length buckets, token-budget batches, step-aligned ranks, diversity-first order.

One epoch's plan is a pure function of (lengths, pipeline config, seed, epoch, world size), so
every rank builds the same plan and a resumed run rebuilds it. A step is one bucket and one
batch per data-parallel rank; batches are packed under ``tokens_per_batch`` counting padding
(rows * longest row). With ``order: interleave`` (the default) steps are ordered so that the
next bucket is drawn with probability proportional to its remaining steps, with at most
``max_run`` consecutive steps of one bucket whenever some order allows it (otherwise the
smallest achievable run, reported). ``order: shuffle`` is a plain shuffle of the same steps,
kept to measure what the interleaving changes (``benchmarks/interleave.py``).

Rank alignment: a bucket's batch count is made a multiple of the world size by re-packing it
into more, smaller batches (balanced, so the ranks of a step do similar work). When a bucket
holds too few samples for that, its leftover samples join the next shorter bucket; only the
shortest bucket's leftovers (fewer than 2 * world_size samples) are dropped, and they are
counted in ``PlanStats.num_dropped`` and listed in ``Plan.dropped``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dflash_trainer.config import PipelineConfig

SORT_WINDOW = 1024
"""Samples sorted by length together before packing: less padding than random packing, but
batch composition still changes every epoch (a full sort would fix it up to ties)."""


@dataclass(frozen=True)
class Step:
    """One optimizer step: a bucket id and one array of dataset indices per rank."""

    bucket: int
    batches: tuple[np.ndarray, ...]


@dataclass(frozen=True, kw_only=True)
class PlanStats:
    """What the plan looks like; logged once per epoch."""

    num_samples: int
    """Samples in the plan (every sample once, except the dropped ones)."""
    num_dropped: int
    """Samples left out so that every rank gets a batch at every step."""
    num_carried: int
    """Samples moved to a shorter bucket to keep ranks aligned."""
    real_tokens: int
    padded_tokens: int
    padding_efficiency: float
    """real_tokens / padded_tokens over all batches."""
    max_run: int
    """Longest run of consecutive steps from one bucket."""
    run_limit: int
    """``max_run`` from the config, or the smallest achievable run when it is not; with
    ``order: shuffle``, which bounds nothing, the longest run itself."""
    steps_per_bucket: tuple[int, ...]
    samples_per_bucket: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One epoch of steps for every rank."""

    steps: list[Step]
    stats: PlanStats
    boundaries: np.ndarray
    """Inclusive upper length bound of each bucket."""
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    seed: int
    epoch: int
    world_size: int

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def num_buckets(self) -> int:
        """Number of buckets (some may be empty)."""
        return len(self.boundaries)


def bucket_boundaries(lengths: np.ndarray, num_buckets: int,
                      explicit: list[int] | None = None) -> np.ndarray:
    """Inclusive upper bounds of the buckets.

    Explicit bounds are used as given, plus one open-ended bucket for longer samples if there
    are any; otherwise equal-count quantiles of ``lengths`` (fewer buckets when many samples
    share a length).
    """
    longest = int(lengths.max())
    if explicit is not None:
        bounds = [int(b) for b in explicit]
        if longest > bounds[-1]:
            bounds.append(longest)
        return np.asarray(bounds, dtype=np.int64)
    qs = np.arange(1, num_buckets + 1) / num_buckets
    bounds = np.quantile(lengths, qs, method="inverted_cdf").astype(np.int64)
    return np.unique(np.append(bounds, longest))


def build_plan(lengths: np.ndarray, cfg: PipelineConfig, *, seed: int, epoch: int,
               world_size: int = 1, sort_window: int | None = SORT_WINDOW) -> Plan:
    """Plan one epoch for ``world_size`` ranks (see the module docstring).

    ``lengths[i]`` is sample i's token count (already truncated to ``data.max_length``).
    ``sort_window=None`` sorts each whole bucket before packing.
    """
    lengths = np.asarray(lengths)
    _validate(lengths, cfg, epoch, world_size, sort_window)
    budget = cfg.tokens_per_batch
    max_rows = cfg.max_batch_size or len(lengths)
    bounds = bucket_boundaries(lengths, cfg.num_buckets, cfg.bucket_boundaries)
    member_of = np.searchsorted(bounds, lengths, side="left")
    num_buckets = len(bounds)

    seeds = np.random.SeedSequence([seed % 2**63, epoch]).spawn(num_buckets + 1)
    bucket_steps: list[list[Step]] = [[] for _ in range(num_buckets)]
    carry = np.zeros(0, dtype=np.int64)
    # Longest bucket first: its batches are single long samples and the hardest to align;
    # what it cannot align moves down to buckets whose batches are easy to split.
    for b in reversed(range(num_buckets)):
        rng = np.random.default_rng(seeds[b])
        pool = np.concatenate([np.flatnonzero(member_of == b), carry])
        order = shuffled_windows(pool, lengths, rng, sort_window)
        batches, carry = _align(order, lengths, world_size, budget, max_rows)
        steps = [Step(b, tuple(batches[j:j + world_size]))
                 for j in range(0, len(batches), world_size)]
        bucket_steps[b] = [steps[k] for k in rng.permutation(len(steps))]

    counts = [len(s) for s in bucket_steps]
    if sum(counts) == 0:
        raise ValueError(f"{len(lengths)} samples cannot give each of the {world_size} "
                         f"data-parallel ranks a batch; use more data or fewer ranks")
    order_rng = np.random.default_rng(seeds[-1])
    if cfg.order == "shuffle":
        sequence = shuffled_order(counts, order_rng)
        run_limit = longest_run(sequence)
    else:
        run_limit = max(cfg.max_run, min_feasible_run(counts))
        sequence = interleave(counts, run_limit, order_rng)
    cursors = [0] * num_buckets
    ordered = []
    for b in sequence:
        ordered.append(bucket_steps[b][cursors[b]])
        cursors[b] += 1
    return Plan(steps=ordered, stats=_stats(ordered, lengths, member_of, carry, counts, run_limit,
                                            num_buckets),
                boundaries=bounds, dropped=np.sort(carry), seed=seed, epoch=epoch,
                world_size=world_size)


def _validate(lengths: np.ndarray, cfg: PipelineConfig, epoch: int, world_size: int,
              sort_window: int | None) -> None:
    if lengths.ndim != 1 or len(lengths) == 0 or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be a non-empty 1-D integer array, got shape "
                         f"{lengths.shape} dtype {lengths.dtype}")
    if lengths.min() < 1:
        raise ValueError(f"sample {int(np.argmin(lengths))} has length {int(lengths.min())}; "
                         f"every sample needs at least one token")
    if int(lengths.max()) > cfg.tokens_per_batch:
        raise ValueError(f"pipeline.tokens_per_batch ({cfg.tokens_per_batch}) is smaller than "
                         f"the longest sample ({int(lengths.max())} tokens, sample "
                         f"{int(np.argmax(lengths))}); raise it or lower data.max_length")
    if cfg.max_batch_size is not None and cfg.max_batch_size < 1:
        raise ValueError(f"pipeline.max_batch_size must be >= 1, got {cfg.max_batch_size}")
    if cfg.num_buckets < 1 or cfg.max_run < 1:
        raise ValueError("pipeline.num_buckets and pipeline.max_run must be >= 1")
    if cfg.order not in ("interleave", "shuffle"):
        raise ValueError(f"pipeline.order must be 'interleave' or 'shuffle', got {cfg.order!r}")
    if world_size < 1 or epoch < 0:
        raise ValueError(f"world_size must be >= 1 and epoch >= 0, got {world_size}, {epoch}")
    if sort_window is not None and sort_window < 1:
        raise ValueError(f"sort_window must be >= 1 or None, got {sort_window}")


def shuffled_windows(pool: np.ndarray, lengths: np.ndarray, rng: np.random.Generator,
                      sort_window: int | None) -> np.ndarray:
    """Shuffle, then sort each window of ``sort_window`` samples by length (ties stay random)."""
    order = pool[rng.permutation(len(pool))]
    window = sort_window or max(1, len(order))
    parts = [chunk[np.argsort(lengths[chunk], kind="stable")]
             for chunk in np.array_split(order, max(1, math.ceil(len(order) / window)))]
    return np.concatenate(parts) if parts else order


def _greedy_starts(seq: list[int], cap: int, max_rows: int) -> list[int]:
    """Start offsets of the fewest contiguous groups with rows * longest <= cap."""
    starts = [0]
    rows = longest = 0
    for i, length in enumerate(seq):
        wider = max(longest, length)
        if rows and ((rows + 1) * wider > cap or rows >= max_rows):
            starts.append(i)
            rows, longest = 1, length
        else:
            rows, longest = rows + 1, wider
    return starts


def greedy_batches(order: np.ndarray, lengths: np.ndarray, budget: int,
                   max_rows: int) -> list[np.ndarray]:
    """Split ``order`` (dataset indices) into the fewest consecutive batches under the budget."""
    if len(order) == 0:
        return []
    starts = _greedy_starts(lengths[order].tolist(), budget, max_rows)
    return np.split(order, starts[1:])


def _balanced_starts(seq: list[int], num_groups: int, budget: int, max_rows: int) -> list[int]:
    """Exactly ``num_groups`` contiguous groups under the budget, with the least max cost.

    Needs ``len(seq) >= num_groups >= len(_greedy_starts(seq, budget, max_rows))``.
    """
    lo, hi = max(seq), budget
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_starts(seq, mid, max_rows)) <= num_groups:
            hi = mid
        else:
            lo = mid + 1
    starts = _greedy_starts(seq, lo, max_rows)
    while len(starts) < num_groups:
        # Split the costliest group of >= 2 rows in half; both halves cost no more.
        ends = starts[1:] + [len(seq)]
        costs = [(e - s) * max(seq[s:e]) if e - s >= 2 else -1 for s, e in zip(starts, ends)]
        k = int(np.argmax(costs))
        assert costs[k] > 0, "caller guarantees enough samples to split"
        starts.insert(k + 1, (starts[k] + ends[k] + 1) // 2)
    return starts


def _align(order: np.ndarray, lengths: np.ndarray, world_size: int, budget: int,
           max_rows: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Batches of this bucket (a multiple of ``world_size``) and the samples left over."""
    if len(order) == 0:
        return [], order
    seq = lengths[order].tolist()
    greedy = _greedy_starts(seq, budget, max_rows)
    target = math.ceil(len(greedy) / world_size) * world_size
    if target > len(seq):
        # Too few samples to split into `target` batches: keep whole greedy groups that fill
        # a multiple of world_size and hand the rest on.
        target = len(greedy) // world_size * world_size
        cut = greedy[target] if target < len(greedy) else len(seq)
        order, leftover = order[:cut], order[cut:]
        seq = seq[:cut]
    else:
        leftover = order[:0]
    if target == 0:
        return [], leftover
    starts = _balanced_starts(seq, target, budget, max_rows)
    return np.split(order, starts[1:]), leftover


def min_feasible_run(counts: list[int]) -> int:
    """Smallest run bound some order of these per-bucket step counts can honour."""
    total, largest = sum(counts), max(counts)
    return max(1, math.ceil(largest / (total - largest + 1)))


def _feasible(remaining: list[int], last: int, run: int, max_run: int) -> bool:
    """Whether the remaining steps can follow a run of ``run`` steps of bucket ``last``.

    Bucket y needs enough other steps to separate its runs: one more run than separators,
    and the current run of ``last`` already uses ``run`` places of its first run.
    """
    total = sum(remaining)
    for y, count in enumerate(remaining):
        others = total - count
        if y == last:
            if count > max_run - run + max_run * others:
                return False
        elif count > max_run * (others + 1):
            return False
    return True


def interleave(counts: list[int], max_run: int, rng: np.random.Generator) -> list[int]:
    """Bucket id of each step: drawn with probability proportional to remaining steps, among
    the buckets after which the remaining steps can still honour ``max_run``.

    Requires ``max_run >= min_feasible_run(counts)``.
    """
    remaining = list(counts)
    last, run = -1, 0
    sequence = []
    for _ in range(sum(counts)):
        candidates = []
        for b, count in enumerate(remaining):
            if count == 0:
                continue
            new_run = run + 1 if b == last else 1
            remaining[b] -= 1
            if new_run <= max_run and _feasible(remaining, b, new_run, max_run):
                candidates.append(b)
            remaining[b] += 1
        assert candidates, "a feasible state always has a feasible next bucket"
        weights = np.asarray([remaining[b] for b in candidates], dtype=np.float64)
        b = candidates[int(rng.choice(len(candidates), p=weights / weights.sum()))]
        run = run + 1 if b == last else 1
        last = b
        remaining[b] -= 1
        sequence.append(b)
    return sequence


def shuffled_order(counts: list[int], rng: np.random.Generator) -> list[int]:
    """Bucket id of each step: ``counts[b]`` steps of bucket b in a uniformly random order."""
    ids = np.repeat(np.arange(len(counts)), counts)
    return ids[rng.permutation(len(ids))].tolist()


def longest_run(buckets: list[int]) -> int:
    """Longest run of equal consecutive values."""
    best = run = 0
    for i, b in enumerate(buckets):
        run = run + 1 if i and b == buckets[i - 1] else 1
        best = max(best, run)
    return best


def _stats(steps: list[Step], lengths: np.ndarray, member_of: np.ndarray, dropped: np.ndarray,
           counts: list[int], run_limit: int, num_buckets: int) -> PlanStats:
    real = padded = carried = 0
    samples = [0] * num_buckets
    for step in steps:
        for batch in step.batches:
            rows = lengths[batch]
            real += int(rows.sum())
            padded += len(batch) * int(rows.max())
            samples[step.bucket] += len(batch)
            carried += int(np.count_nonzero(member_of[batch] != step.bucket))
    return PlanStats(num_samples=sum(samples), num_dropped=len(dropped), num_carried=carried,
                     real_tokens=real, padded_tokens=padded,
                     padding_efficiency=real / padded if padded else 1.0,
                     max_run=longest_run([s.bucket for s in steps]), run_limit=run_limit,
                     steps_per_bucket=tuple(counts), samples_per_bucket=tuple(samples))
