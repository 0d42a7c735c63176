"""DFlash2 drafter (z-lab ``DFlash2DraftModel`` format), standalone next to ``dflash.py``.

Like ``dflash.py`` this file imports only torch, transformers, the standard library and its
sibling ``dflash.py`` (shipped with it), so an exported folder loads with
``AutoModel.from_pretrained(dir, trust_remote_code=True)``; the trainer imports the same class.

DFlash2 keeps the DFlash backbone and adds two things:

* a two-tap dynamic depthwise convolution before and after each attention and MLP sublayer
  (``layers.N.attention_conv`` and ``layers.N.mlp_conv``): ``out_t = sum_tap (base[side, tap, c]
  + delta_t[side, tap, c // group]) * x_{t - tap}``, where ``delta`` is ``kernel_projection`` of
  the sublayer's (normalised) input, computed once and used on both sides. The taps never
  reach across a block boundary: slot 0 (the anchor) reads zero for tap 1, also when many
  blocks are packed into one training sequence;
* a candidate selector (``candidate_selector``): the top ``selector_top_k`` tokens of the
  drafter's logits at each slot are scored as ``S_t(a, b) = U_t(b) + <A[a] * (P h_t), B[b]>``
  (U the logit, A/B the predecessor/successor codebooks, P the hidden projection, h_t the
  drafter's hidden state), and the draft is a left-to-right walk from the verified anchor
  taking the best candidate given the token before it (sampling among the candidates at
  temperature > 0).

Identity initialisation (base kernel tap 0 = 1 and tap 1 = 0, zero kernel projection, zero
successor codebook) makes a fresh DFlash2 drafter compute exactly what its DFlash backbone
computes and draft the backbone's argmax.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config

from .dflash import DFlashDecoderLayer, DFlashDraftModel, block_slots, dflash_value

try:  # transformers >= 5: init helpers that skip parameters already loaded from a checkpoint
    from transformers import initialization as _init
except ImportError:  # transformers 4.x initialises before loading, so plain torch init is right
    _init = nn.init

DEFAULT_CONV_KERNEL_SIZE = 2
DEFAULT_CONV_GROUP_SIZE = 16
DEFAULT_SELECTOR_RANK = 256
DEFAULT_SELECTOR_TOP_K = 16


def _set_unless_loaded(param: nn.Parameter, value: torch.Tensor) -> None:
    # transformers 5 marks parameters read from a checkpoint; a copy through a view or a
    # computed tensor would bypass the check its init helpers make.
    if not getattr(param, "_is_hf_initialized", False):
        with torch.no_grad():
            param.copy_(value)


class DynamicDepthwiseConv(nn.Module):
    """The convolutions around one sublayer: ``base_kernel`` ``[2 sides, taps, H]`` and
    ``kernel_projection`` (bias-free ``H -> 2 * taps * H / group``)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int) -> None:
        super().__init__()
        if group_size < 1 or hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide hidden_size {hidden_size}")
        if kernel_size < 1:
            raise ValueError(f"conv_kernel_size must be >= 1, got {kernel_size}")
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.block_size = block_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, hidden: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolution before the sublayer, and the kernel offsets of the one after it
        (``rows``: see :meth:`convolve`)."""
        delta = self.kernel_projection(hidden).unflatten(-1, (2, self.kernel_size, self.groups))
        return self.convolve(hidden, delta[..., 0, :, :], 0, rows), delta[..., 1, :, :]

    def finish(self, hidden: torch.Tensor, delta: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """The convolution after the sublayer."""
        return self.convolve(hidden, delta, 1, rows)

    def convolve(self, hidden: torch.Tensor, delta: torch.Tensor, side: int, rows: int | None = None) -> torch.Tensor:
        """``hidden`` ``[B, L, H]`` (whole blocks of ``block_size`` rows, or one shorter block;
        with ``rows``, the first ``rows`` rows of every block) convolved with
        ``base_kernel[side]`` plus ``delta`` ``[B, L, taps, groups]``."""
        length = hidden.shape[1]
        base = self.base_kernel[side].to(hidden.dtype)
        delta = delta.to(hidden.dtype)
        slot = torch.arange(length, device=hidden.device) % (rows or self.block_size)

        def term(values: torch.Tensor, tap: int) -> torch.Tensor:
            grouped = values.unflatten(-1, (self.groups, self.group_size))
            return values * base[tap] + (grouped * delta[:, :, tap, :, None]).flatten(-2)

        out = term(hidden, 0)
        for tap in range(1, self.kernel_size):
            # Row t reads row t - tap of its own block only: zero where that is outside.
            shifted = F.pad(hidden[:, :-tap], (0, 0, tap, 0)) * (slot >= tap)[:, None].to(hidden.dtype)
            out = out + term(shifted, tap)
        return out


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer with :class:`DynamicDepthwiseConv` around attention and MLP: input norm ->
    conv -> sublayer -> conv -> residual add."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        args = (config.hidden_size, int(dflash_value(config, "conv_kernel_size", DEFAULT_CONV_KERNEL_SIZE)),
                int(dflash_value(config, "conv_group_size", DEFAULT_CONV_GROUP_SIZE)), self.self_attn.block_size)
        self.attention_conv = DynamicDepthwiseConv(*args)
        self.mlp_conv = DynamicDepthwiseConv(*args)

    def forward(self, hidden_states: torch.Tensor, context: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: Any,
                row_visible: torch.Tensor | None, past_key_values: Any = None,
                query_slots: int | None = None) -> torch.Tensor:
        """The layer's output for every block row, or with ``query_slots=K`` for block slots
        1..K only. Attention always runs on every row (the convolution after it reads each
        row's predecessor); with ``query_slots`` the MLP and its convolutions run on rows
        0..K of each block, all that slots 1..K read (the taps only look back)."""
        normed, kernel = self.attention_conv.prepare(self.input_layernorm(hidden_states))
        attn = self.self_attn(normed, context, position_embeddings, attention_mask, past_key_values)
        attn = self.attention_conv.finish(attn, kernel)
        if row_visible is not None:
            attn = attn * row_visible
        hidden_states = hidden_states + attn
        normed = self.post_attention_layernorm(hidden_states)
        if query_slots is None:
            normed, kernel = self.mlp_conv.prepare(normed)
            return hidden_states + self.mlp_conv.finish(self.mlp(normed), kernel)
        rows = query_slots + 1
        size = self.self_attn.block_size
        hidden_states, normed = (x.unflatten(1, (-1, size))[:, :, :rows].flatten(1, 2) for x in (hidden_states, normed))
        normed, kernel = self.mlp_conv.prepare(normed, rows)
        out = hidden_states + self.mlp_conv.finish(self.mlp(normed), kernel, rows)
        return block_slots(out, 1, rows, query_slots)


class CandidateSelector(nn.Module):
    """``predecessor_codebook`` and ``successor_codebook`` ``[vocab, rank]`` (plain parameters:
    the file names have no ``.weight``) and ``hidden_projection`` (bias-free ``H -> rank``)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        rank = int(dflash_value(config, "selector_rank", DEFAULT_SELECTOR_RANK))
        self.top_k = int(dflash_value(config, "selector_top_k", DEFAULT_SELECTOR_TOP_K))
        if not 1 <= self.top_k <= config.vocab_size:
            raise ValueError(f"selector_top_k {self.top_k} must be in 1..vocab_size ({config.vocab_size})")
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(unary, ids)``: the top-k logits ``[..., k]`` (float32) and their token ids."""
        unary, ids = torch.topk(logits, self.top_k, dim=-1)
        return unary.float(), ids

    def pair_scores(self, hidden: torch.Tensor, unary: torch.Tensor, candidate_ids: torch.Tensor,
                    predecessor_ids: torch.Tensor) -> torch.Tensor:
        """``S(a, b)`` ``[..., k]`` (float32) for one predecessor ``a`` per row
        (``predecessor_ids`` ``[...]``) and the row's candidates ``b`` (``candidate_ids``
        ``[..., k]``, ``unary`` their logits), from the rows' hidden states ``[..., H]``.
        Only the k candidate rows of the successor codebook are read."""
        query = self.predecessor_codebook[predecessor_ids].float() * self.hidden_projection(hidden).float()
        successors = self.successor_codebook[candidate_ids].float()
        return unary + torch.matmul(successors, query[..., None])[..., 0]

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor,
             temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The draft path of blocks ``[B, n]`` from their slots' hidden states ``[B, n, H]`` and
        logits ``[B, n, V]``, starting from the verified ``anchor_ids`` ``[B]``.

        Returns ``(path [B, n], candidate ids [B, n, k], q)``: greedy (``temperature <= 0``,
        ``q`` None) takes the best-scoring candidate at each slot; otherwise each slot samples
        ``softmax(S / temperature)`` over its candidates, returned as ``q`` ``[B, n, k]``.
        """
        unary, candidates = self.candidates(logits)
        path, q = self.walk_candidates(hidden, unary, candidates, anchor_ids, temperature)
        return path, candidates, q

    def walk_candidates(self, hidden: torch.Tensor, unary: torch.Tensor, candidate_ids: torch.Tensor,
                        anchor_ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`walk` over given candidates ``[B, n, k]`` and their logits ``unary``:
        ``(path [B, n], q [B, n, k] or None)``."""
        projected = self.hidden_projection(hidden).float()
        predecessor = anchor_ids
        path, rows = [], []
        for slot in range(hidden.shape[1]):
            query = self.predecessor_codebook[predecessor].float() * projected[:, slot]
            successors = self.successor_codebook[candidate_ids[:, slot]].float()
            scores = unary[:, slot].float() + torch.matmul(successors, query[..., None])[..., 0]
            if temperature > 0:
                q = torch.softmax(scores / temperature, dim=-1)
                index = torch.multinomial(q, 1)[:, 0]
                rows.append(q)
            else:
                index = scores.argmax(dim=-1)
            predecessor = candidate_ids[:, slot].gather(-1, index[:, None])[:, 0]
            path.append(predecessor)
        return torch.stack(path, dim=1), torch.stack(rows, dim=1) if rows else None


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 drafter: the DFlash modules plus ``layers.{i}.attention_conv``,
    ``layers.{i}.mlp_conv`` and ``candidate_selector``.

    Reads ``conv_kernel_size``, ``conv_group_size``, ``selector_rank`` and ``selector_top_k``
    (and optionally ``output_multiplier`` and ``final_logit_softcapping``) from
    ``config.dflash_config`` first, then from the top level of the config.
    """

    layer_class = DFlash2DecoderLayer
    _no_split_modules = ["DFlash2DecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # Modules are initialised after their children, so these overrule the Linear init of
        # kernel_projection (and keep the normal init of hidden_projection).
        if isinstance(module, DynamicDepthwiseConv):
            identity = torch.zeros_like(module.base_kernel)
            identity[:, 0] = 1.0
            _set_unless_loaded(module.base_kernel, identity)
            _init.zeros_(module.kernel_projection.weight)
        elif isinstance(module, CandidateSelector):
            _init.normal_(module.predecessor_codebook, mean=0.0, std=self.config.initializer_range)
            _init.zeros_(module.successor_codebook)
        else:
            super()._init_weights(module)

    def forward(self, position_ids: torch.LongTensor, noise_embedding: torch.Tensor,
                target_hidden: torch.Tensor, attention_mask: Any = None, past_key_values: Any = None,
                use_cache: bool = False, output_slots: int | None = None) -> torch.Tensor:
        """As :meth:`DFlashDraftModel.forward`; ``noise_embedding`` holds whole blocks (or one
        block, possibly shorter), since the convolutions locate slots by row index."""
        rows = noise_embedding.shape[1]
        if rows > self.block_size and rows % self.block_size:
            raise ValueError(f"DFlash2 needs whole blocks of {self.block_size} rows, got {rows}")
        if output_slots is not None and rows % self.block_size:
            raise ValueError(f"output_slots needs whole blocks of {self.block_size} rows, got {rows}")
        return super().forward(position_ids, noise_embedding, target_hidden, attention_mask,
                               past_key_values, use_cache, output_slots)

    def compute_logits(self, hidden_states: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Logits under the target's LM head, times ``output_multiplier`` and soft-capped by
        ``final_logit_softcapping`` where the config sets them."""
        logits = super().compute_logits(hidden_states, lm_head)
        multiplier = float(dflash_value(self.config, "output_multiplier", 1.0))
        if multiplier != 1.0:
            logits = logits * multiplier
        cap = dflash_value(self.config, "final_logit_softcapping")
        if cap is not None and float(cap) > 0:
            logits = torch.tanh(logits / float(cap)) * float(cap)
        return logits

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head: nn.Module,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The selector's path through the top-k candidates of each slot, walked from the
        anchor; at ``temperature > 0`` with the selector's distributions spread over the
        vocabulary ``[1, B-1, V]`` (zero outside the candidates) for rejection sampling."""
        logits = self.compute_logits(hidden, lm_head).float()
        path, candidates, q = self.candidate_selector.walk(hidden, logits, anchor_ids, temperature)
        if q is None:
            return path[0], None
        return path[0], torch.zeros_like(logits).scatter_(-1, candidates, q)


__all__ = ["CandidateSelector", "DEFAULT_CONV_GROUP_SIZE", "DEFAULT_CONV_KERNEL_SIZE", "DEFAULT_SELECTOR_RANK",
           "DEFAULT_SELECTOR_TOP_K", "DFlash2DecoderLayer", "DFlash2DraftModel", "DynamicDepthwiseConv"]
