"""DFlash2 vs DFlash: time and peak memory of one drafter training step at equal shapes.

    python -m benchmarks.dflash2_step [--hidden 576,1024] [--blocks 4,8] [--ranks 64,128,256]
        [--repeats 8] [--out benchmarks/results/dflash2-step-cpu.json]

One step is the trainer's own ``DrafterStep.train_micro_batch`` (objective forward, the
chunked LM-head loss, the DFlash2 selector loss, backward, gradient clipping, fused AdamW,
schedule), built by ``components.build_drafter_step`` from ``configs/demo-cpu.yaml`` with
``model.variant`` set per arm: the demo's batch (one 256-token row, 192 anchors, the loss on
slot 1) and, with ``--all-slots``, the recipe's loss on every slot of the block (at the
first hidden size). The target
is a random Qwen3 of the given width with SmolLM2's 49,152-token vocabulary, cut to the
three layers the taps need; its outputs (features and greedy labels) are computed once per
sample, outside the timed step, as the pipeline's target stage delivers them.

Time: in one process, every arm of a shape is built and the arms take turns one step at a
time (the order reverses every round), after ``--warmup`` steps each; the median step per
arm and the ratio of sums against the DFlash arm are reported, with the load before and
after (``dflash_trainer.evaluation.speedup``) and a busy flag.

Memory: each arm runs again in a fresh subprocess: its peak resident memory during
``--memory-steps`` steps minus the resident memory after the build (target, drafter,
inputs); the optimizer state and gradients appear in that difference, and are also given
analytically (4 bytes per parameter for the weights and the gradient, 8 for AdamW's
moments). One more step then runs under :class:`LiveTensors`, which counts the tensors the
step creates and holds at once (activations, gradients, temporaries), exactly and whatever
the allocator does.

Where the extra time goes: after the timed steps each arm runs ``--profile-steps`` under the
torch profiler; the operators that cost DFlash2 the most over DFlash are listed.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_trainer.training.components import DrafterSide, build_drafter_step
from dflash_trainer.config import load_config
from dflash_trainer.core.distributed import DistInfo
from dflash_trainer.model.batch import Batch, StepInput
from dflash_trainer.model.blocks import sample_anchors
from dflash_trainer.model.target import FeatureExtractor, TargetOutputs
from dflash_trainer.evaluation.speedup import BUSY_MARGIN, LoadSample, MachineProbe, usable_cpus

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 49152
"""SmolLM2's vocabulary."""
TARGET_LAYERS = 3
"""Taps at layers 0 and 1 (the demo's drafter reads two target layers); the last one is never tapped."""


