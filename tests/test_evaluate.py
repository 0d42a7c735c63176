"""Speculative-decoding evaluation: loop accounting, acceptance, lossless check, outputs.

Tiny random Llama targets (hidden 64, vocab 128, tied embeddings) keep the loop tests fast; one
test runs the real SmolLM2 target through ``dflash-trainer eval``.
"""

from __future__ import annotations

import argparse
import io
import json

import pytest
import torch
from torch.nn import functional as F
from transformers import AutoConfig, AutoModel, LlamaConfig, LlamaForCausalLM

from dflash_trainer.config import ModelConfig, load_config
from dflash_trainer.data.tokenize import render_prompt
from dflash_trainer.core.errors import CheckpointError
from dflash_trainer.evaluation.evaluate import (EvalReport, InTrainingEval, print_summary, request_result, summarize,
                                                write_results)
from dflash_trainer.evaluation.prompt_sets import EvalError, EvalPrompt, mtbench_prompts, read_prompt_file
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.training.export import export_drafter
from dflash_trainer.model.modeling.dflash import DFlashDraftModel
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.target import FeatureExtractor
from dflash_trainer.evaluation.spec_decode import Decoded, first_mismatch, speculative_generate, target_generate
from helpers_objective import run_objective

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 8
PROMPT_LEN = 8
TRAIN_TOKENS = 64
MASK_ID = 127


def tiny_target(vocab: int = 128, init_range: float = 0.3, seed: int = 0) -> LlamaForCausalLM:
    """A random target whose greedy continuation does not collapse into one repeated token
    (the default init range 0.02 gives a constant continuation, which any drafter learns)."""
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=vocab, tie_word_embeddings=True,
                         max_position_embeddings=512, initializer_range=init_range)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def fresh_drafter(target: LlamaForCausalLM, block: int = BLOCK, mask_id: int = MASK_ID,
                  seed: int = 1) -> DFlashDraftModel:
    torch.manual_seed(seed)
    return build_drafter(ModelConfig(num_layers=1, block_size=block), target.config, mask_token_id=mask_id)


class OracleDrafter(DFlashDraftModel):
    """Test double for the loop's accounting only: it knows the target's greedy continuation in
    advance and drafts it exactly, through the interface ``spec_generate`` uses (forward ->
    hidden states, ``compute_logits`` -> logits). Its "hidden state" is the block position."""

    def __init__(self, config, sequence: list[int]) -> None:
        super().__init__(config)
        self.sequence = torch.tensor(sequence)

    def forward(self, position_ids, noise_embedding, target_hidden, attention_mask=None, past_key_values=None,
                use_cache=False):
        return position_ids[:, -noise_embedding.shape[1]:, None].to(noise_embedding.dtype)

    def compute_logits(self, hidden_states, lm_head):
        positions = hidden_states[..., 0].long().clamp_max(len(self.sequence) - 1)
        return F.one_hot(self.sequence[positions], lm_head.weight.shape[0]).float()


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_target()


