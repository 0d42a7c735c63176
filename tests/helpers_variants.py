"""Per-step losses, metrics and exports of DFlash and DFlash2 drafters on the demo config
(``configs/demo-cpu.yaml``) shrunk to a tiny random target, for the check that moving the
variants behind one interface changed nothing (tests/test_variants.py).

The run goes through the common training path (drafter build and init, the objective from the
config, the drafter step with its fused AdamW, the export) on fixed synthetic batches, so a
change of the data pipeline does not move the numbers. Every float is kept as ``float.hex``.

The golden was recorded on one CPU and is checked on any: float32 kernels of another
instruction set sum in another order, so the check compares with the tolerances of
:data:`TOLERANCES` (see :func:`differences`), never bits. The exported weights are kept as a
fingerprint per tensor (shape, dtype, L2 norm, a projection on a fixed pattern), not a hash.

``python tests/helpers_variants.py`` rewrites ``tests/data/variant_golden.json``; only do that
for a change that is meant to change the numbers, and say so in the commit.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_trainer.config import load_config
from dflash_trainer.core.distributed import DistInfo
from dflash_trainer.model.batch import Batch, StepInput
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.target import FeatureExtractor
from dflash_trainer.training.drafter_init import initialise_drafter
from dflash_trainer.training.export import export_drafter
from dflash_trainer.training.optim import LRSchedule, build_optimizer
from dflash_trainer.training.pipeline.drafter_step import DrafterStep
from dflash_trainer.training.pipeline.metrics import combine

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "data" / "variant_golden.json"
DEMO = ROOT / "configs" / "demo-cpu.yaml"
VOCAB, HIDDEN, LAYERS, MASK = 96, 64, 6, 95
STEPS, ROWS, SEQ = 4, 2, 40

CASES: dict[str, list[str]] = {
    # The demo as it is (block 4, slot 1 only, target-greedy labels, drafter init from the target).
    "dflash-demo": [],
    "dflash2-demo": ["model.variant=dflash2", "model.selector_rank=8", "model.selector_top_k=4"],
    # Every slot, the other label modes and the selector's options, so each code path is covered.
    "dflash-data-all-slots": ["training.loss_slots=null", "training.labels=data", "model.drafter_init=random"],
    "dflash2-kl-all-slots": ["model.variant=dflash2", "model.selector_rank=8", "model.selector_top_k=6",
                             "model.conv_group_size=8", "training.loss_slots=null", "training.labels=kl",
                             "training.selector_weight=0.5", "training.selector_missing=insert"],
    "dflash2-frozen-selector": ["model.variant=dflash2", "model.selector_rank=4", "model.selector_top_k=3",
                                "training.loss_slots=null", "training.selector_weight=0"],
}
"""Case name -> overrides of the shrunk demo config."""

ANCHORS = 6
_SHRINK = ["model.target_layer_ids=[1,2]", "model.dtype=float32", f"training.num_anchors={ANCHORS}",
           "training.loss_chunk_size=16", "training.warmup_steps=2", "data.max_length=64"]


def _hex(value: float) -> str:
    return float(value).hex()


def tiny_target() -> LlamaForCausalLM:
    """A random 6-layer Llama (seeded): the drafter's init copies its layers 3 and 4."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=256, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def batches(target: torch.nn.Module, layer_ids: list[int], labels: str, num_anchors: int) -> list[StepInput]:
    extractor = FeatureExtractor(target, layer_ids, labels=labels, label_chunk_size=16)  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(1)
    items = []
    try:
        for _ in range(STEPS):
            input_ids = torch.randint(0, VOCAB - 1, (ROWS, SEQ), generator=generator)
            loss_mask = torch.ones(ROWS, SEQ, dtype=torch.bool)
            loss_mask[:, :5] = False
            anchors = torch.stack([torch.randperm(SEQ - 5, generator=generator)[:num_anchors].sort().values + 4
                                   for _ in range(ROWS)])
            keep = torch.ones(ROWS, num_anchors, dtype=torch.bool)
            keep[1, -1] = False
            batch = Batch.of_rows(input_ids, loss_mask, anchors=anchors, keep=keep)
            items.append(StepInput(batch=batch, target=extractor(batch.input_ids, batch.attention_mask)))
    finally:
        extractor.close()
    return items


