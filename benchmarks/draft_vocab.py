"""A pruned draft vocabulary against the whole one: time of the trainer's training step and of one
drafted block, at equal shapes, side by side in one process.

    python -m benchmarks.draft_vocab [--sizes 8192,16384] [--blocks 4,8] [--repeats 12]
        [--out benchmarks/results/draft-vocab-step.json]

One training step is ``DrafterStep.train_micro_batch`` (objective forward with the chunked
LM-head loss, backward, clipping, fused AdamW), built by ``components.build_drafter_step`` from
``configs/demo-cpu.yaml`` with ``model.draft_vocab_size`` set per arm: the demo's batch (one
256-token row, 192 anchors) with the loss on slot 1 at block 4 (the demo) and on every slot at
block 8. One drafted block is what eval, generate and the demo run per verify step: the drafter's
forward over a 256-token context and the block, then ``propose`` (its LM head and the argmax).
The target is a random Qwen3 of SmolLM2's width and vocabulary (49,152), cut to the three layers
the taps need; its features and greedy labels are computed once, outside the timed steps.

Which tokens a pruned arm keeps does not change its cost; the arms keep the first ``size`` ids.
The arms take turns one step at a time (the order reverses every round) after ``--warmup``
steps each; the median per arm and its ratio to the whole vocabulary's are reported, with the
load before and after and a busy flag (``dflash_trainer.evaluation.speedup``). First, the
share of the config's training data's supervised tokens each size in ``--coverage`` covers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.dflash2_step import VOCAB, Shape, _busy, _ints, _write, make_inputs, make_target
from dflash_trainer.config import load_config
from dflash_trainer.core.distributed import DistInfo
from dflash_trainer.data.draft_vocab import DraftVocab
from dflash_trainer.evaluation.speedup import LoadSample, MachineProbe, usable_cpus
from dflash_trainer.model.batch import StepInput
from dflash_trainer.training.components import DrafterSide, build_drafter_step

ROOT = Path(__file__).resolve().parents[1]


def build_arm(shape: Shape, size: int | None, target: torch.nn.Module, config_path: str) -> DrafterSide:
    """The trainer's drafter side with a draft vocabulary of ``size`` tokens (None: all)."""
    sets = [f"model.block_size={shape.block}", "model.drafter_init=random", "model.target_layer_ids=[0,1]",
            f"model.mask_token_id={shape.vocab - 1}", "model.dtype=float32"]
    if shape.all_slots:
        sets.append("training.loss_slots=null")
    vocab = None
    if size is not None:
        sets.append(f"model.draft_vocab_size={size}")
        vocab = DraftVocab(token_ids=np.arange(size), vocab_size=shape.vocab, covered=0, supervised=0)
    cfg = load_config(config_path, sets)
    torch.manual_seed(cfg.training.seed)
    side = build_drafter_step(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
                              target, mask_token_id=shape.vocab - 1, tokenizer=None, total_steps=10**6,
                              compute_dtype=torch.float32, draft_vocab=vocab)
    side.extractor.close()
    return side


@torch.inference_mode()
def draft_block(side: DrafterSide, target: torch.nn.Module, item: StepInput) -> torch.Tensor:
    """One drafted block as the decoding loop drafts it: the drafter over the sample's context and
    ``[anchor, MASK x (B-1)]``, then ``propose`` (greedy)."""
    drafter = side.drafter
    context = item.target.features
    width, block = context.shape[1], drafter.block_size
    block_ids = torch.full((1, block), drafter.mask_token_id, dtype=torch.long)
    block_ids[0, 0] = item.batch.input_ids[0, -1]
    positions = torch.arange(width + block)[None]
    hidden = drafter(positions, target.get_input_embeddings()(block_ids), context)
    drafts, _ = drafter.propose(hidden[:, 1:], block_ids[:, 0], target.get_output_embeddings(), 0.0)
    return drafts


