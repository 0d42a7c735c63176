"""The feature store end to end on a tiny random target: build, a build killed and resumed,
training from the store against the same run online (same batches, equal losses), resume from
the store against an uninterrupted run, and every refusal with a real broken store.

Training runs the real Trainer (through the Python API that the CLI calls); the build runs the
real ``features`` command or :func:`build_store`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import load_config
from dflash_trainer.core.distributed import DistInfo
from dflash_trainer.core.errors import DiskError
from dflash_trainer.core.fsutil import byte_size
from dflash_trainer.features.build import build_store
from dflash_trainer.features.manifest import INDEX, Manifest, ShardRecord, shard_path
from dflash_trainer.features.store import FeatureStore
from helpers_e2e import make_chat_jsonl, make_tiny_target, run_losses as losses, tiny_run_overrides
from helpers_e2e import train_recording as train
from helpers_tmpfs import mounted_tmpfs

pytestmark = pytest.mark.slow

LOSS_RTOL = 1e-5
"""Online and store losses per step, float32 features: the store's forward batches differ from
the training batches (other rows padded together), which moves the target's float32 sums by a
few ulps; with the same forward shapes they are bitwise equal (the test with one row a batch)."""
LOSS_ATOL = 1e-6
"""Beside :data:`LOSS_RTOL`: a KL loss near 0 (0.0066 here) is a difference of log-probabilities
of about 10, so those few ulps are about 1e-6 of it absolute, a larger share than 1e-5 relative
(2.2e-7, i.e. 3.3e-5, under the AVX2 kernels of ``make test-other-cpu``)."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("features")
    return {"root": root, "target": make_tiny_target(root / "target", layers=3, hidden=32),
            "data": make_chat_jsonl(root / "chat.jsonl", num=16), "cache": root / "cache"}


