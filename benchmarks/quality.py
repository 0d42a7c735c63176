"""Drafter quality at a fixed training budget: train each variant for ``--budget-s`` seconds of
training (set-up excluded) and measure the acceptance length on held-out prompts.

Usage::

    .venv/bin/python -m benchmarks.quality --config configs/demo-cpu.yaml --budget-s 240 \\
        --variant demo \\
        --variant greedy:training.labels=target_greedy \\
        --variant lr2e-3:training.lr=2e-3,training.warmup_ratio=0.01 \\
        --out runs/quality/ablation.json

Each ``--variant NAME[:KEY=VALUE,KEY=VALUE...]`` is the config plus ``--set`` overrides plus
its own overrides (later wins). A value containing a comma must be written as a YAML flow
list without spaces, e.g. ``model.target_layer_ids=[1,15,29]`` (brackets are kept together).

Every variant runs in a fresh subprocess (clean memory and threads) that builds a
:class:`~dflash_trainer.training.trainer.Trainer`, trains with ``training.max_time_s = budget``, then
decodes the evaluation prompts speculatively with the trained drafter and compares each output
with the target's own greedy output (the lossless check). The evaluation is a fixed yardstick
for every variant: float32 target and drafter, greedy, first turns of the first
``--eval-prompts`` MT-Bench questions (not in the ShareGPT training data), ``--max-new-tokens``
each. The target-only greedy outputs are computed once per prompt set and cached next to the
results (``baseline-*.json``), so each variant only pays for its speculative decodes.

One table row per variant: load average at start, optimizer steps, training tokens/s, final
loss and ``train/tau_sim`` (mean over the last 20% of logged windows), eval tau, lossless.
The rows (with the full resolved overrides and the per-prompt taus) go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def split_overrides(text: str) -> list[str]:
    """``a=1,b=[1,2],c=x`` -> ``["a=1", "b=[1,2]", "c=x"]`` (commas inside brackets are kept)."""
    parts: list[str] = []
    depth = 0
    current = ""
    for ch in text:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            if current.strip():
                parts.append(current.strip())
            current = ""
            continue
        current += ch
    if current.strip():
        parts.append(current.strip())
    bad = [p for p in parts if "=" not in p]
    if bad:
        raise SystemExit(f"--variant: override(s) {bad} must look like section.key=value")
    return parts


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``name:ov,ov`` -> (name, overrides); ``name`` alone has no overrides."""
    name, _, rest = text.partition(":")
    if not name or any(c in name for c in "/ "):
        raise SystemExit(f"--variant {text!r}: the name must be non-empty, without '/' or spaces")
    return name, split_overrides(rest)


def load1() -> float:
    return os.getloadavg()[0]


def wait_for_quiet(max_load: float, max_wait_s: float) -> float:
    """Sleep until the 1-minute load average is <= max_load or max_wait_s passed; return it."""
    deadline = time.monotonic() + max_wait_s
    load = load1()
    while load > max_load and time.monotonic() < deadline:
        print(f"  load average {load:.2f} > {max_load}: waiting 60 s", flush=True)
        time.sleep(60)
        load = load1()
    return load


# --- worker side (one subprocess) -------------------------------------------------------------

def _eval_prompt_ids(cfg: Any, tokenizer: Any, num_prompts: int) -> list[tuple[str, str, list[int]]]:
    from dflash_trainer.data.tokenize import render_prompt
    from dflash_trainer.evaluation.prompt_sets import load_prompts

    prompts = load_prompts(cfg, limit=num_prompts, first_turn_only=True)
    return [(p.id, p.turns[0], render_prompt(tokenizer, [{"role": "user", "content": p.turns[0]}],
                                              thinking=cfg.data.thinking)) for p in prompts]


def worker_baseline(spec: dict[str, Any]) -> dict[str, Any]:
    """Target-only greedy decodes (float32) of the eval prompts: the lossless reference."""
    import torch

    from dflash_trainer.core import assets
    from dflash_trainer.config import load_config
    from dflash_trainer.model.target import load_target
    from dflash_trainer.data.tokenize import end_of_turn_ids
    from dflash_trainer.evaluation.spec_decode import target_generate

    torch.set_num_threads(spec["threads"])
    cfg = load_config(spec["config"], spec["overrides"])
    target, tokenizer = load_target(str(assets.resolve_target(cfg.model.target)), device="cpu",
                                    dtype=torch.float32)
    stops = end_of_turn_ids(tokenizer, getattr(target, "generation_config", None))
    rows = []
    for pid, text, ids in _eval_prompt_ids(cfg, tokenizer, spec["eval_prompts"]):
        out = target_generate(target, torch.tensor([ids]), max_new_tokens=spec["max_new_tokens"],
                              stop_token_ids=stops)
        rows.append({"id": pid, "prompt": text, "input_ids": ids, "tokens": out.tokens,
                     "prefill_s": out.prefill_s, "decode_s": out.decode_s})
        print(f"  baseline {pid}: {len(out.tokens)} tokens", flush=True)
    return {"stop_token_ids": stops, "prompts": rows}


