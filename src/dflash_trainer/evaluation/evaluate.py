"""Speculative-decoding evaluation: acceptance length, decode speedup and the lossless check.

``dflash-trainer eval --drafter DIR`` decodes every prompt twice, batch size 1: with the
target alone (greedy with a KV cache: the reference output and the baseline timing) and with
speculative decoding (:func:`dflash_trainer.evaluation.spec_decode.speculative_generate`, i.e. the
drafter's ``spec_generate``). At temperature 0 the two outputs must be identical token for
token. A difference is classified at its first differing token: ``numerics`` when the
speculative path emitted its verify logits' own argmax there and plain decoding's token lies
within :func:`~dflash_trainer.evaluation.spec_decode.numerics_margin` of it (a near tie that a batched
verify and a one-token forward round apart, common in bf16), else a wrong acceptance, a bug
that names the prompt and the position, and the command exits with status 1. The two decodes
of a prompt run back to back in alternating order under one thread count
(:mod:`dflash_trainer.evaluation.speedup`), so the speedup compares timings taken under the same
conditions, and says when it cannot be trusted.

A *request* is one generation: one turn of one prompt. Multi-turn prompts (MT-Bench has two
turns) are played as the benchmark intends: the model's own answer to turn 1 (the speculative
output) becomes the assistant message before turn 2. ``tau`` is the mean over requests of the
per-request mean acceptance length (tokens committed per verify step, 1..B), as in z-lab's
benchmark.

``--suite`` evaluates several domains in one run (:mod:`dflash_trainer.evaluation.prompt_sets`: MT-Bench,
HumanEval and CHAMP math by default, the first turns of ``eval.suite_prompts`` prompts each);
every request carries its domain, and the summary gains ``domains``: the same summary for each
domain's requests (its speedup from its own pairs), so tau is reported per domain.

``--engine llama.cpp|vllm|all`` then serves the same requests with real engines, plain and with
the drafter (:mod:`dflash_trainer.engines.compare`), and adds each engine's tau per domain,
identical outputs and tokens/s beside the project's (``engines`` in ``results.json``).

Results go to ``RUN_DIR/eval/`` (``RUN_DIR/eval/suite/`` for the suite, or ``--out``):
``results.json`` (summary fields at the top level, where ``dflash-trainer report`` reads ``tau``
and ``acceptance_hist``, plus a ``per_prompt`` list, each request with its acceptance ``trace``)
and ``acceptance_hist.png``.

The trace of a request lists what each step committed: entry 0 is the target's prefill token,
entry k >= 1 verify step k with ``drafted`` (the drafter's B-1 proposals), ``accepted`` (how
many the target accepted), ``tokens`` (tokens committed: accepted drafts + the target's own
token, fewer at a stop), and the texts ``text`` (accepted drafts), ``bonus`` (the target's
token) and ``rejected`` (the drafts after the accepted ones). :class:`InTrainingEval` is the same
measurement on a small fixed prompt set for the training loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash_trainer.config import Config, save_config
from dflash_trainer.data.tokenize import end_of_turn_ids, render_prompt
from dflash_trainer.core.errors import CheckpointError, ConfigError
from dflash_trainer.training.export import recorded_target
from dflash_trainer.core.fsutil import check_output_folder
from dflash_trainer.core.inputs import check_input
from dflash_trainer.evaluation.prompt_sets import PROMPT_SETS, EvalPrompt, load_prompts, suite_prompts
from dflash_trainer.evaluation.spec_decode import (NUMERICS, Decoded, acceptance_spans, classify_difference,
                                                   first_mismatch, numerics_margin, piece_texts,
                                                   speculative_generate, target_generate)
from dflash_trainer.evaluation.speedup import (Clock, PairedTimer, PairedTiming, SpeedupMeasurement, TimingRun,
                                               describe_measurement, format_speedup, pay_off_line)

if TYPE_CHECKING:
    from dflash_trainer.engines.compare import EngineRequests

__all__ = ["EvalReport", "InTrainingEval", "RequestResult", "acceptance_trace", "decode_request",
           "check_no_earlier_results", "default_out_dir", "domain_summaries", "evaluate_prompts", "load_models",
           "main", "print_summary", "request_result", "summarize", "use_recorded_target", "write_results"]


@dataclass(kw_only=True)
class RequestResult:
    """One generation (one turn of one prompt) decoded by the target alone and speculatively."""

    id: str
    turn: int
    """0-based turn index within the prompt."""
    category: str | None
    domain: str | None = None
    """The prompt's suite domain; None outside a suite."""
    prompt_tokens: int
    tokens: int
    """Tokens generated by speculative decoding (a final stop token included)."""
    steps: int
    """Target verify steps of the speculative run."""
    tau: float | None
    """Mean acceptance length over the steps; None when there was no step (one-token answer)."""
    acceptance_lengths: list[int]
    lossless: bool | None
    """Speculative output == target greedy output; None at temperature > 0 (not comparable)."""
    mismatch_kind: str | None = None
    """Where the outputs differ: ``numerics`` (a near tie the batched verify rounded the other way)
    or ``wrong acceptance`` (a bug); see :func:`~dflash_trainer.evaluation.spec_decode.classify_difference`."""
    first_mismatch: dict[str, Any] | None
    """Where the outputs first differ: ``position`` (0-based, generated tokens) and the tokens."""
    target_decode_s: float
    spec_decode_s: float
    target_decode_tokens: int
    spec_decode_tokens: int
    output: str
    """The speculative answer as text (stop tokens removed)."""
    prompt_text: str = ""
    """The user turn of this request."""
    trace: list[dict[str, Any]] = field(default_factory=list)
    """Per step: what was drafted and accepted (see the module docstring)."""
    timing: PairedTiming | None = None
    """The two decodes timed side by side; None when the baseline was not decoded beside the
    speculative run (then there is no speedup)."""

    @property
    def speedup(self) -> float | None:
        """Target-only time per decode token / speculative time per decode token, from the
        paired timing only."""
        return self.timing.speedup if self.timing is not None else None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (the ``per_prompt`` entry of ``results.json``)."""
        data = asdict(self)
        del data["timing"]
        data["speedup"] = self.speedup
        data["target_first"] = self.timing.target_first if self.timing is not None else None
        return data


@dataclass(kw_only=True)
class EvalReport:
    """All requests of an evaluation and their summary."""

    summary: dict[str, Any]
    requests: list[RequestResult] = field(default_factory=list)

    @property
    def failures(self) -> list[RequestResult]:
        """Requests whose speculative output differs from the target's greedy output by a wrong
        acceptance (a bug; differences by numerics are :attr:`numerics`)."""
        return [r for r in self.requests if r.lossless is False and r.mismatch_kind != NUMERICS]

    @property
    def numerics(self) -> list[RequestResult]:
        """Requests whose output differs from the target's greedy output at a near tie only."""
        return [r for r in self.requests if r.lossless is False and r.mismatch_kind == NUMERICS]

    def to_json(self) -> dict[str, Any]:
        """``results.json``: summary fields at the top level plus ``per_prompt``."""
        return {**self.summary, "per_prompt": [r.to_json() for r in self.requests]}


