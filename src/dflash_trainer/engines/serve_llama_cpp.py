"""The llama.cpp arm of ``make serve-check`` and ``eval --engine``: plain and speculative ``llama-server``.

Both servers run at once on 127.0.0.1 (started one after the other), each with the same thread
count; the prompts go to them alternately (plain then drafter for even prompts, drafter then
plain for odd ones), one request in flight at a time, so both arms of every pair run under the
same load. The 1-minute load average is recorded before and after.

Per prompt: the token ids with and without the drafter, and where they differ, the first
differing position with the target's top candidates there from both servers (each asked again
with ``n_probs``): :func:`classify_difference` tells the engine's numerics (a batched verify
ranks two near-equal candidates differently from single-token decoding) from a wrong
acceptance (a token the verifier's own logits do not rank first).

Cost model, from the servers' own decode clocks: one plain step costs ``plain_ms`` per token;
one speculative step (draft + verify) costs ``step_ms``; a drafter committing ``tau`` tokens per
step gives a speedup of ``tau * plain_ms / step_ms``, so it pays from ``tau = step_ms /
plain_ms`` on (break-even), and reaches 1.3x and 2x at 1.3 and 2 times that.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from dflash_trainer.core.ties import top_ties
from dflash_trainer.engines.llama_cpp_build import SDIST_PIN, ensure_built
from dflash_trainer.engines.llama_cpp_server import (DEFAULT_SPEC_TYPE, LlamaCompletion, complete, convert,
                                                     converted_drafter, server_command)
from dflash_trainer.engines.vllm_server import ServerError, VllmServer, free_port

NEAR_TIE = 0.01
"""Top-2 log-probability margin (nats) under which a differing output of a float target is the
engine's rounding, when the speculative server reports no candidates at that position."""
NEAR_TIE_QUANTIZED = 0.15
"""The same for a quantized target (Q4_1, Q8_0, ...): llama.cpp quantizes the activations of a
batched matmul differently from a single token's, and the log-probabilities of the same
candidates moved by up to 0.13 nats between the two servers at a differing position of the
shipped Q4_1 SmolLM2 (measured with both servers' ``n_probs``)."""
FLOAT_TYPES = ("f32", "f16", "bf16")
SCATTER_BOUND = 1.5
"""Per-prompt step costs whose max/min exceeds this mark the speedup unreliable."""
MIN_STEPS = 4
"""Prompts with fewer verify steps (or plain tokens) are left out of the scatter check."""


class ConversionRefused(ServerError):
    """llama.cpp cannot take this export as it is (known before converting, no server started)."""


@dataclass(kw_only=True)
class LlamaCppOptions:
    """What the llama.cpp arm serves and how."""

    build_dir: Path
    target_type: str = "q4_1"
    """``q4_1``: the GGUF the embedded target ships; ``f32``: the HF folder converted."""
    drafter_type: str = "f32"
    """``convert_hf_to_gguf.py --outtype`` of the drafter: f32, bf16 or q8_0."""
    draft_n_max: int | None = None
    """``--spec-draft-n-max``; default the drafter's block size - 1."""
    spec_type: str = DEFAULT_SPEC_TYPE
    """``--spec-type`` of the drafter server: the drafter's variant's ``llama_cpp_spec_type``,
    chosen by the caller from the export's config.json."""
    prunes_vocab: bool = False
    """Whether llama.cpp's converter converts the drafter's pruned draft vocabulary (the
    ``d2t`` table): the drafter's variant's ``llama_cpp_prunes_vocab``, chosen by the caller."""
    threads: int = 2
    ctx_size: int = 2048
    startup_timeout_s: float = 300.0


def target_gguf(target_name: str, target_dir: Path, options: LlamaCppOptions, cache: Path) -> Path:
    """The target as GGUF: the shipped Q4_1 file of the embedded target, else a conversion."""
    if options.target_type == "q4_1" and target_name == "smollm2":
        from dflash_trainer.core.assets import smollm2_gguf

        return smollm2_gguf()
    return convert(target_dir, cache / f"target-{target_dir.name}-{options.target_type}.gguf",
                   build_dir=options.build_dir, outtype=options.target_type, log_path=cache / "convert.log")


