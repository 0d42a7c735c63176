"""Counts and sizes as people read them: ``41.2K`` parameters, ``1.05B``, ``1.40 GiB``."""

from __future__ import annotations

__all__ = ["format_bytes", "format_count"]


def format_count(n: int | float) -> str:
    """A count with three significant digits and its unit: 812, 41.2K, 7.75M, 1.05B, 2.00T."""
    n = float(n)
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale * 0.9995:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def format_bytes(n: int | float) -> str:
    """A size in binary units with three significant digits: 512 B, 29.4 MiB, 1.40 GiB."""
    n = float(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale * 0.9995:
            return f"{n / scale:.3g} {unit}" if n / scale < 1000 else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"