# --- decoding and metrics -------------------------------------------------------------------

def _mismatch(spec: list[int], target: list[int], tokenizer: Any) -> dict[str, Any] | None:
    pos = first_mismatch(spec, target)
    if pos is None:
        return None

    def at(tokens: list[int]) -> dict[str, Any]:
        token = tokens[pos] if pos < len(tokens) else None
        text = tokenizer.decode([token]) if token is not None and tokenizer is not None else None
        return {"token": token, "text": text}

    return {"position": pos, "speculative": at(spec), "target": at(target)}


def decode_request(run: TimingRun, drafter: nn.Module, target: nn.Module, input_ids: torch.Tensor, *,
                   max_new_tokens: int, stop_token_ids: Sequence[int],
                   temperature: float = 0.0) -> tuple[Decoded, Decoded, PairedTiming]:
    """(target-only, speculative) decodes of one prompt ``[1, S]``, back to back in ``run``."""

    def baseline(clock: Clock) -> Decoded:
        return target_generate(target, input_ids, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                               temperature=temperature, clock=clock)

    def speculative(clock: Clock) -> Decoded:
        return speculative_generate(drafter, target, input_ids, max_new_tokens=max_new_tokens,
                                    stop_token_ids=stop_token_ids, temperature=temperature, clock=clock)

    return run.pair(baseline, speculative)


def acceptance_trace(spec: Decoded, tokenizer: Any = None) -> list[dict[str, Any]]:
    """The acceptance trace of a speculative decode: entry 0 the prefill's token, entry k the
    k-th verify step (texts only with a ``tokenizer``; ``drafted`` empty if untraced)."""
    spans = acceptance_spans(spec.tokens, spec.acceptance_lengths)
    trace: list[dict[str, Any]] = []
    for k, span in enumerate(spans):
        step = spec.steps[k - 1] if k and len(spec.steps) >= k else None
        # The step's own count: a final span cut by max_new_tokens may show fewer of them.
        accepted = spec.acceptance_lengths[k - 1] - 1 if k else 0
        trace.append({"step": k, "drafted": step.drafted if step else [], "accepted": accepted,
                      "tokens": len(span.tokens)})
    if tokenizer is not None:
        pieces = [p for span in spans for p in (span.tokens[:span.accepted], span.tokens[span.accepted:])]
        texts = piece_texts(tokenizer, pieces)
        for k, (entry, span) in enumerate(zip(trace, spans)):
            entry["text"], entry["bonus"] = texts[2 * k], texts[2 * k + 1]
            rejected = entry["drafted"][span.accepted:]
            entry["rejected"] = tokenizer.decode(rejected, skip_special_tokens=True) if rejected else ""
    return trace


def request_result(prompt: EvalPrompt, turn: int, prompt_tokens: int, baseline: Decoded, spec: Decoded, *,
                   temperature: float, tokenizer: Any = None, stop_token_ids: Sequence[int] = (),
                   timing: PairedTiming | None = None, margin: float | None = None) -> RequestResult:
    """Metrics of one request from its two decodes; a speedup only with their paired ``timing``.
    A greedy difference is classified with ``margin`` logits (default: float32's
    :func:`~dflash_trainer.evaluation.spec_decode.numerics_margin`)."""
    steps = len(spec.acceptance_lengths)
    lossless = None
    mismatch = None
    kind = None
    if temperature <= 0:
        mismatch = _mismatch(spec.tokens, baseline.tokens, tokenizer)
        lossless = mismatch is None
        if mismatch is not None:
            verdict = classify_difference(spec, baseline.tokens, mismatch["position"],
                                          margin=numerics_margin(torch.float32) if margin is None else margin)
            mismatch.update(verdict)
            kind = verdict["kind"]
    stops = set(stop_token_ids)
    answer = [t for t in spec.tokens if t not in stops]
    output = tokenizer.decode(answer, skip_special_tokens=True) if tokenizer is not None else ""
    return RequestResult(
        id=prompt.id, turn=turn, category=prompt.category, domain=prompt.domain, prompt_tokens=prompt_tokens,
        tokens=len(spec.tokens), steps=steps,
        tau=sum(spec.acceptance_lengths) / steps if steps else None,
        acceptance_lengths=list(spec.acceptance_lengths), lossless=lossless, first_mismatch=mismatch,
        mismatch_kind=kind,
        target_decode_s=baseline.decode_s, spec_decode_s=spec.decode_s,
        target_decode_tokens=baseline.decode_tokens, spec_decode_tokens=spec.decode_tokens,
        output=output, prompt_text=prompt.turns[turn], trace=acceptance_trace(spec, tokenizer), timing=timing)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if tokens and seconds > 0 else None


