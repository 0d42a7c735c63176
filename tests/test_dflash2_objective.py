"""The DFlash2 selector's training terms (model/selector.py) against direct computations."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from dflash_trainer.config import ModelConfig
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.model.selector import gathered_logits, selector_terms

H, V, TOP_K = 32, 64, 4


def _selector(random_successor: bool = True):
    target = LlamaConfig(hidden_size=H, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=V)
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[1], variant="dflash2",
                                        selector_rank=8, selector_top_k=TOP_K), target, mask_token_id=3)
    selector = drafter.candidate_selector
    if random_successor:
        with torch.no_grad():
            selector.successor_codebook.normal_()
            selector.predecessor_codebook.normal_()
    return selector


def test_gathered_logits_and_their_gradient_equal_the_full_head() -> None:
    torch.manual_seed(0)
    head = torch.randn(V, H)
    hidden = torch.randn(10, H, requires_grad=True)
    ids = torch.randint(0, V, (10, TOP_K))
    out = gathered_logits(hidden, head, ids, chunk_size=3)
    expected = (hidden @ head.T).gather(1, ids)
    torch.testing.assert_close(out, expected)
    weights = torch.randn(10, TOP_K)
    (grad,) = torch.autograd.grad((out * weights).sum(), hidden)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), hidden)
    torch.testing.assert_close(grad, expected_grad)


def _case(seed: int = 1):
    torch.manual_seed(seed)
    batch, num, slots = 2, 3, 3
    head = torch.randn(V, H)
    hidden = torch.randn(batch, num, slots, H, requires_grad=True)
    logits = (hidden.detach() @ head.T)
    unary, candidates = logits.topk(TOP_K, dim=-1)
    labels = torch.randint(0, V, (batch, num, slots))
    labels[0, 0] = candidates[0, 0, :, 1]  # some labels among the candidates
    labels[1, 2, :2] = candidates[1, 2, :2, 0]
    weights = torch.rand(batch, num, slots) + 0.1
    weights[1, 1, 2] = 0.0
    anchors = torch.randint(0, V, (batch, num))
    keep = torch.tensor([[True, True, True], [True, True, False]])
    weights = weights * keep[..., None]
    return head, hidden, unary, candidates, labels, weights, anchors, keep


@pytest.mark.parametrize("missing", ["exclude", "insert"])
def test_selector_loss_is_the_weighted_cross_entropy_over_the_candidates(missing: str) -> None:
    selector = _selector()
    head, hidden, unary, candidates, labels, weights, anchors, keep = _case()
    sums = selector_terms(selector, hidden, head, candidates, unary, labels, weights, anchors, keep,
                          missing=missing, chunk_size=5)
    a, b, p = selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight
    expected = torch.zeros(())
    recall = 0
    for i, j, t in torch.cartesian_prod(torch.arange(2), torch.arange(3), torch.arange(3)).tolist():
        label = int(labels[i, j, t])
        cands = candidates[i, j, t].tolist()
        if weights[i, j, t] > 0 and label in cands:
            recall += 1
        if label not in cands:
            if missing == "exclude":
                continue
            cands[-1] = label
        previous = int(anchors[i, j]) if t == 0 else int(labels[i, j, t - 1])
        h = hidden[i, j, t]
        scores = torch.stack([h @ head[c] + (a[previous] * (p @ h) * b[c]).sum() for c in cands])
        expected = expected + weights[i, j, t] * -torch.log_softmax(scores, dim=0)[cands.index(label)]
    torch.testing.assert_close(sums.loss, expected, rtol=1e-4, atol=1e-4)
    assert int(sums.in_top_k) == recall > 0
    grads = torch.autograd.grad(sums.loss, [hidden, b, p])
    expected_grads = torch.autograd.grad(expected, [hidden, b, p])
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_path_metrics_follow_the_greedy_walk_from_the_anchor() -> None:
    selector = _selector()
    head, hidden, unary, candidates, labels, weights, anchors, keep = _case(seed=2)
    a, b, p = (t.detach() for t in (selector.predecessor_codebook, selector.successor_codebook,
                                    selector.hidden_projection.weight))
    paths = {}
    for i in range(2):
        for j in range(3):
            previous, path = int(anchors[i, j]), []
            for t in range(3):
                h = hidden[i, j, t].detach()
                scores = [float(unary[i, j, t, n] + (a[previous] * (p @ h) * b[c]).sum())
                          for n, c in enumerate(candidates[i, j, t].tolist())]
                previous = int(candidates[i, j, t, max(range(TOP_K), key=scores.__getitem__)])
                path.append(previous)
            paths[i, j] = path
    labels[0, 1] = torch.tensor(paths[0, 1])  # a block the path gets wholly right
    labels[1, 0, 0] = paths[1, 0][0]  # and one with its first slot right
    sums = selector_terms(selector, hidden, head, candidates, unary, labels, weights, anchors, keep)
    hits = torch.tensor([[[paths[i, j][t] == int(labels[i, j, t]) and weights[i, j, t] > 0 for t in range(3)]
                          for j in range(3)] for i in range(2)])
    assert sums.path_correct_per_slot.tolist() == hits.sum(dim=(0, 1)).tolist()
    leading = hits.long().cumprod(-1).sum(-1)
    assert int(sums.path_accepted) == int(((leading + 1) * keep).sum()) >= 5 + 4


def test_identity_selector_walks_the_argmax_and_learns_from_the_first_step() -> None:
    selector = _selector(random_successor=False)
    head, hidden, unary, candidates, labels, weights, anchors, keep = _case(seed=3)
    labels[...] = candidates[..., 0]  # every label is the argmax
    sums = selector_terms(selector, hidden, head, candidates, unary, labels, weights, anchors, keep)
    assert sums.path_correct_per_slot.tolist() == (weights > 0).sum(dim=(0, 1)).tolist()
    sums.loss.backward()
    assert selector.successor_codebook.grad.abs().sum() > 0
