"""DSpark drafters (model/variants/dspark.py, model/modeling/dspark.py): options, the Markov head's
left-to-right walk, identity initialisation, the Markov-corrected loss and the confidence head,
warm start from DFlash, the export in the names vLLM and llama.cpp read (tests/data/dspark_format.json),
lossless decoding, and a run through the trainer."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers_e2e import load_with_transformers_alone, make_tiny_target
from safetensors import safe_open
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import ModelConfig, TrainingConfig, load_config
from dflash_trainer.core.errors import CheckpointError, ConfigError
from dflash_trainer.evaluation.spec_decode import speculative_generate
from dflash_trainer.model.batch import Batch
from dflash_trainer.model.drafter import build_drafter, drafter_variant
from dflash_trainer.model.modeling.dflash import DFlashDraftModel
from dflash_trainer.model.modeling.dspark import DSparkDraftModel, MarkovHead
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.target import TargetOutputs
from dflash_trainer.model.variants import get_variant
from dflash_trainer.model.variants.dspark import markov_corrected_loss
from dflash_trainer.training import export
from dflash_trainer.training.drafter_init import initialise_drafter

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
FORMAT = json.loads((Path(__file__).parent / "data" / "dspark_format.json").read_text())
H, V, BLOCK = 64, 256, 4


def target_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=H, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=V, rope_theta=100000.0, tie_word_embeddings=True)


def model_cfg(variant: str = "dspark", **extra) -> ModelConfig:
    dspark = {"markov_rank": 8} if variant == "dspark" else {}
    return ModelConfig(num_layers=2, block_size=BLOCK, target_layer_ids=[1, 3], variant=variant, **{**dspark, **extra})


def randomised(drafter: DFlashDraftModel, scale: float = 0.2) -> DFlashDraftModel:
    """Every weight moved off its initialisation (a zero ``markov_w2`` would hide mistakes)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for param in drafter.parameters():
            param.add_(torch.randn_like(param) * scale)
    return drafter.eval()


# --- options -----------------------------------------------------------------------------------

def test_dspark_options_need_the_dspark_variant_and_have_defaults() -> None:
    with pytest.raises(ConfigError, match=r"^model.markov_rank is a DSpark option, but model.variant is dflash; "
                                          r"set model.variant=dspark or remove it$"):
        load_config(None, ["model.markov_rank=8"])
    with pytest.raises(ConfigError, match=r"model.enable_confidence_head, training.markov_weight are DSpark "
                                          r"options, but model.variant is dflash2"):
        load_config(None, ["model.variant=dflash2", "model.enable_confidence_head=false",
                           "training.markov_weight=0.5"])
    with pytest.raises(ConfigError, match=r"model.markov_rank must be in \[1, 8192\]"):
        load_config(None, ["model.variant=dspark", "model.markov_rank=0"])
    with pytest.raises(ConfigError, match=r"training.markov_weight must be in \[0, 1000\]"):
        load_config(None, ["model.variant=dspark", "training.markov_weight=-1"])
    cfg = load_config(None, ["model.variant=dspark"])
    assert (cfg.model.markov_rank, cfg.model.enable_confidence_head, cfg.training.markov_weight) == (None, None, None)
    drafter = build_drafter(cfg.model, target_config(), mask_token_id=9)
    assert isinstance(drafter, DSparkDraftModel) and drafter_variant(drafter.config) == "dspark"
    section = drafter.config.dflash_config
    assert (section["markov_rank"], section["enable_confidence_head"], section["confidence_head_with_markov"]) == (
        256, True, True)
    assert drafter.confidence_head is not None and drafter.confidence_head.proj.weight.shape == (1, H + 256)
    plain = build_drafter(model_cfg(enable_confidence_head=False), target_config(), mask_token_id=9)
    assert plain.confidence_head is None and plain.markov_head.markov_w1.weight.shape == (V, 8)


# --- the Markov head ---------------------------------------------------------------------------

