"""Conversations to token ids plus an assistant-only loss mask, with the target's chat template.

The supervised text of an assistant turn is everything the template emits for that turn after
its assistant header, up to where the next turn starts. For ChatML (SmolLM2, Qwen) that is
``content<|im_end|>\\n``: the end-of-turn token is supervised (the drafter must learn to end a
turn) and so is the newline the template writes after it, since the template emits it as part of
the turn; the header ``<|im_start|>assistant\\n`` is not. A token counts as supervised when its
characters overlap a supervised span (the rule of transformers' ``return_assistant_tokens_mask``).

The spans come from the template itself:

- templates with ``{% generation %}`` markers: the marked blocks;
- otherwise prefix renders: for assistant turn ``k``,
  ``render(messages[:k], add_generation_prompt)`` is the text up to the end of the header and
  ``render(messages[:k+1])`` the text up to the end
  of the turn. Every such prefix must be a prefix of the full rendering (so the pieces
  concatenate to it); when a template renders history differently from the generation prompt
  (Qwen3 drops earlier ``<think>`` blocks), this fails and the conversation is refused with a
  :class:`TemplateError` rather than trained on a wrong mask. ``data.last_turn_only`` needs only
  the last turn's prefix, which such templates do satisfy.

An assistant message marked ``"truncated": true`` (an answer cut before the model ended its turn,
as ``regenerate`` marks answers that hit ``--max-new-tokens``) is supervised only up to the end
of its content: the end-of-turn token the template appends would be a false label there.

Before rendering, assistant messages before the first user message are removed (there is no
prompt they answer; counted as ``trimmed_leading``) and messages after the last assistant turn
are dropped (they carry no supervision).

An empty or whitespace-only assistant answer would teach the drafter to end the turn at once
(``regenerate`` fails such answers too). A conversation whose every supervised answer is empty
is dropped (``empty_answer``); one where only some are empty keeps them as context but leaves
them unsupervised, end-of-turn tokens included (counted as ``empty_answers``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from dflash_trainer.data.formats import (
    TRUNCATED,
    Conversation,
    DataError,
    Location,
    Tokenized,
    drop_leading_assistant,
)
from dflash_trainer.core.errors import TargetError

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_CHARS_PER_TOKEN = 6
"""Character budget per token when rendering long conversations (English averages ~4)."""

DropReason = Literal["malformed", "no_assistant", "empty_answer", "too_short", "too_long"]
RULES_VERSION = 2
"""Changes when the same conversation, tokenizer and options give other samples (2: empty
answers dropped or unsupervised); part of the token store's key, so older stores are rebuilt."""


class TemplateError(DataError):
    """The chat template cannot give a verified assistant mask (or there is none)."""


@dataclass(kw_only=True, frozen=True)
class TokenizeOptions:
    """How conversations become samples (the ``data.*`` options that affect tokens)."""

    max_length: int = 3072
    on_too_long: Literal["truncate", "drop"] = "truncate"
    min_supervised_tokens: int = 2
    thinking: bool = False
    last_turn_only: bool = False

    @classmethod
    def from_config(cls, cfg: Any) -> TokenizeOptions:
        """Options of a :class:`dflash_trainer.config.Config`."""
        return cls(max_length=cfg.data.max_length, on_too_long=cfg.data.on_too_long,
                   min_supervised_tokens=cfg.data.min_supervised_tokens, thinking=cfg.data.thinking,
                   last_turn_only=cfg.data.last_turn_only)


