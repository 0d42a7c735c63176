"""Screen what moves early learning, on cached target outputs: held-out slot agreement at fixed steps.

Usage::

    .venv/bin/python -m benchmarks.levers --config configs/demo-cpu.yaml --train-samples 48 \\
        --heldout-samples 8 --checkpoints 50,150,500 --seeds 0,1 \\
        --variant base \\
        --variant init:model.drafter_init=target \\
        --variant late:model.target_layer_ids=[27] \\
        --out benchmarks/results/levers.json

The target runs once: the outputs of every tapped layer any variant needs and the final
hidden states (the KL target) of ``--train-samples + --heldout-samples`` samples of the run's
token store are cached in memory (and on disk under ``--cache-dir``, keyed by the target, the
data and the layers). Each variant then runs drafter-only optimizer steps on the training
samples in turn, one sample per step, with the trainer's own drafter side and training step
(``components.build_drafter_step``: drafter, init, objective, optimizer, lr schedule and the
``DrafterStep``), and measures the agreement of the
drafter's slot-k argmax with the target's argmax on the held-out samples (fixed anchors: every
valid anchor up to ``--eval-anchors`` per sample) at each checkpoint step.

Agreement with the target's greedy choice is what acceptance is made of: slot-1 agreement
``p1`` bounds tau from below by ``1 + p1`` and tracks it closely at these budgets. The step
counts are exact and the results do not depend on how loaded the machine is (only the wall
time does); the target's forward is not part of a step here, so a lever that changes the
target's cost (more tapped layers) must be judged with ``benchmarks/quality.py`` as well.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.quality import split_overrides
from dflash_trainer.core import assets
from dflash_trainer.training.components import build_drafter_step, run_mask_token_id
from dflash_trainer.config import Config, load_config
from dflash_trainer.data.prepare import build_dataset
from dflash_trainer.core.distributed import DistInfo
from dflash_trainer.model.batch import Batch, StepInput
from dflash_trainer.model.blocks import sample_anchors
from dflash_trainer.model.drafter import tapped_layer_ids, text_config
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.target import FeatureExtractor, TargetOutputs, greedy_next_tokens, load_target
from dflash_trainer.training.pipeline.metrics import combine

__all__ = ["Cached", "cache_outputs", "run_variant"]


@dataclass(kw_only=True)
class Cached:
    """Target outputs of one sample (unpadded, batch dimension 1)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    layers: dict[int, torch.Tensor]
    final_hidden: torch.Tensor
    greedy_labels: torch.Tensor | None = None


def cache_outputs(target: torch.nn.Module, store: Any, indices: list[int], layer_ids: list[int],
                  *, max_length: int) -> list[Cached]:
    """Run the target once per sample; keep the tapped layers' outputs and the final hidden states."""
    extractor = FeatureExtractor(target, layer_ids, labels="kl")
    try:
        out = []
        for i in indices:
            ids, mask = store[i]
            ids = torch.as_tensor(ids[:max_length], dtype=torch.long)[None]
            mask = torch.as_tensor(mask[:max_length], dtype=torch.bool)[None]
            outputs = extractor(ids)
            width = outputs.features.shape[-1] // len(layer_ids)
            parts = outputs.features.split(width, dim=-1)
            out.append(Cached(input_ids=ids, loss_mask=mask, final_hidden=outputs.final_hidden.float(),
                              layers={lid: p.float().clone() for lid, p in zip(layer_ids, parts, strict=True)}))
        return out
    finally:
        extractor.close()


def _batch(sample: Cached, anchors: torch.Tensor, keep: torch.Tensor) -> Batch:
    return Batch.of_rows(sample.input_ids, sample.loss_mask, anchors=anchors, keep=keep)


def _target(sample: Cached, layer_ids: list[int], labels: FeatureExtractor | None) -> TargetOutputs:
    """The cached outputs as the trainer's target stage gives them; greedy labels as
    ``labels`` (the run's extractor, when it makes them) derives them."""
    if labels is not None and sample.greedy_labels is None:
        # From the cached final states, once per sample, for the variants with
        # training.labels=target_greedy.
        sample.greedy_labels = greedy_next_tokens(sample.final_hidden, labels.head_weight,
                                                  sample.input_ids, labels.label_chunk_size)
    return TargetOutputs(features=torch.cat([sample.layers[i] for i in layer_ids], dim=-1),
                         final_hidden=sample.final_hidden, target_labels=sample.greedy_labels)


