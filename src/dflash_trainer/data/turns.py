"""Which texts a conversation becomes, and which characters of them are supervised.

The ground truth of assistant turn ``k`` is what an engine serves: the context
``H_k = render(messages[:k], add_generation_prompt=True)`` and the text the template writes for the
turn, ``T_k = render(messages[:k+1])``, after that context. When ``T_k`` extends ``H_k``, the turn's
supervised text is ``T_k[len(H_k):]``. When the generation prompt holds a pre-filled scaffold that
the recorded turn does not repeat (``<think>\\n`` of DeepSeek-R1 distills and QwQ, or Qwen3's empty
think block under ``enable_thinking=false`` beside an answer that carries reasoning), the boundary
falls back to the common prefix of ``H_k`` and ``T_k``, which is valid only when the history
without the generation prompt, ``render(messages[:k])``, is a prefix of ``T_k``. When the history
itself renders differently once the turn follows (LFM2.5 keeps the reasoning of the last
assistant message only, so turn 1 in ``H_3`` keeps it and in ``T_3`` loses it), the sample is
``H_k`` followed by what ``T_k`` writes after its last assistant header (the generation prompt,
or its start up to a ``>`` or newline where the prompt pre-fills more, as an empty thinking
block the turn does not write), provided that text holds the answer: the engine's context
exactly, then the turn as the template writes it. Otherwise the turn cannot be placed and the
conversation is refused (``unrenderable``).

A template is prefix-stable for a conversation when every supervised turn's ``T_k`` is a prefix of
the whole conversation's render (history rendered as it was when the turn was generated). Then
the conversation is one sample, as before. Turns that break this (Qwen3 drops the think block of
earlier turns, so turn 1 as history differs from turn 1 as the last turn) each become a sample
of their own, ``T_k`` with its context; the turns that do not break it stay in the one sample of
the whole conversation. ``thinking`` is per turn: on for an answer that carries reasoning (the
model produced it thinking), ``data.thinking`` otherwise.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflash_trainer.data.render import THINK_CLOSE, ChatRenderer, RenderFailure, reasoning_of

HISTORY_DIFFERS = "history_differs"
"""Why a turn got a sample of its own: the template renders it differently as history."""


@dataclass(frozen=True)
class TurnText:
    """One sample's text: supervised character spans and the assistant message index of each."""

    text: str
    spans: list[tuple[int, int]]
    turns: list[int]
    whole: bool
    """The render of the whole conversation (False: a turn's own sample, ``T_k``)."""


@dataclass(kw_only=True)
class TurnPlan:
    """What one conversation becomes."""

    samples: list[TurnText] = field(default_factory=list)
    own_samples: int = 0
    """Turns that became a sample of their own (0: one sample for the conversation)."""
    reasoning_answers: int = 0
    """Supervised answers carrying reasoning (a field or an inline think block)."""
    reasoning_unrendered: int = 0
    """Of those, answers whose reasoning the template leaves out of their supervised text."""
    beyond: int = 0
    """Turns not rendered: their context, a prefix of the whole render, starts past ``cut_at``."""


