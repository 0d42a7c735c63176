"""``dflash-trainer generate``: watch speculative decoding answer a prompt, step by step.

The answer streams as the drafter's ``spec_generate`` commits it. On a terminal, the draft
tokens the target accepted at each verify step are coloured (a darker green for a longer
accepted run) and the token the target produced itself (the bonus) is plain; elsewhere
(a pipe, a file) accepted spans are bracketed: ``[accepted drafts]bonus``. After each answer:
the acceptance length tau, the acceptance histogram, decode tokens/s of speculative and
target-only decoding (the target decodes the same prompt alone for the comparison), and
with ``--check`` whether the answer equals the target's own greedy answer token for token.

Prompts: ``--prompt TEXT``, ``--prompts FILE`` (a JSONL file as ``dflash-trainer eval``
reads it, or plain text with one prompt per line) or ``--interactive`` (a chat: each answer
becomes part of the conversation).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from dflash_trainer.config import Config
from dflash_trainer.data.tokenize import end_of_turn_ids, render_prompt
from dflash_trainer.core.errors import ConfigError
from dflash_trainer.evaluation.evaluate import load_models, use_recorded_target
from dflash_trainer.evaluation.prompt_sets import EvalError, EvalPrompt, read_prompt_file
from dflash_trainer.evaluation.speedup import PairedTimer, SpeedupMeasurement
from dflash_trainer.evaluation.spec_decode import (Decoded, Span, first_mismatch, speculative_generate,
                                                   target_generate)

__all__ = ["Answer", "SpanWriter", "generate_answer", "main", "read_prompts", "span_colour"]

# 256-colour backgrounds, light to dark green, for accepted runs of 1-2, 3-5, 6-9, 10+ drafts.
_SHADES = ((2, 194), (5, 156), (9, 113), (None, 70))
_RESET = "\x1b[0m"


def span_colour(accepted: int) -> str:
    """ANSI escape that starts the background of a span of ``accepted`` accepted drafts."""
    for upper, code in _SHADES:
        if upper is None or accepted <= upper:
            return f"\x1b[48;5;{code}m\x1b[38;5;16m"
    raise AssertionError("unreachable: the last shade has no upper bound")


def legend(colour: bool) -> str:
    """One line explaining the marking of the streamed answer."""
    if not colour:
        return "[accepted draft tokens] the target's own tokens unmarked"
    samples = []
    lower = 1
    for upper, _ in _SHADES:
        label = f"{lower}+" if upper is None else (f"{lower}-{upper}")
        samples.append(f"{span_colour(lower)} {label} {_RESET}")
        lower = (upper or lower) + 1
    return "accepted drafts per step: " + " ".join(samples) + "  the target's own tokens plain"


class SpanWriter:
    """Writes committed spans as text while they arrive, marked by how they were accepted.

    Text is decoded from the whole sequence so far (word joins and multi-byte characters come
    out as in the full answer); a tail that ends in an incomplete character waits for the
    next span. Stop tokens and other special tokens are not shown.
    """

    def __init__(self, tokenizer: Any, stream: IO[str], *, colour: bool) -> None:
        self.tokenizer = tokenizer
        self.stream = stream
        self.colour = colour
        self._ids: list[int] = []
        self._shown = ""

    def _advance(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        text = self.tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self._shown):
            return ""  # an incomplete character, or a re-spelled tail: wait for more tokens
        new, self._shown = text[len(self._shown):], text
        return new

    def _mark(self, text: str, accepted: int) -> str:
        if not text or not accepted:
            return text
        if not self.colour:
            return f"[{text}]"
        start = span_colour(accepted)
        # Per line, so the background does not run to the terminal's edge.
        return "\n".join(f"{start}{part}{_RESET}" if part else part for part in text.split("\n"))

    def write(self, span: Span) -> None:
        """Show one span: its accepted drafts marked, then the target's own token."""
        drafted = self._advance(span.tokens[:span.accepted])
        own = self._advance(span.tokens[span.accepted:])
        self.stream.write(self._mark(drafted, span.accepted) + own)
        self.stream.flush()


