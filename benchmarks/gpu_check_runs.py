"""The GPU check's sections that run processes: the sanitizer's child, ``dflash-trainer train``
killed and resumed, and the 2-GPU torchrun (see ``benchmarks/gpu_check.py``).

Each training process trains a tiny random Llama (the embedded SmolLM2 tokenizer) on a small
chat file written here, on the device the check runs on.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from benchmarks.gpu_check import Section, Settings

ROOT = Path(__file__).resolve().parents[1]
SANITIZED_STEPS = 20
CHILD_TIMEOUT_S = 300.0
"""A child process that runs longer failed (a hang is what some of these sections look for)."""
COLLECTIVE_TIMEOUT_S = 60
"""``distributed.timeout_s`` of the 2-rank run: a rank left in a collective fails after this."""
WORDS = ("the model drafts tokens block diffusion target verify accept speed cache layer "
         "hidden state anchor mask loss gamma decay train step batch bucket queue").split()


def _section(name: str, **kwargs: Any) -> Section:
    from benchmarks.gpu_check import Section

    return Section(name, **kwargs)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
            "PYTHONPATH": str(ROOT), **extra}


def section_sanitizer(st: Settings) -> Section:
    """Pipelined steps in a child process under ``TORCH_CUDA_SANITIZER=1``."""
    steps = 5 if st.tiny else SANITIZED_STEPS
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--device", st.device.type,
           "--sanitized-steps", str(steps), *(["--tiny"] if st.tiny else [])]
    # The sanitizer needs a CUDA build: on CPU the child runs the same steps without it.
    env = _env(TORCH_CUDA_SANITIZER="1") if st.device.type == "cuda" else _env()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True,
                          timeout=CHILD_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    result = next((json.loads(line) for line in proc.stdout.splitlines()
                   if line.startswith('{"sanitized_steps"')), None)
    data = {"exit": proc.returncode, "steps": steps, "result": result,
            "output_tail": output[-4000:]}
    race = "CSAN" in output or "data race" in output
    ok = proc.returncode == 0 and result is not None and not race
    summary = (f"{steps} pipelined steps under the stream sanitizer: "
               + ("no race reported" if ok else f"exit {proc.returncode}"
                  + (", a race reported" if race else "")))
    note = "" if st.device.type == "cuda" else "CPU: the sanitizer watches CUDA streams only"
    return _section("sanitizer", status="ok" if ok else "FAIL", summary=summary, note=note,
                    data=data)


def make_model_folder(folder: Path, *, layers: int = 3, hidden: int = 64) -> Path:
    """A random Llama with the embedded SmolLM2 tokenizer, saved as a model folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_trainer.core import assets

    tokenizer = assets.load_tokenizer(assets.resolve_target("smollm2"))
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=len(tokenizer), max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_chat_file(path: Path, *, num: int = 32) -> Path:
    """Chat samples (OpenAI messages) of varied lengths."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(num):
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.choice([20, 40, 80, 160])))
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"question {i}: " + " ".join(rng.sample(WORDS, 5))},
                {"role": "assistant", "content": answer}]}) + "\n")
    return path


def run_overrides(root: Path, run_dir: Path, device: torch.device, *extra: str) -> list[str]:
    """A short run on the folder's model and chat file, every step logged, no final evaluation
    (these sections check training; device time is short). SDPA: compiled FlexAttention is the
    recompiles section's; here it would only add its compile time to every process."""
    return [f"model.target={root / 'target'}", f"data.paths=[{root / 'chat.jsonl'}]",
            "model.attention=sdpa",
            f"run_dir={run_dir}", f"data.cache_dir={root / 'cache'}", "data.max_length=128",
            "data.heldout_samples=0", "model.target_layer_ids=[0,1]",
            "pipeline.tokens_per_batch=256", "pipeline.num_buckets=2", "training.num_anchors=8",
            "logging.every_steps=1", "logging.console=false", "logging.tensorboard=false",
            "eval.final=false", f"pipeline.device={device.type}",
            *(["model.dtype=float32", "pipeline.num_threads=1"] if device.type == "cpu" else []),
            *extra]


def _wait(condition: Callable[[], Any], proc: subprocess.Popen, what: str,
          timeout_s: float = CHILD_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"the run exited ({proc.returncode}) before {what}")
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def _latest(ckpt: Path) -> int:
    pointer = ckpt / "latest"
    return int(pointer.read_text().strip()[5:]) if pointer.is_file() else 0


def _logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    text = path.read_text()
    return [json.loads(line)["step"] for line in text[:text.rfind("\n") + 1].splitlines()
            if line.strip()]


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "dflash_trainer", "train", *argv],
                                cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)


