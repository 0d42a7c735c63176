"""The anchor rule: every supervised token after a supervised one can be a slot-1 label, no
weight past a sample's end or on an unsupervised token, blocks past the padded end run on every
attention path, and the coverage statistics ``prepare`` prints agree with the sampler."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from dflash_trainer.config import ModelConfig
from dflash_trainer.data import coverage as coverage_module
from dflash_trainer.data.cache import TokenStore
from dflash_trainer.data.coverage import format_coverage, mask_coverage, store_coverage
from dflash_trainer.model.blocks import label_positions, labels_and_weights, sample_anchors, valid_anchors
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.model.objective import DFlashObjective
from helpers_objective import run_objective

V, H = 256, 64


@st.composite
def rows(draw, max_width=20):
    """A right-padded batch: real lengths, and a loss mask that may hold garbage past them."""
    batch = draw(st.integers(1, 3))
    width = draw(st.integers(1, max_width))
    lens = [draw(st.integers(1, width)) for _ in range(batch)]
    mask = [draw(st.lists(st.booleans(), min_size=width, max_size=width)) for _ in range(batch)]
    return torch.tensor(mask), torch.tensor(lens)


def expected_anchors(mask, length):
    return [a for a in range(length - 1) if mask[a] and mask[a + 1]]


@settings(max_examples=150, deadline=None)
@given(rows(), st.integers(2, 8), st.integers(0, 2**31 - 1))
def test_every_supervised_token_after_a_supervised_one_is_a_slot1_label(layout, block, seed):
    loss_mask, lens = layout
    width = loss_mask.shape[1]
    ids = torch.randint(0, V, loss_mask.shape)
    # As many anchors as positions: every valid anchor is drawn.
    anchors, keep = sample_anchors(loss_mask, width, block, torch.Generator().manual_seed(seed), seq_lens=lens)
    labels, weights = labels_and_weights(ids, loss_mask, anchors, keep, block, None, lens)
    for b in range(loss_mask.shape[0]):
        mask, length = loss_mask[b].tolist(), int(lens[b])
        drawn = anchors[b][keep[b]].tolist()
        assert drawn == expected_anchors(mask, length)
        slot1 = {a + 1 for a, w in zip(drawn, weights[b][keep[b]][:, 0].tolist()) if w > 0}
        assert slot1 == {p for p in range(1, length) if mask[p - 1] and mask[p]}
        for j, a in enumerate(drawn):
            assert labels[b, j, 0] == ids[b, a + 1]


@settings(max_examples=150, deadline=None)
@given(rows(), st.integers(2, 8), st.integers(1, 6), st.integers(0, 2**31 - 1), st.integers(1, 7))
def test_no_weight_past_the_sample_end_or_on_an_unsupervised_token(layout, block, num, seed, slots):
    loss_mask, lens = layout
    slots = min(slots, block - 1)
    ids = torch.randint(0, V, loss_mask.shape)
    anchors, keep = sample_anchors(loss_mask, num, block, torch.Generator().manual_seed(seed), seq_lens=lens)
    assert torch.equal(valid_anchors(loss_mask, lens).sum(1).clamp(max=anchors.shape[1]), keep.sum(1))
    labels, weights = labels_and_weights(ids, loss_mask, anchors, keep, block, 3.0, lens, num_slots=slots)
    assert weights.shape == labels.shape == (*anchors.shape, slots)
    for b in range(anchors.shape[0]):
        mask, length = loss_mask[b].tolist(), int(lens[b])
        kept = anchors[b][keep[b]].tolist()
        assert kept == sorted(set(kept)) and set(kept) <= set(expected_anchors(mask, length))
        for j in range(anchors.shape[1]):
            for k in range(1, slots + 1):
                p = int(anchors[b, j]) + k
                trained = bool(keep[b, j]) and p < length and mask[p]
                assert (weights[b, j, k - 1] > 0) == trained
                if trained:
                    assert labels[b, j, k - 1] == ids[b, p]
    gathered = label_positions(anchors, slots, loss_mask.shape[1], shift=-1)
    assert gathered.min() >= 0 and gathered.max() < loss_mask.shape[1]


@pytest.mark.parametrize("attention", ["sdpa", "blockwise"])
@pytest.mark.parametrize("labels", ["data", "kl"])
@pytest.mark.slow
def test_blocks_past_the_padded_end_train_without_errors(attention, labels):
    torch.manual_seed(0)
    block = 6
    target = LlamaConfig(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=V)
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=block, target_layer_ids=[0]), target,
                            mask_token_id=3)
    embed = torch.randn(V, H)
    width = 12
    ids = torch.randint(4, V, (2, width))
    loss_mask = torch.ones(2, width, dtype=torch.bool)
    loss_mask[1, 7:] = False  # row 1 is 7 tokens long, padded to 12
    lens = torch.tensor([width, 7])
    # Row 0's last block starts at width - 2 and reaches 3 positions past the padded width.
    anchors = torch.tensor([[0, 5, width - 2], [1, 5, 0]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    objective = DFlashObjective(drafter, embed, embed, gamma=None, loss_chunk_size=5, labels=labels,
                                attention=attention)
    tensors = {"input_ids": ids, "loss_mask": loss_mask, "seq_lens": lens, "anchors": anchors, "keep": keep,
               "final_hidden": torch.randn(2, width, H)}
    loss, sums = run_objective(objective, tensors, torch.randn(2, width, H))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in drafter.parameters())
    # Supervised slots: row 0 at 0 (5), 5 (5), 10 (1: position 11); row 1 at 1 (5), 5 (1: position 6).
    assert sums.count.item() == 5 + 5 + 1 + 5 + 1


def brute_coverage(masks, slots):
    """Slot-k labels counted from the sampler itself: draw every anchor and read the weights."""
    width = max(len(m) for m in masks)
    loss_mask = torch.zeros(len(masks), width, dtype=torch.bool)
    for i, m in enumerate(masks):
        loss_mask[i, :len(m)] = torch.tensor(m, dtype=torch.bool)
    lens = torch.tensor([len(m) for m in masks])
    block = max(slots) + 1
    anchors, keep = sample_anchors(loss_mask, width, block, torch.Generator(), seq_lens=lens)
    _, weights = labels_and_weights(torch.zeros_like(loss_mask, dtype=torch.long), loss_mask, anchors, keep,
                                    block, None, lens)
    return {k: int((weights[..., k - 1] > 0).sum()) for k in slots}, int((keep.sum(1) == 0).sum())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=1, max_size=24), min_size=1, max_size=6))
def test_mask_coverage_counts_what_the_sampler_can_train(masks):
    slots = (1, 3, 15)
    cov = mask_coverage(np.concatenate([np.array(m, dtype=np.uint8) for m in masks]),
                        np.array([len(m) for m in masks]), slots)
    labelled, without = brute_coverage(masks, slots)
    assert cov.labelled == labelled and cov.samples_without_anchor == without
    assert cov.supervised_tokens == sum(map(sum, masks)) and cov.samples == len(masks)


def test_store_coverage_reads_the_store_in_chunks(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    masks = [rng.random(n) < 0.8 for n in rng.integers(1, 40, size=50)]
    masks.append(np.array([1, 0, 1, 0], dtype=bool))  # two supervised tokens, no block can start

    def fill(writer):
        for m in masks:
            writer.add(np.arange(len(m), dtype=np.int32), m.astype(np.uint8))
        return {}

    store = TokenStore.build(tmp_path / "store", fill)
    whole = mask_coverage(np.concatenate(masks), np.array([len(m) for m in masks]), (1, 3))
    monkeypatch.setattr(coverage_module, "_CHUNK_TOKENS", 17)
    chunked = store_coverage(store, block_size=4)  # slot 15 does not exist with 4-token blocks
    assert chunked == whole and chunked.samples_without_anchor >= 1
    line = format_coverage(chunked)
    assert "slot 1 " in line and "slot 3 " in line and "slot 15" not in line
    assert f"{chunked.samples_without_anchor} of {len(masks)} samples" in line


def test_answer_endings_are_covered():
    # One answer of 40 supervised tokens ending the sample: the old rule (a <= len - B) left
    # the last 15 tokens without a slot-1 block; now only the answer's first token lacks one.
    mask = np.r_[np.zeros(10, dtype=bool), np.ones(40, dtype=bool)]
    cov = mask_coverage(mask, np.array([50]), (1, 3, 15))
    assert cov.labelled == {1: 39, 3: 37, 15: 25} and cov.share(1) == 39 / 40
