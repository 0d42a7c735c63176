"""DFlash2 drafters: options, the convolutions, the candidate selector, identity
initialisation, training forward, and export in z-lab's format."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers_e2e import load_with_transformers_alone, make_tiny_target
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig

from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import ModelConfig, load_config
from dflash_trainer.core.errors import CheckpointError, ConfigError
from dflash_trainer.training import export
from dflash_trainer.model.blocks import build_block_inputs, dense_block_mask, position_ids
from dflash_trainer.model.drafter import build_drafter, drafter_variant
from dflash_trainer.training.drafter_init import initialise_drafter
from dflash_trainer.model.modeling.dflash import BlockLayout, DFlashDraftModel
from dflash_trainer.model.modeling.dflash2 import CandidateSelector, DFlash2DraftModel, DynamicDepthwiseConv
from dflash_trainer.model.variants import get_variant
from dflash_trainer.evaluation.spec_decode import speculative_generate

H, V, BLOCK = 64, 256, 4
FORMAT = json.loads((Path(__file__).parent / "data" / "dflash2_format.json").read_text())


def target_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=H, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=V, rope_theta=100000.0, tie_word_embeddings=True)


def model_cfg(variant: str = "dflash2", **extra) -> ModelConfig:
    dflash2 = {"selector_rank": 8, "selector_top_k": 5} if variant == "dflash2" else {}
    return ModelConfig(num_layers=2, block_size=BLOCK, target_layer_ids=[1, 3], variant=variant,
                       **{**dflash2, **extra})


def randomised(drafter: DFlashDraftModel, scale: float = 0.2) -> DFlashDraftModel:
    """Every weight moved off its initialisation (identity convolutions and a zero successor
    codebook would hide mistakes)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for param in drafter.parameters():
            param.add_(torch.randn_like(param) * scale)
    return drafter.eval()


# --- options -----------------------------------------------------------------------------------

def test_dflash2_options_need_the_dflash2_variant_and_fit_the_target() -> None:
    with pytest.raises(ConfigError, match=r"^model.selector_top_k is a DFlash2 option, but model.variant is "
                                          r"dflash; set model.variant=dflash2 or remove it$"):
        load_config(None, ["model.selector_top_k=8"])
    with pytest.raises(ConfigError, match=r"model.selector_rank must be in \[1, 8192\]"):
        load_config(None, ["model.variant=dflash2", "model.selector_rank=0"])
    cfg = load_config(None, ["model.variant=dflash2"]).model
    assert (cfg.selector_rank, cfg.selector_top_k, cfg.conv_group_size) == (None, None, None)
    drafter = build_drafter(cfg, target_config(), mask_token_id=9)
    section = drafter.config.dflash_config
    assert (section["selector_rank"], section["selector_top_k"], section["conv_group_size"],
            section["conv_kernel_size"]) == (256, 16, 16, 2)
    with pytest.raises(ConfigError, match=r"model.selector_top_k=300 is larger than the target's vocabulary "
                                          r"\(256 tokens\)"):
        build_drafter(model_cfg(selector_top_k=300), target_config(), mask_token_id=9)
    with pytest.raises(ConfigError, match=r"model.conv_group_size=24 does not divide the target's hidden size 64"):
        build_drafter(model_cfg(conv_group_size=24), target_config(), mask_token_id=9)


# --- convolutions ------------------------------------------------------------------------------

