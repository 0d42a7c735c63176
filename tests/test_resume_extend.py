"""Extending and changing a run on resume: a larger ``training.max_steps`` than the checkpoint's
plan re-plans the LR schedule to the new end (no step at lr 0), and every option that may change
and did is printed with both values. The real Trainer on a tiny random target (one process; the
two-rank case is in tests/test_distributed.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from dflash_trainer.config import load_config
from dflash_trainer.training.optim import lr_at
from dflash_trainer.training.trainer import Trainer
from helpers_e2e import make_chat_jsonl, make_tiny_target, tiny_run_overrides

# Four short trainings share a module fixture: about 9 s.
pytestmark = pytest.mark.slow

FIRST_END = 6
NEW_END = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("extend")
    return {"root": root, "target": make_tiny_target(root / "target", layers=3, hidden=32),
            "data": make_chat_jsonl(root / "chat.jsonl", num=16), "cache": root / "cache"}


def overrides(setup: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    return [*tiny_run_overrides(target=setup["target"], data=setup["data"], cache=setup["cache"],
                                run_dir=run_dir), "training.lr=1e-3", *extra]


def train(args: list[str]) -> Trainer:
    trainer = Trainer(load_config(None, args))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


def lrs(run_dir: Path) -> dict[int, float]:
    """The lr of every step (the last record of a step a resume re-logged)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/lr"] for r in rows if "train/lr" in r}


@pytest.fixture(scope="module")
def finished(setup: dict[str, Path]) -> Path:
    """A run that ended at step FIRST_END, its LR curve at 0 after it."""
    run_dir = setup["root"] / "finished"
    trainer = train(overrides(setup, run_dir, f"training.max_steps={FIRST_END}"))
    assert trainer.stopped_by == "completed" and trainer.total_steps == FIRST_END
    return run_dir


def resumed_copy(finished: Path, tmp_path: Path) -> Path:
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    return run_dir


def test_a_larger_max_steps_replans_the_schedule_and_trains_every_new_step(
        setup, finished, tmp_path: Path, capsys):
    run_dir = resumed_copy(finished, tmp_path)
    capsys.readouterr()
    extra = (f"training.max_steps={NEW_END}", "training.lr=2e-3", "checkpoint.keep_last=5",
             "checkpoint.resume=auto")
    trainer = train(overrides(setup, run_dir, *extra))
    out = capsys.readouterr().out
    assert trainer.stopped_by == "completed" and trainer.drafter_step.optimizer_step == NEW_END
    # Every option that may change and did, with both values.
    assert (f"resume: training.max_steps changed from {FIRST_END} (checkpoint) to {NEW_END}; what "
            "depends on it is recomputed") in out
    assert "resume: training.lr changed from 0.001 (checkpoint) to 0.002; applies from the first" in out
    assert "resume: checkpoint.keep_last changed from 3 (checkpoint) to 5; applies from the first" in out
    assert "checkpoint.resume" not in out
    # The schedule: one line with the lr at the first and the last new step.
    line = next(x for x in out.splitlines() if x.startswith("LR schedule:"))
    assert f"re-planned for the new end (the checkpoint's curve ended at step {FIRST_END})" in line
    match = re.search(rf"lr (\S+) at step {FIRST_END + 1}, (\S+) at step {NEW_END}$", line)
    assert match, line
    # The rest of the run is the tail of an uninterrupted NEW_END-step run at the new lr: every
    # step learns (min_lr is 0, which the old curve had reached), decreasing to the end.
    cfg = load_config(None, overrides(setup, run_dir, *extra)).training
    want = {s: lr_at(s - 1, total_steps=NEW_END, cfg=cfg) for s in range(FIRST_END + 1, NEW_END + 1)}
    got = {s: lr for s, lr in lrs(run_dir).items() if s > FIRST_END}
    assert sorted(got) == list(want)
    assert got == pytest.approx({s: want[s] for s in got}, rel=1e-6)
    assert all(lr > 0 for lr in want.values())
    assert float(match[1]) == pytest.approx(want[FIRST_END + 1], rel=1e-2)
    assert float(match[2]) == pytest.approx(want[NEW_END], rel=1e-2)


def test_a_resume_with_the_same_end_keeps_the_checkpoints_curve(setup, tmp_path: Path, capsys):
    run_dir = tmp_path / "stopped"
    first = Trainer(load_config(None, overrides(setup, run_dir, f"training.max_steps={NEW_END}")))
    try:
        first.train(stop_after_steps=3)
    finally:
        first.close()
    capsys.readouterr()
    train(overrides(setup, run_dir, f"training.max_steps={NEW_END}", "checkpoint.resume=auto"))
    out = capsys.readouterr().out
    assert not [x for x in out.splitlines() if x.startswith("resume: ")]
    cfg = load_config(None, overrides(setup, run_dir)).training
    assert (f"LR schedule: the checkpoint's curve goes on; lr {lr_at(3, total_steps=NEW_END, cfg=cfg):.3g} "
            f"at step 4, {lr_at(NEW_END - 1, total_steps=NEW_END, cfg=cfg):.3g} at step {NEW_END}") in out


def test_a_finished_run_resumed_as_it_was_says_how_to_extend_it(setup, finished, tmp_path: Path,
                                                               capsys: Any):
    run_dir = resumed_copy(finished, tmp_path)
    capsys.readouterr()
    train(overrides(setup, run_dir, f"training.max_steps={FIRST_END}", "checkpoint.resume=auto"))
    assert (f"LR schedule: nothing left to train, the checkpoint is at step {FIRST_END} and the run ends "
            "there; raise training.max_steps or training.epochs to extend it") in capsys.readouterr().out