@pytest.fixture(scope="module")
def prompt(target) -> torch.Tensor:
    return torch.randint(0, 120, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def greedy(target, prompt) -> list[int]:
    out = target_generate(target, prompt, max_new_tokens=TRAIN_TOKENS, stop_token_ids=[])
    assert len(set(out.tokens)) > 16, "the tiny target's continuation should not be trivial"
    return out.tokens


@pytest.fixture(scope="module")
def trained_drafter(target, prompt, greedy) -> DFlashDraftModel:
    """A drafter trained with the project's objective to overfit the target's greedy
    continuation of ``prompt`` (labels = the target's own tokens, every valid anchor)."""
    drafter = fresh_drafter(target)
    sequence = torch.cat([prompt, torch.tensor([greedy])], dim=1)
    length = sequence.shape[1]
    extractor = FeatureExtractor(target, drafter.target_layer_ids)
    features = extractor(sequence).features
    extractor.close()
    loss_mask = torch.zeros(1, length, dtype=torch.long)
    loss_mask[0, PROMPT_LEN:] = 1
    anchors = torch.arange(PROMPT_LEN, length - BLOCK + 1)[None]
    batch = {"input_ids": sequence, "loss_mask": loss_mask, "seq_lens": torch.tensor([length]),
             "anchors": anchors, "keep": torch.ones_like(anchors, dtype=torch.bool)}
    weight = target.get_input_embeddings().weight
    objective = DFlashObjective(drafter, weight, weight, gamma=4.0, loss_chunk_size=1024)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    drafter.train()
    for step in range(150):
        loss, metrics = run_objective(objective, batch, features, step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    tau_sim = float(metrics.accepted / metrics.blocks)
    assert tau_sim > BLOCK - 0.5, f"training did not overfit (tau_sim {tau_sim:.2f}, loss {float(loss):.3f})"
    return drafter


def spec(drafter, target, prompt, max_new_tokens, stops=()) -> Decoded:
    return speculative_generate(drafter, target, prompt, max_new_tokens=max_new_tokens, stop_token_ids=list(stops))


def test_oracle_drafter_commits_full_blocks(target, prompt, greedy):
    oracle = OracleDrafter(fresh_drafter(target).config, prompt[0].tolist() + greedy)
    steps = 4
    out = spec(oracle, target, prompt, 1 + steps * BLOCK)
    assert out.acceptance_lengths == [BLOCK] * steps
    assert out.tokens == greedy[:1 + steps * BLOCK]
    baseline = target_generate(target, prompt, max_new_tokens=1 + steps * BLOCK, stop_token_ids=[])
    result = request_result(EvalPrompt(id="p", turns=["x"]), 0, PROMPT_LEN, baseline, out, temperature=0.0)
    assert result.lossless and result.tau == BLOCK and result.steps == steps
    summary = summarize([result], block_size=BLOCK, temperature=0.0)
    assert summary["acceptance_hist"] == [0] * (BLOCK - 1) + [steps]
    assert summary["tau"] == BLOCK

    # A stop token inside a block ends generation there, for both decoders alike.
    stop = greedy[12]
    cut = greedy.index(stop) + 1
    stopped = spec(oracle, target, prompt, TRAIN_TOKENS, stops=[stop])
    reference = target_generate(target, prompt, max_new_tokens=TRAIN_TOKENS, stop_token_ids=[stop])
    assert stopped.tokens == reference.tokens == greedy[:cut]
    # max_new_tokens inside a block truncates the output (the step still counts its acceptance).
    short = spec(oracle, target, prompt, 1 + 2 * BLOCK - 3)
    assert short.tokens == greedy[:1 + 2 * BLOCK - 3]


@pytest.mark.slow
def test_trained_drafter_reaches_block_size_and_stays_lossless(target, prompt, greedy, trained_drafter):
    trained_drafter.train()
    out = spec(trained_drafter, target, prompt, 1 + 4 * BLOCK)
    assert trained_drafter.training, "the drafter's train mode must be restored"
    assert out.tokens == greedy[:1 + 4 * BLOCK]
    tau = sum(out.acceptance_lengths) / len(out.acceptance_lengths)
    assert tau >= BLOCK - 1, out.acceptance_lengths


@pytest.mark.slow
def test_random_drafter_tau_near_one_and_lossless(target, prompt, greedy):
    out = spec(fresh_drafter(target), target, prompt, 40)
    assert out.tokens == greedy[:40]
    tau = sum(out.acceptance_lengths) / len(out.acceptance_lengths)
    assert 1.0 <= tau < 1.3, out.acceptance_lengths


@pytest.mark.slow
def test_exported_drafter_via_automodel_matches_in_project_module(tmp_path, target, prompt, trained_drafter):
    folder = export_drafter(trained_drafter, tmp_path / "drafter", target_config=target.config, dtype=torch.float32)
    loaded, info = AutoModel.from_pretrained(str(folder), trust_remote_code=True, dtype=torch.float32,
                                             output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(loaded).__module__ != DFlashDraftModel.__module__, "must be the exported dflash.py"
    ours = spec(trained_drafter, target, prompt, 1 + 4 * BLOCK)
    theirs = spec(loaded, target, prompt, 1 + 4 * BLOCK)
    assert theirs.tokens == ours.tokens
    assert theirs.acceptance_lengths == ours.acceptance_lengths


@pytest.mark.slow
def test_in_training_eval(target, prompt, greedy, trained_drafter):
    other = torch.randint(0, 120, (1, 11), generator=torch.Generator().manual_seed(5))
    from dflash_trainer.core.assets import load_tokenizer, resolve_target

    tokenizer = load_tokenizer(resolve_target("smollm2"))  # ids < 128 decode to text too
    evaluator = InTrainingEval(target, [prompt[0].tolist(), other[0].tolist()], max_new_tokens=1 + 3 * BLOCK,
                               stop_token_ids=[], tokenizer=tokenizer, prompt_texts=["p0", "p1"])
    trained_drafter.train()
    before = {k: v.clone() for k, v in trained_drafter.state_dict().items()}
    metrics = evaluator(trained_drafter)
    # The per-prompt results of the call, with traced, spelled-out answers (for a results file).
    first = evaluator.last_requests[0].to_json()
    assert first["prompt_text"] == "p0" and first["trace"][1]["accepted"] == BLOCK - 1
    assert "".join(e["text"] + e["bonus"] for e in first["trace"]) == first["output"]
    assert trained_drafter.training
    assert all(torch.equal(before[k], v) for k, v in trained_drafter.state_dict().items())
    assert set(metrics) >= {"eval/tau", "eval/acceptance_hist", "eval/lossless", "eval/speedup"}
    assert metrics["eval/lossless"] == 1
    assert len(metrics["eval/acceptance_hist"]) == BLOCK and sum(metrics["eval/acceptance_hist"]) > 0
    # The trained prompt gives tau = B; the unseen one about 1: the mean lies in between.
    assert (BLOCK + 1) / 2 - 1.5 < metrics["eval/tau"] < BLOCK
    random_metrics = evaluator(fresh_drafter(target))
    assert random_metrics["eval/lossless"] == 1 and random_metrics["eval/tau"] < 1.3
    assert random_metrics["eval/speedup"] > 0 and random_metrics["eval/speedup_reliable"] in (0, 1)
    assert evaluator.last_speedup.pairs == 2 and evaluator.last_speedup.speedup == random_metrics["eval/speedup"]


@pytest.mark.slow
def test_sampling_is_lossless_in_distribution():
    """At temperature > 0 the committed tokens follow the target's own sampling distribution
    (rejection sampling): the marginals of generated tokens 2 and 3 match the exact ones."""
    vocab, temperature, runs = 8, 1.0, 500
    target = tiny_target(vocab=vocab, init_range=0.2, seed=12)
    drafter = fresh_drafter(target, block=4, mask_id=7, seed=12)
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        p1 = torch.softmax(target(prompt).logits[0, -1] / temperature, -1)
        seq2 = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab)[:, None]], 1)
        p2_given_1 = torch.softmax(target(seq2).logits[:, -1] / temperature, -1)
        seq3 = torch.cat([seq2.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(vocab)[:, None]], 1)
        p3_given_12 = torch.softmax(target(seq3).logits[:, -1] / temperature, -1).view(vocab, vocab, vocab)
    exact2 = p1 @ p2_given_1
    exact3 = torch.einsum("a,ab,abc->c", p1, p2_given_1, p3_given_12)
    draft_only = torch.full((vocab,), 1.0 / vocab)
    assert 0.5 * (exact2 - draft_only).abs().sum() > 0.25, "the target must be far from the drafter's guess"
    torch.manual_seed(0)
    counts2, counts3 = torch.zeros(vocab), torch.zeros(vocab)
    accepted = 0
    for _ in range(runs):
        out = speculative_generate(drafter, target, prompt, max_new_tokens=3, stop_token_ids=[],
                                   temperature=temperature)
        counts2[out.tokens[1]] += 1
        counts3[out.tokens[2]] += 1
        accepted += out.acceptance_lengths[0] > 1
    assert 0 < accepted < runs, "both the accept and the reject path must be exercised"
    # Sampling noise gives a total variation of about 0.03 here; drawing from the target's
    # distribution instead of the residual after a rejection gives about 0.2.
    assert 0.5 * (counts2 / runs - exact2).abs().sum() < 0.08
    assert 0.5 * (counts3 / runs - exact3).abs().sum() < 0.08