def test_convolution_follows_its_formula_and_stays_inside_each_block() -> None:
    torch.manual_seed(0)
    hidden, group, block = 8, 4, 3
    conv = DynamicDepthwiseConv(hidden, 2, group, block)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x, y = torch.randn(1, 2 * block, hidden), torch.randn(1, 2 * block, hidden)
    with torch.no_grad():
        before, kernel = conv.prepare(x)
        after = conv.finish(y, kernel)
        delta = (x[0] @ conv.kernel_projection.weight.T).view(2 * block, 2, 2, hidden // group)  # [t, side, tap, g]
    for side, (inp, out) in enumerate(((x, before), (y, after))):
        for t in range(2 * block):
            for c in range(hidden):
                expected = 0.0
                for tap in range(2):
                    if t % block >= tap:  # the anchor (slot 0) reads zero for tap 1: no earlier block row
                        coefficient = conv.base_kernel[side, tap, c].detach() + delta[t, side, tap, c // group]
                        expected += float(coefficient * inp[0, t - tap, c])
                assert float(out[0, t, c]) == pytest.approx(expected, abs=1e-5)


def test_packed_training_blocks_equal_each_block_drafted_alone() -> None:
    drafter = randomised(build_drafter(model_cfg(), target_config(), mask_token_id=9))
    torch.manual_seed(2)
    seq = 12
    input_ids = torch.randint(20, V, (1, seq))
    anchors, keep = torch.tensor([[2, 5, 6]]), torch.ones(1, 3, dtype=torch.bool)
    features = torch.randn(1, seq, 2 * H)
    embed = torch.randn(V, H)
    noise_ids, block_positions = build_block_inputs(input_ids, anchors, keep, 9, BLOCK)
    args = (position_ids(block_positions, seq), embed[noise_ids], features)
    with torch.no_grad():
        packed = drafter(*args, attention_mask=BlockLayout(anchors, keep, seq, BLOCK))
        dense = drafter(*args, attention_mask=dense_block_mask(anchors, keep, seq, BLOCK))
        slots = drafter(*args, attention_mask=BlockLayout(anchors, keep, seq, BLOCK), output_slots=2)
        for j, anchor in enumerate(anchors[0].tolist()):
            alone = drafter(torch.arange(anchor + BLOCK)[None], embed[noise_ids[:, j * BLOCK:(j + 1) * BLOCK]],
                            features[:, :anchor])
            torch.testing.assert_close(packed[:, j * BLOCK:(j + 1) * BLOCK], alone, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(slots[:, j * 2:(j + 1) * 2], alone[:, 1:3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense, packed, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slots", range(1, BLOCK))
def test_output_slots_equal_the_same_slots_of_whole_blocks(slots: int) -> None:
    """With ``output_slots=K`` the last layer's MLP runs on rows 0..K of each block only (what
    slots 1..K read through the convolutions); the slots equal those of the full forward."""
    drafter = randomised(build_drafter(model_cfg(), target_config(), mask_token_id=9))
    torch.manual_seed(8)
    seq = 12
    input_ids = torch.randint(20, V, (2, seq))
    anchors, keep = torch.tensor([[2, 5, 6], [0, 3, 7]]), torch.tensor([[True, True, True], [True, False, True]])
    noise_ids, block_positions = build_block_inputs(input_ids, anchors, keep, 9, BLOCK)
    args = (position_ids(block_positions, seq), torch.randn(V, H)[noise_ids], torch.randn(2, seq, 2 * H))
    layout = BlockLayout(anchors, keep, seq, BLOCK)
    with torch.no_grad():
        full = drafter(*args, attention_mask=layout)
        part = drafter(*args, attention_mask=layout, output_slots=slots)
    expected = full.unflatten(1, (-1, BLOCK))[:, :, 1:slots + 1].flatten(1, 2)
    torch.testing.assert_close(part, expected, atol=1e-5, rtol=1e-5)


# --- selector ----------------------------------------------------------------------------------

@torch.no_grad()
def test_selector_scores_pairs_from_gathered_rows_and_walks_greedily() -> None:
    config = build_drafter(model_cfg(), target_config(), mask_token_id=9).config
    selector = CandidateSelector(config)
    torch.manual_seed(3)
    with torch.no_grad():
        for param in selector.parameters():
            param.normal_()
    hidden, logits = torch.randn(2, 3, H), torch.randn(2, 3, V)
    anchors = torch.tensor([7, 11])
    unary, candidates = selector.candidates(logits)
    assert torch.equal(unary, logits.topk(5, dim=-1).values)
    projected = hidden @ selector.hidden_projection.weight.T
    predecessors = torch.tensor([[3, 4, 5], [6, 7, 8]])
    scores = selector.pair_scores(hidden, unary, candidates, predecessors)
    a, b = selector.predecessor_codebook, selector.successor_codebook
    for i in range(2):
        for t in range(3):
            for j in range(5):
                expected = unary[i, t, j] + (a[predecessors[i, t]] * projected[i, t] * b[candidates[i, t, j]]).sum()
                assert float(scores[i, t, j]) == pytest.approx(float(expected), abs=1e-4)
    path, _, q = selector.walk(hidden, logits, anchors, temperature=0.0)
    assert q is None
    for i in range(2):
        previous = int(anchors[i])
        for t in range(3):
            best = max(range(5), key=lambda j: float(unary[i, t, j] + (a[previous] * projected[i, t]
                                                                         * b[candidates[i, t, j]]).sum()))
            previous = int(candidates[i, t, best])
            assert int(path[i, t]) == previous
    sampled, cands, q = selector.walk(hidden, logits, anchors, temperature=1.0)
    assert q is not None and q.shape == (2, 3, 5)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 3))
    assert all(int(sampled[i, t]) in cands[i, t].tolist() for i in range(2) for t in range(3))


# --- identity initialisation and decoding ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("dflash2") / "target", layers=4)


@pytest.fixture(scope="module")
def tiny_target(tiny_folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_folder).eval()


def _pair(target: torch.nn.Module) -> tuple[DFlashDraftModel, DFlash2DraftModel]:
    """A DFlash drafter with moved weights and a fresh DFlash2 drafter holding the same backbone."""
    cfg = ModelConfig(num_layers=2, block_size=BLOCK, target_layer_ids=[1, 2])
    dflash = randomised(build_drafter(cfg, target.config, mask_token_id=16), scale=0.5)
    dflash2 = build_drafter(dataclasses.replace(cfg, variant="dflash2", selector_rank=8), target.config,
                            mask_token_id=16).eval()
    result = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert all(".attention_conv." in k or ".mlp_conv." in k or k.startswith("candidate_selector.")
               for k in result.missing_keys)
    return dflash, dflash2


@pytest.mark.slow
def test_an_untrained_dflash2_drafter_drafts_what_its_dflash_backbone_drafts(tiny_target) -> None:
    dflash, dflash2 = _pair(tiny_target)
    assert dflash2.candidate_selector.successor_codebook.abs().sum() == 0
    assert dflash2.candidate_selector.predecessor_codebook.std() > 0.01
    for prompt in ([1, 2, 3, 4, 5], [100, 2000, 30000, 7]):
        ids = torch.tensor([prompt])
        one = speculative_generate(dflash, tiny_target, ids, max_new_tokens=16, stop_token_ids=[])
        two = speculative_generate(dflash2, tiny_target, ids, max_new_tokens=16, stop_token_ids=[])
        assert [s.drafted for s in two.steps] == [s.drafted for s in one.steps]
        assert two.tokens == one.tokens and two.acceptance_lengths == one.acceptance_lengths


def test_sampling_decodes_through_the_selector(tiny_target) -> None:
    _, dflash2 = _pair(tiny_target)
    randomised(dflash2)
    torch.manual_seed(4)
    out = speculative_generate(dflash2, tiny_target, torch.tensor([[1, 2, 3]]), max_new_tokens=12,
                               stop_token_ids=[], temperature=1.0)
    assert len(out.tokens) == 12 and sum(out.acceptance_lengths) + 1 >= 12
    hidden = torch.randn(1, BLOCK - 1, H)
    with torch.no_grad():
        drafts, probs = dflash2.propose(hidden, torch.tensor([5]), tiny_target.get_output_embeddings(), 1.0)
    assert probs is not None and probs.shape == (1, BLOCK - 1, tiny_target.config.vocab_size)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, BLOCK - 1))
    assert ((probs > 0).sum(-1) <= 16).all() and all(float(probs[0, t, d]) > 0 for t, d in enumerate(drafts))


@pytest.mark.slow
def test_eval_and_generate_decode_a_dflash2_export(tiny_folder, tiny_target, tmp_path, capsys) -> None:
    _, dflash2 = _pair(tiny_target)
    folder = export.export_drafter(randomised(dflash2), tmp_path / "d2", target_config=tiny_target.config,
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


def test_a_dflash_export_warm_starts_a_dflash2_drafter_that_drafts_the_same(tiny_target, tmp_path) -> None:
    dflash, fresh = _pair(tiny_target)
    folder = export.export_drafter(dflash, tmp_path / "d1", target_config=tiny_target.config, dtype=torch.float32)
    cfg = ModelConfig(num_layers=2, block_size=BLOCK, target_layer_ids=[1, 2], variant="dflash2", selector_rank=8,
                      init_from=str(folder))
    torch.manual_seed(5)
    dflash2 = build_drafter(cfg, tiny_target.config, mask_token_id=16)
    copied = initialise_drafter(dflash2, tiny_target, cfg)
    assert sorted(copied) == sorted(dflash.state_dict())
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    one = speculative_generate(dflash, tiny_target, ids, max_new_tokens=12, stop_token_ids=[])
    two = speculative_generate(dflash2.eval(), tiny_target, ids, max_new_tokens=12, stop_token_ids=[])
    assert [s.drafted for s in two.steps] == [s.drafted for s in one.steps]
    # A DFlash2 drafter cannot start a DFlash one, nor a drafter reading other target layers.
    two_folder = export.export_drafter(dflash2, tmp_path / "d2", target_config=tiny_target.config)
    back = ModelConfig(num_layers=2, block_size=BLOCK, target_layer_ids=[1, 2], init_from=str(two_folder))
    with pytest.raises(CheckpointError, match=r"d2 holds a DFlash2 drafter .* but a DFlash one \(DFlashDraftModel\) "
                                              r"is expected here; warm-start it with model.variant=dflash2"):
        initialise_drafter(build_drafter(back, tiny_target.config, mask_token_id=16), tiny_target, back)
    other = dataclasses.replace(cfg, target_layer_ids=[0, 2])
    with pytest.raises(CheckpointError, match=r"model.init_from=.*d1 reads target layers \[1, 2\], this drafter "
                                              r"\[0, 2\]"):
        initialise_drafter(build_drafter(other, tiny_target.config, mask_token_id=16), tiny_target, other)
    with pytest.raises(ConfigError, match="model.init_from and model.drafter_init=target both set"):
        load_config(None, ["model.init_from=somewhere", "model.drafter_init=target"])


# --- export ------------------------------------------------------------------------------------

def _sizes(config: dict) -> dict[str, int]:
    scope = {**config, **config.get("dflash_config", {}), "len": len}
    return {name: eval(expr, {"__builtins__": {}}, scope) for name, expr in FORMAT["sizes"].items()}


def _expected_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    sizes = _sizes(config)

    def shape(dims: list) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else sizes[d] for d in dims)

    tensors = {name: shape(dims) for name, dims in FORMAT["tensors_once"].items()}
    for i in range(config["num_hidden_layers"]):
        tensors.update({f"layers.{i}.{name}": shape(dims) for name, dims in FORMAT["tensors_per_layer"].items()})
    return tensors


def test_the_schema_file_reproduces_z_labs_fixture() -> None:
    fixture = FORMAT["fixture"]
    expected = _expected_tensors(fixture["config"])
    assert len(expected) == fixture["tensor_count"]
    assert {k: expected[k] for k in fixture["shapes"]} == {k: tuple(v) for k, v in fixture["shapes"].items()}


def test_export_has_z_labs_config_keys_and_tensors(tmp_path: Path) -> None:
    drafter = randomised(build_drafter(model_cfg(), target_config(), mask_token_id=9))
    out = export.export_drafter(drafter, tmp_path / "d2", target_config=target_config())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "dflash.py", "dflash2.py", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    rules = FORMAT["config"]
    assert {k: config[k] for k in rules["equal"]} == rules["equal"]
    assert not [k for k in rules["present"] if k not in config]
    section = config[rules["drafter_section"]]
    assert not [k for k in rules["drafter_section_present"] if k not in section]
    assert {k: section[k] for k in rules["drafter_section_equal"]} == rules["drafter_section_equal"]
    assert section["selector_rank"] == 8 and section["selector_top_k"] == 5 and section["conv_group_size"] == 16
    assert config["auto_map"] == {"AutoModel": "dflash2.DFlash2DraftModel"}
    with safe_open(out / "model.safetensors", "pt") as f:
        found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert found == _expected_tensors(config)
    assert (out / "dflash2.py").read_text() == get_variant("dflash2").modeling_paths()[-1].read_text()


def test_round_trip_and_the_wrong_variant_is_refused_in_one_line(tmp_path: Path) -> None:
    drafter = randomised(build_drafter(model_cfg(), target_config(), mask_token_id=9))
    out = export.export_drafter(drafter, tmp_path / "d2", dtype=torch.float32)
    export.export_drafter(drafter, out)  # an earlier DFlash2 export may be replaced
    out = export.export_drafter(drafter, out, dtype=torch.float32)
    loaded = export.load_drafter(out, variant="dflash2")
    assert isinstance(loaded, DFlash2DraftModel) and drafter_variant(loaded.config) == "dflash2"
    inputs = {"position_ids": torch.arange(10 + BLOCK)[None], "noise_embedding": torch.randn(1, BLOCK, H),
              "target_hidden": torch.randn(1, 10, 2 * H)}
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs), drafter(**inputs), atol=0, rtol=0)
    with pytest.raises(CheckpointError, match=r"^.*d2 holds a DFlash2 drafter \(architectures DFlash2DraftModel\), "
                                              r"but a DFlash one \(DFlashDraftModel\) is expected here; give a "
                                              r"DFlash export$"):
        export.load_drafter(out, variant="dflash")
    one = export.export_drafter(randomised(build_drafter(model_cfg("dflash"), target_config(), mask_token_id=9)),
                                tmp_path / "d1")
    assert type(export.load_drafter(one)) is DFlashDraftModel
    with pytest.raises(CheckpointError, match=r"d1 holds a DFlash drafter .* but a DFlash2 one "
                                              r"\(DFlash2DraftModel\) is expected here; warm start"):
        export.load_checkpoint_drafter(one, variant="dflash2", fix="warm start from it with model.variant=dflash")


