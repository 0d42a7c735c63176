"""Chat data from a file to the token store, through the real ``prepare`` command: the layout
adapters (OpenAI messages with tools, reasoning fields and inline think blocks, the developer
role, ShareGPT function calls) and the renderer (the real Qwen3 template of llama.cpp's corpus,
and SmolLM2's own ChatML without tool rendering), checked by decoding the supervised tokens."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import Qwen3Config

from benchmarks.chat_template_matrix import corpus, tokenizer_for
from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.core.assets import load_tokenizer, resolve_target
from dflash_trainer.data.cache import TokenStore
from dflash_trainer.data.show import CLOSE, OPEN

QWEN3 = "Qwen-Qwen3-0.6B"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_RESULT = "18 degrees and sunny"


@pytest.fixture(scope="module")
def smol() -> Any:
    return load_tokenizer(resolve_target("smollm2"))


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory: pytest.TempPathFactory, smol: Any) -> Path:
    """A target folder holding SmolLM2's vocabulary with Qwen3's template and tokens (``prepare``
    reads only the tokenizer and config.json)."""
    folder = tmp_path_factory.mktemp("qwen3")
    template = next(p for p in corpus() if p.stem == QWEN3).read_text(encoding="utf-8")
    tokenizer = tokenizer_for(smol, template)
    Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer),
                max_position_embeddings=4096).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _prepare(tmp_path: Path, data: Path, target: Path | str, *extra: str) -> tuple[TokenStore, dict[str, Any], str]:
    """Runs ``dflash-trainer prepare``; returns its store, its stats.json and what it printed."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert cli_main(["prepare", "--data", str(data), *_options(tmp_path / "cache", target), *extra]) == 0
    printed = buffer.getvalue()
    path = Path(re.search(r"^token store: (\S+) \(", printed, re.M).group(1))
    return TokenStore(path), json.loads((path / "stats.json").read_text()), printed


def _options(cache: Path, target: Path | str) -> list[str]:
    return [f"model.target={target}", f"data.cache_dir={cache}", "data.heldout_samples=0",
            "data.min_supervised_tokens=2"]


def _supervised_runs(tokenizer: Any, store: TokenStore, i: int) -> list[str]:
    """The supervised runs of sample ``i``, decoded."""
    ids, mask = store[i]
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    return [tokenizer.decode(ids[run].tolist()) for run in np.split(np.arange(len(ids)), edges)
            if len(run) and mask[run[0]]]


def _context(tokenizer: Any, store: TokenStore, i: int) -> str:
    ids, mask = store[i]
    return tokenizer.decode(ids[~mask.astype(bool)].tolist())


def _tool_chat() -> dict[str, Any]:
    return {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": TOOL_RESULT},
        {"role": "assistant", "content": "Warm and bright in Paris today."}]}


def test_openai_tool_calls_under_qwen3_supervise_the_call_and_not_the_result(tmp_path, qwen3_target):
    tokenizer = load_tokenizer(qwen3_target)
    store, stats, printed = _prepare(tmp_path, _write(tmp_path / "tools.jsonl", [_tool_chat()]), qwen3_target)
    # Qwen3 writes no think block into history: the tool-call turn is its own sample
    assert (stats["kept"], stats["samples"], stats["expanded"], stats["turn_samples"]) == (1, 2, 1, 1)
    assert "1 expanded into 1 per-turn samples" in printed
    assert stats["dropped"]["tools_unsupported"] == 0 and stats["dropped_fields"] == {}
    runs = [_supervised_runs(tokenizer, store, i) for i in range(len(store))]
    call = next(r for r in runs if any("<tool_call>" in t for t in r))
    # the call turn as the model writes it, its JSON-string arguments parsed as an engine does
    assert call == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n']
    assert stats["expansion_tokens"] == int(store.lengths[runs.index(call)])
    answer = next(r for r in runs if r is not call)
    assert answer == ["Warm and bright in Paris today.<|im_end|>\n"]
    # the tools list, the earlier call and the tool result are the final answer's context
    context = _context(tokenizer, store, runs.index(answer))
    assert f"<tool_response>\n{TOOL_RESULT}\n</tool_response>" in context and "<tools>" in context
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in context


def test_a_template_without_tool_rendering_drops_the_tool_record_naming_the_template(tmp_path):
    plain = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
    store, stats, printed = _prepare(tmp_path, _write(tmp_path / "tools.jsonl", [_tool_chat(), plain]), "smollm2")
    assert len(store) == stats["kept"] == 1 and stats["dropped"]["tools_unsupported"] == 1
    (example,) = stats["examples"]["tools_unsupported"]
    assert "tools.jsonl:1 (record 0)" in example
    assert f"the chat template of {resolve_target('smollm2')} has no tool rendering" in example
    assert re.search(r"tools unsupported\s+1", printed)