@pytest.mark.parametrize("kl", [False, True])
def test_the_corrected_loss_and_its_gradients_equal_a_direct_computation(kl: bool) -> None:
    torch.manual_seed(0)
    rows, hidden, vocab, rank = 11, 16, 40, 4
    h = torch.randn(rows, hidden, dtype=torch.float64, requires_grad=True)
    embed = torch.randn(rows, rank, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(vocab, rank, dtype=torch.float64, requires_grad=True)
    head = torch.randn(vocab, hidden, dtype=torch.float64)
    labels, weights = torch.randint(0, vocab, (rows,)), torch.rand(rows, dtype=torch.float64)
    weights[3] = 0
    soft = torch.randn(rows, hidden, dtype=torch.float64) if kl else None
    total, correct = markov_corrected_loss(h, head, embed, w2, labels, weights, chunk_size=4, soft_hidden=soft)
    logits = h @ head.T + embed @ w2.T
    if kl:
        target = torch.log_softmax(soft @ head.T, dim=-1)
        expected = (weights * (target.exp() * (target - torch.log_softmax(logits, -1))).sum(-1)).sum()
        assert torch.equal(correct, logits.argmax(-1) == target.argmax(-1))
    else:
        expected = (weights * F.cross_entropy(logits, labels, reduction="none")).sum()
        assert torch.equal(correct, logits.argmax(-1) == labels)
    torch.testing.assert_close(total.double(), expected, rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad(2.5 * total, (h, embed, w2))
    want = torch.autograd.grad(2.5 * expected, (h, embed, w2))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_the_walk_adds_the_bias_after_the_token_chosen_before_each_slot() -> None:
    torch.manual_seed(3)
    head = MarkovHead(V, 8)
    head.markov_w1.weight.normal_()
    head.markov_w2.weight.normal_()
    base, anchors = torch.randn(2, 3, V), torch.tensor([7, 11])
    path, q = head.walk(base, anchors, temperature=0.0)
    assert q is None
    bias = head.markov_w2.weight @ head.markov_w1.weight.T  # [next, previous]
    for i in range(2):
        previous = int(anchors[i])
        for t in range(3):
            previous = int((base[i, t] + bias[:, previous]).argmax())
            assert int(path[i, t]) == previous
    sampled, q = head.walk(base, anchors, temperature=0.7)
    assert q is not None and q.shape == (2, 3, V)
    previous = anchors
    for t in range(3):
        torch.testing.assert_close(q[:, t], torch.softmax((base[:, t] + bias[:, previous].T) / 0.7, dim=-1))
        assert bool((q[:, t].gather(-1, sampled[:, t:t + 1]) > 0).all())
        previous = sampled[:, t]


# --- identity initialisation, warm start and decoding ------------------------------------------

@pytest.fixture(scope="module")
def tiny_target() -> torch.nn.Module:
    """A random 4-layer Llama of 256 tokens: decoding needs no tokenizer."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=H, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=V, max_position_embeddings=256, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def _pair(target: torch.nn.Module) -> tuple[DFlashDraftModel, DSparkDraftModel]:
    """A DFlash drafter with moved weights and a fresh DSpark drafter holding the same backbone."""
    cfg = ModelConfig(num_layers=2, block_size=BLOCK, target_layer_ids=[1, 2])
    dflash = randomised(build_drafter(cfg, target.config, mask_token_id=16), scale=0.5)
    dspark = build_drafter(dataclasses.replace(cfg, variant="dspark", markov_rank=8), target.config,
                           mask_token_id=16).eval()
    result = dspark.load_state_dict(dflash.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert all(k.startswith(("markov_head.", "confidence_head.")) for k in result.missing_keys)
    return dflash, dspark


def test_an_untrained_dspark_drafter_drafts_what_its_dflash_backbone_drafts(tiny_target) -> None:
    dflash, dspark = _pair(tiny_target)
    assert dspark.markov_head.markov_w2.weight.abs().sum() == 0
    assert 0.9 < float(dspark.markov_head.markov_w1.weight.detach().std()) < 1.1
    for prompt in ([1, 2, 3, 4, 5], [100, 200, 250, 7]):
        ids = torch.tensor([prompt])
        one = speculative_generate(dflash, tiny_target, ids, max_new_tokens=10, stop_token_ids=[])
        two = speculative_generate(dspark, tiny_target, ids, max_new_tokens=10, stop_token_ids=[])
        assert [s.drafted for s in two.steps] == [s.drafted for s in one.steps]
        assert two.tokens == one.tokens and two.acceptance_lengths == one.acceptance_lengths
    # Sampling: the distributions the drafts are drawn from are the backbone's.
    hidden, head = torch.randn(1, BLOCK - 1, tiny_target.config.hidden_size), tiny_target.get_output_embeddings()
    with torch.no_grad():
        _, backbone = dflash.propose(hidden, torch.tensor([5]), head, 0.8)
        drafts, q = dspark.propose(hidden, torch.tensor([5]), head, 0.8)
    assert q is not None and backbone is not None and drafts.shape == (BLOCK - 1,)
    torch.testing.assert_close(q, backbone)


def test_a_dflash_export_warm_starts_a_dspark_drafter_that_drafts_the_same(tiny_target, tmp_path) -> None:
    dflash, _ = _pair(tiny_target)
    folder = export.export_drafter(dflash, tmp_path / "d1", target_config=tiny_target.config, dtype=torch.float32)
    cfg = ModelConfig(num_layers=2, block_size=BLOCK, target_layer_ids=[1, 2], variant="dspark", markov_rank=8,
                      init_from=str(folder))
    torch.manual_seed(5)
    dspark = build_drafter(cfg, tiny_target.config, mask_token_id=16)
    copied = initialise_drafter(dspark, tiny_target, cfg)
    assert sorted(copied) == sorted(dflash.state_dict())
    assert dspark.markov_head.markov_w2.weight.abs().sum() == 0
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    one = speculative_generate(dflash, tiny_target, ids, max_new_tokens=12, stop_token_ids=[])
    two = speculative_generate(dspark.eval(), tiny_target, ids, max_new_tokens=12, stop_token_ids=[])
    assert [s.drafted for s in two.steps] == [s.drafted for s in one.steps]
    # A DSpark drafter warm-starts a DSpark one, not a DFlash one.
    spark_folder = export.export_drafter(randomised(dspark), tmp_path / "ds", target_config=tiny_target.config)
    again = build_drafter(dataclasses.replace(cfg, init_from=str(spark_folder)), tiny_target.config, mask_token_id=16)
    assert len(initialise_drafter(again, tiny_target, dataclasses.replace(cfg, init_from=str(spark_folder)))) == len(
        dspark.state_dict())
    back = ModelConfig(num_layers=2, block_size=BLOCK, target_layer_ids=[1, 2], init_from=str(spark_folder))
    with pytest.raises(CheckpointError, match=r"ds holds a DSpark drafter \(architectures DSparkDraftModel\), but a "
                                              r"DFlash one \(DFlashDraftModel\) is expected here; warm-start it with "
                                              r"model.variant=dspark"):
        initialise_drafter(build_drafter(back, tiny_target.config, mask_token_id=16), tiny_target, back)


def test_sampling_decodes_through_the_markov_walk(tiny_target) -> None:
    _, dspark = _pair(tiny_target)
    randomised(dspark)
    torch.manual_seed(4)
    out = speculative_generate(dspark, tiny_target, torch.tensor([[1, 2, 3]]), max_new_tokens=12,
                               stop_token_ids=[], temperature=1.0)
    assert len(out.tokens) == 12 and sum(out.acceptance_lengths) + 1 >= 12


@pytest.mark.slow
def test_eval_and_generate_decode_a_dspark_export_losslessly(tmp_path, capsys) -> None:
    """The drafts of a DSpark drafter with every weight moved (a live Markov bias), verified by
    the target: eval's and generate's outputs equal the target's own greedy ones."""
    tiny_folder = make_tiny_target(tmp_path / "target", layers=4)
    target = AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    _, dspark = _pair(target)
    folder = export.export_drafter(randomised(dspark), tmp_path / "ds", target_config=target.config,
                                   dtype=torch.float32)
    code = cli_main(["eval", "--drafter", str(folder), f"model.target={tiny_folder}", "eval.num_prompts=1",
                     "eval.max_new_tokens=6", f"run_dir={tmp_path / 'run'}", "pipeline.device=cpu"])
    assert code == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "run" / "eval" / "results.json").read_text())
    assert results["lossless"] is True and results["requests"] == 2
    code = cli_main(["generate", "--drafter", str(folder), "--target", str(tiny_folder), "--max-new-tokens", "8",
                     "--prompt", "the model drafts tokens", "--check"])
    out = capsys.readouterr().out
    assert code == 0 and "lossless: identical to the target's greedy answer (8 tokens)" in out, out


