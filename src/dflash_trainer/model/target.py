"""The frozen target: loading, hidden-state features for the drafter, shared embedding/LM head.

Features are captured with forward hooks on ``model.model.layers[L]`` (the output of decoder
layer L, i.e. HF ``hidden_states[L + 1]``), never with ``output_hidden_states``, so only the
requested layers are kept; when no final hidden state is needed the forward stops right after
the deepest requested layer. A layer id always means the raw layer output, as in the
reference; the last layer is refused (:func:`check_target_layer_ids`), because HF's
``hidden_states[-1]``, which inference reads for it, is taken after the final norm.

:func:`load_target` translates what transformers and safetensors raise on a folder without
weights, a truncated or damaged weight file or an unsupported architecture into one
:class:`~dflash_trainer.core.errors.TargetError` line naming the folder.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from torch import nn

from dflash_trainer.core.assets import first_line, load_tokenizer
from dflash_trainer.core.errors import ConfigError, TargetError

__all__ = ["FeatureExtractor", "TargetOutputs", "check_target_layer_ids", "decoder_layers", "greedy_next_tokens",
           "lm_head_weight", "input_embedding_weight", "load_target", "resolve_mask_token_id"]

LabelMode = Literal["data", "target_greedy", "kl"]


WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.index.json")
"""Files transformers loads weights from (an index names the shards)."""


def load_target(path: str, *, device: torch.device | str, dtype: torch.dtype) -> tuple[nn.Module, Any]:
    """Load an HF causal LM and its tokenizer; eval mode, every parameter frozen.

    A folder without weights, weights that do not load (truncated, damaged, not matching its
    config.json) or a model without the decoder layout raise :class:`TargetError`."""
    from transformers import AutoModelForCausalLM

    folder = Path(path)
    if folder.is_dir() and not any(any(folder.glob(p)) for p in WEIGHT_PATTERNS):
        present = ", ".join(sorted(p.name for p in folder.iterdir())[:6]) or "nothing"
        raise TargetError(f"target {path}: no model weights in the folder (model.safetensors, "
                          f"pytorch_model.bin or a sharded index; it holds {present}); copy the weights "
                          "into it or give the complete model folder")
    _refuse_non_causal(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except torch.OutOfMemoryError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError, KeyError, EOFError) as exc:
        raise TargetError(f"target {path}: the model does not load ({type(exc).__name__}: "
                          f"{first_line(exc)}); its weights are truncated, damaged or do not match its "
                          "config.json: copy or download the model again") from exc
    decoder_layers(model)
    tokenizer = load_tokenizer(path)
    check_vocabulary(model, tokenizer, path)
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer


def _refuse_non_causal(path: str) -> None:
    """TargetError when config.json names only architectures that are no causal LM (BERT's
    ``BertForMaskedLM``): transformers would build another head on top, or fail deep inside."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError):
        return  # from_pretrained below names what is wrong with the folder
    names = list(getattr(config, "architectures", None) or [])
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    if encoder_decoder or (names and not causal.intersection(names)):
        shape = ", an encoder-decoder" if encoder_decoder else ""
        raise TargetError(f"target {path}: not a decoder-only causal LM ({config.model_type}, architectures "
                          f"{', '.join(names) or 'unnamed'}{shape}); DFlash drafts for a decoder-only causal LM "
                          "(Llama, Qwen2, Qwen3, Mistral, ...)")


def check_vocabulary(model: nn.Module, tokenizer: Any, path: str) -> None:
    """TargetError when the tokenizer gives ids past the target's embedding table (its rows):
    the first such token would fail deep inside the forward with an IndexError."""
    rows = input_embedding_weight(model).shape[0]
    if len(tokenizer) > rows:
        raise TargetError(f"target {path}: its embedding has {rows} rows, but its tokenizer has {len(tokenizer)} "
                          f"tokens (ids up to {len(tokenizer) - 1}); the weights and the tokenizer come from "
                          "different models: give the tokenizer the weights were trained with")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """``model.model.layers`` of an HF decoder (Llama, Qwen2/3, Mistral, ...), or a clear error."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TargetError(f"target {type(model).__name__} is not a decoder-only causal LM with the Llama layout "
                          "(its decoder layers at model.model.layers): Llama, Qwen2, Qwen3, Mistral, ... are "
                          "supported")
    return layers


def input_embedding_weight(model: nn.Module) -> torch.Tensor:
    """The target's (frozen) input embedding matrix ``[V, H]``, shared, not copied."""
    return model.get_input_embeddings().weight