def summarize(requests: Sequence[RequestResult], *, block_size: int, temperature: float,
              speedup: SpeedupMeasurement | None = None) -> dict[str, Any]:
    """Summary of requests: tau (mean of per-request means), histogram over 1..B, tokens/s and
    the fields of the ``speedup`` measurement (paired timings, see :mod:`dflash_trainer.evaluation.speedup`).

    Without a measurement ``speedup`` is None: decode rates timed apart are never divided.
    """
    taus = [r.tau for r in requests if r.tau is not None]
    hist = [0] * block_size
    for r in requests:
        for a in r.acceptance_lengths:
            assert 1 <= a <= block_size, f"acceptance length {a} outside 1..{block_size}"
            hist[a - 1] += 1
    steps = sum(hist)
    target_tps = _rate(sum(r.target_decode_tokens for r in requests), sum(r.target_decode_s for r in requests))
    spec_tps = _rate(sum(r.spec_decode_tokens for r in requests), sum(r.spec_decode_s for r in requests))
    by_category: dict[str, list[float]] = {}
    for r in requests:
        if r.tau is not None:
            by_category.setdefault(r.category or "-", []).append(r.tau)
    checked = [r for r in requests if r.lossless is not None]
    numerics = [r for r in checked if r.lossless is False and r.mismatch_kind == NUMERICS]
    failures = [r for r in checked if r.lossless is False and r.mismatch_kind != NUMERICS]
    speedup_fields = speedup.summary_fields() if speedup is not None else {
        "speedup": None, "speedup_reliable": None, "speedup_unreliable_reasons": [], "speedup_measurement": None}
    return {
        "tau": _mean(taus),
        "acceptance_hist": hist,
        "acceptance_hist_frac": [c / steps for c in hist] if steps else [0.0] * block_size,
        "tau_by_category": {k: _mean(v) for k, v in sorted(by_category.items())},
        **speedup_fields,
        "target_tokens_per_s": target_tps,
        "spec_tokens_per_s": spec_tps,
        "lossless": (not failures) if checked else None,
        "lossless_failures": len(failures),
        "lossless_numerics": len(numerics),
        "lossless_identical": len(checked) - len(failures) - len(numerics),
        "requests": len(requests),
        "prompts": len({r.id for r in requests}),
        "steps": steps,
        "tokens": sum(r.tokens for r in requests),
        "block_size": block_size,
        "temperature": temperature,
    }


def domain_summaries(requests: Sequence[RequestResult], *, block_size: int, temperature: float,
                     speedup: SpeedupMeasurement | None = None) -> dict[str, dict[str, Any]]:
    """:func:`summarize` of each suite domain's requests, in the order the domains first appear;
    empty when no request has a domain. A domain's speedup comes from its own pairs, under the
    thread count and the load readings of the whole run's ``speedup`` measurement."""
    by_domain: dict[str, list[RequestResult]] = {}
    for r in requests:
        if r.domain is not None:
            by_domain.setdefault(r.domain, []).append(r)
    out = {}
    for domain, subset in by_domain.items():
        measurement = None
        timings = [r.timing for r in subset if r.timing is not None]
        if speedup is not None and timings:
            measurement = SpeedupMeasurement.from_pairs(timings, threads=speedup.threads, cpus=speedup.cpus,
                                                        before=speedup.before, after=speedup.after)
        out[domain] = summarize(subset, block_size=block_size, temperature=temperature, speedup=measurement)
    return out


def evaluate_prompts(drafter: nn.Module, target: nn.Module, tokenizer: Any, prompts: Sequence[EvalPrompt], *,
                     max_new_tokens: int, temperature: float = 0.0, thinking: bool = False,
                     stop_token_ids: Sequence[int] | None = None, warmup: bool = True,
                     log: Callable[[str], None] | None = None, timer: PairedTimer | None = None) -> EvalReport:
    """Decode every turn of every prompt with the target alone and speculatively, back to back.

    Turn k + 1 follows the speculative answer to turn k. ``warmup`` first runs both decoders
    briefly on the first prompt so one-time costs (allocation, kernel setup) stay out of the
    timings. ``timer`` sets the threads, clock and load probe of the paired timings (default:
    the cores free at the start, ``time.perf_counter``, the OS's load figures).
    """
    device = next(target.parameters()).device
    stops = list(stop_token_ids) if stop_token_ids is not None else end_of_turn_ids(
        tokenizer, getattr(target, "generation_config", None))
    block_size = int(drafter.block_size)
    requests: list[RequestResult] = []
    total = sum(len(p.turns) for p in prompts)
    margin = numerics_margin(next(target.parameters()).dtype)
    with (timer or PairedTimer()).run() as run:
        if log is not None:
            log(f"timing: {run.threads} torch thread{'s' if run.threads > 1 else ''} on {run.cpus} cores "
                f"(other work before: {_fmt(run.before.others_running, '.1f')} runnable threads, "
                f"1-min load {_fmt(run.before.load_1m, '.2f')})")
        if warmup and prompts:
            ids = _prompt_ids(tokenizer, prompts[0], [], 0, thinking, device)
            short = min(max_new_tokens, 2 * block_size)
            target_generate(target, ids, max_new_tokens=short, stop_token_ids=stops, temperature=temperature)
            speculative_generate(drafter, target, ids, max_new_tokens=short, stop_token_ids=stops,
                                 temperature=temperature)
        for prompt in prompts:
            answers: list[str] = []
            for turn in range(len(prompt.turns)):
                ids = _prompt_ids(tokenizer, prompt, answers, turn, thinking, device)
                baseline, spec, timing = decode_request(run, drafter, target, ids, max_new_tokens=max_new_tokens,
                                                        stop_token_ids=stops, temperature=temperature)
                result = request_result(prompt, turn, ids.shape[1], baseline, spec, temperature=temperature,
                                        tokenizer=tokenizer, stop_token_ids=stops, timing=timing, margin=margin)
                answers.append(result.output)
                requests.append(result)
                if log is not None:
                    tau = f"{result.tau:.2f}" if result.tau is not None else "-"
                    status = ("sampled" if result.lossless is None else "lossless" if result.lossless
                              else "differs by numerics" if result.mismatch_kind == NUMERICS else "WRONG ACCEPTANCE")
                    first = "target" if timing.target_first else "speculative"
                    log(f"[{len(requests)}/{total}] {prompt.id} turn {turn + 1}: {result.tokens} tokens, "
                        f"{result.steps} steps, tau {tau}, {status}, speedup {_fmt(result.speedup, '.2f')} "
                        f"({first} first)")
    summary = summarize(requests, block_size=block_size, temperature=temperature, speedup=run.measurement)
    summary.update(max_new_tokens=max_new_tokens, stop_token_ids=stops, device=str(device),
                   dtype=str(next(target.parameters()).dtype).removeprefix("torch."))
    domains = domain_summaries(requests, block_size=block_size, temperature=temperature, speedup=run.measurement)
    if domains:
        summary["domains"] = domains
    return EvalReport(summary=summary, requests=requests)


