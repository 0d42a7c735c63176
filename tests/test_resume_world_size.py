"""Resume on another number of ranks: the weights and AdamW state reshard through DCP, and the
rest of the interrupted epoch is dealt to the new ranks so that every sample of the epoch is
trained exactly once across the change (sample accounting, gloo on CPU, real torchrun).

The resize itself (:func:`resize_plan`) is checked as a pure function first.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers_e2e import make_chat_jsonl, make_tiny_target
from test_distributed import COLLECTIVE_TIMEOUT_S, LAUNCH_TIMEOUT_S, overrides, run_with_deadline

from dflash_trainer.config import PipelineConfig, TrainingConfig
from dflash_trainer.data.buckets import build_plan
from dflash_trainer.data.resize import resize_plan
from dflash_trainer.training.optim import lr_at


def plan_samples(plan, start: int = 0) -> list[int]:
    return sorted(int(i) for step in plan.steps[start:] for batch in step.batches for i in batch)


@pytest.mark.parametrize(("old", "new", "start"), [(2, 1, 3), (2, 3, 3), (1, 2, 5), (3, 2, 2),
                                                    (2, 4, 0), (4, 4, 1)])
def test_resize_deals_the_batches_left_to_the_new_ranks(old: int, new: int, start: int):
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 200, size=120)
    cfg = PipelineConfig(tokens_per_batch=600, num_buckets=3)
    plan = build_plan(lengths, cfg, seed=1, epoch=0, world_size=old)
    resized = resize_plan(plan, start, new)
    assert resized.world_size == new and resized.steps[:start] == plan.steps[:start]
    assert all(len(step.batches) == new and all(len(b) for b in step.batches)
               for step in resized.steps[start:])
    # The same samples, each once; the same batches in the same order, but for split ones.
    assert plan_samples(resized, start) == plan_samples(plan, start)
    before = [i for step in plan.steps[start:] for b in step.batches for i in b.tolist()]
    after = [i for step in resized.steps[start:] for b in step.batches for i in b.tolist()]
    assert after == before
    budget = max(len(b) * int(lengths[b].max()) for s in plan.steps for b in s.batches)
    assert all(len(b) * int(lengths[b].max()) <= budget for s in resized.steps for b in s.batches)


def test_resize_refuses_when_the_samples_left_cannot_feed_every_rank():
    lengths = np.full(8, 50)
    plan = build_plan(lengths, PipelineConfig(tokens_per_batch=50, num_buckets=1), seed=1,
                      epoch=0, world_size=2)  # one sample per batch: nothing to split
    with pytest.raises(ValueError, match=r"the 2 sample\(s\) left in epoch 0 cannot give each of "
                                         r"the 3 ranks a batch"):
        resize_plan(plan, len(plan) - 1, 3)


# --- through torchrun -------------------------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from dflash_trainer.config import load_config
    from dflash_trainer.core.distributed import close_distributed
    from dflash_trainer.training.trainer import Trainer

    out, stop, *args = sys.argv[1:]
    trainer = Trainer(load_config(None, args))
    seen, lrs = [], []
    # The lr each optimizer step uses.
    trainer.drafter_step.optimizer.register_step_pre_hook(
        lambda opt, *_: lrs.append(opt.param_groups[0]["lr"]))
    trainer.train(stop_after_steps=int(stop) or None,
                  on_batch=lambda b: seen.append([b.epoch, b.step, b.sample_ids.tolist()]))
    rank = trainer.dist.rank
    plans = {e: [[b.tolist() for b in s.batches] for s in trainer.parts.plans(e).steps]
             for e in range(trainer.cfg.training.epochs)}
    lengths = trainer.parts.data.lengths.tolist()
    trainer.close()
    del trainer
    close_distributed()
    Path(f"{out}.rank{rank}.json").write_text(json.dumps({"seen": seen, "plans": plans, "lrs": lrs,
                                                          "lengths": lengths}))
""")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resize")
    make_tiny_target(root / "target", layers=3)
    make_chat_jsonl(root / "chat.jsonl", num=40)
    (root / "run_part.py").write_text(SCRIPT)
    return root


