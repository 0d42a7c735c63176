"""One torchrun rank of the GPU check's two_gpu section.

    torchrun --nproc-per-node 2 benchmarks/gpu_check_rank.py OUT_DIR OVERRIDES...

Runs ``dflash-trainer train OVERRIDES``, then, while its CUDA contexts still exist, writes
``OUT_DIR/rank-R.json``: its exit code and the GPUs on which this process holds a context
(from ``nvidia-smi``; None off CUDA).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


def gpus_with_context(pid: int) -> list[int] | None:
    """Indices of the GPUs where process ``pid`` holds a CUDA context (None: no nvidia-smi,
    or it lists no context of ``pid``, as in a container with its own PID namespace)."""
    if shutil.which("nvidia-smi") is None:
        return None

    def query(*args: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader"], text=True,
                             capture_output=True, check=True).stdout
        return [[field.strip() for field in line.split(",")] for line in out.splitlines()
                if line.strip()]

    index_of = {bus: int(index) for index, bus in query("--query-gpu=index,pci.bus_id")}
    found = sorted(index_of[bus] for app_pid, bus in query("--query-compute-apps=pid,gpu_bus_id")
                   if int(app_pid) == pid)
    return found or None


def main() -> int:
    """Train, then report this rank's CUDA contexts."""
    import torch

    from dflash_trainer.cli.main import main as cli_main

    out, argv = Path(sys.argv[1]), sys.argv[2:]
    code = cli_main(["train", *argv])
    rank = int(os.environ["RANK"])
    contexts = gpus_with_context(os.getpid()) if torch.cuda.is_available() else None
    (out / f"rank-{rank}.json").write_text(json.dumps(
        {"rank": rank, "pid": os.getpid(), "exit": code, "gpus_with_context": contexts}))
    return code


if __name__ == "__main__":
    sys.exit(main())