# --- training terms ----------------------------------------------------------------------------

def _pairs_batch(generator: torch.Generator, embed: torch.Tensor, half: int) -> tuple[Batch, TargetOutputs]:
    """Rows of pairs (r, r + half) with r random: the token after a random one is decided by it,
    which a Markov head with the true previous token can learn and the parallel backbone cannot."""
    r = torch.randint(0, half - 1, (8, 12), generator=generator)
    ids = torch.stack([r, r + half], dim=-1).reshape(8, 24)
    anchors = torch.stack([torch.randperm(19, generator=generator)[:6].sort().values + 1 for _ in range(8)])
    batch = Batch.of_rows(ids, torch.ones(8, 24, dtype=torch.bool), anchors=anchors,
                          keep=torch.ones(8, 6, dtype=torch.bool))
    return batch, TargetOutputs(features=embed[ids])


def _objective(markov_weight: float | None = None, confidence: bool = True, vocab: int = 64, hidden: int = 32):
    target = LlamaConfig(hidden_size=hidden, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=vocab)
    torch.manual_seed(0)
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[1], variant="dspark",
                                        markov_rank=16, enable_confidence_head=confidence), target,
                            mask_token_id=vocab - 1)
    embed = torch.randn(vocab, hidden)
    terms = get_variant("dspark").loss_terms(drafter, TrainingConfig(markov_weight=markov_weight))
    return drafter, embed, DFlashObjective(drafter, embed, embed, gamma=None, loss_chunk_size=64, terms=terms)


