"""Resume: a run stopped at step k and resumed trains exactly the batches of an uninterrupted
run, in the same order, with bitwise equal losses and weights (CPU); what a checkpoint holds;
W&B run continuation; refused resumes; a corrupt latest checkpoint skipped by the trainer.

Everything runs the real Trainer on a tiny random target (through the Python API, which the
CLI calls), so one module-scoped set of runs serves every test here.
"""

from __future__ import annotations

import collections
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from torch.distributed.checkpoint import FileSystemReader

from dflash_trainer.training.checkpoint import (
    TRAIN_DIR, CheckpointError, Checkpointer, ResumeError, SaveRequest, _write_manifest,
    load_drafter_weights, read_state, validate_checkpoint)
from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import load_config
from dflash_trainer.training.export import load_drafter
from dflash_trainer.training.trainer import Trainer
from helpers_e2e import make_chat_jsonl, make_tiny_target, tiny_run_overrides, wandb_records

# Three trainings share one module fixture: about 30 s.
pytestmark = pytest.mark.slow

STOP_AT = 5
EPOCHS = 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resume")
    return {"root": root, "target": make_tiny_target(root / "target", layers=3, hidden=32),
            "data": make_chat_jsonl(root / "chat.jsonl", num=16), "cache": root / "cache"}


def overrides(setup: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    """A run of about 16 optimizer steps that takes ~2 s on one CPU thread."""
    assert EPOCHS == 2  # the epochs of tiny_run_overrides
    return [*tiny_run_overrides(target=setup["target"], data=setup["data"], cache=setup["cache"],
                                run_dir=run_dir),
            "pipeline.prefetch_workers=3", "training.lr=1e-3",
            # Noise draws from the global torch RNG: the resumed run must restore it.
            "training.noise_std=0.05", "checkpoint.every_steps=3", "checkpoint.keep_last=2",
            *extra]


Record = tuple[int, int, tuple[int, ...]]


def train(args: list[str], **kwargs: Any) -> tuple[list[Record], Trainer]:
    """Build a Trainer, train, close; the (epoch, plan step, sample ids) of every batch."""
    records: list[Record] = []
    trainer = Trainer(load_config(None, args))
    try:
        trainer.train(on_batch=lambda b: records.append(
            (b.epoch, b.step, tuple(b.sample_ids.tolist()))), **kwargs)
    finally:
        trainer.close()
    return records, trainer


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def by_step(records: list[dict[str, Any]], key: str) -> dict[int, float]:
    """The last value logged for each step (a resume re-logs its first step's window)."""
    return {r["step"]: r[key] for r in records if key in r}


@pytest.fixture(scope="module")
def runs(setup: dict[str, Path]) -> dict[str, Any]:
    root = setup["root"]
    full_dir, split_dir = root / "full", root / "split"
    full, full_trainer = train(overrides(setup, full_dir))
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                           "WANDB_CONSOLE": "off", "WANDB_BASE_URL": "http://127.0.0.1:9"}.items():
            mp.setenv(key, value)
        mp.delenv("WANDB_API_KEY", raising=False)
        first, first_trainer = train(overrides(setup, split_dir, "logging.wandb=offline"),
                                     stop_after_steps=STOP_AT)
        stop_metrics = metrics(split_dir)
        stop_state = read_state(split_dir / "checkpoints" / f"step-{STOP_AT}")
        second, second_trainer = train(overrides(setup, split_dir, "logging.wandb=offline",
                                                 "checkpoint.resume=auto"))
    return {"full_dir": full_dir, "split_dir": split_dir, "full": full, "first": first,
            "second": second, "full_trainer": full_trainer, "first_trainer": first_trainer,
            "second_trainer": second_trainer, "stop_metrics": stop_metrics,
            "stop_state": stop_state}


