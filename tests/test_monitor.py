"""Monitor: log intervals, queue depths, rates, run totals, cross-rank combine, final flush."""

import json
import queue
from pathlib import Path

import pytest

from dflash_trainer.training.pipeline.metrics import Max, MeanSpread, Min, Ratio, Sum, combine
from dflash_trainer.training.pipeline.monitor import Monitor
from dflash_trainer.training.trackers import JsonlTracker, Trackers


class Clock:
    """A hand-driven clock so the rates are exact."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class TrainStage:
    """Counts like the train loop: windowed loss mean, tokens and samples, reset on read."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.tokens = 0
        self.samples = 0

    def step(self, loss: float, tokens: int, samples: int) -> None:
        self.losses.append(loss)
        self.tokens += tokens
        self.samples += samples

    def get_metrics(self) -> dict:
        out: dict = {"train/tokens": Sum(float(self.tokens)), "train/samples": Sum(float(self.samples))}
        if self.losses:
            out["train/loss"] = Ratio(sum(self.losses), len(self.losses))
        self.losses, self.tokens, self.samples = [], 0, 0
        return out


class Dispatcher:
    """Counts batches dispatched per bucket in the window, like the prefetcher."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def dispatch(self, bucket: int) -> None:
        self.counts[bucket] = self.counts.get(bucket, 0) + 1

    def get_metrics(self) -> dict[str, float]:
        out = {f"data/bucket/{b}/dispatched": float(n) for b, n in self.counts.items()}
        out["pipe/prefetch/busy_frac"] = 0.5
        self.counts = {}
        return out


class QueueChannel:
    """A channel stand-in backed by a real bounded queue."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self._queue: queue.Queue = queue.Queue(maxsize=capacity)

    def put(self, item: object) -> None:
        self._queue.put(item, timeout=1)

    def qsize(self) -> int:
        return self._queue.qsize()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def build(tmp_path: Path, clock: Clock, **kwargs) -> tuple[Monitor, TrainStage, Dispatcher,
                                                            QueueChannel, Trackers]:
    train, data = TrainStage(), Dispatcher()
    channel = QueueChannel("batches", capacity=4)
    trackers = Trackers([JsonlTracker(tmp_path / "metrics.jsonl")])
    monitor = Monitor({"train": train, "prefetch": data}, {"batches": channel}, trackers,
                      clock=clock, **kwargs)
    return monitor, train, data, channel, trackers


def test_logs_every_n_steps_with_rates_depths_and_run_totals(tmp_path: Path):
    clock = Clock()
    monitor, train, data, channel, trackers = build(tmp_path, clock, every_steps=2)
    channel.put("a")
    channel.put("b")
    plan = [0, 1, 0, 0]
    logged = []
    for step, bucket in enumerate(plan, start=1):
        data.dispatch(bucket)
        train.step(loss=float(step), tokens=100, samples=4)
        clock.now += 0.5
        logged.append(monitor.maybe_log(step))
    trackers.close()

    assert logged[0] is None and logged[2] is None
    first, second = logged[1], logged[3]
    assert first["train/loss"] == 1.5
    assert first["perf/tokens_per_s"] == 200 / 1.0
    assert first["perf/samples_per_s"] == 8 / 1.0
    assert first["pipe/queue/batches"] == 2
    assert first["pipe/prefetch/busy_frac"] == 0.5
    assert first["data/bucket/0/dispatched"] == 1 and first["data/bucket/1/dispatched"] == 1
    # Bucket 1 is idle in the second window: its run total is still logged.
    assert second["data/bucket/0/dispatched"] == 3 and second["data/bucket/1/dispatched"] == 1
    assert second["train/tokens_total"] == 400 and second["train/samples_total"] == 16
    assert "train/tokens" not in second and "train/samples" not in second

    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4]
    assert records[1]["data/bucket/0/dispatched"] == 3


def test_time_trigger_and_final_flush(tmp_path: Path):
    clock = Clock()
    monitor, train, _, _, trackers = build(tmp_path, clock, every_steps=100, every_s=10.0)
    train.step(1.0, tokens=10, samples=1)
    clock.now += 4
    assert monitor.maybe_log(1) is None
    train.step(3.0, tokens=30, samples=1)
    clock.now += 6
    logged = monitor.maybe_log(2)
    assert logged is not None and logged["train/loss"] == 2.0
    assert logged["perf/tokens_per_s"] == 40 / 10
    assert monitor.final(2) is None  # nothing since the last log
    train.step(5.0, tokens=50, samples=1)
    clock.now += 1
    last = monitor.final(3)
    assert last is not None and last["train/loss"] == 5.0 and last["train/tokens_total"] == 90
    trackers.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [2, 3]