def request_messages(prompt: EvalPrompt, answers: Sequence[str], turn: int) -> list[dict[str, str]]:
    """The chat messages of one request: the system prompt, then the user turns up to ``turn``
    with the earlier ``answers`` between them."""
    messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
    for k in range(turn + 1):
        messages.append({"role": "user", "content": prompt.turns[k]})
        if k < turn:
            messages.append({"role": "assistant", "content": answers[k]})
    return messages


def _prompt_ids(tokenizer: Any, prompt: EvalPrompt, answers: list[str], turn: int, thinking: bool,
                device: torch.device) -> torch.Tensor:
    return torch.tensor([render_prompt(tokenizer, request_messages(prompt, answers, turn), thinking=thinking)],
                        device=device)


# --- outputs --------------------------------------------------------------------------------

def write_results(report: EvalReport, out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``results.json`` and ``acceptance_hist.png`` into ``out_dir``; return both paths."""
    from matplotlib.figure import Figure  # no pyplot: the process-wide backend stays untouched

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "results.json"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report.to_json(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(json_path)

    s = report.summary
    fig = Figure(figsize=(7.0, 4.0), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    tau = f"{s['tau']:.3f}" if s["tau"] is not None else "n/a"
    # One bar group per suite domain (each domain's own fractions), else the run's histogram.
    groups = {f"{name} (tau {_fmt(d['tau'])})": d["acceptance_hist_frac"] for name, d in s.get("domains", {}).items()}
    groups = groups or {"": s["acceptance_hist_frac"]}
    width = 0.8 / len(groups)
    lengths = range(1, len(s["acceptance_hist_frac"]) + 1)
    for k, (label, fractions) in enumerate(groups.items()):
        offset = (k - (len(groups) - 1) / 2) * width
        ax.bar([x + offset for x in lengths], fractions, width=width, label=label or None,
               color=None if len(groups) > 1 else "#3b6ea8")
    if len(groups) > 1:
        ax.legend()
    ax.set_xticks(list(lengths))
    ax.set_xlabel("tokens committed per verify step (accepted drafts + 1)")
    ax.set_ylabel("fraction of steps")
    ax.set_title(f"Acceptance length: tau {tau}, {s['steps']} steps, {s['requests']} requests")
    ax.grid(True, axis="y", alpha=0.3)
    png_path = out / "acceptance_hist.png"
    fig.savefig(png_path)
    return json_path, png_path


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return format(value, spec) if value is not None else "n/a"


def domain_table(summary: dict[str, Any]) -> list[str]:
    """The per-domain lines of a suite's console summary: prompts, tokens, tau, speedup, lossless."""
    lines = [f"{'domain':<20} {'prompts':>7} {'tokens':>7} {'steps':>6} {'tau':>7} {'speedup':>8} lossless"]
    rows = [*summary["domains"].items(), ("all", summary)]
    for name, d in rows:
        lossless = "-" if d["lossless"] is None else f"{d['requests'] - d['lossless_failures']}/{d['requests']}"
        speedup = _fmt(d["speedup"], ".2f") + ("*" if d.get("speedup_reliable") is False else "")
        lines.append(f"{name:<20} {d['prompts']:>7} {d['tokens']:>7} {d['steps']:>6} {_fmt(d['tau']):>7} "
                     f"{speedup:>8} {lossless}")
    hist = "; ".join(f"{name} " + " ".join(f"{k + 1}:{f * 100:.0f}%" for k, f in enumerate(d["acceptance_hist_frac"])
                                           if f > 0) for name, d in summary["domains"].items())
    lines.append(f"acceptance length histogram per domain: {hist}")
    if any(d.get("speedup_reliable") is False for _, d in rows):
        lines.append("* unreliable speedup (see the reasons below)")
    return lines


def print_summary(report: EvalReport, file: Any = None) -> None:
    """Console table: tau per category and overall, histogram, throughput, lossless result."""
    file = file or sys.stdout
    s = report.summary
    counts: dict[str, int] = {}
    for r in report.requests:
        counts[r.category or "-"] = counts.get(r.category or "-", 0) + 1
    lines = [f"speculative decoding: {s['requests']} requests ({s['prompts']} prompts), block {s['block_size']}, "
             f"temperature {s['temperature']:g}, max_new_tokens {s['max_new_tokens']}"]
    if s.get("domains"):
        lines += domain_table(s)
    lines.append(f"{'category':<20} {'requests':>8} {'tau':>7}")
    for category, tau in s["tau_by_category"].items():
        lines.append(f"{category:<20} {counts.get(category, 0):>8} {_fmt(tau):>7}")
    lines.append(f"{'all':<20} {s['requests']:>8} {_fmt(s['tau']):>7}")
    hist = " ".join(f"{k + 1}:{f * 100:.1f}%" for k, f in enumerate(s["acceptance_hist_frac"]) if f > 0)
    lines.append(f"acceptance length histogram: {hist or 'no steps'}")
    speedup = format_speedup(s["speedup"], s.get("speedup_reliable"), s.get("speedup_unreliable_reasons"))
    lines.append(f"decode tokens/s (prefill excluded): target {_fmt(s['target_tokens_per_s'], '.1f')}, "
                 f"speculative {_fmt(s['spec_tokens_per_s'], '.1f')}, speedup {speedup}")
    if s.get("speedup_measurement") is not None:
        lines.append(f"speedup measured: {describe_measurement(s['speedup_measurement'])}")
        pays = pay_off_line(s["speedup"], s["speedup_measurement"].get("step_cost"), s.get("tau"))
        if pays is not None:
            lines.append(pays)
    if s["lossless"] is None:
        lines.append("lossless: not checked (temperature > 0: outputs are samples)")
    else:
        checked = sum(r.lossless is not None for r in report.requests)
        numerics = len(report.numerics)
        lines.append(f"lossless: {checked - s['lossless_failures'] - numerics}/{checked} requests identical to "
                     f"the target's greedy output, {numerics} differ by numerics (a near tie within "
                     f"{_margin_text(report)} logits, the speculative path on its verify's argmax), "
                     f"{s['lossless_failures']} wrong acceptance(s)")
    for r in report.numerics:
        lines.append(_difference_line("numerics", r))
    for r in report.failures:
        lines.append(_difference_line("WRONG ACCEPTANCE", r))
    print("\n".join(lines), file=file, flush=True)


def _margin_text(report: EvalReport) -> str:
    margins = {(r.first_mismatch or {}).get("margin") for r in report.requests if r.lossless is False}
    margins.discard(None)
    return "/".join(f"{m:g}" for m in sorted(margins)) or "the margin of"


def _difference_line(label: str, r: RequestResult) -> str:
    m = r.first_mismatch or {}
    gap = "" if m.get("logit_gap") is None else f" (gap {m['logit_gap']:.3f}, margin {m['margin']:g})"
    return (f"{label} {r.id} turn {r.turn + 1}: first difference at generated token {m.get('position')}: "
            f"speculative {m.get('speculative')} vs target {m.get('target')}; {m.get('why')}{gap}; "
            f"prompt {r.prompt_text[:200]!r}")


# --- in-training evaluation -----------------------------------------------------------------

class InTrainingEval:
    """Greedy speculative decoding on a small fixed prompt set, for the training loop.

    Built once from rendered prompts (token ids). Every call decodes each prompt with the
    target alone (the lossless reference and the baseline timing) and speculatively, back to
    back (:mod:`dflash_trainer.evaluation.speedup`): a baseline timed at another moment, under other load,
    is never divided into a speedup. A call returns ``eval/tau``, ``eval/acceptance_hist`` (step
    counts for acceptance lengths 1..B), ``eval/lossless`` (1 if every output equals the
    target's greedy output, else 0), ``eval/speedup``, ``eval/speedup_reliable`` (1 or 0) and
    ``eval/spec_tokens_per_s``. The drafter is switched to eval mode under ``no_grad`` and
    returned to its previous mode. :attr:`last_requests` keeps the per-prompt results of the
    latest call (with texts given a ``tokenizer``), for an evaluation file's ``per_prompt``
    list, and :attr:`last_speedup` its speedup measurement.
    """

    def __init__(self, target: nn.Module, inputs: Sequence[Sequence[int]], *, max_new_tokens: int,
                 stop_token_ids: Sequence[int], tokenizer: Any = None,
                 prompt_texts: Sequence[str] | None = None, timer: PairedTimer | None = None) -> None:
        if not inputs or not all(len(ids) > 0 for ids in inputs):
            raise ValueError("InTrainingEval needs at least one non-empty prompt")
        self.target = target
        self.device = next(target.parameters()).device
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = list(stop_token_ids)
        self.tokenizer = tokenizer
        texts = list(prompt_texts) if prompt_texts is not None else [""] * len(inputs)
        self.prompts = [EvalPrompt(id=f"train-eval-{i}", turns=[text]) for i, text in enumerate(texts)]
        self.timer = timer or PairedTimer()
        self.last_requests: list[RequestResult] = []
        self.last_speedup: SpeedupMeasurement | None = None
        self.last_block_size: int | None = None
        self.inputs = [torch.tensor([list(ids)], dtype=torch.long, device=self.device) for ids in inputs]
        target_generate(target, self.inputs[0], max_new_tokens=min(max_new_tokens, 8),
                        stop_token_ids=self.stop_token_ids)  # warm-up, not timed

    @classmethod
    def from_prompts(cls, target: nn.Module, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int,
                     thinking: bool = False) -> InTrainingEval:
        """Single-turn user prompts rendered with the tokenizer's chat template; the stop tokens
        are the tokenizer's end-of-turn ids."""
        inputs = [render_prompt(tokenizer, [{"role": "user", "content": p}], thinking=thinking) for p in prompts]
        stops = end_of_turn_ids(tokenizer, getattr(target, "generation_config", None))
        return cls(target, inputs, max_new_tokens=max_new_tokens, stop_token_ids=stops, tokenizer=tokenizer,
                   prompt_texts=prompts)

    @classmethod
    def from_config(cls, cfg: Config, target: nn.Module, tokenizer: Any) -> InTrainingEval:
        """First turns of the first ``eval.in_training_prompts`` prompts of ``eval.prompts``
        (MT-Bench, held-out ShareGPT or a file), ``eval.max_new_tokens`` each."""
        prompts = load_prompts(cfg, limit=cfg.eval.in_training_prompts, first_turn_only=True)
        return cls.from_prompts(target, tokenizer, [p.turns[0] for p in prompts],
                                max_new_tokens=cfg.eval.max_new_tokens, thinking=cfg.data.thinking)

    def __call__(self, drafter: nn.Module) -> dict[str, Any]:
        """Evaluate ``drafter`` (or a DDP wrapper around it) on the fixed prompts."""
        module = getattr(drafter, "module", drafter)  # DDP keeps the drafter in .module
        param = next(module.parameters())
        if param.device != self.device:
            raise ValueError(f"InTrainingEval: the drafter is on {param.device}, the target on {self.device}")
        requests = []
        # speculative_generate switches the drafter to eval mode and restores its mode after.
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False), self.timer.run() as run:
            for prompt, ids in zip(self.prompts, self.inputs):
                baseline, spec, timing = decode_request(run, module, self.target, ids,
                                                        max_new_tokens=self.max_new_tokens,
                                                        stop_token_ids=self.stop_token_ids)
                requests.append(request_result(prompt, 0, ids.shape[1], baseline, spec, temperature=0.0,
                                               tokenizer=self.tokenizer, stop_token_ids=self.stop_token_ids,
                                               timing=timing, margin=numerics_margin(param.dtype)))
        self.last_requests = requests
        self.last_speedup = run.measurement
        self.last_block_size = int(module.block_size)
        s = summarize(requests, block_size=int(module.block_size), temperature=0.0, speedup=run.measurement)
        nan = float("nan")
        return {"eval/tau": s["tau"] if s["tau"] is not None else nan,
                "eval/acceptance_hist": s["acceptance_hist"],
                "eval/lossless": int(bool(s["lossless"])),
                "eval/lossless_numerics": s["lossless_numerics"],
                "eval/lossless_wrong_acceptances": s["lossless_failures"],
                "eval/speedup": s["speedup"] if s["speedup"] is not None else nan,
                "eval/speedup_reliable": nan if s["speedup_reliable"] is None else int(s["speedup_reliable"]),
                "eval/spec_tokens_per_s": s["spec_tokens_per_s"] if s["spec_tokens_per_s"] is not None else nan}

    def write_last(self, out_dir: Path, **fields: Any) -> tuple[Path, str]:
        """Write the latest call's results as ``eval`` writes its own (``results.json`` and
        ``acceptance_hist.png`` in ``out_dir``, where ``dflash-trainer report`` reads them), with
        ``fields`` added to the summary; the results file and a one-line summary of it."""
        assert self.last_block_size is not None, "write_last before the first call"
        summary = summarize(self.last_requests, block_size=self.last_block_size, temperature=0.0,
                            speedup=self.last_speedup)
        summary.update(max_new_tokens=self.max_new_tokens, stop_token_ids=self.stop_token_ids,
                       device=str(self.device),
                       dtype=str(next(self.target.parameters()).dtype).removeprefix("torch."), **fields)
        json_path, _ = write_results(EvalReport(summary=summary, requests=self.last_requests), out_dir)
        lossless = {True: "yes", False: "NO", None: "not checked"}[summary["lossless"]]
        source = f" {summary['prompts_source']}" if "prompts_source" in summary else ""
        speedup = format_speedup(summary["speedup"], summary["speedup_reliable"],
                                 summary["speedup_unreliable_reasons"])
        line = (f"tau {_fmt(summary['tau'])} on {summary['prompts']}{source} prompts x {self.max_new_tokens} "
                f"tokens (first turns, greedy), lossless {lossless} ({summary['lossless_identical']} identical, "
                f"{summary['lossless_numerics']} by numerics, {summary['lossless_failures']} wrong "
                f"acceptances), speedup {speedup}")
        return json_path, line