def test_resumed_run_trains_the_same_batches_with_bitwise_equal_losses(runs):
    full, first, second = runs["full"], runs["first"], runs["second"]
    total = runs["full_trainer"].total_steps
    assert runs["first_trainer"].stopped_by == "stop_after_steps"
    assert len(first) == STOP_AT and runs["second_trainer"].stopped_by == "completed"
    # Same batches, same order; together every planned sample exactly once per epoch.
    assert first + second == full and len(full) == total
    counts = collections.Counter(i for _, _, ids in full for i in ids)
    assert set(counts.values()) == {EPOCHS}
    # Batches were in flight (dispatched, not trained) when the first part stopped, and the
    # checkpoint's data cursor points at the first one of them.
    last = runs["stop_metrics"][-1]
    consumed = sum(v for k, v in last.items()
                   if k.startswith("data/bucket/") and k.endswith("/trained"))
    produced = sum(r.get("pipe/queue/batches/puts", 0) for r in runs["stop_metrics"])
    assert last["step"] == STOP_AT and consumed == STOP_AT and produced > STOP_AT
    assert runs["stop_state"]["data"][0]["step"] == STOP_AT
    # Bitwise: losses, gradient norms and learning rates per step, then the final weights.
    full_m, split_m = metrics(runs["full_dir"]), metrics(runs["split_dir"])
    for key in ("train/loss", "train/grad_norm", "train/lr"):
        assert by_step(split_m, key) == by_step(full_m, key), key
    assert sorted(by_step(split_m, "train/loss")) == list(range(1, total + 1))
    a = load_drafter_weights(runs["full_dir"] / "checkpoints" / f"step-{total}")
    b = load_drafter_weights(runs["split_dir"] / "checkpoints" / f"step-{total}")
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Run totals continue across the resume (checkpoint steps are log steps).
    assert full_m[-1]["train/samples_total"] == split_m[-1]["train/samples_total"] == sum(
        counts.values())


def test_checkpoint_holds_the_training_state_and_a_servable_drafter(runs):
    state = runs["stop_state"]
    folder = runs["split_dir"] / "checkpoints"
    run = state["run"]
    assert run["step"] == STOP_AT and run["epoch"] == 0
    assert state["counters"]["optimizer_step"] == STOP_AT and state["schedule"]["step_count"] == STOP_AT
    # One DCP folder holds everything: weights, AdamW moments and the objects' JSON; no pickles.
    latest = folder / (folder / "latest").read_text().strip()
    assert sorted(p.name for p in latest.iterdir()) == ["config.yaml", "drafter", "manifest.json", TRAIN_DIR]
    keys = FileSystemReader(latest / TRAIN_DIR).read_metadata().state_dict_metadata
    assert any(k.startswith("optimizer.state.") and k.endswith(".exp_avg_sq") for k in keys), \
        "AdamW moments missing"
    assert any(k.startswith("drafter.") for k in keys)
    assert {k for k in keys if not k.startswith(("drafter.", "optimizer."))} == {
        "schedule.all", "counters.all", "data.rank-0", "monitor.all", "rng.rank-0", "run.all"}
    assert set(state["rng"][0]) >= {"python", "numpy", "torch"}
    assert run["tracker_run_id"] == runs["first_trainer"].trackers.run_id
    assert state["monitor"]["totals"]["train/samples_total"] > 0
    assert run["best"]["metric"] == "train/loss" and run["best"]["step"] <= STOP_AT
    assert run["world_size"] == 1
    store = runs["first_trainer"].parts.data
    assert run["data"] == {"sha256": store.content_hash, "store": str(store.path),
                           "samples": len(store)}
    # The drafter folder is the z-lab export (bf16) of the same weights.
    drafter = load_drafter(latest / "drafter")
    exported = drafter.state_dict()
    for key, value in load_drafter_weights(latest).items():
        if key in exported:
            assert torch.equal(exported[key], value.to(torch.bfloat16).float()), key
    assert (latest / "config.yaml").is_file()


def test_retention_keeps_the_last_checkpoints_and_the_best(runs):
    folder = runs["full_dir"] / "checkpoints"
    total = runs["full_trainer"].total_steps
    best = runs["full_trainer"].best
    assert best is not None and best["metric"] == "train/loss"
    names = {p.name for p in folder.iterdir() if p.is_dir()}
    assert names == {f"step-{total - total % 3}", f"step-{total}", f"step-{best['step']}"}
    # Each checkpoint records the best so far; the value only ever improves.
    for name in names:
        assert read_state(folder / name)["run"]["best"]["value"] >= best["value"]


