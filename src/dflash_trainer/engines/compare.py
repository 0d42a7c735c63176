"""Each engine's acceptance per domain beside the project's loop, and the engine runs of ``eval --engine``.

Per domain and engine (:func:`llama_cpp_domains`, :func:`vllm_domains`): the engine's tau from
its own counts (llama.cpp: decode tokens per verify step of the drafter server, pooled over the
domain's prompts; vLLM: 1 + accepted / drafts from its ``/metrics``), how many outputs equal
plain serving's, tokens/s plain and with the drafter, their ratio, and the load average
recorded around the engine's run. :func:`format_domains` prints them next to the project's tau.

:func:`run_engines` serves the same requests through each named engine
(:mod:`~dflash_trainer.engines.serve_llama_cpp`, :mod:`~dflash_trainer.engines.serve_vllm`). An
engine that cannot run (not built, its venv missing, a server that refuses the drafter) gives
its section an ``error`` (the reason and the end of its log) and an ``exit_code`` (3: could not
be built or is not installed, 4: refused the drafter or did not start), and the next engine
still runs. :func:`exit_code` is 1 when an output differs from plain serving other than by the
engine's numerics (llama.cpp's near-ties of the target's top-2 tokens).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from dflash_trainer.engines.llama_cpp_build import BuildError
from dflash_trainer.engines.serve_llama_cpp import LlamaCppOptions, pair_totals, run_llama_cpp
from dflash_trainer.engines.serve_vllm import (ServedRun, VllmOptions, completions_tokens_per_s,
                                               same_output, serve_vllm)
from dflash_trainer.engines.vllm_env import VLLM_PIN, InstallError, is_installed
from dflash_trainer.engines.vllm_server import ServerError

ENGINES = ("llama.cpp", "vllm")
"""The engines ``--engine`` names (``all`` is both)."""
LABELS = {"llama.cpp": "llama.cpp", "vllm": "vLLM"}
EXIT_MISMATCH, EXIT_INSTALL, EXIT_SERVER = 1, 3, 4


def engine_names(choice: str) -> list[str]:
    """The engines of an ``--engine`` value: one name, or ``all``."""
    return list(ENGINES) if choice == "all" else [choice]


def acceptance_from_lengths(lengths: Sequence[int], num_draft: int) -> tuple[float | None, list[float]]:
    """Pooled mean acceptance length and per-position acceptance of verify steps, defined as
    vLLM counts them: position k (0-based) is accepted when the step committed > k + 1 tokens."""
    if not lengths:
        return None, []
    steps = len(lengths)
    per_pos = [sum(1 for a in lengths if a - 1 > k) / steps for k in range(num_draft)]
    return sum(lengths) / steps, per_pos


def domain_indices(prompt_domains: Sequence[str]) -> dict[str, list[int]]:
    """Positions of each domain's prompts, domains in first-appearance order."""
    out: dict[str, list[int]] = {}
    for i, domain in enumerate(prompt_domains):
        out.setdefault(domain, []).append(i)
    return out


def project_domains(requests: Sequence[Any], prompt_domains: Sequence[str], taus: Mapping[str, float | None], *,
                    num_draft: int) -> dict[str, dict[str, Any]]:
    """Per domain, the project's loop: its tau (``taus``, the mean over requests), the pooled
    tau over all its verify steps (as the engines count) and the step count; ``requests`` are
    the evaluation's :class:`~dflash_trainer.evaluation.evaluate.RequestResult` in the order of ``prompt_domains``."""
    rows = {}
    for domain, index in domain_indices(prompt_domains).items():
        chosen = [requests[i] for i in index]
        pooled, _ = acceptance_from_lengths([a for r in chosen for a in r.acceptance_lengths], num_draft)
        rows[domain] = {"prompts": len(index), "tau": taus.get(domain), "pooled_tau": pooled,
                        "steps": sum(r.steps for r in chosen)}
    return rows


def _ratio(drafter: float | None, plain: float | None) -> float | None:
    return drafter / plain if drafter and plain else None


