"""File-system helpers used across the project: atomic writes, hashing, ``step-N`` names,
disk errors that name their folder.

Atomic means a reader sees the old content or the new one, never half: everything is written
under a temporary name in the same folder and renamed into place. ``durable=True`` also fsyncs
the file and its folder, so the rename survives a power loss (checkpoints need that; caches
do not).

A folder being filled by :func:`write_dir_atomically` is named ``.NAME.tmp-PID-XXXX`` and
``flock``-ed by its writer while it exists. A writer killed outright (SIGKILL, power loss)
leaves it behind; :func:`remove_stale_temp_dirs` deletes such folders once their writer is
gone (the kernel released the lock and the pid has ended), and the next write into the same
folder calls it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from dflash_trainer.core.errors import ConfigError, DiskError

log = logging.getLogger(__name__)

_STEP = re.compile(r"step-(\d+)")
_TEMP_DIR = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[^/]+")
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES,
                         errno.EPERM, errno.ENOTDIR, errno.EISDIR})
"""OSError numbers that mean a folder cannot be written (full, over quota or a file size limit,
read-only, no permission, a file where a folder is expected or the reverse): user errors, not
bugs."""
DISK_FIX = "free space or fix the permissions there, or choose another folder"


def read_json_cache(path: Path, *, what: str) -> dict:
    """A cache file's JSON object; {} when it is missing, unreadable or not an object (a cache
    only saves work: a damaged one is warned about, naming ``what`` it holds, and rebuilt)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s %s (%s); measuring again", what, path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp/mkdtemp create private (0600/0700) entries; outputs follow the umask instead. Read
# once at import: os.umask is process-wide, so probing it later could race with other threads.
_UMASK = _read_umask()


def byte_size(count: float) -> str:
    """``count`` bytes in the unit that shows it best: ``512 B``, ``3.4 kB``, ``1.2 MB``,
    ``20.5 GB``, ``4.1 TB`` (decimal units, three significant digits)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(count) >= scale:
            value = count / scale
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:,.0f} {unit}"
    return f"{count:.0f} B"


def fsync_path(path: Path) -> None:
    """fsync a file or folder by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_error_for(path: Path | str, error: OSError, *, fix: str = DISK_FIX) -> DiskError:
    """The one-line :class:`DiskError` of ``error`` while writing ``path``: what, why, the fix."""
    return DiskError(f"cannot write {path}: {os.strerror(error.errno or 0)}; {fix}")


def atomic_write_text(path: Path, text: str, *, durable: bool = False) -> None:
    """Write a text file by rename (creating its folder); ``durable`` fsyncs file and folder.

    A full, read-only or unwritable disk raises :class:`DiskError` naming ``path``.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as exc:
        if disk_oserror(exc) is None:
            raise
        raise disk_error_for(path, exc) from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and disk_oserror(exc) is not None:
            raise disk_error_for(path, exc) from exc
        raise
    if durable:
        fsync_path(path.parent)


def _locked_temp_dir(parent: Path, prefix: str) -> tuple[Path, int]:
    """A fresh folder ``PREFIX-PID-XXXX`` in ``parent`` and the fd of its ``flock``: the lock
    tells :func:`remove_stale_temp_dirs` that its writer is alive."""
    folder = Path(tempfile.mkdtemp(dir=parent, prefix=f"{prefix}-{os.getpid()}-"))
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return folder, fd


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_stale_temp_dirs(parent: Path) -> list[Path]:
    """Delete the temporary folders of :func:`write_dir_atomically` in ``parent`` whose writer
    is gone (killed outright); return them.

    A folder counts as stale when nothing holds its ``flock`` and its writer's pid (in its
    name) has ended. A swapped-out ``.NAME.old-*`` folder whose ``NAME`` is missing (the writer
    died between the two renames of a replace) is renamed back instead: it is the previous
    content.
    """
    parent = Path(parent)
    try:
        entries = list(parent.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for folder in entries:
        match = _TEMP_DIR.fullmatch(folder.name)
        if match is None or folder.is_symlink() or not folder.is_dir():
            continue
        pid = int(match["pid"])
        if pid == os.getpid() or pid_alive(pid):
            continue
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue  # removed meanwhile, or unreadable: not ours to judge
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a child process of the dead writer still holds it
        try:
            original = parent / match["name"]
            if match["kind"] == "old" and not original.exists():
                os.rename(folder, original)
                log.warning("restored %s from %s, left by a writer (pid %d) that was killed "
                            "while replacing it", original, folder.name, pid)
                continue
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
            log.warning("removed %s, left by a writer (pid %d) that was killed", folder, pid)
        finally:
            os.close(fd)
    return removed


def write_dir_atomically(out_dir: Path, write: Callable[[Path], None], *,
                         replace: bool = False, fix: str = DISK_FIX) -> bool:
    """Fill a fresh temporary folder with ``write`` and rename it to ``out_dir``.

    A failure leaves no ``out_dir`` and no temporary folder; a kill leaves one that the next
    call into the same parent folder removes (see :func:`remove_stale_temp_dirs`). Without
    ``replace``, an ``out_dir`` that exists (another process finished first) is kept and this
    call's folder is discarded; with ``replace`` it is swapped out and deleted. Returns whether
    this call's folder became ``out_dir``. A full, read-only or unwritable disk raises
    :class:`DiskError` naming ``out_dir`` and ``fix``.
    """
    out_dir = Path(out_dir)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_dirs(out_dir.parent)
        tmp, tmp_lock = _locked_temp_dir(out_dir.parent, f".{out_dir.name}.tmp")
    except OSError as exc:
        if disk_oserror(exc) is None:
            raise
        raise disk_error_for(out_dir, exc, fix=fix) from exc
    old: Path | None = None
    old_lock: int | None = None
    try:
        os.chmod(tmp, 0o777 & ~_UMASK)
        write(tmp)
        if replace and out_dir.exists():
            old = Path(tempfile.mkdtemp(dir=out_dir.parent,
                                        prefix=f".{out_dir.name}.old-{os.getpid()}-"))
            # The lock goes with the folder being swapped out, not with the empty name.
            old_lock = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fcntl.flock(old_lock, fcntl.LOCK_EX)
            os.replace(out_dir, old)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not out_dir.is_dir():
                raise
            return False
        return True
    except OSError as exc:
        if disk_oserror(exc) is None or isinstance(exc, DiskError):
            raise
        raise disk_error_for(out_dir, exc, fix=fix) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(tmp_lock)
        if old is not None:
            if out_dir.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:  # swapped out, then the new folder failed to take its place: put it back
                os.rename(old, out_dir)
        if old_lock is not None:
            os.close(old_lock)


def sha256_file(path: Path, *, chunk_size: int = 1 << 22,
                on_chunk: Callable[[bytes], None] | None = None) -> str:
    """Hex sha256 of a file's bytes, read in chunks; ``on_chunk`` sees every chunk in order
    (to learn more about the file in the same read)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(chunk_size), b""):
            digest.update(chunk)
            if on_chunk is not None:
                on_chunk(chunk)
    return digest.hexdigest()


