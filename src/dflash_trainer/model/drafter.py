"""Build a DFlash drafter for a target model from the run config, and check that a drafter
fits a target.

The module itself lives in :mod:`dflash_trainer.model.modeling.dflash` (the file exported next
to the weights); this module only derives its config from the target's.

A drafter has no embedding and no LM head of its own: it runs on its target's, so it only works
with the target it was trained for. Its config records that target under
:data:`SIGNATURE_KEY` (vocabulary size, hidden size and a fingerprint of the tokenizer's chat
template and special ids, see :func:`target_signature`), and :func:`check_compatible` refuses a
target that differs in any of them. Drafters exported before the record existed are checked
on their shapes only.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, Qwen3Config

from dflash_trainer.config import ModelConfig
from dflash_trainer.core.errors import ConfigError
from dflash_trainer.model.modeling.dflash import (
    DFlashDraftModel,
    build_target_layer_ids,
)
from dflash_trainer.model.target import check_target_layer_ids, decoder_layers
from dflash_trainer.model.variants import drafter_class, get_variant, variant_of

__all__ = ["FINAL_NORM_SCALE", "SIGNATURE_KEY", "DFlashDraftModel",
           "build_drafter", "build_drafter_config", "check_compatible", "default_target_layer_ids",
           "drafter_class", "drafter_variant", "init_drafter_from_target",
           "init_from_last_layers", "set_draft_vocab", "tapped_layer_ids", "target_signature",
           "text_config", "tokenizer_signature"]

log = logging.getLogger(__name__)

SIGNATURE_KEY = "dflash_trainer"
"""Top-level ``config.json`` key (a drafter config attribute) holding :func:`target_signature`
of the target the drafter was built for. Outside ``dflash_config``, which z-lab, SGLang and
vLLM read; transformers keeps unknown top-level keys as config attributes."""
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id")


def drafter_variant(config: PretrainedConfig) -> str:
    """The name (``model.variant``) of the variant a drafter config describes, by its
    ``architectures`` (:func:`~dflash_trainer.model.variants.variant_of`)."""
    return variant_of(config).name


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs condition the drafter, by the reference rule.

    One feature: the middle layer; otherwise ``round(1 + i * (n_target - 4) / (n_draft - 1))``
    with Python's round-half-to-even (36 layers, 5 features -> [1, 9, 17, 25, 33]).
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(f"need >= 1 target and draft layers, got {num_target_layers}, {num_draft_layers}")
    return build_target_layer_ids(num_target_layers, num_draft_layers)


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder text config of a (possibly multimodal) HF config."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def tokenizer_signature(tokenizer: Any) -> dict[str, Any]:
    """What a drafter depends on in its target's tokenizer: the chat template (its sha256: the
    prompts it was trained on were rendered with it) and the special ids (bos/eos/pad end or
    fill generations; the mask token may be the drafter's mask id); ``sha256`` covers them all."""
    template = getattr(tokenizer, "chat_template", None)
    template_text = template if isinstance(template, str) or template is None else json.dumps(
        template, sort_keys=True)
    ids = {}
    for name in _SPECIAL_IDS:
        value = getattr(tokenizer, name, None)
        ids[name] = list(value) if isinstance(value, (list, tuple)) else value
    template_sha = None if template_text is None else hashlib.sha256(template_text.encode()).hexdigest()
    whole = json.dumps({"chat_template_sha256": template_sha, **ids}, sort_keys=True)
    return {"sha256": hashlib.sha256(whole.encode()).hexdigest(), "chat_template_sha256": template_sha, **ids}


def target_signature(target_config: PretrainedConfig, tokenizer: Any = None) -> dict[str, Any]:
    """The target a drafter is built for: ``vocab_size``, ``hidden_size`` and (given the
    tokenizer) ``tokenizer``: :func:`tokenizer_signature`. Stored under :data:`SIGNATURE_KEY`."""
    target = text_config(target_config)
    signature: dict[str, Any] = {"vocab_size": int(target.vocab_size), "hidden_size": int(target.hidden_size)}
    if tokenizer is not None:
        signature["tokenizer"] = tokenizer_signature(tokenizer)
    return signature


def _rope_parameters(target: PretrainedConfig) -> dict[str, Any]:
    # transformers 5 keeps rope settings in rope_parameters; 4.x configs have rope_theta/rope_scaling.
    params = getattr(target, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(target, "rope_scaling", None) or {"rope_type": "default"})
    params.setdefault("rope_type", params.pop("type", "default"))
    params["rope_theta"] = float(getattr(target, "rope_theta", 10000.0))
    return params


def tapped_layer_ids(model_cfg: ModelConfig, num_target_layers: int) -> list[int]:
    """The target layers a drafter of ``model_cfg`` taps: ``model.target_layer_ids``, else the
    reference rule (:func:`default_target_layer_ids`); checked against the target's layers."""
    layer_ids = (list(model_cfg.target_layer_ids) if model_cfg.target_layer_ids is not None
                 else default_target_layer_ids(num_target_layers, model_cfg.num_layers))
    if model_cfg.target_layer_ids is None and len(set(layer_ids)) < len(layer_ids):
        fits = max(n for n in range(1, model_cfg.num_layers)
                   if len(set(default_target_layer_ids(num_target_layers, n))) == n)
        raise ConfigError(f"model.num_layers={model_cfg.num_layers}: the reference rule would tap the target's "
                          f"layers {layer_ids}, one of them twice (a {num_target_layers}-layer target has too few "
                          f"layers to spread {model_cfg.num_layers} taps over); set model.num_layers={fits}"
                          f"{' or less' if fits > 1 else ''}, or name distinct layers with model.target_layer_ids")
    check_target_layer_ids(layer_ids, num_target_layers)
    return layer_ids


def build_drafter_config(model_cfg: ModelConfig, target_config: PretrainedConfig, *,
                         mask_token_id: int | None = None, tokenizer: Any = None) -> Qwen3Config:
    """Qwen3-style drafter config: per-layer sizes from the target unless ``model.*`` overrides them.

    The config records :func:`target_signature` of the target (with ``tokenizer``, its
    fingerprint too), which :func:`check_compatible` compares before the drafter is used."""
    target = text_config(target_config)
    num_target_layers = int(target.num_hidden_layers)
    layer_ids = tapped_layer_ids(model_cfg, num_target_layers)
    mask_id = mask_token_id if mask_token_id is not None else model_cfg.mask_token_id
    if mask_id is None:
        raise ValueError("model.mask_token_id is not set: resolve it with "
                         "dflash_trainer.model.target.resolve_mask_token_id and pass mask_token_id=")
    heads = model_cfg.num_attention_heads or target.num_attention_heads
    kv_heads = (model_cfg.num_key_value_heads or getattr(target, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        raise ConfigError(
            f"the drafter's {heads} attention heads (model.num_attention_heads"
            f"{'' if model_cfg.num_attention_heads else ', from the target'}) are not a multiple of its "
            f"{kv_heads} key/value heads (model.num_key_value_heads"
            f"{'' if model_cfg.num_key_value_heads else ', from the target'}): each key/value head serves "
            "a whole group of query heads; set model.num_attention_heads to a multiple of "
            "model.num_key_value_heads")
    head_dim = (model_cfg.head_dim or getattr(target, "head_dim", None)
                or target.hidden_size // target.num_attention_heads)
    rope = _rope_parameters(target)
    config = Qwen3Config(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=model_cfg.intermediate_size or target.intermediate_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act=getattr(target, "hidden_act", "silu"),
        max_position_embeddings=getattr(target, "max_position_embeddings", 32768),
        rms_norm_eps=getattr(target, "rms_norm_eps", 1e-6),
        rope_parameters=rope,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        layer_types=["full_attention"] * model_cfg.num_layers,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=getattr(target, "bos_token_id", None),
        eos_token_id=getattr(target, "eos_token_id", None),
        pad_token_id=getattr(target, "pad_token_id", None),
        block_size=model_cfg.block_size,
        num_target_layers=num_target_layers,
        dflash_config={"mask_token_id": int(mask_id), "target_layer_ids": layer_ids,
                       "block_size": model_cfg.block_size},
    )
    variant = get_variant(model_cfg.variant)
    config.architectures = [variant.architecture]
    for key, value in variant.config_fields().items():
        setattr(config, key, value)
    config.dflash_config.update(variant.settings(model_cfg, target))
    draft_vocab = model_cfg.draft_vocab_size
    if draft_vocab is not None:
        if not variant.prunes_vocab:
            raise ConfigError(f"model.draft_vocab_size: {variant.title} drafters draft from the target's whole "
                              "vocabulary; remove model.draft_vocab_size or choose another model.variant")
        if draft_vocab > target.vocab_size:
            raise ConfigError(f"model.draft_vocab_size {draft_vocab} is above the target's vocabulary "
                              f"({target.vocab_size} tokens); set it lower, or remove it for the whole vocabulary")
        if draft_vocab < target.vocab_size:
            config.draft_vocab_size = draft_vocab
    setattr(config, SIGNATURE_KEY, target_signature(target_config, tokenizer))
    check_compatible(config, target_config)
    return config


def check_compatible(drafter_config: PretrainedConfig, target_config: PretrainedConfig, *,
                     tokenizer: Any = None) -> None:
    """Raise :class:`ConfigError` (a ValueError), one line naming every problem, when a drafter
    config cannot run on a target: hidden size, vocabulary, layer ids, mask id, heads, and (given
    the target's ``tokenizer`` and a drafter that recorded one) the tokenizer's chat template and
    special ids. Callers that load a saved drafter say which folder and what to do."""
    target = text_config(target_config)
    section = getattr(drafter_config, "dflash_config", None) or {}
    problems = []
    if drafter_config.hidden_size != target.hidden_size:
        problems.append(f"hidden size: drafter {drafter_config.hidden_size}, target {target.hidden_size} "
                        f"(DFlash needs equal hidden sizes: the target's embedding and LM head are used "
                        f"as they are)")
    drafter_vocab = getattr(drafter_config, "vocab_size", None)
    if drafter_vocab is not None and drafter_vocab != target.vocab_size:
        problems.append(f"vocabulary: the drafter was trained for {drafter_vocab} tokens, the target has "
                        f"{target.vocab_size} (vocab_size): its drafts would be scored by another "
                        "embedding and LM head")
    bad = [i for i in section.get("target_layer_ids", []) if not 0 <= i < target.num_hidden_layers]
    if bad:
        problems.append(f"model.target_layer_ids {bad} out of range for a target with "
                        f"{target.num_hidden_layers} layers (valid: 0..{target.num_hidden_layers - 1})")
    mask_id = section.get("mask_token_id")
    if mask_id is not None and not 0 <= mask_id < target.vocab_size:
        problems.append(f"mask_token_id {mask_id} is outside the target's embedding table "
                        f"({target.vocab_size} rows); the embedding is never resized")
    if drafter_config.num_attention_heads % drafter_config.num_key_value_heads:
        problems.append(f"num_attention_heads {drafter_config.num_attention_heads} is not a multiple "
                        f"of num_key_value_heads {drafter_config.num_key_value_heads}")
    recorded = (getattr(drafter_config, SIGNATURE_KEY, None) or {}).get("tokenizer")
    if tokenizer is not None and recorded:
        problems += _tokenizer_differences(recorded, tokenizer_signature(tokenizer))
    if problems:
        raise ConfigError("drafter/target mismatch: " + "; ".join(problems))


def _tokenizer_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    if recorded.get("sha256") == current["sha256"]:
        return []
    differences = []
    if recorded.get("chat_template_sha256") != current["chat_template_sha256"]:
        differences.append("the chat template differs (the drafter learned the answers of prompts "
                           "rendered with another one)")
    differences += [f"{name} {recorded.get(name)} (drafter's target) vs {current[name]} (this target)"
                    for name in _SPECIAL_IDS if recorded.get(name) != current[name]]
    return [f"tokenizer: {', '.join(differences or ['its fingerprint differs'])}"]


def build_drafter(model_cfg: ModelConfig, target_config: PretrainedConfig, *,
                  mask_token_id: int | None = None, tokenizer: Any = None) -> DFlashDraftModel:
    """A freshly initialised drafter (fp32, SDPA attention) for ``target_config``: the modeling
    class of ``model.variant`` (a :class:`DFlashDraftModel` or a subclass), its modules at their
    identity-safe init.

    ``mask_token_id`` overrides ``model_cfg.mask_token_id``; one of them must be set. With the
    target's ``tokenizer`` its fingerprint is recorded in the config (and so in every export).
    """
    config = build_drafter_config(model_cfg, target_config, mask_token_id=mask_token_id,
                                  tokenizer=tokenizer)
    config._attn_implementation = "sdpa"
    return drafter_class(config)(config)


@torch.no_grad()
def set_draft_vocab(drafter: DFlashDraftModel, token_ids: Sequence[int] | torch.Tensor,
                    target_head_weight: torch.Tensor) -> None:
    """Give a drafter with a pruned draft vocabulary its tokens (target ids, ascending): the
    ``d2t`` table and the target LM head's rows of those tokens."""
    if drafter.lm_head is None or drafter.d2t is None:
        raise ValueError("this drafter drafts from the whole vocabulary (no draft_vocab_size)")
    ids = torch.as_tensor(token_ids, dtype=torch.long).to(drafter.d2t.device)
    if ids.shape != drafter.d2t.shape or bool((ids[1:] <= ids[:-1]).any()):
        raise ValueError(f"a draft vocabulary needs {drafter.draft_vocab_size} distinct ascending token ids, "
                         f"got {ids.numel()}")
    drafter.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
    rows = target_head_weight.detach().index_select(0, ids.to(target_head_weight.device))
    drafter.lm_head.weight.copy_(rows.to(drafter.lm_head.weight))


@torch.no_grad()
def init_from_last_layers(drafter: DFlashDraftModel, target_model: nn.Module) -> list[str]:
    """``model.drafter_init=last_layers``: copy the target's last decoder layers into the
    drafter layers where names and shapes match.

    Drafter layer i takes target layer ``n_target - n_draft + i``. The drafter's ``fc``,
    ``hidden_norm`` and ``norm`` keep their fresh initialisation. Returns the copied names.
    """
    target_layers = decoder_layers(target_model)
    offset = len(target_layers) - len(drafter.layers)
    if offset < 0:
        raise ConfigError(f"model.drafter_init=last_layers copies the target's last layers, but the drafter has "
                          f"{len(drafter.layers)} layers (model.num_layers) and the target only "
                          f"{len(target_layers)}; set model.num_layers <= {len(target_layers)}")
    copied = []
    for i, layer in enumerate(drafter.layers):
        source = dict(target_layers[offset + i].named_parameters())
        for name, param in layer.named_parameters():
            if name in source and source[name].shape == param.shape:
                param.copy_(source[name].to(param.dtype))
                copied.append(f"layers.{i}.{name}")
    return copied


_WIDENED_MLP = {"mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0, "mlp.down_proj.weight": 1}
"""MLP weights and their intermediate-size axis, for a drafter MLP wider than the target's."""


def _copy_matching(dest: nn.Module, source: nn.Module, prefix: str, copied: list[str],
                   skipped: list[str]) -> None:
    """Copy ``source``'s parameters into ``dest``'s of the same name and shape.

    A wider MLP (``model.intermediate_size`` above the target's) takes the target's units as
    its first ones; the extra units keep their fresh input weights and get zero output
    weights, so the layer starts as the target's exactly and the extra units still learn.
    """
    available = dict(source.named_parameters())
    for name, param in dest.named_parameters():
        origin = available.get(name)
        axis = _WIDENED_MLP.get(name)
        if origin is not None and origin.shape == param.shape:
            param.copy_(origin.to(param.dtype))
            copied.append(prefix + name)
        elif (origin is not None and axis is not None and origin.dim() == param.dim()
              and origin.shape[1 - axis] == param.shape[1 - axis] and origin.shape[axis] < param.shape[axis]):
            if axis == 1:
                param.zero_()
            param.narrow(axis, 0, origin.shape[axis]).copy_(origin.to(param.dtype))
            copied.append(f"{prefix}{name} (first {origin.shape[axis]} of {param.shape[axis]} units)")
        else:
            skipped.append(prefix + name)


FINAL_NORM_SCALE = 0.2
"""Scale on the target's final-norm weights in ``model.drafter_init=target``. The copied layer
sees token embeddings, not the target's deep residual stream, so its output under the
target's own final norm gives confident wrong predictions: on SmolLM2 (8 samples x 64 anchors,
KL labels, before any step) KL 15.2 with the norm as it is, 8.4 / 7.3 / 8.0 at 0.5 / 0.2 /
0.1 times it, 10.2 for a random init; slot-1 agreement 6/512 in every scaled case."""


@torch.no_grad()
def init_drafter_from_target(drafter: DFlashDraftModel, target_model: nn.Module) -> list[str]:
    """``model.drafter_init=target``: start the drafter as the target's next layer(s) after the
    last tapped layer L, so its first attention over the context is the target's layer L+1.

    * ``fc`` selects the features of layer L (identity on its block of the concatenated
      features, zero on the other tapped layers', which stay trainable), so the context is
      ``h_L``, the input of target layer L+1;
    * ``hidden_norm`` = layer L+1's ``input_layernorm``: the drafter's context keys and values
      are ``k_proj``/``v_proj`` of ``hidden_norm(fc(h))`` (they do not pass the layer's own
      input norm), so together they are layer L+1's normalised input;
    * drafter layer i = target layer L+1+i (attention projections, QK norms where the target
      has them, MLP, both layer norms); the final ``norm`` = the target's final norm (which
      feeds the same LM head) times :data:`FINAL_NORM_SCALE`: the same argmax, but the first
      predictions are not as confident as the target's own (see there).

    Identical to the target's layer L+1 on the context, for drafter layer 0: the keys (after
    RoPE) and values of every context position, when the target has per-head QK norms
    (Qwen3); for targets without them (Llama, Mistral, Qwen2) the values are identical and the
    keys are the target's keys RMS-normalised per head (the drafter's ``k_norm`` has no
    counterpart there), and attention biases (Qwen2) are not copied (the drafter has none).
    Not identical by construction: the block's own stream starts from token embeddings (the
    anchor and mask tokens), not from ``h_L``, so its queries and the block tokens' keys are
    the layer applied to embeddings; drafter layers after the first see the same context
    normalised by layer L+1's norm, not their own layer's input. Returns the copied names.
    """
    target_layers = decoder_layers(target_model)
    last = max(drafter.target_layer_ids)
    first, needed = last + 1, len(drafter.layers)
    if first + needed > len(target_layers):
        raise ConfigError(
            f"model.drafter_init=target copies target layers {first}..{first + needed - 1} after the "
            f"last tapped layer {last} (model.target_layer_ids), but the target has "
            f"{len(target_layers)} layers; tap an earlier layer or use fewer drafter layers")
    hidden = drafter.config.hidden_size
    blocks = len(drafter.target_layer_ids)
    position = len(drafter.target_layer_ids) - 1 - drafter.target_layer_ids[::-1].index(last)
    fc = torch.zeros(hidden, blocks * hidden, dtype=drafter.fc.weight.dtype, device=drafter.fc.weight.device)
    fc[:, position * hidden:(position + 1) * hidden] = torch.eye(hidden, dtype=fc.dtype, device=fc.device)
    drafter.fc.weight.copy_(fc)
    copied, skipped = ["fc.weight"], []
    _copy_matching(drafter.hidden_norm, target_layers[first].input_layernorm, "hidden_norm.", copied, skipped)
    for i, layer in enumerate(drafter.layers):
        _copy_matching(layer, target_layers[first + i], f"layers.{i}.", copied, skipped)
    final_norm = getattr(getattr(target_model, "model", None), "norm", None)
    if isinstance(final_norm, nn.Module):
        _copy_matching(drafter.norm, final_norm, "norm.", copied, skipped)
        drafter.norm.weight.mul_(FINAL_NORM_SCALE)
    else:
        skipped.append("norm.weight")
    if skipped:
        log.info("model.drafter_init=target: kept the fresh initialisation of %s (no target "
                 "parameter of that name and shape)", ", ".join(skipped))
    return copied
