"""Signals and failures of a real training process.

- SIGTERM / SIGINT: the current step finishes, a final checkpoint is written, the trackers
  are closed (W&B's exit record), the process exits 0, within a measured bound.
- SIGKILL at random moments, several times: ``latest`` always names a complete checkpoint
  that loads, and ``--resume auto`` continues from it; the run then completes with exact
  sample accounting.
- A stage that raises: ``train`` fails within 10 s with the original message, exit code 1,
  and no thread left running.
- Every command (prepare, train before its training, eval, export, regenerate, demo, report,
  generate) ends on SIGINT / SIGTERM with one line and exit 130 / 143, leaving no temporary
  folder or lock file; what a SIGKILL leaves is removed by the next run.

Each training process is a real OS process running the CLI's ``main`` (its own signals, exit
code, threads). Processes are forked from a server that imported the package once
(multiprocessing "forkserver" with preload), so each costs ~2 s instead of the ~10 s of
importing torch and transformers again on this machine.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dflash_trainer.training.checkpoint import find_resume_checkpoint, read_state, validate_checkpoint
from dflash_trainer.config import load_config
from dflash_trainer.training.export import load_drafter
from dflash_trainer.model.target import FeatureExtractor
from dflash_trainer.training.trainer import Trainer
from helpers_e2e import make_chat_jsonl, make_tiny_target, tiny_run_overrides, wandb_records

# Trainings in child processes, killed and resumed: tens of seconds.
pytestmark = pytest.mark.slow

SIGNAL_EXIT_BOUND_S = 15.0
"""Signal -> exit on this shared 2-core machine: one step + final checkpoint + export + close."""

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["dflash_trainer.cli.main", "dflash_trainer.training.trainer", "dflash_trainer.cli.demo",
                             "dflash_trainer.evaluation.evaluate", "dflash_trainer.evaluation.generate",
                             "dflash_trainer.data.regenerate", "dflash_trainer.reporting.report",
                             "dflash_trainer.training.export", "test_signals"])

WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
             "WANDB_BASE_URL": "http://127.0.0.1:9"}


class FailingExtractor(FeatureExtractor):
    """The real feature extractor, failing on its ``fail_at``-th call (injected fault)."""

    fail_at = 3
    stamp: Path | None = None

    def __call__(self, input_ids, attention_mask=None):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == self.fail_at:
            if self.stamp is not None:
                self.stamp.write_text(repr(time.time()))
            raise RuntimeError(f"injected target failure at batch {self.fail_at}")
        return super().__call__(input_ids, attention_mask)


def _child(argv: list[str], log: str, env: dict[str, str], fail_stamp: str | None) -> None:
    """Child process body: ``dflash-trainer train ARGV`` with output to ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    if fail_stamp is not None:
        import dflash_trainer.training.components as components_module

        FailingExtractor.stamp = Path(fail_stamp)
        components_module.FeatureExtractor = FailingExtractor
    from dflash_trainer.cli.main import main

    code = main(["train", *argv])
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def start(argv: list[str], log: Path, *, env: dict[str, str] | None = None,
          fail_stamp: Path | None = None) -> multiprocessing.Process:
    proc = _CTX.Process(target=_child, args=(argv, str(log), env or {},
                                             None if fail_stamp is None else str(fail_stamp)))
    proc.start()
    return proc


