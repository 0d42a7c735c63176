"""Diversity-first interleaving vs a plain shuffle of the same bucketed batches, trained.

    HF_HUB_OFFLINE=1 python -m benchmarks.interleave [--config configs/demo-cpu.yaml]
        [--set KEY=VALUE ...] [--steps 150] [--seeds 0 1] [--work-dir runs/interleave]
        [--out benchmarks/results/interleave.json] [--png docs/interleave.png]

The claim under test: when bucketed batches are plainly shuffled and one bucket holds about
half of the batches, runs of several consecutive steps of that bucket make the loss curve rough
(multi-modal, one level per bucket) and the gradient norm spiky; ``pipeline.order: interleave``
(at most ``pipeline.max_run`` steps of one bucket in a row) is the fix.

For each seed, both orders train through the project's trainer (``train.Trainer``) from the same
initial weights (the trainer seeds the drafter init with ``training.seed``) for the same number
of steps on the same batches: ``pipeline.order`` changes the order of the steps and nothing
else. The data setting (``CLAIM_SETTING``, applied after ``--config`` and before ``--set``) is
the embedded ShareGPT conversations up to 512 tokens (longer ones dropped, not truncated) in
six buckets whose longest holds about half of the steps. Per step, loss and grad norm come from
the run's ``metrics.jsonl`` (logged every step) and the bucket from the batch trained.

Printed side by side per seed: the longest same-bucket run; loss roughness, as the standard
deviation of the per-step loss around its centred moving average and the share of steps whose
loss differs from the previous step's by more than ``--jump`` of the moving average; grad-norm
spikes (steps above twice the median of the previous ``--window`` steps); whether the per-bucket
loss curves separate (the share of the loss residual's variance that the bucket explains,
eta squared, over the second half); and at the end, the loss and slot-1 accuracy on held-out
conversations (the first ``data.heldout_samples`` records, never trained on; the same batches
and anchors for every run). Roughness and spikes skip the first ``--skip`` steps (warmup).

Writes the JSON (settings, histogram, per-run metrics and per-step curves) and one PNG: for
the first seed, the loss per step of both orders coloured by bucket, then both grad-norm
curves, one above the other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.batch_plan import bucket_histogram, format_histogram
from dflash_trainer.config import Config, config_to_dict, load_config
from dflash_trainer.data.buckets import build_plan, longest_run
from dflash_trainer.data.prepare import build_dataset
from dflash_trainer.model.batch import Batch
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.target import FeatureExtractor, TargetOutputs
from dflash_trainer.training.pipeline.prefetch import PrefetchOptions, collate

ORDERS = ("interleave", "shuffle")
CLAIM_SETTING = [
    "data.max_length=512",
    # Dropped, not truncated: truncation piles 80% of the samples up at exactly max_length,
    # one bucket; whole conversations up to 512 tokens spread over all six.
    "data.on_too_long=drop",
    "data.heldout_samples=200",
    "pipeline.tokens_per_batch=512",
    # The longest bucket (353-512 tokens, one conversation per batch) holds about half of the
    # steps; shorter buckets pack 1-7 conversations per batch.
    "pipeline.bucket_boundaries=[96,160,224,288,352]",
    "pipeline.max_run=2",
    # Cheaper steps on a shared 2-core CPU: the reference's dataset labels (the target runs only
    # up to its feature layer, no LM head) and 32 anchors per conversation.
    "training.labels=data",
    "training.num_anchors=32",
    # The loss on slots 1-3, as in every measured run (the demo has since moved to slot 1 only).
    "training.loss_slots=3",
    "training.max_time_s=null",
    "training.epochs=1",
    "eval.every_steps=null",
    "checkpoint.every_steps=null",
    "checkpoint.every_minutes=null",
    "checkpoint.async_save=false",
    "logging.every_steps=1",
    "logging.every_s=null",
    "logging.tensorboard=false",
    "logging.console=false",
    "logging.wandb=disabled",
]


# -- curves and their statistics -------------------------------------------------------------

def centred_average(values: np.ndarray, window: int) -> np.ndarray:
    """Mean over the ``window`` steps centred on each step (fewer at the ends)."""
    half = window // 2
    sums = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(len(values))
    lo, hi = np.maximum(0, idx - half), np.minimum(len(values), idx + half + 1)
    return (sums[hi] - sums[lo]) / (hi - lo)


def curve_stats(loss: np.ndarray, grad_norm: np.ndarray, buckets: np.ndarray, *, window: int,
                jump: float, skip: int) -> dict[str, Any]:
    """Roughness, spikes and bucket separation of one run's per-step curves."""
    trend = centred_average(loss, window)
    residual = loss - trend
    steps = np.arange(len(loss))
    after = steps >= skip
    jumps = np.abs(np.diff(loss)) > jump * trend[1:]
    medians = np.array([np.median(grad_norm[max(0, t - window):t]) if t else np.inf
                        for t in steps])
    spikes = (grad_norm > 2 * medians) & after
    late = steps >= len(loss) // 2
    per_bucket = {}
    for b in np.unique(buckets[late]):
        r = residual[late & (buckets == b)]
        per_bucket[int(b)] = {"steps": int(len(r)), "mean_residual": float(r.mean()),
                              "mean_loss": float(loss[late & (buckets == b)].mean())}
    centred = residual[late] - residual[late].mean()
    between = sum(v["steps"] * (v["mean_residual"] - residual[late].mean()) ** 2
                  for v in per_bucket.values())
    total = float((centred ** 2).sum())
    return {
        "longest_run": longest_run(buckets.tolist()),
        "loss_residual_std": float(residual[after].std()) if after.any() else 0.0,
        "loss_jump_share": float(jumps[after[1:]].mean()) if after[1:].any() else 0.0,
        "grad_norm_spikes": int(spikes.sum()),
        "grad_norm_spike_share": float(spikes[after].mean()) if after.any() else 0.0,
        "bucket_eta2": between / total if total > 0 else 0.0,
        "per_bucket_late": per_bucket,
    }


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The per-step training records of a run's ``metrics.jsonl`` (the last per step)."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if "train/loss" in record:
            by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