def _load() -> float:
    return os.getloadavg()[0]


def compare(plain: LlamaCompletion, spec: LlamaCompletion) -> int | None:
    """First position where the two outputs differ, None when identical."""
    for i, (a, b) in enumerate(zip(plain.token_ids, spec.token_ids)):
        if a != b:
            return i
    if len(plain.token_ids) != len(spec.token_ids):
        return min(len(plain.token_ids), len(spec.token_ids))
    return None


def verify_steps(c: LlamaCompletion) -> int:
    """Verify steps of a completion: after the prefill's token, each step commits its accepted
    drafts + 1 token (a step that drafted nothing commits 1, as a plain decode step)."""
    return max(0, c.decode_tokens - 1 - c.draft_accepted)


def cost_model(plain_ms_per_token: float | None, step_ms: float | None) -> dict[str, float | None]:
    """Break-even tau and the tau for 1.3x and 2x from the two measured step costs."""
    if not plain_ms_per_token or not step_ms:
        return {"break_even_tau": None, "tau_for_1.3x": None, "tau_for_2x": None, "step_cost_ratio": None}
    ratio = step_ms / plain_ms_per_token
    return {"step_cost_ratio": ratio, "break_even_tau": ratio, "tau_for_1.3x": 1.3 * ratio, "tau_for_2x": 2 * ratio}