def section_kill_resume(st: Settings) -> Section:
    """SIGKILL after the second checkpoint, ``--resume auto``, then SIGTERM: exit 0."""
    from dflash_trainer.training.checkpoint import find_resume_checkpoint, validate_checkpoint

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        root = Path(tmp)
        make_model_folder(root / "target")
        make_chat_file(root / "chat.jsonl")
        run_dir = root / "run"
        ckpt = run_dir / "checkpoints"
        argv = run_overrides(root, run_dir, st.device, "training.epochs=20",
                             "checkpoint.every_steps=1", "checkpoint.keep_last=2",
                             "checkpoint.resume=auto")
        first = _start(argv, root / "first.log")
        try:
            _wait(lambda: _latest(ckpt) >= 2, first, "the second checkpoint")
        finally:
            first.kill()
            first.wait()
        folder = find_resume_checkpoint(ckpt)
        validate_checkpoint(folder)
        killed_at = _latest(ckpt)
        logged = len(_logged_steps(run_dir))
        second = _start(argv, root / "second.log")
        try:
            # A step logged by this run: it trains, so its stop signal handler is in place.
            _wait(lambda: len(_logged_steps(run_dir)) > logged, second, "a step after the resume")
            sent = time.monotonic()
            second.send_signal(signal.SIGTERM)
            code = second.wait(CHILD_TIMEOUT_S)
            exit_s = time.monotonic() - sent
        finally:
            if second.poll() is None:
                second.kill()
                second.wait()
        log = (root / "second.log").read_text(errors="replace")
    resumed = f"at step {killed_at}" in log and "resumed from" in log
    stopped = "stopped by signal SIGTERM" in log
    ok = first.returncode == -signal.SIGKILL and resumed and stopped and code == 0
    data = {"killed_at_step": killed_at, "resumed": resumed, "sigterm_exit": code,
            "sigterm_exit_s": exit_s, "stopped_by_sigterm": stopped,
            "log_tail": log[-3000:]}
    summary = (f"SIGKILL at checkpoint step-{killed_at}, resumed there: {resumed}; SIGTERM: "
               f"exit {code} in {exit_s:.1f} s")
    return _section("kill_resume", status="ok" if ok else "FAIL", summary=summary, data=data)


def section_two_gpu(st: Settings) -> Section:
    """torchrun on 2 GPUs (NCCL), a sharded target, an early stop; contexts per GPU."""
    cuda = st.device.type == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        return _section("two_gpu", status="skipped",
                        note=f"{torch.cuda.device_count()} GPU: needs 2")
    with tempfile.TemporaryDirectory(prefix="gpu-check-2-") as tmp:
        root = Path(tmp)
        make_model_folder(root / "target")
        make_chat_file(root / "chat.jsonl")
        # max_steps ends each rank's loop with batches still in its pipeline: the stop the
        # sharded target's stages must agree on.
        argv = run_overrides(root, root / "run", st.device, "distributed.target=fsdp",
                             f"distributed.timeout_s={COLLECTIVE_TIMEOUT_S}", "training.epochs=4",
                             "training.max_steps=5")
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node",
               "2", str(ROOT / "benchmarks" / "gpu_check_rank.py"), str(root), *argv]
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(OMP_NUM_THREADS="1"), text=True,
                              capture_output=True, timeout=CHILD_TIMEOUT_S)
        seconds = time.monotonic() - started
        ranks = [json.loads(p.read_text()) for p in sorted(root.glob("rank-*.json"))]
    output = proc.stdout + proc.stderr
    stragglers = "still running after close" in output
    contexts = {r["rank"]: r["gpus_with_context"] for r in ranks}
    own_gpu_only = all(c is None or c == [r] for r, c in contexts.items())
    ok = proc.returncode == 0 and len(ranks) == 2 and not stragglers and own_gpu_only
    data = {"exit": proc.returncode, "seconds": seconds, "ranks": ranks,
            "stage_threads_left": stragglers, "output_tail": output[-4000:]}
    summary = (f"2 ranks ({'NCCL' if cuda else 'gloo'}), target fsdp, max_steps stop: exit "
               f"{proc.returncode} in {seconds:.0f} s; CUDA contexts per rank "
               f"{contexts if cuda else 'not on CPU'}")
    notes = []
    if stragglers:
        notes.append("a stage thread outlived the pipeline")
    if not own_gpu_only:
        notes.append("a rank holds a context on another rank's GPU")
    if cuda and any(c is None for c in contexts.values()):
        notes.append("nvidia-smi lists no context of a rank (PID namespace?): not checked")
    return _section("two_gpu", status="ok" if ok else "FAIL", summary=summary,
                    note="; ".join(notes), data=data)
