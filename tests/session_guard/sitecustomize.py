"""Loaded by every Python process of a test session (tests/conftest.py puts this folder first on
``PYTHONPATH``): an audit hook that records each write into the user's measurement caches with
the writing process's command line and stack, so the session check blames a write on the test
run only when one of its own processes made it (a ``make demo`` running beside the tests writes
the same files). Then the ``sitecustomize`` this one shadows, if any, is loaded as usual."""

from __future__ import annotations

import os
import sys

_USER = os.environ.get("DFLASH_TEST_USER_CACHE")
_LOG = os.environ.get("DFLASH_TEST_WRITES_LOG")
_NAMES = tuple(filter(None, os.environ.get("DFLASH_TEST_MEASUREMENTS", "").split(os.pathsep)))
_WRITE = frozenset("wax+")


def _target(event: str, args: tuple) -> str | None:
    if event == "open":
        path, mode = args[0], args[1]
        if not isinstance(mode, str) or not _WRITE & set(mode):
            return None
    elif event in ("os.rename", "os.replace", "os.link", "os.symlink"):
        path = args[1]
    else:
        return None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    return path if isinstance(path, str) else None


def _hook(event: str, args: tuple) -> None:
    path = _target(event, args)
    if path is None or os.path.basename(path) not in _NAMES:
        return
    try:
        if os.path.dirname(os.path.realpath(path)) != os.path.realpath(_USER):
            return
        import traceback

        with open(_LOG, "a", encoding="utf-8") as log:  # not a measurement cache: no recursion
            log.write(f"pid {os.getpid()} {event} {path} by {' '.join(sys.argv)}\n"
                      + "".join("    " + line for line in traceback.format_stack()[-8:-1]))
    except Exception:  # an audit hook must never break the process it watches
        pass


def install() -> None:
    """Add the hook to this process (the test session's own; children get it at start-up)."""
    if _USER and _LOG and _NAMES:
        sys.addaudithook(_hook)


install()


def _load_shadowed() -> None:
    """Run the installation's own ``sitecustomize`` (found past this folder on ``sys.path``)."""
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    here = os.path.dirname(os.path.abspath(__file__))
    spec = PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != here])
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(module_from_spec(spec))


if __name__ == "sitecustomize":
    _load_shadowed()
