"""Channel: bounded, one stop signal, values then end-of-stream or the original failure."""

import threading
import time

import pytest

from dflash_trainer.training.pipeline.channel import END, Channel, StageFailure, StopRequested


def _failure(exc: BaseException) -> StageFailure:
    try:
        raise exc
    except BaseException as caught:
        return StageFailure.capture(caught, "producer")


def _in_thread(fn):
    """Run ``fn`` on a thread; return (thread, box) where box holds its result or exception."""
    box: dict = {}

    def main():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            box["error"] = exc
        box["done_at"] = time.monotonic()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return thread, box


def test_values_in_order_then_end_repeatedly():
    ch = Channel("c", 4, threading.Event())
    for i in range(3):
        ch.put(i)
    ch.finish()
    assert ch.qsize() == 3 and ch.capacity == 4
    assert list(ch) == [0, 1, 2]
    assert ch.get() is END and ch.get() is END


def test_failure_travels_after_the_values_and_is_the_original_exception():
    ch = Channel("c", 4, threading.Event())
    ch.put("a")
    ch.put("b")
    original = ValueError("bad record 7")
    ch.fail(_failure(original))
    assert ch.get() == "a"
    assert ch.get() == "b"
    with pytest.raises(ValueError, match="bad record 7") as info:
        ch.get()
    assert info.value is original
    assert any("raised in pipeline stage 'producer'" in note for note in info.value.__notes__)
    with pytest.raises(ValueError):  # stays failed
        ch.get()


def test_first_terminal_wins_and_put_after_end_is_refused():
    ch = Channel("c", 2, threading.Event())
    ch.finish()
    ch.fail(_failure(RuntimeError("late")))
    assert ch.get() is END
    with pytest.raises(StopRequested):
        ch.put(1)


def test_put_blocks_when_full_until_a_get():
    ch = Channel("c", 1, threading.Event())
    ch.put(1)
    thread, box = _in_thread(lambda: ch.put(2))
    time.sleep(0.2)
    assert "done_at" not in box  # still blocked: the channel is bounded
    assert ch.get() == 1
    thread.join(5)
    assert box.get("result", "missing") is None
    assert ch.get() == 2


@pytest.mark.parametrize("blocked_call", ["put_full", "get_empty"])
def test_stop_signal_unblocks_a_full_put_and_an_empty_get(blocked_call):
    stop = threading.Event()
    ch = Channel("c", 1, stop)
    if blocked_call == "put_full":
        ch.put(0)
        thread, box = _in_thread(lambda: ch.put(1))
    else:
        thread, box = _in_thread(ch.get)
    time.sleep(0.2)
    assert "done_at" not in box
    stopped_at = time.monotonic()
    stop.set()
    thread.join(5)
    assert not thread.is_alive()
    assert isinstance(box["error"], StopRequested)
    assert box["done_at"] - stopped_at < 1.0


def test_stop_caused_by_a_failure_still_delivers_values_then_the_failure():
    stop = threading.Event()
    ch = Channel("c", 2, stop)
    ch.put(1)
    ch.fail(_failure(KeyError("k")))
    stop.set()
    assert ch.get() == 1
    with pytest.raises(KeyError):
        ch.get()


def test_stop_without_failure_skips_queued_values():
    stop = threading.Event()
    ch = Channel("c", 2, stop)
    ch.put(1)
    stop.set()
    with pytest.raises(StopRequested):
        ch.get()


def test_wait_metrics_count_blocked_time_and_reset():
    ch = Channel("q", 1, threading.Event())
    thread, _ = _in_thread(lambda: ch.get())
    time.sleep(0.3)
    ch.put("x")
    thread.join(5)
    metrics = ch.get_metrics()
    assert metrics["pipe/queue/q/get_wait_s"] >= 0.2
    assert metrics["pipe/queue/q/puts"] == 1 and metrics["pipe/queue/q/gets"] == 1
    again = ch.get_metrics()
    assert again["pipe/queue/q/get_wait_s"] == 0 and again["pipe/queue/q/gets"] == 0


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        Channel("c", 0, threading.Event())
