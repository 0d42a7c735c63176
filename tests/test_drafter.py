"""Drafter module: config from the target, parameters, init scale, training == inference, spec_generate."""

import copy
import math

import pytest
import torch
from torch.nn import functional as F
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3Config

from dflash_trainer.core import assets
from dflash_trainer.config import ModelConfig
from dflash_trainer.core.errors import ConfigError
from dflash_trainer.model.blocks import build_block_inputs, dense_block_mask, position_ids, sample_anchors
from dflash_trainer.model.drafter import (SIGNATURE_KEY, build_drafter, build_drafter_config, check_compatible,
                                          default_target_layer_ids, init_from_last_layers, tokenizer_signature)
from dflash_trainer.model.modeling import dflash as dflash_module
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.target import FeatureExtractor
from helpers_objective import run_objective

H, V = 64, 256


def tiny_llama(**overrides) -> LlamaConfig:
    kwargs = dict(hidden_size=H, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=V, tie_word_embeddings=True, rope_theta=50000.0)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def perturbed(drafter):
    """Fresh init has a tiny final norm; random weights make equivalence tests sensitive."""
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return drafter.eval()


def test_default_layer_ids_follow_the_reference_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # round half to even: 20.5 -> 20
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]


def test_config_copies_target_dims_unless_overridden():
    target = tiny_llama()
    cfg = build_drafter_config(ModelConfig(num_layers=2, block_size=8, target_layer_ids=[1, 2]), target,
                               mask_token_id=7)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == (64, 128, 4, 2, 16)
    assert cfg.rope_parameters["rope_theta"] == 50000.0
    assert cfg.num_hidden_layers == 2 and cfg.layer_types == ["full_attention"] * 2
    assert cfg.dflash_config == {"mask_token_id": 7, "target_layer_ids": [1, 2], "block_size": 8}
    assert cfg.num_target_layers == 4 and cfg.block_size == 8 and not cfg.tie_word_embeddings
    over = build_drafter_config(ModelConfig(num_layers=1, intermediate_size=96, num_attention_heads=8,
                                            num_key_value_heads=4, head_dim=8, mask_token_id=3,
                                            target_layer_ids=[0, 2]), target)
    assert (over.intermediate_size, over.num_attention_heads, over.num_key_value_heads, over.head_dim) == (96, 8, 4, 8)
    assert over.dflash_config["target_layer_ids"] == [0, 2] and over.dflash_config["mask_token_id"] == 3


def test_reference_taps_that_would_repeat_a_layer_are_refused_naming_num_layers():
    """docs/errors.md: on a 4-layer target the rule spreads two taps over layers 1..1."""
    with pytest.raises(ConfigError, match=r"model.num_layers=2: the reference rule would tap the target's layers "
                                          r"\[1, 1\], one of them twice .* set model.num_layers=1, or name distinct "
                                          r"layers with model.target_layer_ids"):
        build_drafter_config(ModelConfig(num_layers=2), tiny_llama(), mask_token_id=7)
    assert build_drafter_config(ModelConfig(num_layers=2, target_layer_ids=[0, 1]), tiny_llama(),
                                mask_token_id=7).dflash_config["target_layer_ids"] == [0, 1]


def test_config_errors_are_clear():
    target = tiny_llama()
    with pytest.raises(ValueError, match="mask_token_id is not set"):
        build_drafter_config(ModelConfig(), target)
    with pytest.raises(ValueError, match=r"target_layer_ids \[4\] out of range"):
        build_drafter_config(ModelConfig(target_layer_ids=[0, 4]), target, mask_token_id=1)
    # The last layer (3) is refused: serving reads it after the final norm, training before.
    with pytest.raises(ValueError, match=r"target_layer_ids \[3\] out of range.*final norm"):
        build_drafter_config(ModelConfig(target_layer_ids=[3]), target, mask_token_id=1)
    with pytest.raises(ValueError, match="outside the target's embedding table"):
        build_drafter_config(ModelConfig(), target, mask_token_id=V)
    drafter_cfg = build_drafter_config(ModelConfig(), target, mask_token_id=1)
    with pytest.raises(ConfigError, match="hidden size: drafter 64, target 32"):
        check_compatible(drafter_cfg, tiny_llama(hidden_size=32))