def _reasoning_file(tmp_path: Path) -> Path:
    return _write(tmp_path / "reasoning.jsonl", [
        {"messages": [{"role": "user", "content": "2+2?"},
                      {"role": "assistant", "reasoning_content": "two and two make four", "content": "4"}]},
        {"messages": [{"role": "user", "content": "3+3?"},
                      {"role": "assistant", "content": "<think>\nthree and three make six\n</think>\n\n6"}]},
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]}])


@pytest.mark.parametrize("thinking", [False, True])
def test_reasoning_fields_and_inline_think_are_supervised_in_either_thinking_mode(tmp_path, qwen3_target, thinking):
    tokenizer = load_tokenizer(qwen3_target)
    store, stats, printed = _prepare(tmp_path, _reasoning_file(tmp_path), qwen3_target,
                                     f"data.thinking={str(thinking).lower()}")
    assert (stats["kept"], stats["samples"]) == (3, 3)
    assert stats["reasoning_answers"] == 2 and stats["reasoning_unrendered"] == 0
    assert "2 supervised answers carried reasoning" in printed
    (four,), (six,), (plain,) = (_supervised_runs(tokenizer, store, i) for i in range(3))
    assert four == "<think>\ntwo and two make four\n</think>\n\n4<|im_end|>\n"
    assert six == "<think>\nthree and three make six\n</think>\n\n6<|im_end|>\n"
    # data.thinking keeps its meaning for the answer without reasoning: Qwen3 opens the turn
    # with an empty think block in the generation prompt (context) when thinking is off, and
    # the model writes it (supervised) when thinking is on
    assert plain == ("<think>\n\n</think>\n\nhi there<|im_end|>\n" if thinking else "hi there<|im_end|>\n")
    assert _context(tokenizer, store, 2).endswith("assistant\n" if thinking else "assistant\n<think>\n\n</think>\n\n")


def test_the_developer_role_becomes_the_system_message_of_a_template_without_one(tmp_path, qwen3_target):
    tokenizer = load_tokenizer(qwen3_target)
    store, stats, _ = _prepare(tmp_path, _write(tmp_path / "dev.jsonl", [{"messages": [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"}]}]),
        qwen3_target)
    assert stats["kept"] == len(store) == 1
    assert _context(tokenizer, store, 0).startswith("<|im_start|>system\nAnswer in one word.<|im_end|>")
    assert _supervised_runs(tokenizer, store, 0) == ["Paris<|im_end|>\n"]


def _sharegpt_calls() -> dict[str, Any]:
    return {"tools": json.dumps([WEATHER]), "conversations": [
        {"from": "human", "value": "Weather in Rome?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Rome"}})},
        {"from": "observation", "value": TOOL_RESULT},
        {"from": "gpt", "value": "Rome: 18 degrees, sunny."}]}


def test_sharegpt_function_calls_and_observations_and_show(tmp_path, qwen3_target, capsys):
    tokenizer = load_tokenizer(qwen3_target)
    data = _write(tmp_path / "sharegpt.jsonl", [_sharegpt_calls()])
    store, stats, _ = _prepare(tmp_path, data, qwen3_target)
    assert (stats["kept"], stats["samples"], stats["turn_samples"]) == (1, 2, 1)
    runs = [t for i in range(len(store)) for t in _supervised_runs(tokenizer, store, i)]
    calls = [t for t in runs if "<tool_call>" in t]
    assert len(calls) == 1 and '"city": "Rome"' in calls[0]
    assert any("Rome: 18 degrees, sunny." in t for t in runs) and not any(TOOL_RESULT in t for t in runs)

    # prepare --show prints the same samples from the same code path, nothing written
    assert cli_main(["prepare", "--data", str(data), *_options(tmp_path / "show-cache", qwen3_target),
                     "--show", "5"]) == 0
    out = capsys.readouterr().out
    assert "2 samples shown" in out and not (tmp_path / "show-cache").exists()
    assert "assistant turn 1 of 2, its own sample (history repeated as context)" in out
    assert "assistant turn 2 of 2, the whole conversation" in out
    bodies = "".join(line for line in out.splitlines(keepends=True)
                     if not line.startswith("--- ") and "samples shown" not in line)
    marked = re.findall(f"{OPEN}(.*?){CLOSE}", bodies, re.S)
    assert sorted(marked) == sorted(runs) and TOOL_RESULT in out
