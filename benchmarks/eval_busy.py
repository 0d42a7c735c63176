"""The evaluation beside a busy process: torch threads on every core vs on the free cores.

    python -m benchmarks.eval_busy [--prompts 3] [--max-new-tokens 32] [--rounds 2] [--busy 1]
                                   [--block-size 4] [--out eval_busy.json]

Real components: the embedded SmolLM2-135M-Instruct target in float32, a randomly initialised
one-layer drafter with the demo's block of 4 (tau about 1, so the work per prompt is fixed),
the first turns of the first ``--prompts`` MT-Bench questions, and ``evaluate_prompts`` (the
``dflash-trainer eval`` loop: warm-up, then target-only and speculative decodes of each prompt
side by side).

``--busy`` Python busy loops run in subprocesses for the whole benchmark. Two arms do the same
evaluation: ``all-cores`` pins the torch threads to every core (the old behaviour), ``free-cores``
lets the evaluation pick them from the cores free at its start (the new default). The arms
alternate within each round and their order flips between rounds. Printed per run: wall time,
threads, the load before and after, the speedup and its reliability mark; then the mean wall
time per arm and their ratio (all-cores / free-cores: above 1 means the free-core choice is
faster).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.core.assets import resolve_target
from dflash_trainer.config import ModelConfig
from dflash_trainer.evaluation.evaluate import evaluate_prompts
from dflash_trainer.evaluation.prompt_sets import EvalPrompt, mtbench_prompts
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.model.target import load_target, resolve_mask_token_id
from dflash_trainer.evaluation.speedup import PairedTimer, load_average, others_running, usable_cpus


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[list[int]]:
    """``count`` subprocesses spinning a Python loop; stopped (by their own pids) on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True:\n    pass"]) for _ in range(count)]
    try:
        time.sleep(2.0)  # let them reach the run queue before anything samples it
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _f(value: float | None, spec: str = ".2f") -> str:
    return "?" if value is None else format(value, spec)


def run_arm(name: str, threads: int | None, model: tuple[Any, Any, Any], prompts: list[EvalPrompt],
            max_new_tokens: int) -> dict[str, Any]:
    """One evaluation; ``threads`` None lets it choose from the free cores."""
    drafter, target, tokenizer = model
    started = time.perf_counter()
    cpu_started = time.process_time()
    with torch.no_grad():
        report = evaluate_prompts(drafter, target, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                  timer=PairedTimer(threads=threads))
    wall = time.perf_counter() - started
    s = report.summary
    m = s["speedup_measurement"]
    row = {"arm": name, "wall_s": wall, "cpu_s": time.process_time() - cpu_started,
           "threads": m["torch_threads"], "tokens": s["tokens"], "tau": s["tau"],
           "lossless": s["lossless"], "speedup": s["speedup"], "speedup_reliable": s["speedup_reliable"],
           "speedup_unreliable_reasons": s["speedup_unreliable_reasons"], "measurement": m}
    print(f"  {name:<10} {wall:7.1f} s wall, {row['cpu_s']:6.1f} s cpu, {m['torch_threads']} threads, "
          f"others running {_f(m['others_running_before'], '.1f')} -> {_f(m['others_running_after'], '.1f')}, "
          f"1-min load {_f(m['load_1m_before'])} -> {_f(m['load_1m_after'])}, speedup {_f(s['speedup'])} "
          f"({'reliable' if s['speedup_reliable'] else 'unreliable: ' + '; '.join(s['speedup_unreliable_reasons'])})",
          flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=3, help="MT-Bench first turns (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="each round runs both arms (default 2)")
    parser.add_argument("--busy", type=int, default=1, help="busy-loop processes beside the evaluation")
    parser.add_argument("--block-size", type=int, default=4, help="drafter block size (default 4, the demo's)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)

    cpus = usable_cpus()
    path = resolve_target("smollm2")
    target, tokenizer = load_target(str(path), device="cpu", dtype=torch.float32)
    torch.manual_seed(0)
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=args.block_size), target.config,
                            mask_token_id=resolve_mask_token_id(tokenizer, target.config.vocab_size)).eval()
    prompts = [EvalPrompt(id=p.id, turns=p.turns[:1], category=p.category)
               for p in mtbench_prompts()[:args.prompts]]
    model = (drafter, target, tokenizer)
    started_load = load_average()
    print(f"eval_busy: {cpus} cores, {args.busy} busy process(es), {len(prompts)} prompts x {args.max_new_tokens} "
          f"tokens, SmolLM2 float32, random drafter (block {drafter.block_size}); 1-min load at start "
          f"{_f(started_load)}", flush=True)
    arms = [("all-cores", cpus), ("free-cores", None)]
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {
        "cpus": cpus, "busy_processes": args.busy, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "block_size": args.block_size, "rounds": args.rounds, "load_1m_start": started_load,
        "command": "python -m benchmarks.eval_busy " + " ".join(argv if argv is not None else sys.argv[1:]),
        "torch": torch.__version__, "runs": rows}
    with busy_processes(args.busy) as pids:
        print(f"busy pids {pids}; others running now {_f(others_running(), '.1f')}", flush=True)
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", flush=True)
            for name, threads in (arms if r % 2 == 0 else arms[::-1]):
                rows.append({"round": r, **run_arm(name, threads, model, prompts, args.max_new_tokens)})
                summarize(summary, rows, [name for name, _ in arms])
                if args.out:  # after every run: a run cut short still leaves its figures
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"mean wall: all-cores {_f(summary['mean_wall_s']['all-cores'], '.1f')} s, free-cores "
          f"{_f(summary['mean_wall_s']['free-cores'], '.1f')} s (threads {summary['free_core_threads']}); "
          f"all-cores / free-cores = {_f(summary['all_over_free'])}; 1-min load {_f(started_load)} at start, "
          f"{_f(summary['load_1m_end'])} at the end", flush=True)
    if args.out:
        print(f"wrote {args.out}")
    return 0


def summarize(summary: dict[str, Any], rows: list[dict[str, Any]], arms: list[str]) -> None:
    """Mean wall time per arm over the runs so far, their ratio and the load now, into ``summary``."""
    mean: dict[str, float | None] = {}
    for name in arms:
        walls = [x["wall_s"] for x in rows if x["arm"] == name]
        mean[name] = sum(walls) / len(walls) if walls else None
    old, new = mean["all-cores"], mean["free-cores"]
    summary.update(mean_wall_s=mean, all_over_free=old / new if old and new else None,
                   free_core_threads=sorted({x["threads"] for x in rows if x["arm"] == "free-cores"}),
                   load_1m_end=load_average())

if __name__ == "__main__":
    sys.exit(main())
