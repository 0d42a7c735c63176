"""The one place where a raw record of any layout becomes a :class:`Conversation` (or a
pre-tokenized sample, or a located :class:`Rejected`).

Layouts, detected per record by their keys (first match) or required with ``data.format``:

=====================  =========================================================================
``messages``           OpenAI ``{"messages": [{"role", "content"}, ...], "tools"?}`` (also
                       UltraChat-200k and TRL conversational ``messages``)
``sharegpt``           ``{"conversations": [{"from", "value"}, ...], "system"?, "tools"?}``
``lmsys``              lmsys-chat ``{"conversation": [{"role", "content"}, ...]}``
``alpaca``             ``{"instruction", "input"?, "output", "system"?, "history"?}``
``prompt_completion``  TRL ``{"prompt", "completion"}``: two strings or two message lists
``ultrachat``          original UltraChat ``{"data": [question, answer, ...]}``
``tokenized``          ``{"input_ids", "loss_mask"}``
=====================  =========================================================================

``data.fields`` (:class:`~dflash_trainer.config.FieldsConfig`) maps any other layout: the key
holding the messages, the role and content keys, and role names. A message list may use
``role``/``content`` or ``from``/``value`` in any of the chat layouts.

What comes out (the contract with the renderer): OpenAI-style messages whose ``role`` is one of
system, developer, user, assistant, tool, and whose ``content`` is a string; an assistant message
may also have ``reasoning_content`` (a ``reasoning`` field is renamed to it), ``tool_calls``
(``[{"type": "function", "id"?, "function": {"name", "arguments"}}]``, arguments as the data gives
them) and ``truncated: true``; a tool message ``tool_call_id`` and ``name``. ShareGPT
``function_call`` turns become assistant ``tool_calls`` and ``observation`` turns ``tool``
messages. A record's ``tools`` (a list, or a JSON string of one) comes out as OpenAI function
definitions. Text content parts are joined with a newline, as vLLM and SGLang join them.

Nothing is lost without a count: any other message key, a non-text content part and a key of a
tool call that is not rendered are dropped and counted by name in ``drops`` (null values and
empty lists hold nothing and are not counted). A record that breaks the layout (a missing
field, an unknown role, a wrong type) is ``malformed``, with a message naming the message.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from dflash_trainer.config import FieldsConfig
from dflash_trainer.data.readers import Location, Rejected

ROLE_ALIASES = {
    "system": "system", "developer": "developer",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "tool": "tool", "function": "tool", "ipython": "tool", "observation": "tool",
}
"""Role names of the data -> role (``function`` is OpenAI's legacy tool result, ``ipython``
Llama 3.1's, ``observation`` ShareGPT's)."""
FUNCTION_CALL_ROLE = "function_call"
"""ShareGPT role of an assistant tool call (its value is ``{"name", "arguments"}`` as JSON)."""
CONTENT_PART_SEPARATOR = "\n"
"""Joins the text parts of one OpenAI ``content`` list (as vLLM and SGLang do)."""
TEXT_PART_TYPES = ("text", "input_text", "output_text")
TRUNCATED = "truncated"
"""Message key marking an assistant answer cut before the model ended its turn."""
REASONING = "reasoning_content"
"""The message key of an answer's reasoning (what Qwen3 / DeepSeek-R1 templates read)."""
INSTRUCTION_SEPARATOR = "\n\n"
"""Joins an Alpaca ``instruction`` and its ``input`` into one user message."""

Layout = Literal["messages", "sharegpt", "lmsys", "alpaca", "prompt_completion", "ultrachat",
                 "tokenized"]
Format = Literal["auto", "messages", "sharegpt", "lmsys", "alpaca", "prompt_completion", "ultrachat",
                 "tokenized", "hf"]
Drops = dict[str, int]
"""Dropped field name -> count."""


@dataclass(frozen=True)
class Conversation:
    """A chat: OpenAI-style messages (see the module docstring for the keys they may have) and
    the record's tool definitions, if any."""

    messages: list[dict[str, Any]]
    location: Location
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Tokenized:
    """A pre-tokenized sample."""

    input_ids: list[int]
    loss_mask: list[int]
    location: Location


Record = Conversation | Tokenized | Rejected


class _Malformed(Exception):
    pass


_LAYOUT_KEYS: dict[Layout, tuple[str, ...]] = {
    "messages": ("messages",), "sharegpt": ("conversations",), "lmsys": ("conversation",),
    "alpaca": ("instruction", "output"), "prompt_completion": ("prompt", "completion"),
    "ultrachat": ("data",), "tokenized": ("input_ids",),
}
"""The keys that identify each layout, in the order of detection."""
_LAYOUT_NAMES = {"messages": "OpenAI", "sharegpt": "ShareGPT", "lmsys": "lmsys",
                 "alpaca": "Alpaca", "prompt_completion": "TRL", "ultrachat": "UltraChat",
                 "tokenized": "pre-tokenized"}


