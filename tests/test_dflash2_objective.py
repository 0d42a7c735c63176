"""The DFlash2 selector's training terms (model/variants/dflash2.py) against direct computations."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig

from dflash_trainer.config import ModelConfig, TrainingConfig
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.model.variants import get_variant
from dflash_trainer.model.variants.dflash2 import gathered_logits, selector_terms

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


def _objective_inputs():
    from dflash_trainer.model.batch import Batch
    from dflash_trainer.model.target import TargetOutputs

    torch.manual_seed(4)
    seq = 16
    input_ids = torch.randint(5, V, (2, seq))
    loss_mask = torch.ones(2, seq, dtype=torch.bool)
    anchors = torch.tensor([[1, 4, 9], [0, 6, 11]])
    batch = Batch.of_rows(input_ids, loss_mask, anchors=anchors, keep=torch.ones(2, 3, dtype=torch.bool))
    return batch, TargetOutputs(features=torch.randn(2, seq, H))


@pytest.mark.parametrize("weight", [0.5, 0.0])
def test_objective_adds_the_weighted_selector_loss_and_reports_its_metrics(weight: float) -> None:
    from dflash_trainer.model.objective import DFlashObjective

    target = LlamaConfig(hidden_size=H, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=V)
    torch.manual_seed(5)
    model = build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[1], variant="dflash2",
                                      selector_rank=8, selector_top_k=TOP_K), target, mask_token_id=3)
    embed = torch.randn(V, H)
    terms = get_variant("dflash2").loss_terms(model, TrainingConfig(selector_weight=weight, selector_missing="insert"))
    objective = DFlashObjective(model, embed, embed, gamma=None, loss_chunk_size=5, loss_slots=2, terms=terms)
    batch, outputs = _objective_inputs()
    sums = objective(batch, outputs, step=0)
    assert list(sums.terms) == ["selector_loss"] and sums.term_weights == {"selector_loss": weight}
    torch.testing.assert_close(sums.objective(), sums.loss + weight * sums.terms["selector_loss"])
    counts = sums.counts
    assert 0 <= int(counts["in_top_k"]) <= int(sums.count) and counts["path_correct_per_slot"].shape == (2,)
    assert int(sums.blocks) <= int(counts["path_accepted"]) <= 3 * int(sums.blocks)
    assert [m.name for m in sums.metrics][-4:] == ["train/selector_loss", "train/candidate_recall",
                                                    "train/tau_sim_selector", "train/acc_sel_pos/{k}"]
    sums.objective().backward()
    grads = [p.grad for p in model.candidate_selector.parameters()]
    if weight:
        # From the identity start only the successor codebook moves (the pair terms are 0).
        assert all(g is not None for g in grads) and model.candidate_selector.successor_codebook.grad.abs().sum() > 0
    else:
        assert all(g is None for g in grads) and not any(p.requires_grad for p in model.candidate_selector.parameters())
    # A DFlash drafter's objective has no selector term.
    plain = build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[1]), target, mask_token_id=3)
    sums = DFlashObjective(plain, embed, embed, gamma=None, loss_chunk_size=5)(batch, outputs, step=0)
    assert not sums.terms and not sums.counts and sums.objective() is sums.loss


@pytest.mark.slow
def test_a_dflash2_run_logs_the_selector_reports_it_exports_dflash2_and_resumes(tmp_path) -> None:
    import json

    from helpers_e2e import make_chat_jsonl, make_tiny_target, tiny_run_overrides

    from dflash_trainer.cli.main import main as cli_main

    target = make_tiny_target(tmp_path / "target", layers=3)
    run = tmp_path / "run"
    args = [a for a in tiny_run_overrides(target=target, data=make_chat_jsonl(tmp_path / "chat.jsonl", num=16),
                                          cache=tmp_path / "cache", run_dir=run) if not a.startswith("training.epochs")]
    args += ["model.block_size=4", "model.variant=dflash2", "model.selector_rank=8", "training.selector_weight=0.5",
             "training.selector_missing=insert", "eval.num_prompts=1", "eval.max_new_tokens=8"]
    assert cli_main(["train", *args, "training.max_steps=2"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "train/candidate_recall" in r]
    assert len(logged) == 2
    for key in ("train/candidate_recall", "train/tau_sim_selector", "train/selector_loss", "train/acc_sel_pos/1",
                "train/acc_sel_pos/3"):
        assert all(0 <= r[key] < 1e3 for r in logged), key
    assert 1.0 <= logged[-1]["train/tau_sim_selector"] <= 4.0
    config = json.loads((run / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_rank"] == 8
    assert "final tau_sim_selector (DFlash2)" in (run / "report" / "index.html").read_text()
    assert cli_main(["train", *args, "training.max_steps=3", "checkpoint.resume=auto"]) == 0
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["train/step"] == 3


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor any aten op creates (forward and backward) while active;
    views of existing tensors are not created, so they do not count."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.numel() > self.numel:
                self.numel, self.op = tensor.numel(), (func, tuple(tensor.shape))
        return out


def test_the_selector_never_forms_a_vocabulary_wide_tensor_per_slot() -> None:
    """Nothing of the selector's loss, its gradient or its path metrics is as large as one
    ``[slots, vocab]`` tensor, let alone ``[slots, k, vocab]``: only candidates' rows are read."""
    vocab = 2048  # much larger than H, the rank and k, so a vocabulary-wide tensor stands out
    target = LlamaConfig(hidden_size=H, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=vocab)
    selector = build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[1], variant="dflash2",
                                         selector_rank=8, selector_top_k=TOP_K), target,
                             mask_token_id=3).candidate_selector
    torch.manual_seed(6)
    head = torch.randn(vocab, H)
    hidden = torch.randn(2, 3, 3, H, requires_grad=True)
    unary, candidates = (hidden.detach() @ head.T).topk(TOP_K, dim=-1)
    labels = candidates[..., 1].clone()
    weights, keep = torch.ones(2, 3, 3), torch.ones(2, 3, dtype=torch.bool)
    anchors = torch.randint(0, vocab, (2, 3))
    slots = hidden[..., 0].numel()
    largest = _LargestOutput()
    with largest:
        sums = selector_terms(selector, hidden, head, candidates, unary, labels, weights, anchors, keep,
                              missing="insert", chunk_size=4)
        sums.loss.backward()
    assert selector.successor_codebook.grad is not None and hidden.grad is not None
    # The codebooks' dense gradients [vocab, rank] are the largest tensors formed.
    assert largest.numel == vocab * 8 < slots * vocab, largest.op
    # The check can fail: scoring the pairs over the whole vocabulary is caught.
    naive = _LargestOutput()
    with naive, torch.no_grad():
        selector.pair_scores(hidden.reshape(slots, H), hidden.reshape(slots, H) @ head.T,
                             torch.arange(vocab).expand(slots, vocab), labels.reshape(-1))
    assert naive.numel >= slots * vocab