def check_output_folder(out: Path, *, what: str) -> None:
    """Refuse (:class:`ConfigError`, before any work) an output folder ``what`` names that is an
    existing file or anything else but a folder; a missing one is created by its writer."""
    if os.path.lexists(out) and not out.is_dir():
        kind = "an existing file" if out.is_file() else "not a folder (a dangling link or a special file)"
        raise ConfigError(f"{what} {out} is {kind}; give the path of a folder (new, or one that holds "
                          "earlier results)")


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)")
"""How Rust's std::io::Error prints an errno: ``... (os error 28)`` or its Debug ``Os { code: 28, ... }``."""


def save_safetensors(tensors: dict, path: Path, *, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, with a failed write raised as the ``OSError`` it is: the
    library reports a full disk as ``SafetensorError: ... No space left on device (os error 28)``,
    which :func:`disk_error` would not recognise."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        found = _RUST_OS_ERROR.search(str(exc))
        if found is None:
            raise
        code = int(found.group(1) or found.group(2))
        raise OSError(code, os.strerror(code), str(path)) from exc


class FileScan(Protocol):
    """Something learnt from a file's bytes in the read that hashes it, memoised with the hash."""

    name: str
    """Its key in a memo entry."""

    def update(self, chunk: bytes) -> None:
        """Sees the next chunk of the file."""

    def result(self) -> Any:
        """What the chunks showed (JSON-serialisable)."""


def memoised_sha256(path: Path, memo_path: Path) -> tuple[str, bool]:
    """sha256 of a file's bytes, and whether the memo in ``memo_path`` (a JSON object by
    resolved path) answered it instead of a read (see :func:`memoised_scan`)."""
    digest, _, memoised = memoised_scan(path, memo_path)
    return digest, memoised


def memoised_scan(path: Path, memo_path: Path, scan: FileScan | None = None) -> tuple[str, Any, bool]:
    """sha256 of a file's bytes, what ``scan`` learnt from them in the same read (None without
    one), and whether the memo in ``memo_path`` (a JSON object by resolved path) answered both
    instead of a read.

    The memo is a shortcut only: an entry answers while the file's size, mtime, inode *and*
    ctime are those it was hashed at. ctime is what makes that safe: ``cp -p``, ``rsync -t``,
    ``touch -r`` or a restored backup put back the size and mtime of an edited file, but the
    kernel sets ctime on every write and no tool can set it back. Any change rehashes, and the
    new hash replaces the entry; so does an entry without the scan's result (hashed before the
    scan existed). A memo that cannot be read or written only costs the hashing.
    """
    resolved = Path(path).resolve()
    info = resolved.stat()
    stamp = {"size": info.st_size, "mtime_ns": info.st_mtime_ns, "inode": info.st_ino,
             "ctime_ns": info.st_ctime_ns}
    memo = read_json_cache(memo_path, what="file hash memo")
    entry = memo.get(str(resolved))
    if isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items()) \
            and isinstance(entry.get("sha256"), str) and (scan is None or scan.name in entry):
        return entry["sha256"], entry[scan.name] if scan is not None else None, True
    digest = sha256_file(resolved, on_chunk=scan.update if scan is not None else None)
    found = scan.result() if scan is not None else None
    memo[str(resolved)] = {**stamp, "sha256": digest, **({scan.name: found} if scan is not None else {})}
    try:
        atomic_write_text(memo_path, json.dumps(memo, indent=1))
    except OSError as exc:
        log.warning("cannot keep the file hash memo %s (%s); hashing again next time", memo_path, exc)
    return digest, found, False


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


def disk_error(exc: BaseException, *, folder: str | os.PathLike[str] | None = None
               ) -> DiskError | None:
    """The :class:`DiskError` behind ``exc`` (itself, or an ``OSError`` of a full, read-only or
    unwritable disk anywhere in its cause/context chain), or None. It names the file of the
    ``OSError``, else ``folder`` (the folder the command writes into)."""
    if isinstance(exc, DiskError):
        return exc
    error = disk_oserror(exc)
    if error is None:
        return None
    where = error.filename or (f"into {folder}" if folder is not None else "the output folder")
    return disk_error_for(where, error,
                          fix=f"{DISK_FIX} (run_dir, --out, data.cache_dir)")