def _window_mean(rows: list[dict[str, Any]], key: str, frac: float = 0.2) -> float | None:
    values = [r[key] for r in rows if key in r]
    if not values:
        return None
    tail = values[-max(1, int(round(len(values) * frac))):]
    return sum(tail) / len(tail)


def evaluate_drafter(drafter: Any, cfg: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Speculative decodes of the cached baseline prompts; tau, histogram, lossless check."""
    import torch

    from dflash_trainer.core import assets
    from dflash_trainer.evaluation.evaluate import request_result, summarize
    from dflash_trainer.evaluation.prompt_sets import EvalPrompt
    from dflash_trainer.model.target import load_target
    from dflash_trainer.evaluation.spec_decode import Decoded, speculative_generate

    baseline = json.loads(Path(spec["baseline"]).read_text())
    stops = baseline["stop_token_ids"]
    # The fixed yardstick: float32 target and drafter, whatever the training dtype was. The
    # target is loaded afresh: a bf16-loaded target converted back with .float() keeps bf16-rounded
    # weights, and its greedy outputs differ from the float32 reference (5 of 20 prompts).
    target, _ = load_target(str(assets.resolve_target(cfg.model.target)), device="cpu",
                            dtype=torch.float32)
    drafter = drafter.float().eval()
    t2 = time.perf_counter()
    requests = []
    with torch.no_grad():
        for row in baseline["prompts"]:
            ids = torch.tensor([row["input_ids"]])
            spec_out = speculative_generate(drafter, target, ids, max_new_tokens=spec["max_new_tokens"],
                                            stop_token_ids=stops)
            base = Decoded(tokens=row["tokens"], prefill_s=row["prefill_s"], decode_s=row["decode_s"])
            prompt = EvalPrompt(id=row["id"], turns=[row["prompt"]], category="mtbench-first-turn")
            requests.append(request_result(prompt, 0, ids.shape[1], base, spec_out, temperature=0.0,
                                           stop_token_ids=stops))
    eval_s = time.perf_counter() - t2
    summary = summarize(requests, block_size=int(drafter.block_size), temperature=0.0)
    return {
        "eval_s": eval_s,
        "eval_tau": summary["tau"],
        "eval_hist": summary["acceptance_hist"],
        "lossless": summary["lossless"],
        "lossless_failures": summary["lossless_failures"],
        "per_prompt_tau": {r.id: r.tau for r in requests},
        "mismatches": {r.id: r.first_mismatch for r in requests if r.lossless is False},
        "eval_tokens": summary["tokens"],
    }


def worker_evaluate(spec: dict[str, Any]) -> dict[str, Any]:
    """Evaluate an exported drafter folder (``--eval-only``)."""
    import torch

    from dflash_trainer.config import load_config
    from dflash_trainer.training.export import load_drafter

    torch.set_num_threads(spec["threads"])
    cfg = load_config(spec["config"], spec["overrides"])
    return evaluate_drafter(load_drafter(Path(spec["drafter"]), dtype=torch.float32), cfg, spec)


def worker_variant(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one variant for the budget, then evaluate it against the cached baseline."""
    import torch

    from dflash_trainer.config import config_to_dict, load_config
    from dflash_trainer.model.dtypes import cpu_model_name
    from dflash_trainer.training.trainer import Trainer

    t0 = time.perf_counter()
    cfg = load_config(spec["config"], spec["overrides"])
    trainer = Trainer(cfg)
    setup_s = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        last = trainer.train()
        train_s = time.perf_counter() - t1
    finally:
        trainer.close()
    steps = trainer.drafter_step.optimizer_step
    # Read before the evaluation, whose float32 copies would otherwise set the peak.
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    drafter_params = sum(p.numel() for p in trainer.drafter.parameters() if p.requires_grad)
    logged = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()
              if line.strip()]
    windows = [r for r in logged if "train/loss" in r]
    tokens = last.get("train/tokens_total", 0.0)

    result = evaluate_drafter(trainer.drafter, cfg, spec)
    return {
        "steps": steps,
        "stopped_by": trainer.stopped_by,
        "setup_s": setup_s,
        "train_s": train_s,
        "train_tokens": tokens,
        "tokens_per_s": tokens / train_s if train_s > 0 else None,
        "steps_per_s": steps / train_s if train_s > 0 else None,
        "train_peak_rss_mb": peak_rss_mb,
        "drafter_trainable_params": drafter_params,
        "final_loss": _window_mean(windows, "train/loss"),
        "final_acc": _window_mean(windows, "train/acc"),
        "final_tau_sim": _window_mean(windows, "train/tau_sim"),
        "last_window": {k: v for k, v in last.items() if k.startswith(("train/", "perf/"))
                        and not k.startswith("train/acc_pos")},
        "loss_curve": [(r["step"], r["train/loss"], r.get("train/tau_sim")) for r in windows],
        "config": config_to_dict(cfg),
        "torch_threads": torch.get_num_threads(),
        # Steps in a time budget depend on the CPU: rows compare within one machine only.
        "cpu": cpu_model_name(),
        "compute_dtype": str(trainer.compute_dtype).removeprefix("torch."),
        **result,
    }