@pytest.mark.slow
def test_the_terms_fall_on_a_tiny_overfit_and_the_markov_path_beats_the_backbone() -> None:
    """Pairs data (see :func:`_pairs_batch`), 80 AdamW steps at lr 3e-3: the corrected loss and the
    confidence loss fall, the Markov path is right on about half the slots (every slot after a
    random token: the most there is) where the backbone is near chance, and the estimated
    acceptance is close to the actual one (one run: corrected loss 5.83 -> 3.09, confidence loss
    0.693 -> 0.637, Markov accuracy 0.49, backbone 0.014, estimated acceptance 0.41)."""
    drafter, embed, objective = _objective()
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    history = []
    for step in range(80):
        sums = objective(*_pairs_batch(generator, embed, 32), step)
        if step == 0:
            assert list(sums.terms) == ["markov_loss", "confidence_loss"]
            assert sums.term_weights == {"markov_loss": 1.0, "confidence_loss": 1.0}
            torch.testing.assert_close(sums.objective(), sums.loss + sums.terms["markov_loss"]
                                       + sums.terms["confidence_loss"])
            assert [m.name for m in sums.metrics][4:] == [
                "train/markov_loss", "train/markov_acc", "train/tau_sim_markov", "train/acc_markov_pos/{k}",
                "train/confidence_loss", "train/confidence_mean", "train/confidence_pos/{k}"]
            # From the identity start the corrected logits are the backbone's.
            torch.testing.assert_close(sums.terms["markov_loss"], sums.loss)
            assert torch.equal(sums.counts["markov_correct_per_slot"], sums.correct_per_slot)
            assert torch.equal(sums.counts["markov_accepted"], sums.accepted)
            # The confidence loss trains the confidence head alone.
            grads = torch.autograd.grad(sums.terms["confidence_loss"], list(drafter.parameters()), allow_unused=True,
                                        retain_graph=True)
            moved = {n for (n, _), g in zip(drafter.named_parameters(), grads) if g is not None and g.abs().sum() > 0}
            assert moved == {"confidence_head.proj.weight", "confidence_head.proj.bias"}
        optimizer.zero_grad()
        (sums.objective() / sums.weight).backward()
        optimizer.step()
        count = float(sums.count)
        history.append({"markov_loss": float(sums.terms["markov_loss"].detach() / sums.weight),
                        "confidence_loss": float(sums.terms["confidence_loss"].detach() / sums.weight),
                        "markov_acc": float(sums.counts["markov_correct"]) / count, "acc": float(sums.correct) / count,
                        "confidence": float(sums.counts["confidence_sum"]) / count})
    assert all(torch.isfinite(torch.tensor(list(h.values()))).all() for h in history)
    last = {key: sum(h[key] for h in history[-20:]) / 20 for key in history[0]}
    assert last["markov_loss"] < history[0]["markov_loss"] - 1.0
    assert last["confidence_loss"] < history[0]["confidence_loss"] - 0.04  # ln 2 at the zero init
    assert last["markov_acc"] > 0.4 and last["acc"] < 0.1
    assert abs(last["confidence"] - last["markov_acc"]) < 0.15


