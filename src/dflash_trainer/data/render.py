"""Chat messages rendered the way an inference engine renders them for the target.

vLLM and SGLang render a chat request with the tokenizer's chat template. Before the template
sees the messages, the engine prepares them; :class:`ChatRenderer` does the same:

- a tool call's ``arguments`` given as a JSON string is parsed into an object (templates write
  ``arguments | tojson``), and a string that is not JSON makes the record malformed;
- the ``developer`` role becomes ``system`` when the template has no ``developer`` role;
- a reasoning field (``reasoning_content``) goes where the template reads it: kept as
  ``reasoning_content``, or renamed ``thinking`` / ``reasoning`` for templates reading those,
  or written inline as ``<think>\\n...\\n</think>\\n\\n`` before the content for templates that
  only split inline think blocks (QwQ, DeepSeek-R1 distills). A template that does not
  render it loses it: the answer is kept, and :mod:`~dflash_trainer.data.turns` counts it
  (``reasoning_unrendered``);
- a record with tool calls, tool messages or a ``tools`` list under a template that has no
  tool rendering is refused (``tools_unsupported``, the template named), as is a template that
  renders without error but leaves a tool call or tool result out of the text;
- whatever the template raises (``raise_exception``, undefined variables, type errors) refuses
  that one record (``unrenderable``) with the template's message; no record's exception
  escapes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from dflash_trainer.data.formats import TRUNCATED

RenderReason = Literal["malformed", "unrenderable", "tools_unsupported"]
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_READS_FIELD = {name: re.compile(rf"(\.{name}\b|\[['\"]{name}['\"]\])")
                for name in ("reasoning_content", "thinking", "reasoning")}


class RenderFailure(Exception):
    """One record that the template cannot render as the engine would (its reason counted)."""

    def __init__(self, reason: RenderReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class TemplateTraits:
    """What a chat template's source says it renders."""

    reasoning_field: str | None
    """The message key the template reads reasoning from (None: none)."""
    inline_think: bool
    """The template splits ``</think>`` out of the content (QwQ, DeepSeek-R1 distills)."""
    developer_role: bool
    tools: bool
    """The template renders tool calls (it reads ``tool_calls``)."""


def template_traits(template: str) -> TemplateTraits:
    """The traits of one chat template's source."""
    field_name = next((name for name, pattern in _READS_FIELD.items() if pattern.search(template)), None)
    return TemplateTraits(reasoning_field=field_name, inline_think=THINK_CLOSE in template,
                          developer_role="developer" in template, tools="tool_calls" in template)


def reasoning_of(message: dict[str, Any]) -> str:
    """The reasoning an assistant message carries: its reasoning field or its inline think block."""
    reasoning = message.get("reasoning_content") or ""
    if not reasoning and THINK_CLOSE in message.get("content", ""):
        reasoning = message["content"].split(THINK_CLOSE)[0].split(THINK_OPEN)[-1]
    return reasoning.strip()


def uses_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """Whether a conversation has tool calls, tool messages or a tools list."""
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


class ChatRenderer:
    """One chat template applied as an engine applies it (see the module docstring)."""

    def __init__(self, tokenizer: Any, template: str, *, name: str) -> None:
        self.template = template
        self.name = name
        self.traits = template_traits(template)
        self._special = dict(tokenizer.special_tokens_map)

    def engine_messages(self, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        """Messages as the engine hands them to the template. Raises :class:`RenderFailure`."""
        if uses_tools(messages, tools) and not self.traits.tools:
            raise RenderFailure("tools_unsupported", f"the chat template of {self.name} has no tool "
                                "rendering (it never reads tool_calls); this record has tool calls, "
                                "tool messages or a tools list")
        prepared = []
        for j, message in enumerate(messages):
            message = {k: v for k, v in message.items() if k != TRUNCATED}
            if message["role"] == "developer" and not self.traits.developer_role:
                message["role"] = "system"
            if message.get("tool_calls"):
                message["tool_calls"] = [_parsed_call(call, j) for call in message["tool_calls"]]
            reasoning = message.pop("reasoning_content", None)
            if reasoning:
                if self.traits.reasoning_field is not None:
                    message[self.traits.reasoning_field] = reasoning
                elif self.traits.inline_think and THINK_CLOSE not in message["content"]:
                    message["content"] = (f"{THINK_OPEN}\n{reasoning.strip(chr(10))}\n{THINK_CLOSE}\n\n"
                                          f"{message['content'].lstrip(chr(10))}")
            prepared.append(message)
        return prepared

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
               generation_prompt: bool, thinking: bool) -> str:
        """The template's text for ``messages`` (already :meth:`engine_messages`). Raises
        :class:`RenderFailure` with whatever the template raised."""
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, _ = render_jinja_template(
                conversations=[messages], tools=tools or None, chat_template=self.template,
                add_generation_prompt=generation_prompt, enable_thinking=thinking, **self._special)
        except Exception as exc:  # the template is foreign code: any error refuses this record only
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RenderFailure("unrenderable", f"the chat template of {self.name} fails on this "
                                f"record: {message}") from exc
        return rendered[0]

    def check_tools_rendered(self, messages: list[dict[str, Any]], text: str) -> None:
        """Refuse a render that silently leaves out a tool call or a tool result."""
        for message in messages:
            names = [(c.get("function") or c).get("name", "") for c in message.get("tool_calls") or []]
            missing = [n for n in names if n and n not in text]
            if message["role"] == "tool" and message["content"].strip() and message["content"].strip() not in text:
                missing.append("a tool result")
            if missing:
                raise RenderFailure("tools_unsupported", f"the chat template of {self.name} leaves "
                                    f"{', '.join(missing)} out of the rendered text (no tool rendering "
                                    "for this shape of message)")


def _parsed_call(call: Any, j: int) -> dict[str, Any]:
    """A tool call with JSON-string arguments parsed to an object, as vLLM does before rendering."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise RenderFailure("malformed", f"message {j}: a tool call must be "
                            "{\"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise RenderFailure("malformed", f"message {j}: tool call {function.get('name')!r} has "
                                f"arguments that are not JSON ({exc})") from exc
    return {**call, "function": function}