_NO_FIELD_MAP = FieldsConfig()


@functools.cache
def _roles(names: tuple[str, ...]) -> dict[str, str]:
    """The role aliases with ``data.fields.roles`` (its ``NAME=ROLE`` entries) over them."""
    return {**ROLE_ALIASES, **FieldsConfig(roles=list(names)).role_map()}


def detect_layout(raw: dict[str, Any], required: Layout | None = None) -> Layout | None:
    """The first layout whose keys ``raw`` has (only ``required``, when given), or None. A null
    value is no key: a Parquet or Arrow file holding several layouts has every layout's columns,
    null where a row lacks one."""
    return next((layout for layout, keys in _LAYOUT_KEYS.items()
                 if layout == (required or layout) and all(raw.get(k) is not None for k in keys)), None)


def normalize_record(raw: Any, location: Location, format: Format = "auto", *,
                     fields: FieldsConfig | None = None, drops: Drops | None = None) -> Record:
    """One raw record as a :class:`Conversation`, :class:`Tokenized` or :class:`Rejected`.

    ``format`` requires a layout (``auto``/``hf`` detect it); ``fields`` is ``data.fields``;
    the names of the fields left out of a record that is not rejected are counted in ``drops``.
    """
    if not isinstance(raw, dict):
        return Rejected("malformed", f"expected a JSON object, got {type(raw).__name__}", location)
    fields = fields or _NO_FIELD_MAP
    roles = _roles(tuple(fields.roles))
    found: Drops = {}
    try:
        if fields.messages is not None:
            if raw.get(fields.messages) is None:
                return Rejected("malformed", f"no {fields.messages!r} field (data.fields.messages); "
                                f"record keys: {sorted(raw)}", location)
            messages = _messages(raw[fields.messages], roles, found,
                                 role_key=fields.role, content_key=fields.content)
        else:
            detected = detect_layout(raw, None if format in ("auto", "hf") else format)  # type: ignore[arg-type]
            if detected is None and format not in ("auto", "hf"):
                wanted = _LAYOUT_KEYS[format]  # type: ignore[index]
                return Rejected("malformed", f"no {' and '.join(map(repr, wanted))} field"
                                f"{'s' if len(wanted) > 1 else ''} (data.format={format}); "
                                f"record keys: {sorted(raw)}", location)
            if detected is None:
                return Rejected("malformed", _no_layout(raw), location)
            if detected == "tokenized":
                return _tokenized(raw, location)
            messages = _ADAPTERS[detected](raw, roles, found)
        messages = _with_system(raw, messages, found)
        tools = _tools(raw.get("tools"))
    except _Malformed as exc:
        return Rejected("malformed", str(exc), location)
    if not messages:
        return Rejected("empty", "conversation has no messages", location)
    if drops is not None:
        for name, count in found.items():
            drops[name] = drops.get(name, 0) + count
    return Conversation(messages, location, tools)


def _no_layout(raw: dict[str, Any]) -> str:
    known = ", ".join(f"{'+'.join(map(repr, keys))} ({_LAYOUT_NAMES[layout]})"
                      for layout, keys in _LAYOUT_KEYS.items())
    return (f"record matches no layout: it has none of the fields {known}; keys: {sorted(raw)}; "
            "map its fields with data.fields (see docs/data.md)")


# --- layouts ------------------------------------------------------------------------------------

def _openai(raw: dict[str, Any], roles: dict[str, str], drops: Drops) -> list[dict[str, Any]]:
    return _messages(raw["messages"], roles, drops, keys=("role", "content"))


def _sharegpt(raw: dict[str, Any], roles: dict[str, str], drops: Drops) -> list[dict[str, Any]]:
    return _messages(raw["conversations"], roles, drops, keys=("from", "value"))


def _lmsys(raw: dict[str, Any], roles: dict[str, str], drops: Drops) -> list[dict[str, Any]]:
    return _messages(raw["conversation"], roles, drops, keys=("role", "content"))


