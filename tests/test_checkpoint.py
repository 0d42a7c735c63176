"""Checkpoint files: atomic, validated, retained, and safe against SIGKILL mid-write."""

import collections
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_trainer.training.checkpoint import (
    CheckpointError, Checkpointer, ResumeError, SaveRequest, checkpoint_names,
    TRAIN_DIR, find_resume_checkpoint, load_drafter_weights, local_part, read_state, resolve_resume,
    snapshot, validate_checkpoint)
from dflash_trainer.data.cache import TokenStore
from dflash_trainer.core.errors import DiskError


def _request(step: int, size: int = 1000) -> SaveRequest:
    state = {"run": {"all": json.dumps({"step": step})}, "rng": {"rank-0": json.dumps([step])},
             "drafter": {"w": torch.full((size,), float(step))}}
    return SaveRequest(step=step, state=state, export=None)


def test_snapshot_is_a_detached_cpu_copy():
    w = torch.nn.Parameter(torch.ones(3))
    snap = snapshot({"w": w, "nested": [w, 3]})
    with torch.no_grad():
        w.add_(1)
    assert torch.equal(snap["w"], torch.ones(3)) and not snap["w"].requires_grad
    assert snap["nested"][1] == 3


def test_local_part_splits_replicated_tensors_between_ranks():
    """Every tensor is written by exactly one rank, the bytes about evenly; the other values
    by rank 0."""
    state = {"drafter": {f"w{i}": torch.zeros(100 * (i + 1)) for i in range(7)},
             "optimizer": {"state": {"w0": {"step": torch.tensor(3.0)}},
                           "param_groups": [{"lr": 0.1, "params": ["w0"]}]}}
    parts = [local_part(state, rank, 3) for rank in range(3)]
    owners = collections.Counter(k for part in parts for k in part.get("drafter", {}))
    assert owners == collections.Counter({f"w{i}": 1 for i in range(7)})
    sizes = [sum(v.numel() for v in part.get("drafter", {}).values()) for part in parts]
    assert max(sizes) - min(sizes) <= 700
    assert sum("step" in part.get("optimizer", {}).get("state", {}).get("w0", {}) for part in parts) == 1
    assert "param_groups" in parts[0]["optimizer"]
    assert all("param_groups" not in part.get("optimizer", {}) for part in parts[1:])


@pytest.mark.parametrize("async_save", [True, False])
def test_save_retention_and_latest(tmp_path: Path, async_save: bool):
    ck = Checkpointer(tmp_path, keep_last=2, async_save=async_save)
    ck.save(_request(1))
    ck.mark_best(1)
    for step in (2, 3, 4):
        ck.save(_request(step))
    ck.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step-1", "step-3", "step-4"]
    assert (tmp_path / "latest").read_text() == "step-4"
    folder = find_resume_checkpoint(tmp_path)
    assert folder == tmp_path / "step-4"
    assert read_state(folder) == {"run": {"step": 4}, "rng": {0: [4]}}
    assert read_state(folder, ("run",)) == {"run": {"step": 4}}
    assert torch.equal(load_drafter_weights(folder)["w"], torch.full((1000,), 4.0))


def test_corrupt_and_partial_checkpoints_are_skipped(tmp_path: Path, caplog):
    ck = Checkpointer(tmp_path, keep_last=5, async_save=False)
    ck.save(_request(1))
    ck.save(_request(2))
    # Corrupt the newest: flip bytes in place (same size).
    metadata = tmp_path / "step-2" / TRAIN_DIR / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[-10] ^= 0xFF
    metadata.write_bytes(bytes(data))
    # A partial folder without manifest, newer than both.
    (tmp_path / "step-3" / TRAIN_DIR).mkdir(parents=True)
    (tmp_path / "step-3" / TRAIN_DIR / ".metadata").write_bytes(b"half")
    with pytest.raises(CheckpointError, match="checksum"):
        validate_checkpoint(tmp_path / "step-2")
    assert find_resume_checkpoint(tmp_path) == tmp_path / "step-1"
    assert "skipping checkpoint" in caplog.text
    assert resolve_resume("auto", tmp_path) == tmp_path / "step-1"
    with pytest.raises(CheckpointError, match="partial"):
        resolve_resume(str(tmp_path / "step-3"), tmp_path)
    with pytest.raises(CheckpointError, match="no such"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)


