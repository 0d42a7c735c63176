"""Batch plan: every sample once, token budget, step-aligned ranks, run bound, determinism."""

import dataclasses
import functools
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dflash_trainer.config import PipelineConfig
from dflash_trainer.data.buckets import (Plan, build_plan, bucket_boundaries, interleave,
                                         longest_run, min_feasible_run)

MAX_LENGTH = 512


@st.composite
def plan_inputs(draw):
    n = draw(st.integers(1, 300))
    style = draw(st.sampled_from(["uniform", "skewed", "few_values"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if style == "uniform":
        lengths = rng.integers(1, MAX_LENGTH + 1, n)
    elif style == "skewed":
        lengths = np.clip(rng.lognormal(4.5, 1.0, n).astype(np.int64), 1, MAX_LENGTH)
    else:
        lengths = rng.choice([3, 40, 41, 300, MAX_LENGTH], n)
    explicit = draw(st.one_of(st.none(), st.lists(st.integers(1, MAX_LENGTH), min_size=1,
                                                 max_size=5, unique=True).map(sorted)))
    cfg = PipelineConfig(num_buckets=draw(st.integers(1, 8)), bucket_boundaries=explicit,
                         tokens_per_batch=draw(st.integers(MAX_LENGTH, 4 * MAX_LENGTH)),
                         max_batch_size=draw(st.one_of(st.none(), st.integers(1, 16))),
                         max_run=draw(st.integers(1, 3)))
    return (lengths.astype(np.int64), cfg, draw(st.integers(0, 2**31)), draw(st.integers(0, 5)),
            draw(st.integers(1, 4)), draw(st.sampled_from([None, 1, 7, 1024])))


def _build(lengths, cfg, seed, epoch, world_size, window) -> Plan | None:
    try:
        return build_plan(lengths, cfg, seed=seed, epoch=epoch, world_size=world_size,
                          sort_window=window)
    except ValueError as exc:
        assert "cannot give each" in str(exc)
        return None


def _flat(plan: Plan) -> list[int]:
    return [int(i) for step in plan.steps for batch in step.batches for i in batch]


SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
@SETTINGS
@given(plan_inputs())
def test_plan_properties(inputs):
    lengths, cfg, seed, epoch, world_size, window = inputs
    plan = _build(*inputs)
    if plan is None:
        assert len(lengths) < 2 * world_size
        return
    # Every sample exactly once per epoch, across ranks, or reported as dropped.
    seen = _flat(plan) + plan.dropped.tolist()
    assert sorted(seen) == list(range(len(lengths)))
    assert plan.stats.num_dropped == len(plan.dropped) < 2 * world_size
    assert plan.stats.num_samples == len(lengths) - len(plan.dropped)
    bucket_of = np.searchsorted(plan.boundaries, lengths, side="left")
    max_rows = cfg.max_batch_size or len(lengths)
    carried = 0
    for step in plan.steps:
        # Step-aligned: one non-empty batch per rank, all from one bucket (or carried down
        # from a longer bucket to keep the ranks aligned).
        assert len(step.batches) == world_size
        for batch in step.batches:
            assert 1 <= len(batch) <= max_rows
            assert len(batch) * lengths[batch].max() <= cfg.tokens_per_batch
            assert np.all(bucket_of[batch] >= step.bucket)
            carried += int(np.count_nonzero(bucket_of[batch] != step.bucket))
    assert plan.stats.num_carried == carried
    # The run bound holds whenever some order of these steps can honour it.
    counts = [sum(s.bucket == b for s in plan.steps) for b in range(plan.num_buckets)]
    assert list(plan.stats.steps_per_bucket) == counts
    run = longest_run([s.bucket for s in plan.steps])
    assert run == plan.stats.max_run
    if counts_allow(tuple(c for c in counts if c), cfg.max_run):
        assert run <= cfg.max_run
    else:
        assert run == min_feasible_run(counts)
    # Deterministic for the same inputs.
    again = _build(*inputs)
    assert [s.bucket for s in again.steps] == [s.bucket for s in plan.steps]
    assert _flat(again) == _flat(plan)


@pytest.mark.slow
@SETTINGS
@given(plan_inputs())
def test_new_order_every_epoch(inputs):
    lengths, cfg, seed, epoch, world_size, window = inputs
    plan = _build(*inputs)
    assume(plan is not None and len(plan.steps) >= 10)
    other = _build(lengths, cfg, seed, epoch + 1, world_size, window)
    assert _flat(other) != _flat(plan)
    assert sorted(_flat(other) + other.dropped.tolist()) == list(range(len(lengths)))


@functools.cache
def counts_allow(counts: tuple[int, ...], max_run: int, last: int = -1, run: int = 0) -> bool:
    """Brute force: can these step counts be ordered with runs <= max_run?"""
    if not any(counts):
        return True
    for b, c in enumerate(counts):
        new_run = run + 1 if b == last else 1
        if c and new_run <= max_run:
            rest = counts[:b] + (c - 1,) + counts[b + 1:]
            if counts_allow(rest, max_run, b, new_run):
                return True
    return False


@pytest.mark.parametrize("max_run", [1, 2, 3])
def test_interleave_meets_the_bound_exactly_when_an_order_exists(max_run):
    rng = np.random.default_rng(0)
    for counts in itertools.product(range(6), repeat=3):
        if not any(counts):
            continue
        feasible = counts_allow(counts, max_run)
        assert feasible == (min_feasible_run(list(counts)) <= max_run)
        limit = max(max_run, min_feasible_run(list(counts)))
        for _ in range(3):
            seq = interleave(list(counts), limit, rng)
            assert [seq.count(b) for b in range(3)] == list(counts)
            assert longest_run(seq) <= limit


def test_interleave_is_diversity_first():
    # Proportional draws: in the first half of the epoch every bucket has already appeared
    # in roughly its share, instead of one bucket after another.
    seq = interleave([300, 100, 100], 2, np.random.default_rng(1))
    first_half = seq[:250]
    assert 0.45 < first_half.count(0) / 250 < 0.75
    assert first_half.count(1) > 25 and first_half.count(2) > 25


def test_boundaries_quantiles_and_explicit():
    lengths = np.arange(1, 601)
    assert bucket_boundaries(lengths, 6).tolist() == [100, 200, 300, 400, 500, 600]
    assert bucket_boundaries(np.full(50, 7), 6).tolist() == [7]
    assert bucket_boundaries(lengths, 6, [128, 256]).tolist() == [128, 256, 600]
    assert bucket_boundaries(lengths, 6, [128, 1024]).tolist() == [128, 1024]


def test_buckets_pack_many_short_and_few_long_rows():
    lengths = np.array([16] * 200 + [1000] * 20)
    cfg = PipelineConfig(bucket_boundaries=[64], tokens_per_batch=2048, max_run=2)
    plan = build_plan(lengths, cfg, seed=0, epoch=0, world_size=2)
    rows = {s.bucket: max(len(b) for b in s.batches) for s in plan.steps}
    assert rows[0] > 50 and rows[1] <= 2
    assert plan.stats.padding_efficiency == 1.0


def test_rank_alignment_by_splitting_not_dropping():
    # 3 batches' worth in one bucket and 4 ranks: re-packed into 4 batches, none dropped,
    # the largest as small as possible (the slowest rank sets the step time).
    lengths = np.full(30, 100)
    cfg = PipelineConfig(num_buckets=1, tokens_per_batch=1000, max_run=2)
    plan = build_plan(lengths, cfg, seed=0, epoch=0, world_size=4)
    assert len(plan.steps) == 1 and plan.stats.num_dropped == 0
    rows = [len(b) for b in plan.steps[0].batches]
    assert sum(rows) == 30 and max(rows) == 8


def test_leftover_long_samples_are_carried_to_a_shorter_bucket():
    lengths = np.array([900] * 5 + [10] * 40)
    cfg = PipelineConfig(bucket_boundaries=[100], tokens_per_batch=1000, max_run=2)
    plan = build_plan(lengths, cfg, seed=3, epoch=0, world_size=2)
    assert plan.stats.num_dropped == 0 and plan.stats.num_carried == 1
    assert plan.stats.steps_per_bucket[1] == 2


def test_unfillable_ranks_drop_and_report():
    lengths = np.full(5, 900)
    cfg = PipelineConfig(num_buckets=1, tokens_per_batch=1000)
    plan = build_plan(lengths, cfg, seed=0, epoch=0, world_size=4)
    assert plan.stats.num_dropped == 1 and len(plan.dropped) == 1 and len(plan.steps) == 1
    with pytest.raises(ValueError, match="cannot give each of the 8"):
        build_plan(lengths, cfg, seed=0, epoch=0, world_size=8)


def test_budget_below_longest_sample_is_a_clear_error():
    with pytest.raises(ValueError, match="pipeline.tokens_per_batch .*data.max_length"):
        build_plan(np.array([10, 5000]), PipelineConfig(tokens_per_batch=4096), seed=0, epoch=0)


def _steps_key(plan: Plan) -> list[tuple[int, tuple[tuple[int, ...], ...]]]:
    return [(s.bucket, tuple(tuple(int(i) for i in b) for b in s.batches)) for s in plan.steps]


@pytest.mark.slow
@SETTINGS
@given(plan_inputs())
def test_shuffle_order_has_the_same_steps_in_another_order(inputs):
    lengths, cfg, seed, epoch, world_size, window = inputs
    plan = _build(*inputs)
    assume(plan is not None)
    shuffled_cfg = dataclasses.replace(cfg, order="shuffle")
    shuffled = _build(lengths, shuffled_cfg, seed, epoch, world_size, window)
    # Same buckets and packing: the same multiset of steps, and within one bucket even the same
    # sequence, so the two plans differ only in how the buckets are interleaved.
    assert sorted(_steps_key(shuffled)) == sorted(_steps_key(plan))
    for b in range(plan.num_buckets):
        assert ([k for k in _steps_key(shuffled) if k[0] == b]
                == [k for k in _steps_key(plan) if k[0] == b])
    assert shuffled.stats.max_run == shuffled.stats.run_limit == longest_run(
        [s.bucket for s in shuffled.steps])
    assert shuffled.dropped.tolist() == plan.dropped.tolist()
    # Deterministic in (seed, epoch), and a new order every epoch like the interleaved plan.
    again = _build(lengths, shuffled_cfg, seed, epoch, world_size, window)
    assert _steps_key(again) == _steps_key(shuffled)


def _half_in_one_bucket() -> np.ndarray:
    # Six buckets; the longest holds 120 of 240 single-sample batches (the other buckets' batches
    # hold one sample each too, so batches = samples).
    return np.repeat([60, 120, 180, 240, 300, 500], [24, 24, 24, 24, 24, 120]).astype(np.int64)


def test_shuffle_makes_long_same_bucket_runs_and_interleave_bounds_them():
    lengths = _half_in_one_bucket()
    base = PipelineConfig(bucket_boundaries=[64, 128, 192, 256, 320], tokens_per_batch=512,
                          max_batch_size=1, max_run=2)
    runs = {"interleave": [], "shuffle": []}
    for seed in range(10):
        for order in runs:
            plan = build_plan(lengths, dataclasses.replace(base, order=order), seed=seed, epoch=0)
            assert plan.stats.steps_per_bucket == (24, 24, 24, 24, 24, 120)
            runs[order].append(plan.stats.max_run)
    assert max(runs["interleave"]) <= 2
    # A uniform shuffle of 240 steps, half of them one bucket, has a longest run of about
    # log2(240) = 8; every seed here shows at least 5.
    assert min(runs["shuffle"]) >= 5
    a = build_plan(lengths, base, seed=0, epoch=0)
    b = build_plan(lengths, dataclasses.replace(base, order="shuffle"), seed=0, epoch=0)
    assert [s.bucket for s in a.steps] != [s.bucket for s in b.steps]
    c = build_plan(lengths, dataclasses.replace(base, order="shuffle"), seed=0, epoch=1)
    assert [s.bucket for s in c.steps] != [s.bucket for s in b.steps]


def test_unknown_order_is_a_clear_error():
    cfg = PipelineConfig(order="sorted")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pipeline.order must be"):
        build_plan(np.array([10, 20]), cfg, seed=0, epoch=0)