@pytest.mark.slow
def test_transformers_alone_loads_the_dflash2_export(tmp_path: Path) -> None:
    drafter = randomised(build_drafter(model_cfg(), target_config(), mask_token_id=9))
    out = export.export_drafter(drafter, tmp_path / "d2", dtype=torch.float32)
    inputs = {"position_ids": torch.arange(10 + BLOCK)[None], "noise_embedding": torch.randn(1, BLOCK, H),
              "target_hidden": torch.randn(1, 10, 2 * H)}
    name, info, out_tensor = load_with_transformers_alone(out, inputs, tmp_path)
    assert name == "DFlash2DraftModel"
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [] and info["mismatched_keys"] == []
    with torch.no_grad():
        torch.testing.assert_close(out_tensor, drafter(**inputs), atol=1e-5, rtol=1e-4)


def test_warm_start_refuses_a_drafter_trained_with_another_tokenizer(tiny_target, tmp_path) -> None:
    import copy

    from dflash_trainer.core import assets

    tokenizer = assets.load_tokenizer(assets.resolve_target("smollm2"))
    other = copy.deepcopy(tokenizer)
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    source = build_drafter(ModelConfig(num_layers=2, block_size=BLOCK, target_layer_ids=[1, 2]), tiny_target.config,
                           mask_token_id=16, tokenizer=other)
    folder = export.export_drafter(source, tmp_path / "other-template", target_config=tiny_target.config)
    cfg = ModelConfig(num_layers=2, block_size=BLOCK, target_layer_ids=[1, 2], init_from=str(folder))
    fresh = build_drafter(cfg, tiny_target.config, mask_token_id=16, tokenizer=tokenizer)
    with pytest.raises(CheckpointError, match=r"model.init_from=.*other-template does not fit the target: .*"
                                              r"tokenizer: the chat template differs"):
        initialise_drafter(fresh, tiny_target, cfg, tokenizer=tokenizer)
    assert initialise_drafter(fresh, tiny_target, cfg, tokenizer=other)  # the same tokenizer: accepted
