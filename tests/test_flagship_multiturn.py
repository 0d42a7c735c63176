"""The flagship path on multi-turn reasoning data, end to end through the command line: a tiny random
Qwen3 target with the real Qwen3 chat template (llama.cpp's corpus), ShareGPT conversations of
two and three user turns regenerated with thinking on through both backends (transformers, and
the OpenAI client against a server that answers with a separate ``reasoning_content`` as vLLM's
reasoning parser does), then ``prepare --show``, ``prepare``, ``features``, ``train --config
configs/qwen3-8b.yaml`` shrunk by overrides, and ``eval`` on the held-out multi-turn conversations."""

from __future__ import annotations

import json
import re
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmarks.chat_template_matrix import corpus, tokenizer_for
from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.core.assets import load_tokenizer, resolve_target
from helpers_e2e import WORDS, JsonHandler, serving

ROOT = Path(__file__).resolve().parents[1]
QWEN3 = "Qwen-Qwen3-0.6B"


def make_qwen3_target(folder: Path) -> Path:
    """A random 3-layer Qwen3 with SmolLM2's vocabulary, Qwen3's chat template and its tokens."""
    template = next(p for p in corpus() if p.stem == QWEN3).read_text(encoding="utf-8")
    tokenizer = tokenizer_for(load_tokenizer(resolve_target("smollm2")), template)
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer),
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_sharegpt(path: Path, num: int) -> Path:
    """ShareGPT conversations of two and three user turns (the answers are regenerated)."""
    records = []
    for i in range(num):
        turns = []
        for t in range(2 + i % 2):
            turns += [{"from": "human", "value": f"q{i}.{t}: " + " ".join(WORDS[(i + t + j) % len(WORDS)]
                                                                        for j in range(6))},
                      {"from": "gpt", "value": "an answer to be regenerated"}]
        records.append({"conversations": turns})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


class ReasoningServer(ThreadingHTTPServer):
    """Answers chat completions as a server with a reasoning parser: ``reasoning_content`` apart
    from ``content``. Records the requests."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), ReasoningHandler)
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class ReasoningHandler(JsonHandler):
    server: ReasoningServer

    def do_GET(self) -> None:
        self.reply({"object": "list", "data": [{"id": "tiny-qwen3", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append(body)
        n = len(body["messages"])
        message = {"role": "assistant", "content": f"answer {n}: " + " ".join(WORDS[n:n + 8]),
                   "reasoning_content": f"thinking {n}: " + " ".join(WORDS[n + 2:n + 12])}
        self.reply({"object": "chat.completion", "model": body["model"],
                     "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
                     "usage": {"completion_tokens": 24}})


@pytest.mark.slow
def test_qwen3_multi_turn_reasoning_data_prepare_features_train_eval(tmp_path: Path, capsys) -> None:
    target = make_qwen3_target(tmp_path / "target")
    source = make_sharegpt(tmp_path / "sharegpt.jsonl", 12)
    local, served = tmp_path / "regen-local.jsonl", tmp_path / "regen-served.jsonl"
    common = ["--target", str(target), "--data", str(source), "--max-new-tokens", "12", "data.thinking=true"]
    # sampled: a random model's greedy choice here is a control token, an empty answer
    assert cli_main(["regenerate", *common, "--out", str(local), "--temperature", "1"]) == 0
    with serving(ReasoningServer(), join_timeout=10) as server:
        assert cli_main(["regenerate", *common, "--out", str(served), "--backend", "openai",
                         "--server-url", server.url, "--concurrency", "2", "--limit", "8"]) == 0
    assert all(r["chat_template_kwargs"] == {"enable_thinking": True} for r in server.requests)
    served_records = [json.loads(line) for line in served.read_text().splitlines()]
    assert all("<think>\nthinking" in m["content"] for r in served_records for m in r["messages"]
               if m["role"] == "assistant")
    capsys.readouterr()

    cache, run, store = tmp_path / "tokens", tmp_path / "run", tmp_path / "features"
    overrides = [f"model.target={target}", f"data.paths=[{served},{local}]", f"data.cache_dir={cache}",
                 f"run_dir={run}", "data.max_length=512", "data.heldout_samples=2", "model.num_layers=1",
                 "model.target_layer_ids=[0,1]", "model.mask_token_id=null", "model.block_size=4",
                 "model.dtype=float32", "model.attention=auto", "training.epochs=1", "training.max_steps=3",
                 "training.num_anchors=8", "pipeline.tokens_per_batch=1024", "pipeline.prefetch_workers=1",
                 "pipeline.num_threads=1", "pipeline.device=cpu", "logging.wandb=disabled",
                 "logging.every_steps=1", "logging.console=false", "logging.tensorboard=false",
                 "checkpoint.resume=null", "checkpoint.every_minutes=null", "eval.prompts=sharegpt-heldout",
                 "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.every_steps=null"]
    config = ["--config", str(ROOT / "configs/qwen3-8b.yaml")]

    # What is trained, before any store is written: per-turn samples named, reasoning marked
    assert cli_main(["prepare", *config, *overrides, "--show", "4"]) == 0
    shown = capsys.readouterr().out
    # (the served file's order depends on which request finished first)
    assert re.search(r"assistant turn 1 of [23], its own sample \(history repeated as context\)", shown)
    assert re.search(r"assistant turn ([23]) of \1, the whole conversation", shown)
    assert "no token store was written" in shown
    # turn 1 as it was served: its reasoning supervised (history renders it without)
    assert "<|im_start|>assistant\n⟦<think>\nthinking 1: " in shown
    assert not cache.exists() or not any(cache.iterdir())

    assert cli_main(["prepare", *config, *overrides]) == 0
    out = capsys.readouterr().out
    stats = json.loads(next(cache.glob("*/stats.json")).read_text())
    # Every multi-turn conversation trains every answer: per-turn samples for the earlier turns
    assert stats["dropped"] == dict.fromkeys(stats["dropped"], 0) and stats["kept"] == 12 + 8 - 2
    assert stats["expanded"] == stats["kept"] and stats["samples"] > stats["kept"]
    served_answers = sum(m["role"] == "assistant" for r in served_records[2:] for m in r["messages"])
    assert stats["expansion_tokens"] > 0 and stats["reasoning_answers"] == served_answers  # 2 held out
    assert stats["reasoning_unrendered"] == 0
    assert re.search(r"expanded into [\d,]+ per-turn samples .*\+[\d,]+ tokens \([\d.]+% of all\)", out)
    assert "supervised answers carried reasoning" in out

    assert cli_main(["features", *config, *overrides, f"--out={store}"]) == 0
    assert cli_main(["train", *config, *overrides, f"features.store={store}"]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss" in m for m in metrics)
    assert cli_main(["eval", *config, *overrides, "--drafter", str(run / "drafter")]) == 0
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["lossless"] is True and results["requests"] >= 2
