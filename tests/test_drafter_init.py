"""model.drafter_init=target: the drafter starts as the target's layer after the last tapped one."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash_trainer.training.checkpoint import ResumeError
from dflash_trainer.config import ModelConfig, config_to_dict, load_config, upgrade_saved_config
from dflash_trainer.core.errors import ConfigError
from dflash_trainer.model.drafter import (
    FINAL_NORM_SCALE,
    build_drafter,
    init_drafter_from_target,
)
from dflash_trainer.training.drafter_init import initialise_drafter
from dflash_trainer.training.resume import check_resume_compatible

SIZES = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 256}


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SIZES)).eval()


def qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=16)).eval()
    with torch.no_grad():  # non-trivial norms, so a missed copy shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def drafter_for(target: torch.nn.Module, layer_ids: list[int], num_layers: int = 1):
    cfg = ModelConfig(num_layers=num_layers, block_size=4, target_layer_ids=layer_ids, drafter_init="target")
    drafter = build_drafter(cfg, target.config, mask_token_id=3).eval()
    return drafter, initialise_drafter(drafter, target, cfg)


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.named_parameters())


def test_layers_and_norms_are_copies_of_the_next_target_layers():
    target = llama()
    drafter, copied = drafter_for(target, [0, 1], num_layers=2)
    for i, source in enumerate((2, 3)):
        theirs = params(target.model.layers[source])
        for name, param in drafter.layers[i].named_parameters():
            if "q_norm" in name or "k_norm" in name:  # Llama has no QK norm: left as initialised
                assert torch.equal(param, torch.ones_like(param)) and name not in theirs
            else:
                assert torch.equal(param, theirs[name]), (i, name)
                assert f"layers.{i}.{name}" in copied
    assert torch.equal(drafter.hidden_norm.weight, target.model.layers[2].input_layernorm.weight)
    assert torch.equal(drafter.norm.weight, target.model.norm.weight * FINAL_NORM_SCALE)


def test_a_wider_mlp_starts_as_the_target_layer_and_its_extra_units_can_learn():
    target = qwen3()
    narrow, _ = drafter_for(target, [1])
    cfg = ModelConfig(num_layers=1, block_size=4, target_layer_ids=[1], drafter_init="target",
                      intermediate_size=3 * SIZES["intermediate_size"])
    wide = build_drafter(cfg, target.config, mask_token_id=3).eval()
    copied = initialise_drafter(wide, target, cfg)
    assert "layers.0.mlp.down_proj.weight (first 128 of 384 units)" in copied
    mlp, theirs = wide.layers[0].mlp, target.model.layers[2].mlp
    assert torch.equal(mlp.gate_proj.weight[:128], theirs.gate_proj.weight)
    assert torch.equal(mlp.down_proj.weight[:, :128], theirs.down_proj.weight)
    assert not mlp.down_proj.weight[:, 128:].any() and mlp.up_proj.weight[128:].abs().sum() > 0
    x = torch.randn(2, 5, SIZES["hidden_size"])
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), narrow.layers[0].mlp(x))
    mlp(x).square().sum().backward()
    assert mlp.down_proj.weight.grad[:, 128:].abs().sum() > 0  # the extra units are not dead


def test_fc_selects_the_last_tapped_layer():
    target = llama()
    drafter, _ = drafter_for(target, [1, 0])  # list order, not layer order: layer 1 is the first block
    features = torch.randn(2, 5, 2 * 64)
    with torch.no_grad():
        assert torch.equal(drafter.fc(features), features[..., :64])
    drafter, _ = drafter_for(target, [2])
    features = torch.randn(1, 5, 64)
    with torch.no_grad():
        assert torch.equal(drafter.fc(features), features)


def capture(module: torch.nn.Module, store: list[torch.Tensor]):
    return module.register_forward_hook(lambda mod, args, out: store.append(out.detach()))


def context_kv(target: torch.nn.Module, tapped: int, ids: torch.Tensor):
    """Keys (after the per-head norm where the target has one, before RoPE) and values of the
    target's layer tapped + 1, and the drafter's first layer over the same context."""
    drafter, _ = drafter_for(target, [tapped])
    layer = target.model.layers[tapped + 1].self_attn
    theirs_k, theirs_v, ours_k, ours_v = [], [], [], []
    key_module = getattr(layer, "k_norm", layer.k_proj)
    ours = drafter.layers[0].self_attn
    hooks = [capture(key_module, theirs_k), capture(layer.v_proj, theirs_v),
             capture(ours.k_norm, ours_k), capture(ours.v_proj, ours_v)]
    try:
        with torch.no_grad():
            hidden = target(ids, output_hidden_states=True).hidden_states[tapped + 1]
            seq = ids.shape[1]
            block = target.get_input_embeddings()(torch.tensor([[7, 3, 3, 3]]))
            drafter(torch.arange(seq + 4)[None], block, hidden)
    finally:
        for hook in hooks:
            hook.remove()
    seq = ids.shape[1]
    return theirs_k[0], theirs_v[0], ours_k[0][:, :seq], ours_v[0], drafter


def test_context_keys_and_values_are_the_target_layers_own_qwen3():
    target = qwen3()
    ids = torch.randint(0, 256, (1, 9))
    their_k, their_v, our_k, our_v, drafter = context_kv(target, 1, ids)
    assert torch.allclose(our_k, their_k, atol=1e-6)
    assert torch.allclose(our_v, their_v, atol=1e-6)
    # Same RoPE at the same positions, so the rotated keys agree too.
    positions = torch.arange(9)[None]
    x = torch.zeros(1, 9, 64)
    for ours, theirs in zip(drafter.rotary_emb(x, positions), target.model.rotary_emb(x, positions)):
        assert torch.allclose(ours, theirs)


def test_context_values_identical_and_keys_head_normalised_llama():
    target = llama()
    ids = torch.randint(0, 256, (1, 9))
    their_k, their_v, our_k, our_v, _ = context_kv(target, 1, ids)
    assert torch.allclose(our_v, their_v, atol=1e-6)
    heads = their_k.view(1, 9, -1, 16)
    normalised = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + target.config.rms_norm_eps)
    assert torch.allclose(our_k, normalised, atol=1e-5)


def test_refused_without_a_next_layer_and_the_replaced_key_says_what_to_write():
    with pytest.raises(ConfigError, match="target layers 3..4"):
        drafter_for(llama(), [2], num_layers=2)
    with pytest.raises(ConfigError, match=r"model.init_from_target=True was replaced by "
                                          r"model.drafter_init: write model.drafter_init=last_layers"):
        load_config(None, ["model.init_from_target=true"])
    # What every earlier run's config.yaml holds still loads, and means a random init.
    assert load_config(None, ["model.init_from_target=false"]).model.drafter_init == "random"
    assert load_config(None, ["model.drafter_init=last_layers"]).model.drafter_init == "last_layers"


def test_a_checkpoint_saved_with_the_replaced_key_resumes_under_the_new_one():
    for old, now in ((False, "random"), (True, "last_layers")):
        saved = config_to_dict(load_config(None))
        saved["model"]["init_from_target"] = old
        current = config_to_dict(load_config(None, [f"model.drafter_init={now}"]))
        check_resume_compatible(upgrade_saved_config(saved), current)
        with pytest.raises(ResumeError, match=r"cannot resume: model\.(drafter_init|init_from_target)"):
            check_resume_compatible(saved, current)


def test_last_layers_copies_the_targets_last_layers():
    target = llama()
    cfg = ModelConfig(num_layers=1, block_size=4, target_layer_ids=[1], drafter_init="last_layers")
    drafter = build_drafter(cfg, target.config, mask_token_id=3)
    copied = initialise_drafter(drafter, target, cfg)
    assert "layers.0.mlp.up_proj.weight" in copied and "fc.weight" not in copied
    assert torch.equal(drafter.layers[0].mlp.up_proj.weight,
                       target.model.layers[-1].mlp.up_proj.weight)


def test_random_init_copies_nothing():
    target = llama()
    cfg = ModelConfig(num_layers=1, block_size=4, target_layer_ids=[1])
    drafter = build_drafter(cfg, target.config, mask_token_id=3)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    assert initialise_drafter(drafter, target, cfg) == []
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in before.items())
    assert init_drafter_from_target(drafter, target)  # the function itself always initialises