def test_gather_sees_the_raw_window_and_disables_the_time_trigger(tmp_path: Path):
    seen = []

    def gather(window: dict) -> list[dict]:
        # A 2-rank all-gather when the other rank counted the same.
        seen.append(dict(window))
        return [window, dict(window)]

    clock = Clock()
    with pytest.warns(UserWarning, match="every_s has no effect"):
        monitor, train, data, _, trackers = build(tmp_path, clock, every_steps=3, every_s=0.1,
                                                  gather=gather)
    train.step(1.0, tokens=100, samples=2)
    data.dispatch(2)
    clock.now += 5
    assert monitor.maybe_log(1) is None  # time alone never triggers with a gather
    clock.now += 5
    logged = monitor.maybe_log(3)
    trackers.close()
    assert seen[0]["train/tokens"] == Sum(100.0) and seen[0]["pipe/queue/batches"] == 0
    assert logged["perf/tokens_per_s"] == 200 / 10  # Sum: the job's tokens
    assert logged["data/bucket/2/dispatched"] == 1  # plain: the mean of the ranks
    assert logged["train/loss"] == 1.0 and logged["train/tokens_total"] == 200


def test_combine_applies_each_metrics_rule():
    ranks = [{"loss": Ratio(6.0, 2.0), "tokens": Sum(10.0), "gmax": Max(3.0), "frac": 0.2,
              "step_s": MeanSpread(1.0, "spread"), "only0": 5.0, "short": Min(4.0)},
             {"loss": Ratio(1.0, 8.0), "tokens": Sum(30.0), "gmax": Max(7.0), "frac": 0.4,
              "step_s": MeanSpread(3.0, "spread"), "short": Min(2.0)}]
    out = combine(ranks)
    assert out["loss"] == pytest.approx(7.0 / 10.0)  # over every rank's weight, not mean of means
    assert out["tokens"] == 40.0 and out["gmax"] == 7.0 and out["frac"] == pytest.approx(0.3)
    assert out["step_s"] == 2.0 and out["spread"] == 2.0 and out["only0"] == 5.0
    assert out["short"] == 2.0
    assert combine([{"empty": Ratio(0.0, 0.0)}]) == {"empty": 0.0}
    assert "spread" not in combine(ranks[:1])
    with pytest.raises(TypeError, match="loss"):
        combine([{"loss": Ratio(1.0, 1.0)}, {"loss": 1.0}])


def test_state_dict_keeps_run_totals_across_a_resume(tmp_path: Path):
    clock = Clock()
    monitor, train, data, _, trackers = build(tmp_path, clock, every_steps=1)
    data.dispatch(0)
    train.step(1.0, tokens=10, samples=1)
    clock.now += 1
    monitor.maybe_log(1)
    state = json.loads(json.dumps(monitor.state_dict()))  # checkpoint-serializable
    trackers.close()

    resumed, train2, data2, _, trackers2 = build(tmp_path, clock, every_steps=1)
    resumed.load_state_dict(state)
    assert resumed.final(1) is None
    data2.dispatch(0)
    train2.step(1.0, tokens=5, samples=1)
    clock.now += 1
    logged = resumed.maybe_log(2)
    trackers2.close()
    assert logged["data/bucket/0/dispatched"] == 2 and logged["train/tokens_total"] == 15


def test_a_metric_from_two_stages_is_an_error(tmp_path: Path):
    class Loss:
        def get_metrics(self) -> dict[str, float]:
            return {"train/loss": 1.0}

    monitor = Monitor({"a": Loss(), "b": Loss()}, {}, Trackers(), every_steps=1)
    with pytest.raises(ValueError, match="'train/loss' is reported by both stage 'a' and "
                                         "stage 'b'"):
        monitor.maybe_log(1)


def test_rejects_bad_intervals():
    with pytest.raises(ValueError, match="logging.every_steps"):
        Monitor({}, {}, Trackers(), every_steps=0)
    with pytest.raises(ValueError, match="logging.every_s"):
        Monitor({}, {}, Trackers(), every_steps=1, every_s=0)
