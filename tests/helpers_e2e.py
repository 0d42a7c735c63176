"""Shared builders for end-to-end tests: a tiny random target, a small chat data file, the
overrides of a short run, and a W&B run log reader."""

from __future__ import annotations

import contextlib
import json
import random
import socketserver
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import torch
from conftest import with_guard
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_trainer.core import assets

WORDS = ("the model drafts tokens block diffusion target verify accept speed cache layer "
         "hidden state anchor mask loss gamma decay train step batch bucket queue").split()


def make_tiny_target(folder: Path, *, layers: int = 4, hidden: int = 64, seed: int = 0) -> Path:
    """A randomly initialised Llama with the real SmolLM2 tokenizer (so chat templates work)."""
    tokenizer = assets.load_tokenizer(assets.resolve_target("smollm2"))
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_chat_jsonl(path: Path, *, num: int = 24, seed: int = 0) -> Path:
    """OpenAI-messages JSONL with varied lengths (so several length buckets fill)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(num):
            n_words = rng.choice([20, 40, 80, 160])
            answer = " ".join(rng.choice(WORDS) for _ in range(n_words))
            record = {"messages": [
                {"role": "user", "content": f"question {i}: " + " ".join(rng.sample(WORDS, 5))},
                {"role": "assistant", "content": answer}]}
            f.write(json.dumps(record) + "\n")
    return path


def tiny_run_overrides(*, target: Path, data: Path, cache: Path, run_dir: Path) -> list[str]:
    """Config overrides of a short two-epoch run on a 3-layer ``make_tiny_target`` and a
    16-sample ``make_chat_jsonl`` (one CPU thread, every step logged, no console/TensorBoard, no
    final evaluation)."""
    return [f"model.target={target}", f"data.paths=[{data}]", f"run_dir={run_dir}",
            f"data.cache_dir={cache}", "data.max_length=128", "data.heldout_samples=0",
            "model.target_layer_ids=[0,1]", "model.dtype=float32", "pipeline.tokens_per_batch=256",
            "pipeline.num_buckets=2", "pipeline.num_threads=1", "training.num_anchors=4",
            "training.epochs=2", "logging.every_steps=1", "logging.console=false",
            "logging.tensorboard=false", "eval.final=false"]


def wandb_records(run_file: Path) -> list[dict[str, Any]]:
    """The records of a W&B transaction log (``run-ID.wandb``), read by W&B itself
    (``wandb leet inspect --json``); a log still being written gives the records so far."""
    wandb_cli = Path(sys.executable).parent / "wandb"
    out = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(run_file)],
                         capture_output=True, text=True, timeout=120).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@contextlib.contextmanager
def serving(server: socketserver.BaseServer, *, join_timeout: float) -> Iterator[socketserver.BaseServer]:
    """Serve ``server`` from a daemon thread for the block; shut it down and close it after."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=join_timeout)


class JsonHandler(BaseHTTPRequestHandler):
    """A quiet request handler of the tests' local servers, answering JSON bodies."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, body: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def reply(self, body: Any, status: int = 200) -> None:
        """Send ``body`` as a JSON response."""
        self._send(json.dumps(body).encode(), status)


def load_with_transformers_alone(folder: Path, inputs: dict[str, torch.Tensor],
                                 work: Path) -> tuple[str, dict[str, list[str]], Any]:
    """Load an exported drafter ``folder`` in a fresh interpreter with transformers alone (no
    dflash_trainer importable) and run it on ``inputs``: the class name, the loading info and
    the output."""
    import os
    import textwrap

    torch.save(inputs, work / "inputs.pt")
    script = textwrap.dedent(f"""
        import json, sys, torch
        from transformers import AutoModel
        model, info = AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True, output_loading_info=True)
        assert "dflash_trainer" not in sys.modules
        with torch.no_grad():
            torch.save(model.eval()(**torch.load({str(work / 'inputs.pt')!r})), {str(work / 'out.pt')!r})
        print(json.dumps({{"class": type(model).__name__, **{{k: sorted(v) for k, v in info.items()}}}}))
    """)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(work / "hf"), PYTHONPATH=with_guard(""))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                            cwd=work, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads(result.stdout.strip().splitlines()[-1])
    return info.pop("class"), info, torch.load(work / "out.pt")


def train_recording(args: list[str], *, on_batch: Any = None, **kwargs: Any) -> tuple[list[tuple], Any]:
    """A run of the real Trainer on the config of ``args``: the (epoch, step, sample ids) of every
    batch it trained on, and the closed Trainer; ``on_batch`` also hears each batch."""
    from dflash_trainer.config import load_config
    from dflash_trainer.training.trainer import Trainer

    records: list[tuple] = []
    trainer = Trainer(load_config(None, args))

    def record(batch: Any) -> None:
        records.append((batch.epoch, batch.step, tuple(batch.sample_ids.tolist())))
        if on_batch is not None:
            on_batch(batch)

    try:
        trainer.train(on_batch=record, **kwargs)
    finally:
        trainer.close()
    return records, trainer


def run_losses(run_dir: Path) -> dict[int, float]:
    """``train/loss`` of every logged step of a run folder's ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