def test_weight_zero_freezes_the_markov_head_and_the_confidence_head_is_optional() -> None:
    drafter, embed, objective = _objective(markov_weight=0.0)
    assert not any(p.requires_grad for p in drafter.markov_head.parameters())
    sums = objective(*_pairs_batch(torch.Generator().manual_seed(2), embed, 32), 0)
    assert list(sums.terms) == ["confidence_loss"] and "markov_correct" not in sums.counts
    sums.objective().backward()
    assert drafter.confidence_head.proj.weight.grad.abs().sum() > 0
    drafter, embed, objective = _objective(confidence=False)
    sums = objective(*_pairs_batch(torch.Generator().manual_seed(2), embed, 32), 0)
    assert list(sums.terms) == ["markov_loss"] and "confidence_sum" not in sums.counts
    sums.objective().backward()
    assert drafter.markov_head.markov_w2.weight.grad.abs().sum() > 0


# --- export ------------------------------------------------------------------------------------

def _sizes(config: dict) -> dict[str, int]:
    scope = {**config, **config.get("dflash_config", {})}
    return {name: eval(expr, {"__builtins__": {}}, scope) for name, expr in FORMAT["sizes"].items()}


@pytest.mark.parametrize("confidence", [True, False])
def test_export_has_the_keys_and_tensors_vllm_and_llama_cpp_read(tmp_path: Path, confidence: bool) -> None:
    drafter = randomised(build_drafter(model_cfg(enable_confidence_head=confidence), target_config(),
                                       mask_token_id=9))
    out = export.export_drafter(drafter, tmp_path / "ds", target_config=target_config(), dtype=torch.float32)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "dflash.py", "dspark.py", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    rules = FORMAT["config"]
    assert {k: config[k] for k in rules["equal"]} == rules["equal"]
    assert not [k for k in rules["present"] if k not in config]
    section = config[rules["drafter_section"]]
    assert not [k for k in rules["drafter_section_present"] if k not in section]
    assert (config["markov_rank"], config["enable_confidence_head"], config["confidence_head_with_markov"]) == (
        8, confidence, True)
    assert config["auto_map"] == {"AutoModel": "dspark.DSparkDraftModel"}
    sizes = _sizes(config)
    expected = dict(FORMAT["tensors"], **(FORMAT["confidence_tensors"] if confidence else {}))
    with safe_open(out / "model.safetensors", "pt") as f:
        found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    heads = {k: v for k, v in found.items() if not k.startswith(("layers.", "fc.", "hidden_norm.", "norm."))}
    assert heads == {k: tuple(d if isinstance(d, int) else sizes[d] for d in dims) for k, dims in expected.items()}
    assert found.keys() - heads.keys() == {k for k in drafter.state_dict() if not k.startswith(("markov_", "conf"))}
    loaded = export.load_drafter(out, variant="dspark")
    assert isinstance(loaded, DSparkDraftModel) and (loaded.confidence_head is not None) == confidence
    inputs = {"position_ids": torch.arange(10 + BLOCK)[None], "noise_embedding": torch.randn(1, BLOCK, H),
              "target_hidden": torch.randn(1, 10, 2 * H)}
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        hidden = loaded(**inputs)
        torch.testing.assert_close(hidden, drafter(**inputs), atol=0, rtol=0)
        assert torch.equal(loaded.propose(hidden[:, 1:], torch.tensor([3]), head, 0.0)[0],
                           drafter.propose(hidden[:, 1:], torch.tensor([3]), head, 0.0)[0])