# --- command --------------------------------------------------------------------------------

def _dtype(cfg: Config, device: torch.device) -> torch.dtype:
    from dflash_trainer.model.dtypes import config_dtype

    return config_dtype(cfg.model, device)


def load_models(cfg: Config, drafter_dir: Path) -> tuple[nn.Module, nn.Module, Any, Path]:
    """(drafter, target, tokenizer, target folder) for ``cfg`` on its device and dtype.

    Raises :class:`~dflash_trainer.core.errors.CheckpointError` when ``drafter_dir`` is not an
    exported drafter or does not fit the target; target errors (``AssetError``) propagate.
    """
    from dflash_trainer.core.assets import resolve_target
    from dflash_trainer.core.distributed import resolve_device
    from dflash_trainer.model.drafter import check_compatible
    from dflash_trainer.training.export import load_drafter
    from dflash_trainer.model.target import load_target

    if os.path.lexists(drafter_dir):
        check_input(drafter_dir, what="--drafter", kind="folder", error=CheckpointError)
    if not (drafter_dir / "config.json").is_file():
        raise CheckpointError(f"--drafter {drafter_dir}: no config.json there; pass a folder written by "
                              "`dflash-trainer export` (or the run's drafter/ folder)")
    device = resolve_device(cfg.pipeline)
    dtype = _dtype(cfg, device)
    target_path = resolve_target(cfg.model.target)
    target, tokenizer = load_target(str(target_path), device=device, dtype=dtype)
    drafter = load_drafter(drafter_dir, dtype=dtype).to(device).eval()
    try:
        check_compatible(drafter.config, target.config, tokenizer=tokenizer)
    except ValueError as exc:
        raise CheckpointError(f"--drafter {drafter_dir} does not fit the target {target_path}: {exc}; pass "
                              "the target it was trained for (--target) or a drafter trained for "
                              "this one") from exc
    return drafter, target, tokenizer, target_path


