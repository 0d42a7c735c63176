"""Anchors, labels and weights; chunked LM-head loss == naive loss; metrics; noise ramp."""

import threading

import pytest
import torch
from transformers import LlamaConfig

from dflash_trainer.config import ModelConfig, load_config
from dflash_trainer.model.blocks import build_block_inputs, labels_and_weights, sample_anchors, slot_weights
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.model.loss import chunked_head_loss, dflash_loss, reference_head_loss
from dflash_trainer.model.objective import DFlashObjective, noise_scale
from helpers_objective import run_objective


def test_sample_anchors_validity_count_order_and_padding():
    loss_mask = torch.zeros(3, 30, dtype=torch.bool)
    loss_mask[0, 5:] = True
    loss_mask[1, 10:14] = True
    loss_mask[2, 20:] = True  # real length 24 -> 20..22 (= 24 - 2) are valid
    seq_lens = torch.tensor([30, 30, 24])
    anchors, keep = sample_anchors(loss_mask, 8, 4, torch.Generator().manual_seed(0), seq_lens=seq_lens)
    assert anchors.shape == keep.shape == (3, 8)
    assert keep.sum(1).tolist() == [8, 3, 3]
    for b in range(3):
        chosen = anchors[b][keep[b]]
        assert torch.all(chosen[1:] > chosen[:-1])  # sorted, distinct
        assert torch.all(loss_mask[b, chosen] & loss_mask[b, chosen + 1]) and torch.all(chosen <= seq_lens[b] - 2)
        assert torch.all(anchors[b][~keep[b]] == 0)
    assert anchors[1][keep[1]].tolist() == [10, 11, 12]  # 13 is the span's last supervised token
    assert anchors[2][keep[2]].tolist() == [20, 21, 22]  # blocks may run past the sample's end
    # N follows the batch: at most the largest valid count.
    small, _ = sample_anchors(loss_mask[1:2], 512, 4, torch.Generator().manual_seed(0))
    assert small.shape == (1, 3)


def test_sample_anchors_is_reproducible_uniform_and_thread_safe():
    loss_mask = torch.ones(1, 200, dtype=torch.bool)
    first, _ = sample_anchors(loss_mask, 16, 16, torch.Generator().manual_seed(7))
    again, _ = sample_anchors(loss_mask, 16, 16, torch.Generator().manual_seed(7))
    other, _ = sample_anchors(loss_mask, 16, 16, torch.Generator().manual_seed(8))
    assert torch.equal(first, again) and not torch.equal(first, other)
    counts = torch.zeros(200)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        a, _ = sample_anchors(loss_mask, 16, 16, gen)
        counts[a[0]] += 1
    valid = counts[:199]
    assert counts[199:].sum() == 0 and valid.min() > 0.4 * valid.mean()
    results = {}

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        results[seed] = [sample_anchors(loss_mask, 16, 16, gen)[0] for _ in range(20)]

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        assert all(torch.equal(r, sample_anchors(loss_mask, 16, 16, gen)[0]) for r in results[seed])


def test_block_inputs():
    ids = torch.arange(100, 120)[None]
    noise, positions = build_block_inputs(ids, torch.tensor([[3, 10]]), torch.tensor([[True, False]]), 7, 4)
    assert noise.tolist() == [[103, 7, 7, 7, 7, 7, 7, 7]]
    assert positions.tolist() == [[3, 4, 5, 6, 10, 11, 12, 13]]


def test_slot_weights_match_the_reference_table():
    w = slot_weights(16, 7.0)
    expected = [1.000, 0.867, 0.751, 0.651, 0.565, 0.490, 0.424, 0.368, 0.319, 0.276, 0.240, 0.208,
                0.180, 0.156, 0.135]
    assert torch.allclose(w, torch.tensor(expected), atol=1e-3)
    assert torch.equal(slot_weights(16, None), torch.ones(15))
    assert torch.equal(slot_weights(16, 0.0), torch.ones(15))


