"""Stop signals: every command ends on SIGINT (Ctrl-C) or SIGTERM with one line and exit code
128 + the signal number (130, 143), except ``train`` while it trains, which stops gracefully.

``cli.main`` runs each command inside :func:`stop_signals_raise`: both signals raise
:class:`Interrupted` in the main thread. It is a ``KeyboardInterrupt``, so every cleanup that
runs on Ctrl-C runs on SIGTERM too: ``finally`` blocks remove temporary folders, locks are
released, ``regenerate`` keeps the conversations it wrote. ``train`` replaces the handlers
while it trains (:class:`~dflash_trainer.training.pipeline.stage.GracefulStop`: the step finishes, a
final checkpoint is written, exit 0) and puts them back afterwards. The table of what each
command keeps is in docs/errors.md.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

INTERRUPT_HINTS = {
    "prepare": "no token store was written (a half-built one is removed); run prepare again",
    "train": "the checkpoints written so far are kept; continue with --resume auto",
    "eval": "results are written at the end only; run eval again",
    "export": "no export was written (a half-written one is removed); run export again",
    "regenerate": "the conversations written so far are kept; run the same command again to "
                  "continue",
    "demo": "what was done stays in its run folder; run the demo again for a new run",
    "report": "run report again to write it",
    "generate": "nothing to keep",
}
"""What an interrupted command leaves behind and what to do: the end of its one line."""


class Interrupted(KeyboardInterrupt):
    """A stop signal, raised in the main thread by :func:`stop_signals_raise`'s handler."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_code(signum: int) -> int:
    """The exit code of a command ended by ``signum``: 128 + its number, as the shell reports."""
    return 128 + int(signum)


def signal_of(exc: KeyboardInterrupt) -> int:
    """The signal behind a ``KeyboardInterrupt`` (SIGINT unless it is an :class:`Interrupted`)."""
    return getattr(exc, "signum", signal.SIGINT)


def interrupted_line(command: str, signum: int) -> str:
    """``dflash-trainer CMD: interrupted (SIGNAME); what is kept and what to do``."""
    hint = INTERRUPT_HINTS.get(command, "run the command again")
    return f"dflash-trainer {command}: interrupted ({signal.Signals(signum).name}); {hint}"


def report_interrupt(command: str, signum: int) -> int:
    """Print :func:`interrupted_line` on stderr (on a line of its own on a terminal, where
    Ctrl-C interrupts a half-written line) and return the exit code."""
    sys.stdout.flush()
    start = "\n" if sys.stderr.isatty() else ""
    print(start + interrupted_line(command, signum), file=sys.stderr, flush=True)
    return exit_code(signum)


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[list[int]]:
    """SIGINT and SIGTERM raise :class:`Interrupted` inside the block; yields the signals
    received (a command may catch the exception and return, as ``regenerate`` does: the first
    signal still decides the exit code). Restores the previous handlers on exit. Outside the
    main thread (no signal handlers there) it does nothing."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
