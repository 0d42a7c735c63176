"""Timed decoding of one prompt: the target alone (baseline) and speculative decoding.

The speculative loop is the drafter's own ``spec_generate`` (the method of the modeling file
that is exported next to the weights), so the loop evaluated here is the one users get from
``AutoModel.from_pretrained(dir, trust_remote_code=True)``; this module only adds timing
around it. The baseline is the target's plain decode with a KV cache, one token per forward.

Timing excludes the prefill: the clock of the decode phase starts when the target's first
forward (the prompt) returns, for both. The drafter's first call (which also projects the
prompt's context features into the draft cache) counts as decode time, which is conservative.
On CUDA the device is synchronised at every clock reading. Both decoders take the clock as an
argument (``time.perf_counter`` by default) so that a paired timing
(:mod:`dflash_trainer.evaluation.speedup`) hands both arms its own.

The acceptance trace (what the drafter proposed at each verify step and how much of it the
target accepted) is read off the target's forward inputs with a pre-hook: every verify
forward receives the block ``[bonus, draft_1, ..., draft_{B-1}]`` at position ``start``, so
the drafts are the block's tail and consecutive block positions give the accepted count.
A forward hook keeps the top :data:`TOP_K` logits of every position the target scored, so that
a greedy output that differs from plain decoding can be classified (:func:`classify_difference`).
Nothing in the decoding loop changes.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import DynamicCache

from dflash_trainer.core.ties import top_ties
from dflash_trainer.evaluation.speedup import Clock

__all__ = ["NUMERICS", "WRONG_ACCEPTANCE", "Decoded", "Span", "VerifyLogits", "VerifyStep", "acceptance_spans",
           "classify_difference", "first_mismatch", "numerics_margin", "piece_texts",
           "speculative_generate", "target_generate"]

TOP_K = 8
"""Logits kept per scored position: enough to find plain decoding's token when it is a near tie."""
NUMERICS = "numerics"
WRONG_ACCEPTANCE = "wrong acceptance"


def numerics_margin(dtype: torch.dtype) -> float:
    """The largest gap, in logits, between the verify logits' argmax and plain decoding's token
    that rounding can explain: 1.0 for 16-bit compute, 0.01 for float32. A batched verify and a
    one-token forward sum in other orders; in bf16 (8 bits of mantissa) logits of 10 to 30 round
    in steps of 0.06 to 0.125 per operation, and over a whole network a near tie flips."""
    return 0.01 if dtype in (torch.float32, torch.float64) else 1.0


@dataclass(kw_only=True)
class VerifyLogits:
    """The top logits of one target forward of the speculative loop (prefill or verify)."""

    start: int
    """Absolute position whose logits are row 0 (they choose the token at ``start + 1``)."""
    ids: torch.Tensor
    """``[L, TOP_K]`` token ids, best first."""
    values: torch.Tensor
    """``[L, TOP_K]`` their logits (float32)."""


@dataclass(kw_only=True)
class VerifyStep:
    """One target verify step of speculative decoding."""

    drafted: list[int]
    """The drafter's proposals for block slots 1..B-1."""
    accepted: int
    """How many of them (a prefix) the target accepted; the step commits these plus one token
    of the target's own (the bonus)."""


class Span(NamedTuple):
    """Tokens committed by one step: ``accepted`` accepted drafts, then the target's own token.

    The first span (the prefill's token) has ``accepted == 0``. The last span can be cut short
    by a stop token or ``max_new_tokens``; then it may end before the bonus.
    """

    tokens: list[int]
    accepted: int