def lm_head_weight(model: nn.Module) -> torch.Tensor:
    """The target's (frozen) LM head ``[V, H]``; with tied embeddings this is the embedding matrix."""
    head = model.get_output_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) or head is None:
        return input_embedding_weight(model)
    if getattr(head, "bias", None) is not None:
        raise TargetError(f"target LM head {type(head).__name__} has a bias; DFlash supports bias-free heads")
    return head.weight


@dataclass(kw_only=True)
class TargetOutputs:
    """What one target forward gives the drafter step."""

    features: torch.Tensor
    """``[B, S, K*H]`` outputs of the requested layers, concatenated in list order."""
    target_labels: torch.Tensor | None = None
    """``[B, S]`` target greedy token for each position (argmax of the logits at position p-1);
    position 0 keeps the input token. Set for ``labels="target_greedy"``."""
    final_hidden: torch.Tensor | None = None
    """``[B, S, H]`` target final (post-norm) hidden states, for ``labels="kl"``."""


def check_target_layer_ids(layer_ids: Collection[int], num_layers: int) -> None:
    """Refuse (ConfigError) layer ids outside ``0..num_layers - 2``. The last layer is refused
    too: its hook sees the raw layer output, but inference servers take ``hidden_states[-1]``,
    which is after the final norm (a different scale), so training and serving would disagree.
    A list given twice over is refused by the config (``model.target_layer_ids``); the
    reference rule may tap a layer twice on a target with fewer layers than it spreads over."""
    if not layer_ids:
        raise ConfigError("model.target_layer_ids is empty: name at least one target layer, "
                          f"0..{num_layers - 2}")
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"model.target_layer_ids {bad} out of range for a target with "
                          f"{num_layers} layers: use ids 0..{num_layers - 2}")
    if num_layers - 1 in layer_ids:
        raise ConfigError(
            f"model.target_layer_ids [{num_layers - 1}] out of range: {num_layers - 1} is the target's "
            f"last layer; training hooks the raw output of layer L, while inference reads "
            f"hidden_states[L + 1], which for the last layer is taken after the final norm, so the "
            f"drafter would be served other features than it was trained on; pick layers below "
            f"{num_layers - 1} (0..{num_layers - 2})")


class _StopForward(Exception):
    """Raised by the deepest feature hook to skip the target layers nobody needs."""


