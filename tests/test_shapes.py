"""pipeline.round_shapes: the drafter's context width and anchor count padded up to a fixed set
of sizes; the loss does not change, and compiled FlexAttention compiles a bounded number of
variants over a real plan, then no more."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounter
from transformers import LlamaConfig

from dflash_trainer.config import ModelConfig, PipelineConfig
from dflash_trainer.data.buckets import build_plan
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.model.modeling import dflash as dflash_module
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.shapes import FLEX_BLOCK, pad_blocks, shape_sizes
from dflash_trainer.model.target import TargetOutputs
from dflash_trainer.training.pipeline.prefetch import PrefetchOptions, collate

BLOCK = 16
HIDDEN = 32
VOCAB = 128
MAX_LENGTH = 320
NUM_ANCHORS = 32


def test_sizes_are_whole_flex_blocks_and_cover_every_batch():
    sizes = shape_sizes(max_width=3072, num_anchors=512, block_size=16)
    assert sizes.widths == (128, 256, 512, 1024, 2048, 3072)
    assert sizes.anchors == (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    assert sizes.max_variants == 72
    for width in range(1, 3073):
        padded = sizes.width(width)
        assert padded >= width and padded % FLEX_BLOCK == 0 and padded <= 2 * max(width, 64)
    for count in range(1, 513):
        padded = sizes.anchor_count(count)
        assert padded >= count and padded * 16 % FLEX_BLOCK == 0 and padded <= max(1.5 * count, 16)
    # Block size 8: 16 anchors fill one 128-token query block.
    assert shape_sizes(max_width=100, num_anchors=20, block_size=8).anchors == (16, 32)
    assert "at most 72 (width, anchors) pairs" in sizes.describe()


class Tokens:
    """Samples of varied lengths, the first 10% of each unsupervised (a TokenDataset)."""

    def __init__(self, num: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(24, MAX_LENGTH + 1, size=num).astype(np.int64)
        self._rows = []
        for length in self.lengths:
            mask = np.ones(length, dtype=np.uint8)
            mask[: max(1, length // 10)] = 0
            self._rows.append((rng.integers(1, VOCAB - 1, size=length, dtype=np.int32), mask))

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self._rows[index]


def _objective(round_shapes: str, attention: str, layers: int = 2) -> DFlashObjective:
    torch.manual_seed(0)
    target_config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    drafter = build_drafter(ModelConfig(num_layers=layers, block_size=BLOCK,
                                        target_layer_ids=[1]),
                            target_config, mask_token_id=VOCAB - 1)
    with torch.no_grad():
        for p in drafter.parameters():  # a fresh init's tiny final norm makes the loss flat
            p.add_(torch.randn_like(p) * 0.1)
    embed = torch.randn(VOCAB, HIDDEN) * 0.1
    return DFlashObjective(drafter, embed, torch.randn(VOCAB, HIDDEN) * 0.1, gamma=7.0,
                           loss_chunk_size=256, attention=attention,  # type: ignore[arg-type]
                           shape_sizes=shape_sizes(max_width=MAX_LENGTH, num_anchors=NUM_ANCHORS,
                                                   block_size=BLOCK),
                           round_shapes=round_shapes)  # type: ignore[arg-type]


def _plan_batches(steps: int):
    data = Tokens(400, seed=1)
    cfg = PipelineConfig(num_buckets=6, tokens_per_batch=1024, max_run=2)
    plan = build_plan(data.lengths, cfg, seed=0, epoch=0)
    options = PrefetchOptions(rank=0, num_workers=1, num_anchors=NUM_ANCHORS, block_size=BLOCK,
                              seed=0, epochs=1)
    assert len(plan) >= steps
    return [collate(data, plan, i, options) for i in range(steps)]


def _features(batch, seed: int) -> TargetOutputs:
    gen = torch.Generator().manual_seed(seed)
    return TargetOutputs(features=torch.randn(*batch.shape, HIDDEN, generator=gen))


@pytest.mark.parametrize("attention", ["sdpa", "blockwise"])
def test_padding_leaves_the_loss_and_gradients_unchanged(attention):
    batch = _plan_batches(3)[2]
    target = _features(batch, seed=2)
    results = []
    for round_shapes in ("never", "always"):
        objective = _objective(round_shapes, attention)
        sums = objective(batch, target, step=0)
        sums.mean_loss().backward()
        grads = {n: p.grad.clone() for n, p in objective.drafter.named_parameters()
                 if p.grad is not None}
        results.append((sums, grads))
    (plain, plain_grads), (padded, padded_grads) = results
    sizes = _objective("always", attention).shape_sizes
    assert sizes is not None and sizes.width(batch.shape[1]) > batch.shape[1], "padding happened"
    for name in ("loss", "weight", "correct", "accepted"):
        torch.testing.assert_close(getattr(padded, name), getattr(plain, name), rtol=1e-5,
                                   atol=1e-6)
    assert plain_grads.keys() == padded_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(padded_grads[name], grad, rtol=1e-4, atol=1e-6)


def test_auto_rounds_on_the_flex_path_only():
    objective = _objective("auto", "auto")
    assert not objective.rounds_shapes(torch.device("cpu"))  # SDPA on CPU: computed as before
    assert objective.rounds_shapes(torch.device("cuda"))
    assert not _objective("never", "flex").rounds_shapes(torch.device("cuda"))
    assert _objective("always", "sdpa").rounds_shapes(torch.device("cpu"))


@pytest.mark.slow
def test_compiled_flex_attention_compiles_a_bounded_number_of_variants_over_a_plan(
        monkeypatch):
    """24 steps of a 6-bucket plan through the objective's FlexAttention path (forward; CPU
    has no FlexAttention backward), flex_attention compiled by dynamo with a backend that
    counts compiled graphs: with the shapes rounded the count stays within the known bound
    and under dynamo's recompile limit, and the last 12 steps compile nothing. (Unfused on
    CPU, a step costs about a second: the steps are few.)"""
    from torch.nn.attention.flex_attention import flex_attention

    counter = CompileCounter()
    monkeypatch.setattr(dflash_module, "flex_attention", torch.compile(flex_attention,
                                                                       backend=counter))
    torch._dynamo.reset()
    objective = _objective("always", "flex", layers=1)
    sizes = objective.shape_sizes
    batches = _plan_batches(24)
    shapes, counts = set(), []
    with torch.no_grad():
        for i, batch in enumerate(batches):
            padded = pad_blocks(sizes, batch.anchors, batch.keep, torch.zeros(*batch.shape, 1))
            shapes.add((padded.context.shape[1], padded.anchors.shape[1]))
            objective(batch, _features(batch, seed=i), step=0)
            counts.append(counter.frame_count)
    raw = {(b.shape[1], b.anchors.shape[1]) for b in batches}
    print(f"{len(raw)} raw (width, anchors) shapes -> {len(shapes)} rounded; compiles per step "
          f"{counts}")
    assert len(shapes) < len(raw)
    assert counts[-1] <= min(len(shapes), torch._dynamo.config.recompile_limit)
    assert counts[11] == counts[-1], "compiles level off"
    torch._dynamo.reset()