def test_labels_are_same_position_and_exclusions_hold():
    ids = torch.arange(50, 70)[None]
    loss_mask = torch.ones(1, 20, dtype=torch.bool)
    loss_mask[0, 6] = False
    anchors, keep = torch.tensor([[4, 14, 0]]), torch.tensor([[True, True, False]])
    labels, weights = labels_and_weights(ids, loss_mask, anchors, keep, 4, None, torch.tensor([17]))
    assert labels.shape == weights.shape == (1, 3, 3)
    assert labels[0, 0].tolist() == [55, 56, 57]  # slot k predicts x_{a+k}: no shift
    assert weights[0, 0].tolist() == [1.0, 0.0, 1.0]  # loss_mask[6] is 0
    assert weights[0, 1].tolist() == [1.0, 1.0, 0.0]  # 14 + 3 = 17 is past the real length
    assert weights[0, 2].tolist() == [0.0, 0.0, 0.0]  # dropped block
    _, decayed = labels_and_weights(ids, loss_mask, anchors, keep, 4, 2.0, torch.tensor([17]))
    assert torch.allclose(decayed[0, 1, :2], torch.tensor([1.0, 0.60653]), atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("soft", [False, True])
def test_chunked_loss_and_grad_equal_naive(chunk, soft):
    torch.manual_seed(0)
    m, h, v = 90, 32, 300
    head = torch.randn(v, h)
    labels = torch.randint(0, v, (m,))
    weights = torch.rand(m) * (torch.rand(m) > 0.3)
    soft_hidden = torch.randn(m, h) if soft else None
    x1 = torch.randn(m, h, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    total, correct = chunked_head_loss(x1, head, labels, weights, chunk, soft_hidden)
    ref_total, ref_correct = reference_head_loss(x2, head, labels, weights, soft_hidden)
    (total * 0.7).backward()
    (ref_total * 0.7).backward()
    torch.testing.assert_close(total, ref_total, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-6, rtol=1e-4)
    assert torch.equal(correct, ref_correct)


def test_chunked_loss_with_a_bf16_head_matches_naive():
    torch.manual_seed(0)
    head = torch.randn(300, 32).to(torch.bfloat16)
    labels = torch.randint(0, 300, (50,))
    weights = torch.rand(50)
    x1 = torch.randn(50, 32, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    total, _ = chunked_head_loss(x1, head, labels, weights, 16)
    ref_total, _ = reference_head_loss(x2, head, labels, weights)
    total.backward()
    ref_total.backward()
    torch.testing.assert_close(total, ref_total, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(x1.grad, x2.grad, atol=2e-2, rtol=2e-2)  # bf16 grad matmul


def test_batch_without_valid_anchor_gives_zero_loss_not_nan():
    target = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256)
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[0]), target, mask_token_id=3)
    loss_mask = torch.zeros(2, 10, dtype=torch.bool)
    anchors, keep = sample_anchors(loss_mask, 8, 4, torch.Generator())
    assert anchors.shape == (2, 1) and not keep.any()
    embed = torch.randn(256, 64)
    objective = DFlashObjective(drafter, embed, embed, gamma=None, loss_chunk_size=8)
    batch = {"input_ids": torch.randint(0, 256, (2, 10)), "loss_mask": loss_mask, "seq_lens": torch.tensor([10, 10]),
             "anchors": anchors, "keep": keep}
    loss, metrics = run_objective(objective, batch, torch.randn(2, 10, 64), 0)
    loss.backward()
    assert loss.item() == 0.0 and metrics.blocks.item() == 0 and metrics.count.item() == 0
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters() if p.grad is not None)