def test_mismatch_is_reported_with_position():
    prompt = EvalPrompt(id="q7", turns=["Tell me a story"], category="writing")
    baseline = Decoded(tokens=[5, 6, 7, 8], prefill_s=0.1, decode_s=0.3)
    spec_out = Decoded(tokens=[5, 6, 9, 8], prefill_s=0.1, decode_s=0.1, acceptance_lengths=[2, 1])
    result = request_result(prompt, 0, 10, baseline, spec_out, temperature=0.0)
    assert result.lossless is False and result.first_mismatch["position"] == 2
    assert result.first_mismatch["speculative"]["token"] == 9 and result.first_mismatch["target"]["token"] == 7
    assert result.speedup is None  # decodes not timed side by side give no speedup
    summary = summarize([result], block_size=4, temperature=0.0)
    assert summary["lossless"] is False and summary["lossless_failures"] == 1 and summary["speedup"] is None
    summary["max_new_tokens"] = 4
    text = io.StringIO()
    print_summary(EvalReport(summary=summary, requests=[result]), file=text)
    assert "WRONG ACCEPTANCE q7 turn 1" in text.getvalue() and "token 2" in text.getvalue()
    assert first_mismatch([1, 2], [1, 2, 3]) == 2 and first_mismatch([1], [1]) is None