def default_out_dir(cfg: Config, *, suite: bool, drafter: str | Path | None = None,
                    run_dir_given: bool = False) -> Path:
    """Where ``eval`` writes without ``--out``, next to the drafter: ``RUN_DIR/eval`` for a run's
    ``drafter/`` folder (or with ``run_dir`` given), else ``DRAFTER-eval`` beside the drafter's
    folder; for the suite its ``suite`` subfolder (beside a plain evaluation, and read by
    ``dflash-trainer report`` as ``eval/suite``)."""
    folder = Path(cfg.run_dir) / "eval"
    if drafter is not None and not run_dir_given:
        path = Path(drafter)
        run = path.parent
        in_run = path.name == "drafter" and ((run / "config.yaml").is_file() or (run / "checkpoints").is_dir())
        folder = run / "eval" if in_run else path.with_name(f"{path.name}-eval")
    return folder / ("suite" if suite else "")


def check_no_earlier_results(out_dir: Path, *, overwrite: bool) -> None:
    """Refuse (:class:`ConfigError`, before any work) a folder that holds an earlier evaluation's
    ``results.json`` unless ``overwrite``."""
    if (out_dir / "results.json").exists() and not overwrite:
        raise ConfigError(f"{out_dir} holds the results of an earlier evaluation (results.json); pass "
                          "--overwrite to replace them, or choose another folder with --out")