def wait_for(condition, timeout: float, what: str, proc: multiprocessing.Process | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc is not None and not proc.is_alive():
            raise AssertionError(f"process exited ({proc.exitcode}) before {what}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("signals")
    return {"root": root, "target": make_tiny_target(root / "target", layers=3, hidden=32),
            "data": make_chat_jsonl(root / "chat.jsonl", num=16), "cache": root / "cache"}


def overrides(setup: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    return [*tiny_run_overrides(target=setup["target"], data=setup["data"], cache=setup["cache"],
                                run_dir=run_dir),
            "pipeline.prefetch_workers=2", *extra]


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    text = path.read_text()
    complete = text[:text.rfind("\n") + 1]  # the writer may be mid-line
    return [json.loads(line)["step"] for line in complete.splitlines() if line.strip()]


def latest_step(ckpt: Path) -> int:
    pointer = ckpt / "latest"
    return int(pointer.read_text().strip()[5:]) if pointer.is_file() else 0


def wandb_record_kinds(run_file: Path) -> list[str]:
    """Record kinds in a W&B transaction log, read by W&B itself (``wandb leet inspect``)."""
    return [r["type"] for r in wandb_records(run_file)]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_the_step_checkpoints_closes_and_exits_0(setup, tmp_path: Path, signum):
    run_dir = tmp_path / "run"
    log = tmp_path / "log.txt"
    wandb = signum == signal.SIGTERM  # W&B's exit record proves the trackers were closed
    argv = overrides(setup, run_dir, *(["logging.wandb=offline"] if wandb else []))
    proc = start(argv, log, env=WANDB_ENV if wandb else None)
    wait_for(lambda: len(logged_steps(run_dir)) >= 2, 120, "two logged steps", proc)
    sent = time.monotonic()
    os.kill(proc.pid, signum)
    proc.join(60)
    elapsed = time.monotonic() - sent
    output = log.read_text()
    assert proc.exitcode == 0, output
    print(f"{signal.Signals(signum).name}: exit {elapsed:.2f} s after the signal")
    assert elapsed < SIGNAL_EXIT_BOUND_S
    assert f"stopped by signal {signal.Signals(signum).name}" in output
    steps = logged_steps(run_dir)
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and last < 14, "whole steps only, stopped early"
    ckpt = run_dir / "checkpoints"
    assert latest_step(ckpt) == last
    state = read_state(ckpt / f"step-{last}")
    assert state["counters"]["optimizer_step"] == last and state["data"][0]["stream_index"] == last
    if wandb:
        run_id = state["run"]["tracker_run_id"]
        run_file = next((run_dir / "wandb").glob(f"offline-run-*-{run_id}")) / f"run-{run_id}.wandb"
        kinds = wait_for(lambda: (k := wandb_record_kinds(run_file)) and "exit" in k and k,
                         15, "the W&B exit record")
        assert kinds.count("history") == last


def test_sigkill_at_random_moments_then_resume_auto(setup, tmp_path: Path):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    argv = overrides(setup, run_dir, "checkpoint.every_steps=1", "checkpoint.keep_last=2",
                     "checkpoint.resume=auto")
    rng = random.Random(0)
    resumed_from: list[int] = []
    for trial in range(3):
        before = latest_step(ckpt)
        log = tmp_path / f"log-{trial}.txt"
        proc = start(argv, log)
        # Let it get past its resume point, then kill it wherever it is.
        wait_for(lambda before=before: latest_step(ckpt) > before, 120, "a new checkpoint", proc)
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
        if trial:
            assert f"resumed from {ckpt / f'step-{before}'} at step {before}" in log.read_text()
        folder = find_resume_checkpoint(ckpt)
        assert folder == ckpt / (ckpt / "latest").read_text().strip(), "latest is not complete"
        validate_checkpoint(folder)
        assert read_state(folder)["run"]["step"] == latest_step(ckpt)
        load_drafter(folder / "drafter")
        resumed_from.append(latest_step(ckpt))
    log = tmp_path / "log-final.txt"
    proc = start(argv, log)
    proc.join(120)
    output = log.read_text()
    assert proc.exitcode == 0, output
    assert f"resumed from {ckpt / f'step-{resumed_from[-1]}'} at step {resumed_from[-1]}" in output
    total_steps, samples = _plan_totals(setup, tmp_path)
    assert latest_step(ckpt) == total_steps
    # Steps after a checkpoint were re-run by the next process; the run totals come from the
    # checkpoints, so every sample counts exactly once per epoch in the end.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == total_steps
    assert records[-1]["train/samples_total"] == samples


def _plan_totals(setup: dict[str, Path], tmp_path: Path) -> tuple[int, int]:
    """(optimizer steps, samples) of the run's two epochs."""
    trainer = Trainer(load_config(None, overrides(setup, tmp_path / "count")))
    try:
        return trainer.total_steps, sum(len(ids) for e in range(2)
                                        for s in trainer.parts.plans(e).steps
                                        for ids in s.batches)
    finally:
        trainer.close()


def test_stage_failure_fails_fast_with_the_original_error_and_no_threads(
        setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import dflash_trainer.training.components as components_module

    stamp = tmp_path / "raised_at"
    monkeypatch.setattr(FailingExtractor, "stamp", stamp)
    monkeypatch.setattr(components_module, "FeatureExtractor", FailingExtractor)
    before = set(threading.enumerate())
    trainer = Trainer(load_config(None, overrides(setup, tmp_path / "run",
                                                  "checkpoint.every_steps=1")))
    with pytest.raises(RuntimeError, match="injected target failure at batch 3") as info:
        trainer.train()
    elapsed = time.time() - float(stamp.read_text())
    trainer.close()
    assert elapsed < 10
    assert "raised in pipeline stage 'target'" in "".join(getattr(info.value, "__notes__", []))
    leftover = [t.name for t in threading.enumerate()
                if t not in before and t.is_alive() and t.name != "tqdm_monitor"]
    assert not leftover, leftover
    # Steps before the failure were checkpointed and stay loadable.
    folder = find_resume_checkpoint(tmp_path / "run" / "checkpoints")
    assert folder is not None and read_state(folder)["run"]["step"] >= 1

    # The same failure through the CLI in its own process: exit 1 with the message.
    log = tmp_path / "log.txt"
    cli_stamp = tmp_path / "cli_raised_at"
    proc = start(overrides(setup, tmp_path / "cli"), log, fail_stamp=cli_stamp)
    proc.join(120)
    exited = time.time()
    output = log.read_text()
    assert proc.exitcode == 1, output
    assert "RuntimeError: injected target failure at batch 3" in output
    assert exited - float(cli_stamp.read_text()) < 10


# --- every command, SIGINT and SIGTERM: one line, exit 128 + N, nothing half-written left --------

def _hold(target: str, mode: str, stamp: str) -> None:
    """Wrap ``module:Class.method`` (or ``module:function``) so that its first call writes
    ``stamp`` and then waits for a signal: ``block`` before the real call, ``after`` once it
    returned (its output exists), ``slow`` sleeps 0.2 s per call and lets every call run."""
    import importlib

    module_name, _, qualname = target.partition(":")
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)

    def held(*args, **kwargs):
        if not os.path.exists(stamp):
            Path(stamp).write_text("reached")
        if mode == "slow":
            time.sleep(0.2)
            return original(*args, **kwargs)
        if mode == "after":
            original(*args, **kwargs)
        # Short sleeps: the kernel may hand the signal to any thread (a heartbeat, a torch
        # worker), which does not wake a long sleep in the main thread; the handler then runs
        # only when the main thread next executes bytecode.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.05)
        raise AssertionError("no signal came")

    setattr(owner, name, held)


def _command_child(argv: list[str], log: str, hold: tuple[str, str], stamp: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    _hold(*hold, stamp)
    from dflash_trainer.cli.main import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


@pytest.fixture(scope="module")
def finished_run(setup) -> dict[str, Path]:
    """A short finished run (its checkpoint, exported drafter and metrics) to evaluate, export,
    report and generate from."""
    from dflash_trainer.cli.main import main

    run_dir = setup["root"] / "finished"
    assert main(["train", *overrides(setup, run_dir, "training.max_steps=2")]) == 0
    return {"run": run_dir, "drafter": run_dir / "drafter",
            "checkpoint": run_dir / "checkpoints" / "step-2"}


_MODEL = "transformers.models.llama.modeling_llama:LlamaForCausalLM.forward"


def _command_cases(setup: dict[str, Path], run: dict[str, Path], d: Path) -> dict[str, Any]:
    """command -> (argv, what to hold, folders that must hold no temporary or lock files)."""
    target = [f"model.target={setup['target']}", "model.dtype=float32", "pipeline.num_threads=1"]
    eval_args = ["eval.prompts=mtbench", "eval.num_prompts=1", "eval.in_training_prompts=1",
                 "eval.max_new_tokens=4"]
    return {
        "prepare": (["prepare", *overrides(setup, d / "run", f"data.cache_dir={d / 'cache'}")],
                    ("dflash_trainer.data.cache:TokenStoreWriter.add", "block"), [d / "cache"]),
        "train": (["train", *overrides(setup, d / "run", f"data.cache_dir={d / 'cache'}")],
                  ("dflash_trainer.data.cache:TokenStoreWriter.add", "block"),
                  [d / "cache", d / "run"]),
        "eval": (["eval", "--drafter", str(run["drafter"]), "--out", str(d / "eval"), *target,
                  *eval_args], (_MODEL, "block"), [d]),
        "export": (["export", "--checkpoint", str(run["checkpoint"]), "--out", str(d / "out")],
                   ("dflash_trainer.training.export:save_safetensors", "after"), [d]),
        "regenerate": (["regenerate", "--data", str(setup["data"]), "--out", str(d / "o.jsonl"),
                        "--max-new-tokens", "4", "--limit", "2", *target],
                       (_MODEL, "block"), [d]),
        "demo": (["demo", *overrides(setup, d / "run"), *eval_args],
                 ("dflash_trainer.training.pipeline.drafter_step:DrafterStep.train_micro_batch", "slow"),
                 [d / "run", d / "run" / "checkpoints"]),
        "report": (["report", str(run["run"])], ("matplotlib.figure:Figure.savefig", "block"),
                   [run["run"], run["run"] / "report"]),
        "generate": (["generate", "--drafter", str(run["drafter"]), "--prompt", "hello",
                      "--max-new-tokens", "4", *target], (_MODEL, "block"), [d]),
    }


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("command", ["prepare", "train", "eval", "export", "regenerate", "demo",
                                     "report", "generate"])
def test_a_signal_ends_every_command_with_one_line_and_128_plus_n(
        setup, finished_run, tmp_path: Path, command: str, signum: signal.Signals):
    """docs/errors.md's signal table: SIGINT exits 130, SIGTERM 143, with one line
    ``dflash-trainer CMD: interrupted (SIGNAME); ...``, no traceback and no temporary folder or
    lock file left (train while it trains stops gracefully instead: the tests above)."""
    argv, hold, clean = _command_cases(setup, finished_run, tmp_path)[command]
    log, stamp = tmp_path / "log.txt", tmp_path / "reached"
    proc = _CTX.Process(target=_command_child, args=(argv, str(log), hold, str(stamp)))
    proc.start()
    try:
        wait_for(stamp.exists, 120, f"{command} to reach {hold[0]}", proc)
        os.kill(proc.pid, signum)
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
    output = log.read_text()
    assert proc.exitcode == 128 + signum, output
    # generate's line may follow its half-written answer: the line is found where it starts.
    lines = re.findall(rf"dflash-trainer {command}: .*", output)
    assert len(lines) == 1 and lines[0].startswith(
        f"dflash-trainer {command}: interrupted ({signum.name}); "), output
    assert "Traceback" not in output, output
    for folder in clean:
        left = [p.name for p in folder.glob(".*") if ".tmp-" in p.name or p.name.endswith(".lock")]
        assert not left, (folder, left)
    if command in ("eval", "export"):
        assert not (tmp_path / "eval" / "results.json").exists() and not (tmp_path / "out").exists()
    if command == "demo":  # its training stopped gracefully first: the final checkpoint exists
        assert (tmp_path / "run" / "checkpoints" / "latest").is_file(), output


@pytest.mark.parametrize("command", ["prepare", "export"])
def test_what_a_sigkill_leaves_is_removed_by_the_next_run(setup, finished_run, tmp_path: Path,
                                                          command: str):
    """SIGKILL cannot be caught: the half-written token store or export stays as a hidden
    ``.NAME.tmp-PID-*`` folder until the next run into the same folder removes it."""
    from dflash_trainer.cli.main import main

    argv, hold, _ = _command_cases(setup, finished_run, tmp_path)[command]
    folder = tmp_path / "cache" if command == "prepare" else tmp_path
    log, stamp = tmp_path / "log.txt", tmp_path / "reached"
    proc = _CTX.Process(target=_command_child, args=(argv, str(log), hold, str(stamp)))
    proc.start()
    try:
        wait_for(stamp.exists, 120, f"{command} to reach {hold[0]}", proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    left = [p.name for p in folder.glob(f".*.tmp-{proc.pid}-*")]
    assert len(left) == 1, list(folder.iterdir())
    assert main(argv) == 0
    assert not [p.name for p in folder.glob(".*") if ".tmp-" in p.name or p.name.endswith(".lock")]
