"""Session settings: a test run never writes measurement caches into the user's cache.

The dtype probe (``model/dtypes.py``, ``dtype-probe.json``) and the demo's durations
(``cli/duration.py``, ``demo-durations.json``) keep what they measured on this machine in the user
cache (:func:`dflash_trainer.core.assets.cache_root`), and the next ``make demo`` trusts them: a
measurement taken under a test run's load would mislead it. So the session points
``DFLASH_CACHE``, which every subprocess and torchrun rank inherits, at a folder of its own. The
caches that hold no measurement (token stores, targets converted from GGUF, the content-hash
memo) are links to the user's there, so they stay warm across runs as before.

At the end of the session the user's measurement files are compared with their state at its
start; a run that changed them fails.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dflash_trainer.core.assets import cache_root

MEASUREMENT_CACHES = ("dtype-probe.json", "demo-durations.json")
"""Files of the user cache that record measurements of this machine."""
SHARED_FOLDERS = ("tokens", "targets")
"""Folders of the user cache that the session shares (made when missing, as a run would)."""
SHARED_FILES = ("sha256-memo.json",)
"""Files of the user cache that the session reads when they exist (a write replaces the link)."""

_state: dict[str, object] = {}


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_size


def pytest_configure(config: pytest.Config) -> None:
    user = cache_root()
    session = Path(tempfile.mkdtemp(prefix="dflash-test-cache-"))
    for name in SHARED_FOLDERS:
        (user / name).mkdir(parents=True, exist_ok=True)
        (session / name).symlink_to(user / name, target_is_directory=True)
    for name in SHARED_FILES:
        if (user / name).is_file():
            (session / name).symlink_to(user / name)
    _state.update(user=user, session=session, previous=os.environ.get("DFLASH_CACHE"),
                  before={name: _stat(user / name) for name in MEASUREMENT_CACHES})
    os.environ["DFLASH_CACHE"] = str(session)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    user = _state["user"]
    assert isinstance(user, Path)
    changed = [name for name, before in _state["before"].items()  # type: ignore[union-attr]
               if _stat(user / name) != before]
    if changed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = (f"the test run wrote measurement caches into the user cache: "
                   f"{', '.join(str(user / name) for name in changed)}")
        if reporter is not None:
            reporter.write_line(f"FAILED {message}", red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    if "session" not in _state:
        return
    previous = _state["previous"]
    if previous is None:
        os.environ.pop("DFLASH_CACHE", None)
    else:
        os.environ["DFLASH_CACHE"] = str(previous)
    shutil.rmtree(_state["session"], ignore_errors=True)  # the links only, never their targets


@pytest.fixture
def user_cache() -> Path:
    """The user's cache folder, as the code would choose it without the session's."""
    user = _state["user"]
    assert isinstance(user, Path)
    return user


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module of small models (``pytest.mark.usefixtures("one_thread")``):
    tiny matmuls gain nothing from a second thread, and on a shared, loaded machine OpenMP
    barriers make every small op wait for a free core (measured 10x slower)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
