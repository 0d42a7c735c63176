"""Exit codes under torchrun (docs/errors.md): torchrun itself exits 1 for any failed rank;
``python -m dflash_trainer.cli.torchrun`` exits with the documented code of the rank that failed.

The launches are real (two gloo ranks on CPU) and run a refused resume: a checkpoint folder that
does not exist, refused by rank 0 with one line (exit 2 on every rank).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from dflash_trainer.cli.torchrun import exit_code_of
from helpers_e2e import make_chat_jsonl, make_tiny_target
from test_distributed import LAUNCH_TIMEOUT_S, overrides, run_with_deadline


def _failure(rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
    failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="<N/A>")
    failure.timestamp = timestamp
    return failure


@pytest.mark.parametrize("codes, want", [
    ({0: (2, 5), 1: (2, 5)}, 2),  # every rank refused the resume
    ({0: (-15, 5), 1: (1, 6)}, 1),  # rank 1 failed; the agent then stopped rank 0 (SIGTERM)
    ({0: (143, 5), 1: (2, 5)}, 2),  # a rank that handles SIGTERM exits 143 in the same second
    ({0: (1, 7), 1: (2, 6)}, 2),  # the earliest failure
    ({0: (-9, 5)}, 137),  # killed by SIGKILL, as a shell reports it
    ({0: (143, 5), 1: (-15, 5)}, 143),  # only stopped ranks: the first of them
])
def test_the_launch_exits_with_the_code_of_the_rank_that_failed(codes, want):
    failures = {rank: _failure(rank, code, ts) for rank, (code, ts) in codes.items()}
    assert exit_code_of(ChildFailedError("dflash_trainer", failures)) == want


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("exit_codes")
    make_tiny_target(root / "target", layers=3)
    make_chat_jsonl(root / "chat.jsonl", num=16)
    return root


def _refused_resume(root: Path, launcher: list[str], name: str) -> tuple[int | None, str]:
    run_dir = root / name
    cmd = [*launcher, "--standalone", "--nproc-per-node", "2", "-m", "dflash_trainer", "train",
           *overrides(root, run_dir, f"checkpoint.resume={root / 'no-such-checkpoint'}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    log = root / f"{name}.log"
    code = run_with_deadline(cmd, env, log, timeout_s=LAUNCH_TIMEOUT_S)
    return code, log.read_text(errors="replace")


def _one_refusal(log: str, root: Path) -> None:
    lines = [line for line in log.splitlines() if "dflash-trainer train:" in line]
    assert lines == [f"dflash-trainer train: checkpoint error: checkpoint.resume="
                     f"{root / 'no-such-checkpoint'}: no such checkpoint folder"], log[-4000:]


@pytest.mark.slow
def test_plain_torchrun_reports_a_refused_resume_as_1_with_the_ranks_code_in_its_summary(setup):
    code, log = _refused_resume(setup, [str(Path(sys.executable).parent / "torchrun")], "plain")
    assert code == 1, log[-4000:]
    assert "exitcode: 2" in log
    _one_refusal(log, setup)


@pytest.mark.slow
def test_the_project_launcher_exits_2_for_a_refused_resume_as_documented(setup):
    code, log = _refused_resume(setup, [sys.executable, "-m", "dflash_trainer.cli.torchrun"], "launcher")
    assert code == 2, log[-4000:]
    assert "exitcode: 2" in log and "Traceback" not in log  # the summary, without torchrun's traceback
    _one_refusal(log, setup)