def test_read_prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([
        json.dumps({"question_id": 3, "category": "math", "turns": ["a", "b"]}),
        json.dumps({"prompt": "single"}),
        json.dumps({"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
                                 {"role": "assistant", "content": "x"}, {"role": "user", "content": "u2"}]}),
        "",
        json.dumps({"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]}),
    ]) + "\n")
    prompts = read_prompt_file(path)
    assert [p.turns for p in prompts] == [["a", "b"], ["single"], ["u1", "u2"], ["hello"]]
    assert prompts[0].id == "3" and prompts[0].category == "math" and prompts[2].system == "sys"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"turns": []}) + "\n")
    with pytest.raises(EvalError, match=r"bad.jsonl:2"):
        read_prompt_file(bad)


@pytest.mark.slow
def test_eval_command_on_smollm2_mtbench(tmp_path):
    """``dflash-trainer eval`` on the real SmolLM2 target, a random drafter and 2 two-turn
    MT-Bench prompts: lossless, tau ~1, outputs written, turn 2 follows the model's answer."""
    from dflash_trainer.evaluation import evaluate
    from dflash_trainer.core.assets import load_tokenizer, resolve_target
    from dflash_trainer.model.target import resolve_mask_token_id
    from dflash_trainer.reporting.report import read_evals

    path = resolve_target("smollm2")
    config, tokenizer = AutoConfig.from_pretrained(path), load_tokenizer(path)
    mask_id = resolve_mask_token_id(tokenizer, config.vocab_size)
    torch.manual_seed(0)
    drafter = build_drafter(ModelConfig(num_layers=1), config, mask_token_id=mask_id)
    folder = export_drafter(drafter, tmp_path / "drafter", target_config=config)
    cfg = load_config(None, ["eval.num_prompts=2", "eval.max_new_tokens=5", f"run_dir={tmp_path / 'run'}",
                             "pipeline.device=cpu"])
    code = evaluate.main(cfg, argparse.Namespace(drafter=str(folder), out=None))
    assert code == 0
    out = tmp_path / "run" / "eval"
    results = json.loads((out / "results.json").read_text())
    assert (out / "acceptance_hist.png").stat().st_size > 0
    assert load_config(out / "config.yaml") == cfg  # the resolved config sits next to the output
    assert results["lossless"] is True and results["requests"] == 4 and results["prompts"] == 2
    assert 1.0 <= results["tau"] < 1.2
    assert len(results["acceptance_hist"]) == 16 and results["speedup"] > 0
    assert isinstance(results["speedup_reliable"], bool) and results["speedup_measurement"]["pairs"] == 4
    assert [r["target_first"] for r in results["per_prompt"]] == [True, False, True, False]
    assert results["stop_token_ids"] == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    first, second = results["per_prompt"][:2]
    assert (first["turn"], second["turn"]) == (0, 1) and first["id"] == second["id"]
    assert first["lossless"] and first["tokens"] == 5 and first["first_mismatch"] is None
    question = mtbench_prompts()[0]
    messages = [{"role": "user", "content": question.turns[0]}, {"role": "assistant", "content": first["output"]},
                {"role": "user", "content": question.turns[1]}]
    assert second["prompt_tokens"] == len(render_prompt(tokenizer, messages))
    evals, skipped = read_evals(out)
    assert not skipped and evals[0].tau == results["tau"]

    # A user error goes to cli.main, which prints it and exits 1 (tests/test_bad_input.py).
    with pytest.raises(CheckpointError, match="nope: no config.json there"):
        evaluate.main(cfg, argparse.Namespace(drafter=str(tmp_path / "nope"), out=None, overwrite=True))


