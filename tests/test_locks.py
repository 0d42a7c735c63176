"""One writer per folder, stale temporary folders, and disk errors that name their folder.

Locks are taken by real processes (``python -c`` holders, a real ``train`` in a forkserver
child) and killed with real signals; the kernel's ``flock`` does the rest.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.data.cache import TokenStore, TokenStoreWriter
from dflash_trainer.core.errors import DiskError, LockError
from dflash_trainer.core.fsutil import remove_stale_temp_dirs, write_dir_atomically
from dflash_trainer.core.locks import run_folder_lock
from helpers_e2e import make_chat_jsonl, make_tiny_target, tiny_run_overrides
from conftest import with_guard

SRC = str(Path(__file__).resolve().parents[1] / "src")


def python(script: str, *args: str) -> subprocess.Popen:
    """A ``python -c`` process running ``script`` (dedented) with the package importable."""
    env = {**os.environ, "PYTHONPATH": with_guard(SRC)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


HOLD = """
    import sys, time
    from pathlib import Path
    from dflash_trainer.core.locks import run_folder_lock
    run_folder_lock(sys.argv[1]).acquire()
    Path(sys.argv[2]).write_text("held")
    time.sleep(float(sys.argv[3]))
"""


def holding(run_dir: Path, tmp_path: Path, seconds: float = 60) -> subprocess.Popen:
    ready = tmp_path / f"held-{time.monotonic_ns()}"
    proc = python(HOLD, str(run_dir), str(ready), str(seconds))
    wait_for(ready.exists, 30, "the holder to take the lock")
    return proc


def stop(proc: subprocess.Popen, signum: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        proc.send_signal(signum)
    proc.wait(30)


# --- the lock itself ------------------------------------------------------------------------------

def test_a_lock_names_its_holder_and_disappears_on_release(tmp_path: Path) -> None:
    lock = run_folder_lock(tmp_path / "run").acquire()
    holder = json.loads((tmp_path / "run" / ".lock").read_text())
    assert holder["pid"] == os.getpid() and set(holder) == {"pid", "host", "command", "started"}
    with pytest.raises(LockError, match=rf"run folder {tmp_path / 'run'} is in use by pid "
                                        rf"{os.getpid()} on .*; wait for it to finish or stop "
                                        rf"it, or choose another run_dir"):
        run_folder_lock(tmp_path / "run").acquire()  # another open file: flock refuses it too
    lock.release()
    lock.release()
    assert not (tmp_path / "run").exists(), "the folder the lock made, empty, is removed again"
    with run_folder_lock(tmp_path / "run"):
        pass


def test_another_process_holding_the_lock_is_named_and_a_killed_one_is_taken_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_dir = tmp_path / "run"
    proc = holding(run_dir, tmp_path)
    try:
        with pytest.raises(LockError, match=rf"is in use by pid {proc.pid} on "):
            run_folder_lock(run_dir).acquire()
    finally:
        stop(proc)
    assert json.loads((run_dir / ".lock").read_text())["pid"] == proc.pid, "left behind"
    with caplog.at_level(logging.WARNING, logger="dflash_trainer.core.locks"):
        lock = run_folder_lock(run_dir).acquire()
    assert f"taking over the lock of pid {proc.pid}" in caplog.text
    lock.release()


@pytest.mark.slow
def test_waiting_for_a_holder_that_finishes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = holding(run_dir, tmp_path)
    waits: list[str] = []
    try:
        with pytest.raises(LockError, match=r"after waiting 0 s"):
            run_folder_lock(run_dir).acquire(timeout_s=0.3, on_wait=waits.append)
        assert len(waits) == 1 and f"pid {proc.pid}" in waits[0]
        stopper = python(f"import os, signal, time; time.sleep(0.5); os.kill({proc.pid}, 9)")
        run_folder_lock(run_dir).acquire(timeout_s=30).release()
        stopper.wait(30)
    finally:
        stop(proc)


def test_a_lock_held_by_a_child_of_a_dead_holder_says_so(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    child_pid = tmp_path / "child"
    proc = python("""
        import os, sys, time
        from pathlib import Path
        from dflash_trainer.core.locks import run_folder_lock
        run_folder_lock(sys.argv[1]).acquire()
        pid = os.fork()  # the child shares the locked open file
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        Path(sys.argv[2]).write_text(str(pid))
        os._exit(0)
    """, str(run_dir), str(child_pid))
    proc.wait(30)
    pid = int(wait_for(lambda: child_pid.exists() and child_pid.read_text(), 30, "the child"))
    try:
        with pytest.raises(LockError, match=rf"still locked although its holder, pid {proc.pid} "
                                            rf".*has ended .*delete {run_dir / '.lock'}"):
            run_folder_lock(run_dir).acquire()
    finally:
        os.kill(pid, signal.SIGKILL)


def test_a_run_folder_that_is_a_file_is_a_disk_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(DiskError, match=rf"cannot write {tmp_path / 'file'}: it is a file"):
        run_folder_lock(tmp_path / "file").acquire()
    with pytest.raises(DiskError, match=rf"cannot write {tmp_path / 'file' / 'run'}: Not a directory"):
        run_folder_lock(tmp_path / "file" / "run").acquire()


# --- the token store: one builder, stale builds cleaned -------------------------------------------

BUILD = """
    import sys, time
    import numpy as np
    from pathlib import Path
    from dflash_trainer.data.cache import TokenStore

    def fill(writer):
        writer.add(np.arange(5), np.ones(5))
        Path(sys.argv[2]).write_text("building")
        time.sleep(float(sys.argv[3]))
        writer.add(np.arange(7), np.ones(7))
        return {"by": "the other process"}

    TokenStore.build(Path(sys.argv[1]), fill)
