"""A run that diverges is a result, not a crash: one line naming the steps and the source, a
checkpoint of the last finite state, exit code 3 (docs/errors.md), and the report names where it
diverged.

The sources are real: a target whose weights hold NaNs (its features are NaN), and a learning
rate so large that the drafter overflows from finite features.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers_e2e import make_chat_jsonl, make_tiny_target
from safetensors.torch import load_file, save_file

from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import load_config
from dflash_trainer.core.errors import EXIT_DIVERGED, DivergedError
from dflash_trainer.model.target import TargetOutputs
from dflash_trainer.reporting.report import read_metrics, summarize
from dflash_trainer.training.pipeline.drafter_step import features_nonfinite
from dflash_trainer.training.trainer import Trainer


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("divergence")
    target = make_tiny_target(root / "target", layers=3)
    nan_target = make_tiny_target(root / "nan-target", layers=3)
    weights = load_file(nan_target / "model.safetensors")
    # Layer 0's MLP output is NaN: so is every hidden state from layer 0 on.
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, nan_target / "model.safetensors", metadata={"format": "pt"})
    return {"target": target, "nan_target": nan_target, "data": make_chat_jsonl(root / "chat.jsonl", num=8),
            "cache": root / "cache"}


def args(world: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    return ["--data", str(world["data"]), f"data.cache_dir={world['cache']}", f"run_dir={run_dir}",
            "data.max_length=128", "pipeline.tokens_per_batch=256", "data.heldout_samples=0",
            "model.target_layer_ids=[0,1]", "model.dtype=float32", "pipeline.num_threads=1",
            "training.num_anchors=4", "logging.console=false", "logging.tensorboard=false",
            "logging.every_steps=1", "training.max_steps=8", "training.max_nonfinite_steps=3", *extra]


def test_a_target_with_nan_weights_ends_the_run_with_its_source_a_checkpoint_and_exit_3(
        world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run_dir = tmp_path / "run"
    capsys.readouterr()
    code = cli_main(["train", f"model.target={world['nan_target']}", *args(world, run_dir)])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("dflash-trainer train: ")]
    assert code == EXIT_DIVERGED == 3 and len(lines) == 1, err
    assert lines[0].startswith(
        "dflash-trainer train: training diverged: 3 consecutive optimizer steps (steps 1-3) had a non-finite "
        "loss or gradient norm (training.max_nonfinite_steps=3); source: the target's hidden states "
        f"(model.target={world['nan_target']}: its weights or model.dtype=float32); the drafter's last "
        f"finite state (before step 1; the non-finite steps were skipped) is saved in "
        f"{run_dir / 'checkpoints' / 'step-3'}"), lines
    assert (run_dir / "checkpoints" / "step-3" / "drafter" / "model.safetensors").is_file()
    # The last finite state is the initial one: nothing was stepped on NaNs.
    saved = load_file(run_dir / "checkpoints" / "step-3" / "drafter" / "model.safetensors")
    assert all(bool(torch.isfinite(v).all()) for v in saved.values())
    log = read_metrics(run_dir / "metrics.jsonl")
    assert not log.bad_lines
    assert dict(summarize(log, []))["diverged"].startswith(
        "non-finite loss or gradient norm from step 1 to step 3, where the run stopped")
    assert dict(summarize(log, []))["steps skipped (non-finite)"] == "3"


@pytest.mark.slow
@pytest.mark.parametrize("lr, source", [
    (1e38, "the drafter's weights (an optimizer step made them non-finite: lower training.lr); no checkpoint "
           "of it was written."),
    (1e25, "the drafter's loss or gradients, from finite features (lower training.lr or training.grad_clip, "
           "or set model.dtype=float32); the drafter's last finite state (before step "),
])
def test_a_drafter_that_overflows_is_named_as_the_source(world: dict[str, Path], tmp_path: Path, lr: float,
                                                         source: str):
    """A learning rate far beyond its range: at 1e38 one step makes the weights inf; at 1e25 they
    stay finite and every later forward overflows, from finite features."""
    cfg = load_config(None, [f"model.target={world['target']}",
                             f"data.paths=[{world['data']}]", *args(world, tmp_path / "run")[2:],
                             "training.warmup_steps=0", "training.schedule=constant"])
    cfg.training.lr = lr  # past training.lr's range (at most 1): set after the checks
    trainer = Trainer(cfg)
    try:
        with pytest.raises(DivergedError) as caught:
            trainer.train()
    finally:
        trainer.close()
    message = str(caught.value)
    step = trainer.drafter_step.optimizer_step
    first = int(re.search(r"\(steps (\d+)-(\d+)\)", message)[1])  # type: ignore[index]
    assert f"(steps {first}-{step})" in message and step - first + 1 >= 3 and step <= 6, message
    assert f"source: {source}" in message, message
    saved = tmp_path / "run" / "checkpoints" / f"step-{step}"
    assert saved.is_dir() == ("last finite state" in source)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["train/diverged_from_step"] == first and math.isfinite(rows[0]["train/loss"])


@pytest.mark.slow
def test_two_ranks_diverge_together_with_one_line_a_checkpoint_and_exit_3(world: dict[str, Path], tmp_path: Path):
    """Under torchrun every rank sees the same reduced gradient norm: they stop at the same step,
    save the checkpoint together, rank 0 prints the line, and the project's launcher exits 3."""
    from test_distributed import LAUNCH_TIMEOUT_S, overrides, run_with_deadline

    root = world["nan_target"].parent
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dflash_trainer.cli.torchrun", "--standalone", "--nproc-per-node", "2",
           "-m", "dflash_trainer", "train", *overrides(root, run_dir),
           f"model.target={world['nan_target']}", f"data.paths=[{world['data']}]", "training.max_nonfinite_steps=3"]
    log = tmp_path / "launch.log"
    code = run_with_deadline(cmd, {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}, log,
                             timeout_s=LAUNCH_TIMEOUT_S)
    text = log.read_text(errors="replace")
    assert code == 3, text[-4000:]
    lines = [line for line in text.splitlines() if "dflash-trainer train:" in line]
    assert len(lines) == 1 and "training diverged: 3 consecutive optimizer steps (steps 1-3)" in lines[0], lines
    assert "source: the target's hidden states" in lines[0] and "Traceback" not in text, text[-4000:]
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step-3" / "train").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]


def test_the_features_check_sees_a_nan_or_inf_at_a_token_and_ignores_padding():
    features = torch.randn(2, 5, 8, dtype=torch.bfloat16)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    item = SimpleNamespace(batch=SimpleNamespace(attention_mask=mask),
                           target=TargetOutputs(features=features, final_hidden=torch.zeros(2, 5, 4)))
    assert not bool(features_nonfinite(item))  # type: ignore[arg-type]
    features[0, 4, 3] = float("nan")  # padding: never reaches the loss
    assert not bool(features_nonfinite(item))  # type: ignore[arg-type]
    features[1, 2, 0], features[1, 2, 1] = float("inf"), float("-inf")  # they do not cancel
    assert bool(features_nonfinite(item))  # type: ignore[arg-type]
    features[1, 2, :2] = 0
    item.target.final_hidden[1, 0, 0] = float("nan")
    assert bool(features_nonfinite(item))  # type: ignore[arg-type]