# -- held-out evaluation ---------------------------------------------------------------------

@dataclasses.dataclass
class HeldOut:
    """Fixed held-out batches (same anchors for every run) and, once computed, the target's
    outputs for them (the same frozen target in every run)."""

    batches: list[Batch]
    target_outputs: list[TargetOutputs] | None = None


def heldout_batches(cfg: Config, *, num_anchors: int, block_size: int) -> HeldOut:
    """The first ``data.heldout_samples`` records, prepared like the training data, packed
    like it and collated by the prefetcher's ``collate`` with seed 0 (the same anchors in
    every run)."""
    held = dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, heldout_samples=0, max_samples=cfg.data.heldout_samples))
    store, _ = build_dataset(held, log=None)
    plan = build_plan(np.asarray(store.lengths), cfg.pipeline, seed=0, epoch=0)
    options = PrefetchOptions(rank=0, num_workers=1, num_anchors=num_anchors,
                              block_size=block_size, seed=0, epochs=1)
    return HeldOut([collate(store, plan, step, options) for step in range(len(plan))])


@torch.no_grad()
def evaluate_heldout(trainer: Any, cfg: Config, heldout: HeldOut) -> dict[str, float]:
    """Loss (the training objective) and slot-1 accuracy of the trained drafter on the
    held-out batches, with the trainer's target, dtype and objective settings."""
    drafter = trainer.drafter
    extractor = FeatureExtractor(trainer.target, drafter.target_layer_ids,
                                 labels=cfg.training.labels,
                                 label_chunk_size=cfg.training.loss_chunk_size)
    try:
        objective = DFlashObjective.from_config(drafter, extractor.embed_weight,
                                                extractor.head_weight, cfg)
        autocast = trainer.compute_dtype if trainer.compute_dtype != torch.float32 else None
        drafter.eval()
        if heldout.target_outputs is None:
            heldout.target_outputs = [extractor(b.input_ids, b.attention_mask)
                                      for b in heldout.batches]
        loss = weight = correct1 = count1 = 0.0
        for batch, target in zip(heldout.batches, heldout.target_outputs):
            with torch.autocast("cpu", dtype=autocast or torch.float32,
                                enabled=autocast is not None):
                sums = objective(batch, target, 0)
            loss += float(sums.loss)
            weight += float(sums.weight)
            correct1 += float(sums.correct_per_slot[0])
            count1 += float(sums.count_per_slot[0])
    finally:
        extractor.close()
    return {"heldout_loss": loss / max(weight, 1e-9), "heldout_acc_slot1": correct1 / max(count1, 1),
            "heldout_batches": len(heldout.batches), "heldout_blocks_slot1": count1}


# -- one training run ------------------------------------------------------------------------