def test_a_drafter_that_predicts_from_the_anchor_is_refused_in_one_line(tmp_path: Path) -> None:
    """DeepSeek's and SpecForge's DSpark drafters (``sample_from_anchor`` true, or missing as vLLM
    and llama.cpp read it) predict from the block's first row; this class drafts DFlash's layout,
    so it refuses them rather than decoding them wrongly."""
    out = export.export_drafter(randomised(build_drafter(model_cfg(), target_config(), mask_token_id=9)),
                                tmp_path / "ds", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    for value in (True, None):
        if value is None:
            config.pop("sample_from_anchor")
        else:
            config["sample_from_anchor"] = value
        (out / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=r"ds/config.json is not a valid drafter config \(this DSpark "
                                                  r"drafter predicts from the anchor row \(sample_from_anchor is "
                                                  r"true or missing\)"):
            export.load_drafter(out)


def _vllm_file(relative: str) -> Path:
    found = sorted(REPO.glob(f".venv-vllm/lib/python*/site-packages/{relative}"))
    if not found:
        pytest.skip(f"no vLLM install in .venv-vllm ({relative})")
    return found[0]


def test_the_format_file_holds_what_vllm_s_qwen3_dspark_reads() -> None:
    """The attributes vLLM's DSpark modules create (so the weight names it loads) and the config
    keys it reads, from the installed source."""
    vllm = FORMAT["vllm"]
    tree = ast.parse(_vllm_file(vllm["file"]).read_text())
    created: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            created[node.name] = {t.attr for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets
                                  if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                  and t.value.id == "self"}
    for cls, attrs in vllm["modules"].items():
        assert set(attrs) <= created.get(cls, set()), (cls, attrs)
    read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    read |= {n.args[1].value for n in ast.walk(tree) if isinstance(n, ast.Call) and len(n.args) >= 2
             and getattr(n.func, "id", "") == "getattr" and isinstance(n.args[1], ast.Constant)}
    assert set(vllm["config_keys"]) <= read
    assert f'"{vllm["registry"]["architecture"]}": ("qwen3_dspark"' in _vllm_file(vllm["registry"]["file"]).read_text()
    rename = _vllm_file(vllm["rename"]["file"]).read_text()
    assert f'"{vllm["rename"]["from"]}" in self.draft_model_config.architectures' in rename
    assert f'"{vllm["rename"]["to"]}"' in rename
    assert f'"{vllm["layout"]["key"]}", True' in _vllm_file(vllm["layout"]["file"]).read_text()
    # The names of the exported heads are those modules' parameters.
    for name in FORMAT["tensors"] | FORMAT["confidence_tensors"]:
        module, attr, _ = name.split(".")
        assert module in created["Qwen3DSparkModel"] and attr in created["DSparkMarkovHead"] | created[
            "DSparkConfidenceHead"]


def test_the_format_file_holds_what_llama_cpp_s_converter_reads() -> None:
    """llama.cpp's DSpark converter and graph, from the vendored source of the serve check's
    build (skipped where it is not built)."""
    from dflash_trainer.engines.llama_cpp_build import default_folder, source_dir

    source = source_dir(default_folder())
    if not (source / "conversion" / "qwen.py").is_file():
        pytest.skip(f"no llama.cpp source at {source} (make serve-check builds it)")
    llama = FORMAT["llama_cpp"]
    converter = (source / llama["converter"]["file"]).read_text()
    registered = converter[converter.index("@ModelBase.register(\n    \"Qwen3DSparkModel\""):]
    assert f'"{llama["converter"]["registers"]}"' in registered[:registered.index("class DSparkModel")]
    assert all(f'"{key}"' in registered for key in llama["converter"]["reads"])
    mapping = (source / llama["tensor_mapping"]["file"]).read_text()
    assert all(f'"{name}"' in mapping for name in llama["tensor_mapping"]["names"])
    graph = (source / llama["graph"]["file"]).read_text()
    assert all(text in graph for text in llama["graph"]["strings"])


@pytest.mark.slow
def test_transformers_alone_loads_the_dspark_export(tmp_path: Path) -> None:
    drafter = randomised(build_drafter(model_cfg(), target_config(), mask_token_id=9))
    out = export.export_drafter(drafter, tmp_path / "ds", dtype=torch.float32)
    inputs = {"position_ids": torch.arange(10 + BLOCK)[None], "noise_embedding": torch.randn(1, BLOCK, H),
              "target_hidden": torch.randn(1, 10, 2 * H)}
    name, info, out_tensor = load_with_transformers_alone(out, inputs, tmp_path)
    assert name == "DSparkDraftModel"
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [] and info["mismatched_keys"] == []
    with torch.no_grad():
        torch.testing.assert_close(out_tensor, drafter(**inputs), atol=1e-5, rtol=1e-4)


# --- a run -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_dspark_run_logs_its_metrics_reports_them_exports_dspark_and_resumes(tmp_path) -> None:
    from helpers_e2e import make_chat_jsonl, tiny_run_overrides

    target = make_tiny_target(tmp_path / "target", layers=3)
    run = tmp_path / "run"
    args = [a for a in tiny_run_overrides(target=target, data=make_chat_jsonl(tmp_path / "chat.jsonl", num=16),
                                          cache=tmp_path / "cache", run_dir=run) if not a.startswith("training.epochs")]
    args += ["model.block_size=4", "model.variant=dspark", "model.markov_rank=8", "training.markov_weight=0.5",
             "eval.num_prompts=1", "eval.max_new_tokens=8"]
    assert cli_main(["train", *args, "training.max_steps=2"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "train/markov_acc" in r]
    assert len(logged) == 2
    for key in ("train/markov_loss", "train/markov_acc", "train/tau_sim_markov", "train/acc_markov_pos/1",
                "train/acc_markov_pos/3", "train/confidence_loss", "train/confidence_mean", "train/confidence_pos/3"):
        assert all(0 <= r[key] < 1e3 for r in logged), key
    assert 1.0 <= logged[-1]["train/tau_sim_markov"] <= 4.0 and 0 < logged[-1]["train/confidence_mean"] < 1
    config = json.loads((run / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"] and config["markov_rank"] == 8
    report = (run / "report" / "index.html").read_text()
    assert "final tau_sim_markov (DSpark)" in report and "final confidence_mean (DSpark)" in report
    assert cli_main(["train", *args, "training.max_steps=3", "checkpoint.resume=auto"]) == 0
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["train/step"] == 3
