"""DFlash block-diffusion drafter (z-lab ``DFlashDraftModel`` format), standalone.

This file imports only torch, transformers and the standard library, so it can be copied next
to an exported ``config.json`` and loaded with ``AutoModel.from_pretrained(dir,
trust_remote_code=True)``. The trainer imports the same class, so training and serving run one
definition of the module.

The drafter has no embedding and no LM head: both are the target's, frozen (with a pruned draft
vocabulary, ``draft_vocab_size``, it keeps the target head's rows of its tokens). It drafts a block
``[anchor token, MASK x (B-1)]`` in one forward pass, conditioned on target hidden states
(``fc`` over the concatenated target layers, then ``hidden_norm``) that every layer projects
with its own ``k_proj``/``v_proj`` and prepends to the block's keys and values.

Two forward modes share one code path:

* training: ``target_hidden`` covers the whole sequence, ``noise_embedding`` holds N blocks, and
  ``attention_mask`` (dense bool ``[B, 1, Q, C + Q]`` or a FlexAttention ``BlockMask``) says
  which context positions and block tokens each query sees;
* inference: ``target_hidden`` holds only the committed tokens not yet in ``past_key_values``;
  the cache stores context K/V only (block K/V is used but never stored), so no cropping of the
  draft cache is needed after a draft; no mask, the block is bidirectional.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Config,
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

try:  # transformers >= 5: init helpers that skip parameters already loaded from a checkpoint
    from transformers import initialization as _init
except ImportError:  # transformers 4.x initialises before loading, so plain torch init is right
    _init = nn.init

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch without FlexAttention: only dense masks are available
    BlockMask = None
    flex_attention = None

_compiled_flex_attention = None


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default target layers for a drafter (z-lab rule, Python's round-half-to-even)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def dflash_value(config: Any, name: str, default: Any = None) -> Any:
    """Read a DFlash setting from ``config.dflash_config`` first, then the top level."""
    section = getattr(config, "dflash_config", None) or {}
    if name in section and section[name] is not None:
        return section[name]
    value = getattr(config, name, None)
    return default if value is None else value


def extract_context_feature(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """Concatenate HF ``output_hidden_states`` of the given decoder layers (layer L = index L + 1)."""
    return torch.cat([hidden_states[layer_id + 1] for layer_id in layer_ids], dim=-1)


def _flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any,
          scale: float) -> torch.Tensor:
    global _compiled_flex_attention
    fn = flex_attention
    if query.is_cuda:
        # Uncompiled flex attention materialises the full score matrix; compile once per process.
        if _compiled_flex_attention is None:
            _compiled_flex_attention = torch.compile(flex_attention)
        fn = _compiled_flex_attention
    return fn(query, key, value, block_mask=block_mask, scale=scale,
              enable_gqa=query.shape[1] != key.shape[1])


def _eager(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    if mask is not None:
        # Additive -inf mask: a bool mask added to the scores would mask nothing.
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(probs, value)


@dataclass(frozen=True)
class BlockLayout:
    """The training visibility rule in factored form, for attention without a dense mask.

    Keys are ``[context (context_len) | block_0 | ... | block_{N-1}]`` and queries the blocks:
    block j sees context keys ``< anchors[b, j]`` and its own ``block_size`` keys; a block
    with ``keep`` False contributes a zero attention output. Equal to the dense mask of
    ``dflash_trainer.model.blocks.dense_block_mask`` but costs ``Q x (context_len + block_size)``
    scores instead of ``Q x (context_len + Q)``: most of a dense mask is other blocks' keys.
    """

    anchors: torch.Tensor
    keep: torch.Tensor
    context_len: int
    block_size: int


def _blockwise(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: BlockLayout,
               scale: float) -> torch.Tensor:
    batch, heads, q_len, dim = query.shape
    kv_heads, ctx, size = key.shape[1], layout.context_len, layout.block_size
    # Queries may be a subset of each block's slots (output_slots): `rows` per block, while
    # the keys are always the whole blocks.
    groups, num = heads // kv_heads, layout.anchors.shape[1]
    rows = q_len // num
    # The scale goes on the [Q, D] queries, not on the [Q, ctx + B] scores.
    query = query * scale
    # GQA without repeating K/V: query head h uses K/V head h // groups.
    q = query.reshape(batch, kv_heads, groups * q_len, dim)
    ctx_scores = torch.matmul(q, key[:, :, :ctx].transpose(-1, -2)).view(batch, kv_heads, groups, num, rows, ctx)
    unseen = torch.arange(ctx, device=query.device)[None, None, :] >= layout.anchors[:, :, None]
    ctx_scores = ctx_scores.masked_fill(unseen[:, None, None, :, None, :], float("-inf"))
    q_blocks = query.view(batch, kv_heads, groups, num, rows, dim)
    k_blocks = key[:, :, ctx:].reshape(batch, kv_heads, 1, num, size, dim)
    v_blocks = value[:, :, ctx:].reshape(batch, kv_heads, 1, num, size, dim)
    own_scores = torch.matmul(q_blocks, k_blocks.transpose(-1, -2))
    # Softmax in the scores' dtype: the CPU and CUDA kernels accumulate bf16 in float32, so an
    # explicit upcast and downcast only added full-size copies (13% of a bf16 CPU step with the
    # LM head's). split, not two slices: its backward writes one gradient, not two zero-filled ones.
    probs = torch.softmax(torch.cat([ctx_scores, own_scores], dim=-1), dim=-1)
    ctx_probs, own_probs = probs.split([ctx, size], dim=-1)
    from_ctx = torch.matmul(ctx_probs.reshape(batch, kv_heads, groups * q_len, ctx), value[:, :, :ctx])
    out = from_ctx.view(batch, kv_heads, groups, num, rows, dim) + torch.matmul(own_probs, v_blocks)
    out = out * layout.keep[:, None, None, :, None, None].to(out.dtype)
    return out.view(batch, heads, q_len, dim)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, scale: float,
           implementation: str | None) -> torch.Tensor:
    """Attention over ``[B, H, L, D]`` tensors (GQA allowed) with no mask, a bool mask, a
    :class:`BlockLayout` or a BlockMask."""
    if isinstance(mask, BlockLayout):
        return _blockwise(query, key, value, mask, scale)
    if BlockMask is not None and isinstance(mask, BlockMask):
        return _flex(query, key, value, mask, scale)
    if implementation == "eager":
        return _eager(query, key, value, mask, scale)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                          enable_gqa=query.shape[1] != key.shape[1])


def block_slots(x: torch.Tensor, dim: int, block_size: int, slots: int) -> torch.Tensor:
    """Slots ``1..slots`` of every block along ``dim`` (of length ``N * block_size``)."""
    return x.unflatten(dim, (-1, block_size)).narrow(dim + 1, 1, slots).flatten(dim, dim + 1)


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values are ``[projected context | block]``; queries are the block."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.block_size = int(dflash_value(config, "block_size", 16))
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, context: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: Any,
                past_key_values: Any = None, query_slots: int | None = None) -> torch.Tensor:
        batch = hidden_states.shape[0]
        ctx_len = context.shape[1]
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        q_cos, q_sin = cos[..., ctx_len:, :], sin[..., ctx_len:, :]
        queries = hidden_states
        # A dense mask is sliced like the queries; a FlexAttention BlockMask is built for whole
        # blocks, so with one the rows are selected after attention (o_proj and MLP still run
        # on them only).
        select_late = query_slots is not None and BlockMask is not None and isinstance(attention_mask, BlockMask)
        if query_slots is not None and not select_late:
            size = self.block_size
            queries = block_slots(hidden_states, 1, size, query_slots)
            q_cos, q_sin = block_slots(q_cos, 2, size, query_slots), block_slots(q_sin, 2, size, query_slots)
            if isinstance(attention_mask, torch.Tensor):
                attention_mask = block_slots(attention_mask, 2, size, query_slots)

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, x.shape[1], -1, self.head_dim)

        query = self.q_norm(heads(self.q_proj(queries))).transpose(1, 2)
        query = query * q_cos + rotate_half(query) * q_sin
        key = self.k_norm(heads(torch.cat([self.k_proj(context), self.k_proj(hidden_states)], 1)))
        key = key.transpose(1, 2)
        key = key * cos + rotate_half(key) * sin
        value = heads(torch.cat([self.v_proj(context), self.v_proj(hidden_states)], 1)).transpose(1, 2)
        if past_key_values is not None:
            # Only context K/V enter the cache; block K/V are used for this call and dropped.
            ctx_key, ctx_value = past_key_values.update(key[:, :, :ctx_len], value[:, :, :ctx_len],
                                                        self.layer_idx)
            key = torch.cat([ctx_key, key[:, :, ctx_len:]], dim=2)
            value = torch.cat([ctx_value, value[:, :, ctx_len:]], dim=2)
        # Under autocast the fp32 norm weights promote q/k to fp32 while v stays low precision.
        query, key = query.to(value.dtype), key.to(value.dtype)
        out = attend(query, key, value, attention_mask, self.scaling, self.config._attn_implementation)
        out = out.transpose(1, 2).reshape(batch, query.shape[2], -1)
        if select_late:
            out = block_slots(out, 1, self.block_size, query_slots)
        return self.o_proj(out)


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer around :class:`DFlashAttention`."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, context: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: Any,
                row_visible: torch.Tensor | None, past_key_values: Any = None,
                query_slots: int | None = None) -> torch.Tensor:
        """The layer's output for every block row, or with ``query_slots=K`` for block slots
        1..K only (keys and values still come from every row)."""
        attn = self.self_attn(self.input_layernorm(hidden_states), context, position_embeddings,
                              attention_mask, past_key_values, query_slots)
        if query_slots is not None:
            size = self.self_attn.block_size
            hidden_states = block_slots(hidden_states, 1, size, query_slots)
            if row_visible is not None:
                row_visible = block_slots(row_visible, 1, size, query_slots)
        if row_visible is not None:
            attn = attn * row_visible
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DraftHead(nn.Module):
    """The LM head of a pruned draft vocabulary: the target head's rows of the draft tokens,
    ``weight`` ``[draft_vocab_size, H]``. A buffer, not a parameter: it stays the target's rows
    (the drafter learns states the target's head reads), no optimizer or gradient reduction
    carries it, and FSDP leaves it whole on every rank."""

    def __init__(self, rows: int, hidden_size: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(rows, hidden_size))


class DFlashDraftModel(PreTrainedModel):
    """DFlash drafter: ``layers.{i}``, ``fc``, ``hidden_norm``, ``norm``, ``rotary_emb``; with
    ``draft_vocab_size`` below ``vocab_size`` (a pruned draft vocabulary) also ``lm_head``
    (:class:`DraftHead`) and ``d2t``.

    Reads ``block_size``, ``target_layer_ids`` and ``mask_token_id`` from
    ``config.dflash_config`` first, then from the top level of the config.
    """

    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    layer_class: type[nn.Module] = DFlashDecoderLayer
    """The decoder layer; a variant may wrap its sublayers differently."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise NotImplementedError(f"DFlashDraftModel supports full-attention layers only; "
                                      f"config.layer_types = {layer_types}")
        layer_ids = dflash_value(config, "target_layer_ids")
        if layer_ids is None:
            num_target_layers = getattr(config, "num_target_layers", None)
            if num_target_layers is None:
                raise ValueError("DFlash config needs dflash_config.target_layer_ids or num_target_layers")
            layer_ids = build_target_layer_ids(num_target_layers, config.num_hidden_layers)
        self.target_layer_ids = list(layer_ids)
        self.block_size = int(dflash_value(config, "block_size", 16))
        self.mask_token_id = dflash_value(config, "mask_token_id")
        self.layers = nn.ModuleList([self.layer_class(config, i) for i in range(config.num_hidden_layers)])
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        vocab = int(config.vocab_size)
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or vocab)
        if not 1 <= self.draft_vocab_size <= vocab:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..vocab_size ({vocab})")
        self.lm_head: DraftHead | None = None
        self.d2t: torch.Tensor | None
        if self.draft_vocab_size < vocab:
            self.lm_head = DraftHead(self.draft_vocab_size, config.hidden_size)
            # vLLM's and llama.cpp's table: draft row i drafts target token i + d2t[i].
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        else:
            self.register_buffer("d2t", None)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            _init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                _init.zeros_(module.bias)
        elif isinstance(module, Qwen3RMSNorm):
            # The final norm feeds the target's frozen LM head, which expects the target's own
            # output scale: with weight 1 the first logits are huge (CE ~77 on SmolLM2). Weight
            # 1/sqrt(H) makes the output a unit-L2 vector, so |logit_v| <= |w_v| (the head row
            # norm) and the first CE is close to ln(vocab); Adam grows the scale as needed.
            value = self.config.hidden_size ** -0.5 if module is self.norm else 1.0
            _init.constant_(module.weight, value)
        else:
            super()._init_weights(module)

    def forward(self, position_ids: torch.LongTensor, noise_embedding: torch.Tensor,
                target_hidden: torch.Tensor, attention_mask: Any = None, past_key_values: Any = None,
                use_cache: bool = False, output_slots: int | None = None) -> torch.Tensor:
        """Drafter hidden states (after the final norm) for the block tokens.

        Args:
            position_ids: ``[B or 1, C + Q]`` positions of the C context tokens, then the Q block tokens.
            noise_embedding: ``[B, Q, H]`` target embeddings of the block tokens.
            target_hidden: ``[B, C, K*H]`` concatenated target layer outputs for the context.
            attention_mask: None (inference: everything visible), a bool ``[B, 1, Q, C_all + Q]``
                mask (True = attend; C_all includes cached context), a :class:`BlockLayout`
                (training without a dense mask) or a FlexAttention BlockMask.
            past_key_values: a transformers ``Cache`` holding context K/V of earlier calls; the
                new context K/V are appended, block K/V are never stored.
            use_cache: accepted for z-lab compatibility; caching happens iff a cache is passed.
            output_slots: training with a loss on block slots 1..K only: return just those rows
                (``[B, N*K, H]`` for N blocks). The last layer then computes queries, attention
                output and MLP for them alone; every row still gives keys and values, so the
                result equals the same rows of the full output.

        Returns:
            ``[B, Q, H]`` (or ``[B, N*K, H]`` with ``output_slots``); apply the target's LM head outside.
        """
        del use_cache
        if output_slots is not None and not 1 <= output_slots < self.block_size:
            raise ValueError(f"output_slots must be in 1..{self.block_size - 1}, got {output_slots}")
        context = self.hidden_norm(self.fc(target_hidden))
        position_embeddings = self.rotary_emb(noise_embedding, position_ids)
        row_visible = None
        if isinstance(attention_mask, torch.Tensor):
            if attention_mask.dtype != torch.bool:
                raise TypeError(f"DFlash attention masks must be bool (True = attend), got {attention_mask.dtype}")
            # Queries that see nothing (dropped blocks) would give NaN on some SDPA backends:
            # let them see everything and zero their attention output instead (CPU SDPA semantics).
            visible = attention_mask.any(dim=-1, keepdim=True)
            attention_mask = attention_mask | ~visible
            row_visible = visible[:, 0].to(noise_embedding.dtype)
        hidden_states = noise_embedding
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states, context, position_embeddings, attention_mask,
                                  row_visible, past_key_values, output_slots if i == last else None)
        return self.norm(hidden_states)

    def output_head(self, target_head_weight: torch.Tensor) -> torch.Tensor:
        """The LM head weight the drafter's states are scored with: its own :class:`DraftHead`
        rows ``[draft_vocab_size, H]`` with a pruned draft vocabulary, else the target's."""
        return target_head_weight if self.lm_head is None else self.lm_head.weight

    def draft_token_ids(self) -> torch.Tensor:
        """The target token id of each draft-vocabulary row ``[draft_vocab_size]``."""
        rows = torch.arange(self.draft_vocab_size, device=self.fc.weight.device)
        return rows if self.d2t is None else rows + self.d2t

    def to_draft_ids(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target ids -> (draft-vocabulary rows, whether each id is in the draft vocabulary);
        an id outside it gets row 0."""
        if self.d2t is None:
            return token_ids, torch.ones_like(token_ids, dtype=torch.bool)
        rows = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=token_ids.device)
        rows[self.draft_token_ids().to(token_ids.device)] = torch.arange(self.draft_vocab_size,
                                                                          device=token_ids.device)
        mapped = rows[token_ids]
        return mapped.clamp_min(0), mapped >= 0

    def widen(self, values: torch.Tensor, fill: float) -> torch.Tensor:
        """``[..., draft_vocab_size]`` -> ``[..., vocab_size]``: each draft row's value at its
        target token, ``fill`` at the tokens outside the draft vocabulary."""
        if self.d2t is None:
            return values
        out = values.new_full((*values.shape[:-1], self.config.vocab_size), fill)
        return out.index_copy_(-1, self.draft_token_ids().to(values.device), values)

    def compute_logits(self, hidden_states: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Logits ``[..., vocab_size]`` of drafter hidden states under the target's LM head, or
        with a pruned draft vocabulary under the drafter's own rows (-inf at other tokens, so
        neither the argmax nor a sampled draft is ever outside it)."""
        if self.lm_head is None:
            return lm_head(hidden_states.to(lm_head.weight.dtype))
        weight = self.lm_head.weight
        return self.widen(hidden_states.to(weight.dtype) @ weight.T, float("-inf"))

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head: nn.Module,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafts of one block from its hidden states ``[1, B-1, H]`` (slots 1..B-1).

        Returns the ``[B-1]`` draft ids and, at ``temperature > 0``, the ``[1, B-1, V]``
        distributions they were sampled from (for rejection sampling); ``anchor_ids`` ``[1]``
        (the block's verified first token) is unused here, a variant may condition on it.
        """
        del anchor_ids
        logits = self.compute_logits(hidden, lm_head).float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            return torch.multinomial(probs[0], 1)[:, 0], probs
        return logits[0].argmax(dim=-1), None

    @torch.inference_mode()
    def spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: list[int] | None = None, temperature: float = 0.0,
                      return_stats: bool = False) -> torch.LongTensor | SimpleNamespace:
        """Speculative decoding of one prompt with ``target`` verifying this drafter's blocks.

        Greedy (``temperature == 0``) output equals the target's own greedy output; at
        ``temperature > 0`` drafts are sampled and verified by rejection sampling, so the output
        follows the target's sampling distribution.

        Returns:
            ``[1, prompt + generated]`` token ids, or with ``return_stats`` a namespace with
            ``output_ids``, ``num_input_tokens``, ``num_output_tokens`` and
            ``acceptance_lengths`` (accepted drafts + 1 per target verify step, in [1, B]).
        """
        if input_ids.shape[0] != 1:
            raise ValueError(f"spec_generate decodes one prompt at a time, got batch {input_ids.shape[0]}")
        if self.mask_token_id is None:
            raise ValueError("config.dflash_config.mask_token_id is not set")
        was_training = self.training
        self.eval()
        try:
            return self._spec_generate(target, input_ids, max_new_tokens, stop_token_ids, temperature,
                                       return_stats)
        finally:
            self.train(was_training)

    def _spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
                       stop_token_ids: list[int] | None, temperature: float,
                       return_stats: bool) -> torch.LongTensor | SimpleNamespace:
        device = input_ids.device
        block = self.block_size
        stops = torch.tensor(list(stop_token_ids or []), dtype=torch.long, device=device)
        embed = target.get_input_embeddings()
        head = target.get_output_embeddings()
        cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        target_cache, draft_cache = DynamicCache(), DynamicCache()
        dtype = self.fc.weight.dtype

        prompt_len = input_ids.shape[1]
        out = target(input_ids, use_cache=True, output_hidden_states=True, logits_to_keep=1,
                     **{cache_arg: target_cache})
        tokens = [input_ids[0]]
        bonus = _sample(out.logits[:, -1], temperature)
        context = extract_context_feature(out.hidden_states, self.target_layer_ids)
        start = prompt_len  # position of the bonus token
        generated, acceptance = 1, []
        stopped = bool(torch.isin(bonus, stops).any())
        tokens.append(bonus)
        while generated < max_new_tokens and not stopped:
            block_ids = torch.full((1, block), self.mask_token_id, dtype=torch.long, device=device)
            block_ids[0, 0] = bonus[0]
            positions = torch.arange(start - context.shape[1], start + block, device=device)[None]
            hidden = self(positions, embed(block_ids).to(dtype), context.to(dtype),
                          past_key_values=draft_cache)
            block_ids[0, 1:], draft_probs = self.propose(hidden[:, 1:], block_ids[:, 0], head, temperature)
            out = target(block_ids, position_ids=positions[:, -block:], use_cache=True,
                         output_hidden_states=True, **{cache_arg: target_cache})
            accepted, bonus = _verify(block_ids[0, 1:], out.logits[0].float(), draft_probs, temperature)
            committed = torch.cat([block_ids[0, 1:accepted + 1], bonus])
            hits = torch.isin(committed, stops).nonzero()
            if hits.numel() > 0:
                committed = committed[: int(hits[0, 0]) + 1]
                stopped = True
            tokens.append(committed)
            generated += committed.numel()
            acceptance.append(accepted + 1)
            start += accepted + 1
            _crop_to(target_cache, start)
            context = extract_context_feature(out.hidden_states, self.target_layer_ids)[:, :accepted + 1]
        output_ids = torch.cat(tokens)[: prompt_len + max_new_tokens][None]
        if not return_stats:
            return output_ids
        return SimpleNamespace(output_ids=output_ids, num_input_tokens=prompt_len,
                               num_output_tokens=output_ids.shape[1] - prompt_len,
                               acceptance_lengths=acceptance)


def _sample(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(torch.softmax(logits.float() / temperature, dim=-1), 1)[:, 0]


def _verify(drafts: torch.Tensor, target_logits: torch.Tensor, draft_probs: torch.Tensor | None,
            temperature: float) -> tuple[int, torch.Tensor]:
    """Number of accepted drafts and the next (bonus) token, from ``[B, V]`` verify logits."""
    num = drafts.shape[0]
    if temperature <= 0:
        posterior = target_logits.argmax(dim=-1)
        accepted = int((drafts == posterior[:-1]).long().cumprod(0).sum())
        return accepted, posterior[accepted:accepted + 1]
    target_probs = torch.softmax(target_logits / temperature, dim=-1)
    p = target_probs[:num].gather(-1, drafts[:, None])[:, 0]
    q = draft_probs[0].gather(-1, drafts[:, None])[:, 0]
    accept = torch.rand_like(p) * q < p
    accepted = int(accept.long().cumprod(0).sum())
    if accepted == num:
        return accepted, torch.multinomial(target_probs[num], 1)
    residual = (target_probs[accepted] - draft_probs[0, accepted]).clamp_min(0)
    if float(residual.sum()) <= 0:
        residual = target_probs[accepted]
    return accepted, torch.multinomial(residual / residual.sum(), 1)


def _crop_to(cache: Any, length: int) -> None:
    # Negative crop removes tokens from the end in transformers 4.x and 5.x alike.
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


__all__ = ["BlockLayout", "DFlashDraftModel", "DraftHead", "block_slots", "build_target_layer_ids",
           "extract_context_feature", "dflash_value"]
