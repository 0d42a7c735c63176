"""The user-error hierarchy: mistakes in input, config or environment that the user can fix.

``cli.main`` catches every :class:`UserError` and prints one line (``dflash-trainer CMD: what
went wrong, where, and what to do``) and exits with the class's :attr:`UserError.exit_code`;
anything else is a bug and keeps its traceback. ``--debug`` or ``DFLASH_DEBUG=1`` shows the
traceback for user errors too.

Exit codes: 0 success or a graceful stop of ``train`` (SIGINT/SIGTERM while it trains, time
limit), 1 data, target, checkpoint, disk, lock, engine or runtime errors, 2 usage and config
errors, 3 a ``train`` run that diverged (:class:`DivergedError`), 130 / 143 a command
interrupted by SIGINT / SIGTERM (:mod:`dflash_trainer.core.interrupts`).
Each class also derives from the built-in exception it used to be (``ValueError``,
``RuntimeError``, ``OSError``), so code that catches those keeps working.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_DIVERGED = 3


class UserError(Exception):
    """An error the user can fix; its message names the file/line, field or folder and the fix."""

    exit_code: int = EXIT_RUNTIME
    kind: str = "error"
    """Short label printed before the message (``config error``, ``data error``...)."""


class ConfigError(UserError, ValueError):
    """A config file, key, value or command-line option is wrong."""

    exit_code = EXIT_USAGE
    kind = "config error"


class DataError(UserError, ValueError):
    """A data file or store is unreadable, malformed or yields no training samples."""

    kind = "data error"


class TargetError(UserError, ValueError):
    """The target model (or its tokenizer/template) cannot serve the requested setup."""

    kind = "target error"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint or exported drafter is missing, incomplete, corrupted or does not match."""

    kind = "checkpoint error"


class DiskError(UserError, OSError):
    """A folder cannot be written (disk full, read-only, permissions)."""

    kind = "disk error"


class ServerError(UserError, RuntimeError):
    """An inference server (``regenerate --backend openai``) failed or answered nonsense."""

    kind = "server error"


class EngineError(UserError, RuntimeError):
    """The inference engine serving the target's hidden states (``engine.kind=vllm``) died, hung,
    or serves another model; the message names its log."""

    kind = "engine error"


class LockError(UserError, RuntimeError):
    """A folder is being written by another process (one writer per folder)."""

    kind = "lock error"


class DivergedError(UserError, RuntimeError):
    """A training run whose loss or gradients stayed non-finite for
    ``training.max_nonfinite_steps`` steps: a result of the run (its last finite state is
    checkpointed), told apart from a crash by its exit code."""

    exit_code = EXIT_DIVERGED
    kind = "training diverged"
