"""Tests keep measurement caches out of the user's cache (tests/conftest.py), in this process and
in the processes it starts, while token stores and converted targets stay shared."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trainer.cli.duration import durations_cache_path, record
from dflash_trainer.core.assets import cache_root
from dflash_trainer.model.dtypes import probe_cache_path


def test_measurement_caches_are_the_sessions_not_the_users(user_cache: Path):
    session = cache_root()
    assert session != user_cache and os.environ["DFLASH_CACHE"] == str(session)
    assert probe_cache_path().parent == durations_cache_path().parent == session
    # What a CLI run, a forked command or a torchrun rank chooses: both paths derive from it.
    code = "from dflash_trainer.core.assets import cache_root; print(cache_root())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout.strip()
    assert out == str(session) and not Path(out).resolve().is_relative_to(user_cache.resolve())


def _bytes(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def test_a_recorded_measurement_lands_in_the_session_cache(user_cache: Path):
    before = _bytes(user_cache / "demo-durations.json")
    record("test | settings 0", {"step_per_probe": 1.0, "eval_per_probe": 1.0})
    assert "test | settings 0" in json.loads(durations_cache_path().read_text())
    assert _bytes(user_cache / "demo-durations.json") == before


def test_token_stores_and_targets_stay_the_users(user_cache: Path):
    for name in ("tokens", "targets"):
        assert (cache_root() / name).resolve() == (user_cache / name).resolve()


WRITERS = {
    "the test itself": "(user_cache / 'dtype-probe.json').write_text('{}')",
    # A child the way the code writes the probe (an atomic rename), with a PYTHONPATH of its own.
    "a child process": ("subprocess.run([sys.executable, '-c', 'import sys; from pathlib import Path; "
                        "from dflash_trainer.core.fsutil import atomic_write_text; "
                        "atomic_write_text(Path(sys.argv[1]) / \\'dtype-probe.json\\', \\'{}\\')', str(user_cache)], "
                        "check=True, env={**os.environ, 'PYTHONPATH': with_guard(SRC)})"),
}


def _nested_run(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A pytest run of one test ``body`` under a copy of this session's conftest and recorder,
    whose "user cache" is a folder of this test."""
    tests = tmp_path / "tests"
    shutil.copytree(Path(__file__).with_name("session_guard"), tests / "session_guard")
    (tests / "conftest.py").write_text(Path(__file__).with_name("conftest.py").read_text())
    (tests / "test_writes.py").write_text(
        "import os, subprocess, sys\n"
        "from conftest import with_guard\n"
        f"SRC = {str(Path(__file__).resolve().parents[1] / 'src')!r}\n\n\n"
        f"def test_writes(user_cache):\n    {body}\n")
    user = tmp_path / "user-cache"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                         cwd=tmp_path, env={**os.environ, "DFLASH_CACHE": str(user)},
                         capture_output=True, text=True, timeout=120)
    return run, user


@pytest.mark.slow
@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_run_that_writes_a_measurement_into_the_user_cache_fails(tmp_path: Path, writer: str):
    """The session's own check, on a run whose "user cache" is a folder of this test: a test, or
    a process it starts, that writes the dtype probe there makes the run fail, naming the file and
    the process."""
    run, user = _nested_run(tmp_path, WRITERS[writer])
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"wrote measurement caches into the user cache: {user / 'dtype-probe.json'}" in run.stdout
    assert "the writing processes:" in run.stdout and "1 passed" in run.stdout
    if writer == "a child process":
        assert "atomic_write_text" in run.stdout


@pytest.mark.slow
def test_a_write_by_a_process_outside_the_run_is_noted_not_blamed(tmp_path: Path):
    """A process that is not the test run's (here one started without the session's variables,
    as a ``make demo`` beside the tests would be) changes the user's probe during the run: noted,
    and the run passes."""
    outside = ("subprocess.run([sys.executable, '-c', 'import sys, pathlib; "
               "pathlib.Path(sys.argv[1], \\'dtype-probe.json\\').write_text(\\'{}\\')', str(user_cache)], "
               "check=True, env={k: v for k, v in os.environ.items() if not k.startswith(('DFLASH', 'PYTHONPATH'))})")
    run, user = _nested_run(tmp_path, outside)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (user / "dtype-probe.json").is_file()
    assert f"note: {user / 'dtype-probe.json'} changed during the test run, by no process of it" in run.stdout