def test_a_dflash2_objective_step_holds_at_most_one_loss_chunk_of_logits() -> None:
    """The whole DFlash2 objective (backbone, chunked loss with top-k, selector), forward and
    backward: no tensor larger than one ``[loss_chunk_size, vocab]`` chunk or a codebook."""
    from dflash_trainer.model.objective import DFlashObjective

    vocab, chunk = 2048, 4
    target = LlamaConfig(hidden_size=H, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=vocab)
    torch.manual_seed(7)
    model = build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[1], variant="dflash2",
                                      selector_rank=8, selector_top_k=TOP_K), target, mask_token_id=3)
    embed = torch.randn(vocab, H)
    terms = get_variant("dflash2").loss_terms(model, TrainingConfig(selector_missing="insert"))
    objective = DFlashObjective(model, embed, embed, gamma=None, loss_chunk_size=chunk, terms=terms)
    batch, outputs = _objective_inputs()
    slots = 2 * 3 * 3
    largest = _LargestOutput()
    with largest:
        sums = objective(batch, outputs, step=0)
        sums.objective().backward()
    assert "selector_loss" in sums.terms and model.candidate_selector.successor_codebook.grad is not None
    assert largest.numel <= max(chunk * vocab, vocab * 8) < slots * vocab, largest.op