def test_heads_that_do_not_divide_the_kv_heads_name_both_keys():
    with pytest.raises(ConfigError, match=r"3 attention heads \(model.num_attention_heads\) are not a "
                                          r"multiple of its 2 key/value heads \(model.num_key_value_heads, "
                                          r"from the target\)"):
        build_drafter_config(ModelConfig(num_attention_heads=3), tiny_llama(), mask_token_id=1)
    with pytest.raises(ConfigError, match=r"4 attention heads \(model.num_attention_heads, from the "
                                          r"target\) are not a multiple of its 3 key/value heads"):
        build_drafter_config(ModelConfig(num_key_value_heads=3), tiny_llama(), mask_token_id=1)


def test_last_layers_init_with_more_layers_than_the_target_is_a_config_error():
    target = LlamaForCausalLM(tiny_llama(num_hidden_layers=2))
    drafter = build_drafter(ModelConfig(num_layers=3, target_layer_ids=[0]), target.config, mask_token_id=1)
    with pytest.raises(ConfigError, match=r"drafter has 3 layers \(model.num_layers\) and the target only 2"):
        init_from_last_layers(drafter, target)


@pytest.fixture(scope="module")
def tokenizer():
    return assets.load_tokenizer(assets.resolve_target("smollm2"))


def changed(tokenizer, **attributes):
    """A copy of a real tokenizer with some tokens or the chat template replaced."""
    other = copy.deepcopy(tokenizer)
    for name, value in attributes.items():
        setattr(other, name, value)
    return other


def test_the_config_records_the_target_and_its_tokenizer(tokenizer):
    cfg = build_drafter_config(ModelConfig(), tiny_llama(), mask_token_id=1, tokenizer=tokenizer)
    signature = getattr(cfg, SIGNATURE_KEY)
    assert signature["vocab_size"] == V and signature["hidden_size"] == H
    assert signature["tokenizer"] == tokenizer_signature(tokenizer)
    assert (signature["tokenizer"]["bos_token_id"], signature["tokenizer"]["eos_token_id"],
            signature["tokenizer"]["pad_token_id"], signature["tokenizer"]["mask_token_id"]) == (1, 2, 2, None)
    assert len(signature["tokenizer"]["sha256"]) == 64
    without = build_drafter_config(ModelConfig(), tiny_llama(), mask_token_id=1)
    assert getattr(without, SIGNATURE_KEY) == {"vocab_size": V, "hidden_size": H}


def test_a_target_with_another_vocabulary_is_refused():
    """The issue's case: a drafter for a 49,152-token vocabulary against 49,664 rows."""
    cfg = build_drafter_config(ModelConfig(), tiny_llama(vocab_size=49152), mask_token_id=1)
    with pytest.raises(ConfigError, match=r"vocabulary: the drafter was trained for 49152 tokens, the "
                                          r"target has 49664"):
        check_compatible(cfg, tiny_llama(vocab_size=49664))


@pytest.mark.parametrize(("attributes", "message"), [
    (dict(chat_template="{{ messages }}"), "tokenizer: the chat template differs"),
    (dict(eos_token="<|im_start|>"), r"tokenizer: eos_token_id 2 \(drafter's target\) vs 1 \(this target\)"),
    (dict(pad_token="<|endoftext|>", bos_token="<|im_end|>"),
     r"tokenizer: bos_token_id 1 .* vs 2 .*, pad_token_id 2 .* vs 0"),
    (dict(mask_token="<empty_output>"), r"tokenizer: mask_token_id None \(drafter's target\) vs 16"),
])
def test_a_tokenizer_that_differs_is_named(tokenizer, attributes, message):
    cfg = build_drafter_config(ModelConfig(), tiny_llama(), mask_token_id=1, tokenizer=tokenizer)
    check_compatible(cfg, tiny_llama(), tokenizer=copy.deepcopy(tokenizer))
    with pytest.raises(ConfigError, match=message):
        check_compatible(cfg, tiny_llama(), tokenizer=changed(tokenizer, **attributes))


def test_a_drafter_without_a_recorded_tokenizer_is_checked_on_shapes_only(tokenizer):
    """Exports written before the signature existed still load; their shapes are still checked."""
    cfg = build_drafter_config(ModelConfig(), tiny_llama(), mask_token_id=1, tokenizer=tokenizer)
    delattr(cfg, SIGNATURE_KEY)
    check_compatible(cfg, tiny_llama(), tokenizer=changed(tokenizer, chat_template="anything"))
    with pytest.raises(ConfigError, match="vocabulary"):
        check_compatible(cfg, tiny_llama(vocab_size=V + 64), tokenizer=tokenizer)


