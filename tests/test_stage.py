"""Stage / Supervisor: first error stops everything and is re-raised on the main thread."""

import os
import signal
import threading
import time
import traceback

import pytest

from dflash_trainer.training.pipeline.channel import END, Channel
from dflash_trainer.training.pipeline.stage import GracefulStop, Stage, Supervisor


class Source(Stage):
    """Puts 0, 1, 2, ... (``count`` of them, or forever) into its output."""

    def __init__(self, out: Channel, stop: threading.Event, count: int | None = None) -> None:
        super().__init__("source", stop=stop, outputs=[out])
        self.count = count

    def run(self) -> None:
        i = 0
        while self.count is None or i < self.count:
            self.outputs[0].put(i)
            i += 1


class Doubler(Stage):
    """Doubles values; raises ``fail_at`` is reached."""

    def __init__(self, inbox: Channel, out: Channel, stop: threading.Event,
                 fail_at: int | None = None) -> None:
        super().__init__("doubler", stop=stop, outputs=[out])
        self.inbox = inbox
        self.fail_at = fail_at

    def run(self) -> None:
        for value in self.inbox:
            with self.busy():
                if value == self.fail_at:
                    explode(value)
                self.outputs[0].put(2 * value)


def explode(value: int) -> None:
    raise ZeroDivisionError(f"cannot double {value}")


def _stage_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("source", "doubler"))]


def _pipeline(fail_at: int | None, count: int | None):
    sup = Supervisor()
    a = Channel("a", 2, sup.stop)
    b = Channel("b", 2, sup.stop)
    sup.add(Source(a, sup.stop, count))
    sup.add(Doubler(a, b, sup.stop, fail_at))
    return sup, b


def test_main_thread_consumer_gets_every_value_then_end():
    sup, out = _pipeline(fail_at=None, count=50)
    with sup:
        sup.start()
        assert list(sup.iterate(out)) == [2 * i for i in range(50)]
    assert not _stage_threads()


def test_stage_error_is_reraised_on_main_thread_with_original_traceback():
    # The source runs forever and is blocked on a full channel when the doubler fails:
    # the stop signal must unblock it so that every thread exits.
    sup, out = _pipeline(fail_at=5, count=None)
    start = time.monotonic()
    received = []
    with pytest.raises(ZeroDivisionError, match="cannot double 5") as info:
        with sup:
            sup.start()
            for value in sup.iterate(out):
                received.append(value)
    assert time.monotonic() - start < 10
    assert received == [0, 2, 4, 6, 8][:len(received)]
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "explode" in frames  # the worker's frames, not only the main thread's
    assert any("stage 'doubler'" in note and "explode" in note for note in info.value.__notes__)
    assert not _stage_threads()


def test_check_reraises_promptly_between_steps():
    sup, _ = _pipeline(fail_at=0, count=None)
    with pytest.raises(ZeroDivisionError):
        with sup:
            sup.start()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                sup.check()
                time.sleep(0.01)
    assert not _stage_threads()


def test_unsupervised_consumer_sees_the_failure_after_values():
    stop = threading.Event()
    a, b = Channel("a", 8, stop), Channel("b", 8, stop)
    source, doubler = Source(a, stop, count=3), Doubler(a, b, stop, fail_at=2)
    source.start()
    doubler.start()
    assert b.get() == 0 and b.get() == 2
    with pytest.raises(ZeroDivisionError):
        b.get()
    assert source.close() and doubler.close()


def test_close_is_idempotent_and_start_after_close_is_refused():
    stop = threading.Event()
    out = Channel("a", 1, stop)
    stage = Source(out, stop, count=None)
    assert stage.close()  # never started
    stage2 = Source(Channel("b", 1, stop), stop, count=None)
    stage2.start()
    assert stage2.close(timeout_s=5)
    assert stage2.close(timeout_s=5)
    assert not stage2.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        stage2.start()


def test_normal_end_closes_outputs_and_close_does_not_stop_others():
    stop = threading.Event()
    out = Channel("a", 8, stop)
    stage = Source(out, stop, count=3)
    stage.start()
    assert [out.get() for _ in range(3)] == [0, 1, 2]
    assert out.get() is END
    assert stage.close()
    assert not stop.is_set()  # a finished stage does not stop the pipeline when closed


def test_busy_frac_is_windowed():
    stop = threading.Event()

    class Busy(Stage):
        def run(self) -> None:
            while not self.stop.is_set():
                with self.busy():
                    time.sleep(0.05)

    stage = Busy("busy", stop=stop)
    stage.start()
    time.sleep(0.3)
    first = stage.get_metrics()["pipe/busy/busy_frac"]
    stage.close()
    time.sleep(0.3)
    second = stage.get_metrics()["pipe/busy/busy_frac"]
    assert first > 0.5
    assert second < 0.5  # the window restarted; idle after close


def test_supervisor_refuses_a_stage_with_another_stop_event():
    sup = Supervisor()
    with pytest.raises(ValueError, match="stop event"):
        sup.add(Source(Channel("a", 1, threading.Event()), threading.Event()))


def test_graceful_stop_sets_a_flag_and_restores_handlers():
    previous = signal.getsignal(signal.SIGTERM)
    with GracefulStop() as stopper:
        assert not stopper.requested
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not stopper.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stopper.requested and stopper.signum == signal.SIGTERM
        # A second SIGINT means "abort now".
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGTERM) is previous
