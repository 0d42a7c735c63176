"""The published chat templates of llama.cpp's corpus (the pinned ``llama-cpp-python`` sdist)
against the conversation shapes of ``benchmarks/chat_template_matrix.py``: every cell gives
samples whose supervised runs are the turns as an engine serves them, or a record dropped with a
named reason; no exception escapes. The templates are fetched once into the user cache's
``chat-templates`` folder (a package-registry download of the sdist)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.chat_template_matrix import SHAPES, corpus, run_matrix

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks/results/chat-template-matrix.json"
FLAGSHIPS = ("Qwen-Qwen3-0.6B", "Qwen3.5-4B", "Qwen-QwQ-32B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
             "meta-llama-Llama-3.1-8B-Instruct", "openai-gpt-oss-120b", "LFM2.5-Instruct")


@pytest.fixture(scope="module")
def templates() -> list[Path]:
    return corpus()


def test_the_corpus_is_the_pinned_sdist(templates):
    names = {p.stem for p in templates}
    assert len(templates) >= 60 and set(FLAGSHIPS) <= names


def test_flagship_templates_every_shape(templates):
    result = run_matrix([p for p in templates if p.stem in FLAGSHIPS])
    assert result["defects"] == []
    cells = result["cells"]
    # Qwen3: multi-turn and reasoning data need per-turn samples, and every shape trains
    assert all(c["outcome"] == "ok" for c in cells["Qwen-Qwen3-0.6B"].values())
    assert cells["Qwen-Qwen3-0.6B"]["multi_turn"]["per_turn_samples"] == 1
    assert cells["Qwen-Qwen3-0.6B"]["reasoning_field"]["reasoning_unrendered"] == 0
    # QwQ and the R1 distills open <think> in the prompt: single turns train (common prefix)
    assert cells["Qwen-QwQ-32B"]["single"]["outcome"] == "ok"
    assert cells["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"]["single"]["outcome"] == "ok"
    # Llama 3.1 renders tool calls; the history is a prefix: one sample per conversation
    assert cells["meta-llama-Llama-3.1-8B-Instruct"]["tool_call"]["outcome"] == "ok"
    assert cells["meta-llama-Llama-3.1-8B-Instruct"]["multi_turn"]["per_turn_samples"] == 0


@pytest.mark.slow
def test_every_template_every_shape_and_the_committed_matrix(templates):
    result = run_matrix(templates)
    assert result["defects"] == [], result["defects"]
    assert all(sum(counts.values()) == len(templates) for counts in result["counts_per_shape"].values())
    assert set(result["counts_per_shape"]) == set(SHAPES)
    committed = json.loads(RESULT.read_text())
    assert committed["counts_per_shape"] == result["counts_per_shape"]
    assert committed["cells"] == result["cells"]
