"""benchmarks.quality leaves no worker behind when it is stopped."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from benchmarks import quality

ROOT = Path(__file__).resolve().parents[1]

_STUBBORN = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
             "print('ready', flush=True)\n"
             "time.sleep(60)\n")
_SLEEPER = "import time\nprint('ready', flush=True)\ntime.sleep(60)\n"


def _started(code: str) -> subprocess.Popen:
    # From the repository root, where ``python -c`` finds the benchmarks package.
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_stop_worker_kills_a_worker_that_ignores_sigterm():
    proc = _started(_STUBBORN)
    began = time.monotonic()
    quality.stop_worker(proc, grace_s=0.5)
    assert proc.returncode == -9
    assert time.monotonic() - began < 30


def test_stop_worker_lets_a_worker_exit_on_sigterm():
    proc = _started(_SLEEPER)
    quality.stop_worker(proc, grace_s=30)
    assert proc.returncode == -15


def test_a_stopped_parent_stops_its_worker(tmp_path: Path):
    pid_file = tmp_path / "worker.pid"
    parent = (f"import subprocess, sys\n"
              f"from benchmarks import quality\n"
              f"import signal\n"
              f"signal.signal(signal.SIGTERM, quality._raise_on_sigterm)\n"
              f"with quality.worker_process([sys.executable, '-c', {_SLEEPER!r}], stdout=subprocess.PIPE) as proc:\n"
              f"    proc.stdout.readline()\n"
              f"    open({str(pid_file)!r}, 'w').write(str(proc.pid))\n"
              f"    print('ready', flush=True)\n"
              f"    quality.wait_for_worker(proc, timeout_s=600)\n")
    proc = _started(parent)
    worker_pid = int(pid_file.read_text())
    proc.terminate()
    assert proc.wait(timeout=30) == 128 + 15
    assert not Path(f"/proc/{worker_pid}").exists()


def test_a_worker_past_its_time_is_killed():
    proc = _started(_STUBBORN)
    assert quality.wait_for_worker(proc, timeout_s=0.2) is None
    assert proc.returncode == -9
