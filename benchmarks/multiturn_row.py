"""Per-turn samples against last-turn-only on multi-turn ShareGPT data under a Qwen3-style template.

    python -m benchmarks.multiturn_row [--steps 400] [--train 1500] [--eval-prompts 8]
        [--out benchmarks/results/multiturn-qwen3-template.json]

The target is the embedded SmolLM2-135M-Instruct with the real Qwen3 chat template of llama.cpp's
corpus swapped in (no token added: the weights stay as they are; SmolLM2 spells ``<think>`` in
pieces). Qwen3's template renders an earlier assistant turn without the think block the last turn
gets, so a multi-turn conversation is not prefix-stable and every earlier turn becomes a sample of
its own. The data: the embedded ShareGPT set's conversations with at least two assistant turns;
the first ``--eval-prompts`` are held out as multi-turn evaluation prompts (their user turns, up to
three, each answered by the target itself), the next ``--train`` are the training file.

Two arms, the demo recipe (``configs/demo-cpu.yaml``) with the same steps and seed, float32:
``per_turn`` (the default) and ``last_turn_only`` (``data.last_turn_only=true``). For each, the
``prepare`` statistics (supervised tokens per conversation, the expansion's token overhead), the
training loss at the end, and ``eval`` on the held-out multi-turn prompts: tau over all turns and
per turn index, and the lossless check. Each command runs as the user would run it, in a
subprocess; the result JSON holds the rows and the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.chat_template_matrix import corpus
from dflash_trainer.core.assets import load_tokenizer, resolve_target
from dflash_trainer.data.formats import Conversation, expand_paths, read_source

ROOT = Path(__file__).resolve().parents[1]
QWEN3 = "Qwen-Qwen3-0.6B"
ARMS = {"per_turn": [], "last_turn_only": ["data.last_turn_only=true"]}


def make_target(folder: Path) -> Path:
    """SmolLM2's weights (linked) and tokenizer with the Qwen3 chat template."""
    source = resolve_target("smollm2")
    folder.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix in (".safetensors", ".json") and "tokenizer" not in path.name:
            link = folder / path.name
            if not link.exists():
                link.symlink_to(path)
    tokenizer = load_tokenizer(source)
    tokenizer.chat_template = next(p for p in corpus() if p.stem == QWEN3).read_text(encoding="utf-8")
    tokenizer.save_pretrained(folder)
    return folder


def make_data(folder: Path, *, train: int, eval_prompts: int, max_chars: int) -> tuple[Path, Path, int, int]:
    """(training JSONL, evaluation prompts JSONL, training conversations, records scanned) from
    the embedded set (fewer than ``train`` where the set has no more):
    conversations of at least two assistant turns and at most ``max_chars`` characters (so that
    the whole conversation fits ``data.max_length`` and last-turn-only keeps its last answer)."""
    (source,) = expand_paths(["sharegpt"])
    multi: list[list[dict[str, Any]]] = []
    scanned = 0
    for record in read_source(source):
        scanned += 1
        if (isinstance(record, Conversation) and sum(m["role"] == "assistant" for m in record.messages) >= 2
                and sum(len(m["content"]) for m in record.messages) <= max_chars):
            multi.append(record.messages)
            if len(multi) == eval_prompts + train:
                break
    prompts = folder / "eval-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"multiturn-{i}", "turns": [
        m["content"] for m in messages if m["role"] == "user"][:3]}) + "\n"
        for i, messages in enumerate(multi[:eval_prompts])))
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in multi[eval_prompts:]))
    return data, prompts, len(multi) - eval_prompts, scanned


