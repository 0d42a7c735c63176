"""``python -m dflash_trainer.cli.torchrun``: torchrun that exits with the failed rank's code.

torchrun's elastic agent turns any failed rank into its own ``ChildFailedError`` and exits 1,
whatever the rank exited with: a refused resume (2 on every rank) or an interrupt (130, 143)
would all read as 1, unlike docs/errors.md. This launcher takes torchrun's arguments unchanged,
prints torchrun's failure summary, and exits with the code of the rank that failed first on its
own (a rank that the agent then stopped with a signal only counts when no rank failed
otherwise); a rank killed by signal N is reported as 128 + N, as a shell does.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

__all__ = ["exit_code_of", "main"]

STOP_CODES = frozenset({130, 143})
"""Exit codes of a rank stopped by SIGINT or SIGTERM (the agent stops the others that way)."""


def exit_code_of(error: ChildFailedError) -> int:
    """The exit code a launch that failed with ``error`` should end with: the earliest failure
    (then the lowest rank) among the ranks that were not stopped by a signal, else among all."""

    def order(item: tuple[int, ProcessFailure]) -> tuple[bool, int, int]:
        rank, failure = item
        stopped = failure.exitcode < 0 or failure.exitcode in STOP_CODES
        return stopped, failure.timestamp, rank

    _, failure = min(error.failures.items(), key=order)
    return 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default: this process's arguments); its exit code."""
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(None if argv is None else list(argv))
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr, flush=True)
        return exit_code_of(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