def test_parameters_are_draft_only_and_fresh():
    torch.manual_seed(0)
    drafter = build_drafter(ModelConfig(num_layers=2, target_layer_ids=[0, 1, 2]), tiny_llama(), mask_token_id=1)
    names = set(drafter.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert all(n.startswith("layers.") or n in {"fc.weight", "hidden_norm.weight", "norm.weight"} for n in names)
    assert "layers.1.self_attn.q_norm.weight" in names and "layers.0.mlp.gate_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n or "rotary" in n for n in names)
    assert drafter.fc.weight.shape == (H, 3 * H)
    assert abs(drafter.layers[0].mlp.up_proj.weight.std().item() - 0.02) < 0.002
    assert torch.all(drafter.hidden_norm.weight == 1.0)
    assert torch.allclose(drafter.norm.weight, torch.full((H,), H ** -0.5))
    assert drafter.config._attn_implementation == "sdpa"


def test_first_loss_is_near_ln_vocab_with_a_trained_scale_head():
    """A trained tied head has large rows; the fresh final norm keeps the first CE near ln(V)."""
    torch.manual_seed(0)
    vocab = 4096
    target = LlamaForCausalLM(tiny_llama(vocab_size=vocab)).eval().requires_grad_(False)
    with torch.no_grad():
        target.model.embed_tokens.weight.normal_(0.0, 0.4)  # row norm ~3.2, as SmolLM2's
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=8, target_layer_ids=[1, 2]),
                            target.config, mask_token_id=5)
    extractor = FeatureExtractor(target, drafter.target_layer_ids)
    ids = torch.randint(0, vocab, (2, 48))
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    anchors, keep = sample_anchors(loss_mask, 16, 8, torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "loss_mask": loss_mask, "seq_lens": torch.tensor([48, 48]),
             "anchors": anchors, "keep": keep}
    objective = DFlashObjective(drafter, extractor.embed_weight, extractor.head_weight, gamma=4.0,
                                loss_chunk_size=64)
    features = extractor(ids).features
    with torch.no_grad():
        loss, _ = run_objective(objective, batch, features, 0)
        assert abs(loss.item() - math.log(vocab)) < 0.05 * math.log(vocab)
        drafter.norm.weight.fill_(1.0)  # the plain Qwen3 init
        unit_loss, _ = run_objective(objective, batch, features, 0)
    assert unit_loss.item() > 1.5 * math.log(vocab)


def test_training_forward_equals_inference_forward():
    """Block j of the masked training pass == an inference call with context [0, a_j) and that block."""
    torch.manual_seed(0)
    drafter = perturbed(build_drafter(ModelConfig(num_layers=2, block_size=4, target_layer_ids=[0, 2]),
                                      tiny_llama(), mask_token_id=5))
    seq, block = 20, 4
    features = torch.randn(2, seq, 2 * H)
    ids = torch.randint(0, V, (2, seq))
    embed = torch.randn(V, H)
    anchors = torch.tensor([[3, 7, 16], [0, 2, 0]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    noise, block_pos = build_block_inputs(ids, anchors, keep, 5, block)
    with torch.no_grad():
        train = drafter(position_ids(block_pos, seq), embed[noise], features,
                        attention_mask=dense_block_mask(anchors, keep, seq, block))
        for b, j in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]:
            a = int(anchors[b, j])
            tokens = noise[b, j * block:(j + 1) * block]
            infer = drafter(torch.arange(a + block)[None], embed[tokens][None], features[b:b + 1, :a])
            torch.testing.assert_close(infer[0], train[b, j * block:(j + 1) * block], atol=1e-5, rtol=1e-5)
        # Same with the context fed in two pieces through the draft cache.
        cache = DynamicCache()
        tokens = noise[0, 2 * block:3 * block]
        drafter(torch.arange(9 + block)[None], embed[tokens][None], features[:1, :9], past_key_values=cache)
        assert cache.get_seq_length() == 9  # context only: block K/V are never stored
        infer = drafter(torch.arange(9, 16 + block)[None], embed[tokens][None], features[:1, 9:16],
                        past_key_values=cache)
        assert cache.get_seq_length() == 16
    torch.testing.assert_close(infer[0], train[0, 2 * block:3 * block], atol=1e-5, rtol=1e-5)


def test_crop_to_removes_only_the_excess():
    cache = DynamicCache()
    cache.update(torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4), 0)
    dflash_module._crop_to(cache, 7)
    assert cache.get_seq_length() == 7
    dflash_module._crop_to(cache, 4)
    assert cache.get_seq_length() == 4