def _alpaca(raw: dict[str, Any], roles: dict[str, str], drops: Drops) -> list[dict[str, Any]]:
    instruction, extra, output = raw["instruction"], raw.get("input"), raw["output"]
    for key, value in (("instruction", instruction), ("output", output), ("input", extra)):
        if not isinstance(value, str) and not (key == "input" and value is None):
            raise _Malformed(f"Alpaca {key!r} must be a string, got {type(value).__name__}")
    prompt = instruction + (INSTRUCTION_SEPARATOR + extra if extra and extra.strip() else "")
    history = raw.get("history") or []
    if not (isinstance(history, list) and all(isinstance(pair, list) and len(pair) == 2
                                              and all(isinstance(t, str) for t in pair) for pair in history)):
        raise _Malformed("Alpaca 'history' must be a list of [question, answer] string pairs")
    turns = [text for pair in history for text in pair] + [prompt, output]
    return _alternating(turns)


def _prompt_completion(raw: dict[str, Any], roles: dict[str, str], drops: Drops) -> list[dict[str, Any]]:
    prompt, completion = raw["prompt"], raw["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return _alternating([prompt, completion])
    if isinstance(prompt, list) and isinstance(completion, list):
        return (_messages(prompt, roles, drops, keys=("role", "content"))
                + _messages(completion, roles, drops, keys=("role", "content"), first=len(prompt)))
    raise _Malformed("TRL 'prompt' and 'completion' must both be strings or both be lists of messages, "
                     f"got {type(prompt).__name__} and {type(completion).__name__}")


def _ultrachat(raw: dict[str, Any], roles: dict[str, str], drops: Drops) -> list[dict[str, Any]]:
    turns = raw["data"]
    if not (isinstance(turns, list) and all(isinstance(t, str) for t in turns)):
        raise _Malformed("UltraChat 'data' must be a list of strings (question, answer, ...)")
    return _alternating(turns)


def _alternating(turns: list[str]) -> list[dict[str, Any]]:
    """User and assistant messages taking turns, the user first."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(turns)]


_ADAPTERS: dict[Layout, Callable[[dict[str, Any], dict[str, str], Drops], list[dict[str, Any]]]] = {
    "messages": _openai, "sharegpt": _sharegpt, "lmsys": _lmsys, "alpaca": _alpaca,
    "prompt_completion": _prompt_completion, "ultrachat": _ultrachat,
}


def _with_system(raw: dict[str, Any], messages: list[dict[str, Any]], drops: Drops) -> list[dict[str, Any]]:
    """A record-level ``system`` string (Alpaca, LLaMA-Factory's ShareGPT) as the first message;
    counted as dropped when the conversation already starts with a system message."""
    system = raw.get("system")
    if system is None or system == "":
        return messages
    if not isinstance(system, str):
        raise _Malformed(f"'system' must be a string, got {type(system).__name__}")
    if messages and messages[0]["role"] in ("system", "developer"):
        _count(drops, "system (record)")
        return messages
    return [{"role": "system", "content": system}, *messages]


# --- messages -----------------------------------------------------------------------------------

_PAIRS = (("role", "content"), ("from", "value"))


def _keys_of(turns: list[Any], preferred: tuple[str, str]) -> tuple[str, str]:
    """``preferred`` unless the messages use the other pair's role key and never the preferred one."""
    other = _PAIRS[1] if preferred == _PAIRS[0] else _PAIRS[0]
    dicts = [t for t in turns if isinstance(t, dict)]
    if any(other[0] in t for t in dicts) and not any(preferred[0] in t for t in dicts):
        return other
    return preferred


def _messages(turns: Any, roles: dict[str, str], drops: Drops, *, keys: tuple[str, str] | None = None,
              role_key: str | None = None, content_key: str | None = None,
              first: int = 0) -> list[dict[str, Any]]:
    """A list of raw messages as contract messages; ``keys`` the preferred (role, content) keys
    (the other pair is used where the messages have it instead); numbering starts at ``first``."""
    if not isinstance(turns, list):
        raise _Malformed(f"expected a list of messages, got {type(turns).__name__}")
    if role_key is None or content_key is None:
        detected = _keys_of(turns, keys or _PAIRS[0])
        role_key, content_key = role_key or detected[0], content_key or detected[1]
    messages: list[dict[str, Any]] = []
    for j, turn in enumerate(turns, start=first):
        if not isinstance(turn, dict):
            raise _Malformed(f"message {j}: expected an object, got {type(turn).__name__}")
        if role_key not in turn:
            raise _Malformed(f"message {j}: missing field {role_key!r} (has {sorted(turn)})")
        name = str(turn[role_key]).strip().lower()
        if roles.get(name, name) == FUNCTION_CALL_ROLE:
            _function_call_turn(turn, j, content_key, messages, drops, role_key)
            continue
        role = roles.get(name)
        if role is None:
            raise _Malformed(f"message {j}: unknown role {turn[role_key]!r}; accepted: "
                             f"{', '.join([*roles, FUNCTION_CALL_ROLE])} (map others with data.fields.roles)")
        messages.append(_message(turn, j, role, role_key, content_key, drops))
    return messages


def _message(turn: dict[str, Any], j: int, role: str, role_key: str, content_key: str,
             drops: Drops) -> dict[str, Any]:
    if len(turn) == 2 and isinstance(turn.get(content_key), str):
        return {"role": role, "content": turn[content_key]}  # the common case: nothing else to read
    calls = _tool_calls(turn, j, drops) if role == "assistant" else []
    if content_key not in turn and not calls:
        raise _Malformed(f"message {j}: missing field {content_key!r} (has {sorted(turn)})")
    content = turn.get(content_key)
    if content is None and role == "assistant":
        content = ""  # OpenAI writes null beside tool_calls
    message: dict[str, Any] = {"role": role, "content": _content(content, j, drops)}
    used = {role_key, content_key}
    if role == "assistant":
        used |= {"tool_calls", "function_call"}
        reasoning = _reasoning(turn, j, drops)
        if reasoning is not None:
            message[REASONING] = reasoning
        used |= {REASONING, "reasoning"}
        if calls:
            message["tool_calls"] = calls
    if role == "tool":
        for key in ("tool_call_id", "name"):
            value = turn.get(key)
            if value is not None:
                if not isinstance(value, str):
                    raise _Malformed(f"message {j}: {key!r} must be a string, got {type(value).__name__}")
                message[key] = value
            used.add(key)
    cut = turn.get(TRUNCATED, False)
    if not isinstance(cut, bool):
        raise _Malformed(f"message {j}: {TRUNCATED!r} must be true or false, got {cut!r}")
    if cut:
        if role != "assistant":
            raise _Malformed(f"message {j}: only assistant messages can be {TRUNCATED!r} "
                             f"(this one is {role!r})")
        message[TRUNCATED] = True
    used.add(TRUNCATED)
    for key, value in turn.items():
        if key not in used and not _holds_nothing(value):
            _count(drops, key)
    return message


def _holds_nothing(value: Any) -> bool:
    return value is None or value == [] or value == {}


def _count(drops: Drops, name: str) -> None:
    drops[name] = drops.get(name, 0) + 1


def _content(value: Any, j: int, drops: Drops) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            kind = part.get("type", "text") if isinstance(part, dict) else None
            if kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, dict) and isinstance(kind, str) and kind not in TEXT_PART_TYPES:
                _count(drops, f"content part {kind}")  # an image, audio, file: no text to train on
            else:
                raise _Malformed(f"message {j}: a content part must be an object with a 'type' "
                                 f"(text parts with a string 'text'), got {part!r:.60}")
        return CONTENT_PART_SEPARATOR.join(texts)
    raise _Malformed(f"message {j}: content must be a string, got {type(value).__name__}")


def _reasoning(turn: dict[str, Any], j: int, drops: Drops) -> str | None:
    """The answer's reasoning: ``reasoning_content``, else ``reasoning`` (counted as dropped when
    both are given and differ)."""
    values = {key: turn.get(key) for key in (REASONING, "reasoning")}
    for key, value in values.items():
        if value is not None and not isinstance(value, str):
            raise _Malformed(f"message {j}: {key!r} must be a string, got {type(value).__name__}")
    chosen, other = values[REASONING], values["reasoning"]
    if chosen is None:
        return other
    if other is not None and other != chosen:
        _count(drops, "reasoning")
    return chosen


def _tool_calls(turn: dict[str, Any], j: int, drops: Drops) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` plus its legacy OpenAI ``function_call``."""
    calls = turn.get("tool_calls")
    if calls is None:
        calls = []
    if not isinstance(calls, list):
        raise _Malformed(f"message {j}: 'tool_calls' must be a list, got {type(calls).__name__}")
    legacy = turn.get("function_call")
    if legacy is not None:
        calls = [*calls, {"type": "function", "function": legacy}]
    return [_tool_call(call, j, i, drops) for i, call in enumerate(calls)]


def _tool_call(call: Any, j: int, i: int, drops: Drops) -> dict[str, Any]:
    """One tool call as ``{"type": "function", "id"?, "function": {"name", "arguments"}}``;
    a flat ``{"name", "arguments"}`` (as ShareGPT writes it) is accepted too."""
    where = f"message {j}: tool call {i}"
    if not isinstance(call, dict):
        raise _Malformed(f"{where}: expected an object, got {type(call).__name__}")
    flat = "function" not in call
    function = call if flat else call["function"]
    if call.get("type", "function") != "function" and not flat:
        raise _Malformed(f"{where}: type {call.get('type')!r} is not a function call")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise _Malformed(f"{where}: needs a function name ({{'function': {{'name': ..., 'arguments': ...}}}})")
    arguments = function.get("arguments")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, (str, dict)):
        raise _Malformed(f"{where}: 'arguments' must be a JSON string or an object, got "
                         f"{type(arguments).__name__}")
    out: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    ident = call.get("id")
    if ident is not None:
        if not isinstance(ident, str):
            raise _Malformed(f"{where}: 'id' must be a string, got {type(ident).__name__}")
        out["id"] = ident
    for key, value in function.items():
        if key not in ("name", "arguments", "id", "type") and not _holds_nothing(value):
            _count(drops, f"tool_calls.function.{key}" if not flat else f"tool_calls.{key}")
    if not flat:
        for key, value in call.items():
            if key not in ("type", "id", "function") and not _holds_nothing(value):
                _count(drops, f"tool_calls.{key}")
    return out


def _function_call_turn(turn: dict[str, Any], j: int, content_key: str, messages: list[dict[str, Any]],
                        drops: Drops, role_key: str) -> None:
    """A ShareGPT ``function_call`` turn: its JSON value (one call or a list of parallel calls)
    becomes ``tool_calls`` of the assistant message right before it, or of a new one."""
    value = turn.get(content_key)
    try:
        parsed = json.loads(value) if isinstance(value, str) else value
    except ValueError as exc:
        raise _Malformed(f"message {j}: the function_call value is not JSON ({exc}); expected "
                         '{"name": ..., "arguments": ...}') from exc
    calls = parsed if isinstance(parsed, list) else [parsed]
    if not calls or not all(isinstance(c, dict) for c in calls):
        raise _Malformed(f"message {j}: the function_call value must be a JSON object "
                         '{"name": ..., "arguments": ...} or a list of them')
    converted = [_tool_call(c, j, i, drops) for i, c in enumerate(calls)]
    for key, extra in turn.items():
        if key not in (role_key, content_key) and not _holds_nothing(extra):
            _count(drops, key)
    if messages and messages[-1]["role"] == "assistant" and not messages[-1].get(TRUNCATED):
        messages[-1].setdefault("tool_calls", []).extend(converted)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": converted})


# --- tools and pre-tokenized records ------------------------------------------------------------

def _tools(value: Any) -> list[dict[str, Any]] | None:
    """A record's tool definitions as OpenAI ``{"type": "function", "function": {...}}`` objects
    (a bare ``{"name", "parameters"}`` is wrapped); a JSON string is parsed; none or empty: None."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise _Malformed(f"'tools' is a string but not JSON ({exc}); expected a list of function "
                             "definitions") from exc
        if value is None or value == []:
            return None
    if not isinstance(value, list):
        raise _Malformed(f"'tools' must be a list of function definitions, got {type(value).__name__}")
    tools = []
    for i, tool in enumerate(value):
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            tools.append(tool)
        elif isinstance(tool, dict) and isinstance(tool.get("name"), str):
            tools.append({"type": "function", "function": tool})
        else:
            raise _Malformed(f"tools[{i}]: expected a function definition ({{'name', 'description', "
                             "'parameters'}, or {'type': 'function', 'function': {...}})")
    return tools


def _tokenized(raw: dict[str, Any], location: Location) -> Record:
    ids, mask = raw.get("input_ids"), raw.get("loss_mask")
    if mask is None:
        raise _Malformed("pre-tokenized record has 'input_ids' but no 'loss_mask'")
    if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                         and i >= 0 for i in ids)):
        raise _Malformed("'input_ids' must be a list of non-negative integers")
    if not (isinstance(mask, list) and all(m in (0, 1) for m in mask)):
        raise _Malformed("'loss_mask' must be a list of 0/1 values")
    if len(ids) != len(mask):
        raise _Malformed(f"'input_ids' has {len(ids)} tokens but 'loss_mask' {len(mask)}")
    if not ids:
        return Rejected("empty", "pre-tokenized record has no tokens", location)
    return Tokenized([int(i) for i in ids], [int(m) for m in mask], location)


def drop_leading_assistant(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """``messages`` without the assistant messages before the first user message (they answer
    no prompt), and how many were removed; without a user message every assistant one goes."""
    roles = [m["role"] for m in messages]
    first_user = roles.index("user") if "user" in roles else len(roles)
    kept = [m for i, m in enumerate(messages) if i >= first_user or m["role"] != "assistant"]
    return kept, len(messages) - len(kept)
