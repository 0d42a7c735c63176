"""Timed decoding of one prompt: the target alone (baseline) and speculative decoding.

The speculative loop is the drafter's own ``spec_generate`` (the method of the modeling file
that is exported next to the weights), so the loop evaluated here is the one users get from
``AutoModel.from_pretrained(dir, trust_remote_code=True)``; this module only adds timing
around it. The baseline is the target's plain decode with a KV cache, one token per forward.

Timing excludes the prefill: the clock of the decode phase starts when the target's first
forward (the prompt) returns, for both. The drafter's first call (which also projects the
prompt's context features into the draft cache) counts as decode time, which is conservative.
On CUDA the device is synchronised at every clock reading.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

__all__ = ["Decoded", "end_of_turn_ids", "first_mismatch", "speculative_generate", "target_generate"]


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

    @property
    def decode_tokens(self) -> int:
        """Tokens produced after the prefill (the first token comes with the prefill)."""
        return max(len(self.tokens) - 1, 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _now(device: torch.device) -> float:
    _sync(device)
    return time.perf_counter()


@contextmanager
def _first_forward_end(module: nn.Module, device: torch.device) -> Iterator[list[float]]:
    """Yields a list that receives the time at which ``module``'s first forward in this thread
    returns; calls from other threads (a training pipeline sharing the target) are ignored."""
    thread = threading.get_ident()
    stamps: list[float] = []

    def hook(_module: nn.Module, _args: Any, _output: Any) -> None:
        if not stamps and threading.get_ident() == thread:
            stamps.append(_now(device))

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
                    stop_token_ids: Sequence[int], temperature: float = 0.0) -> Decoded:
    """The target's own decode of ``input_ids`` ``[1, S]`` with a KV cache, one token per forward.

    Greedy at ``temperature == 0``, else sampling from ``softmax(logits / temperature)``.
    Stops after a token in ``stop_token_ids`` (kept in the output) or ``max_new_tokens``.
    """
    _check_prompt(input_ids, max_new_tokens)
    device = input_ids.device
    stops = set(int(t) for t in stop_token_ids)
    # transformers 5.x renames past_key_values to cache (the old name warns until 5.40).
    cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    cache = {cache_arg: DynamicCache()}
    start = _now(device)
    out = target(input_ids, use_cache=True, logits_to_keep=1, **cache)
    token = _pick(out.logits[:, -1], temperature)
    tokens = [int(token)]
    prefill_end = _now(device)
    while len(tokens) < max_new_tokens and tokens[-1] not in stops:
        out = target(token[:, None], use_cache=True, **cache)
        token = _pick(out.logits[:, -1], temperature)
        tokens.append(int(token))
    end = _now(device)
    return Decoded(tokens=tokens, prefill_s=prefill_end - start, decode_s=end - prefill_end)


def speculative_generate(drafter: nn.Module, target: nn.Module, input_ids: torch.Tensor, *,
                         max_new_tokens: int, stop_token_ids: Sequence[int],
                         temperature: float = 0.0) -> Decoded:
    """Speculative decoding of ``input_ids`` ``[1, S]`` with ``drafter.spec_generate``.

    ``drafter`` is a ``DFlashDraftModel`` (in-project or loaded through ``trust_remote_code``)
    on the target's device. Its train/eval mode is restored afterwards (``spec_generate``
    switches to eval mode; not every modeling file switches back).
    """
    _check_prompt(input_ids, max_new_tokens)
    device = input_ids.device
    was_training = drafter.training
    try:
        with _first_forward_end(target, device) as prefill_end:
            start = _now(device)
            stats = drafter.spec_generate(target=target, input_ids=input_ids, max_new_tokens=max_new_tokens,
                                          stop_token_ids=list(stop_token_ids), temperature=temperature,
                                          return_stats=True)
            end = _now(device)
    finally:
        drafter.train(was_training)
    assert prefill_end, "spec_generate did not call the target"
    tokens = stats.output_ids[0, stats.num_input_tokens:].tolist()
    return Decoded(tokens=tokens, prefill_s=prefill_end[0] - start, decode_s=end - prefill_end[0],
                   acceptance_lengths=[int(a) for a in stats.acceptance_lengths])


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where two token sequences differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


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