"""


@pytest.mark.slow
def test_a_second_builder_waits_and_reads_the_finished_store(tmp_path: Path) -> None:
    path, building = tmp_path / "cache" / "key", tmp_path / "building"
    proc = python(BUILD, str(path), str(building), "1.0")
    wait_for(building.exists, 30, "the first builder")
    waits: list[str] = []

    def fill(writer: TokenStoreWriter) -> dict:
        raise AssertionError("the store was built twice")

    store = TokenStore.build(path, fill, on_wait=waits.append)
    assert proc.wait(30) == 0, proc.stderr.read()
    assert not store.built_here and store.meta["by"] == "the other process" and len(store) == 2
    assert len(waits) == 1 and f"token store {path} is in use by pid {proc.pid}" in waits[0]
    assert sorted(p.name for p in path.parent.iterdir()) == ["key"]


@pytest.mark.slow
def test_a_killed_build_leaves_a_folder_that_the_next_build_removes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path, building = tmp_path / "cache" / "key", tmp_path / "building"
    # A live writer's folder stays: only the dead one goes.
    live = python(BUILD, str(tmp_path / "cache" / "other"), str(tmp_path / "other"), "60")
    try:
        wait_for((tmp_path / "other").exists, 30, "the live builder")
        proc = python(BUILD, str(path), str(building), "60")
        wait_for(building.exists, 30, "the builder")
        stop(proc)
        left = [p.name for p in path.parent.iterdir()]
        assert any(re.fullmatch(rf"\.key\.tmp-{proc.pid}-.+", n) for n in left), left
        with caplog.at_level(logging.WARNING, logger="dflash_trainer.core.fsutil"):
            store = TokenStore.build(path, lambda w: (w.add(np.arange(3), np.ones(3)), {})[1])
        assert store.built_here and len(store) == 1
        names = sorted(p.name for p in path.parent.iterdir())
        assert [n for n in names if n.startswith(".key.")] == []
        assert any(n.startswith(f".other.tmp-{live.pid}-") for n in names), names
        assert f"left by a writer (pid {proc.pid}) that was killed" in caplog.text
    finally:
        stop(live)


def test_a_swapped_out_folder_of_a_killed_replace_is_put_back(tmp_path: Path) -> None:
    dead = python("import os; print(os.getpid())")
    pid = int(dead.communicate()[0])
    old = tmp_path / f".export.old-{pid}-abc"
    old.mkdir()
    (old / "config.json").write_text("{}")
    remove_stale_temp_dirs(tmp_path)
    assert (tmp_path / "export" / "config.json").read_text() == "{}" and not old.exists()


def test_a_full_disk_names_the_folder_being_written(tmp_path: Path) -> None:
    def full(folder: Path) -> None:
        raise OSError(28, os.strerror(28))  # what a write() on a full disk raises: no file name

    with pytest.raises(DiskError, match=rf"cannot write {tmp_path / 'out'}: No space left on "
                                        r"device; free space .*\(data.cache_dir\)"):
        write_dir_atomically(tmp_path / "out", full, fix="free space (data.cache_dir)")
    assert list(tmp_path.iterdir()) == []


def test_a_disk_error_without_a_file_name_names_the_commands_folder(tmp_path: Path) -> None:
    """A write() on a full disk raises ENOSPC without a file name: the message names the folder
    the command writes into, from its config and flags."""
    import argparse
    import errno

    from dflash_trainer.cli.main import output_folder
    from dflash_trainer.core.fsutil import disk_error
    from dflash_trainer.config import load_config

    assert disk_error(RuntimeError("a bug"), folder=tmp_path / "run") is None
    error = RuntimeError("metrics writer failed")
    error.__cause__ = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert str(disk_error(error, folder=tmp_path / "run")).startswith(
        f"cannot write into {tmp_path / 'run'}: No space left on device; free space")
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'c'}"])
    args = argparse.Namespace(out=None, run=str(tmp_path / "r"), suite=None)
    assert [output_folder(c, cfg, args) for c in ("prepare", "train", "eval", "report")] == [
        str(tmp_path / "c"), str(tmp_path / "run"), str(tmp_path / "run" / "eval"),
        str(tmp_path / "r")]


# --- two real train processes, one run folder -----------------------------------------------------

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["dflash_trainer.cli.main", "dflash_trainer.training.trainer"])


def _train_child(argv: list[str], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.exit(cli_main(["train", *argv]))


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


@pytest.mark.slow
def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (``T`` in /proc/PID/task/*/stat)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue
    return bool(states) and all(state in ("T", "t") for state in states)


@pytest.mark.slow
def test_a_second_train_on_a_locked_run_folder_is_refused_untouched(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = make_tiny_target(tmp_path / "target", layers=3, hidden=32)
    data = make_chat_jsonl(tmp_path / "chat.jsonl", num=16)
    run_dir = tmp_path / "run"
    argv = [*tiny_run_overrides(target=target, data=data, cache=tmp_path / "cache",
                                run_dir=run_dir),
            "training.epochs=200", "checkpoint.every_steps=1", "checkpoint.resume=auto"]
    first = _CTX.Process(target=_train_child, args=(argv, str(tmp_path / "first.txt")))
    first.start()
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "latest").is_file(), 120, "a checkpoint")
        os.kill(first.pid, signal.SIGSTOP)  # frozen, still holding the lock: nothing changes
        # SIGSTOP lands asynchronously: the checkpoint writer thread may still be mid-write.
        wait_for(lambda: _all_threads_stopped(first.pid), 30, "the first train to stop")
        before = _snapshot(run_dir)
        capsys.readouterr()
        assert cli_main(["train", *argv]) == 1
        err = capsys.readouterr().err
        assert _snapshot(run_dir) == before
        lines = [line for line in err.splitlines() if line.startswith("dflash-trainer train: ")]
        assert len(lines) == 1 and re.fullmatch(
            rf"dflash-trainer train: lock error: run folder {re.escape(str(run_dir))} is in use "
            rf"by pid {first.pid} on \S+ \(`.*`, since [-0-9: ]+\); wait for it to finish or "
            r"stop it, or choose another run_dir", lines[0]), err
        os.kill(first.pid, signal.SIGKILL)
        first.join(30)
    finally:
        if first.is_alive():
            first.kill()
    # Killed: the kernel released its lock; the next run takes it over and resumes.
    assert json.loads((run_dir / ".lock").read_text())["pid"] == first.pid
    assert cli_main(["train", *argv, "training.max_steps=1", "training.epochs=2"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert not (run_dir / ".lock").exists()


@pytest.mark.slow
def test_under_torchrun_every_rank_refuses_a_locked_run_folder(tmp_path: Path) -> None:
    """Only rank 0 takes the lock; the refusal reaches every rank (none waits for rank 0 in a
    collective it never enters, the launch ends), and is printed once, by rank 0."""
    from test_distributed import WORLD, run_with_deadline
    from test_distributed import overrides as dist_overrides

    make_tiny_target(tmp_path / "target", layers=3)
    make_chat_jsonl(tmp_path / "chat.jsonl", num=16)
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    holder = holding(run_dir, tmp_path, seconds=600)
    try:
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node",
               str(WORLD), "-m", "dflash_trainer", "train",
               *dist_overrides(tmp_path, run_dir, "distributed.timeout_s=60")]
        code = run_with_deadline(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, log, timeout_s=300)
    finally:
        stop(holder)
    output = log.read_text(errors="replace")
    assert code not in (0, None), output[-3000:]
    refusals = re.findall(rf"dflash-trainer train: lock error: run folder {re.escape(str(run_dir))} "
                          rf"is in use by pid {holder.pid} ", output)
    # torchrun prints its own traceback of the failed launch; none comes from the trainer.
    assert len(refusals) == 1 and not re.search(r'File ".*/dflash_trainer/', output), output[-3000:]


# --- disk errors from real processes --------------------------------------------------------------

def _no_dac_override() -> list[str]:
    """The prefix that runs a command as root without the right to ignore file permissions."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: file permissions do not bind")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]