def worker_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    workers = {"baseline": worker_baseline, "variant": worker_variant, "evaluate": worker_evaluate}
    result = workers[spec["kind"]](spec)
    Path(spec["result"]).write_text(json.dumps(result, indent=1) + "\n")
    return 0


# --- parent side ------------------------------------------------------------------------------

def run_worker(spec: dict[str, Any], log_path: Path, timeout_s: float) -> dict[str, Any] | None:
    """Run one worker subprocess; its output goes to ``log_path``; its result or None on failure."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path = log_path.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec, indent=1))
    result_path = Path(spec["result"])
    result_path.unlink(missing_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(spec["threads"]),
               MKL_NUM_THREADS=str(spec["threads"]))
    with log_path.open("w") as log:
        with worker_process([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO) as proc:
            rc = wait_for_worker(proc, timeout_s)
        if rc is None:
            print(f"  timed out after {timeout_s:.0f} s; log: {log_path}", flush=True)
            return None
    if rc != 0 or not result_path.is_file():
        tail = log_path.read_text().splitlines()[-15:]
        print(f"  failed (exit {rc}); log: {log_path}\n    " + "\n    ".join(tail), flush=True)
        return None
    return json.loads(result_path.read_text())


@contextlib.contextmanager
def worker_process(args: list[str], **popen_kwargs: Any) -> Iterator[subprocess.Popen]:
    """A worker subprocess that is stopped if the ``with`` block is left by an exception."""
    proc = subprocess.Popen(args, **popen_kwargs)
    try:
        yield proc
    except BaseException:
        # Ctrl-C or SIGTERM of the parent: a half-trained variant measures nothing, and a
        # worker left training would skew every measurement after it.
        stop_worker(proc)
        raise


def wait_for_worker(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """The worker's exit code, or None (worker killed) after ``timeout_s``."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def stop_worker(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the worker, then SIGKILL it if it is still running after ``grace_s``."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


HEADER = (f"{'variant':<22} {'load1':>5} {'steps':>6} {'tok/s':>7} {'loss':>7} {'acc':>6} "
          f"{'tau_sim':>7} {'eval_tau':>8} {'lossless':>8}")


def format_row(row: dict[str, Any]) -> str:
    lossless = {True: "yes", False: "NO", None: "-"}[row.get("lossless")]
    return (f"{row['name']:<22} {_fmt(row.get('load1_start'), '.2f'):>5} {_fmt(row.get('steps'), 'd'):>6} "
            f"{_fmt(row.get('tokens_per_s'), '.0f'):>7} {_fmt(row.get('final_loss'), '.3f'):>7} "
            f"{_fmt(row.get('final_acc'), '.3f'):>6} {_fmt(row.get('final_tau_sim'), '.3f'):>7} "
            f"{_fmt(row.get('eval_tau'), '.3f'):>8} {lossless:>8}")