def _run(args: list[str], log: Path) -> float:
    """Run ``dflash-trainer ARGS`` (output appended to ``log``); its seconds."""
    started = time.monotonic()
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"\n$ dflash-trainer {' '.join(args)}\n")
        out.flush()
        code = subprocess.call([sys.executable, "-m", "dflash_trainer", *args], stdout=out,
                               stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if code != 0:
        raise SystemExit(f"dflash-trainer {args[0]} failed ({code}); see {log}")
    return round(time.monotonic() - started, 1)


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it (results carry no machine's paths)."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else "RUN_ROOT"


def run_arm(name: str, extra: list[str], common: list[str], run_root: Path, log: Path,
            cache: Path) -> dict[str, Any]:
    """prepare, train and eval one arm; its row."""
    run_dir = run_root / name
    sets = [*common, *extra, f"run_dir={run_dir}"]
    seconds = {"prepare": _run(["prepare", *sets], log)}
    stats = max(cache.glob("*/stats.json"), key=lambda p: p.stat().st_mtime)
    prepared = json.loads(stats.read_text())
    seconds["train"] = _run(["train", *sets, "--overwrite"], log)
    seconds["eval"] = _run(["eval", *sets, "--drafter", str(run_dir / "drafter")], log)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    by_turn: dict[int, list[float]] = {}
    for row in results["per_prompt"]:
        by_turn.setdefault(int(row["turn"]), []).append(row["tau"])
    kept = prepared["kept"]
    return {
        "arm": name, "overrides": extra,
        "conversations": kept, "samples": prepared["samples"],
        "supervised_tokens": prepared["supervised_tokens"], "total_tokens": prepared["total_tokens"],
        "supervised_per_conversation": round(prepared["supervised_tokens"] / kept, 1),
        "expansion_tokens": prepared["expansion_tokens"],
        "turns_skipped_long": prepared["turns_skipped_long"],
        "final_loss": round(losses[-1], 4) if losses else None,
        "tau": results["tau"], "tau_by_turn": {t: round(sum(v) / len(v), 4) for t, v in sorted(by_turn.items())},
        "lossless": results["lossless"], "eval_requests": len(results["per_prompt"]), "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--train", type=int, default=1500, help="training conversations")
    parser.add_argument("--eval-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-length", type=int, default=512, help="data.max_length and tokens per batch")
    parser.add_argument("--max-chars", type=int, default=1600, help="longest conversation taken, in characters")
    parser.add_argument("--run-root", default=str(ROOT / "runs/multiturn-row"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/multiturn-qwen3-template.json"))
    args = parser.parse_args(argv)
    run_root = Path(args.run_root).resolve()
    run_root.mkdir(parents=True, exist_ok=True)
    log, cache = run_root / "commands.log", run_root / "tokens"
    target = make_target(run_root / "target")
    data, prompts, conversations, scanned = make_data(run_root, train=args.train, eval_prompts=args.eval_prompts,
                                       max_chars=args.max_chars)
    common = ["--config", str(ROOT / "configs/demo-cpu.yaml"), f"model.target={target}",
              f"data.paths=[{data}]", "data.heldout_samples=0", f"data.cache_dir={cache}",
              f"data.max_length={args.max_length}", f"pipeline.tokens_per_batch={args.max_length}",
              "model.dtype=float32", f"training.max_steps={args.steps}", f"training.seed={args.seed}",
              "logging.console=false", f"eval.prompts={prompts}", "eval.first_turn_only=false",
              "eval.num_prompts=null", f"eval.max_new_tokens={args.max_new_tokens}"]
    rows = [run_arm(name, extra, common, run_root, log, cache) for name, extra in ARMS.items()]
    per_turn, last = rows
    result = {
        "target": "SmolLM2-135M-Instruct with the Qwen3 chat template (llama.cpp corpus, " + QWEN3 + ")",
        "data": f"embedded ShareGPT: {conversations} conversations with >= 2 assistant turns and <= "
                f"{args.max_chars} characters (of the first {scanned} records), {args.eval_prompts} more "
                "held out as prompts (<= 3 user turns)",
        "recipe": f"configs/demo-cpu.yaml, data.max_length={args.max_length}, float32, same steps and seed per arm",
        "steps": args.steps, "seed": args.seed,
        "max_new_tokens": args.max_new_tokens,
        "expansion_overhead_note": "per-turn samples' tokens / all tokens of the per-turn arm",
        "expansion_overhead": round(per_turn["expansion_tokens"] / per_turn["total_tokens"], 4),
        "supervised_ratio": round(per_turn["supervised_tokens"] / last["supervised_tokens"], 3),
        "tau_delta": round(per_turn["tau"] - last["tau"], 4),
        "rows": rows,
        # The run folder as the docs' command names it: relative to the repository when inside it.
        "commands": "dflash-trainer prepare|train|eval " + " ".join(common[2:]).replace(
            str(run_root.resolve()), _shown(run_root)),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
