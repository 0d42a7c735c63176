"""Session settings: a test run never writes measurement caches into the user's cache.

The dtype probe (``model/dtypes.py``, ``dtype-probe.json``) and the demo's durations
(``cli/duration.py``, ``demo-durations.json``) keep what they measured on this machine in the user
cache (:func:`dflash_trainer.core.assets.cache_root`), and the next ``make demo`` trusts them: a
measurement taken under a test run's load would mislead it. So the session points
``DFLASH_CACHE``, which every subprocess and torchrun rank inherits, at a folder of its own. The
caches that hold no measurement (token stores, targets converted from GGUF, the chat templates
of the pinned llama.cpp sdist, the content-hash memo) are links to the user's there, so they
stay warm across runs as before.

Every Python process of the session also runs ``tests/session_guard/sitecustomize.py`` (first on
``PYTHONPATH``): an audit hook that records any write into the user's measurement files with the
process's command line and stack. At the end of the session such a record fails the run, naming
the process. A change of those files that no process of the session made (a ``make demo`` or a
training run beside the tests: the probe is per machine) is reported as such and does not fail
the run, since the test run did not make it.
"""

from __future__ import annotations

import importlib.util
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
GUARD = Path(__file__).with_name("session_guard")
"""The ``sitecustomize`` folder that every process of the session loads (the write recorder)."""
SHARED_FOLDERS = ("tokens", "targets", "chat-templates")
"""Folders of the user cache that the session shares (made when missing, as a run would)."""
SHARED_FILES = ("sha256-memo.json",)
"""Files of the user cache that the session reads when they exist (a write replaces the link)."""

_SESSION_VARIABLES = ("DFLASH_CACHE", "DFLASH_TEST_USER_CACHE", "DFLASH_TEST_WRITES_LOG", "DFLASH_TEST_MEASUREMENTS",
                      "PYTHONPATH")
"""What the session sets for itself and its children, restored at its end."""

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
    writes = session / "user-cache-writes.log"
    _state.update(user=user, session=session, writes=writes,
                  previous={name: os.environ.get(name) for name in _SESSION_VARIABLES},
                  before={name: _stat(user / name) for name in MEASUREMENT_CACHES})
    os.environ.update(DFLASH_CACHE=str(session), DFLASH_TEST_USER_CACHE=str(user), DFLASH_TEST_WRITES_LOG=str(writes),
                      DFLASH_TEST_MEASUREMENTS=os.pathsep.join(MEASUREMENT_CACHES),
                      PYTHONPATH=with_guard(os.environ.get("PYTHONPATH", "")))
    # This process too (its children load the recorder at start-up).
    spec = importlib.util.spec_from_file_location("session_guard", GUARD / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    user, writes = _state["user"], _state["writes"]
    assert isinstance(user, Path) and isinstance(writes, Path)
    changed = [name for name, before in _state["before"].items()  # type: ignore[union-attr]
               if _stat(user / name) != before]
    records = writes.read_text(encoding="utf-8") if writes.is_file() else ""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if records:
        written = sorted({name for name in MEASUREMENT_CACHES if name in records})
        message = (f"the test run wrote measurement caches into the user cache: "
                   f"{', '.join(str(user / name) for name in written)}; the writing processes:\n{records}")
        if reporter is not None:
            reporter.write_line(f"FAILED {message}", red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif changed and reporter is not None:
        reporter.write_line(f"note: {', '.join(str(user / name) for name in changed)} changed during the test run, "
                            "by no process of it (a run beside the tests); not counted", yellow=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    if "session" not in _state:
        return
    for name, value in _state["previous"].items():  # type: ignore[union-attr]
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    shutil.rmtree(_state["session"], ignore_errors=True)  # the links only, never their targets


def with_guard(pythonpath: str) -> str:
    """``pythonpath`` with the session's write recorder first: a test that starts a child with a
    ``PYTHONPATH`` of its own passes its value through this, so that the child is watched too."""
    return os.pathsep.join(filter(None, [str(GUARD), pythonpath]))


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