class FeatureExtractor:
    """Hidden states of chosen target layers, captured by forward hooks under ``torch.no_grad``.

    The hooks are registered once and stay inert unless the calling thread is inside
    :meth:`__call__`, so other users of the same target (evaluation, another thread) are not
    affected. Call :meth:`close` to remove them. One thread at a time per extractor.
    Inputs must be right-padded: with causal attention real positions never see the padding.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], *, labels: LabelMode = "data",
                 label_chunk_size: int = 1024) -> None:
        layers = decoder_layers(model)
        check_target_layer_ids(layer_ids, len(layers))
        self.model = model
        self.layer_ids = list(layer_ids)
        self.labels = labels
        self.label_chunk_size = label_chunk_size
        self._local = threading.local()
        self._stop_after = max(self.layer_ids)
        self._handles = [layers[i].register_forward_hook(self._make_hook(i)) for i in sorted(set(layer_ids))]

    @property
    def embed_weight(self) -> torch.Tensor:
        """The target's input embedding ``[V, H]`` (frozen, shared)."""
        return input_embedding_weight(self.model)

    @property
    def head_weight(self) -> torch.Tensor:
        """The target's LM head ``[V, H]`` (frozen, shared; the embedding when tied)."""
        return lm_head_weight(self.model)

    def _make_hook(self, layer_id: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            captured = getattr(self._local, "captured", None)
            if captured is None:
                return
            captured[layer_id] = output[0] if isinstance(output, tuple) else output
            if self._local.stop_early and layer_id == self._stop_after:
                raise _StopForward
        return hook

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> TargetOutputs:
        """Run the target on ``[B, S]`` ids; features (and labels/final states if configured)."""
        # no_grad, not inference_mode: the features are saved for the drafter's backward.
        need_final = self.labels in ("target_greedy", "kl")
        self._local.captured = {}
        self._local.stop_early = not need_final
        final_hidden = None
        try:
            out = self.model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            final_hidden = out.last_hidden_state
        except _StopForward:
            pass
        finally:
            captured, self._local.captured = self._local.captured, None
        features = torch.cat([captured[i] for i in self.layer_ids], dim=-1)
        if self.labels == "target_greedy":
            labels = greedy_next_tokens(final_hidden, self.head_weight, input_ids, self.label_chunk_size)
            return TargetOutputs(features=features, target_labels=labels)
        if self.labels == "kl":
            return TargetOutputs(features=features, final_hidden=final_hidden)
        return TargetOutputs(features=features)

    def close(self) -> None:
        """Remove the hooks from the target."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def greedy_next_tokens(final_hidden: torch.Tensor, head_weight: torch.Tensor, input_ids: torch.Tensor,
                       chunk_size: int) -> torch.Tensor:
    """``out[:, p] = argmax(head @ final_hidden[:, p - 1])`` for p >= 1; ``out[:, 0] = input_ids[:, 0]``
    (no position predicts the first token, and it is never a label).

    The target's logits at position p predict token p + 1, so the greedy label of position p
    comes from position p - 1. Costs one LM-head matmul per position (as the target's own
    forward would), computed ``chunk_size`` positions at a time so ``[S, V]`` never exists.
    """
    batch, seq, hidden = final_hidden.shape
    flat = final_hidden.reshape(batch * seq, hidden)
    preds = torch.empty(batch * seq, dtype=torch.long, device=final_hidden.device)
    for start in range(0, batch * seq, chunk_size):
        preds[start:start + chunk_size] = (flat[start:start + chunk_size] @ head_weight.T).argmax(dim=-1)
    preds = preds.view(batch, seq)
    labels = torch.empty_like(preds)
    labels[:, 0] = input_ids[:, 0]
    labels[:, 1:] = preds[:, :-1]
    return labels


def resolve_mask_token_id(tokenizer: Any, num_embeddings: int, explicit: int | None = None,
                          forbidden_in_data: Collection[int] | None = None) -> int:
    """Mask token id inside the target's embedding table; never resizes the embedding.

    Order: ``explicit`` > the tokenizer's mask token > the first embedding row with no token
    (``len(tokenizer)``, as for Qwen3: 151669) > the highest-id added token that is not a
    special token of the tokenizer (SmolLM2: 16 ``<empty_output>``). Every choice must be
    < ``num_embeddings``, must not be eos/pad/bos and must not occur in ``forbidden_in_data``
    (ids seen in the training data); an explicit id that breaks a rule raises ValueError.
    """
    eos = tokenizer.eos_token_id
    reserved = {i for i in ([*eos] if isinstance(eos, (list, tuple)) else [eos])
                + [tokenizer.pad_token_id, tokenizer.bos_token_id] if i is not None}
    data_ids = set(forbidden_in_data or ())

    def problem(token_id: int) -> str | None:
        if not 0 <= token_id < num_embeddings:
            return f"it is outside the target embedding table ({num_embeddings} rows; never resized)"
        if token_id in reserved:
            return "it is the eos/pad/bos token (generation would stop or misread it)"
        if token_id in data_ids:
            return "it occurs in the training data"
        return None

    if explicit is not None:
        reason = problem(explicit)
        if reason:
            raise ConfigError(f"model.mask_token_id={explicit} cannot be used: {reason}; choose an unused "
                             f"token id below {num_embeddings} or leave model.mask_token_id unset")
        return explicit
    candidates = []
    if tokenizer.mask_token_id is not None:
        candidates.append(tokenizer.mask_token_id)
    candidates.append(len(tokenizer))
    special = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    candidates += sorted((i for i in added if i not in special), reverse=True)
    for token_id in candidates:
        if problem(token_id) is None:
            return token_id
    raise ConfigError(f"no usable mask token: the tokenizer has no mask token, no free embedding row "
                     f"(len(tokenizer)={len(tokenizer)}, {num_embeddings} rows) and no unused added token; "
                     f"set model.mask_token_id to a token id below {num_embeddings} that is not "
                     f"eos/pad/bos and does not occur in the data")