def test_chunked_loss_never_saves_full_logits():
    m, h, v, chunk = 64, 16, 500, 8
    head = torch.randn(v, h)
    x = torch.randn(m, h, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        total, _ = chunked_head_loss(x, head, torch.randint(0, v, (m,)), torch.ones(m), chunk)
        naive, _ = reference_head_loss(x, head, torch.randint(0, v, (m,)), torch.ones(m))
    assert max(saved[:1]) <= m * h  # the chunked path saves only d(loss)/d(hidden)
    assert max(saved[1:]) >= m * v  # the naive path keeps [M, V] logits for backward
    with pytest.raises(ValueError, match="must be frozen"):
        chunked_head_loss(x, head.requires_grad_(True), torch.zeros(m, dtype=torch.long), torch.ones(m), 4)


def test_dflash_loss_metrics():
    # Identity head: the logits are the hidden states, so predictions are chosen by hand.
    vocab, num, block = 8, 2, 4
    head = torch.eye(vocab)
    labels = torch.tensor([[[1, 2, 3], [4, 5, 6]]])
    predicted = torch.tensor([[[1, 2, 0], [0, 5, 6]]])  # block 0: 2 leading hits; block 1: none
    hidden = torch.zeros(1, num, block, vocab)
    hidden[:, :, 1:] = torch.nn.functional.one_hot(predicted, vocab).float() * 5
    weights = torch.tensor([[[1.0, 0.5, 0.25], [1.0, 0.5, 0.0]]])
    keep = torch.tensor([[True, True]])
    metrics = dflash_loss(hidden.view(1, num * block, vocab), head, labels, weights, keep, chunk_size=2)
    ce = torch.nn.functional.cross_entropy(hidden[0, :, 1:].reshape(-1, vocab), labels.reshape(-1),
                                           reduction="none")
    # Sums, not means: the train loop divides by the weight of every rank.
    torch.testing.assert_close(metrics.loss, (ce * weights.reshape(-1)).sum())
    torch.testing.assert_close(metrics.mean_loss(), metrics.loss / weights.sum())
    assert metrics.correct.item() == 3 and metrics.count.item() == 5
    assert metrics.correct_per_slot.tolist() == [1, 2, 0]
    assert metrics.count_per_slot.tolist() == [2, 2, 1]
    assert metrics.accepted.item() == (1 + 2) + (1 + 0)
    assert metrics.blocks.item() == 2
    torch.testing.assert_close(metrics.weight, weights.sum())


def test_noise_ramp_is_applied_to_the_features():
    torch.manual_seed(0)
    cfg = load_config(None, ["training.noise_std=0.2", "training.noise_warmup_steps=100",
                             "model.block_size=4", "model.num_layers=1"])
    assert noise_scale(0, 0.2, 100) == 0.0 and noise_scale(50, 0.2, 100) == pytest.approx(0.1)
    assert noise_scale(500, 0.2, 100) == 0.2 and noise_scale(0, 0.2, 0) == 0.2
    target = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256)
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[0]), target, mask_token_id=3)
    embed = torch.randn(256, 64)
    objective = DFlashObjective.from_config(drafter, embed, embed, cfg)
    applied = []
    handle = drafter.fc.register_forward_pre_hook(lambda mod, args: applied.append(args[0].clone()))
    features = torch.randn(1, 600, 64)
    ids = torch.randint(0, 256, (1, 600))
    loss_mask = torch.ones(1, 600, dtype=torch.bool)
    batch = {"input_ids": ids, "loss_mask": loss_mask, "seq_lens": torch.tensor([600]),
             "anchors": torch.tensor([[10]]), "keep": torch.tensor([[True]])}
    with torch.no_grad():
        for step in (0, 50, 100, 1000):
            run_objective(objective, batch, features, step)
    handle.remove()
    stds = [(a - features).std().item() for a in applied]
    assert stds[0] == 0.0
    assert stds[1] == pytest.approx(0.1, rel=0.05)
    assert stds[2] == pytest.approx(0.2, rel=0.05) and stds[3] == pytest.approx(0.2, rel=0.05)


def test_objective_refuses_flex_training_on_cpu_and_missing_labels():
    target = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256)
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[0]), target, mask_token_id=3)
    embed = torch.randn(256, 64)
    batch = {"input_ids": torch.randint(0, 256, (1, 12)), "loss_mask": torch.ones(1, 12, dtype=torch.bool),
             "seq_lens": torch.tensor([12]), "anchors": torch.tensor([[2]]), "keep": torch.tensor([[True]])}
    flex = DFlashObjective(drafter, embed, embed, gamma=None, loss_chunk_size=8, attention="flex")
    with pytest.raises(ValueError, match="needs CUDA"):
        run_objective(flex, batch, torch.randn(1, 12, 64), 0)
    greedy = DFlashObjective(drafter, embed, embed, gamma=None, loss_chunk_size=8, labels="target_greedy")
    with pytest.raises(ValueError, match="target_labels"):
        run_objective(greedy, batch, torch.randn(1, 12, 64), 0)
    with pytest.raises(ValueError, match="frozen"):
        DFlashObjective(drafter, embed.requires_grad_(True), embed, gamma=None, loss_chunk_size=8)


def seeded_drafter_and_head(*, block_size):
    """A 1-layer drafter over a tiny Llama config, with random embedding and LM head (seed 0)."""
    torch.manual_seed(0)
    target = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256)
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=block_size, target_layer_ids=[0]), target,
                            mask_token_id=3)
    return drafter, torch.randn(256, 64), torch.randn(256, 64)


