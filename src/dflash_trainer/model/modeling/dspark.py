"""DSpark drafter (DeepSeek's DSpark as SpecForge, speculators, vLLM and llama.cpp load it),
standalone next to ``dflash.py``.

Like ``dflash.py`` this file imports only torch, transformers, the standard library and its
sibling ``dflash.py`` (shipped with it), so an exported folder loads with
``AutoModel.from_pretrained(dir, trust_remote_code=True)``; the trainer imports the same class.

DSpark keeps the DFlash backbone (one parallel pass drafts the block ``[anchor, MASK x (B-1)]``;
slot k's state predicts the token at anchor + k) and adds two small heads:

* a low-rank Markov head (``markov_head``): ``markov_w1`` ``[vocab, rank]`` embeds the token
  before a slot and ``markov_w2`` ``[vocab, rank]`` maps it to a transition bias over the
  vocabulary, added to the slot's logits: ``logits_k = head(h_k) + markov_w2 @ markov_w1[x_{k-1}]``.
  The block is drafted left to right: slot 1's previous token is the verified anchor, slot k's
  the draft just chosen for slot k-1 (greedy at temperature 0, else sampled from
  ``softmax(logits_k / temperature)``, and that distribution is used for lossless rejection
  sampling);
* an optional confidence head (``confidence_head.proj``, a linear map with bias from
  ``[h_k; markov_w1[x_{k-1}]]`` to one logit): the estimated probability that slot k's draft is
  accepted given that the slots before it were. Serving engines may use it to size the
  verification; drafting does not read it.

Identity initialisation (``markov_w2`` = 0) makes the bias exactly 0, so a fresh DSpark drafter
drafts exactly what its DFlash backbone drafts. ``markov_w1`` starts random (normal, std 1, as
``nn.Embedding`` does), so ``markov_w2`` receives gradient at the first step.

The block layout is DFlash's fill-in one (the anchor is the verified bonus token, the masks are
the predictions): exports say ``sample_from_anchor: false``, which vLLM and llama.cpp read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config

from .dflash import DFlashDraftModel, dflash_value

try:  # transformers >= 5: init helpers that skip parameters already loaded from a checkpoint
    from transformers import initialization as _init
except ImportError:  # transformers 4.x initialises before loading, so plain torch init is right
    _init = nn.init

DEFAULT_MARKOV_RANK = 256
MARKOV_INIT_STD = 1.0
"""Std of ``markov_w1``'s normal init: ``nn.Embedding``'s, as SpecForge, speculators and DeepSpec
initialise it. With ``markov_w2`` at zero it sets how fast the bias grows once ``markov_w2``
moves (the bias is their product)."""


class MarkovHead(nn.Module):
    """``markov_w1`` (an embedding ``[vocab, rank]``) and ``markov_w2`` (bias-free ``rank -> draft
    vocab``, weight ``[draft vocab, rank]``): the transition bias ``markov_w2 @ markov_w1[previous
    token]``."""

    def __init__(self, vocab_size: int, rank: int, draft_vocab_size: int | None = None) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"markov_rank must be >= 1, got {rank}")
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        # The bias is over the draft vocabulary (its rows), the previous token a target id.
        self.markov_w2 = nn.Linear(rank, draft_vocab_size or vocab_size, bias=False)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``markov_w1[token_ids]`` ``[..., rank]``."""
        return self.markov_w1(token_ids)

    def bias(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The transition bias ``[..., vocab]`` (float32) after each of ``token_ids``."""
        return self.markov_w2(self.embed(token_ids)).float()

    def walk(self, base_logits: torch.Tensor, anchor_ids: torch.Tensor, temperature: float,
             widen: Callable[[torch.Tensor], torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafts of blocks ``[B, n]`` from their slots' base logits ``[B, n, V]``, left to
        right from the verified ``anchor_ids`` ``[B]``: each slot's logits plus the bias after
        the token chosen before it (``widen`` maps a draft-vocabulary bias onto the ``V``
        tokens). Greedy (``temperature <= 0``, no distributions), or sampled from
        ``softmax(logits / temperature)``, returned as ``[B, n, V]``."""
        previous = anchor_ids
        path, rows = [], []
        for slot in range(base_logits.shape[1]):
            bias = self.bias(previous)
            logits = base_logits[:, slot].float() + (bias if widen is None else widen(bias))
            if temperature > 0:
                q = torch.softmax(logits / temperature, dim=-1)
                previous = torch.multinomial(q, 1)[:, 0]
                rows.append(q)
            else:
                previous = logits.argmax(dim=-1)
            path.append(previous)
        return torch.stack(path, dim=1), torch.stack(rows, dim=1) if rows else None


class ConfidenceHead(nn.Module):
    """``proj``: a linear map with bias from ``[h; markov_w1[previous]]`` (or ``h`` alone without
    ``confidence_head_with_markov``) to one acceptance logit."""

    def __init__(self, input_dim: int, with_markov: bool) -> None:
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor | None) -> torch.Tensor:
        """Acceptance logits ``[...]`` (float32) of slots with states ``hidden`` ``[..., H]`` and
        previous-token embeddings ``markov_embed`` ``[..., rank]``."""
        features = torch.cat([hidden, markov_embed.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        return self.proj(features.to(self.proj.weight.dtype))[..., 0].float()


class DSparkDraftModel(DFlashDraftModel):
    """DSpark drafter: the DFlash modules plus ``markov_head`` and, with
    ``enable_confidence_head``, ``confidence_head``.

    Reads ``markov_rank``, ``enable_confidence_head`` and ``confidence_head_with_markov`` from
    ``config.dflash_config`` first, then from the top level of the config, where it also needs
    ``sample_from_anchor: false`` (the block layout).
    """

    def __init__(self, config: Qwen3Config) -> None:
        if getattr(config, "sample_from_anchor", True) is not False:
            # vLLM and llama.cpp read a missing key as true, the layout of DeepSeek's and
            # SpecForge's DSpark drafters, whose first block row already predicts.
            raise ValueError("this DSpark drafter predicts from the anchor row (sample_from_anchor is true or "
                             "missing); DSparkDraftModel drafts DFlash's block layout, where the anchor is the "
                             "verified token and the masks predict (sample_from_anchor: false)")
        super().__init__(config)
        rank = int(dflash_value(config, "markov_rank", DEFAULT_MARKOV_RANK))
        self.markov_head = MarkovHead(config.vocab_size, rank, self.draft_vocab_size)
        self.confidence_head: ConfidenceHead | None = None
        if bool(dflash_value(config, "enable_confidence_head", False)):
            # Missing means false, as vLLM reads it; this trainer's drafters always set it true.
            with_markov = bool(dflash_value(config, "confidence_head_with_markov", False))
            self.confidence_head = ConfidenceHead(config.hidden_size + (rank if with_markov else 0), with_markov)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # The heads' own parts, found by identity: transformers skips a custom module without
        # parameters of its own (MarkovHead, ConfidenceHead), so their init goes on the leaves.
        markov, confidence = getattr(self, "markov_head", None), getattr(self, "confidence_head", None)
        if markov is not None and module is markov.markov_w1:
            _init.normal_(module.weight, mean=0.0, std=MARKOV_INIT_STD)
        elif markov is not None and module is markov.markov_w2:
            _init.zeros_(module.weight)
        elif confidence is not None and module is confidence.proj:
            _init.zeros_(module.weight)
            _init.zeros_(module.bias)
        else:
            super()._init_weights(module)

    def confidence_logits(self, hidden: torch.Tensor, previous_ids: torch.Tensor) -> torch.Tensor:
        """The confidence head's acceptance logits ``[...]`` for slot states ``[..., H]`` whose
        previous tokens are ``previous_ids`` ``[...]``; the estimated acceptance probability is
        their sigmoid."""
        if self.confidence_head is None:
            raise ValueError("this DSpark drafter has no confidence head (enable_confidence_head is false)")
        return self.confidence_head(hidden, self.markov_head.embed(previous_ids))

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head: nn.Module,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The Markov head's left-to-right walk over the slots' logits from the anchor; at
        ``temperature > 0`` with the distributions the drafts were sampled from ``[1, B-1, V]``."""
        logits = self.compute_logits(hidden, lm_head).float()
        path, q = self.markov_head.walk(logits, anchor_ids, temperature, lambda bias: self.widen(bias, 0.0))
        return path[0], q


__all__ = ["ConfidenceHead", "DEFAULT_MARKOV_RANK", "DSparkDraftModel", "MARKOV_INIT_STD", "MarkovHead"]