def test_report_roundtrip_of_outputs(tmp_path):
    from dflash_trainer.evaluation.speedup import MachineProbe, PairedTimer

    quiet = MachineProbe(cpus=lambda: 2, load_average=lambda: 0.5, others_running=lambda: 0.0)
    with PairedTimer(probe=quiet).run() as run:
        baseline, spec_out, timing = run.pair(
            lambda clock: Decoded(tokens=[1, 2, 3], prefill_s=0, decode_s=1),
            lambda clock: Decoded(tokens=[1, 2, 3], prefill_s=0, decode_s=0.5, acceptance_lengths=[2]))
    result = request_result(EvalPrompt(id="a", turns=["t"]), 0, 3, baseline, spec_out, temperature=0.0, timing=timing)
    summary = summarize([result], block_size=4, temperature=0.0, speedup=run.measurement)
    summary["max_new_tokens"] = 3
    json_path, png_path = write_results(EvalReport(summary=summary, requests=[result]), tmp_path)
    data = json.loads(json_path.read_text())
    assert data["tau"] == 2.0 and data["acceptance_hist"] == [0, 1, 0, 0]
    assert data["per_prompt"][0]["lossless"] is True and data["speedup"] == pytest.approx(2.0)
    assert data["per_prompt"][0]["speedup"] == pytest.approx(2.0) and data["per_prompt"][0]["target_first"] is True
    assert data["speedup_reliable"] is True and data["speedup_unreliable_reasons"] == []
    assert data["speedup_measurement"]["torch_threads"] == 2 and data["speedup_measurement"]["load_1m_after"] == 0.5
    assert png_path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_acceptance_trace_and_streamed_spans(target, prompt, greedy):
    """An oracle that drafts the greedy continuation with every 5th position wrong: the trace
    names each step's drafts and accepted count, the streamed spans equal the final ones and
    cover the output, and the trace texts spell the answer."""
    from dflash_trainer.core.assets import load_tokenizer, resolve_target
    from dflash_trainer.evaluation.evaluate import acceptance_trace
    from dflash_trainer.evaluation.spec_decode import Span, acceptance_spans

    sequence = prompt[0].tolist() + greedy
    corrupted = [t if i < PROMPT_LEN or (i - PROMPT_LEN) % 5 != 3 else (t + 1) % 120
                 for i, t in enumerate(sequence)]
    oracle = OracleDrafter(fresh_drafter(target).config, corrupted)
    streamed: list[Span] = []
    out = speculative_generate(oracle, target, prompt, max_new_tokens=40, stop_token_ids=[], on_span=streamed.append)
    assert out.tokens == greedy[:40]
    assert 1 < len(set(out.acceptance_lengths)), out.acceptance_lengths  # partial acceptance happens
    spans = acceptance_spans(out.tokens, out.acceptance_lengths)
    assert streamed == spans
    assert [t for s in spans for t in s.tokens] == out.tokens
    assert len(out.steps) == len(out.acceptance_lengths)
    pos = 1
    for step, span in zip(out.steps, spans[1:]):
        assert len(step.drafted) == BLOCK - 1 and span.accepted == min(step.accepted, len(span.tokens))
        shown = span.accepted  # the last step may be cut by max_new_tokens
        assert step.drafted[:shown] == out.tokens[pos:pos + shown]
        if step.accepted < BLOCK - 1 and pos + step.accepted < len(out.tokens):
            assert step.drafted[step.accepted] != out.tokens[pos + step.accepted]  # the first rejected draft
        pos += len(span.tokens)

    tokenizer = load_tokenizer(resolve_target("smollm2"))
    trace = acceptance_trace(out, tokenizer)
    assert [e["step"] for e in trace] == list(range(len(spans)))
    assert trace[0]["accepted"] == 0 and trace[0]["drafted"] == []
    assert [e["accepted"] for e in trace[1:]] == [a - 1 for a in out.acceptance_lengths]
    assert "".join(e["text"] + e["bonus"] for e in trace) == tokenizer.decode(out.tokens, skip_special_tokens=True)