@dataclass(kw_only=True)
class Answer:
    """One generated answer: the speculative decode and the target-only decode of the prompt."""

    text: str
    spec: Decoded
    baseline: Decoded
    checked: bool
    """Whether a lossless check was asked for and applies (greedy decoding)."""
    speedup: SpeedupMeasurement
    """The two decodes' speed ratio, measured back to back, with its reliability."""

    @property
    def tau(self) -> float | None:
        """Mean tokens committed per verify step."""
        lengths = self.spec.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else None

    @property
    def mismatch(self) -> int | None:
        """First generated position where speculative and target-only outputs differ."""
        return first_mismatch(self.spec.tokens, self.baseline.tokens)


def generate_answer(drafter: nn.Module, target: nn.Module, tokenizer: Any, messages: list[dict[str, str]], *,
                    max_new_tokens: int, temperature: float, stop_token_ids: Sequence[int],
                    on_span: Callable[[Span], None] | None = None, check: bool = False,
                    thinking: bool = False, timer: PairedTimer | None = None) -> Answer:
    """Answer the last user message of ``messages`` speculatively (streaming spans to
    ``on_span``), then decode it with the target alone, back to back under the same threads
    (:class:`~dflash_trainer.evaluation.speedup.PairedTimer`), for the speed comparison and the check."""
    device = next(target.parameters()).device
    ids = torch.tensor([render_prompt(tokenizer, messages, thinking=thinking)], device=device)
    with torch.no_grad(), (timer or PairedTimer()).run(speculative_first=True) as run:
        baseline, spec, _ = run.pair(
            lambda clock: target_generate(target, ids, max_new_tokens=max_new_tokens,
                                          stop_token_ids=stop_token_ids, temperature=temperature, clock=clock),
            lambda clock: speculative_generate(drafter, target, ids, max_new_tokens=max_new_tokens,
                                               stop_token_ids=stop_token_ids, temperature=temperature,
                                               on_span=on_span, clock=clock))
    stops = set(stop_token_ids)
    text = tokenizer.decode([t for t in spec.tokens if t not in stops], skip_special_tokens=True)
    return Answer(text=text, spec=spec, baseline=baseline, checked=check and temperature <= 0,
                  speedup=run.measurement)


def _rate(decoded: Decoded) -> float | None:
    return decoded.decode_tokens / decoded.decode_s if decoded.decode_tokens and decoded.decode_s > 0 else None


def summary_lines(answer: Answer, block_size: int) -> list[str]:
    """tau, the acceptance histogram, tokens/s and (when checked) the lossless verdict."""
    lengths = answer.spec.acceptance_lengths
    tau = f"{answer.tau:.2f}" if answer.tau is not None else "n/a"
    lines = [f"tau {tau}: {len(answer.spec.tokens)} tokens in {len(lengths)} verify steps "
             f"(+1 token from the prefill), block size {block_size}"]
    counts = [lengths.count(k) for k in range(1, block_size + 1)]
    widest = max(counts, default=0)
    for k, count in enumerate(counts, start=1):
        if count:
            bar = "#" * max(1, round(30 * count / widest))
            lines.append(f"  {k:>2} tokens/step {count:>4}  {bar}")
    spec_rate, base_rate = _rate(answer.spec), _rate(answer.baseline)
    speed = (f"speculative {spec_rate:.1f}, target-only {base_rate:.1f}, "
             f"speedup {answer.speedup.label()} (back to back)" if spec_rate and base_rate
             else "too few tokens to time")
    lines.append(f"decode tokens/s (prefill excluded): {speed}")
    if answer.checked:
        pos = answer.mismatch
        lines.append(f"lossless: identical to the target's greedy answer ({len(answer.baseline.tokens)} tokens)"
                     if pos is None else
                     f"lossless: NO, the answers differ from generated token {pos} on")
    return lines


