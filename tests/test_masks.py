"""Attention masks: each visibility rule, no information leak, SDPA == eager == flex."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from dflash_trainer.config import ModelConfig
from dflash_trainer.model.blocks import (build_block_inputs, dense_block_mask, flex_block_mask, position_ids)
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.model.modeling.dflash import BlockLayout

H, V, BLOCK = 64, 256, 4


def rule(anchors, keep, context_len, block, b, q, kv):
    """The reference rule, spelled out with plain ints (independent of blocks.allow)."""
    j = q // block
    if not keep[b][j]:
        return False
    if kv < context_len:
        return kv < anchors[b][j]
    return (kv - context_len) // block == j


@st.composite
def layouts(draw):
    batch = draw(st.integers(1, 3))
    context_len = draw(st.integers(BLOCK, 24))
    num = draw(st.integers(1, 5))
    # Anchors up to context_len - 2 (the anchor rule): a block may reach past the padded end.
    anchors = [sorted(draw(st.lists(st.integers(0, context_len - 2), min_size=num, max_size=num)))
               for _ in range(batch)]
    keep = [draw(st.lists(st.booleans(), min_size=num, max_size=num)) for _ in range(batch)]
    return anchors, keep, context_len


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_dense_mask_matches_the_rule_everywhere(layout):
    anchors, keep, context_len = layout
    mask = dense_block_mask(torch.tensor(anchors), torch.tensor(keep), context_len, BLOCK)
    num = len(anchors[0])
    assert mask.shape == (len(anchors), 1, num * BLOCK, context_len + num * BLOCK)
    for b in range(len(anchors)):
        for q in range(num * BLOCK):
            row = [rule(anchors, keep, context_len, BLOCK, b, q, kv) for kv in range(context_len + num * BLOCK)]
            assert mask[b, 0, q].tolist() == row


def test_each_rule_on_a_small_case():
    context_len = 10
    anchors = torch.tensor([[3, 6, 0]])
    keep = torch.tensor([[True, True, False]])
    mask = dense_block_mask(anchors, keep, context_len, BLOCK)[0, 0]
    own0 = slice(context_len, context_len + BLOCK)
    own1 = slice(context_len + BLOCK, context_len + 2 * BLOCK)
    # Context strictly before the anchor: position 2 yes, the anchor position 3 no.
    assert mask[0, 2] and not mask[0, 3] and not mask[0, 9]
    assert mask[BLOCK, 5] and not mask[BLOCK, 6]
    # Own block in both directions (slot 0 sees slot 3 and slot 3 sees slot 0).
    assert mask[0, own0].all() and mask[3, own0].all()
    # No other block.
    assert not mask[0:BLOCK, own1].any() and not mask[BLOCK:2 * BLOCK, own0].any()
    # A dropped block sees nothing.
    assert not mask[2 * BLOCK:].any()


def make_drafter():
    torch.manual_seed(0)
    target = LlamaConfig(hidden_size=H, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=V)
    drafter = build_drafter(ModelConfig(num_layers=2, block_size=BLOCK, target_layer_ids=[0, 2]), target,
                            mask_token_id=5)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return drafter.eval()


def block_hidden(drafter, ids, features, anchors, keep, embed, mask_fn=dense_block_mask):
    seq = ids.shape[1]
    noise, block_pos = build_block_inputs(ids, anchors, keep, 5, BLOCK)
    with torch.no_grad():
        return drafter(position_ids(block_pos, seq), embed[noise], features,
                       attention_mask=mask_fn(anchors, keep, seq, BLOCK))


def blockwise_layout(anchors, keep, context_len, block):
    return BlockLayout(anchors, keep, context_len, block)


@pytest.mark.parametrize("mask_fn", [dense_block_mask, blockwise_layout], ids=["dense", "blockwise"])
def test_no_leak_from_features_or_tokens_the_block_must_not_see(mask_fn):
    drafter = make_drafter()
    seq = 24
    ids = torch.randint(0, V, (1, seq))
    features = torch.randn(1, seq, 2 * H)
    embed = torch.randn(V, H)
    # The last block starts at seq - 2 and runs past the sequence end.
    anchors, keep = torch.tensor([[4, 9, 15, seq - 2]]), torch.tensor([[True, True, True, True]])
    base = block_hidden(drafter, ids, features, anchors, keep, embed, mask_fn)
    for j, a in enumerate(anchors[0].tolist()):
        rows = slice(j * BLOCK, (j + 1) * BLOCK)
        later_features = features.clone()
        later_features[:, a:] += torch.randn_like(later_features[:, a:])  # includes the anchor itself
        later_tokens = ids.clone()
        later_tokens[:, a + 1:] = torch.randint(0, V, (1, seq - a - 1))  # other blocks' anchor tokens move
        for f, t in ((later_features, ids), (features, later_tokens)):
            torch.testing.assert_close(block_hidden(drafter, t, f, anchors, keep, embed, mask_fn)[:, rows],
                                       base[:, rows], atol=1e-6, rtol=1e-6)
        # Sanity (the test can fail): the feature just before the anchor does matter.
        earlier = features.clone()
        earlier[:, a - 1] += 1.0
        assert not torch.allclose(block_hidden(drafter, ids, earlier, anchors, keep, embed, mask_fn)[:, rows],
                                  base[:, rows], atol=1e-4)


def test_eager_with_additive_mask_equals_sdpa():
    drafter = make_drafter()
    ids = torch.randint(0, V, (2, 20))
    features = torch.randn(2, 20, 2 * H)
    embed = torch.randn(V, H)
    anchors, keep = torch.tensor([[2, 8, 16], [0, 5, 0]]), torch.tensor([[True, True, True], [True, True, False]])
    sdpa = block_hidden(drafter, ids, features, anchors, keep, embed)
    drafter.config._attn_implementation = "eager"
    eager = block_hidden(drafter, ids, features, anchors, keep, embed)
    assert torch.isfinite(eager).all()
    torch.testing.assert_close(eager, sdpa, atol=1e-5, rtol=1e-5)


def flex_case():
    """Drafter and inputs of the CPU flex tests: two rows of 40 tokens, a block past the end,
    dropped blocks."""
    drafter = make_drafter()
    ids = torch.randint(0, V, (2, 40))
    features = torch.randn(2, 40, 2 * H)
    embed = torch.randn(V, H)
    anchors = torch.tensor([[1, 3, 8, 20, 30, 38], [0, 7, 9, 11, 0, 0]])  # 38: past the end
    keep = torch.tensor([[True] * 6, [True, True, True, True, False, False]])
    return drafter, ids, features, embed, anchors, keep


@pytest.mark.slow
def test_flex_forward_equals_sdpa_forward_on_cpu():
    drafter, ids, features, embed, anchors, keep = flex_case()
    sdpa = block_hidden(drafter, ids, features, anchors, keep, embed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # uncompiled flex on CPU warns that it is slow
        flex = block_hidden(drafter, ids, features, anchors, keep, embed, mask_fn=flex_block_mask)
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)


def test_flex_mask_matches_dense_mask():
    anchors = torch.tensor([[1, 3, 8, 24], [0, 7, 9, 0]])
    keep = torch.tensor([[True, True, False, True], [True, True, True, False]])
    block_mask = flex_block_mask(anchors, keep, 26, BLOCK)
    dense = dense_block_mask(anchors, keep, 26, BLOCK)
    q = torch.arange(dense.shape[2])[:, None]
    kv = torch.arange(dense.shape[3])[None, :]
    for b in range(2):
        from_mod = block_mask.mask_mod(torch.tensor(b), torch.tensor(0), q, kv)
        assert torch.equal(from_mod, dense[b, 0])


def test_non_bool_dense_masks_are_refused():
    drafter = make_drafter()
    mask = dense_block_mask(torch.tensor([[2]]), torch.tensor([[True]]), 8, BLOCK).float()
    with pytest.raises(TypeError, match="must be bool"):
        drafter(torch.arange(8 + BLOCK)[None], torch.randn(1, BLOCK, H), torch.randn(1, 8, 2 * H),
                attention_mask=mask)


@settings(max_examples=25, deadline=None)
@given(layouts())
@pytest.mark.slow
def test_blockwise_attention_equals_the_dense_mask_forward_and_backward(layout):
    anchors, keep, context_len = (torch.tensor(layout[0]), torch.tensor(layout[1]), layout[2])
    drafter = make_drafter()
    batch = anchors.shape[0]
    ids = torch.randint(0, V, (batch, context_len))
    embed = torch.randn(V, H)
    features = torch.randn(batch, context_len, 2 * H)
    noise, block_pos = build_block_inputs(ids, anchors, keep, 5, BLOCK)
    outputs, grads = [], []
    for mask in (dense_block_mask(anchors, keep, context_len, BLOCK),
                 BlockLayout(anchors, keep, context_len, BLOCK)):
        drafter.zero_grad()
        out = drafter(position_ids(block_pos, context_len), embed[noise], features, attention_mask=mask)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outputs.append(out.detach())
        grads.append([p.grad.clone() for p in drafter.parameters()])
    assert torch.isfinite(outputs[1]).all()
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
    for blockwise, dense in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(blockwise, dense, atol=1e-5, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(layouts(), st.integers(1, BLOCK - 1), st.sampled_from(["dense", "blockwise"]))
@pytest.mark.slow
def test_output_slots_equal_the_same_rows_of_the_full_forward_and_backward(layout, slots, kind):
    """``output_slots=K`` (the last layer computes slots 1..K only) changes nothing for those
    rows: outputs and every parameter gradient equal the full forward's, two layers deep."""
    anchors, keep, context_len = (torch.tensor(layout[0]), torch.tensor(layout[1]), layout[2])
    drafter = make_drafter()
    batch, num = anchors.shape
    ids = torch.randint(0, V, (batch, context_len))
    embed = torch.randn(V, H)
    features = torch.randn(batch, context_len, 2 * H)
    noise, block_pos = build_block_inputs(ids, anchors, keep, 5, BLOCK)
    mask = (dense_block_mask(anchors, keep, context_len, BLOCK) if kind == "dense"
            else BlockLayout(anchors, keep, context_len, BLOCK))
    weight = torch.linspace(-1, 1, batch * num * slots * H).view(batch, num * slots, H)
    outputs, grads = [], []
    for output_slots in (None, slots):
        drafter.zero_grad()
        out = drafter(position_ids(block_pos, context_len), embed[noise], features, attention_mask=mask,
                      output_slots=output_slots)
        if output_slots is None:
            out = out.view(batch, num, BLOCK, H)[:, :, 1:slots + 1].reshape(batch, num * slots, H)
        (out * weight).sum().backward()
        outputs.append(out.detach())
        grads.append([p.grad.clone() for p in drafter.parameters()])
    assert outputs[1].shape == (batch, num * slots, H)
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
    for selected, full in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(selected, full, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_output_slots_on_a_flex_mask_equal_the_full_forward_on_cpu():
    drafter, ids, features, embed, anchors, keep = flex_case()
    noise, block_pos = build_block_inputs(ids, anchors, keep, 5, BLOCK)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # uncompiled flex on CPU warns that it is slow
        mask = flex_block_mask(anchors, keep, 40, BLOCK)
        full = drafter(position_ids(block_pos, 40), embed[noise], features, attention_mask=mask)
        selected = drafter(position_ids(block_pos, 40), embed[noise], features, attention_mask=mask,
                           output_slots=2)
        with pytest.raises(ValueError, match="output_slots must be in 1..3"):
            drafter(position_ids(block_pos, 40), embed[noise], features, attention_mask=mask,
                    output_slots=BLOCK)
    torch.testing.assert_close(selected, full.view(2, 6, BLOCK, H)[:, :, 1:3].reshape(2, 12, H),
                               atol=1e-5, rtol=1e-5)