def time_arms(shape: Shape, sizes: list[int | None], args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Seconds per training step and per drafted block of each arm, arms taking turns."""
    target = make_target(shape)
    inputs = make_inputs(shape, target, args.config, args.samples)
    sides = {size: build_arm(shape, size, target, args.config) for size in sizes}
    for side in sides.values():
        for step in range(args.warmup):
            side.drafter_step.train_micro_batch(inputs[step % len(inputs)])
            draft_block(side, target, inputs[step % len(inputs)])
    times: dict[str, dict[str, list[float]]] = {_name(size): {"step": [], "draft": []} for size in sizes}
    for rnd in range(args.repeats):
        for size in sizes if rnd % 2 == 0 else sizes[::-1]:
            item = inputs[rnd % len(inputs)]
            start = time.perf_counter()
            sides[size].drafter_step.train_micro_batch(item)
            middle = time.perf_counter()
            for _ in range(args.drafts):
                draft_block(sides[size], target, item)
            times[_name(size)]["step"].append(middle - start)
            times[_name(size)]["draft"].append((time.perf_counter() - middle) / args.drafts)
    return times


def _name(size: int | None) -> str:
    return "full" if size is None else str(size)


def summarise(times: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Median, quartiles and the ratio to the whole vocabulary's median, per arm and measure."""
    rows: dict[str, Any] = {}
    for arm, measures in times.items():
        rows[arm] = {}
        for measure, values in measures.items():
            quartiles = statistics.quantiles(values, n=4)
            median = statistics.median(values)
            rows[arm][f"{measure}_s_median"] = median
            rows[arm][f"{measure}_s_quartiles"] = [quartiles[0], quartiles[2]]
            rows[arm][f"{measure}_ratio"] = median / statistics.median(times["full"][measure])
            rows[arm][f"{measure}_s_all"] = values
    return rows


def coverage(config_path: str, sizes: list[int]) -> dict[str, Any]:
    """The share of the config's training data's supervised tokens that each pruned vocabulary
    covers (what a run prints at its start), from its prepared token store."""
    from dflash_trainer.core import assets
    from dflash_trainer.data.draft_vocab import choose_draft_vocab
    from dflash_trainer.data.prepare import build_dataset

    cfg = load_config(config_path, [])
    store, _ = build_dataset(cfg, tokenizer=assets.load_tokenizer(assets.resolve_target(cfg.model.target)))
    rows = {}
    for size in sizes:
        vocab = choose_draft_vocab(store, size, VOCAB)
        rows[str(size)] = {"covered": vocab.covered, "supervised": vocab.supervised, "coverage": vocab.coverage}
        print(vocab.describe(), flush=True)
    return {"samples": len(store), "sizes": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/demo-cpu.yaml")
    parser.add_argument("--sizes", type=_ints, default=[8192, 16384], help="pruned arms (the whole vocabulary too)")
    parser.add_argument("--blocks", type=_ints, default=[4, 8], help="4: loss on slot 1; 8: on every slot")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--drafts", type=int, default=4, help="drafted blocks timed after each step")
    parser.add_argument("--samples", type=int, default=2, help="distinct inputs the steps cycle through")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--coverage", type=_ints, default=[4096, 8192, 16384, 32768],
                        help="vocabulary sizes whose coverage of the config's training data is counted")
    parser.add_argument("--no-coverage", action="store_true", help="skip the coverage count (no data needed)")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="the random target's vocabulary")
    parser.add_argument("--out", default=None, help="JSON results file")
    args = parser.parse_args(argv)
    data_coverage = None if args.no_coverage else coverage(args.config, args.coverage)
    torch.set_num_threads(args.threads)
    probe = MachineProbe()
    before = LoadSample.read(probe)
    started = time.perf_counter()
    groups = []
    sizes: list[int | None] = [None, *args.sizes]
    for block in args.blocks:
        shape = Shape(hidden=args.hidden, block=block, all_slots=block != 4, vocab=args.vocab)
        group_before = LoadSample.read(probe)
        times = time_arms(shape, sizes, args)
        group_after = LoadSample.read(probe)
        rows = summarise(times)
        groups.append({"shape": asdict(shape), "loss_on": "every slot" if shape.all_slots else "slot 1",
                       "arms": rows, "load_before": asdict(group_before), "load_after": asdict(group_after),
                       "busy": _busy(group_before, group_after, args.threads)})
        print(f"block {block}, loss on {groups[-1]['loss_on']}:", flush=True)
        for arm, row in rows.items():
            print(f"  {arm:>6s} tokens: step {row['step_s_median'] * 1e3:6.0f} ms (x{row['step_ratio']:.2f}), "
                  f"drafted block {row['draft_s_median'] * 1e3:6.1f} ms (x{row['draft_ratio']:.2f})", flush=True)
        if groups[-1]["busy"]:
            print("  busy: other work ran beside these arms", flush=True)
    report = {"config": args.config, "vocab": args.vocab, "hidden": args.hidden, "threads": args.threads,
              "dtype": "float32", "repeats": args.repeats, "warmup": args.warmup, "drafts": args.drafts,
              "cpus": usable_cpus(), "load_before": asdict(before), "load_after": asdict(LoadSample.read(probe)),
              "busy": any(g["busy"] for g in groups), "seconds": time.perf_counter() - started, "groups": groups,
              "data_coverage": data_coverage}
    if args.out:
        _write(args.out, report)
    print(json.dumps({g["shape"]["block"]: {a: round(r["step_ratio"], 3) for a, r in g["arms"].items()}
                      for g in groups}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
