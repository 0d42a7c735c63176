"""A real tmpfs for the tests of a full disk: mounted for one test, then unmounted.

Mounting needs root (CAP_SYS_ADMIN); without it a test that needs one skips, and says which
test covers the same code without root.
"""

from __future__ import annotations

import contextlib
import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(folder: Path, *, size: str, otherwise: str) -> Iterator[Path]:
    """``folder`` as a fresh tmpfs of ``size`` (``32m``, ``64k``) for the block; the test skips
    when it cannot be mounted (``otherwise`` names what covers it then)."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}; {otherwise}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path) -> Path:
    """Fill the file system of ``folder`` to the last byte; the filler file is returned."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as out:
        block = b"\0" * (1 << 20)
        while block:
            try:
                if out.write(block) < len(block):
                    block = block[: len(block) // 2]
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                block = block[: len(block) // 2]
    return filler