def run_llama_cpp(*, target_name: str, target_dir: Path, drafter: Path, prompt_ids: Sequence[list[int]],
                  prompts: Sequence[str], max_tokens: int, num_draft: int, options: LlamaCppOptions,
                  out_dir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Serve, alternate, compare; the llama.cpp section of the serve-check result."""
    draft_vocab = json.loads((drafter / "config.json").read_text(encoding="utf-8")).get("draft_vocab_size")
    if draft_vocab is not None and not options.prunes_vocab:
        # Its converter maps no d2t tensor for this architecture ("Can not map tensor 'model.d2t'").
        raise ConversionRefused(f"llama.cpp's convert_hf_to_gguf.py does not convert {drafter}'s pruned draft "
                                f"vocabulary (draft_vocab_size {draft_vocab}, d2t) for this drafter's "
                                "architecture; serve it with vLLM, or train without model.draft_vocab_size "
                                "for llama.cpp")
    binary = ensure_built(options.build_dir, log=log)
    cache = options.build_dir / "models"
    cache.mkdir(parents=True, exist_ok=True)
    model = target_gguf(target_name, target_dir, options, cache)
    log(f"llama.cpp: converting the drafter with llama.cpp's convert_hf_to_gguf.py ({options.drafter_type})")
    draft = converted_drafter(drafter, target_dir, cache, build_dir=options.build_dir, outtype=options.drafter_type)
    n_max = options.draft_n_max or num_draft
    servers = {}
    for label, draft_model in (("plain", None), ("drafter", draft)):
        port = free_port()
        command = server_command(binary, model, port=port, draft=draft_model, draft_n_max=n_max,
                                 threads=options.threads, ctx_size=options.ctx_size, spec_type=options.spec_type)
        servers[label] = VllmServer(command, port=port, log_path=out_dir / f"llama-cpp-{label}.log",
                                    name="llama-server")
    try:
        for label, server in servers.items():
            log(f"llama.cpp: starting llama-server {label} on {server.url} (log {server.log_path})")
            server.start()
            server.wait_ready(options.startup_timeout_s)
        rows = _alternate(servers, prompt_ids, prompts, max_tokens=max_tokens, n_max=n_max,
                          target_type=options.target_type, log=log)
    finally:
        for server in servers.values():
            server.stop()
    return _summarize(rows, model=model, draft=draft, n_max=n_max, options=options)


def _alternate(servers: dict[str, VllmServer], prompt_ids: Sequence[list[int]], prompts: Sequence[str], *,
               max_tokens: int, n_max: int, target_type: str, log: Callable[[str], None]) -> dict[str, Any]:
    load_before = _load()
    pairs = []
    with httpx.Client(timeout=httpx.Timeout(900.0, connect=10.0)) as client:
        for server in servers.values():  # one-time costs (allocation, first graph) stay out of the timing
            complete(client, server.url, prompt_ids[0], max_tokens=8)
        for i, ids in enumerate(prompt_ids):
            order = ("plain", "drafter") if i % 2 == 0 else ("drafter", "plain")
            done = {label: complete(client, servers[label].url, ids, max_tokens=max_tokens) for label in order}
            plain, spec = done["plain"], done["drafter"]
            position = compare(plain, spec)
            verdict: dict[str, Any] = {"top2_margin": None, "near_tie": False}
            if position is not None and position < min(len(plain.token_ids), len(spec.token_ids)):
                tops = {label: _candidates_at(client, servers[label].url, ids, position) for label in servers}
                verdict = classify_difference(plain_top=tops["plain"], spec_top=tops["drafter"],
                                              spec_token=spec.token_ids[position], target_type=target_type)
            steps = verify_steps(spec)
            pairs.append({"index": i, "prompt": prompts[i], "order": list(order), "identical": position is None,
                          "first_difference": position, **verdict, "steps": steps,
                          "tau": (spec.decode_tokens - 1) / steps if steps else None,
                          "plain": asdict(plain), "drafter": asdict(spec)})
            log(f"llama.cpp: [{i + 1}/{len(prompt_ids)}] plain {plain.tokens_per_s or 0:.1f} tok/s, "
                f"drafter {spec.tokens_per_s or 0:.1f} tok/s, {'identical' if position is None else 'DIFFERS'}")
    return {"pairs": pairs, "load_before": load_before, "load_after": _load()}


def _candidates_at(client: httpx.Client, url: str, prompt_ids: list[int], position: int) -> list[tuple[int, float]]:
    """A server's top-3 candidates (id, log-probability) at ``position`` of its greedy output,
    or [] where it reports none (llama-server reports none for some accepted drafts)."""
    probed = complete(client, url, prompt_ids, max_tokens=position + 1, n_probs=3)
    top = probed.top_logprobs or []
    return top[position] if len(top) > position else []


def classify_difference(*, plain_top: Sequence[tuple[int, float]], spec_top: Sequence[tuple[int, float]],
                        spec_token: int, target_type: str) -> dict[str, Any]:
    """Whether a speculative output's first difference from plain decoding is the engine's
    numerics (``near_tie``) or a wrong acceptance, and why (``verdict``).

    With the speculative server's own candidates at that position: numerics when its emitted
    token is its own top candidate (the verify accepted what its logits ranked first) and plain
    decoding's token is among its candidates (two candidates ranked differently by a batched and
    a single-token forward). Without them: the plain top-2 margin against :data:`NEAR_TIE`
    (float targets) or :data:`NEAR_TIE_QUANTIZED` (quantized ones)."""
    margin = plain_top[0][1] - plain_top[1][1] if len(plain_top) >= 2 else None
    plain_token = plain_top[0][0] if plain_top else None
    if spec_top:
        spec_margin = spec_top[0][1] - spec_top[1][1] if len(spec_top) >= 2 else None
        # A token tied with the top candidate is ranked first whichever of the two is listed first.
        ranked_first = spec_token in top_ties(spec_top)
        numerics = ranked_first and plain_token in {token for token, _ in spec_top}
        if numerics:
            why = (f"the verify batch ranks token {spec_token} first by {spec_margin:.4f} nats, single-token "
                   f"decoding ranks token {plain_token} first by {margin:.4f}")
        elif not ranked_first:
            why = f"token {spec_token} was accepted although the verify's own logits rank {spec_top[0][0]} first"
        else:
            why = f"plain decoding's token {plain_token} is not among the verify's candidates"
        return {"top2_margin": margin, "spec_top2_margin": spec_margin, "near_tie": numerics, "verdict": why}
    bound = NEAR_TIE if target_type.lower() in FLOAT_TYPES else NEAR_TIE_QUANTIZED
    near = margin is not None and margin < bound
    why = (f"plain top-2 margin {margin:.4f} nats {'<' if near else '>='} {bound} ({target_type} target; the "
           f"speculative server reports no candidates there)" if margin is not None else "no candidates reported")
    return {"top2_margin": margin, "spec_top2_margin": None, "near_tie": near, "verdict": why}


def pair_totals(pairs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Pooled acceptance and decode tokens/s (ratios of sums) of some prompt pairs: all of a
    run's, or one domain's."""
    plain_ms = sum(p["plain"]["decode_ms"] for p in pairs)
    plain_n = sum(p["plain"]["decode_tokens"] for p in pairs)
    spec_ms = sum(p["drafter"]["decode_ms"] for p in pairs)
    spec_n = sum(p["drafter"]["decode_tokens"] for p in pairs)
    steps = sum(p["steps"] for p in pairs)
    drafted = sum(p["drafter"]["draft_n"] for p in pairs)
    accepted = sum(p["drafter"]["draft_accepted"] for p in pairs)
    plain_tps = plain_n / plain_ms * 1000 if plain_ms else None
    spec_tps = spec_n / spec_ms * 1000 if spec_ms else None
    return {"acceptance": {"pooled_tau": (spec_n - len(pairs)) / steps if steps else None, "verify_steps": steps,
                           "drafted": drafted, "accepted": accepted,
                           "accept_rate": accepted / drafted if drafted else None},
            "plain_tokens_per_s": plain_tps, "drafter_tokens_per_s": spec_tps,
            "speedup": spec_tps / plain_tps if spec_tps and plain_tps else None}