def markdown_table(paths: list[str]) -> str:
    """The rows of result JSON files as a markdown table (for docs/quality.md)."""
    lines = ["| variant | overrides | budget s | load1 | steps | tok/s | loss | acc | tau_sim | eval tau | lossless |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            lossless = {True: "yes", False: "NO", None: "-"}[row.get("lossless")]
            lines.append(
                f"| {row['name']} | {', '.join(row['overrides']) or '-'} | {row['budget_s']:.0f} | "
                f"{_fmt(row.get('load1_start'), '.1f')} | {_fmt(row.get('steps'), 'd')} | "
                f"{_fmt(row.get('tokens_per_s'), '.0f')} | {_fmt(row.get('final_loss'), '.2f')} | "
                f"{_fmt(row.get('final_acc'), '.3f')} | {_fmt(row.get('final_tau_sim'), '.3f')} | "
                f"{_fmt(row.get('eval_tau'), '.3f')} | {lossless} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--markdown", nargs="+", metavar="RESULTS_JSON",
                        help="print the rows of earlier result files as a markdown table and exit")
    parser.add_argument("--config", default="configs/demo-cpu.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override applied to every variant (repeatable)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                        help="a config variant (repeatable); default one variant 'base'")
    parser.add_argument("--budget-s", type=float, default=900.0, help="training seconds per variant")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (pipeline.num_threads)")
    parser.add_argument("--eval-prompts", type=int, default=20, help="MT-Bench first turns to decode")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="runs/quality/results.json", help="results JSON (appended rows)")
    parser.add_argument("--run-root", default="runs/quality", help="run dirs and logs of the variants")
    parser.add_argument("--eval-only", action="store_true",
                        help="do not train: re-evaluate RUN_ROOT/NAME/drafter of each variant and "
                             "update its row in --out (training fields are kept)")
    parser.add_argument("--max-load", type=float, default=2.5,
                        help="wait before a variant while the 1-minute load average is above this")
    parser.add_argument("--max-wait-s", type=float, default=0.0,
                        help="longest wait for the load to drop before each variant (0: do not wait)")
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if args.markdown:
        print(markdown_table(args.markdown))
        return 0
    signal.signal(signal.SIGTERM, _raise_on_sigterm)

    variants = [parse_variant(v) for v in args.variant] or [("base", [])]
    names = [n for n, _ in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"--variant names must be unique, got {names}")
    common = [o for text in args.set for o in split_overrides(text)]
    run_root = (REPO / args.run_root).resolve()
    out_path = (REPO / args.out).resolve()
    eval_overrides = ["eval.prompts=mtbench", f"eval.max_new_tokens={args.max_new_tokens}"]

    # The reference outputs depend on the target, the chat rendering and the prompt set only,
    # so variants of different config files share them.
    from dflash_trainer.config import load_config

    base_cfg = load_config(args.config, common)
    key = hashlib.sha256(json.dumps([base_cfg.model.target, base_cfg.data.thinking, args.eval_prompts,
                                     args.max_new_tokens]).encode()).hexdigest()[:12]
    baseline_path = run_root / f"baseline-{key}.json"
    if not baseline_path.is_file():
        print(f"baseline: target-only greedy decodes of {args.eval_prompts} MT-Bench first turns "
              f"(float32, max_new_tokens {args.max_new_tokens})", flush=True)
        spec = {"kind": "baseline", "config": args.config, "overrides": common + eval_overrides,
                "threads": args.threads, "eval_prompts": args.eval_prompts,
                "max_new_tokens": args.max_new_tokens, "result": str(baseline_path)}
        if run_worker(spec, run_root / "logs" / "baseline.log", timeout_s=3600) is None:
            return 1

    rows: list[dict[str, Any]] = []
    if out_path.is_file():
        rows = json.loads(out_path.read_text()).get("rows", [])
    print(HEADER, flush=True)
    failed = 0
    for name, overrides in variants:
        load = wait_for_quiet(args.max_load, args.max_wait_s)
        run_dir = run_root / name
        if args.eval_only:
            previous = next((r for r in rows if r.get("name") == name), {"name": name})
            spec = {"kind": "evaluate", "config": args.config, "overrides": common + overrides,
                    "drafter": str(run_dir / "drafter"), "threads": args.threads,
                    "max_new_tokens": args.max_new_tokens, "baseline": str(baseline_path),
                    "result": str(run_root / "logs" / f"{name}.eval.result.json")}
            result = run_worker(spec, run_root / "logs" / f"{name}.eval.log", timeout_s=3600)
            failed += result is None
            row = {**previous, **(result or {"error": "evaluation failed"}), "reevaluated_utc":
                   time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            rows = [r for r in rows if r.get("name") != name] + [row]
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
            print(format_row(row), flush=True)
            continue
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        # Repo-relative (the worker runs in REPO) so result files name no path of this machine.
        shown = run_dir.relative_to(REPO) if run_dir.is_relative_to(REPO) else run_dir
        forced = [f"run_dir={shown}", f"training.max_time_s={args.budget_s}",
                  f"pipeline.num_threads={args.threads}", "eval.every_steps=null",
                  "logging.console=false", "logging.tensorboard=false", "logging.wandb=disabled"]
        all_overrides = common + overrides + forced
        spec = {"kind": "variant", "config": args.config, "overrides": all_overrides,
                "threads": args.threads, "max_new_tokens": args.max_new_tokens,
                "baseline": str(baseline_path), "result": str(run_root / "logs" / f"{name}.result.json")}
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        result = run_worker(spec, run_root / "logs" / f"{name}.log", timeout_s=args.budget_s + 3600)
        row = {"name": name, "overrides": overrides, "common": common, "config_file": args.config,
               "budget_s": args.budget_s, "threads": args.threads, "eval_prompts": args.eval_prompts,
               "max_new_tokens": args.max_new_tokens, "load1_start": load, "load1_end": load1(),
               "started_utc": started, **(result or {"error": "worker failed"})}
        failed += result is None
        rows = [r for r in rows if r.get("name") != name] + [row]
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
        print(format_row(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