def train_one(cfg: Config, heldout_for: dict[str, Any]) -> dict[str, Any]:
    """Train one order through ``Trainer`` and return its per-step curves and held-out result."""
    from dflash_trainer.training.trainer import Trainer

    run_dir = Path(cfg.run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh run every time: this benchmark owns its run dirs
    started = time.perf_counter()
    trainer = Trainer(cfg)
    buckets: list[int] = []
    try:
        init = [p.detach().double().sum().item() for p in trainer.drafter.parameters()]
        t0 = time.perf_counter()
        trainer.train(on_batch=lambda batch: buckets.append(int(batch.bucket)))
        train_s = time.perf_counter() - t0
    finally:
        trainer.close()
    records = read_metrics(run_dir)
    if "heldout" not in heldout_for:
        heldout_for["heldout"] = heldout_batches(cfg, num_anchors=heldout_for["anchors"],
                                                 block_size=trainer.drafter.block_size)
    result = evaluate_heldout(trainer, cfg, heldout_for["heldout"])
    logged = [b for r in records for b in r.get("data/step_buckets", [])]
    if logged and logged != buckets[:len(logged)]:
        raise AssertionError("metrics.jsonl data/step_buckets disagrees with the batches trained")
    if len(records) != len(buckets):
        raise AssertionError(f"{len(records)} logged steps for {len(buckets)} batches trained: "
                             f"logging.every_steps must be 1 and grad_accum 1")
    return {
        "steps": len(buckets),
        "stopped_by": trainer.stopped_by,
        "train_s": train_s,
        "total_s": time.perf_counter() - started,
        "init_checksum": float(np.sum(init)),
        "bucket": buckets,
        "loss": [float(r["train/loss"]) for r in records],
        "grad_norm": [float(r["train/grad_norm"]) for r in records],
        "acc_slot1": [float(r.get("train/acc_pos/1", float("nan"))) for r in records],
        **result,
    }


# -- output ----------------------------------------------------------------------------------

def format_table(results: dict[str, dict[str, dict[str, Any]]], jump: float) -> str:
    """Per seed, the two orders side by side; then the means over seeds."""
    rows = [("steps", "steps", "{:d}"),
            ("longest same-bucket run", "longest_run", "{:d}"),
            ("loss residual std", "loss_residual_std", "{:.4f}"),
            (f"loss jumps > {jump:.0%} (share)", "loss_jump_share", "{:.3f}"),
            ("grad-norm spikes > 2x median", "grad_norm_spikes", "{:d}"),
            ("grad-norm spike share", "grad_norm_spike_share", "{:.3f}"),
            ("bucket eta^2 (2nd half)", "bucket_eta2", "{:.3f}"),
            ("held-out loss", "heldout_loss", "{:.4f}"),
            ("held-out acc slot 1", "heldout_acc_slot1", "{:.4f}"),
            ("train seconds", "train_s", "{:.0f}")]
    seeds = list(results)
    head = f"{'':<30}" + "".join(f"{f'seed {s} {o}':>20}" for s in seeds for o in ORDERS)
    head += "".join(f"{f'mean {o}':>18}" for o in ORDERS)
    lines = [head, "-" * len(head)]
    for label, key, fmt in rows:
        cells = [fmt.format(results[s][o][key]) for s in seeds for o in ORDERS]
        means = [np.mean([results[s][o][key] for s in seeds]) for o in ORDERS]
        mean_fmt = fmt.replace(":d", ":.1f")
        lines.append(f"{label:<30}" + "".join(f"{c:>20}" for c in cells)
                     + "".join(f"{mean_fmt.format(m):>18}" for m in means))
    for s in seeds:
        for o in ORDERS:
            levels = ", ".join(f"{b}: {v['mean_loss']:.3f}"
                               for b, v in results[s][o]["per_bucket_late"].items())
            lines.append(f"seed {s} {o:<10} mean loss per bucket, 2nd half: {levels}")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict[str, Any]]], seed: str, num_buckets: int,
         window: int, path: Path) -> None:
    """Loss per step (coloured by bucket) of both orders, then both grad-norm curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("viridis")(np.linspace(0, 0.95, num_buckets))
    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True)
    for row, (kind, key) in enumerate((("loss", "loss"), ("grad norm", "grad_norm"))):
        values = [np.asarray(results[seed][o][key]) for o in ORDERS]
        lo, hi = min(v.min() for v in values), max(v.max() for v in values)
        for k, order in enumerate(ORDERS):
            ax = axes[2 * row + k]
            run = results[seed][order]
            y = np.asarray(run[key])
            b = np.asarray(run["bucket"])
            x = np.arange(1, len(y) + 1)
            ax.plot(x, y, color="0.75", linewidth=0.6, zorder=1)
            if key == "loss":
                ax.plot(x, centred_average(y, window), color="black", linewidth=1.0, zorder=3,
                        label=f"{window}-step centred mean")
            ax.scatter(x, y, c=colours[b], s=9, zorder=2)
            if key == "grad_norm":
                # Log scale: the warmup's large norms would flatten the later spikes.
                ax.set_yscale("log")
                ax.set_ylim(lo / 1.1, hi * 1.1)
            else:
                ax.set_ylim(lo - 0.03 * (hi - lo), hi + 0.03 * (hi - lo))
            ax.set_ylabel(kind)
            ax.set_title(f"{kind}, order {order} (longest same-bucket run {run['longest_run']}, "
                         f"seed {seed})", fontsize=10, loc="left")
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=colours[b], label=f"bucket {b}")
               for b in range(num_buckets)]
    axes[0].legend(handles=handles + axes[0].get_legend_handles_labels()[0], ncol=4, fontsize=8,
                   loc="upper right")
    axes[-1].set_xlabel("optimizer step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark; returns what it writes to ``--out``."""
    base = load_config(args.config, CLAIM_SETTING + [f"training.max_steps={args.steps}"]
                       + args.set)
    store, _ = build_dataset(base, log=None)
    lengths = np.asarray(store.lengths)
    plan = build_plan(lengths, base.pipeline, seed=base.training.seed, epoch=0)
    histogram = bucket_histogram(plan, lengths)
    print(f"data: {len(lengths)} samples ({base.data.paths}, max_length {base.data.max_length}, "
          f"on_too_long {base.data.on_too_long}), mean {lengths.mean():.0f} tokens; "
          f"tokens_per_batch {base.pipeline.tokens_per_batch}; {args.steps} steps per run")
    print(format_histogram(histogram), flush=True)
    heldout_for: dict[str, Any] = {"anchors": args.heldout_anchors}
    header = {
        "command": "python -m benchmarks.interleave " + " ".join(sys.argv[1:]),
        "settings": {"claim_setting": CLAIM_SETTING, "set": args.set, "steps": args.steps,
                     "seeds": args.seeds, "window": args.window, "jump": args.jump,
                     "skip": args.skip, "heldout_anchors": args.heldout_anchors},
        "config": config_to_dict(base),
        "histogram": histogram,
        "torch": torch.__version__,
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for seed in args.seeds:
        results[str(seed)] = {}
        for order in ORDERS:
            cfg = load_config(args.config, CLAIM_SETTING + [
                f"training.max_steps={args.steps}", *args.set, f"training.seed={seed}",
                f"pipeline.order={order}", f"run_dir={Path(args.work_dir) / f'seed{seed}-{order}'}"])
            print(f"seed {seed}, order {order}: training {args.steps} steps ...", flush=True)
            out = train_one(cfg, heldout_for)
            out.update(curve_stats(np.asarray(out["loss"]), np.asarray(out["grad_norm"]),
                                   np.asarray(out["bucket"]), window=args.window,
                                   jump=args.jump, skip=args.skip))
            results[str(seed)][order] = out
            print(f"  {out['steps']} steps in {out['train_s']:.0f} s, longest run "
                  f"{out['longest_run']}, held-out loss {out['heldout_loss']:.4f}", flush=True)
            if args.out:  # what is done so far survives an interrupted run
                _write_json(args.out, {**header, "partial": True, "results": results})
        a, b = (results[str(seed)][o] for o in ORDERS)
        if a["init_checksum"] != b["init_checksum"]:
            raise AssertionError(f"seed {seed}: the two orders started from different weights")
        if sorted(a["bucket"]) != sorted(b["bucket"]) and a["steps"] == len(plan):
            raise AssertionError(f"seed {seed}: the orders trained different buckets")
    table = format_table(results, args.jump)
    print(table)
    report = {**header, "table": table, "results": results,
              "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.out:
        _write_json(args.out, report)
        print(f"wrote {args.out}")
    if args.png:
        plot(results, str(args.seeds[0]), len(plan.boundaries), args.window, Path(args.png))
        print(f"wrote {args.png}")
    return report


def _write_json(path: str, data: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo-cpu.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override after the claim setting, repeatable")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--work-dir", default="runs/interleave", help="the runs' run dirs")
    parser.add_argument("--window", type=int, default=21,
                        help="steps of the moving average and of the running median")
    parser.add_argument("--jump", type=float, default=0.10,
                        help="a loss jump is a change of more than this share of the average")
    parser.add_argument("--skip", type=int, default=20,
                        help="first steps left out of roughness and spikes (warmup)")
    parser.add_argument("--heldout-anchors", type=int, default=64,
                        help="anchors per held-out conversation")
    parser.add_argument("--out", default="benchmarks/results/interleave.json")
    parser.add_argument("--png", default="docs/interleave.png")
    parser.add_argument("--replot", default=None, metavar="JSON",
                        help="only redraw --png from a result JSON of this script")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        report = json.loads(Path(args.replot).read_text())
        seed = str(report["settings"]["seeds"][0])
        plot(report["results"], seed, len(report["histogram"]), report["settings"]["window"],
             Path(args.png))
        print(f"wrote {args.png}")
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
