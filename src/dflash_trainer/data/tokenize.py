"""Conversations to token ids plus an assistant-only loss mask, with the target's chat template.

A conversation becomes one sample, or one per assistant turn where the template needs it
(:mod:`dflash_trainer.data.turns`), rendered as an engine renders it for the target
(:mod:`dflash_trainer.data.render`). The supervised text of an assistant turn is everything the
template emits for that turn after its context ``render(messages[:k], add_generation_prompt)``:
for ChatML (SmolLM2, Qwen) that is ``content<|im_end|>\\n``: the end-of-turn token is supervised
(the drafter must learn to end a turn) and so is the newline the template writes after it, since
the template emits it as part of the turn; the header ``<|im_start|>assistant\\n`` is not. A
token counts as supervised when its characters overlap a supervised span (the rule of
transformers' ``return_assistant_tokens_mask``).

An assistant message marked ``"truncated": true`` (an answer cut before the model ended its turn,
as ``regenerate`` marks answers that hit ``--max-new-tokens``) is supervised only up to the end
of its content: the end-of-turn token the template appends would be a false label there.

Before rendering, assistant messages before the first user message are removed (there is no
prompt they answer; counted as ``trimmed_leading``) and messages after the last assistant turn
are dropped (they carry no supervision).

An empty or whitespace-only assistant answer (no tool call either) would teach the drafter to end
the turn at once (``regenerate`` fails such answers too). A conversation whose every supervised
answer is empty is dropped (``empty_answer``); one where only some are empty keeps them as context
but leaves them unsupervised, end-of-turn tokens included (counted as ``empty_answers``).

A per-turn sample longer than ``data.max_length`` whose context alone fills it is left out
(``turns_skipped_long``), not the conversation: a later turn can fit again when the template
strips history reasoning. A record that the template cannot render is dropped with its reason
(``unrenderable``, ``tools_unsupported``, ``malformed``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
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
from dflash_trainer.data.render import ChatRenderer, RenderFailure
from dflash_trainer.data.turns import TurnPlan, TurnText, plan_turns
from dflash_trainer.core.errors import TargetError

_CHARS_PER_TOKEN = 6
"""Character budget per token when rendering long conversations (English averages ~4)."""

DropReason = Literal["malformed", "no_assistant", "empty_answer", "too_short", "too_long",
                     "unrenderable", "tools_unsupported"]
RULES_VERSION = 2
"""Changes when the same conversation, tokenizer and options give other samples (2: empty
answers dropped or unsupervised); part of the token store's key, so older stores are rebuilt.
Per-turn samples did not change it: every conversation that rules 2 turned into a sample (its
history a prefix of the whole render) still gives that same sample, and the others were refused.
Files with the reasoning, tool and ``developer`` fields that earlier readers dropped or refused
get a new key through their identity instead (:class:`~dflash_trainer.data.cache.ChatFieldScan`)."""


class TemplateError(DataError):
    """The tokenizer has no chat template (or is not a fast tokenizer)."""


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
    turns: tuple[int, ...] = ()
    """Message indices (in the trimmed conversation) of the assistant turns it supervises."""
    whole: bool = True
    """The whole conversation (False: one turn's own sample, its context repeating the history)."""


@dataclass(frozen=True)
class Samples:
    """What one record became: its samples and what rendering it found."""

    encoded: list[Encoded]
    trimmed_leading: int = 0
    """Assistant messages removed before the first user message."""
    cut_answers: int = 0
    """Assistant messages marked ``truncated`` (their end of turn is not supervised)."""
    empty_answers: int = 0
    """Empty or whitespace-only assistant answers left unsupervised."""
    reasoning_answers: int = 0
    """Supervised answers carrying reasoning."""
    reasoning_unrendered: int = 0
    """Answers whose reasoning the template does not render (kept without it)."""
    turns_skipped_long: int = 0
    """Per-turn samples left out because their context alone fills ``data.max_length``."""
    turn_drops: list[Dropped] = field(default_factory=list)
    """Per-turn samples dropped (too short, too long with ``on_too_long=drop``) beside kept ones."""
    expansion_tokens: int = 0
    """Tokens of the per-turn samples (their contexts repeat the history)."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The trimmed conversation (``Encoded.turns`` index it)."""


@dataclass(frozen=True)
class Dropped:
    """A record left out of training, with the reason counted in the statistics."""

    reason: DropReason
    message: str


class ChatTokenizer:
    """Encodes conversations with one tokenizer's chat template under fixed options."""

    def __init__(self, tokenizer: Any, options: TokenizeOptions, *, template_name: str | None = None) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise TemplateError(f"tokenizer {type(tokenizer).__name__} is not a fast (Rust) "
                                "tokenizer; character offsets are needed for the loss mask")
        self.tokenizer = tokenizer
        self.options = options
        try:
            self.template: str | None = tokenizer.get_chat_template()
        except ValueError:
            self.template = None
        self.name = template_name or getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        self.renderer = ChatRenderer(tokenizer, self.template, name=self.name) if self.template else None
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
    def supports_thinking(self) -> bool:
        """Whether the template reads ``enable_thinking`` (so ``data.thinking`` has an effect)."""
        return reads_enable_thinking(self.template)

    def _require_template(self, location: Location | None) -> ChatRenderer:
        if self.renderer is None:
            where = f"{location}: " if location is not None else ""
            raise TemplateError(
                f"{where}the tokenizer ({self.name}) has no chat template, so conversations cannot be "
                "rendered; use a model folder whose tokenizer has one (chat_template.jinja or "
                "tokenizer_config.json), or pre-tokenized data")
        return self.renderer

    def _cut_point(self, text: str, max_chars: int | None) -> int:
        if max_chars is None or len(text) <= max_chars:
            return len(text)
        found = [i for t in self._split_tokens if (i := text.find(t, max_chars)) >= 0]
        return min(found) if found else len(text)

    def encode_batch(self, records: Sequence[Conversation | Tokenized]) -> list[Samples | Dropped]:
        """Encode records in order; the texts of all conversations are tokenized in one batched call.

        Long texts are first rendered and tokenized only up to ``_CHARS_PER_TOKEN * max_length``
        characters (cut right before a template control token, so the ids are a prefix of the
        full text's; turns whose context starts past the cut are not rendered); the few records
        whose cut text has too few tokens are planned and tokenized again in full.
        """
        budget = _CHARS_PER_TOKEN * self.options.max_length
        results: list[Samples | Dropped | None] = [None] * len(records)
        planned: list[tuple[int, TurnPlan, list[dict[str, Any]], int]] = []
        for i, record in enumerate(records):
            if isinstance(record, Tokenized):
                results[i] = self._from_tokenized(record)
                continue
            messages, trimmed = trim_conversation(record.messages)
            plan = self._plan(record, messages, budget)
            if isinstance(plan, Dropped):
                results[i] = plan
            else:
                planned.append((i, plan, messages, trimmed))
        encodings = self._encode_texts([s for _, plan, _, _ in planned for s in plan.samples], budget)
        per_record, again, at = [], [], 0
        for i, plan, messages, trimmed in planned:
            mine, at = encodings[at:at + len(plan.samples)], at + len(plan.samples)
            if any(cut and len(ids) <= self.options.max_length for ids, _, cut in mine):
                again.append((i, messages, trimmed))
            else:
                per_record.append((i, plan, messages, trimmed, mine))
        for i, messages, trimmed in again:
            plan = self._plan(records[i], messages, None)
            assert isinstance(plan, TurnPlan)  # it planned with the cut, so it plans in full
            per_record.append((i, plan, messages, trimmed, self._encode_texts(plan.samples, None)))
        for i, plan, messages, trimmed, mine in per_record:
            results[i] = self._samples(records[i].location, plan, messages, trimmed, mine)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _plan(self, record: Conversation, messages: list[dict[str, Any]],
              max_chars: int | None) -> TurnPlan | Dropped:
        """The texts of one conversation's samples (:func:`plan_turns`), or why it is dropped."""
        renderer = self._require_template(record.location)
        assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistant:
            return Dropped("no_assistant", f"{record.location}: no assistant turn after a user turn")
        answers = assistant[-1:] if self.options.last_turn_only else assistant
        supervised = [k for k in answers if not is_empty_answer(messages[k])]
        if not supervised:
            which = "the last assistant answer (data.last_turn_only)" if self.options.last_turn_only \
                else "every assistant answer"
            return Dropped("empty_answer", f"{record.location}: {which} is empty or whitespace "
                           "(it would teach the drafter to end the turn at once)")
        try:
            return plan_turns(renderer, messages, getattr(record, "tools", None), supervised=supervised,
                              thinking=self.options.thinking,
                              truncated={k for k in supervised if messages[k].get(TRUNCATED)},
                              cut_at=None if max_chars is None else lambda t: self._cut_point(t, max_chars))
        except RenderFailure as exc:
            return Dropped(exc.reason, f"{record.location}: {exc}")

    def _samples(self, location: Location, plan: TurnPlan, messages: list[dict[str, Any]], trimmed: int,
                 tokenized: list[tuple[np.ndarray, np.ndarray, bool]]) -> Samples | Dropped:
        """One record's samples from its tokenized texts (or why none is kept)."""
        encoded, skipped, drops = [], plan.beyond, []
        for sample, (ids, mask, was_cut) in zip(plan.samples, tokenized):
            result = self._finish(ids, mask, location, was_cut, sample)
            if result is None:
                skipped += 1
            elif isinstance(result, Dropped):
                drops.append(result)
            else:
                encoded.append(result)
        if not encoded:
            return drops[0] if drops else Dropped("too_long", f"{location}: the context of every turn is "
                                                  f"longer than data.max_length {self.options.max_length}")
        answers = assistant_answers(messages, self.options.last_turn_only)
        return Samples(
            encoded, trimmed_leading=trimmed, cut_answers=sum(bool(m.get(TRUNCATED)) for m in messages),
            empty_answers=sum(is_empty_answer(m) for m in answers),
            reasoning_answers=plan.reasoning_answers, reasoning_unrendered=plan.reasoning_unrendered,
            turns_skipped_long=skipped, turn_drops=drops,
            expansion_tokens=sum(len(e.input_ids) for e in encoded if not e.whole), messages=messages)

    def _encode_texts(self, samples: list[TurnText], max_chars: int | None
                      ) -> list[tuple[np.ndarray, np.ndarray, bool]]:
        if not samples:
            return []
        cuts = [self._cut_point(s.text, max_chars) for s in samples]
        encodings = self._backend.encode_batch([s.text[:cut] for s, cut in zip(samples, cuts)],
                                               add_special_tokens=False)
        out = []
        for encoding, sample, cut in zip(encodings, samples, cuts):
            ids = np.asarray(encoding.ids, dtype=np.int32)
            offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
            mask = np.zeros(len(ids), dtype=bool)
            for start, stop in sample.spans:
                if start < cut:
                    mask |= (offsets[:, 1] > start) & (offsets[:, 0] < min(stop, cut))
            out.append((ids, mask.astype(np.uint8), cut < len(sample.text)))
        return out

    def encode(self, record: Conversation | Tokenized) -> Samples | Dropped:
        """Encode one record (see :meth:`encode_batch`)."""
        return self.encode_batch([record])[0]

    def _from_tokenized(self, record: Tokenized) -> Samples | Dropped:
        ids = np.asarray(record.input_ids, dtype=np.int64)
        if ids.size and int(ids.max()) >= self.vocab_size:
            return Dropped("malformed", f"{record.location}: token id {int(ids.max())} is outside "
                           f"the tokenizer's vocabulary (size {self.vocab_size})")
        result = self._finish(ids.astype(np.int32), np.asarray(record.loss_mask, dtype=np.uint8),
                              record.location, False, None)
        return Samples([result]) if isinstance(result, Encoded) else result  # type: ignore[list-item]

    def _finish(self, ids: np.ndarray, mask: np.ndarray, location: Location, was_cut: bool,
                sample: TurnText | None) -> Encoded | Dropped | None:
        """The sample, a Dropped one, or None for a turn whose context alone is too long."""
        opts = self.options
        truncated = False
        if len(ids) > opts.max_length:
            if sample is not None and not sample.whole and not mask[:opts.max_length].any():
                return None
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
        return Encoded(np.ascontiguousarray(ids), np.ascontiguousarray(mask), truncated,
                       tuple(sample.turns) if sample is not None else (),
                       sample.whole if sample is not None else True)


def assistant_answers(messages: list[dict[str, Any]], last_turn_only: bool) -> list[dict[str, Any]]:
    """The assistant messages whose turns are supervised (the last only with last_turn_only)."""
    answers = [m for m in messages if m["role"] == "assistant"]
    return answers[-1:] if last_turn_only else answers


def is_empty_answer(message: dict[str, Any]) -> bool:
    """Whether an assistant message says nothing: its content is empty or whitespace only and it
    has no tool call and no reasoning."""
    return (message["role"] == "assistant" and not message["content"].strip()
            and not message.get("tool_calls") and not (message.get("reasoning_content") or "").strip())


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
