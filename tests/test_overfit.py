"""End to end on a tiny target: the drafter memorises a few sequences, then drafts them for real."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_trainer.config import ModelConfig
from dflash_trainer.model.blocks import sample_anchors
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.target import FeatureExtractor
from helpers_objective import run_objective

# Hundreds of optimizer steps each.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

VOCAB, BLOCK = 256, 8


def tiny_target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
                                          tie_word_embeddings=True)).eval().requires_grad_(False)
    with torch.no_grad():  # a trained-looking tied head (large rows), as in real targets
        target.model.embed_tokens.weight.normal_(0.0, 0.4)
    return target


def train(objective: DFlashObjective, batch: dict, features: torch.Tensor, steps: int, **extra) -> list[float]:
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(objective.drafter.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        anchors, keep = sample_anchors(batch["loss_mask"], 16, BLOCK, generator, seq_lens=batch["seq_lens"])
        loss, _ = run_objective(objective, {**batch, **extra, "anchors": anchors, "keep": keep}, features, step)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(objective.drafter.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_drafter_overfits_a_few_sequences():
    target = tiny_target()
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=BLOCK, target_layer_ids=[1, 2]),
                            target.config, mask_token_id=3)
    extractor = FeatureExtractor(target, drafter.target_layer_ids)
    objective = DFlashObjective(drafter, extractor.embed_weight, extractor.head_weight, gamma=4.0,
                                loss_chunk_size=256)
    seq = 40
    ids = torch.randint(4, VOCAB, (4, seq))
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[:, :4] = False  # a "prompt" that is never supervised
    batch = {"input_ids": ids, "loss_mask": loss_mask, "seq_lens": torch.tensor([seq, seq, seq - 6, seq])}
    features = extractor(ids).features
    losses = train(objective, batch, features, 200)
    assert abs(losses[0] - math.log(VOCAB)) < 0.5
    assert sum(losses[-10:]) / 10 < 0.05 * losses[0]
    # Every valid anchor at once: per-slot accuracy on the memorised sequences.
    anchors, keep = sample_anchors(loss_mask, seq, BLOCK, torch.Generator(), seq_lens=batch["seq_lens"])
    with torch.no_grad():
        _, metrics = run_objective(objective, {**batch, "anchors": anchors, "keep": keep}, features, 0)
    per_slot = metrics.correct_per_slot.float() / metrics.count_per_slot.float()
    assert per_slot.min() > 0.9, per_slot
    assert metrics.accepted.item() / metrics.blocks.item() > 0.8 * BLOCK


def test_trained_drafter_is_accepted_by_real_speculative_decoding():
    """Train on the target's own greedy continuations (on-policy labels), then decode them."""
    target = tiny_target()
    prompt_len, new = 8, 40
    prompts = torch.randint(4, VOCAB, (3, prompt_len))
    ids = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False)
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=BLOCK, target_layer_ids=[1, 2]),
                            target.config, mask_token_id=3)
    extractor = FeatureExtractor(target, drafter.target_layer_ids, labels="target_greedy")
    out = extractor(ids)
    assert torch.equal(out.target_labels[:, prompt_len + 1:], ids[:, prompt_len + 1:])
    objective = DFlashObjective(drafter, extractor.embed_weight, extractor.head_weight, gamma=4.0,
                                loss_chunk_size=256, labels="target_greedy")
    loss_mask = torch.arange(ids.shape[1])[None, :].expand_as(ids) >= prompt_len
    batch = {"input_ids": ids, "loss_mask": loss_mask, "seq_lens": torch.full((3,), ids.shape[1])}
    train(objective, batch, out.features, 200, target_labels=out.target_labels)
    for i in range(3):
        stats = drafter.spec_generate(target, prompts[i:i + 1], max_new_tokens=new, return_stats=True)
        assert torch.equal(stats.output_ids, ids[i:i + 1])  # lossless
        mean_accept = sum(stats.acceptance_lengths) / len(stats.acceptance_lengths)
        assert mean_accept > 0.6 * BLOCK, stats.acceptance_lengths
