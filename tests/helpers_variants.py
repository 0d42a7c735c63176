"""Per-step losses, metrics and exports of DFlash and DFlash2 drafters on the demo config
(``configs/demo-cpu.yaml``) shrunk to a tiny random target, for the bitwise check that moving
the variants behind one interface changed nothing (tests/test_variants.py).

The run goes through the common training path (drafter build and init, the objective from the
config, the drafter step with its fused AdamW, the export) on fixed synthetic batches, so a
change of the data pipeline does not move the numbers. Every float is kept as ``float.hex``.

``python tests/helpers_variants.py`` rewrites ``tests/data/variant_golden.json``; only do that
for a change that is meant to change the numbers, and say so in the commit.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
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

_SHRINK = ["model.target_layer_ids=[1,2]", "model.dtype=float32", "training.num_anchors=6",
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
        weights = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
        config = json.loads((out / "config.json").read_text())
    config.pop("transformers_version")
    return {"steps": steps, "safetensors_sha256": weights, "config": config}


def main() -> None:
    """Rewrite :data:`GOLDEN` from the code as it is."""
    golden = {case: record(case) for case in CASES}
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
