"""The config files shipped with the package (``configs/*.yaml`` of the repository).

A wheel installs them as package data under ``dflash_trainer/configs``; a source checkout reads
them from the repository's ``configs/`` folder. ``--config demo-cpu.yaml`` (or ``demo-cpu``, or
``configs/demo-cpu.yaml``) names one of them when no such file exists where the command runs, so
the commands of the README work from any folder once the package is installed.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["bundled_config", "bundled_configs_dir", "bundled_names"]

_PACKAGE = Path(__file__).resolve().parents[1]


def bundled_configs_dir() -> Path | None:
    """The folder of the shipped config files: the installed package's, else the source tree's."""
    for folder in (_PACKAGE / "configs", _PACKAGE.parents[1] / "configs"):
        if folder.is_dir() and any(folder.glob("*.yaml")):
            return folder
    return None


def bundled_names() -> list[str]:
    """The shipped configs' file names (``demo-cpu.yaml``, ...), sorted."""
    folder = bundled_configs_dir()
    return sorted(p.name for p in folder.glob("*.yaml")) if folder is not None else []


def bundled_config(name: str | Path) -> Path | None:
    """The shipped config file that ``name`` names (``demo-cpu``, ``demo-cpu.yaml`` or
    ``configs/demo-cpu.yaml``), or None."""
    folder = bundled_configs_dir()
    path = Path(name)
    if folder is None or len(path.parts) > 2 or (len(path.parts) == 2 and path.parts[0] != "configs"):
        return None
    stem = path.name.removesuffix(".yaml")
    candidate = folder / f"{stem}.yaml"
    return candidate if stem and candidate.is_file() else None