def test_reads_dflash_config_before_top_level():
    cfg = Qwen3Config(hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, intermediate_size=128, vocab_size=V, block_size=16, mask_token_id=1,
                      num_target_layers=10, dflash_config={"block_size": 8, "mask_token_id": 9})
    model = dflash_module.DFlashDraftModel(cfg)
    assert (model.block_size, model.mask_token_id, model.target_layer_ids) == (8, 9, [5])
    cfg.layer_types = ["sliding_attention"]
    with pytest.raises(NotImplementedError, match="full-attention"):
        dflash_module.DFlashDraftModel(cfg)


def test_spec_generate_is_lossless_greedy():
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama()).eval()
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[1, 2]),
                            target.config, mask_token_id=5).eval()
    prompt = torch.randint(6, V, (1, 9))
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    stats = drafter.spec_generate(target, prompt, max_new_tokens=20, temperature=0.0, return_stats=True)
    assert torch.equal(stats.output_ids, expected)
    assert stats.num_output_tokens == 20
    assert all(1 <= n <= 4 for n in stats.acceptance_lengths)
    # A stop token ends generation right after it.
    stop = int(expected[0, 9 + 6])
    first = int((expected[0, 9:] == stop).nonzero()[0, 0])
    out = drafter.spec_generate(target, prompt, max_new_tokens=20, stop_token_ids=[stop])
    assert torch.equal(out, expected[:, :9 + first + 1])


def test_verify_counts_leading_matches_and_picks_the_bonus():
    logits = torch.full((4, 10), -5.0)
    for pos, tok in enumerate([3, 4, 9, 2]):  # target greedy tokens at the 4 verify positions
        logits[pos, tok] = 5.0
    assert dflash_module._verify(torch.tensor([3, 4, 9]), logits, None, 0.0)[0] == 3
    accepted, bonus = dflash_module._verify(torch.tensor([3, 4, 1]), logits, None, 0.0)
    assert (accepted, int(bonus)) == (2, 9)
    accepted, bonus = dflash_module._verify(torch.tensor([0, 4, 9]), logits, None, 0.0)
    assert (accepted, int(bonus)) == (0, 3)
    # Sampling: drafts with target probability ~1 are always accepted; the bonus follows the target.
    draft_probs = torch.softmax(logits[None, :3], dim=-1)
    accepted, bonus = dflash_module._verify(torch.tensor([3, 4, 9]), logits * 10, draft_probs, 1.0)
    assert (accepted, int(bonus)) == (3, 2)


def test_spec_generate_sampling_runs_and_stays_in_vocab():
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama()).eval()
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[1, 2]),
                            target.config, mask_token_id=5).eval()
    out = drafter.spec_generate(target, torch.randint(6, V, (1, 5)), max_new_tokens=15, temperature=0.8)
    assert out.shape == (1, 20) and int(out.max()) < V


def test_last_layers_init_copies_matching_layers():
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama())
    drafter = build_drafter(ModelConfig(num_layers=2, target_layer_ids=[0, 1]), target.config, mask_token_id=1)
    copied = init_from_last_layers(drafter, target)
    assert "layers.1.self_attn.q_proj.weight" in copied and "layers.0.mlp.down_proj.weight" in copied
    assert not any("q_norm" in name for name in copied)  # Llama has no QK-norm
    assert torch.equal(drafter.layers[1].self_attn.q_proj.weight, target.model.layers[3].self_attn.q_proj.weight)
    assert torch.equal(drafter.layers[0].mlp.up_proj.weight, target.model.layers[2].mlp.up_proj.weight)


def test_eager_and_sdpa_agree_on_fp32_gradients():
    torch.manual_seed(0)
    drafter = perturbed(build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[0]),
                                      tiny_llama(), mask_token_id=5)).train()
    seq = 16
    features = torch.randn(1, seq, H)
    anchors, keep = torch.tensor([[2, 9, 0]]), torch.tensor([[True, True, False]])
    noise, block_pos = build_block_inputs(torch.randint(0, V, (1, seq)), anchors, keep, 5, 4)
    embed = torch.randn(V, H)
    grads = []
    for impl in ("sdpa", "eager"):
        drafter.config._attn_implementation = impl
        drafter.zero_grad()
        out = drafter(position_ids(block_pos, seq), embed[noise], features,
                      attention_mask=dense_block_mask(anchors, keep, seq, 4))
        F.mse_loss(out, torch.ones_like(out)).backward()
        assert torch.isfinite(out).all()
        grads.append((out.detach(), [p.grad.clone() for p in drafter.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
