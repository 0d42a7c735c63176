"""Logs that survive a full disk: ``metrics.jsonl`` is never left with a torn line.

A real tmpfs (mounted by the test; that needs root, else those tests skip) fills in the middle
of a run: the failed line is rolled back, the run stops with one disk error line, and after the
space is freed ``--resume auto`` finishes it with every step's metrics once, readable by the
report without a warning. Where no tmpfs can be mounted, a file size limit (``RLIMIT_FSIZE``,
a real ``EFBIG`` from the kernel in the middle of a line) checks the same rollback. A line torn
by a kill is repaired when the log is opened again.
"""

from __future__ import annotations

import errno
import json
import logging
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers_e2e import make_chat_jsonl, make_tiny_target, train_recording
from helpers_tmpfs import fill, mounted_tmpfs

from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.core.appendlog import AppendLog
from dflash_trainer.reporting.report import read_metrics, write_report
from dflash_trainer.training.trainer import close_after_failure

RECORD = {"step": 1, "train/loss": 2.5, "note": "x" * 3000}
"""A record of about the size of a training step's metrics line (3 kB): lines cross pages."""


@pytest.fixture()
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A fresh 32 MB tmpfs, unmounted after the test."""
    with mounted_tmpfs(tmp_path / "tmpfs", size="32m",
                       otherwise="test_a_file_size_limit_mid_line_is_rolled_back checks the rollback") as folder:
        yield folder


def lines_of(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes()
    assert data.endswith(b"\n"), data[-200:]
    return [json.loads(line) for line in data.decode().splitlines()]


def test_a_write_that_fills_the_tmpfs_is_rolled_back(tmpfs: Path):
    log = AppendLog(tmpfs / "metrics.jsonl")
    log.append({**RECORD, "step": 0})
    filler = fill(tmpfs)
    failures = 0
    for step in range(1, 4):  # the first page of the file fills, then a line crosses into no space
        try:
            log.append({**RECORD, "step": step})
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            failures += 1
    assert failures >= 2
    kept = [r["step"] for r in lines_of(tmpfs / "metrics.jsonl")]  # whole lines only, ending in \n
    filler.unlink()
    log.append({**RECORD, "step": 9})
    log.close()
    assert [r["step"] for r in lines_of(tmpfs / "metrics.jsonl")] == [*kept, 9]


def test_a_file_size_limit_mid_line_is_rolled_back(tmp_path: Path):
    """No root needed: RLIMIT_FSIZE makes the kernel refuse the bytes past the limit (EFBIG)
    in the middle of a line, as a full disk does."""
    script = textwrap.dedent(f"""
        import errno, resource, signal
        from dflash_trainer.core.appendlog import AppendLog
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, resource.RLIM_INFINITY))
        log = AppendLog({str(tmp_path / 'metrics.jsonl')!r})
        for step in range(6):
            try:
                log.append({{"step": step, "note": "x" * 3000}})
            except OSError as exc:
                assert exc.errno == errno.EFBIG, exc
                print("failed", step)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["failed", "3", "failed", "4", "failed", "5"], out
    assert [r["step"] for r in lines_of(tmp_path / "metrics.jsonl")] == [0, 1, 2]


@pytest.mark.parametrize("tail, kept, message", [
    (b'{"step": 3, "train/lo', [1, 2], "removed a torn last line of 21 bytes"),
    (b'{"step": 3}', [1, 2, 3], "its last record had lost its newline"),
    (b"", [1, 2], None),
])
def test_a_line_torn_by_a_kill_is_repaired_on_open(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                   tail: bytes, kept: list[int], message: str | None):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n' + tail)
    with caplog.at_level(logging.WARNING, logger="dflash_trainer.core.appendlog"):
        log = AppendLog(path)
    log.append({"step": 4})
    log.close()
    assert [r["step"] for r in lines_of(path)] == [*kept, 4]
    warned = [r.getMessage() for r in caplog.records]
    assert (warned == []) if message is None else (len(warned) == 1 and message in warned[0]), warned


def test_closing_after_a_failure_that_fails_too_is_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    class FailsToClose:
        run_dir = tmp_path / "run"

        def close(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    with caplog.at_level(logging.WARNING, logger="dflash_trainer.training.trainer"):
        close_after_failure(FailsToClose())  # type: ignore[arg-type]
    assert [(r.levelno, r.exc_info) for r in caplog.records] == [(logging.WARNING, None)]
    assert caplog.records[0].getMessage().startswith("closing after the failure failed too: disk error: ")


@pytest.mark.slow
def test_a_run_whose_tmpfs_fills_mid_run_resumes_with_every_steps_metrics_once(
        tmpfs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    target = make_tiny_target(tmp_path / "target", layers=3)
    data = make_chat_jsonl(tmp_path / "chat.jsonl", num=16)
    run_dir = tmpfs / "run"
    args = [f"model.target={target}", f"data.paths=[{data}]", f"run_dir={run_dir}",
            f"data.cache_dir={tmp_path / 'cache'}", "data.max_length=128", "data.heldout_samples=0",
            "model.target_layer_ids=[0,1]", "model.dtype=float32", "pipeline.tokens_per_batch=256",
            "pipeline.num_threads=1", "training.num_anchors=4", "training.max_steps=12",
            "logging.every_steps=1", "logging.console=false", "logging.tensorboard=false",
            "checkpoint.every_steps=4", "checkpoint.async_save=false"]
    filled: list[Path] = []

    def fill_after_the_first_checkpoint(batch: Any) -> None:
        if batch.step == 4 and not filled:  # the batch of step 5, after step-4 was saved
            filled.append(fill(tmpfs))

    with pytest.raises(OSError) as failed:
        train_recording(args, on_batch=fill_after_the_first_checkpoint)
    assert "No space left on device" in str(failed.value) and filled
    logged = [r["step"] for r in lines_of(run_dir / "metrics.jsonl")]  # rolled back: whole lines
    assert logged == list(range(1, logged[-1] + 1)) and 4 <= logged[-1] < 8, logged
    filled[0].unlink()

    assert cli_main(["train", *args, "checkpoint.resume=auto"]) == 0
    raw = [r["step"] for r in lines_of(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert sorted(set(raw)) == list(range(1, 13)), raw  # a resume re-logs the steps after step-4
    log = read_metrics(run_dir / "metrics.jsonl")
    assert not log.bad_lines and [r["step"] for r in log.records if "train/loss" in r] == list(range(1, 13))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unreadable line would be a warning
        write_report(run_dir)
