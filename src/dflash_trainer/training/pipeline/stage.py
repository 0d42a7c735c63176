"""Pipeline stages (threads), the supervisor that owns them, and graceful-stop signals.

Shutdown protocol: all stages share one stop ``Event``. A stage body returns normally ->
its output channels get end-of-stream. A body raises -> the exception (with its formatted
traceback attached as a note) ends the output channels as a failure, and the supervisor
records it (first error wins) and sets the stop signal, which unblocks every channel call
in every stage within ``channel.POLL_S``. The main thread then closes the supervisor
(joins every thread with a timeout) and re-raises the original exception object.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import Any

from dflash_trainer.training.pipeline.channel import END, Channel, StageFailure, StopRequested

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0


class Stage:
    """A pipeline stage: subclasses implement :meth:`run`, which runs on the stage's thread.

    ``run`` reads its inputs (``Channel.get`` / iteration) and puts into ``outputs``; it marks
    its working time with ``with self.busy():`` for ``pipe/{name}/busy_frac``. Helper threads
    started with :meth:`spawn` share the failure handling; ``num_busy_threads`` is how many
    threads may be busy at once (the busy fraction's denominator).
    """

    def __init__(self, name: str, *, stop: threading.Event, outputs: Sequence[Channel] = (),
                 num_busy_threads: int = 1, join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        self.name = name
        self.stop = stop
        self.outputs = list(outputs)
        self.join_timeout_s = join_timeout_s
        self.failure: StageFailure | None = None
        self.on_failure: Callable[[StageFailure], None] | None = None
        """Called once per failing thread; the supervisor sets it. Default: set the stop."""
        self._num_busy_threads = num_busy_threads
        self._threads: list[threading.Thread] = []
        self._lifecycle_lock = threading.Lock()
        self._started = False
        self._closed = False
        self._metrics_lock = threading.Lock()
        self._busy_s = 0.0
        self._busy_since: dict[int, float] = {}
        self._window_start = time.perf_counter()

    def run(self) -> None:
        """The stage body; returning normally ends the output channels."""
        raise NotImplementedError

    def start(self) -> None:
        """Start the stage thread (once)."""
        with self._lifecycle_lock:
            if self._closed:
                raise RuntimeError(f"stage {self.name!r} was closed; build a new one")
            if self._started:
                raise RuntimeError(f"stage {self.name!r} already started")
            self._started = True
        self._launch(self.run, f"{self.name}", finishes_outputs=True)

    def spawn(self, target: Callable[[], None], name: str) -> threading.Thread:
        """Start a helper thread of this stage; its exceptions fail the stage like ``run``'s."""
        return self._launch(target, f"{self.name}/{name}", finishes_outputs=False)

    def _launch(self, target: Callable[[], None], name: str,
                finishes_outputs: bool) -> threading.Thread:
        thread = threading.Thread(target=self._thread_main, args=(target, finishes_outputs),
                                  name=name, daemon=True)
        with self._lifecycle_lock:
            self._threads.append(thread)
        thread.start()
        return thread

    def _thread_main(self, target: Callable[[], None], finishes_outputs: bool) -> None:
        try:
            target()
        except StopRequested:
            return
        except BaseException as exc:  # forwarded, never swallowed: see _report
            self._report(StageFailure.capture(exc, self.name))
            return
        if finishes_outputs:
            for channel in self.outputs:
                channel.finish()

    def _report(self, failure: StageFailure) -> None:
        with self._metrics_lock:
            if self.failure is None:
                self.failure = failure
        # End the outputs before stopping, so a consumer that is not supervised still sees
        # the failure in order after the values it already has.
        for channel in self.outputs:
            channel.fail(failure)
        if self.on_failure is not None:
            self.on_failure(failure)
        else:
            self.stop.set()

    def is_alive(self) -> bool:
        """Whether any thread of this stage is still running."""
        with self._lifecycle_lock:
            threads = list(self._threads)
        return any(t.is_alive() for t in threads)

    def close(self, timeout_s: float | None = None) -> bool:
        """Stop (if still running) and join every thread; idempotent.

        Setting the stop signal stops the whole pipeline: closing one running stage is a
        shutdown. Returns False (and logs the names) if threads outlived the timeout.
        """
        with self._lifecycle_lock:
            self._closed = True
            threads = list(self._threads)
        if any(t.is_alive() for t in threads):
            self.stop.set()
        deadline = time.monotonic() + (self.join_timeout_s if timeout_s is None else timeout_s)
        me = threading.current_thread()
        for thread in threads:
            if thread is not me:
                thread.join(max(0.0, deadline - time.monotonic()))
        stragglers = [t.name for t in threads if t.is_alive() and t is not me]
        if stragglers:
            logger.warning("stage %r: threads still running after close: %s", self.name,
                           ", ".join(stragglers))
        return not stragglers

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Count the enclosed time as busy for this thread."""
        ident = threading.get_ident()
        with self._metrics_lock:
            self._busy_since[ident] = time.perf_counter()
        try:
            yield
        finally:
            with self._metrics_lock:
                self._busy_s += time.perf_counter() - self._busy_since.pop(ident)

    def get_metrics(self) -> dict[str, float]:
        """Metrics over the window since the previous call (thread-safe; resets the window).

        ``pipe/{name}/busy_frac``, the stage's own :meth:`collect_metrics` and the put/get
        wait times of its output channels.
        """
        with self._metrics_lock:
            now = time.perf_counter()
            busy = self._busy_s + sum(now - since for since in self._busy_since.values())
            window = now - self._window_start
            self._busy_s = 0.0
            self._busy_since = dict.fromkeys(self._busy_since, now)
            self._window_start = now
        frac = busy / (window * self._num_busy_threads) if window > 0 else 0.0
        metrics = {f"pipe/{self.name}/busy_frac": min(1.0, frac)}
        metrics.update(self.collect_metrics())
        for channel in self.outputs:
            metrics.update(channel.get_metrics())
        return metrics

    def collect_metrics(self) -> dict[str, float]:
        """Stage-specific windowed metrics; subclasses reset their own counters here."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Position in the data, for stages that hold one."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` before :meth:`start`."""
        if state:
            raise ValueError(f"stage {self.name!r} holds no state, got keys {sorted(state)}")


class Supervisor:
    """Starts stages, turns the first failure anywhere into a stop, and re-raises it.

    The main thread consumes the last channel itself (:meth:`iterate`, calling
    :meth:`check` between steps if it does other work). Use as a context manager so threads
    are always joined.
    """

    def __init__(self, stop: threading.Event | None = None, *,
                 join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        self.stop = stop if stop is not None else threading.Event()
        self.join_timeout_s = join_timeout_s
        self.stages: list[Stage] = []
        self._failure: StageFailure | None = None
        self._lock = threading.Lock()

    def add(self, stage: Stage) -> Stage:
        """Supervise ``stage``, which must share this supervisor's stop signal."""
        if stage.stop is not self.stop:
            raise ValueError(f"stage {stage.name!r} must be built with the supervisor's stop event")
        stage.on_failure = self._on_failure
        self.stages.append(stage)
        return stage

    def start(self) -> None:
        """Start every stage, in the order added."""
        for stage in self.stages:
            stage.start()

    @property
    def failure(self) -> StageFailure | None:
        """The first failure recorded, if any."""
        return self._failure

    def _on_failure(self, failure: StageFailure) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = failure
        self.stop.set()

    def check(self) -> None:
        """If a stage failed: close everything and re-raise its original exception."""
        failure = self._failure
        if failure is not None:
            self.close()
            raise failure.exc

    def iterate(self, channel: Channel) -> Iterator[Any]:
        """Consume ``channel`` on the calling thread until end-of-stream.

        Stops quietly when the stop signal is set without a failure (graceful stop); any
        failure closes the pipeline and is re-raised here.
        """
        while True:
            self.check()  # a failure elsewhere wins over values still queued here
            try:
                value = channel.get()
            except StopRequested:
                value = None
                stopped = True
            except BaseException:
                self.close()
                raise
            else:
                stopped = False
            if stopped:
                self.check()
                return
            if value is END:
                return
            yield value

    def close(self) -> bool:
        """Stop what still runs and join every stage with the timeout; idempotent."""
        if any(stage.is_alive() for stage in self.stages):
            self.stop.set()
        deadline = time.monotonic() + self.join_timeout_s
        joined = [stage.close(max(0.0, deadline - time.monotonic())) for stage in self.stages]
        return all(joined)

    def get_metrics(self) -> dict[str, float]:
        """All stages' metrics (each resets its own window)."""
        metrics: dict[str, float] = {}
        for stage in self.stages:
            metrics.update(stage.get_metrics())
        return metrics

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
        if exc_type is None:
            self.check()


class GracefulStop:
    """SIGINT/SIGTERM request a graceful stop instead of killing the process.

    The trainer reads :attr:`requested` between steps, finishes the step and writes a final
    checkpoint. A second SIGINT raises ``KeyboardInterrupt`` (the user insists). The handler
    only sets a flag: no I/O or locks inside a signal handler.
    """

    def __init__(self, signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM)) -> None:
        self.signals = tuple(signals)
        self.event = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """Whether a stop signal arrived."""
        return self.event.is_set()

    def install(self) -> GracefulStop:
        """Install the handlers (main thread only), remembering the previous ones."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("GracefulStop.install() must be called from the main thread")
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put the previous handlers back; idempotent."""
        while self._previous:
            sig, handler = self._previous.popitem()
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        self.event.set()

    def __enter__(self) -> GracefulStop:
        return self.install()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.restore()
