"""The levers a CPU user has in llama.cpp, each measured side by side: plain vs drafter decoding.

For every setting (target Q4_1 or f32, drafter f32 / bf16 / q8_0, ``--spec-draft-n-max`` 1..B-1)
the serve check's llama.cpp arm serves the same prompts with a plain and a speculative
``llama-server``, alternating pairs, and reports the speedup (ratio of sums over the pairs, with
the load recorded), the acceptance and the cost of one speculative step in plain steps. The
project's own loop runs once, on the same prompts, for its tau. One JSON file holds every row.

    .venv/bin/python benchmarks/llama_cpp_levers.py --drafter runs/demo/drafter \\
        --prompts 10 --max-tokens 128 --out benchmarks/results/llama-cpp-levers.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))

import serve_check  # noqa: E402


def variants(n_max: list[int], targets: list[str], drafters: list[str]) -> list[dict[str, object]]:
    """Every (target type, drafter type, drafts per step) setting to measure."""
    return [{"target": t, "drafter_type": d, "n_max": n} for t, d, n in itertools.product(targets, drafters, n_max)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--targets", default="q4_1,f32")
    parser.add_argument("--drafter-types", default="f32")
    parser.add_argument("--n-max", default=None, help="drafts per step to try, e.g. 1,3 (default 1..block-1)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    drafter = Path(args.drafter)
    block = serve_check.num_draft_tokens(drafter) + 1
    rows: list[dict[str, object]] = []
    out = Path(args.out)
    project = None
    n_max = [int(n) for n in args.n_max.split(",")] if args.n_max else list(range(1, block))
    for v in variants(n_max, args.targets.split(","), args.drafter_types.split(",")):
        work = Path("runs") / "llama-cpp-levers" / f"{v['target']}-{v['drafter_type']}-n{v['n_max']}"
        argv_v = ["--engine", "llama.cpp", "--drafter", str(drafter), "--prompts", str(args.prompts),
                  "--max-tokens", str(args.max_tokens), "--llama-target", str(v["target"]),
                  "--llama-drafter-type", str(v["drafter_type"]), "--spec-draft-n-max", str(v["n_max"]),
                  "--out", str(work)]
        if project is not None:
            argv_v.append("--skip-eval")
        started = time.monotonic()
        code = serve_check.main(argv_v)
        result = json.loads((work / "result.json").read_text())
        if project is None:
            project = result["project_acceptance"]
        lc = result["llama_cpp"]
        rows.append({**v, "exit": code, "wall_s": round(time.monotonic() - started, 1),
                     "speedup": lc["speedup"], "speedup_reliable": lc["speedup_reliable"],
                     "speedup_unreliable_reasons": lc["speedup_unreliable_reasons"],
                     "plain_tokens_per_s": lc["plain_tokens_per_s"],
                     "drafter_tokens_per_s": lc["drafter_tokens_per_s"], "acceptance": lc["acceptance"],
                     "cost": lc["cost"], "identical": lc["identical"], "near_ties": lc["near_ties"],
                     "pairs": len(lc["pairs"]), "load_before": lc["load_before"], "load_after": lc["load_after"]})
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"command": " ".join(["benchmarks/llama_cpp_levers.py", *(argv or sys.argv[1:])]),
                                   "drafter": str(drafter), "project_acceptance": project, "rows": rows},
                                  indent=1) + "\n")
    print(f"{'target':<6} {'drafter':<7} {'n_max':>5} {'tau':>6} {'plain':>7} {'drafter':>8} {'speedup':>8} "
          f"{'step cost':>9}  identical")
    for r in rows:
        tau = r["acceptance"]["pooled_tau"]
        mark = "" if r["speedup_reliable"] else " (unreliable)"
        print(f"{r['target']:<6} {r['drafter_type']:<7} {r['n_max']:>5} {tau or 0:>6.3f} "
              f"{r['plain_tokens_per_s'] or 0:>7.1f} {r['drafter_tokens_per_s'] or 0:>8.1f} "
              f"{r['speedup'] or 0:>8.3f} {r['cost']['step_cost_ratio'] or 0:>9.2f}  "
              f"{r['identical']}/{r['pairs']}{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