def launch(root: Path, run_dir: Path, nproc: int, stop: int, *extra: str) -> list[dict]:
    """One part of a run on ``nproc`` ranks (torchrun, its own process group, killed on
    timeout); each rank's trained batches and its plans."""
    out = run_dir.parent / f"{run_dir.name}-{nproc}"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node",
           str(nproc), str(root / "run_part.py"), str(out), str(stop),
           *overrides(root, run_dir, f"distributed.timeout_s={COLLECTIVE_TIMEOUT_S}",
                      "training.epochs=2", *extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    log = run_dir.parent / f"{run_dir.name}-{nproc}.log"
    code = run_with_deadline(cmd, env, log, timeout_s=LAUNCH_TIMEOUT_S)
    assert code == 0, f"exit {code}; {log} ends:\n{log.read_text(errors='replace')[-6000:]}"
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(nproc)]


def check_lrs(before: list[dict], after: list[dict], world_size: int) -> None:
    """The lr of every step: never 0 (``min_lr`` is 0, which the cosine reaches after the last
    step), decreasing after warmup, and the resumed run's last step at the lr of the last step
    of an uninterrupted run of the new world size."""
    cfg = TrainingConfig(lr=3e-3)  # as overrides() sets it
    pipeline = PipelineConfig(tokens_per_batch=256, num_buckets=2)
    lengths = np.asarray(after[0]["lengths"])
    total = sum(len(build_plan(lengths, pipeline, seed=cfg.seed, epoch=e, world_size=world_size))
                for e in range(2))
    assert all(rank["lrs"] == after[0]["lrs"] for rank in after)
    lrs = before[0]["lrs"] + after[0]["lrs"]
    assert all(lr > 0 for lr in lrs), lrs
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:])), lrs  # warmup is 1 step here
    uninterrupted = [lr_at(s, total_steps=total, cfg=cfg) for s in range(total)]
    assert lrs[-1] == pytest.approx(uninterrupted[-1], rel=0.25), (lrs, uninterrupted)
    assert lrs[-1] < uninterrupted[-2]


def trained(parts: list[list[dict]], epoch: int) -> collections.Counter:
    return collections.Counter(i for ranks in parts for rank in ranks for e, _, ids in rank["seen"]
                               if e == epoch for i in ids)


@pytest.fixture(scope="module")
def two_rank_part(assets) -> tuple[Path, list[dict]]:
    """2 ranks, stopped at step 2 of epoch 0 (8 steps): its final checkpoint is step-2."""
    run_dir = assets / "two"
    return run_dir, launch(assets, run_dir, 2, 2)


@pytest.mark.slow
@pytest.mark.parametrize(("first", "then", "stop"), [(2, 1, 2), (2, 3, 2), (1, 2, 3), (3, 2, 1)])
def test_resume_on_another_world_size_trains_each_sample_of_the_epoch_once(
        assets, two_rank_part, tmp_path: Path, first: int, then: int, stop: int):
    if first == 2:
        source, before = two_rank_part
    else:
        source = tmp_path / "first"
        before = launch(assets, source, first, stop)
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    after = launch(assets, run_dir, then, 0, "checkpoint.resume=auto")
    # Epoch 0: what the first part trained plus what the resumed part trained is the first
    # part's plan of the epoch, every sample once (its dropped samples excepted, as always).
    plan0 = before[0]["plans"]["0"]
    planned = collections.Counter(i for step in plan0 for batch in step for i in batch)
    assert set(planned.values()) == {1}
    assert trained([before, after], 0) == planned
    assert all(e == 0 and s < stop for rank in before for e, s, _ in rank["seen"])
    # Each resumed rank trained one batch per step, the steps aligned across ranks.
    steps = [[(e, s) for e, s, _ in rank["seen"]] for rank in after]
    assert all(s == steps[0] for s in steps)
    # Epoch 1 is planned for the new world size, each sample once.
    plan1 = after[0]["plans"]["1"]
    assert all(len(step) == then for step in plan1)
    assert trained([after], 1) == collections.Counter(i for step in plan1 for b in step for i in b)
    check_lrs(before, after, then)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["train/loss"] for r in records if "train/loss" in r}
    resumed = [s for s in losses if s > stop]
    assert resumed and resumed[0] == stop + 1 and all(np.isfinite(losses[s]) for s in resumed)