@dataclass(kw_only=True)
class Decoded:
    """Generated tokens of one prompt and the time spent on them."""

    tokens: list[int]
    """Generated token ids (prompt excluded); a stop token that ended generation is included."""
    prefill_s: float
    """Time of the target's prompt forward (which also yields the first token)."""
    decode_s: float
    """Time from the end of the prefill to the last token."""
    acceptance_lengths: list[int] = field(default_factory=list)
    """Tokens committed per target verify step (accepted drafts + 1), in [1, B]; empty for the
    target-only baseline."""
    steps: list[VerifyStep] = field(default_factory=list)
    """The drafts of each verify step; empty for the baseline, or when the drafter's loop
    did not call the target the way the trace expects (another modeling file)."""
    prompt_tokens: int = 0
    """Length of the prompt (the position of the first generated token)."""
    verify_logits: list[VerifyLogits] = field(default_factory=list)
    """The top logits of each target forward of the speculative loop; empty for the baseline."""

    @property
    def decode_tokens(self) -> int:
        """Tokens produced after the prefill (the first token comes with the prefill)."""
        return max(len(self.tokens) - 1, 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _now(device: torch.device, clock: Clock) -> float:
    _sync(device)
    return clock()


@contextmanager
def _first_forward_end(module: nn.Module, device: torch.device, clock: Clock) -> Iterator[list[float]]:
    """Yields a list that receives the time at which ``module``'s first forward in this thread
    returns; calls from other threads (a training pipeline sharing the target) are ignored."""
    thread = threading.get_ident()
    stamps: list[float] = []

    def hook(_module: nn.Module, _args: Any, _output: Any) -> None:
        if not stamps and threading.get_ident() == thread:
            stamps.append(_now(device, clock))

    handle = module.register_forward_hook(hook)
    try:
        yield stamps
    finally:
        handle.remove()


def _pick(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(torch.softmax(logits.float() / temperature, dim=-1), 1)[:, 0]


def _check_prompt(input_ids: torch.Tensor, max_new_tokens: int) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(f"expected one non-empty prompt of shape [1, S], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


@torch.inference_mode()
def target_generate(target: nn.Module, input_ids: torch.Tensor, *, max_new_tokens: int,
                    stop_token_ids: Sequence[int], temperature: float = 0.0,
                    clock: Clock = time.perf_counter) -> Decoded:
    """The target's own decode of ``input_ids`` ``[1, S]`` with a KV cache, one token per forward.

    Greedy at ``temperature == 0``, else sampling from ``softmax(logits / temperature)``.
    Stops after a token in ``stop_token_ids`` (kept in the output) or ``max_new_tokens``.
    ``clock`` times the prefill and the decode.
    """
    _check_prompt(input_ids, max_new_tokens)
    device = input_ids.device
    stops = set(int(t) for t in stop_token_ids)
    # transformers 5.x renames past_key_values to cache (the old name warns until 5.40).
    cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    cache = {cache_arg: DynamicCache()}
    start = _now(device, clock)
    out = target(input_ids, use_cache=True, logits_to_keep=1, **cache)
    token = _pick(out.logits[:, -1], temperature)
    tokens = [int(token)]
    prefill_end = _now(device, clock)
    while len(tokens) < max_new_tokens and tokens[-1] not in stops:
        out = target(token[:, None], use_cache=True, **cache)
        token = _pick(out.logits[:, -1], temperature)
        tokens.append(int(token))
    end = _now(device, clock)
    return Decoded(tokens=tokens, prefill_s=prefill_end - start, decode_s=end - prefill_end)


class _VerifyTrace:
    """Pre-hook on the target that records the input blocks of one ``spec_generate`` call
    (this thread only) and, given ``on_span``, reports each step's span once it is known."""

    def __init__(self, on_span: Callable[[Span], None] | None) -> None:
        self.thread = threading.get_ident()
        self.blocks: list[torch.Tensor] = []
        self.on_span = on_span
        self.emitted = 0
        self._previous: tuple[list[int], int] | None = None
        """(block ids, block start) of the previous verify step, when streaming."""

    def __call__(self, _module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if threading.get_ident() != self.thread:
            return
        ids = args[0] if args else kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            return
        first_call = not self.blocks
        self.blocks.append(ids.detach().clone())
        positions = kwargs.get("position_ids")
        if self.on_span is None or first_call or not isinstance(positions, torch.Tensor):
            return
        # The block of step k + 1 starts with step k's bonus, at step k's start + accepted + 1.
        block, start = ids[0].tolist(), int(positions[0, 0])
        if self._previous is None:
            self._emit(Span([block[0]], 0))
        else:
            previous, previous_start = self._previous
            accepted = start - previous_start - 1
            self._emit(Span(previous[1:accepted + 1] + [block[0]], accepted))
        self._previous = (block, start)

    def _emit(self, span: Span) -> None:
        assert self.on_span is not None
        self.on_span(span)
        self.emitted += 1

    def finish(self, spans: list[Span]) -> None:
        """Report the spans the hook could not see (the last one at least)."""
        if self.on_span is not None:
            for span in spans[self.emitted:]:
                self._emit(span)


class _LogitsTrace:
    """Forward hook on the target that keeps the top logits of every scored position (this thread only)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.calls: list[VerifyLogits] = []

    def __call__(self, _module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        ids = args[0] if args else kwargs.get("input_ids")
        logits = getattr(output, "logits", None)
        if threading.get_ident() != self.thread or not isinstance(ids, torch.Tensor) or logits is None:
            return
        positions = kwargs.get("position_ids")
        first = int(positions[0, 0]) if isinstance(positions, torch.Tensor) else 0  # the prefill has none
        rows = logits[0].float()
        top = rows.topk(min(TOP_K, rows.shape[-1]), dim=-1)
        # logits_to_keep may score only the last rows of the input.
        self.calls.append(VerifyLogits(start=first + ids.shape[1] - rows.shape[0], ids=top.indices, values=top.values))


def classify_difference(spec: Decoded, plain: Sequence[int], position: int, *, margin: float) -> dict[str, Any]:
    """Why greedy speculative output ``spec.tokens`` first differs from plain decoding ``plain``
    at generated token ``position``: ``numerics`` when the speculative path emitted the verify
    logits' own argmax there (any token equal to the top logit: two equal logits are a tie,
    whichever one ``argmax`` or ``topk`` lists first) and plain decoding's token is within
    ``margin`` logits of it (a near tie that the batched verify rounded the other way), else
    ``wrong acceptance`` (a bug:
    the loop committed a token its verify did not choose, or scored a context it should not have).
    """
    at = spec.prompt_tokens + position - 1  # the position whose logits chose this token
    found = [(call, at - call.start) for call in spec.verify_logits if call.start <= at < call.start + len(call.ids)]
    spec_token = spec.tokens[position] if position < len(spec.tokens) else None
    plain_token = plain[position] if position < len(plain) else None
    result: dict[str, Any] = {"kind": WRONG_ACCEPTANCE, "margin": margin, "verify_argmax": None, "logit_gap": None}
    if not found or spec_token is None or plain_token is None:
        result["why"] = "no verify logits for that position, or one output ended early"
        return result
    call, row = found[-1]  # the last forward that scored it is the one that committed it
    ids, values = call.ids[row].tolist(), call.values[row].tolist()
    argmaxes = top_ties(list(zip(ids, values, strict=True)))
    # The loop's argmax and the trace's topk may list two equal logits in either order.
    result["verify_argmax"] = spec_token if spec_token in argmaxes else argmaxes[0]
    if spec_token not in argmaxes:
        result["why"] = "the speculative path emitted a token that is not its verify logits' argmax"
        return result
    if plain_token not in ids:
        result["why"] = f"plain decoding's token is not among the verify logits' top {len(ids)}"
        return result
    gap = max(values) - values[ids.index(plain_token)]
    result["logit_gap"] = gap
    if gap <= margin:
        tie = " (an exact tie)" if gap == 0 else ""
        result.update(kind=NUMERICS,
                      why=f"a near tie: plain decoding's token is {gap:.3f} logits below the argmax{tie}")
    else:
        result["why"] = f"plain decoding's token is {gap:.3f} logits below the verify argmax (margin {margin:g})"
    return result


def speculative_generate(drafter: nn.Module, target: nn.Module, input_ids: torch.Tensor, *,
                         max_new_tokens: int, stop_token_ids: Sequence[int],
                         temperature: float = 0.0,
                         on_span: Callable[[Span], None] | None = None,
                         clock: Clock = time.perf_counter) -> Decoded:
    """Speculative decoding of ``input_ids`` ``[1, S]`` with ``drafter.spec_generate``.

    ``drafter`` is a ``DFlashDraftModel`` or a variant's subclass (in-project or loaded through
    ``trust_remote_code``) on the target's device; each block's drafts come from its class's
    drafting step (``propose``: the argmax, or a variant's own walk). Its train/eval mode
    is restored afterwards (``spec_generate`` switches to eval mode; not every modeling file
    switches back). ``on_span`` receives the
    committed tokens step by step while decoding runs (one step behind the target, plus the
    rest at the end), for streaming output; it costs one host sync per step. ``clock`` times
    the prefill and the decode.
    """
    _check_prompt(input_ids, max_new_tokens)
    device = input_ids.device
    was_training = drafter.training
    trace = _VerifyTrace(on_span)
    logits_trace = _LogitsTrace()
    handle = target.register_forward_pre_hook(trace, with_kwargs=True)
    logits_handle = target.register_forward_hook(logits_trace, with_kwargs=True)
    try:
        with _first_forward_end(target, device, clock) as prefill_end:
            start = _now(device, clock)
            stats = drafter.spec_generate(target=target, input_ids=input_ids, max_new_tokens=max_new_tokens,
                                          stop_token_ids=list(stop_token_ids), temperature=temperature,
                                          return_stats=True)
            end = _now(device, clock)
    finally:
        handle.remove()
        logits_handle.remove()
        drafter.train(was_training)
    assert prefill_end, "spec_generate did not call the target"
    tokens = stats.output_ids[0, stats.num_input_tokens:].tolist()
    lengths = [int(a) for a in stats.acceptance_lengths]
    steps: list[VerifyStep] = []
    if len(trace.blocks) == len(lengths) + 1:
        steps = [VerifyStep(drafted=block[0, 1:].tolist(), accepted=a - 1)
                 for block, a in zip(trace.blocks[1:], lengths)]
    trace.finish(acceptance_spans(tokens, lengths))
    return Decoded(tokens=tokens, prefill_s=prefill_end[0] - start, decode_s=end - prefill_end[0],
                   acceptance_lengths=lengths, steps=steps, prompt_tokens=input_ids.shape[1],
                   verify_logits=[VerifyLogits(start=c.start, ids=c.ids.cpu(), values=c.values.cpu())
                                  for c in logits_trace.calls])


def acceptance_spans(tokens: Sequence[int], acceptance_lengths: Sequence[int]) -> list[Span]:
    """Split generated ``tokens`` into the spans the prefill and each verify step committed."""
    if not tokens:
        return []
    spans = [Span([int(tokens[0])], 0)]
    pos = 1
    for length in acceptance_lengths:
        if pos >= len(tokens):
            break
        taken = [int(t) for t in tokens[pos:pos + length]]
        spans.append(Span(taken, min(length - 1, len(taken))))
        pos += len(taken)
    assert pos == len(tokens), f"{len(tokens) - pos} tokens not covered by the acceptance lengths"
    return spans


def piece_texts(tokenizer: Any, pieces: Sequence[Sequence[int]]) -> list[str]:
    """The text of each consecutive piece of one token sequence (special tokens dropped).

    Decoded as prefixes of the whole, so word joins and multi-byte characters split across
    pieces come out as in the full text; a piece where that fails is decoded on its own.
    """
    texts: list[str] = []
    ids: list[int] = []
    previous = ""
    for piece in pieces:
        ids.extend(piece)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if text.startswith(previous) and not text.endswith("\ufffd"):
            texts.append(text[len(previous):])
            previous = text
        else:
            texts.append(tokenizer.decode(list(piece), skip_special_tokens=True))
            previous = "".join(texts)
    return texts


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where two token sequences differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