def _one_error_line(result: subprocess.CompletedProcess, command: str) -> str:
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines()
             if line.startswith(f"dflash-trainer {command}: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("disk")
    return {"target": make_tiny_target(root / "target", layers=3, hidden=32),
            "data": make_chat_jsonl(root / "chat.jsonl", num=16)}


@pytest.mark.slow
def test_a_read_only_run_folder_is_one_line_naming_it(tiny: dict[str, Path],
                                                      tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o555)
    argv = ["train", *tiny_run_overrides(target=tiny["target"], data=tiny["data"],
                                         cache=tmp_path / "cache", run_dir=run_dir)]
    result = subprocess.run([*_no_dac_override(), sys.executable, "-m", "dflash_trainer", *argv],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 1
    assert _one_error_line(result, "train") == (
        f"dflash-trainer train: disk error: cannot write {run_dir}: Permission denied; free "
        "space or fix the permissions there, or choose another folder (run_dir)")
    assert list(run_dir.iterdir()) == []


@pytest.mark.slow
def test_a_full_disk_under_the_token_cache_is_one_line_naming_the_store(
        tiny: dict[str, Path], tmp_path: Path) -> None:
    import resource

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (2_000, 2_000))

    cache = tmp_path / "cache"
    argv = ["prepare", *tiny_run_overrides(target=tiny["target"], data=tiny["data"], cache=cache,
                                           run_dir=tmp_path / "run")]
    result = subprocess.run([sys.executable, "-m", "dflash_trainer", *argv], capture_output=True,
                            text=True, timeout=300, check=False, preexec_fn=limit_file_size)
    assert result.returncode == 1
    line = _one_error_line(result, "prepare")
    assert re.fullmatch(rf"dflash-trainer prepare: disk error: cannot write {cache}/[0-9a-f]+: "
                        r"File too large; free space or fix the permissions there, or choose "
                        r"another folder \(data.cache_dir\)", line), line
    # Only the memo of the data files' content hashes may stay: it is valid whatever the store.
    left = {p.name for p in cache.iterdir()} if cache.exists() else set()
    assert left <= {".file-sha256.json"}, f"no temporary folder or lock file left: {left}"
