"""Append-only JSON Lines logs that a full disk never leaves with a torn line.

A buffered text file flushes what fits when the disk fills: half a line stays in the file, and
the line the resumed run appends after it is glued to that half (one unreadable line, and a
lost record). :class:`AppendLog` writes each line with unbuffered ``write`` calls and, when one
fails, truncates the file back to its size before the line, so a failed append leaves the file
as it was. A line torn by what cannot be rolled back (a kill, a power loss, a failed truncate)
is repaired when the log is opened again: a complete last record gets its newline back, a
partial one is cut off, and either is reported.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

__all__ = ["AppendLog", "repair_tail"]

log = logging.getLogger(__name__)

_TAIL_CHUNK = 1 << 16


def _last_newline(fd: int, size: int) -> int:
    """Offset just past the file's last newline (0 when it has none)."""
    end = size
    while end > 0:
        start = max(0, end - _TAIL_CHUNK)
        chunk = os.pread(fd, end - start, start)
        at = chunk.rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


def _is_record(data: bytes) -> bool:
    try:
        return isinstance(json.loads(data), dict)
    except ValueError:
        return False


def repair_tail(fd: int, path: Path) -> str | None:
    """Make the file behind ``fd`` (open for reading and appending) end with a whole line.

    Returns what was done (for a message), or None when the file was whole already.
    """
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return None
    keep = _last_newline(fd, size)
    tail = os.pread(fd, size - keep, keep)
    if _is_record(tail):
        os.write(fd, b"\n")
        return f"{path}: its last record had lost its newline (an interrupted write); it is restored"
    os.ftruncate(fd, keep)
    return (f"{path}: removed a torn last line of {size - keep} bytes that an interrupted write left "
            "(its record was never complete)")


class AppendLog:
    """One JSON object per line, appended; each line is on disk whole or not at all.

    The owner is the only writer (the run folder's lock): the size before a line is the size
    to return to when its write fails.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            repaired = repair_tail(self._fd, self.path) if _is_regular(self._fd) else None
        except BaseException:
            self.close()
            raise
        if repaired is not None:
            log.warning("%s", repaired)

    def append(self, record: dict) -> None:
        """Append ``record`` as one line; on a failed write the file is as it was before."""
        assert self._fd is not None, "append() after close()"
        line = memoryview((json.dumps(record) + "\n").encode())
        before = os.fstat(self._fd).st_size
        try:
            while line:
                line = line[os.write(self._fd, line):]
        except OSError:
            self._roll_back(before)
            raise

    def _roll_back(self, size: int) -> None:
        assert self._fd is not None
        if not _is_regular(self._fd):
            return  # a device or a pipe keeps nothing to cut
        try:
            os.ftruncate(self._fd, size)
        except OSError as exc:
            # The next open repairs the tail.
            log.warning("%s: cannot cut a partly written line after a failed write (%s); the next run "
                        "repairs it", self.path, exc)

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _is_regular(fd: int) -> bool:
    return stat.S_ISREG(os.fstat(fd).st_mode)