@torch.no_grad()
def evaluate(objective: DFlashObjective, heldout: list[tuple[Cached, torch.Tensor, torch.Tensor]],
             layer_ids: list[int], labels: FeatureExtractor | None) -> list[float]:
    """Per-slot agreement with the target's argmax over the held-out samples' fixed anchors."""
    objective.eval()
    correct = count = None
    for sample, anchors, keep in heldout:
        sums = objective(_batch(sample, anchors, keep), _target(sample, layer_ids, labels), 10**9)
        c, n = sums.correct_per_slot.double(), sums.count_per_slot.double()
        correct = c if correct is None else correct + c
        count = n if count is None else count + n
    objective.train()
    return (correct / count.clamp_min(1)).tolist()


def run_variant(cfg: Config, *, target: torch.nn.Module, tokenizer: Any, mask_token_id: int,
                train: list[Cached], heldout: list[Cached], checkpoints: list[int], seed: int,
                eval_anchors: int) -> dict[str, Any]:
    """Train one variant from a fresh drafter (initialised from ``seed``) for ``max(checkpoints)``
    optimizer steps; agreement at each checkpoint."""
    total = max(checkpoints)
    torch.manual_seed(seed)
    side = build_drafter_step(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
                              target, mask_token_id=mask_token_id, tokenizer=tokenizer, total_steps=total,
                              compute_dtype=next(target.parameters()).dtype)
    try:
        drafter_step, objective = side.drafter_step, side.objective
        layer_ids = side.drafter.target_layer_ids
        labels = side.extractor if cfg.training.labels == "target_greedy" else None
        block = side.drafter.block_size
        fixed = torch.Generator().manual_seed(1234)
        heldout_batches = []
        for sample in heldout:
            anchors, keep = sample_anchors(sample.loss_mask, eval_anchors, block, fixed)
            heldout_batches.append((sample, anchors, keep))
        gen = torch.Generator().manual_seed(seed)
        curve: dict[int, list[float]] = {}
        losses = []
        start = time.perf_counter()
        micro = 0
        while drafter_step.optimizer_step < total:
            sample = train[micro % len(train)]
            micro += 1
            anchors, keep = sample_anchors(sample.loss_mask, cfg.training.num_anchors, block, gen)
            item = StepInput(batch=_batch(sample, anchors, keep), target=_target(sample, layer_ids, labels))
            if not drafter_step.train_micro_batch(item):
                continue
            losses.append(combine([drafter_step.get_metrics()])["train/loss"])
            step = drafter_step.optimizer_step
            if step in checkpoints:
                curve[step] = evaluate(objective, heldout_batches, layer_ids, labels)
                print(f"    step {step}: slot-1 {curve[step][0]:.3f}  slot-2 "
                      f"{curve[step][1] if len(curve[step]) > 1 else float('nan'):.3f}  "
                      f"loss {statistics.fmean(losses[-20:]):.3f}  ({time.perf_counter() - start:.0f} s)",
                      flush=True)
    finally:
        side.extractor.close()
    return {"seed": seed, "agreement": {str(k): v for k, v in curve.items()},
            "loss_last20": statistics.fmean(losses[-20:]), "seconds": time.perf_counter() - start}