def _summarize(rows: dict[str, Any], *, model: Path, draft: Path, n_max: int,
               options: LlamaCppOptions) -> dict[str, Any]:
    pairs = rows["pairs"]
    plain_ms = sum(p["plain"]["decode_ms"] for p in pairs)
    plain_steps = sum(max(0, p["plain"]["decode_tokens"] - 1) for p in pairs)
    spec_ms = sum(p["drafter"]["decode_ms"] for p in pairs)
    steps = sum(p["steps"] for p in pairs)
    ratios = [(p["drafter"]["decode_tokens"] / p["drafter"]["decode_ms"])
              / (p["plain"]["decode_tokens"] / p["plain"]["decode_ms"])
              for p in pairs if p["drafter"]["decode_ms"] and p["plain"]["decode_ms"] and p["plain"]["decode_tokens"]]
    # A prompt's speedup follows its acceptance; the cost of one step in plain steps should not.
    costs = [(p["drafter"]["decode_ms"] / p["steps"]) / (p["plain"]["decode_ms"] / (p["plain"]["decode_tokens"] - 1))
             for p in pairs if p["steps"] >= MIN_STEPS and p["plain"]["decode_tokens"] > MIN_STEPS
             and p["plain"]["decode_ms"] > 0]
    reasons = []
    cores = os.cpu_count() or 1
    busy = max(rows["load_before"], rows["load_after"]) - options.threads
    if busy > 0.5 * cores:
        reasons.append(f"load average {max(rows['load_before'], rows['load_after']):.2f} beyond the server's "
                       f"{options.threads} threads on {cores} cores")
    if costs and min(costs) > 0 and max(costs) / min(costs) > SCATTER_BOUND:
        reasons.append(f"scatter: per-prompt step cost varies {max(costs) / min(costs):.2f}x "
                       f"({min(costs):.2f}..{max(costs):.2f} plain steps; bound {SCATTER_BOUND}x)")
    differing = [p for p in pairs if not p["identical"]]
    return {
        "engine": f"llama.cpp from {SDIST_PIN} (CPU, {options.threads} threads)",
        "target_gguf": model.name, "target_type": options.target_type, "drafter_gguf": draft.name,
        "drafter_type": options.drafter_type, "draft_n_max": n_max, "spec_type": options.spec_type,
        "pairs": pairs, "identical": len(pairs) - len(differing), "near_ties": sum(p["near_tie"] for p in differing),
        **pair_totals(pairs),
        "speedup_per_prompt": ratios, "step_cost_per_prompt": costs,
        "speedup_per_prompt_median": statistics.median(ratios) if ratios else None,
        "speedup_reliable": not reasons, "speedup_unreliable_reasons": reasons,
        "load_before": rows["load_before"], "load_after": rows["load_after"],
        "cost": {"plain_ms_per_token": plain_ms / plain_steps if plain_steps else None,
                 "step_ms": spec_ms / steps if steps else None,
                 **cost_model(plain_ms / plain_steps if plain_steps else None, spec_ms / steps if steps else None)},
    }
