"""Trackers: JSONL content, readable TensorBoard events, an offline W&B run, console lines."""

import io
import json
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dflash_trainer.config import LoggingConfig
from dflash_trainer.training.trackers import (ConsoleTracker, JsonlTracker, StepValues, TensorBoardTracker,
                                              Tracker, Trackers, build_trackers)


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


@pytest.mark.slow
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


class FakeClock:
    """A monotonic clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def plain_console(monkeypatch: pytest.MonkeyPatch, clock: FakeClock, **kwargs) -> tuple[ConsoleTracker, io.StringIO]:
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(var, raising=False)
    stream = io.StringIO()
    return ConsoleTracker(stream=stream, clock=clock, **kwargs), stream


def test_time_bounded_eta_counts_from_training_start_and_ends_at_zero(monkeypatch: pytest.MonkeyPatch):
    clock = FakeClock()
    # 87870 planned steps at 1 step/s would take a day; the run stops after 600 s of training.
    console, stream = plain_console(monkeypatch, clock, total_steps=87870, max_time_s=600.0)
    clock.now += 300  # model loading and the untrained evaluation: not training time
    console.training_started()
    clock.now += 10
    console.log({"train/loss": 2.0}, 10)
    clock.now += 290
    console.log({"train/loss": 1.5}, 300)
    clock.now += 300  # the deadline: training stops and logs its last window
    console.log({"train/loss": 1.4}, 600)
    console.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("step 10  0:00:10/0:10:00") and lines[0].endswith("eta 0:09:50")
    assert lines[1].startswith("step 300  0:05:00/0:10:00") and lines[1].endswith("eta 0:05:00")
    assert lines[2].startswith("step 600  0:10:00/0:10:00") and lines[2].endswith("eta 0:00:00")
    assert "87870" not in stream.getvalue()


def test_step_bounded_run_shows_steps_and_a_rate_eta(monkeypatch: pytest.MonkeyPatch):
    clock = FakeClock()
    # 100 steps at 2 steps/s finish in under a minute, well before the 1-hour limit.
    console, stream = plain_console(monkeypatch, clock, total_steps=100, max_time_s=3600.0)
    console.training_started()
    clock.now += 5
    console.log({"train/loss": 2.0}, 10)
    clock.now += 10
    console.log({"train/loss": 1.0}, 30)
    lines = stream.getvalue().splitlines()
    assert lines[1].startswith("step 30/100") and lines[1].endswith("eta 0:00:35")
    plain, out = plain_console(monkeypatch, clock, total_steps=None)
    plain.log({"train/loss": 2.0}, 1)
    assert out.getvalue().startswith("step 1/?") and out.getvalue().rstrip().endswith("eta -")


def test_step_values_collects_one_value_per_micro_batch(tmp_path: Path):
    jsonl = JsonlTracker(tmp_path / "metrics.jsonl")
    tb = TensorBoardTracker(tmp_path / "tb")
    wrapped = StepValues(Trackers([jsonl, tb]), "data/step_buckets")
    for bucket in (2, 0, 1):
        wrapped.record(bucket)
    wrapped.log({"train/loss": 1.0}, 3)
    wrapped.log({"train/loss": 0.5}, 4)  # nothing recorded since: no list
    jsonl.close()
    tb.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["data/step_buckets"] == [2.0, 0.0, 1.0]
    assert "data/step_buckets" not in records[1]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert "data/step_buckets" not in acc.Tags()["histograms"] + acc.Tags()["scalars"]


def test_console_progress_bar_on_a_terminal():
    stream = io.StringIO()
    console = ConsoleTracker(total_steps=50, stream=stream, plain=False)
    assert not console.plain
    console.log({"train/loss": 3.0}, 5)
    console.close()
    out = stream.getvalue()
    assert "5/50" in out and "loss 3.0000" in out
    # Time-bounded: the bar fills with elapsed time against the limit.
    clock = FakeClock()
    stream = io.StringIO()
    console = ConsoleTracker(total_steps=10**5, stream=stream, plain=False, max_time_s=600.0, clock=clock)
    console.training_started()
    clock.now += 150
    console.log({"train/loss": 3.0}, 7)
    console.close()
    assert "step 7  0:02:30/0:10:00" in stream.getvalue() and "eta 0:07:30" in stream.getvalue()


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