def use_recorded_target(cfg: Config, args: argparse.Namespace, *, command: str) -> Config:
    """``cfg`` with ``model.target`` set to the target the drafter's export recorded, when no
    target was given (``--target``, ``model.target`` in the config or an override) and that
    target is available here; said in one line."""
    if "model.target" in getattr(args, "set_keys", {"model.target"}):
        return cfg
    found = recorded_target(args.drafter)
    if found is None:
        return cfg
    target, record = found
    print(f"{command}: target {target} as recorded in {Path(args.drafter) / 'config.json'}"
          + (f" (revision {record['revision']})" if record.get("revision") else "")
          + "; --target chooses another", flush=True)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, target=target))


def main(cfg: Config, args: argparse.Namespace) -> int:
    """``dflash-trainer eval --drafter DIR [--target T] [--prompts P | --suite] [--engine E] [--out DIR]``.

    ``--suite`` evaluates the first turns of ``eval.suite_prompts`` prompts of each domain of
    ``eval.suite`` in one run and reports tau per domain; ``--engine`` then serves the same
    requests with llama.cpp and/or vLLM (:func:`compare_engines`). Exit status: 0 when every
    greedy output equals the target's, 1 on a lossless failure (or an engine's output that
    differs from its plain serving other than by its numerics), 3 or 4 when an engine could
    not run (not available, or refused the drafter). User errors (a bad prompt file or
    domain, a missing or incompatible drafter, a bad eval option) are raised as
    :class:`~dflash_trainer.core.errors.UserError` for ``cli.main`` to report with their code.
    """
    drafter_dir = Path(args.drafter)
    suite = bool(getattr(args, "suite", False))
    if args.out:
        check_output_folder(Path(args.out), what="--out")
    # A caller without the command line's set_keys gave its run_dir on purpose: write there.
    out_dir = Path(args.out) if args.out else default_out_dir(
        cfg, suite=suite, drafter=drafter_dir, run_dir_given="run_dir" in getattr(args, "set_keys", {"run_dir"}))
    check_no_earlier_results(out_dir, overwrite=bool(getattr(args, "overwrite", False)))
    cfg = use_recorded_target(cfg, args, command="eval")
    engine = getattr(args, "engine", None)
    if engine is not None:
        check_engine_option(engine, cfg)
    if suite and getattr(args, "flag_eval__prompts", None) is not None:
        raise ConfigError("--prompts and --suite exclude each other: --suite evaluates the domains of eval.suite "
                          "(choose them with eval.suite=[mtbench,humaneval,...])")
    if suite:
        domains = suite_prompts(cfg)
        prompts = [p for group in domains.values() for p in group]
        source = "suite: " + ", ".join(f"{name} ({len(group)})" for name, group in domains.items())
    else:
        prompts = load_prompts(cfg)
        source = cfg.eval.prompts
    drafter, target, tokenizer, target_path = load_models(cfg, drafter_dir)
    param = next(target.parameters())
    device, dtype = param.device, param.dtype
    torch.manual_seed(cfg.training.seed)
    print(f"eval: drafter {drafter_dir} on target {target_path} ({device}, {str(dtype).removeprefix('torch.')}), "
          f"{len(prompts)} prompts from {source}{' (first turns)' if suite else ''}, "
          f"max_new_tokens {cfg.eval.max_new_tokens}, temperature {cfg.eval.temperature:g}", flush=True)
    started = time.perf_counter()
    report = evaluate_prompts(drafter, target, tokenizer, prompts, max_new_tokens=cfg.eval.max_new_tokens,
                              temperature=cfg.eval.temperature, thinking=cfg.data.thinking,
                              log=lambda line: print(line, flush=True))
    report.summary.update(target=str(target_path), drafter=str(drafter_dir),
                          prompts_source="suite" if suite else cfg.eval.prompts, wall_s=time.perf_counter() - started)
    if suite:
        report.summary["suite"] = {name: {"source": PROMPT_SETS[name].description if name in PROMPT_SETS else path,
                                          "prompts": len(domains[name])}
                                   for name, path in zip(domains, cfg.eval.suite)}
    json_path, png_path = write_results(report, out_dir)
    save_config(cfg, out_dir)
    print_summary(report)
    print(f"eval: wrote {json_path} and {png_path}", flush=True)
    code = 1 if report.failures else 0
    if engine is not None:
        num_draft = int(drafter.block_size) - 1
        del drafter, target  # the engines load the target themselves: free its memory first
        gc.collect()
        engine_code = compare_engines(engine, cfg, report, prompts, tokenizer, target_path=target_path,
                                      drafter_dir=drafter_dir, num_draft=num_draft, out_dir=out_dir,
                                      domain=None if suite else prompt_source_name(cfg.eval.prompts))
        code = 1 if code or engine_code == 1 else engine_code
    return code