def overrides(setup: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    return [*tiny_run_overrides(target=setup["target"], data=setup["data"], cache=setup["cache"],
                                run_dir=run_dir),
            "training.labels=target_greedy", "features.dtype=float32", "features.shard_mb=0.05",
            "checkpoint.every_steps=3", "checkpoint.keep_last=5", *extra]


SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def build(setup: dict[str, Path], store: Path, *extra: str, **kwargs: Any):
    cfg = load_config(None, overrides(setup, setup["root"] / "unused", f"features.store={store}", *extra))
    return build_store(cfg, SINGLE, out=store, say=lambda m: None, **kwargs)


@pytest.fixture(scope="module")
def store(setup) -> Path:
    out = setup["root"] / "store"
    result = build(setup, out)
    assert result.complete and result.built == result.manifest.num_shards > 1
    return out


def test_store_layout_and_manifest(store: Path, setup):
    manifest = Manifest.read(store)
    assert manifest.layer_ids == [0, 1] and manifest.labels == "target_greedy"
    assert manifest.storage_dtype == "float32" and manifest.target_dtype == "float32"
    # Features of 2 layers x 32 + one int32 label per token.
    assert manifest.bytes_per_token == 2 * 32 * 4 + 4
    index = json.loads((store / INDEX).read_text())["shards"]
    assert len(index) == manifest.num_shards
    assert sum(r["num_samples"] for r in index) == manifest.num_samples
    assert sum(r["num_tokens"] for r in index) == manifest.num_tokens


def test_training_from_the_store_equals_online(store: Path, setup):
    root = setup["root"]
    online, _ = train(overrides(setup, root / "online"))
    offline, trainer = train(overrides(setup, root / "offline", f"features.store={store}"))
    assert offline == online  # the same batches in the same order
    a, b = losses(root / "online"), losses(root / "offline")
    assert a.keys() == b.keys() and a
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=LOSS_RTOL, abs=LOSS_ATOL), step
    # The reader stage reports its own metrics; no target forward ran.
    rows = [json.loads(line) for line in (root / "offline" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("pipe/store/read_mb", 0) > 0 for r in rows)
    assert not any("pipe/target/busy_frac" in r for r in rows)
    # Only the embedding, final norm and LM head are real tensors; the layers stay on meta.
    meta = [n for n, p in trainer.target.named_parameters() if p.is_meta]
    assert meta and all(n.startswith("model.layers.") for n in meta)


def test_one_row_batches_are_bitwise_equal(setup, tmp_path: Path):
    extra = ("pipeline.max_batch_size=1", "training.epochs=1")
    out = tmp_path / "store1"
    build(setup, out, *extra)
    train(overrides(setup, tmp_path / "online", *extra))
    train(overrides(setup, tmp_path / "offline", f"features.store={out}", *extra))
    assert losses(tmp_path / "online") == losses(tmp_path / "offline")


def test_resume_from_the_store_is_bitwise_equal(store: Path, setup, tmp_path: Path):
    full, _ = train(overrides(setup, tmp_path / "full", f"features.store={store}"))
    first, _ = train(overrides(setup, tmp_path / "split", f"features.store={store}"), stop_after_steps=4)
    second, _ = train(overrides(setup, tmp_path / "split", f"features.store={store}",
                                "checkpoint.resume=auto"))
    assert first + second == full
    assert losses(tmp_path / "split") == losses(tmp_path / "full")


def test_a_killed_build_resumes_without_rewriting_finished_shards(setup, tmp_path: Path):
    out = tmp_path / "store"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dflash_trainer", "features", f"--out={out}",
           *overrides(setup, tmp_path / "run", "features.shard_mb=0.02")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not list(out.glob("shard-*.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = {p: p.stat().st_mtime_ns for p in out.glob("shard-*.safetensors")
                if (p.with_suffix(".json")).exists()}
    manifest = Manifest.read(out)
    assert finished and len(finished) < manifest.num_shards and not (out / INDEX).exists()
    # A train against the half-built store is refused with the way to finish it.
    with pytest.raises(Exception, match="incomplete"):
        train(overrides(setup, tmp_path / "run", f"features.store={out}", "features.shard_mb=0.02"))
    result = build(setup, out, "features.shard_mb=0.02")
    assert result.complete and result.kept == len(finished)
    assert result.built == manifest.num_shards - len(finished)
    assert all(p.stat().st_mtime_ns == t for p, t in finished.items())  # nothing rewritten
    assert not list(out.glob(".tmp-*"))


def test_progress_line_and_disk_estimate(setup, tmp_path: Path, capsys):
    code = cli_main(["features", f"--out={tmp_path / 'store'}", *overrides(setup, tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0
    assert "bytes/token" in out and "ETA" in out and "tok/s" in out
    size = r"\d[\d.,]* [kMGT]?B"
    assert re.search(fr"= {size} in \d+ shards; {size} left to write, {size} free in ", out), out


def test_sizes_are_shown_in_the_unit_that_fits():
    assert [byte_size(n) for n in (0, 512, 3_400, 1_234_567, 20.5e9, 4.1e12)] == [
        "0 B", "512 B", "3.4 kB", "1.23 MB", "20.5 GB", "4.1 TB"]


def test_a_small_store_on_a_small_disk_is_refused_in_units_that_show_it(setup, tmp_path: Path, capsys):
    """A 64 kB tmpfs for a store of about half a megabyte: the refusal reads in kB, not
    "needs 0.00 GB, has 0.00 GB free"."""
    with mounted_tmpfs(tmp_path / "small", size="64k", otherwise="test_sizes_are_shown_in_the_unit_that_fits "
                       "checks the units") as small:
        code = cli_main(["features", f"--out={small / 'store'}", *overrides(setup, tmp_path / "run")])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash-trainer")]
    assert code == 1 and len(lines) == 1, lines
    found = re.search(r"disk error: .*small/store: the feature store needs (\d+) kB more and the disk has "
                      r"(\d+(?:\.\d+)?) kB free; ", lines[0])
    assert found and int(found[1]) > float(found[2]) > 0, lines


def refusal(capsys, args: list[str]) -> tuple[int, str]:
    code = cli_main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_a_store_of_other_settings_is_refused(store: Path, setup, tmp_path: Path, capsys):
    args = ["train", *overrides(setup, tmp_path / "run", f"features.store={store}")]
    code, line = refusal(capsys, [*args, "model.target_layer_ids=[0]"])
    assert code == 1 and "layer_ids is [0, 1], this run's is [0]" in line
    code, line = refusal(capsys, [*args, "training.labels=kl"])
    assert code == 1 and "labels is 'target_greedy', this run's is 'kl'" in line
    code, line = refusal(capsys, [*args, "data.max_length=100"])
    assert code == 1 and "token_store" in line
    # Building into a store of other settings is refused too, naming the field.
    code, line = refusal(capsys, ["features", f"--out={store}",
                                  *overrides(setup, tmp_path / "run", "features.dtype=bfloat16")])
    assert code == 1 and "storage_dtype='float32'" in line


@pytest.mark.parametrize("damage", ["missing", "truncated", "corrupt", "no_index"])
def test_a_broken_store_is_named(store: Path, setup, tmp_path: Path, capsys, damage: str):
    broken = tmp_path / "broken"
    shutil.copytree(store, broken)
    shard = shard_path(broken, 1)
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif damage == "corrupt":
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        (broken / INDEX).unlink()
    code, line = refusal(capsys, ["train", *overrides(setup, tmp_path / "run", f"features.store={broken}")])
    assert code == 1
    if damage == "no_index":
        assert "incomplete" in line and str(broken) in line
    else:
        assert str(shard) in line, line
        assert {"missing": "missing", "truncated": "truncated", "corrupt": "checksum"}[damage] in line


def test_too_little_disk_is_refused_before_the_build(setup, tmp_path: Path, monkeypatch):
    import shutil as shutil_module

    real = shutil_module.disk_usage
    monkeypatch.setattr(shutil_module, "disk_usage",
                        lambda path: real(path)._replace(free=1000))
    with pytest.raises(DiskError, match=r"needs \d[\d.,]* [kMGT]?B more and the disk has 1 kB free; "):
        build(setup, tmp_path / "store")
    assert not list((tmp_path / "store").glob("shard-*"))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_mid_build_stops_with_one_line_and_resumes(setup, tmp_path: Path):
    mount = tmp_path / "small"
    mount.mkdir()
    probe = build(setup, tmp_path / "probe", "features.shard_mb=0.02")
    shard_bytes = max(ShardRecord.read(tmp_path / "probe", k).bytes for k in range(probe.manifest.num_shards))
    size_kb = (3 * shard_bytes + 64 * 1024) // 1024
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mount)]).returncode:
        pytest.skip("tmpfs cannot be mounted here")
    try:
        out = mount / "store"
        import shutil as shutil_module

        real = shutil_module.disk_usage
        # The space check would refuse the build up front; the disk fills while it runs.
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(shutil_module, "disk_usage", lambda path: real(path)._replace(free=1 << 40))
            with pytest.raises(DiskError, match="No space left on device.*finished shards are kept"):
                build(setup, out, "features.shard_mb=0.02")
        kept = [k for k in range(probe.manifest.num_shards) if ShardRecord.read(out, k) is not None]
        assert kept and not list(out.glob(".tmp-*"))
        moved = tmp_path / "moved"
        shutil.copytree(out, moved)
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    result = build(setup, moved, "features.shard_mb=0.02")
    assert result.complete and result.kept == len(kept)


def test_float8_store_is_close_to_the_features(setup, tmp_path: Path):
    out = tmp_path / "fp8"
    build(setup, out, "features.dtype=float8_e4m3fn")
    exact = FeatureStore.open(setup["root"] / "store", expected=Manifest.read(setup["root"] / "store"),
                              dtype=torch.float32) if (setup["root"] / "store").exists() else None
    small = FeatureStore.open(out, expected=Manifest.read(out), dtype=torch.float32)
    assert small.manifest.bytes_per_token == 2 * 32 + 4 + 4
    if exact is not None:
        a, b = exact.sample(0).features, small.sample(0).features
        assert torch.allclose(a, b, rtol=0.07, atol=0.07 * a.abs().amax(-1, keepdim=True).max().item())


def torchrun(args: list[str], log: Path) -> None:
    """``torchrun --standalone --nproc-per-node 2 -m dflash_trainer ARGS``; it must exit 0."""
    from test_distributed import run_with_deadline

    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2",
           "-m", "dflash_trainer", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    code = run_with_deadline(cmd, env, log, timeout_s=300)
    assert code == 0, f"torchrun exited {code}; {log} ends:\n{log.read_text(errors='replace')[-4000:]}"


def test_two_ranks_build_their_own_shards_and_train_from_the_store(store: Path, setup, tmp_path: Path):
    # Two ranks build a store: each its own shards, rank 0 the index; the same bytes as one rank's.
    out = tmp_path / "store2"
    torchrun(["features", f"--out={out}", *overrides(setup, tmp_path / "x", "distributed.timeout_s=120")],
             tmp_path / "build.log")
    one, two = json.loads((store / INDEX).read_text()), json.loads((out / INDEX).read_text())
    assert [r["num_samples"] for r in two["shards"]] == [r["num_samples"] for r in one["shards"]]
    assert Manifest.read(out) == Manifest.read(store)
    # Two ranks train from the store that one rank built (another world size) as they train online.
    extra = ("distributed.timeout_s=120", "pipeline.prefetch_workers=1")
    torchrun(["train", *overrides(setup, tmp_path / "online", *extra)], tmp_path / "online.log")
    torchrun(["train", *overrides(setup, tmp_path / "offline", f"features.store={store}", *extra)],
             tmp_path / "offline.log")
    a, b = losses(tmp_path / "online"), losses(tmp_path / "offline")
    assert a.keys() == b.keys() and a
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=LOSS_RTOL, abs=LOSS_ATOL), step


def test_a_kl_store_trains_as_online(setup, tmp_path: Path):
    # target_greedy is the module's store; data mode reads the same features without labels.
    labels = "kl"
    extra = (f"training.labels={labels}", "training.epochs=1")
    out = tmp_path / "store"
    build(setup, out, *extra)
    assert Manifest.read(out).labels == labels
    online, _ = train(overrides(setup, tmp_path / "online", *extra))
    offline, _ = train(overrides(setup, tmp_path / "offline", f"features.store={out}", *extra))
    assert offline == online
    a, b = losses(tmp_path / "online"), losses(tmp_path / "offline")
    assert a.keys() == b.keys() and a
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=LOSS_RTOL, abs=LOSS_ATOL), step


def test_an_online_checkpoint_resumes_from_the_store(store: Path, setup, tmp_path: Path):
    full, _ = train(overrides(setup, tmp_path / "full"))
    first, _ = train(overrides(setup, tmp_path / "split"), stop_after_steps=4)
    second, _ = train(overrides(setup, tmp_path / "split", f"features.store={store}",
                                "checkpoint.resume=auto"))
    assert first + second == full
    a, b = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert a.keys() == b.keys()
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=LOSS_RTOL, abs=LOSS_ATOL), step