def read_prompts(path: str | Path) -> list[EvalPrompt]:
    """Prompts of a ``.jsonl`` file (formats of ``dflash-trainer eval``) or of a text file,
    one prompt per non-empty line."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return read_prompt_file(path)
    try:
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalError(f"--prompts {path}: cannot read it: {exc}") from exc
    prompts = [EvalPrompt(id=str(i), turns=[line]) for i, line in enumerate(lines) if line]
    if not prompts:
        raise EvalError(f"--prompts {path}: no prompts in it (one per line, or a .jsonl file)")
    return prompts


def _interactive_turns(stream: IO[str]) -> Iterable[str]:
    print("interactive: type a message; an empty line, /exit or Ctrl-D ends", file=stream, flush=True)
    while True:
        try:
            line = input("\nyou> ")
        except EOFError:
            return
        if not line.strip() or line.strip() == "/exit":
            return
        yield line


def main(cfg: Config, args: argparse.Namespace) -> int:
    """``dflash-trainer generate --drafter DIR (--prompt TEXT | --prompts FILE | --interactive)``.

    Exit status 0; 1 when ``--check`` finds an answer that differs from the target's greedy
    answer. User errors (no or several prompt sources: 2; a bad drafter or prompt file: 1) are
    raised as :class:`~dflash_trainer.core.errors.UserError` for ``cli.main`` to report.
    """
    stream = sys.stdout
    sources = sum([args.prompt is not None, args.prompts is not None, bool(args.interactive)])
    if sources != 1:
        raise ConfigError("give exactly one of --prompt TEXT, --prompts FILE or --interactive")
    prompts = ([EvalPrompt(id="0", turns=[args.prompt])] if args.prompt is not None
               else read_prompts(args.prompts) if args.prompts is not None else [])
    cfg = use_recorded_target(cfg, args, command="generate")
    drafter, target, tokenizer, target_path = load_models(cfg, Path(args.drafter))
    torch.manual_seed(cfg.training.seed)
    colour = stream.isatty() and not os.environ.get("NO_COLOR")
    max_new_tokens = cfg.eval.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens
    temperature = cfg.eval.temperature if args.temperature is None else args.temperature
    stops = end_of_turn_ids(tokenizer, getattr(target, "generation_config", None))
    param = next(target.parameters())
    print(f"generate: drafter {args.drafter} on target {target_path} ({param.device}, "
          f"{str(param.dtype).removeprefix('torch.')}), max_new_tokens {max_new_tokens}, "
          f"temperature {temperature:g}\n{legend(colour)}", file=stream, flush=True)
    if args.check and param.dtype != torch.float32:
        print("note: the check is exact in float32 only (model.dtype=float32); in lower precision the "
              "batched verify and the one-token decode can round near-ties differently", file=stream)
    failures = 0

    def answer(messages: list[dict[str, str]]) -> str:
        nonlocal failures
        stream.write("assistant> ")
        writer = SpanWriter(tokenizer, stream, colour=colour)
        result = generate_answer(drafter, target, tokenizer, messages, max_new_tokens=max_new_tokens,
                                 temperature=temperature, stop_token_ids=stops, on_span=writer.write,
                                 check=args.check, thinking=cfg.data.thinking)
        if result.checked and result.mismatch is not None:
            failures += 1
        print("\n\n" + "\n".join(summary_lines(result, int(drafter.block_size))), file=stream, flush=True)
        return result.text

    history: list[dict[str, str]] = []
    turns = ((p, turn) for p in prompts for turn in p.turns)
    if args.interactive:
        turns = ((None, turn) for turn in _interactive_turns(stream))
    current = None
    for prompt, turn in turns:
        if prompt is not current:  # a new prompt starts a new conversation
            current = prompt
            history = [{"role": "system", "content": prompt.system}] if prompt and prompt.system else []
            print(f"\n=== prompt {prompt.id} ===", file=stream)
        if prompt is not None:
            print(f"you> {turn}", file=stream)
        history.append({"role": "user", "content": turn})
        history.append({"role": "assistant", "content": answer(history)})
    return 1 if failures else 0
