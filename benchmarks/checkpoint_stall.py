"""How much a checkpoint save delays the training loop: asynchronous vs synchronous saves.

    python -m benchmarks.checkpoint_stall [--layers 5] [--every 4] [--steps 14]
                                          [--device auto|cpu|cuda]

One process, three runs of the same real training (the embedded SmolLM2-135M-Instruct target,
a drafter of ``--layers`` decoder layers for it, synthetic chat data): no periodic saves
(baseline), asynchronous saves every ``--every`` steps (``checkpoint.async_save=true``, the
default), synchronous saves at the same steps. For each run:

- main-thread time per save: the time ``Trainer.save_checkpoint`` holds the training thread
  (the snapshot copy to CPU, the hand-off, and waiting for a previous write if one is still
  running); measured exactly;
- loop stall per save: the extra wall time of the training loop per save over the baseline,
  from the intervals between consecutive trained batches (this includes the writer thread
  competing for CPU and the GIL; it is an estimate, noisy on a shared machine);
- the background write time (dcp.save of the training state, drafter export, checksums,
  fsync, rename).

Stalls are printed in seconds and as a fraction of one baseline step. The first ``--warmup``
steps of each run (pipeline start) are left out.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_trainer.core import assets
from dflash_trainer.config import load_config
from dflash_trainer.training.trainer import Trainer

WORDS = ("the model drafts tokens block diffusion target verify accept speed cache layer hidden "
         "state anchor mask loss gamma decay train step batch bucket queue").split()


def write_chat_data(path: Path, num: int, seed: int = 0) -> Path:
    """OpenAI-messages JSONL with assistant turns of varied lengths."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(num):
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.choice([60, 120, 180])))
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"question {i}: " + " ".join(rng.sample(WORDS, 6))},
                {"role": "assistant", "content": answer}]}) + "\n")
    return path


def run(root: Path, name: str, args: argparse.Namespace, data: Path,
        checkpoint: list[str]) -> dict[str, Any]:
    """Train ``args.steps`` steps; step intervals, save times and the state size."""
    cfg = load_config(None, [
        f"model.target={assets.resolve_target('smollm2')}", f"data.paths=[{data}]",
        f"data.cache_dir={root / 'cache'}", f"run_dir={root / name}", "data.max_length=256",
        "data.heldout_samples=0", "pipeline.tokens_per_batch=256", "pipeline.num_buckets=2",
        f"pipeline.device={args.device}", f"model.num_layers={args.layers}",
        "training.num_anchors=8", "training.epochs=4", "logging.every_steps=1000",
        "logging.console=false", "logging.tensorboard=false", *checkpoint])
    trainer = Trainer(cfg)
    ends: list[float] = []
    save_times: list[float] = []
    original: Callable[..., None] = trainer.save_checkpoint

    def timed_save(*a: Any, **kw: Any) -> None:
        start = time.perf_counter()
        original(*a, **kw)
        if len(ends) < args.steps:  # not the final save after the measured steps
            save_times.append(time.perf_counter() - start)

    trainer.save_checkpoint = timed_save  # type: ignore[method-assign]

    def on_batch(_batch: Any) -> None:
        if trainer.device.type == "cuda":
            import torch

            torch.cuda.synchronize(trainer.device)
        ends.append(time.perf_counter())

    try:
        trainer.train(stop_after_steps=args.steps, on_batch=on_batch)
    finally:
        trainer.close()
    intervals = [b - a for a, b in zip(ends, ends[1:])][args.warmup:]
    params = sum(p.numel() for p in trainer.drafter.parameters())
    return {"intervals": intervals, "saves": save_times, "params": params,
            "writes": list(trainer.checkpointer.write_seconds[:len(save_times)]),
            "state_mb": sum(f.stat().st_size for f in (root / name / "checkpoints").rglob("*")
                            if f.is_file() and "drafter" not in f.parts)
            / 2**20 / max(1, len(list((root / name / "checkpoints").glob("step-*"))))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=5, help="drafter decoder layers")
    parser.add_argument("--every", type=int, default=4, help="save every N steps")
    parser.add_argument("--steps", type=int, default=14, help="steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first intervals left out")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = write_chat_data(root / "chat.jsonl", num=160)
        every = [f"checkpoint.every_steps={args.every}", "checkpoint.keep_last=2"]
        results = {
            "baseline": run(root, "baseline", args, data, []),
            "async": run(root, "async", args, data, every + ["checkpoint.async_save=true"]),
            "sync": run(root, "sync", args, data, every + ["checkpoint.async_save=false"]),
        }
    base = results["baseline"]["intervals"]
    step = statistics.median(base)
    print(f"drafter: {args.layers} layers, {results['async']['params'] / 1e6:.1f}M parameters; "
          f"checkpoint training state {results['async']['state_mb']:.0f} MiB (train/ shards: "
          f"weights, AdamW moments and the other objects' state)")
    print(f"baseline step: median {step:.3f} s, mean {statistics.mean(base):.3f} s, "
          f"stdev {statistics.pstdev(base):.3f} s over {len(base)} steps")
    print(f"{'mode':<6} {'saves':>5} {'main-thread/save':>17} {'(steps)':>8} "
          f"{'loop stall/save':>24} {'(steps)':>8} {'write (bg)':>11}")
    stalls = {}
    for mode in ("async", "sync"):
        r = results[mode]
        saves = len(r["saves"])
        main_thread = statistics.mean(r["saves"])
        extra = sum(r["intervals"]) - statistics.mean(base) * len(r["intervals"])
        stall = extra / max(1, saves)
        # Step-to-step noise of the baseline, carried to a sum over this run's intervals.
        noise = statistics.pstdev(base) * len(r["intervals"]) ** 0.5 / max(1, saves)
        stalls[mode] = (main_thread, stall)
        write = statistics.mean(r["writes"]) if r["writes"] else float("nan")
        print(f"{mode:<6} {saves:>5} {main_thread:>15.3f} s {main_thread / step:>8.3f} "
              f"{stall:>9.3f} s +- {noise:.3f} s {stall / step:>8.3f} {write:>9.3f} s")
    print(f"async / sync, main-thread time per save: "
          f"{stalls['async'][0] / stalls['sync'][0]:.3f}")
    print(f"async / sync, loop stall per save (estimate): "
          f"{stalls['async'][1] / stalls['sync'][1]:.3f}")


if __name__ == "__main__":
    main()