@dataclass(frozen=True, kw_only=True)
class Shape:
    """The target's width and the step's block."""

    hidden: int
    block: int
    all_slots: bool
    vocab: int = VOCAB

    @property
    def heads(self) -> int:
        """SmolLM2's head width (64) and its 3:1 grouping of query to key/value heads."""
        return self.hidden // 64

    @property
    def kv_heads(self) -> int:  # noqa: D102
        return next(k for k in range(max(1, self.heads // 3), 0, -1) if self.heads % k == 0)

    @property
    def intermediate(self) -> int:  # noqa: D102
        return self.hidden * 8 // 3


def make_target(shape: Shape) -> torch.nn.Module:
    """A random frozen fp32 Qwen3 LM of ``shape``'s width (SmolLM2's proportions)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=TARGET_LAYERS, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval().requires_grad_(False)


def arm_overrides(shape: Shape, arm: str, top_k: int) -> list[str]:
    """``--set`` overrides of the demo config for one arm (``dflash`` or ``dflash2-r<rank>``)."""
    sets = [f"model.block_size={shape.block}", "model.drafter_init=random", "model.target_layer_ids=[0,1]",
            f"model.mask_token_id={shape.vocab - 1}", "model.dtype=float32"]
    if shape.all_slots:
        sets.append("training.loss_slots=null")
    if arm != "dflash":
        rank = int(arm.removeprefix("dflash2-r"))
        sets += ["model.variant=dflash2", f"model.selector_rank={rank}", f"model.selector_top_k={top_k}"]
    return sets


def build_arm(shape: Shape, arm: str, target: torch.nn.Module, *, top_k: int, config_path: str) -> DrafterSide:
    """The trainer's drafter side for one arm on ``target``."""
    cfg = load_config(config_path, arm_overrides(shape, arm, top_k))
    torch.manual_seed(cfg.training.seed)
    side = build_drafter_step(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
                              target, mask_token_id=shape.vocab - 1, tokenizer=None,
                              total_steps=10**6, compute_dtype=torch.float32)
    side.extractor.close()
    return side


def make_inputs(shape: Shape, target: torch.nn.Module, config_path: str, samples: int) -> list[StepInput]:
    """``samples`` step inputs of the demo's batch shape: random tokens, the target's features of
    layers 0 and 1 and its greedy labels, anchors drawn as the trainer draws them."""
    cfg = load_config(config_path, [])
    length, anchors = cfg.data.max_length, cfg.training.num_anchors
    extractor = FeatureExtractor(target, [0, 1], labels=cfg.training.labels)
    gen = torch.Generator().manual_seed(0)
    inputs = []
    try:
        for _ in range(samples):
            ids = torch.randint(0, shape.vocab - 1, (1, length), generator=gen)
            loss_mask = torch.ones_like(ids, dtype=torch.bool)
            loss_mask[:, :length // 10] = False
            with torch.no_grad():
                out = extractor(ids)
            picked, keep = sample_anchors(loss_mask, anchors, shape.block, gen)
            batch = Batch.of_rows(ids, loss_mask, anchors=picked, keep=keep)
            inputs.append(StepInput(batch=batch, target=TargetOutputs(features=out.features.clone(),
                                                                       target_labels=out.target_labels)))
    finally:
        extractor.close()
    return inputs


def trainable_params(side: DrafterSide) -> int:
    """Parameters the optimizer updates."""
    return sum(p.numel() for p in side.drafter_step.parameters)


class LiveTensors(TorchDispatchMode):
    """The peak bytes of tensor storage that operators create while active and that is still
    alive: what one step holds at its worst beyond the state it started with, counted exactly
    (the resident size also holds what the allocator keeps or has not returned)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size and key not in self._seen:
                self._seen.add(key)
                self.live += size
                self.peak = max(self.peak, self.live)
                # Storages keep their Python object while alive: this runs when the memory is freed.
                weakref.finalize(storage, self._free, key, size)
        return out


def _status_kb(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def child(args: argparse.Namespace) -> None:
    """One arm in this fresh process: print its memory figures as JSON."""
    shape = Shape(**json.loads(args.shape))
    target = make_target(shape)
    inputs = make_inputs(shape, target, args.config, args.samples)
    side = build_arm(shape, args.arm, target, top_k=args.top_k, config_path=args.config)
    # The peak from here on (Linux: clear_refs 5 resets VmHWM to the current resident size).
    Path("/proc/self/clear_refs").write_text("5")
    base_kb = _status_kb("VmRSS")
    for step in range(args.memory_steps):
        side.drafter_step.train_micro_batch(inputs[step % len(inputs)])
    peak_kb = _status_kb("VmHWM")
    params = trainable_params(side)
    tensors = LiveTensors()
    with tensors:
        side.drafter_step.train_micro_batch(inputs[args.memory_steps % len(inputs)])
    print(json.dumps({"arm": args.arm, "rss_after_build_mb": base_kb / 1024,
                      "peak_extra_mb": (peak_kb - base_kb) / 1024, "trainable_params": params,
                      "step_tensor_peak_mb": tensors.peak / 2**20,
                      "weights_mb": 4 * params / 2**20, "grads_mb": 4 * params / 2**20,
                      "adamw_state_mb": 8 * params / 2**20}))


def measure_memory(shape: Shape, arm: str, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`child` in a subprocess."""
    cmd = [sys.executable, "-m", "benchmarks.dflash2_step", "--child-arm", arm, "--child-shape",
           json.dumps(asdict(shape)), "--config", args.config, "--top-k", str(args.top_k),
           "--samples", str(args.samples), "--memory-steps", str(args.memory_steps),
           "--threads", str(args.threads)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"memory run of {arm} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def time_arms(shape: Shape, arms: list[str], args: argparse.Namespace
              ) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Seconds of each timed step per arm, arms taking turns (order reversed every round); then
    each arm's operator profile (:func:`profile_step`)."""
    target = make_target(shape)
    inputs = make_inputs(shape, target, args.config, args.samples)
    sides = {arm: build_arm(shape, arm, target, top_k=args.top_k, config_path=args.config) for arm in arms}
    for arm in arms:
        for step in range(args.warmup):
            sides[arm].drafter_step.train_micro_batch(inputs[step % len(inputs)])
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for rnd in range(args.repeats):
        for arm in arms if rnd % 2 == 0 else arms[::-1]:
            item = inputs[rnd % len(inputs)]
            start = time.perf_counter()
            sides[arm].drafter_step.train_micro_batch(item)
            times[arm].append(time.perf_counter() - start)
    profiles = {arm: profile_step(side, inputs, args.profile_steps) for arm, side in sides.items()
                if args.profile_steps}
    return times, profiles


def profile_step(side: DrafterSide, inputs: list[StepInput], steps: int) -> dict[str, float]:
    """Milliseconds per step of each operator (its own time, not its callees'), after the timed steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(steps):
            side.drafter_step.train_micro_batch(inputs[step % len(inputs)])
    return {event.key: event.self_cpu_time_total / 1e3 / steps for event in prof.key_averages()}


def breakdown(profiles: dict[str, dict[str, float]], arm: str, top: int = 12) -> list[dict[str, Any]]:
    """The ``top`` operators that cost ``arm`` the most time over the DFlash arm, per step."""
    base, other = profiles["dflash"], profiles[arm]
    rows = [{"op": op, "dflash_ms": base.get(op, 0.0), "arm_ms": ms, "extra_ms": ms - base.get(op, 0.0)}
            for op, ms in other.items()]
    rows.sort(key=lambda row: -row["extra_ms"])
    total = {"op": "total", "dflash_ms": sum(base.values()), "arm_ms": sum(other.values())}
    return [{**total, "extra_ms": total["arm_ms"] - total["dflash_ms"]}, *rows[:top]]


def summarise(shape: Shape, times: dict[str, list[float]], memory: dict[str, dict[str, Any]],
              profiles: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per-arm medians, the ratios against the DFlash arm and where the extra time goes."""
    base_t, base_m = sum(times["dflash"]), memory["dflash"]
    arms = {}
    for arm, seconds in times.items():
        mem = memory[arm]
        arms[arm] = {
            "step_s_median": statistics.median(seconds), "step_s": seconds,
            "time_ratio": sum(seconds) / base_t,
            "peak_extra_mb": mem["peak_extra_mb"],
            "peak_extra_ratio": mem["peak_extra_mb"] / base_m["peak_extra_mb"],
            "state_mb": mem["weights_mb"] + mem["adamw_state_mb"],
            "state_ratio": mem["trainable_params"] / base_m["trainable_params"],
            "resident_peak_mb": mem["rss_after_build_mb"] + mem["peak_extra_mb"],
            "resident_peak_ratio": ((mem["rss_after_build_mb"] + mem["peak_extra_mb"])
                                    / (base_m["rss_after_build_mb"] + base_m["peak_extra_mb"])),
            # The peak beyond the optimizer's state and the gradients: activations and buffers.
            "work_mb": mem["peak_extra_mb"] - mem["grads_mb"] - mem["adamw_state_mb"],
            "step_tensor_peak_ratio": mem["step_tensor_peak_mb"] / base_m["step_tensor_peak_mb"],
            # Without the gradients, whose size is the parameters'.
            "activation_peak_mb": mem["step_tensor_peak_mb"] - mem["grads_mb"],
            **mem}
        arms[arm]["work_ratio"] = arms[arm]["work_mb"] / arms["dflash"]["work_mb"]
        arms[arm]["activation_peak_ratio"] = (arms[arm]["activation_peak_mb"]
                                              / arms["dflash"]["activation_peak_mb"])
        if arm != "dflash" and profiles:
            arms[arm]["extra_time_by_op"] = breakdown(profiles, arm)
    return {"shape": asdict(shape), "arms": arms}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every shape: time the arms side by side, then each arm's memory in its own process; the
    report so far is written to ``--out`` after each shape."""
    torch.set_num_threads(args.threads)
    probe = MachineProbe()
    before = LoadSample.read(probe)
    started = time.perf_counter()
    groups = []
    for hidden in args.hidden:
        for block in args.blocks:
            for all_slots in ([False, True] if args.all_slots and hidden == args.hidden[0] else [False]):
                shape = Shape(hidden=hidden, block=block, all_slots=all_slots, vocab=args.vocab)
                sweep = hidden == args.hidden[0] and block == args.blocks[0] and not all_slots
                arms = ["dflash"] + [f"dflash2-r{r}" for r in (args.ranks if sweep else [args.rank])]
                print(f"hidden {hidden}, block {block}, loss on {'every slot' if all_slots else 'slot 1'}: "
                      f"{', '.join(arms)}", flush=True)
                group_before = LoadSample.read(probe)
                times, profiles = time_arms(shape, arms, args)
                group_after = LoadSample.read(probe)
                memory = {arm: measure_memory(shape, arm, args) for arm in arms}
                group = {**summarise(shape, times, memory, profiles), "load_before": asdict(group_before),
                         "load_after": asdict(group_after),
                         "busy": _busy(group_before, group_after, args.threads)}
                groups.append(group)
                if args.out:
                    _write(args.out, _report(args, before, LoadSample.read(probe), started, groups))
                for arm, row in group["arms"].items():
                    print(f"  {arm:14s} {row['step_s_median'] * 1e3:7.0f} ms/step (x{row['time_ratio']:.2f})  "
                          f"peak extra {row['peak_extra_mb']:7.0f} MB (x{row['peak_extra_ratio']:.2f})  "
                          f"step tensors {row['step_tensor_peak_mb']:6.0f} MB (x{row['step_tensor_peak_ratio']:.2f}, "
                          f"without grads x{row['activation_peak_ratio']:.2f})  "
                          f"params {row['trainable_params'] / 1e6:6.1f} M", flush=True)
                    for op in row.get("extra_time_by_op", [])[:6]:
                        print(f"      {op['op']:32s} {op['dflash_ms']:8.1f} -> {op['arm_ms']:8.1f} ms", flush=True)
                if group["busy"]:
                    print("  busy: other work ran beside these arms", flush=True)
    return _report(args, before, LoadSample.read(probe), started, groups)


def _report(args: argparse.Namespace, before: LoadSample, after: LoadSample, started: float,
            groups: list[dict[str, Any]]) -> dict[str, Any]:
    return {"config": args.config, "vocab": args.vocab, "top_k": args.top_k, "threads": args.threads,
            "dtype": "float32", "repeats": args.repeats, "warmup": args.warmup,
            "memory_steps": args.memory_steps, "cpus": usable_cpus(), "load_before": asdict(before),
            "load_after": asdict(after), "busy": any(group["busy"] for group in groups),
            "seconds": time.perf_counter() - started, "groups": groups}


def _busy(before: LoadSample, after: LoadSample, threads: int) -> bool:
    """``dflash_trainer.evaluation.speedup``'s rule: other work wanted more than the cores left free."""
    loads = [before.others_running, after.others_running,
             None if after.load_1m is None else after.load_1m - threads]
    known = [load for load in loads if load is not None]
    return bool(known) and max(known) > usable_cpus() - threads + BUSY_MARGIN


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/demo-cpu.yaml")
    parser.add_argument("--hidden", type=_ints, default=[576, 1024])
    parser.add_argument("--blocks", type=_ints, default=[4, 8])
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--rank", type=int, default=256, help="selector rank of every shape")
    parser.add_argument("--ranks", type=_ints, default=[64, 128, 256],
                        help="rank sweep at the first hidden size and block")
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--all-slots", action="store_true",
                        help="also the loss on every slot (the recipe's), at the first hidden size")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=1,
                        help="steps per arm under the profiler, for the breakdown (0: none)")
    parser.add_argument("--samples", type=int, default=2, help="distinct inputs the steps cycle through")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the config's pipeline.num_threads, else 1)")
    parser.add_argument("--out", default=None, help="JSON results file")
    parser.add_argument("--child-arm", help=argparse.SUPPRESS)
    parser.add_argument("--child-shape", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads is None:
        args.threads = load_config(args.config, []).pipeline.num_threads or 1
    if args.child_arm:
        torch.set_num_threads(args.threads)
        args.arm, args.shape = args.child_arm, args.child_shape
        child(args)
        return 0
    report = run(args)
    if report["busy"]:
        print("busy: other work ran beside the benchmark; the time ratios are unreliable", flush=True)
    if args.out:
        _write(args.out, report)
    return 0


def _write(path: str, report: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