def test_write_failure_reaches_the_training_thread(tmp_path: Path):
    def full_disk(path: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    ck = Checkpointer(tmp_path, keep_last=2, async_save=True)
    ck.save(SaveRequest(step=1, state={"a": 1}, export=full_disk))
    with pytest.raises(DiskError, match=r"cannot write checkpoint .*step-1\.tmp: No space left"):
        ck.wait()
    assert find_resume_checkpoint(tmp_path) is None
    assert not (tmp_path / "step-1.tmp").exists()


def test_a_bug_in_the_writer_is_not_a_user_error(tmp_path: Path):
    def bug(path: Path) -> None:
        raise KeyError("oops")

    ck = Checkpointer(tmp_path, keep_last=2, async_save=False)
    with pytest.raises(KeyError):
        ck.save(SaveRequest(step=1, state={"a": 1}, export=bug))


def test_stale_tmp_folder_is_removed_at_start_and_never_loaded(tmp_path: Path):
    Checkpointer(tmp_path, keep_last=2, async_save=False).save(
        SaveRequest(step=1, state={"a": 1}, export=None))
    stale = tmp_path / "step-2.tmp"
    shutil.copytree(tmp_path / "step-1", stale)
    assert find_resume_checkpoint(tmp_path) == tmp_path / "step-1"
    Checkpointer(tmp_path, keep_last=2, async_save=False).close()
    assert not stale.exists() and (tmp_path / "step-1").is_dir()


WRITER = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    from dflash_trainer.training.checkpoint import Checkpointer, SaveRequest
    ck = Checkpointer(Path(sys.argv[1]), keep_last=2, async_save=True)
    step = int(sys.argv[2])
    while True:
        step += 1
        ck.save(SaveRequest(step=step, state={"run": {"all": json.dumps({"step": step})},
                                              "rng": {"rank-0": json.dumps(torch.randn(20).tolist())},
                                              "drafter": {"w": torch.full((300_000,), float(step))}},
                            export=None))
        print(step, flush=True)
""")


@pytest.mark.slow
def test_sigkill_during_writes_never_breaks_latest(tmp_path: Path):
    rng = random.Random(0)
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    ckpt = tmp_path / "ckpt"
    last = 0
    for _ in range(12):
        proc = subprocess.Popen([sys.executable, str(script), str(ckpt), str(last)],
                                stdout=subprocess.PIPE, text=True)
        # Wait for the interpreter to start writing, then kill at a random moment.
        proc.stdout.readline()
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        folder = find_resume_checkpoint(ckpt)
        if folder is None:
            continue
        state = read_state(folder)
        assert len(state["rng"][0]) == 20
        # The tensors of the same step: complete, whatever moment the kill came at.
        step = state["run"]["step"]
        assert torch.equal(load_drafter_weights(folder)["w"], torch.full((300_000,), float(step)))
        assert (ckpt / "latest").read_text().strip().startswith("step-")
        validate_checkpoint(ckpt / (ckpt / "latest").read_text().strip())
        last = step
    assert last > 0, "no checkpoint ever completed"


def test_resume_auto_refuses_to_start_fresh_over_damaged_checkpoints(tmp_path: Path):
    ck = Checkpointer(tmp_path, keep_last=5, async_save=False)
    ck.save(_request(2))
    ck.close()
    (tmp_path / "step-2" / TRAIN_DIR / ".metadata").write_bytes(b"damaged")
    assert checkpoint_names(tmp_path) == ["step-2", "latest"]
    with pytest.raises(ResumeError, match=r"checkpoint.resume=auto: no complete checkpoint in .*, "
                                          r"but it holds step-2, latest \(damaged or partial"):
        resolve_resume("auto", tmp_path)
    assert checkpoint_names(tmp_path / "none") == []


def test_the_token_store_hash_is_its_content_whatever_the_path(tmp_path: Path):
    """What a resume compares: the same samples give the same hash in any folder; a changed
    token, mask bit or sample boundary changes it; a store written before the hash existed
    gets the same value from its files."""
    def build(folder: Path, samples: list[list[int]], masks: list[list[int]] | None = None):
        def fill(writer):
            for i, ids in enumerate(samples):
                writer.add(np.asarray(ids), np.asarray(masks[i] if masks else [1] * len(ids)))
            return {}
        return TokenStore.build(folder, fill)

    a = build(tmp_path / "a", [[1, 2, 3], [4, 5]])
    assert build(tmp_path / "b", [[1, 2, 3], [4, 5]]).content_hash == a.content_hash
    others = [build(tmp_path / "c", [[1, 2, 3], [4, 6]]),
              build(tmp_path / "d", [[1, 2], [3, 4, 5]]),
              build(tmp_path / "e", [[1, 2, 3], [4, 5]], masks=[[1, 1, 0], [1, 1]])]
    assert len({a.content_hash, *(o.content_hash for o in others)}) == 4
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    del meta["content_sha256"]
    (tmp_path / "a" / "meta.json").write_text(json.dumps(meta))
    assert TokenStore(tmp_path / "a").content_hash == a.content_hash
