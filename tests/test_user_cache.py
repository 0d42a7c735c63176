"""Tests keep measurement caches out of the user's cache (tests/conftest.py), in this process and
in the processes it starts, while token stores and converted targets stay shared."""

from __future__ import annotations

import json
import os
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


@pytest.mark.slow
def test_a_run_that_writes_a_measurement_into_the_user_cache_fails(tmp_path: Path):
    """The session's own check, on a run whose "user cache" is a folder of this test: a test
    that writes the dtype probe there by hand makes the run fail, naming the file."""
    (tmp_path / "tests").mkdir()
    conftest = Path(__file__).with_name("conftest.py")
    (tmp_path / "tests" / "conftest.py").write_text(conftest.read_text())
    (tmp_path / "tests" / "test_writes.py").write_text(
        "def test_writes(user_cache):\n"
        "    (user_cache / 'dtype-probe.json').write_text('{}')\n")
    user = tmp_path / "user-cache"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                         cwd=tmp_path, env={**os.environ, "DFLASH_CACHE": str(user)},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"wrote measurement caches into the user cache: {user / 'dtype-probe.json'}" in run.stdout
    assert "1 passed" in run.stdout