def test_checkpointer_best_replaces_the_previous_best(tmp_path: Path):
    ck = Checkpointer(tmp_path, keep_last=1, async_save=False)
    for step, best in ((1, True), (2, False), (3, True), (4, False)):
        ck.save(SaveRequest(step=step, state={"step": step}, export=None, best=best))
    ck.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step-3", "step-4"]


def _wandb_steps(run_file: Path) -> list[int]:
    """History steps of a W&B run file."""
    return [r["history"]["step"]["num"] for r in wandb_records(run_file) if r["type"] == "history"]


def test_wandb_run_continues_with_the_same_id(runs):
    run_id = runs["first_trainer"].trackers.run_id
    assert run_id and runs["second_trainer"].trackers.run_id == run_id
    parts = sorted((runs["split_dir"] / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(parts) == 2
    steps = [_wandb_steps(p / f"run-{run_id}.wandb") for p in parts]
    total = runs["full_trainer"].total_steps
    assert steps[0][-1] == STOP_AT and steps[1][0] > STOP_AT and steps[1][-1] == total


def test_refused_resumes_exit_2_with_the_reason(runs, setup, tmp_path: Path, capsys):
    split_dir = runs["split_dir"]
    config_before = (split_dir / "config.yaml").read_bytes()
    cases = [
        (split_dir, ["checkpoint.resume=auto", "training.seed=7"], "training.seed was 42"),
        (split_dir, ["checkpoint.resume=auto", "pipeline.tokens_per_batch=512"],
         "pipeline.tokens_per_batch was 256"),
        (split_dir, [], f"run folder {split_dir} holds an earlier run (checkpoints step-"),
        (split_dir, [f"checkpoint.resume={tmp_path / 'missing'}"], "no such checkpoint"),
    ]
    for run_dir, extra, message in cases:
        assert cli_main(["train", *overrides(setup, run_dir, *extra)]) == 2, message
        assert message in capsys.readouterr().err
    assert (split_dir / "config.yaml").read_bytes() == config_before
    with pytest.raises(ResumeError):
        Trainer(load_config(None, overrides(setup, split_dir, "training.num_anchors=8",
                                            "checkpoint.resume=auto")))


@pytest.mark.parametrize("layout", ["single file", "state.pt beside train"])
def test_a_checkpoint_of_an_earlier_layout_says_how_to_continue(runs, setup, tmp_path: Path, capsys,
                                                                layout: str):
    """Checkpoints written before the one DCP state (the weights inside state.pt; or weights and
    AdamW in train/ with the rest pickled in state.pt and rank-R.pt) are refused with one line
    naming the warm start that continues from their weights."""
    old = tmp_path / "old"
    ckpt = runs["split_dir"] / "checkpoints"
    shutil.copytree(ckpt / (ckpt / "latest").read_text(), old)
    state = {"step": STOP_AT, "config": {}}
    if layout == "single file":
        state["drafter"] = load_drafter_weights(old)
        shutil.rmtree(old / TRAIN_DIR)
    torch.save(state, old / "state.pt")
    (old / "manifest.json").unlink()
    _write_manifest(old, STOP_AT)
    assert cli_main(["train", *overrides(setup, tmp_path / "run", f"checkpoint.resume={old}")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"dflash-trainer train: checkpoint error: cannot resume from {old}: it is a checkpoint in "
        f"an earlier layout (state.pt), which this version does not resume; start a new run "
        f"(another run_dir, or --overwrite) from its weights with model.init_from={old / 'drafter'} "
        f"(the optimizer state and data position start over)")
    if layout == "single file":
        assert cli_main(["train", *overrides(setup, tmp_path / "warm", f"model.init_from={old / 'drafter'}",
                                             "training.max_steps=1")]) == 0


def test_corrupt_latest_checkpoint_is_skipped_by_the_trainer(runs, setup, tmp_path: Path,
                                                             caplog):
    run_dir = tmp_path / "copy"
    shutil.copytree(runs["full_dir"], run_dir)
    ckpt = run_dir / "checkpoints"
    total = runs["full_trainer"].total_steps
    state_file = ckpt / f"step-{total}" / TRAIN_DIR / ".metadata"
    data = bytearray(state_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state_file.write_bytes(bytes(data))
    (ckpt / f"step-{total + 1}").mkdir()  # a partial folder: no manifest
    with pytest.raises(CheckpointError):
        validate_checkpoint(ckpt / f"step-{total}")
    newest_valid = total - total % 3
    caplog.set_level(logging.WARNING)
    records, trainer = train(overrides(setup, run_dir, "checkpoint.resume=auto"))
    assert "skipping checkpoint" in caplog.text and "checksum" in caplog.text
    assert [(e, s) for e, s, _ in records] == [(e, s) for e, s, _ in runs["full"][newest_valid:]]
    resumed = by_step(metrics(run_dir), "train/loss")
    full = by_step(metrics(runs["full_dir"]), "train/loss")
    assert all(resumed[s] == full[s] for s in range(newest_valid + 1, total + 1))
    validate_checkpoint(ckpt / f"step-{total}")  # rewritten by the resumed run


# --- nothing overwritten or resumed silently ------------------------------------------------------

def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def test_a_fresh_run_never_overwrites_an_earlier_runs_checkpoints(setup, tmp_path: Path, capsys):
    """Checkpoints without ``latest`` (a copy, a crash before the pointer moved) count too;
    ``--overwrite`` is the one way to start over there, and it says what it deleted."""
    run_dir = tmp_path / "run"
    ck = Checkpointer(run_dir / "checkpoints", keep_last=5, async_save=False)
    for step in (2, 4):
        ck.save(SaveRequest(step=step, state={"step": step}, export=None))
    ck.close()
    (run_dir / "checkpoints" / "latest").unlink()
    before = _files(run_dir)
    assert cli_main(["train", *overrides(setup, run_dir)]) == 2
    err = capsys.readouterr().err
    assert (f"checkpoint error: run folder {run_dir} holds an earlier run (checkpoints step-2, "
            f"step-4); continue it with --resume auto (checkpoint.resume=auto), start over with "
            f"--overwrite (deletes them), or choose another run_dir") in err
    assert _files(run_dir) == before
    assert cli_main(["train", "--overwrite", *overrides(setup, run_dir), "checkpoint.resume=auto"]) == 2
    assert "--overwrite starts the run in" in capsys.readouterr().err
    assert _files(run_dir) == before

    assert cli_main(["train", "--overwrite", *overrides(setup, run_dir, "training.max_steps=1")]) == 0
    out = capsys.readouterr().out
    assert f"--overwrite: removed checkpoints of the earlier run in {run_dir}" in out
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step-1"]
    # The finished run is an earlier run now: a fresh start there is refused in turn.
    assert cli_main(["train", *overrides(setup, run_dir)]) == 2
    assert "(checkpoints step-1, latest; metrics.jsonl; drafter/)" in capsys.readouterr().err


def test_a_resume_over_data_edited_in_place_is_refused(setup, tmp_path: Path, capsys):
    data = make_chat_jsonl(tmp_path / "chat.jsonl", num=16)
    args = [*tiny_run_overrides(target=setup["target"], data=data, cache=tmp_path / "cache",
                                run_dir=tmp_path / "run"), "checkpoint.every_steps=1"]
    assert cli_main(["train", *args, "training.max_steps=2"]) == 0
    state = read_state(tmp_path / "run" / "checkpoints" / "step-2")["run"]
    make_chat_jsonl(data, num=24, seed=1)  # same path, other records
    capsys.readouterr()
    assert cli_main(["train", *args, "checkpoint.resume=auto"]) == 2
    err = capsys.readouterr().err
    assert (f"checkpoint error: cannot resume from {tmp_path / 'run' / 'checkpoints' / 'step-2'}: "
            f"the training data changed since the checkpoint: its token store held 16 samples "
            f"with content sha256 {state['data']['sha256'][:16]} ({state['data']['store']}), the "
            f"data now gives 24 samples with ") in err
    assert "a file in data.paths was changed in place. Restore the data" in err
    # The same content again, from another cache folder: the resume goes ahead.
    make_chat_jsonl(data, num=16)
    assert cli_main(["train", *args, "checkpoint.resume=auto", f"data.cache_dir={tmp_path / 'c2'}",
                     "training.max_steps=3"]) == 0
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'step-2'} at step 2" in capsys.readouterr().out
