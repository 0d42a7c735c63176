"""The Trainer's own decisions, each through a real run on a tiny random target: the
max_time_s stop, eval every N steps with the best checkpoint by eval/tau, time-based
checkpoints, gradient accumulation, the demo's own settings, and total_steps from every epoch's
plan (repeated non-finite steps: tests/test_divergence.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from dflash_trainer.training import components
from dflash_trainer.config import load_config
from dflash_trainer.data.buckets import Plan
from dflash_trainer.evaluation.evaluate import InTrainingEval
from dflash_trainer.training.trainer import Trainer
from helpers_e2e import make_chat_jsonl, make_tiny_target, tiny_run_overrides

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trainer")
    return {"target": make_tiny_target(root / "target", layers=3, hidden=32),
            "data": make_chat_jsonl(root / "chat.jsonl", num=16), "cache": root / "cache"}


def overrides(setup: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    """Two epochs of one-row batches, a second or two on one CPU thread."""
    return [*tiny_run_overrides(target=setup["target"], data=setup["data"], cache=setup["cache"],
                                run_dir=run_dir),
            "pipeline.prefetch_workers=1", "training.lr=1e-3", *extra]


def run(args: list[str], **kwargs: Any) -> tuple[Trainer, list[dict[str, Any]]]:
    """Build, train, close; the trainer and its metrics.jsonl records. The in-training
    evaluation is the one ``dflash-trainer train`` hands the Trainer."""
    trainer = Trainer(load_config(None, args), evaluator=InTrainingEval.from_config)
    try:
        trainer.train(**kwargs)
    finally:
        trainer.close()
    path = trainer.run_dir / "metrics.jsonl"
    return trainer, [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step-*")
                  if p.name[5:].isdigit())


@pytest.mark.slow
def test_max_time_s_stops_after_the_first_step_with_a_final_checkpoint(setup, tmp_path):
    trainer, records = run(overrides(setup, tmp_path / "run", "training.max_time_s=1e-6"))
    assert trainer.stopped_by == "max_time_s"
    assert trainer.drafter_step.optimizer_step == 1 < trainer.total_steps
    assert records[-1]["step"] == 1
    assert checkpoint_steps(tmp_path / "run") == [1]
    assert (tmp_path / "run" / "drafter" / "model.safetensors").is_file()


@pytest.mark.slow
def test_eval_every_n_steps_keeps_the_best_checkpoint_by_tau(setup, tmp_path):
    run_dir = tmp_path / "run"
    trainer, records = run(overrides(
        setup, run_dir, "training.max_steps=6", "eval.every_steps=2", "eval.prompts=mtbench",
        "eval.in_training_prompts=1", "eval.max_new_tokens=8", "checkpoint.keep_last=1"))
    taus = {r["step"]: r["eval/tau"] for r in records if "eval/tau" in r}
    assert sorted(taus) == [2, 4, 6]
    best_step = max(taus, key=lambda s: (taus[s], -s))  # the first of equal values wins
    assert trainer.best == {"metric": "eval/tau", "value": taus[best_step], "step": best_step}
    # Retention keeps the newest checkpoint and the best one.
    assert checkpoint_steps(run_dir) == sorted({best_step, 6})


@pytest.mark.slow
def test_every_minutes_checkpoints_by_the_clock(setup, tmp_path):
    run_dir = tmp_path / "run"
    # 60 microseconds: every step is past due, with no step-based saving configured.
    trainer, _ = run(overrides(setup, run_dir, "checkpoint.every_minutes=1e-6",
                               "checkpoint.keep_last=100", "training.max_steps=4"))
    assert trainer.cfg.checkpoint.every_steps is None
    assert checkpoint_steps(run_dir) == [1, 2, 3, 4]


@pytest.mark.slow
def test_grad_accum_steps_once_per_two_micro_batches(setup, tmp_path):
    trainer, records = run(overrides(setup, tmp_path / "run", "training.grad_accum=2"))
    plans = trainer.parts.plans
    micro = plans.num_steps(0) + plans.num_steps(1)
    assert trainer.total_steps == micro // 2
    assert trainer.drafter_step.optimizer_step == trainer.total_steps
    assert trainer.drafter_step.micro_step == 2 * trainer.total_steps
    assert [r["step"] for r in records if "train/loss" in r] == list(
        range(1, trainer.total_steps + 1))
    tokens = sum(int(trainer.parts.data.lengths[ids].sum()) for e in range(2)
                 for s in plans(e).steps[:trainer.drafter_step.micro_step - e * plans.num_steps(0)]
                 for ids in s.batches)
    assert records[-1]["train/tokens_total"] == tokens


@pytest.mark.slow
def test_the_demo_config_trains_with_its_own_settings(setup, tmp_path):
    """configs/demo-cpu.yaml as it is (the target's greedy tokens as labels, two layers, a
    4-token block, loss on slot 1 only, constant LR after a 10-step warmup), on the tiny target
    and data."""
    args = [f"model.target={setup['target']}", f"data.paths=[{setup['data']}]",
            f"run_dir={tmp_path / 'run'}", f"data.cache_dir={setup['cache']}",
            "data.max_length=128", "data.heldout_samples=0", "model.target_layer_ids=[0]",
            "training.max_steps=12",
            "training.num_anchors=4", "pipeline.tokens_per_batch=256", "logging.console=false",
            "logging.tensorboard=false", "logging.every_steps=1"]
    cfg = load_config(REPO / "configs" / "demo-cpu.yaml", args)
    assert (cfg.training.labels, cfg.training.loss_slots, cfg.training.schedule) == (
        "target_greedy", 1, "constant")
    assert (cfg.model.num_layers, cfg.model.block_size) == (2, 4)
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 13))
    slots = {k for r in train for k in r if k.startswith("train/acc_pos/")}
    assert slots == {"train/acc_pos/1"}
    lrs = [r["train/lr"] for r in train]
    assert lrs[9:] == [cfg.training.lr] * 3 and lrs[0] < cfg.training.lr  # warmup, then flat
    assert all(0 <= r["train/loss"] < 1e3 for r in train)


@pytest.mark.slow
def test_total_steps_follow_each_epochs_own_plan(setup, tmp_path, monkeypatch):
    real_build = components.EpochPlans.build

    def shorter_second_epoch(self: components.EpochPlans, epoch: int) -> Plan:
        plan = real_build(self, epoch)
        return dataclasses.replace(plan, steps=plan.steps[:3]) if epoch == 1 else plan

    monkeypatch.setattr(components.EpochPlans, "build", shorter_second_epoch)
    trainer, records = run(overrides(setup, tmp_path / "run"))
    first = trainer.parts.plans.num_steps(0)
    assert trainer.total_steps == first + 3
    # The schedule ends where the data ends: every planned step trained, the last one above
    # min_lr (0) and the curve at it after the last step.
    assert trainer.stopped_by == "completed"
    assert trainer.drafter_step.optimizer_step == trainer.drafter_step.schedule.total_steps == first + 3
    assert records[-1]["train/lr"] > 0 and trainer.drafter_step.schedule.lr == pytest.approx(0.0, abs=1e-12)
