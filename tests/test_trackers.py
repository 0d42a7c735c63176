"""Trackers: JSONL content, readable TensorBoard events, an offline W&B run, console lines."""

import io
import json
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dflash_trainer.config import LoggingConfig
from dflash_trainer.trackers import (ConsoleTracker, JsonlTracker, TensorBoardTracker, Tracker,
                                     Trackers, build_trackers)


@pytest.fixture
def offline_wandb(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, quiet W&B; any network attempt would go to a closed local port."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def test_jsonl_appends_one_flushed_object_per_log(tmp_path: Path):
    path = tmp_path / "run" / "metrics.jsonl"
    tracker = JsonlTracker(path)
    tracker.log({"train/loss": 2.5, "data/bucket/0/dispatched": 3}, step=10)
    # Flushed per line: readable before close.
    first = json.loads(path.read_text().splitlines()[0])
    assert first["step"] == 10 and first["train/loss"] == 2.5
    assert first["data/bucket/0/dispatched"] == 3.0
    assert abs(first["time"] - time.time()) < 60
    tracker.log({"eval/tau": 3.0, "eval/acceptance_hist": [1, 0, 4]}, step=20)
    tracker.close()
    tracker.close()

    resumed = JsonlTracker(path)  # a resumed run continues the same file
    resumed.log({"train/loss": float("nan")}, step=30)
    resumed.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30]
    assert records[1]["eval/acceptance_hist"] == [1.0, 0.0, 4.0]
    assert records[2]["train/loss"] != records[2]["train/loss"]  # NaN survives the round trip


def test_tensorboard_events_hold_the_scalars(tmp_path: Path):
    tracker = TensorBoardTracker(tmp_path / "tb")
    tracker.log_config({"training": {"lr": 6e-4}})
    for step in (10, 20, 30):
        tracker.log({"train/loss": 1.0 / step, "perf/tokens_per_s": 100.0 * step}, step)
    tracker.log({"eval/acceptance_hist": [2, 0, 5, 1]}, step=30)
    tracker.close()

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()
    assert {"train/loss", "perf/tokens_per_s"} <= set(tags["scalars"])
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [10, 20, 30]
    assert loss[-1].value == pytest.approx(1 / 30, rel=1e-6)
    assert "eval/acceptance_hist" in tags["histograms"]
    hist = acc.Histograms("eval/acceptance_hist")[0].histogram_value
    assert hist.num == 8 and hist.min == 1 and hist.max == 4


def test_wandb_offline_writes_a_run_directory(tmp_path: Path, offline_wandb: None):
    cfg = LoggingConfig(wandb="offline", tensorboard=False, console=False, tags=["test"])
    start = time.monotonic()
    trackers = build_trackers(cfg, tmp_path, config_dict={"training": {"lr": 6e-4}},
                              is_rank0=True)
    run_id = trackers.run_id
    assert run_id
    trackers.log({"train/loss": 1.25}, step=5)
    trackers.log({"eval/acceptance_hist": [1, 2, 3]}, step=5)
    trackers.close()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1
    # finish() returns before W&B's service process has written the transaction log (it
    # completes in the background and at interpreter exit): poll for the history record.
    run_file = runs[0] / f"run-{run_id}.wandb"
    deadline = time.monotonic() + 10
    while b"train/loss" not in run_file.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b"train/loss" in run_file.read_bytes()

    # Resume: the same id continues the same run.
    resumed = build_trackers(cfg, tmp_path, config_dict={}, is_rank0=True,
                             resume_run_id=run_id)
    assert resumed.run_id == run_id
    resumed.log({"train/loss": 1.0}, step=6)
    resumed.close()
    assert time.monotonic() - start < 20, "wandb offline init is unexpectedly slow"


def test_console_prints_plain_lines_without_a_tty(monkeypatch: pytest.MonkeyPatch):
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(var, raising=False)
    stream = io.StringIO()
    console = ConsoleTracker(total_steps=100, stream=stream)
    assert console.plain
    console.log({"train/loss": 2.0, "train/grad_norm": 0.5, "perf/tokens_per_s": 1234.0}, 10)
    console.log({"train/loss": 1.5}, 20)
    console.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 10/100") and "loss 2.0000" in lines[0]
    assert "gnorm 0.5" in lines[0] and "tok/s 1,234" in lines[0]
    assert "eta" in lines[1] and "eta -" not in lines[1]  # a rate exists from the 2nd log on


def test_console_eta_stops_at_the_time_budget(monkeypatch: pytest.MonkeyPatch):
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(var, raising=False)
    stream = io.StringIO()
    # 10^6 planned steps at this rate would take days; the run ends within max_time_s (60 s).
    console = ConsoleTracker(total_steps=10**6, stream=stream, max_time_s=60.0)
    console.log({"train/loss": 2.0}, 1)
    time.sleep(0.05)
    console.log({"train/loss": 2.0}, 2)
    console.close()
    assert console._eta(3) <= 60.0
    eta = stream.getvalue().splitlines()[1].split("eta ")[1]
    assert "day" not in eta and eta != "-"


def test_console_progress_bar_on_a_terminal():
    stream = io.StringIO()
    console = ConsoleTracker(total_steps=50, stream=stream, plain=False)
    assert not console.plain
    console.log({"train/loss": 3.0}, 5)
    console.close()
    out = stream.getvalue()
    assert "5/50" in out and "loss 3.0000" in out


def test_build_trackers_fan_out_and_other_ranks(tmp_path: Path):
    cfg = LoggingConfig(wandb="disabled", tensorboard=True, console=False)
    trackers = build_trackers(cfg, tmp_path, config_dict={"a": 1}, is_rank0=True)
    assert [type(t).__name__ for t in trackers.trackers] == ["JsonlTracker",
                                                              "TensorBoardTracker"]
    assert trackers.run_id is None
    trackers.log({"train/loss": 1.0}, 1)
    trackers.close()
    trackers.close()  # idempotent
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))

    other = build_trackers(cfg, tmp_path / "rank1", config_dict={}, is_rank0=False)
    assert other.trackers == []
    other.log({"train/loss": 1.0}, 1)
    other.close()
    assert not (tmp_path / "rank1").exists()


def test_close_closes_every_tracker_and_reraises_the_first_error():
    closed = []

    class Failing(Tracker):
        def close(self) -> None:
            closed.append("failing")
            raise OSError("disk full")

    class Recording(Tracker):
        def close(self) -> None:
            closed.append("recording")

    with pytest.raises(OSError, match="disk full"):
        Trackers([Failing(), Recording()]).close()
    assert closed == ["failing", "recording"]