@dataclass(frozen=True)
class Encoded:
    """A training sample: ``input_ids`` (int32) and ``loss_mask`` (uint8, 1 = supervised)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    truncated: bool = False
    trimmed_leading: int = 0
    """Assistant messages removed before the first user message."""
    cut_answers: int = 0
    """Assistant messages marked ``truncated`` (their end of turn is not supervised)."""
    empty_answers: int = 0
    """Empty or whitespace-only assistant answers left unsupervised."""


@dataclass(frozen=True)
class Dropped:
    """A sample left out of training, with the reason counted in the statistics."""

    reason: DropReason
    message: str


class ChatTokenizer:
    """Encodes conversations with one tokenizer's chat template under fixed options."""

    def __init__(self, tokenizer: Any, options: TokenizeOptions) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise TemplateError(f"tokenizer {type(tokenizer).__name__} is not a fast (Rust) "
                                "tokenizer; character offsets are needed for the loss mask")
        self.tokenizer = tokenizer
        self.options = options
        try:
            self.template: str | None = tokenizer.get_chat_template()
        except ValueError:
            self.template = None
        self.vocab_size = len(tokenizer)
        # A private copy of the Rust tokenizer: no truncation/padding state shared with callers,
        # and no conversion of every encoding to Python lists.
        from tokenizers import Tokenizer

        self._backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        self._backend.no_truncation()
        self._backend.no_padding()
        # Added tokens split the text before tokenization, so text can be cut right before one
        # without changing the ids before it (unless the token strips whitespace to its left).
        literal = self.template or ""
        self._split_tokens = [t.content for t in tokenizer.added_tokens_decoder.values()
                              if not t.lstrip and t.content.strip() and t.content in literal]

    @property
    def mode(self) -> Literal["generation", "prefix", "none"]:
        """How assistant spans are found: template markers, prefix renders, or no template."""
        if self.template is None:
            return "none"
        return "generation" if _GENERATION_TAG.search(self.template) else "prefix"

    @property
    def supports_thinking(self) -> bool:
        """Whether the template reads ``enable_thinking`` (so ``data.thinking`` has an effect)."""
        return reads_enable_thinking(self.template)

    def _render(self, messages: list[dict[str, Any]], *, generation_prompt: bool,
                with_spans: bool = False) -> tuple[str, list[tuple[int, int]]]:
        from transformers.utils.chat_template_utils import render_jinja_template

        kwargs = {**self.tokenizer.special_tokens_map, "enable_thinking": self.options.thinking}
        rendered, indices = render_jinja_template(
            conversations=[messages], chat_template=self.template,
            return_assistant_tokens_mask=with_spans, add_generation_prompt=generation_prompt,
            **kwargs)
        return rendered[0], ([tuple(s) for s in indices[0]] if with_spans else [])

    def render(self, messages: list[dict[str, Any]], location: Location | None = None, *,
               max_chars: int | None = None) -> tuple[str, list[tuple[int, int]]]:
        """Text of a (trimmed) conversation and its supervised character spans.

        With ``max_chars``, the text is cut at the first template control token at or after
        that many characters, and turns after the cut are not rendered. Control tokens are
        tokenized on their own, so the ids of the cut text are exactly a prefix of the ids of
        the full text.
        """
        text, spans, _ = self._render_spans(messages, location, max_chars)
        return text, spans

    def _render_spans(self, messages: list[dict[str, Any]], location: Location | None,
                      max_chars: int | None) -> tuple[str, list[tuple[int, int]], bool]:
        """:meth:`render` plus whether the text was cut."""
        where = f"{location}: " if location is not None else ""
        if self.template is None:
            name = getattr(self.tokenizer, "name_or_path", "?")
            raise TemplateError(
                f"{where}the tokenizer ({name}) has no chat template, so conversations cannot be rendered; "
                f"use a model folder whose tokenizer "
                "has one (chat_template.jinja or tokenizer_config.json), or pre-tokenized data")
        assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        last = assistant[-1]
        if self.mode == "generation":
            text, spans = self._render(messages, generation_prompt=False, with_spans=True)
            spans = self._clip_cut_answers(messages, text, spans, where)
            spans = self._drop_empty_answers(messages, spans, where)
            if self.options.last_turn_only:
                head, _ = self._render(messages[:last], generation_prompt=True)
                if not text.startswith(head):
                    raise TemplateError(f"{where}the chat template renders the history before the "
                                        "last assistant turn differently from the full chat")
                spans = [s for s in spans if s[1] > len(head)]
            cut = self._cut_point(text, max_chars)
            return text[:cut], [(a, min(b, cut)) for a, b in spans if a < cut], cut < len(text)
        text, _ = self._render(messages, generation_prompt=False)
        cut = self._cut_point(text, max_chars)
        spans: list[tuple[int, int]] = []
        end = 0
        for k in ([last] if self.options.last_turn_only else assistant):
            head, _ = self._render(messages[:k], generation_prompt=True)
            if len(head) >= cut:
                break  # this turn and later ones are beyond the cut
            turn = text if k == last else self._render(messages[:k + 1], generation_prompt=False)[0]
            if not (len(head) >= end and text.startswith(head) and text.startswith(turn)
                    and turn.startswith(head)):
                raise TemplateError(
                    f"{where}the chat template does not render assistant turn {k} as a prefix of "
                    "the full chat (it renders history differently from a new turn, e.g. by "
                    "dropping earlier <think> blocks), so the assistant mask cannot be verified. "
                    "Set data.last_turn_only=true, or use a template with {% generation %} markers")
            end = len(turn)
            if is_empty_answer(messages[k]):
                continue
            stop = len(turn)
            if messages[k].get(TRUNCATED):
                stop = _content_stop(messages[k], k, text, len(head), stop, where)
            spans.append((len(head), min(stop, cut)))
        return text[:cut], [(a, b) for a, b in spans if a < b], cut < len(text)

    def _clip_cut_answers(self, messages: list[dict[str, Any]], text: str,
                          spans: list[tuple[int, int]], where: str) -> list[tuple[int, int]]:
        """End the supervised span of each ``truncated`` answer where its content ends.

        ``spans`` holds one span per assistant message, in order (before any is left out)."""
        assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if not any(messages[k].get(TRUNCATED) for k in assistant):
            return spans
        if len(spans) != len(assistant):
            raise TemplateError(
                f"{where}the chat template marks {len(spans)} assistant spans for {len(assistant)} "
                "assistant turns, so the turns marked truncated cannot be found; remove the marks")
        return [(a, _content_stop(messages[k], k, text, a, b, where) if messages[k].get(TRUNCATED) else b)
                for k, (a, b) in zip(assistant, spans)]

    def _drop_empty_answers(self, messages: list[dict[str, Any]], spans: list[tuple[int, int]],
                            where: str) -> list[tuple[int, int]]:
        """``spans`` without those of empty answers (one span per assistant message, in order)."""
        assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if not any(is_empty_answer(messages[k]) for k in assistant):
            return spans
        if len(spans) != len(assistant):
            raise TemplateError(
                f"{where}the chat template marks {len(spans)} assistant spans for {len(assistant)} "
                "assistant turns, so the empty answers cannot be left unsupervised; remove them")
        return [span for k, span in zip(assistant, spans) if not is_empty_answer(messages[k])]

    def _cut_point(self, text: str, max_chars: int | None) -> int:
        if max_chars is None or len(text) <= max_chars:
            return len(text)
        found = [i for t in self._split_tokens if (i := text.find(t, max_chars)) >= 0]
        return min(found) if found else len(text)

    def encode_batch(self, records: Sequence[Conversation | Tokenized]) -> list[Encoded | Dropped]:
        """Encode records in order; conversations are tokenized in one batched call.

        Long conversations are first rendered only up to ``_CHARS_PER_TOKEN * max_length``
        characters (see :meth:`render`); the few whose cut text has too few tokens are rendered
        and tokenized again in full.
        """
        results: list[Encoded | Dropped | None] = [None] * len(records)
        todo: list[tuple[int, list[dict[str, Any]], int]] = []
        for i, record in enumerate(records):
            if isinstance(record, Tokenized):
                results[i] = self._from_tokenized(record)
                continue
            messages, trimmed = trim_conversation(record.messages)
            if not any(m["role"] == "assistant" for m in messages):
                results[i] = Dropped("no_assistant", f"{record.location}: no assistant turn "
                                     "after a user turn")
                continue
            if all(is_empty_answer(m) for m in self._supervised_answers(messages)):
                which = "the last assistant answer (data.last_turn_only)" if self.options.last_turn_only \
                    else "every assistant answer"
                results[i] = Dropped("empty_answer", f"{record.location}: {which} is empty or whitespace "
                                     "(it would teach the drafter to end the turn at once)")
                continue
            todo.append((i, messages, trimmed))
        budget = _CHARS_PER_TOKEN * self.options.max_length
        again = []
        for (i, messages, trimmed), (ids, mask, was_cut) in zip(
                todo, self._tokenize([(m, records[i].location) for i, m, _ in todo], budget)):
            if was_cut and len(ids) <= self.options.max_length:
                again.append((i, messages, trimmed))
                continue
            results[i] = self._finish(ids, mask, trimmed, records[i].location, was_cut, messages)
        for (i, messages, trimmed), (ids, mask, _) in zip(
                again, self._tokenize([(m, records[i].location) for i, m, _ in again], None)):
            results[i] = self._finish(ids, mask, trimmed, records[i].location, False, messages)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _supervised_answers(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The assistant messages whose turns are supervised (the last only with last_turn_only)."""
        answers = [m for m in messages if m["role"] == "assistant"]
        return answers[-1:] if self.options.last_turn_only else answers

    def _tokenize(self, items: list[tuple[list[dict[str, Any]], Location]], max_chars: int | None
                  ) -> list[tuple[np.ndarray, np.ndarray, bool]]:
        """(ids, mask, text was cut) per conversation, tokenized in one batch."""
        if not items:
            return []
        texts, all_spans, cut = [], [], []
        for messages, location in items:
            text, spans, was_cut = self._render_spans(messages, location, max_chars)
            texts.append(text)
            all_spans.append(spans)
            cut.append(was_cut)
        out = []
        encodings = self._backend.encode_batch(texts, add_special_tokens=False)
        for encoding, spans, was_cut in zip(encodings, all_spans, cut):
            ids = np.asarray(encoding.ids, dtype=np.int32)
            offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
            mask = np.zeros(len(ids), dtype=bool)
            for start, stop in spans:
                mask |= (offsets[:, 1] > start) & (offsets[:, 0] < stop)
            out.append((ids, mask.astype(np.uint8), was_cut))
        return out

    def encode(self, record: Conversation | Tokenized) -> Encoded | Dropped:
        """Encode one record (see :meth:`encode_batch`)."""
        return self.encode_batch([record])[0]

    def _from_tokenized(self, record: Tokenized) -> Encoded | Dropped:
        ids = np.asarray(record.input_ids, dtype=np.int64)
        if ids.size and int(ids.max()) >= self.vocab_size:
            return Dropped("malformed", f"{record.location}: token id {int(ids.max())} is outside "
                           f"the tokenizer's vocabulary (size {self.vocab_size})")
        return self._finish(ids.astype(np.int32), np.asarray(record.loss_mask, dtype=np.uint8),
                            0, record.location, False)

    def _finish(self, ids: np.ndarray, mask: np.ndarray, trimmed: int, location: Location,
                was_cut: bool, messages: list[dict[str, Any]] = ()) -> Encoded | Dropped:
        opts = self.options
        truncated = False
        if len(ids) > opts.max_length:
            if opts.on_too_long == "drop":
                count = f"more than {opts.max_length}" if was_cut else str(len(ids))
                return Dropped("too_long", f"{location}: {count} tokens > data.max_length "
                               f"{opts.max_length} (data.on_too_long=drop)")
            ids, mask, truncated = ids[:opts.max_length], mask[:opts.max_length], True
        supervised = int(mask.sum())
        if supervised < opts.min_supervised_tokens:
            after = f" after truncation to {opts.max_length} tokens" if truncated else ""
            return Dropped("too_short", f"{location}: {supervised} supervised tokens{after} < "
                           f"data.min_supervised_tokens {opts.min_supervised_tokens}")
        answers = self._supervised_answers(list(messages)) if messages else []
        return Encoded(np.ascontiguousarray(ids), np.ascontiguousarray(mask), truncated, trimmed,
                       sum(bool(m.get(TRUNCATED)) for m in messages),
                       sum(is_empty_answer(m) for m in answers))


def _content_stop(message: dict[str, Any], k: int, text: str, start: int, stop: int,
                  where: str) -> int:
    """Where the content of assistant message ``k`` ends inside its turn ``text[start:stop]``."""
    content = message["content"]
    # The first occurrence inside the turn: the template may trim the content, and the
    # end-of-turn suffix comes after it.
    found = [i + len(c) for c in dict.fromkeys((content, content.strip()))
             if (i := text.find(c, start, stop)) >= 0]
    if not found:
        raise TemplateError(
            f"{where}assistant turn {k} is marked truncated, but the chat template does not render "
            "its content verbatim, so where the answer stops cannot be found; remove the mark")
    return found[0]


def is_empty_answer(message: dict[str, Any]) -> bool:
    """Whether an assistant message's content is empty or whitespace only."""
    return message["role"] == "assistant" and not message["content"].strip()


def reads_enable_thinking(template: str | dict[str, str] | None) -> bool:
    """Whether a chat template (or a dict of named templates) reads the ``enable_thinking``
    switch, so that ``data.thinking`` changes what it renders."""
    if isinstance(template, dict):
        template = " ".join(template.values())
    return bool(template) and "enable_thinking" in template


def render_prompt(tokenizer: Any, messages: list[dict[str, str]], *, thinking: bool = False) -> list[int]:
    """Token ids of a chat ending with the assistant generation prompt (the training template)."""
    if not getattr(tokenizer, "chat_template", None):
        raise TargetError(f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template, "
                        "so prompts cannot be rendered; use a target folder whose tokenizer has one")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=thinking)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def trim_conversation(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Remove assistant messages before the first user message and every message after the
    last assistant one; returns the messages and how many leading assistant ones were removed."""
    kept, trimmed = drop_leading_assistant(messages)
    while kept and kept[-1]["role"] != "assistant":
        kept.pop()
    return kept, trimmed


def end_of_turn_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """Token ids that end an assistant turn: the tokenizer's and generation config's eos ids,
    plus the special token the chat template writes right after an assistant message
    (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ...)."""
    ids: list[int] = []

    def add(value: Any) -> None:
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if v is not None and int(v) not in ids:
                ids.append(int(v))

    add(getattr(tokenizer, "eos_token_id", None))
    if generation_config is not None:
        add(getattr(generation_config, "eos_token_id", None))
    marker = "XQZJ-end-of-turn-probe"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False)
    except (ValueError, TypeError, AttributeError):
        return ids  # no chat template: eos only
    after = text[text.find(marker) + len(marker):] if marker in text else ""
    following = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    if following and following[0] in special:
        add(following[0])
    return ids