def test_kl_objective_distils_the_target_distribution_of_position_a_plus_k_minus_1():
    drafter, embed, head = seeded_drafter_and_head(block_size=4)
    seq = 16
    batch = {"input_ids": torch.randint(0, 256, (1, seq)), "loss_mask": torch.ones(1, seq, dtype=torch.bool),
             "seq_lens": torch.tensor([seq]), "anchors": torch.tensor([[2, 12]]),
             "keep": torch.tensor([[True, True]]), "final_hidden": torch.randn(1, seq, 64)}
    features = torch.randn(1, seq, 64)
    captured = []
    drafter.register_forward_hook(lambda mod, args, out: captured.append(out))
    objective = DFlashObjective(drafter, embed, head, gamma=2.0, loss_chunk_size=5, labels="kl")
    with torch.no_grad():
        loss, metrics = run_objective(objective, batch, features, 0)
    hidden = captured[0].view(6, 64)  # the objective asks the drafter for slots 1..3 only
    prev = torch.tensor([2, 3, 4, 12, 13, 14])  # a + k - 1 for k = 1..3
    weights = slot_weights(4, 2.0).repeat(2)
    total, correct = reference_head_loss(hidden, head, torch.zeros(6, dtype=torch.long), weights,
                                         batch["final_hidden"][0, prev])
    torch.testing.assert_close(loss, total / weights.sum())
    assert metrics.correct.item() == int(correct.sum()) and loss.item() > 0


def test_objective_under_bf16_autocast_with_a_bf16_target():
    torch.manual_seed(0)
    target = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256)
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[0]), target, mask_token_id=3)
    embed = torch.randn(256, 64).to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 30))
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    anchors, keep = sample_anchors(loss_mask, 8, 4, torch.Generator())
    batch = {"input_ids": ids, "loss_mask": loss_mask, "seq_lens": torch.tensor([30, 30]), "anchors": anchors,
             "keep": keep}
    objective = DFlashObjective(drafter, embed, embed, gamma=None, loss_chunk_size=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = run_objective(objective, batch, torch.randn(2, 30, 64, dtype=torch.bfloat16), 0)
    loss.backward()
    assert torch.isfinite(loss) and drafter.fc.weight.grad.dtype == torch.float32
    assert torch.isfinite(drafter.fc.weight.grad).all() and drafter.fc.weight.grad.norm() > 0


@pytest.mark.parametrize("labels", ["data", "kl"])
def test_loss_slots_supervises_only_the_first_slots(labels):
    drafter, embed, head = seeded_drafter_and_head(block_size=6)
    seq = 40
    ids = torch.randint(0, 256, (2, seq))
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    anchors, keep = sample_anchors(loss_mask, 5, 6, torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "loss_mask": loss_mask, "seq_lens": torch.tensor([seq, seq]), "anchors": anchors,
             "keep": keep, "final_hidden": torch.randn(2, seq, 64)}
    features = torch.randn(2, seq, 64)

    def run(loss_slots, gamma):
        drafter.zero_grad()
        objective = DFlashObjective(drafter, embed, head, gamma=gamma, loss_chunk_size=7, labels=labels,
                                    loss_slots=loss_slots)
        loss, metrics = run_objective(objective, batch, features, 0)
        loss.backward()
        return loss, metrics, [p.grad.clone() for p in drafter.parameters()]

    # gamma = 0.1 makes the weight of slots >= 3 negligible (exp(-20)), the same objective as
    # supervising slots 1..2 only, up to that weight.
    short_loss, short_metrics, short_grads = run(2, 0.1)
    full_loss, _, full_grads = run(None, 0.1)
    torch.testing.assert_close(short_loss, full_loss, rtol=1e-3, atol=1e-4)
    for a, b in zip(short_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    assert short_metrics.count_per_slot.shape == (2,)
    # Slots past the sequence end (anchors up to seq - 2 are drawn) are not counted.
    inside = sum(a + k < seq for a in anchors[keep].tolist() for k in (1, 2))
    assert short_metrics.count.item() == inside
    with pytest.raises(ValueError, match="loss_slots"):
        DFlashObjective(drafter, embed, head, gamma=None, loss_chunk_size=7, loss_slots=6)


def test_loss_slots_config_is_checked():
    with pytest.raises(Exception, match="training.loss_slots"):
        load_config(None, ["model.block_size=8", "training.loss_slots=8"])
    assert load_config(None, ["model.block_size=8", "training.loss_slots=3"]).training.loss_slots == 3