def record(case: str) -> dict[str, Any]:
    """The numbers of one case: each step's logged training metrics, and the export's
    ``model.safetensors`` sha256 and ``config.json`` (its transformers version left out).
    Runs on one thread (the sums of several threads can round differently)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _record(case)
    finally:
        torch.set_num_threads(threads)


def _record(case: str) -> dict[str, Any]:
    cfg = load_config(DEMO, [*_SHRINK, *CASES[case]])
    target = tiny_target()
    torch.manual_seed(cfg.training.seed)
    drafter = build_drafter(cfg.model, target.config, mask_token_id=MASK)
    initialise_drafter(drafter, target, cfg.model)
    objective = DFlashObjective.from_config(drafter, target.model.embed_tokens.weight, target.lm_head.weight, cfg)
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.training)
    step = DrafterStep(objective=objective, parameters=params, optimizer=optimizer,
                       schedule=LRSchedule(optimizer, total_steps=STEPS, cfg=cfg.training), cfg=cfg.training,
                       dist_info=DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
                       block_size=drafter.block_size, autocast_dtype=None)
    steps = []
    torch.manual_seed(cfg.training.seed + 1)
    for item in batches(target, drafter.target_layer_ids, cfg.training.labels, cfg.training.num_anchors):
        step.train_micro_batch(item)
        metrics = combine([step.get_metrics()])
        steps.append({k: _hex(v) for k, v in sorted(metrics.items()) if k.startswith("train/")})
    with tempfile.TemporaryDirectory() as tmp:
        out = export_drafter(drafter, Path(tmp) / "export", target_config=target.config)
        weights = {name: fingerprint(t) for name, t in sorted(load_file(out / "model.safetensors").items())}
        config = json.loads((out / "config.json").read_text())
    config.pop("transformers_version")
    return {"steps": steps, "weights": weights, "config": config}


def fingerprint(tensor: torch.Tensor) -> dict[str, Any]:
    """Shape, dtype, L2 norm and the projection on a fixed pattern of one exported tensor: a
    change of any element moves the projection, and both compare with a tolerance. The pattern is
    made of integers (a multiplicative hash), so it is the same on every CPU."""
    values = tensor.double().numpy().ravel()
    pattern = (np.arange(values.size, dtype=np.uint64) * np.uint64(2654435761) % np.uint64(2**32)
               ).astype(np.float64) / 2**32 - 0.5
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype), "norm": _hex(np.linalg.norm(values)),
            "projection": _hex(float(values @ pattern))}


DISCRETE = ("train/acc", "train/tau_sim")
"""Metrics of argmax matches: one near tie that another CPU breaks the other way flips one match."""
EXACT = ("train/lr", "train/samples", "train/skipped_nonfinite", "train/step", "train/tokens")
"""Metrics computed from counts and the schedule alone: no float32 sums, equal on every CPU."""
TOLERANCES = {"metric_rel": 1e-4, "discrete_abs": 1 / (ROWS * ANCHORS), "weights_rel": 1e-3}
"""Why these tolerances (the golden is checked on CPUs other than the one that recorded it):

- ``metric_rel``: losses, grad norms and every other float32 metric, relative. The same run under
  AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``, MKL and oneDNN at AVX2) against AVX-512 ones differs
  by at most 1.4e-5 (a KL label loss) and 1.6e-7 elsewhere over these 4 steps: float32 sums in
  another order. 1e-4 leaves a 7x margin; a change of the code path moves them by far more.
- ``discrete_abs``: accuracies and tau_sim, absolute: one flipped argmax match among the step's
  ROWS x num_anchors (2 x 6) blocks.
- ``weights_rel``: each exported tensor's norm, and its projection relative to that norm. AdamW
  normalises each gradient element, so an element whose gradient is near 0 can move by up to
  lr per step on another CPU: measured 1.8e-4 of a tensor's norm at most; 1e-3 is a 5x margin.
"""


def _close(got: str, want: str, *, rel: float = 0.0, abs_: float = 0.0, scale: float | None = None) -> bool:
    a, b = float.fromhex(got), float.fromhex(want)
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= abs_ + rel * (abs(b) if scale is None else scale)


def differences(got: dict[str, Any], golden: dict[str, Any]) -> list[str]:
    """What differs between a run and the golden beyond :data:`TOLERANCES`, one line each."""
    found = []
    if len(got["steps"]) != len(golden["steps"]):
        return [f"{len(got['steps'])} steps, the golden has {len(golden['steps'])}"]
    for number, (step, want) in enumerate(zip(got["steps"], golden["steps"], strict=True), start=1):
        if step.keys() != want.keys():
            found.append(f"step {number}: metrics {sorted(step)} != {sorted(want)}")
            continue
        for key, value in step.items():
            if key in EXACT:
                ok = value == want[key]
            elif key.startswith(DISCRETE):
                ok = _close(value, want[key], abs_=TOLERANCES["discrete_abs"])
            else:
                ok = _close(value, want[key], rel=TOLERANCES["metric_rel"])
            if not ok:
                found.append(f"step {number}: {key} {float.fromhex(value)!r} != {float.fromhex(want[key])!r}")
    if got["weights"].keys() != golden["weights"].keys():
        found.append(f"exported tensors {sorted(got['weights'])} != {sorted(golden['weights'])}")
    for name in got["weights"].keys() & golden["weights"].keys():
        mine, want = got["weights"][name], golden["weights"][name]
        if (mine["shape"], mine["dtype"]) != (want["shape"], want["dtype"]):
            found.append(f"{name}: {mine['shape']} {mine['dtype']} != {want['shape']} {want['dtype']}")
            continue
        norm = float.fromhex(want["norm"])
        rel = TOLERANCES["weights_rel"]
        if not (_close(mine["norm"], want["norm"], rel=rel)
                and _close(mine["projection"], want["projection"], rel=rel, scale=norm)):
            found.append(f"{name}: norm {float.fromhex(mine['norm'])!r} / projection "
                         f"{float.fromhex(mine['projection'])!r} != {norm!r} / "
                         f"{float.fromhex(want['projection'])!r}")
    return found


def main() -> None:
    """Rewrite :data:`GOLDEN` from the code as it is."""
    golden = {case: record(case) for case in CASES}
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
