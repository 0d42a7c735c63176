"""Every published chat template of llama.cpp's corpus against a set of conversation shapes.

    python -m benchmarks.chat_template_matrix [--out benchmarks/results/chat-template-matrix.json]

The corpus is ``vendor/llama.cpp/models/templates/*.jinja`` of the pinned ``llama-cpp-python``
sdist (:func:`dflash_trainer.engines.llama_cpp_build.chat_templates`; about 70 templates of
Qwen3, Qwen3.5, QwQ, DeepSeek R1/V3/V4, Llama 3.x, gpt-oss, Gemma, Mistral, GLM, Kimi, ...). Each
template goes into the SmolLM2 tokenizer, with the control tokens it writes added as special
tokens, and every shape of :data:`SHAPES` goes through the trainer's tokenizer
(:class:`~dflash_trainer.data.tokenize.ChatTokenizer`, the code path of the token store). A
cell is one of:

- ``ok``: every supervised run of every sample decodes to exactly what the template writes for
  that assistant turn after its serving context, computed here independently with
  ``tokenizer.apply_chat_template`` (the turn's render minus its common prefix with the
  generation-prompt render), and that text holds the answer;
- ``dropped``: the record is refused with a named reason (``unrenderable``,
  ``tools_unsupported``, ...);
- ``mismatch`` or ``exception``: a defect (the test of the corpus fails on either).

The result JSON holds the count per shape and outcome, the templates that needed per-turn
samples, the reasoning answers a template trained without their reasoning, and every cell.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

from dflash_trainer.core.assets import cache_root, load_tokenizer, resolve_target
from dflash_trainer.data.formats import Conversation, Location
from dflash_trainer.data.render import reasoning_of
from dflash_trainer.data.tokenize import ChatTokenizer, Dropped, Samples, TokenizeOptions
from dflash_trainer.engines import llama_cpp_build

ROOT = Path(__file__).resolve().parents[1]
LOC = Location("matrix", 0)
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
FOLLOW_UP = "And of Italy?"
ANSWER_2 = "Rome is the capital of Italy."
REASONING = "The user asks about France; its capital is Paris."
REASONING_2 = "Italy's capital is Rome."
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
_CONTROL = re.compile(r"<[|｜][^<>\s]{1,60}?[|｜]>|</?[A-Za-z][A-Za-z0-9_:.\-]{0,40}>|\[/?[A-Z_]{3,20}\]")
"""Literal control tokens of a template (``<|im_start|>``, ``<｜Assistant｜>``, ``<seed:eos>``,
``[INST]``, ...): the model's own tokenizer has each as one token, so they are added to SmolLM2's."""


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _assistant(text: str, **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": text, **extra}


def _think(reasoning: str, answer: str) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n{answer}"


SHAPES: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "single": ([_user(QUESTION), _assistant(ANSWER)], None),
    "system": ([{"role": "system", "content": "You answer in one sentence."}, _user(QUESTION),
                _assistant(ANSWER)], None),
    "multi_turn": ([_user(QUESTION), _assistant(ANSWER), _user(FOLLOW_UP), _assistant(ANSWER_2)], None),
    "reasoning_field": ([_user(QUESTION), _assistant(ANSWER, reasoning_content=REASONING), _user(FOLLOW_UP),
                         _assistant(ANSWER_2, reasoning_content=REASONING_2)], None),
    "inline_think": ([_user(QUESTION), _assistant(_think(REASONING, ANSWER)), _user(FOLLOW_UP),
                      _assistant(_think(REASONING_2, ANSWER_2))], None),
    "tool_call": ([_user("What is the weather in Paris?"),
                   _assistant("", tool_calls=[{"type": "function", "id": "call_1", "function": {
                       "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]),
                   {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C, sunny"},
                   _assistant("It is 18 C and sunny in Paris.")], [WEATHER_TOOL]),
    "developer": ([{"role": "developer", "content": "You answer in one sentence."}, _user(QUESTION),
                   _assistant(ANSWER)], None),
}
"""Conversation shapes in the record contract (messages, tools) that prepare hands the tokenizer."""


def corpus() -> list[Path]:
    """The templates of the pinned sdist (downloaded into the user cache once)."""
    folder = llama_cpp_build.chat_templates(cache_root() / "chat-templates", llama_cpp_build.default_folder())
    return sorted(folder.glob("*.jinja"))


def tokenizer_for(base: Any, template: str) -> Any:
    """``base`` with ``template`` as its chat template and the control tokens it writes added
    (found in its source and in its renders of the shapes: some templates build them, as
    ``'<｜hy_eos{}｜>'.format(...)``)."""
    tok = copy.deepcopy(base)
    tok.chat_template = template
    texts = [template]
    for messages, tools in SHAPES.values():
        try:
            texts.append(tok.apply_chat_template(messages, tools=tools, tokenize=False))
        except Exception:  # noqa: BLE001 - a shape the template refuses adds no token
            continue
    tokens = sorted({t for text in texts for t in _CONTROL.findall(text)} - set(tok.get_vocab()))
    if tokens:
        tok.add_special_tokens({"additional_special_tokens": tokens}, replace_extra_special_tokens=False)
    return tok


def turn_problem(tok: Any, chat: ChatTokenizer, messages: list[dict[str, Any]], tools: Any, k: int,
                 thinking: bool, context: list[int], supervised: list[int]) -> str | None:
    """What is wrong with one supervised run of assistant message ``k`` (None: nothing), checked
    against renders made here with ``apply_chat_template`` (not the trainer's renderer):

    - the text before the run is the serving context ``H_k`` (the generation-prompt render) or
      a prefix of it, never text the engine does not feed, and the run's first token holds text
      beyond it (a control token that both renders begin alike is the model's);
    - context and run together are the template's render of the turn ``T_k``; or the context
      is ``H_k`` and the run is what ``T_k`` writes after a header that the generation prompt
      starts with;
    - the run holds the answer.
    """
    prepared = chat.renderer.engine_messages(messages, tools)
    think = thinking or bool(reasoning_of(messages[k]))
    kwargs = {"tools": tools, "tokenize": False, "enable_thinking": think}
    head = tok.apply_chat_template(prepared[:k], add_generation_prompt=True, **kwargs)
    turn = tok.apply_chat_template(prepared[:k + 1], **kwargs)
    base = tok.apply_chat_template(prepared[:k], **kwargs) if k else ""
    ctx, got, first = tok.decode(context), tok.decode(supervised), tok.decode(supervised[:1])
    prompt = head[len(base):] if head.startswith(base) else ""
    before = turn[:len(turn) - len(got)] if turn.endswith(got) else None
    after_header = ctx == head and before is not None and any(
        prompt[:i].strip() and before.endswith(prompt[:i]) for i in range(len(prompt), 0, -1))
    answer = messages[k]["content"].split("</think>")[-1].strip() or "get_weather"
    if not head.startswith(ctx):
        return f"the context holds text the engine does not feed: {ctx[len(os.path.commonprefix([ctx, head])):]!r}"
    if ctx != head and head.startswith(ctx + first):
        return f"the first supervised token {first!r} is context"
    if ctx + got != turn and not after_header:
        return f"supervised {got!r} is not the turn: {turn[len(ctx):]!r}"
    if answer not in got:
        return f"supervised {got!r} lacks the answer {answer!r}"
    return None


def boundary_differs(tok: Any, context_text: str, sample_ids: list[int]) -> bool:
    """Whether the engine's tokens of the context are not those of the sample (a tokenizer
    merging across the boundary, as SmolLM2's ``\\n\\n`` + ``The``)."""
    head_ids = tok(context_text, add_special_tokens=False)["input_ids"]
    return sample_ids[:len(head_ids)] != head_ids


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def check_cell(tok: Any, name: str, shape: str, *, thinking: bool = False) -> dict[str, Any]:
    """One template x shape: its outcome and what it found."""
    messages, tools = SHAPES[shape]
    record = Conversation(copy.deepcopy(messages), LOC)
    object.__setattr__(record, "tools", tools)  # the field the record adapter fills
    chat = ChatTokenizer(tok, TokenizeOptions(max_length=4096, min_supervised_tokens=1, thinking=thinking),
                         template_name=name)
    try:
        result = chat.encode(record)
    except Exception as exc:  # a defect: the matrix records it, the test fails on it
        return {"outcome": "exception", "error": f"{type(exc).__name__}: {exc}"[:300]}
    if isinstance(result, Dropped):
        return {"outcome": "dropped", "reason": result.reason, "message": result.message.split(": ", 1)[-1][:300]}
    assert isinstance(result, Samples)
    problems, boundary_merged = [], 0
    for encoded in result.encoded:
        ids, mask = encoded.input_ids.tolist(), encoded.loss_mask.tolist()
        runs = _runs(mask)
        if len(runs) != len(encoded.turns):
            problems.append(f"sample of turns {encoded.turns}: {len(runs)} supervised runs")
            continue
        for (a, b), k in zip(runs, encoded.turns):
            problem = turn_problem(tok, chat, result.messages, tools, k, thinking, ids[:a], ids[a:b])
            if problem:
                problems.append(f"turn {k}: {problem}")
            boundary_merged += boundary_differs(tok, tok.decode(ids[:a]), ids)
    cell = {"outcome": "mismatch" if problems else "ok", "samples": len(result.encoded),
            "per_turn_samples": sum(not e.whole for e in result.encoded)}
    if boundary_merged:
        cell["boundary_tokens_differ"] = boundary_merged
    if result.reasoning_answers:
        cell["reasoning_unrendered"] = result.reasoning_unrendered
    if problems:
        cell["problems"] = problems[:4]
    return cell


def run_matrix(templates: list[Path], shapes: list[str] | None = None) -> dict[str, Any]:
    """Every template x shape (:func:`check_cell`), with the counts per shape."""
    base = load_tokenizer(resolve_target("smollm2"))
    shapes = shapes or list(SHAPES)
    cells: dict[str, dict[str, Any]] = {}
    for path in templates:
        tok = tokenizer_for(base, path.read_text(encoding="utf-8"))
        cells[path.stem] = {shape: check_cell(tok, path.stem, shape) for shape in shapes}
    counts = {}
    for shape in shapes:
        outcomes = Counter(c[shape]["outcome"] if c[shape]["outcome"] != "dropped"
                           else f"dropped:{c[shape]['reason']}" for c in cells.values())
        counts[shape] = dict(sorted(outcomes.items()))
    return {
        "corpus": f"{llama_cpp_build.SDIST_PIN} {llama_cpp_build.TEMPLATES}/*.jinja",
        "templates": len(templates),
        "tokenizer": "SmolLM2-135M-Instruct + the template's control tokens",
        "counts_per_shape": counts,
        "per_turn_templates": sorted(n for n, c in cells.items()
                                     if any(x.get("per_turn_samples") for x in c.values())),
        "reasoning_unrendered": sorted(n for n, c in cells.items()
                                       if any(x.get("reasoning_unrendered") for x in c.values())),
        "defects": sorted(f"{n}/{s}" for n, c in cells.items() for s, x in c.items()
                          if x["outcome"] in ("mismatch", "exception")),
        "cells": cells,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/chat-template-matrix.json"))
    args = parser.parse_args(argv)
    started = time.monotonic()
    result = run_matrix(corpus())
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    Path(args.out).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps({k: result[k] for k in ("templates", "counts_per_shape", "defects")}, indent=1))
    return 1 if result["defects"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
