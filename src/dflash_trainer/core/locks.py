"""One writer per folder: an exclusive ``flock`` on a lock file that names its holder.

A run folder is locked through ``RUN_DIR/.lock`` by the process that trains into it; a token
store being built is locked through ``CACHE_DIR/.KEY.lock``. The lock file holds JSON
``{"pid", "host", "command", "started"}`` of the holder, so that a second writer is refused
with one line naming who holds the folder (:class:`~dflash_trainer.core.errors.LockError`).

The kernel releases a ``flock`` when its holder dies, however it dies (SIGKILL included): a
lock file left by a killed process is taken over by the next writer, with a warning naming the
dead pid. The holder deletes the file when it releases the lock (still holding it, so a
waiter that opened the old file notices that it now locks a deleted file and tries again).
The descriptor is close-on-exec, so a program the holder starts does not inherit the lock.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_trainer.core.errors import DiskError, LockError
from dflash_trainer.core.fsutil import DISK_FIX, disk_error_for, disk_oserror, pid_alive

log = logging.getLogger(__name__)

RUN_LOCK = ".lock"
"""The lock file of a run folder."""
_POLL_S = 0.2


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        data = os.pread(fd, 4096, 0)
        holder = json.loads(data.decode("utf-8")) if data else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def describe_holder(holder: dict[str, Any] | None) -> str:
    """``pid N on HOST (`COMMAND`, since TIME)`` of a lock file's JSON."""
    if not holder:
        return "another process (its lock file names no holder yet)"
    started = holder.get("started")
    since = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
             if isinstance(started, (int, float)) else "?")
    return (f"pid {holder.get('pid')} on {holder.get('host')} (`{holder.get('command')}`, "
            f"since {since})")


def _holder_gone(holder: dict[str, Any] | None) -> bool:
    """Whether the holder a lock file names has ended (only knowable on its own host)."""
    if not holder or holder.get("host") != socket.gethostname():
        return False
    pid = holder.get("pid")
    return isinstance(pid, int) and not pid_alive(pid)


class FolderLock:
    """An exclusive lock on ``path`` (a lock file), taken by :meth:`acquire`.

    ``what`` names the locked thing in messages ("run folder runs/x"); ``setting`` is the
    config key or flag that chooses its place (``run_dir``, ``data.cache_dir``), which a
    refused writer can change. Usable as a context manager.
    """

    def __init__(self, path: Path, *, what: str, setting: str) -> None:
        self.path = Path(path)
        self.what = what
        self.setting = setting
        self._fd: int | None = None
        self._made_folder = False

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self, *, timeout_s: float = 0.0,
                on_wait: Callable[[str], None] | None = None) -> FolderLock:
        """Take the lock, waiting up to ``timeout_s`` while another process holds it.

        ``on_wait`` receives one line naming the holder when waiting starts. Raises
        :class:`LockError` naming the holder when the lock is still held after the timeout,
        and :class:`~dflash_trainer.core.errors.DiskError` naming the folder when the lock file
        cannot be created there.
        """
        if self._fd is not None:
            return self
        deadline = time.monotonic() + timeout_s
        waiting = False
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                if time.monotonic() >= deadline:
                    raise LockError(self._refusal(holder, waited_s=timeout_s)) from None
                if not waiting and on_wait is not None:
                    on_wait(f"{self.what} is in use by {describe_holder(holder)}; waiting up to "
                            f"{timeout_s:.0f} s")
                waiting = True
                time.sleep(_POLL_S)
                continue
            if not self._is_current(fd):
                os.close(fd)  # locked a file its holder deleted on release: open the new one
                continue
            previous = _read_holder(fd)
            if previous and previous.get("pid") != os.getpid():
                log.warning("%s: taking over the lock of %s, which ended without releasing it",
                            self.what, describe_holder(previous))
            self._write_holder(fd)
            self._fd = fd
            return self

    def _open(self) -> int:
        folder = self.path.parent
        fix = f"{DISK_FIX} ({self.setting})"
        if folder.exists() and not folder.is_dir():
            raise DiskError(f"cannot write {folder}: it is a file, not a folder; choose "
                            f"another {self.setting}")
        try:
            if not folder.is_dir():
                folder.mkdir(parents=True)
                self._made_folder = True
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if disk_oserror(exc) is None:
                raise
            raise disk_error_for(folder, exc, fix=fix) from exc

    def _is_current(self, fd: int) -> bool:
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (now.st_ino, now.st_dev) == (mine.st_ino, mine.st_dev)

    def _refusal(self, holder: dict[str, Any] | None, *, waited_s: float) -> str:
        waited = f" after waiting {waited_s:.0f} s" if waited_s > 0 else ""
        if _holder_gone(holder):
            return (f"{self.what} is still locked{waited} although its holder, "
                    f"{describe_holder(holder)}, has ended (a process it started may hold "
                    f"{self.path}): stop that process, or delete {self.path}")
        return (f"{self.what} is in use by {describe_holder(holder)}{waited}; wait for it to "
                f"finish or stop it, or choose another {self.setting}")

    @staticmethod
    def _write_holder(fd: int) -> None:
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "command": shlex.join(sys.argv)[:300], "started": time.time()}
        data = json.dumps(holder).encode("utf-8")
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)

    def release(self) -> None:
        """Delete the lock file and release the lock (idempotent); a folder the lock created
        is removed again when it stayed empty."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._is_current(fd):
                self.path.unlink()
        finally:
            os.close(fd)
        if self._made_folder:
            try:
                self.path.parent.rmdir()
            except OSError:
                pass  # the holder wrote into it: a run folder now
            self._made_folder = False

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def run_folder_lock(run_dir: Path | str) -> FolderLock:
    """The lock of a run folder (``RUN_DIR/.lock``), not yet taken."""
    run_dir = Path(run_dir)
    return FolderLock(run_dir / RUN_LOCK, what=f"run folder {run_dir}", setting="run_dir")
