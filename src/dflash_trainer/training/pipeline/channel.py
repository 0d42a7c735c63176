"""Bounded channels between pipeline stages: values, end-of-stream and failures in one place.

A channel has one producer side and any number of consumers. Values go through a bounded
``queue.Queue`` (this is the backpressure). The producer ends the stream once, with
:meth:`Channel.finish` or :meth:`Channel.fail`; that terminal item is delivered after every
value put before it, and it never blocks, so a failing stage can always report. Every
blocking call waits in short slices and checks the pipeline's one stop signal, so nothing
blocks forever (Python 3.11 has no ``Queue.shutdown``).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

POLL_S = 0.05
"""How often a blocked put/get re-checks the stop signal."""


class StopRequested(Exception):
    """A blocking channel call gave up because the pipeline is stopping (not a failure)."""


class _EndOfStream:
    def __repr__(self) -> str:
        return "END"


END: Any = _EndOfStream()
"""Returned by :meth:`Channel.get` once the producer finished and every value was taken."""


@dataclass(frozen=True)
class StageFailure:
    """An exception raised in a stage, with where it happened and its formatted traceback."""

    exc: BaseException
    stage: str
    thread: str
    traceback: str

    @classmethod
    def capture(cls, exc: BaseException, stage: str) -> StageFailure:
        """Wrap ``exc`` (being handled now) and attach the worker traceback to it as a note.

        The note is added once, here, so every later re-raise of the same object (in a
        consumer stage, then on the main thread) shows where it really came from.
        """
        text = "".join(traceback.format_exception(exc))
        thread = threading.current_thread().name
        exc.add_note(f"[dflash-trainer] raised in pipeline stage {stage!r} on thread {thread!r}; "
                     f"worker traceback:\n{text.rstrip()}")
        return cls(exc=exc, stage=stage, thread=thread, traceback=text)


class Channel:
    """Bounded single-producer channel observing one stop signal.

    ``put`` raises :class:`StopRequested` when the stop signal is set or the stream was
    already ended. ``get`` returns the next value, then :data:`END` after ``finish``, or
    re-raises the producer's original exception after ``fail``. A failure is always
    delivered after the values queued before it (the stop a failure causes does not hide
    it); a stop without a failure makes ``get`` raise :class:`StopRequested` at once.
    """

    def __init__(self, name: str, capacity: int, stop: threading.Event) -> None:
        if capacity < 1:
            raise ValueError(f"channel {name!r}: capacity must be >= 1, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.stop = stop
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self._terminal: StageFailure | _EndOfStream | None = None
        self._lock = threading.Lock()
        self._put_wait_s = 0.0
        self._get_wait_s = 0.0
        self._num_put = 0
        self._num_get = 0

    def qsize(self) -> int:
        """Values currently queued (approximate, as ``queue.Queue.qsize``)."""
        return self._queue.qsize()

    def put(self, value: Any) -> None:
        """Enqueue ``value``, waiting while the channel is full."""
        start = time.perf_counter()
        done = False
        try:
            while not done:
                if self.stop.is_set() or self._terminal is not None:
                    raise StopRequested(f"channel {self.name!r} no longer accepts values")
                try:
                    self._queue.put(value, timeout=POLL_S)
                    done = True
                except queue.Full:
                    pass
        finally:
            with self._lock:
                self._put_wait_s += time.perf_counter() - start
                self._num_put += done

    def finish(self) -> None:
        """End the stream normally; consumers get :data:`END` after the queued values."""
        with self._lock:
            if self._terminal is None:
                self._terminal = END

    def fail(self, failure: StageFailure) -> None:
        """End the stream with a failure; consumers re-raise it after the queued values."""
        with self._lock:
            if self._terminal is None:
                self._terminal = failure

    def get(self) -> Any:
        """Next value, or :data:`END`; re-raises a producer failure."""
        start = time.perf_counter()
        got = False
        try:
            while True:
                # Read the terminal before looking at the queue: the producer puts its last
                # value before ending, so an empty queue after a set terminal is really empty.
                terminal = self._terminal
                if self.stop.is_set() and not isinstance(terminal, StageFailure):
                    raise StopRequested(f"pipeline stopping while reading {self.name!r}")
                try:
                    value = self._queue.get(timeout=POLL_S if terminal is None else 0)
                    got = True
                    return value
                except queue.Empty:
                    if terminal is not None:
                        self._raise_failure()
                        return END
        finally:
            with self._lock:
                self._get_wait_s += time.perf_counter() - start
                self._num_get += got

    def __iter__(self) -> Iterator[Any]:
        """Values until end-of-stream; raises a failure or :class:`StopRequested`."""
        while (value := self.get()) is not END:
            yield value

    def get_metrics(self) -> dict[str, float]:
        """Seconds spent in put/get (mostly waiting) and values moved since the last call."""
        with self._lock:
            metrics = {
                f"pipe/queue/{self.name}/put_wait_s": self._put_wait_s,
                f"pipe/queue/{self.name}/get_wait_s": self._get_wait_s,
                f"pipe/queue/{self.name}/puts": float(self._num_put),
                f"pipe/queue/{self.name}/gets": float(self._num_get),
            }
            self._put_wait_s = self._get_wait_s = 0.0
            self._num_put = self._num_get = 0
        return metrics

    def _raise_failure(self) -> None:
        terminal = self._terminal
        if isinstance(terminal, StageFailure):
            raise terminal.exc