def _cache_key(cfg: Config, target_path: Path, indices: list[int]) -> str:
    parts = json.dumps([str(target_path), cfg.data.paths, cfg.data.max_length, indices])
    return hashlib.sha256(parts.encode()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/demo-cpu.yaml")
    parser.add_argument("--set", action="append", default=[], help="override for every variant")
    parser.add_argument("--variant", action="append", default=[], help="NAME[:KEY=VALUE,...]")
    parser.add_argument("--train-samples", type=int, default=48)
    parser.add_argument("--heldout-samples", type=int, default=8)
    parser.add_argument("--eval-anchors", type=int, default=128)
    parser.add_argument("--checkpoints", default="50,150,500")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", default="runs/levers/cache")
    parser.add_argument("--out", default=None, help="JSON results file")
    parser.add_argument("--markdown", nargs="+", default=None, metavar="FILE",
                        help="print the table of earlier --out files (rows of one variant name are merged) and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        files = [json.loads(Path(f).read_text()) for f in args.markdown]
        common = sorted(set.intersection(*(set(f["checkpoints"]) for f in files)))
        print(format_table([row for f in files for row in f["results"]], common))
        return 0
    torch.set_num_threads(args.threads)
    checkpoints = sorted(int(c) for c in args.checkpoints.split(","))
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = []
    for spec in args.variant or ["base"]:
        name, _, rest = spec.partition(":")
        variants.append((name, args.set + split_overrides(rest)))
    configs = {name: load_config(args.config, overrides) for name, overrides in variants}
    base = configs[variants[0][0]]
    target_path = assets.resolve_target(base.model.target)
    # float32 target: the cached outputs are a fixed yardstick whatever the variants' dtype.
    target, tokenizer = load_target(str(target_path), device="cpu", dtype=torch.float32)
    num_layers = int(text_config(target.config).num_hidden_layers)
    store, _ = build_dataset(base, tokenizer=tokenizer)
    count = args.train_samples + args.heldout_samples
    step = max(1, len(store) // count)
    indices = [i * step for i in range(count)]
    layer_ids = sorted({lid for cfg in configs.values() for lid in tapped_layer_ids(cfg.model, num_layers)})
    cache_file = Path(args.cache_dir) / f"{_cache_key(base, target_path, indices)}.pt"
    cached = [Cached(**item) for item in torch.load(cache_file)] if cache_file.exists() else []
    if not cached or not set(layer_ids) <= set(cached[0].layers):
        # One file per sample set, holding every layer any run asked for so far.
        layer_ids = sorted(set(layer_ids) | (set(cached[0].layers) if cached else set()))
        t0 = time.perf_counter()
        cached = cache_outputs(target, store, indices, layer_ids, max_length=base.data.max_length)
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        torch.save([vars(c) for c in cached], cache_file)
        print(f"cached target outputs of {count} samples, layers {layer_ids}: "
              f"{time.perf_counter() - t0:.0f} s -> {cache_file}", flush=True)
    train, heldout = cached[:args.train_samples], cached[args.train_samples:]
    embed_rows = target.get_input_embeddings().weight.shape[0]
    mask_id = run_mask_token_id(base, tokenizer, embed_rows, store)
    results = []
    for name, overrides in variants:
        for seed in seeds:
            print(f"{name} seed {seed} ({', '.join(overrides) or 'config'})", flush=True)
            row = run_variant(configs[name], target=target, tokenizer=tokenizer, mask_token_id=mask_id, train=train,
                              heldout=heldout, checkpoints=checkpoints, seed=seed,
                              eval_anchors=args.eval_anchors)
            results.append({"variant": name, "overrides": overrides, **row})
            if args.out:
                # After every row: a long screen that is stopped keeps what it measured.
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps({"config": args.config, "checkpoints": checkpoints,
                                                      "train_samples": args.train_samples,
                                                      "heldout_samples": args.heldout_samples,
                                                      "eval_anchors": args.eval_anchors,
                                                      "results": results}, indent=1))
    print()
    print(format_table(results, checkpoints))
    return 0


def format_table(results: list[dict[str, Any]], checkpoints: list[int]) -> str:
    """Markdown table: slot-1 (and slot-2) held-out agreement per variant, mean over seeds."""
    names = list(dict.fromkeys(r["variant"] for r in results))
    head = " | ".join(f"slot-1 @ {c}" for c in checkpoints)
    lines = [f"| variant | overrides | seeds | {head} | slot-2 @ {checkpoints[-1]} |",
             "|---|---|---|" + "---|" * (len(checkpoints) + 1)]
    for name in names:
        rows = [r for r in results if r["variant"] == name]
        cells = []
        for c in checkpoints:
            vals = [r["agreement"][str(c)][0] for r in rows]
            cells.append(f"{statistics.fmean(vals):.3f} ({' / '.join(f'{v:.3f}' for v in vals)})")
        slot2 = [r["agreement"][str(checkpoints[-1])][1] for r in rows if len(r["agreement"][str(checkpoints[-1])]) > 1]
        s2 = f"{statistics.fmean(slot2):.3f}" if slot2 else "-"
        lines.append(f"| {name} | {', '.join(rows[0]['overrides']) or '-'} | {len(rows)} | "
                     f"{' | '.join(cells)} | {s2} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