def plan_turns(renderer: ChatRenderer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               *, supervised: list[int], thinking: bool, truncated: set[int] = frozenset(),
               cut_at: Callable[[str], int] | None = None) -> TurnPlan:
    """The samples of a (trimmed) conversation whose assistant messages ``supervised`` are trained
    on. ``truncated`` holds the assistant indices whose end of turn is not supervised. With
    ``cut_at`` (where a text is cut before tokenizing), a turn whose context is a prefix of the
    whole render reaching past the cut is not rendered further (:attr:`TurnPlan.beyond`): the
    whole sample is cut before it, and its own context is at least as long. Raises
    :class:`RenderFailure`."""
    plan = TurnPlan()
    prepared = renderer.engine_messages(messages, tools)
    think = {k: thinking or bool(reasoning_of(m)) for k, m in enumerate(messages) if m["role"] == "assistant"}
    plan.reasoning_answers = sum(bool(reasoning_of(messages[k])) for k in supervised)

    def render(upto: int, prompt: bool, k: int) -> str:
        return renderer.render(prepared[:upto], tools=tools, generation_prompt=prompt, thinking=think[k])

    last = len(messages) - 1
    full = render(len(messages), False, last)
    renderer.check_tools_rendered(prepared, full)
    whole = TurnText(full, [], [], True)
    own: list[TurnText] = []
    end = 0
    cut = cut_at(full) if cut_at is not None else len(full)
    for k in supervised:
        head = render(k, True, k)
        if len(head) >= cut and full.startswith(head):
            plan.beyond += 1
            continue
        rendered = full if k == last else render(k + 1, False, k)
        turn, start = _place(rendered, head, functools.partial(render, k, False, k), k, messages[k])
        stop = _content_stop(messages[k], turn, start) if k in truncated else len(turn)
        reasoning = reasoning_of(messages[k])
        plan.reasoning_unrendered += bool(reasoning) and reasoning not in turn[start:stop]
        if full.startswith(turn) and start >= end:
            whole.spans.append((start, stop))
            whole.turns.append(k)
            end = len(turn)
        else:
            own.append(TurnText(turn, [(start, stop)], [k], False))
    plan.samples = ([whole] if whole.spans else []) + own
    plan.own_samples = len(own)
    return plan


def _place(turn: str, head: str, history: Any, k: int, answer: dict[str, Any]) -> tuple[str, int]:
    """Turn ``k``'s sample text and where its supervised text starts (see the module docstring).

    ``turn`` is the template's render up to the turn, ``head`` its serving context,
    ``history()`` the render of the messages before it without the generation prompt, and
    ``answer`` the assistant message."""
    if turn.startswith(head):
        return turn, len(head)
    base = history()
    common = len(os.path.commonprefix([head, turn]))
    if turn.startswith(base) and head.startswith(base) and common >= len(base):
        return turn, common
    prompt = head[len(base):] if head.startswith(base) else ""
    for header in _headers(prompt):
        found = turn.rfind(header)
        written = turn[found + len(header):]
        if found >= 0 and _holds(written, answer):
            # The history renders differently once the turn follows (a template keeping the
            # reasoning of the last assistant message only), or the prompt pre-fills what the
            # turn does not write (an empty thinking block): the engine's context, then what
            # the template writes for the turn after its header.
            return head + written, len(head)
    raise RenderFailure("unrenderable", f"the chat template does not render assistant message {k} "
                        "as an extension of its context (neither the generation prompt nor the "
                        "history before it is a prefix of the turn, and the turn has no header "
                        "the generation prompt starts with)")


def _headers(prompt: str) -> list[str]:
    """Prefixes of a generation prompt that end after a ``>`` or a newline, longest first (the
    assistant header without what the prompt pre-fills after it)."""
    cuts = [i + 1 for i, c in enumerate(prompt) if c in ">\n" and prompt[:i + 1].strip()]
    return [prompt[:i] for i in sorted(set(cuts), reverse=True)]


def _holds(written: str, answer: dict[str, Any]) -> bool:
    """Whether a turn's text holds its answer's content and tool call names."""
    content = answer["content"].split(THINK_CLOSE)[-1].strip()
    names = [(c.get("function") or {}).get("name") or "" for c in answer.get("tool_calls") or []]
    return content in written and all(n in written for n in names)


def _content_stop(message: dict[str, Any], turn: str, start: int) -> int:
    """Where the content of a ``truncated`` answer ends inside its turn (its end of turn is no label)."""
    content = message["content"]
    # The first occurrence inside the turn: the template may trim the content, and the
    # end-of-turn suffix comes after it.
    found = [i + len(c) for c in dict.fromkeys((content, content.strip()))
             if c and (i := turn.find(c, start)) >= 0]
    if not found:
        raise RenderFailure("unrenderable", "an answer is marked truncated, but the chat template "
                            "does not render its content verbatim, so where it stops cannot be found; "
                            "remove the mark")
    return found[0]