def llama_cpp_domains(llama: Mapping[str, Any], prompt_domains: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per domain, from the llama.cpp arm's result (:func:`run_llama_cpp`): pooled tau, outputs
    identical to plain serving (and how many of the others are the engine's numerics), decode
    tokens/s of both servers by their own clocks, speedup, load."""
    rows = {}
    for domain, index in domain_indices(prompt_domains).items():
        pairs = [llama["pairs"][i] for i in index]
        totals = pair_totals(pairs)
        rows[domain] = {"prompts": len(pairs), "tau": totals["acceptance"]["pooled_tau"],
                        "verify_steps": totals["acceptance"]["verify_steps"],
                        "identical": sum(p["identical"] for p in pairs),
                        "engine_numerics": sum(not p["identical"] and p["near_tie"] for p in pairs),
                        "plain_tokens_per_s": totals["plain_tokens_per_s"],
                        "drafter_tokens_per_s": totals["drafter_tokens_per_s"], "speedup": totals["speedup"],
                        "load_before": llama["load_before"], "load_after": llama["load_after"]}
    return rows


def vllm_domains(spec: ServedRun, plain: ServedRun, prompt_domains: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per domain, from the vLLM arm: mean acceptance length from the drafter server's counters
    over the domain's prompts, outputs identical to plain serving, tokens/s (prefill included,
    one server at a time), load. No speedup: the two servers ran one after the other, not in
    alternating pairs, so their ratio is not a side-by-side measurement."""
    rows = {}
    for domain, index in domain_indices(prompt_domains).items():
        # The prompts of a domain are consecutive: its counters are the snapshots' difference.
        counters = spec.snapshots[index[-1] + 1].minus(spec.snapshots[index[0]]) if spec.snapshots else None
        plain_tps = completions_tokens_per_s([plain.completions[i] for i in index])
        spec_tps = completions_tokens_per_s([spec.completions[i] for i in index])
        rows[domain] = {"prompts": len(index), "tau": counters.mean_acceptance_length if counters else None,
                        "drafts": counters.drafts if counters else None,
                        "identical": sum(same_output(spec.completions[i], plain.completions[i]) for i in index),
                        "engine_numerics": 0, "plain_tokens_per_s": plain_tps, "drafter_tokens_per_s": spec_tps,
                        "speedup": None, "load_before": spec.load_before, "load_after": plain.load_after}
    return rows


def _f(value: float | None, spec: str = ".3f") -> str:
    return format(value, spec) if value is not None else "n/a"


def format_domains(rows: Mapping[str, Mapping[str, Any]], engines: Sequence[tuple[str, str]], *,
                   max_tokens: int) -> str:
    """Tau per domain: the project's loop (``project``: ``tau``, ``pooled_tau``) next to each
    engine (``(key, label)`` of ``engines``, each row's ``key``: ``tau``, ``identical``,
    ``speedup``) on the same prompts."""
    header = f"{'domain':<12} {'prompts':>7} {'project tau':>11} {'pooled':>7}"
    for _, label in engines:
        header += f" {label + ' tau':>14} {'identical':>9} {'speedup':>7}"
    lines = [f"tau per domain (tokens committed per verify step; 'pooled' = all steps of the domain, as the "
             f"engines count; {max_tokens} tokens per prompt):", header]
    for domain, row in rows.items():
        project = row.get("project") or {}
        line = f"{domain:<12} {row['prompts']:>7} {_f(project.get('tau')):>11} {_f(project.get('pooled_tau')):>7}"
        for key, _ in engines:
            engine = row.get(key)
            if engine is None:
                line += f" {'-':>14} {'-':>9} {'-':>7}"
                continue
            speedup = _f(engine["speedup"], ".2f") + ("x" if engine["speedup"] is not None else "")
            line += (f" {_f(engine['tau']):>14} {str(engine['identical']) + '/' + str(engine['prompts']):>9}"
                     f" {speedup:>7}")
        lines.append(line)
    return "\n".join(lines)


# --- eval --engine ----------------------------------------------------------------------------

@dataclass(kw_only=True)
class EngineRequests:
    """The requests of the project's evaluation, as each engine receives them."""

    conversations: list[list[dict[str, str]]]
    """Chat messages of each request (vLLM renders them with the target's chat template)."""
    prompt_ids: list[list[int]]
    """The same requests rendered by the project (llama.cpp receives these token ids)."""
    domains: list[str]
    """The domain of each request (consecutive per domain)."""


@dataclass(kw_only=True)
class EngineSettings:
    """What the engines serve and how; the defaults are serve-check's."""

    target_name: str
    """``model.target`` as given (``smollm2`` serves the GGUF the embedded target ships)."""
    target_dir: Path
    drafter: Path
    num_draft: int
    """Drafts per verify step: the drafter's block size - 1."""
    max_tokens: int
    dtype: str = "float32"
    """vLLM's ``--dtype``."""
    llama: LlamaCppOptions
    vllm_venv: Path
    vllm_method: str = "dflash"
    """vLLM's speculative ``method`` for the drafter: its variant's ``vllm_method``, chosen by
    the caller from the export's config.json (``llama.spec_type`` is llama.cpp's)."""
    startup_timeout_s: float = 1500.0


class EngineMissing(RuntimeError):
    """An engine is not installed (and ``eval`` does not install it)."""


def run_engines(names: Sequence[str], requests: EngineRequests, settings: EngineSettings, *, out_dir: Path,
                log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Each named engine's section of ``results.json``: per domain rows, totals and the outputs
    that differ from plain serving, or ``error`` (the reason, then the end of the engine's log)
    and ``exit_code`` when it could not run."""
    sections: dict[str, dict[str, Any]] = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        try:
            if name == "llama.cpp":
                sections[name] = _llama_cpp(requests, settings, out_dir, log)
            else:
                sections[name] = _vllm(requests, settings, out_dir, log)
        except (BuildError, InstallError, EngineMissing) as exc:
            sections[name] = {"error": f"not available: {exc}", "exit_code": EXIT_INSTALL}
        except (ServerError, httpx.HTTPError) as exc:
            sections[name] = {"error": f"refused the drafter or did not start: {exc}", "exit_code": EXIT_SERVER}
    return sections


def _ctx(requests: EngineRequests, max_tokens: int) -> int:
    # Room for the longest request and its answer; serve-check's 2048 at least.
    return max(2048, max(len(ids) for ids in requests.prompt_ids) + max_tokens + 16)


def _llama_cpp(requests: EngineRequests, settings: EngineSettings, out_dir: Path,
               log: Callable[[str], None]) -> dict[str, Any]:
    options = settings.llama
    options.ctx_size = _ctx(requests, settings.max_tokens)
    result = run_llama_cpp(target_name=settings.target_name, target_dir=settings.target_dir, drafter=settings.drafter,
                           prompt_ids=requests.prompt_ids,
                           prompts=[c[-1]["content"] for c in requests.conversations],
                           max_tokens=settings.max_tokens, num_draft=settings.num_draft, options=options,
                           out_dir=out_dir, log=log)
    return llama_cpp_section(result, requests.domains)


def llama_cpp_section(result: Mapping[str, Any], prompt_domains: Sequence[str]) -> dict[str, Any]:
    """The llama.cpp section of ``eval --engine`` from the llama.cpp arm's result
    (:func:`~dflash_trainer.engines.serve_llama_cpp.run_llama_cpp`, as serve-check records it)."""
    differing = [{"index": p["index"], "domain": prompt_domains[p["index"]], "prompt": p["prompt"][:200],
                  "first_difference": p["first_difference"], "engine_numerics": p["near_tie"],
                  "verdict": p.get("verdict")} for p in result["pairs"] if not p["identical"]]
    return {"engine": result["engine"], "domains": llama_cpp_domains(result, prompt_domains),
            "prompts": len(result["pairs"]), "identical": result["identical"],
            "tau": result["acceptance"]["pooled_tau"],
            "plain_tokens_per_s": result["plain_tokens_per_s"], "drafter_tokens_per_s": result["drafter_tokens_per_s"],
            "speedup": result["speedup"], "speedup_reliable": result["speedup_reliable"],
            "speedup_unreliable_reasons": result["speedup_unreliable_reasons"],
            "load_before": result["load_before"], "load_after": result["load_after"],
            "timing": "decode only, the servers' own clocks, alternating pairs", "cpus": os.cpu_count(),
            "target_gguf": result["target_gguf"], "drafter_gguf": result["drafter_gguf"],
            "draft_n_max": result["draft_n_max"], "cost": result["cost"], "differing": differing}


def _vllm(requests: EngineRequests, settings: EngineSettings, out_dir: Path,
          log: Callable[[str], None]) -> dict[str, Any]:
    if not is_installed(settings.vllm_venv):
        raise EngineMissing(f"no finished vLLM virtualenv at {settings.vllm_venv} ({VLLM_PIN}); build it with "
                            f"`python -m dflash_trainer.engines.vllm_env {settings.vllm_venv}` (or "
                            "`make serve-check`), or set eval.vllm_venv")
    options = VllmOptions(python=settings.vllm_venv / "bin" / "python", dtype=settings.dtype,
                          max_model_len=_ctx(requests, settings.max_tokens),
                          startup_timeout_s=settings.startup_timeout_s)
    speculative = {"method": settings.vllm_method, "model": str(settings.drafter.resolve()),
                   "num_speculative_tokens": settings.num_draft}
    spec, plain = serve_vllm(options, settings.target_dir, speculative, requests.conversations,
                             max_tokens=settings.max_tokens, out_dir=out_dir, log=log)
    return vllm_section(spec, plain, requests)


def vllm_section(spec: ServedRun, plain: ServedRun, requests: EngineRequests) -> dict[str, Any]:
    """The vLLM section of ``eval --engine`` from the drafter and the plain server's answers."""
    conversations = requests.conversations
    same = [same_output(s, p) for s, p in zip(spec.completions, plain.completions)]
    counters = spec.counters
    differing = [{"index": i, "domain": requests.domains[i], "prompt": conversations[i][-1]["content"][:200],
                  "first_difference": None, "engine_numerics": False, "verdict": None}
                 for i, ok in enumerate(same) if not ok]
    return {"engine": f"{VLLM_PIN} (CPU)", "domains": vllm_domains(spec, plain, requests.domains),
            "prompts": len(same), "identical": sum(same),
            "tau": counters.mean_acceptance_length if counters else None,
            "plain_tokens_per_s": plain.tokens_per_s, "drafter_tokens_per_s": spec.tokens_per_s,
            "speedup": None, "speedup_reliable": False,
            "speedup_unreliable_reasons": ["not measured: vLLM's plain and drafter servers run one "
                                           "after the other, not in alternating pairs"],
            "load_before": spec.load_before, "load_after": plain.load_after,
            "timing": "request wall time, prefill included, one server at a time", "cpus": os.cpu_count(),
            "startup_s": {"plain": plain.startup_s, "drafter": spec.startup_s}, "differing": differing}


def exit_code(sections: Mapping[str, Mapping[str, Any]]) -> int:
    """1 when an engine's output differs from plain serving other than by its numerics; else the
    first failed engine's code (3 or 4); else 0."""
    if any(not d["engine_numerics"] for s in sections.values() for d in s.get("differing", [])):
        return EXIT_MISMATCH
    return next((int(s["exit_code"]) for s in sections.values() if "error" in s), 0)


def format_engines(sections: Mapping[str, Mapping[str, Any]], project: Mapping[str, Mapping[str, Any]], *,
                   max_tokens: int) -> str:
    """The console report of ``eval --engine``: one table of tau per domain (the project's loop
    and each engine that ran), then per engine its totals, the load, and each differing output;
    an engine that could not run is one line with its reason."""
    ran = [(name, LABELS[name]) for name, s in sections.items() if "error" not in s]
    rows = {domain: {"prompts": p["prompts"], "project": p,
                     **{name: sections[name]["domains"].get(domain) for name, _ in ran}}
            for domain, p in project.items()}
    lines = [format_domains(rows, ran, max_tokens=max_tokens)]
    for name, s in sections.items():
        label = LABELS[name]
        if "error" in s:
            lines.append(f"{label}: did not run: {s['error'].partition(chr(10))[0]}")
            continue
        speed = f"{_f(s['speedup'], '.2f')}x" if s["speedup"] is not None else "n/a"
        if s.get("speedup_reliable") is False:
            speed += " (UNRELIABLE: " + "; ".join(s["speedup_unreliable_reasons"]) + ")"
        lines.append(f"{label}: {s['engine']}: tau {_f(s['tau'])}, identical to plain serving {s['identical']}/"
                     f"{s['prompts']}, tokens/s plain {_f(s['plain_tokens_per_s'], '.1f')}, with drafter "
                     f"{_f(s['drafter_tokens_per_s'], '.1f')}: speedup {speed} ({s['timing']}; "
                     f"1-min load {_f(s['load_before'], '.2f')} -> {_f(s['load_after'], '.2f')} on "
                     f"{s['cpus']} cores)")
        for d in s["differing"]:
            kind = "engine numerics" if d["engine_numerics"] else "DIFFERS"
            where = f" at token {d['first_difference']}" if d["first_difference"] is not None else ""
            lines.append(f"  {label} request {d['index']} ({d['domain']}): {kind}{where}"
                         + (f": {d['verdict']}" if d["verdict"] else "") + f"; prompt {d['prompt'][:80]!r}")
    return "\n".join(lines)
