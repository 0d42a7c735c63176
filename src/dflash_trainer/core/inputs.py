"""Every path a command reads goes through :func:`check_input` before it is opened.

A path can be a file, a folder, a symlink (to either, dangling, or in a loop), a FIFO, a
device, a socket, or something the process may not read. Opening a FIFO blocks until another
process writes to it, a device never ends, a loop makes ``Path.resolve`` raise ``RuntimeError``
and ``Path.exists`` answer False, and a permission error looks like a disk error (EACCES). So
one function decides, before anything is opened, and says which of these it is in one line
naming the path; :func:`input_files` walks a folder with the same checks on each entry, so that
a loop or a FIFO inside a data folder is named instead of skipped.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from dflash_trainer.core.errors import DataError, UserError

__all__ = ["check_input", "input_files", "symlink_chain"]

Kind = Literal["file", "folder", "any"]

_SPECIAL = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def symlink_chain(path: Path, limit: int = 40) -> str:
    """``a -> b -> a``: the links followed from ``path`` until one repeats (for loop messages)."""
    seen: list[str] = [str(path)]
    current = path
    for _ in range(limit):
        try:
            target = Path(os.readlink(current))
        except OSError:
            break
        current = target if target.is_absolute() else current.parent / target
        name = os.path.normpath(current)
        seen.append(name)
        if name in seen[:-1]:
            break
    return " -> ".join(seen)


def check_input(path: Path | str, *, what: str, kind: Kind = "any",
                error: type[UserError] = DataError) -> Path:
    """``path`` if it can be read as ``kind``, else ``error`` in one line starting with ``what``
    (the setting or flag that named it) and naming the path.

    Refused: a missing path (with the absolute path it resolved to), a symlink loop (with the
    links followed), a dangling symlink, anything that is not a regular file or a folder (a
    FIFO or a device: reading one would block or never end), a file where a folder is expected
    or the reverse, and a path this process cannot read (``cannot read``). Nothing is read:
    the file is opened without blocking and closed, the folder listed.
    """
    path = Path(path).expanduser()
    try:
        info = os.stat(path)
    except OSError as exc:
        raise error(_stat_problem(path, exc, what)) from exc
    if stat.S_ISDIR(info.st_mode):
        if kind == "file":
            raise error(f"{what}: {path} is a folder, not a file; give a file")
        _probe(lambda: os.scandir(path).close(), path, what, error, "list")
        return path
    if not stat.S_ISREG(info.st_mode):
        special = next((name for test, name in _SPECIAL if test(info.st_mode)), "a special file")
        raise error(f"{what}: {path} is not a regular file ({special}); reading it would block or "
                    "never end: give a regular file or a folder")
    if kind == "folder":
        raise error(f"{what}: {path} is a file, not a folder; give a folder")
    _probe(lambda: os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK)), path, what, error, "read")
    return path


def _stat_problem(path: Path, exc: OSError, what: str) -> str:
    if exc.errno == errno.ELOOP:
        return (f"{what}: {path} is a symlink loop ({symlink_chain(path)}); point the link at a real "
                "file or folder")
    if exc.errno == errno.ENOENT:
        if os.path.islink(path):
            return (f"{what}: {path} is a dangling symlink (to {os.readlink(path)}, which does not "
                    "exist); point it at a real file or folder")
        return f"{what}: no such file or folder (resolved to {Path(os.path.abspath(path))})"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"{what}: cannot read {path}: {exc.strerror} (a folder on its path may not be "
                "searchable); fix the permissions or copy it somewhere readable")
    return f"{what}: cannot read {path}: {exc.strerror or exc}"


def _probe(open_it: Callable[[], None], path: Path, what: str, error: type[UserError], verb: str) -> None:
    try:
        open_it()
    except OSError as exc:
        raise error(f"{what}: cannot read {path}: {exc.strerror or exc} (cannot {verb} it); fix its "
                    "permissions (chmod u+r, and u+x for a folder) or copy it somewhere readable") from exc


def input_files(folder: Path, *, what: str, accept: Callable[[Path], bool],
                error: type[UserError] = DataError) -> list[Path]:
    """Every file under ``folder`` (symlinks followed, hidden names skipped) whose name
    ``accept`` takes, sorted, each checked by :func:`check_input`. A symlink loop anywhere
    inside (a link to a folder above it included) is an error naming it, and so is a dangling
    link, a FIFO or an unreadable file with an accepted name: never skipped, since a data file
    behind it would be lost without a word."""
    found: list[Path] = []
    ancestors: set[tuple[int, int]] = set()

    def walk(current: Path) -> None:
        info = os.stat(current)
        if (info.st_dev, info.st_ino) in ancestors:
            raise error(f"{what}: {current} is a symlink loop (it leads back to "
                        f"{Path(os.path.realpath(current))}, a folder above it); remove the link")
        ancestors.add((info.st_dev, info.st_ino))
        _probe(lambda: os.scandir(current).close(), current, what, error, "list")
        with os.scandir(current) as listing:
            entries = sorted(listing, key=lambda e: e.name)
        for entry in entries:
            child = Path(entry.path)
            if entry.name.startswith("."):
                continue
            try:
                mode = os.stat(child).st_mode
            except OSError as exc:
                if exc.errno == errno.ELOOP or accept(child):
                    raise error(_stat_problem(child, exc, what)) from exc
                continue  # a dangling link with a name that is not data's
            if stat.S_ISDIR(mode):
                walk(check_input(child, what=what, kind="folder", error=error))
            elif accept(child):
                found.append(check_input(child, what=what, kind="file", error=error))
        ancestors.discard((info.st_dev, info.st_ino))

    walk(folder)
    return found
