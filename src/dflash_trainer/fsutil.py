"""File-system helpers used across the project: atomic writes, hashing, ``step-N`` names.

Atomic means a reader sees the old content or the new one, never half: everything is written
under a temporary name in the same folder and renamed into place. ``durable=True`` also fsyncs
the file and its folder, so the rename survives a power loss (checkpoints need that; caches
do not).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

_STEP = re.compile(r"step-(\d+)")
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES,
                         errno.EPERM})
"""OSError numbers that mean a folder cannot be written (full, over quota or a file size limit,
read-only, no permission): user errors, not bugs."""


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp/mkdtemp create private (0600/0700) entries; outputs follow the umask instead. Read
# once at import: os.umask is process-wide, so probing it later could race with other threads.
_UMASK = _read_umask()


def fsync_path(path: Path) -> None:
    """fsync a file or folder by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str, *, durable: bool = False) -> None:
    """Write a text file by rename (creating its folder); ``durable`` fsyncs file and folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(path.parent)


def write_dir_atomically(out_dir: Path, write: Callable[[Path], None], *,
                         replace: bool = False) -> bool:
    """Fill a fresh temporary folder with ``write`` and rename it to ``out_dir``.

    A failure leaves no ``out_dir`` and no temporary folder. Without ``replace``, an
    ``out_dir`` that exists (another process finished first) is kept and this call's folder is
    discarded; with ``replace`` it is swapped out and deleted. Returns whether this call's
    folder became ``out_dir``.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        os.chmod(tmp, 0o777 & ~_UMASK)
        write(tmp)
        old = None
        if replace and out_dir.exists():
            old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
            os.replace(out_dir, old)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not out_dir.is_dir():
                raise
            return False
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sha256_file(path: Path, *, chunk_size: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(chunk_size), b""):
            digest.update(chunk)
    return digest.hexdigest()


def step_name(step: int) -> str:
    """The folder name of a checkpoint at optimizer step ``step``: ``step-N``."""
    return f"step-{step}"


def step_of(path: Path | str) -> int | None:
    """N of a ``step-N`` folder name (exactly that shape), else None."""
    match = _STEP.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def disk_oserror(exc: BaseException) -> OSError | None:
    """The ``OSError`` of :data:`DISK_ERRNOS` that is ``exc`` or in its cause/context chain."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_ERRNOS:
            return current
        current = current.__cause__ or current.__context__
    return None