ENGINE_CHOICES = ("llama.cpp", "vllm", "all")


def check_engine_option(engine: str, cfg: Config) -> None:
    """Raise a :class:`ConfigError` for an ``--engine`` the comparison cannot run."""
    if engine not in ENGINE_CHOICES:
        raise ConfigError(f"--engine must be {', '.join(ENGINE_CHOICES[:-1])} or {ENGINE_CHOICES[-1]}, got {engine!r}")
    if cfg.eval.temperature > 0:
        raise ConfigError(f"--engine compares greedy outputs with and without the drafter; eval.temperature is "
                          f"{cfg.eval.temperature:g}, set eval.temperature=0")


def prompt_source_name(source: str) -> str:
    """The domain name of a prompt source: the set's name, or a file's stem."""
    return source if source in PROMPT_SETS else Path(source).stem


def compare_engines(engine: str, cfg: Config, report: EvalReport, prompts: Sequence[EvalPrompt], tokenizer: Any, *,
                    target_path: Path, drafter_dir: Path, num_draft: int, out_dir: Path, domain: str | None) -> int:
    """``eval --engine``: the evaluation's requests through each engine (plain and with the
    drafter), tau per domain beside the project's, the ``engines`` section added to
    ``results.json``; returns the engines' exit status (:func:`dflash_trainer.engines.compare.exit_code`)."""
    from dflash_trainer.engines.compare import (LABELS, EngineSettings, engine_names, exit_code, format_engines,
                                                project_domains, run_engines)
    from dflash_trainer.engines.llama_cpp_build import default_folder
    from dflash_trainer.engines.serve_llama_cpp import LlamaCppOptions
    from dflash_trainer.model.variants import variant_of_export

    # How the engines serve the drafter: its variant's speculative type (llama.cpp) and method (vLLM).
    variant = variant_of_export(drafter_dir)
    requests = engine_requests(prompts, report, tokenizer, thinking=cfg.data.thinking, domain=domain)
    s = report.summary
    taus = {name: d["tau"] for name, d in s["domains"].items()} if s.get("domains") else {domain: s["tau"]}
    project = project_domains(report.requests, requests.domains, taus, num_draft=num_draft)
    # The embedded target ships a Q4_1 GGUF; any other target is converted, at full precision.
    target_type = cfg.eval.llama_cpp_target if cfg.model.target == "smollm2" else "f32"
    llama = LlamaCppOptions(build_dir=Path(cfg.eval.llama_cpp_build) if cfg.eval.llama_cpp_build else default_folder(),
                            target_type=target_type, spec_type=variant.llama_cpp_spec_type,
                            prunes_vocab=variant.llama_cpp_prunes_vocab,
                            threads=cfg.eval.engine_threads or os.cpu_count() or 1,
                            startup_timeout_s=cfg.eval.engine_startup_timeout_s)
    settings = EngineSettings(target_name=cfg.model.target, target_dir=Path(target_path), drafter=drafter_dir,
                              num_draft=num_draft, max_tokens=cfg.eval.max_new_tokens, dtype=s["dtype"], llama=llama,
                              vllm_venv=Path(cfg.eval.vllm_venv).absolute(), vllm_method=variant.vllm_method,
                              startup_timeout_s=cfg.eval.engine_startup_timeout_s)
    names = engine_names(engine)
    print(f"eval: the same {len(requests.prompt_ids)} requests through {', '.join(LABELS[n] for n in names)}, "
          f"plain and with the drafter (greedy, max_tokens {cfg.eval.max_new_tokens})", flush=True)
    sections = run_engines(names, requests, settings, out_dir=out_dir / "engines",
                           log=lambda line: print(f"eval: {line}", flush=True))
    report.summary["engines"] = sections
    json_path, _ = write_results(report, out_dir)
    print(format_engines(sections, project, max_tokens=cfg.eval.max_new_tokens), flush=True)
    for name, section in sections.items():
        if "error" in section:
            print(f"dflash-trainer eval: engine error: {LABELS[name]} {section['error']}", file=sys.stderr, flush=True)
    print(f"eval: wrote the engines section into {json_path} (servers' logs in {out_dir / 'engines'})", flush=True)
    return exit_code(sections)


def engine_requests(prompts: Sequence[EvalPrompt], report: EvalReport, tokenizer: Any, *, thinking: bool,
                    domain: str | None) -> EngineRequests:
    """The evaluation's requests as the engines receive them: the same messages (a later turn
    after the project's own answer to the earlier ones), rendered by the project's chat
    template, each with its domain (``domain`` for requests outside a suite)."""
    from dflash_trainer.engines.compare import EngineRequests

    conversations, ids, domains = [], [], []
    results = iter(report.requests)
    for prompt in prompts:
        answers: list[str] = []
        for turn in range(len(prompt.turns)):
            result = next(results)
            messages = request_messages(prompt, answers, turn)
            conversations.append(messages)
            ids.append(render_prompt(tokenizer, messages, thinking=thinking))
            domains.append(result.domain or domain)
            answers.append(result.output)
    return EngineRequests(conversations=conversations, prompt_ids=ids, domains=domains)
