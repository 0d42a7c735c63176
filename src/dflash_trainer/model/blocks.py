"""Training blocks: random anchors, block inputs, labels with decay weights, attention masks.

Layout of one training forward (per sequence, S = padded length, B = block size, N blocks):
keys/values ``[context (S) | block_0 | ... | block_{N-1}]``, queries ``[block_0 | ... ]``.
Block j starts at anchor ``a_j``: its input is ``[x_{a_j}, MASK x (B-1)]`` at positions
``a_j .. a_j + B - 1`` and slot k (k >= 1) is trained to predict ``x_{a_j + k}``. A block may
run past its sample's end (and past S): those slots keep their positions (as at inference,
where a block drafts beyond the committed tokens), read clamped labels and get weight 0.

The visibility rule :func:`allow` is written once; :func:`dense_block_mask` (SDPA) and
:func:`flex_block_mask` (FlexAttention) are both built from it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["allow", "build_block_inputs", "dense_block_mask", "flex_block_mask", "label_positions",
           "labels_and_weights", "position_ids", "sample_anchors", "slot_weights", "valid_anchors"]


def valid_anchors(loss_mask: torch.Tensor, seq_lens: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, S]`` bool: may a block start at position a? The anchor rule of the reference.

    a is valid iff ``loss_mask[a]``, ``loss_mask[a + 1]`` and ``a <= seq_len - 2`` (``seq_lens``
    defaults to the padded length S). A block may run past the sample's end: its slots there
    get label weight 0 (:func:`labels_and_weights`), so every supervised token that follows a
    supervised one can be a slot-1 label, the end-of-turn token included.
    """
    batch, seq = loss_mask.shape
    mask = loss_mask.bool()
    lens = (torch.full((batch,), seq, dtype=torch.long, device=mask.device) if seq_lens is None
            else seq_lens.to(device=mask.device, dtype=torch.long))
    next_supervised = torch.zeros_like(mask)
    next_supervised[:, :-1] = mask[:, 1:]
    positions = torch.arange(seq, device=mask.device)
    return mask & next_supervised & (positions[None, :] <= lens[:, None] - 2)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, block_size: int, generator: torch.Generator,
                   *, seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random block starts per sequence, sorted; ``(anchors [B, N] long, keep [B, N] bool)``.

    Valid positions follow :func:`valid_anchors` (``seq_lens`` defaults to the padded length);
    ``block_size`` does not restrict them, since blocks may run past the end. Each sequence
    gets a uniformly random subset of ``min(num_anchors, its valid count)`` valid positions.
    ``N = min(num_anchors, max valid count over the batch)`` (at least 1): shapes follow the
    batch instead of always ``num_anchors``, because padding blocks cost as much drafter and
    LM-head compute as real ones and short buckets would be mostly padding. Slots past a
    sequence's count have ``keep=False`` and anchor 0.

    Uses only ``generator`` and fresh tensors: safe in prefetch threads, one generator each.
    """
    batch, seq = loss_mask.shape
    valid = valid_anchors(loss_mask, seq_lens)
    counts = valid.sum(dim=1)
    num = max(1, min(num_anchors, int(counts.max()) if batch else 0))
    keys = torch.rand(batch, seq, generator=generator, device=generator.device).to(loss_mask.device)
    keys = keys.masked_fill(~valid, 2.0)  # invalid positions sort after every valid one
    picked = keys.argsort(dim=1)[:, :num]
    keep = torch.arange(num, device=loss_mask.device)[None, :] < counts[:, None]
    anchors = torch.where(keep, picked, seq).sort(dim=1).values
    return torch.where(keep, anchors, 0), keep


def build_block_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, mask_token_id: int,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(noise_ids [B, N*B], block_positions [B, N*B])`` for the blocks.

    Slot 0 of a kept block is the token at its anchor; every other slot (and every slot of a
    dropped block) is the mask token. Slot k sits at position ``anchor + k``, also when that
    is past the sequence end: RoPE has no position table to overrun.
    """
    batch, num = anchors.shape
    offsets = torch.arange(block_size, device=anchors.device)
    noise = torch.full((batch, num, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    noise[:, :, 0] = torch.where(keep, input_ids.gather(1, anchors), mask_token_id)
    positions = anchors[:, :, None] + offsets
    return noise.view(batch, num * block_size), positions.view(batch, num * block_size)


def slot_weights(block_size: int, gamma: float | None, device: torch.device | None = None) -> torch.Tensor:
    """Decay ``w_k = exp(-(k-1)/gamma)`` for slots k = 1..B-1 (all 1 when gamma is None or 0)."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    if not gamma:
        return torch.ones_like(k)
    return torch.exp(-(k - 1) / gamma)


def labels_and_weights(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                       keep: torch.Tensor, block_size: int, gamma: float | None,
                       seq_lens: torch.Tensor,
                       num_slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, weights)``, both ``[B, N, K]``, for slots k = 1..K (slot 0 is never trained);
    K is ``num_slots``, by default ``B-1`` (``training.loss_slots`` supervises fewer).

    Same-position labels: slot k predicts ``input_ids[anchor + k]`` (pass the target's greedy
    labels as ``input_ids`` for on-policy labels). Weight ``exp(-(k-1)/gamma)`` where
    ``keep``, ``anchor + k < seq_len`` and ``loss_mask[anchor + k]``; 0 elsewhere, in
    particular on slots past the sample's end.
    """
    slots = num_slots or block_size - 1
    pos = anchors[:, :, None] + torch.arange(1, slots + 1, device=anchors.device)
    inside = (pos < seq_lens.to(pos.device)[:, None, None]) & keep[:, :, None]
    flat = label_positions(anchors, slots, input_ids.shape[1]).flatten(1)
    labels = input_ids.gather(1, flat).view_as(pos)
    supervised = loss_mask.bool().gather(1, flat).view_as(pos) & inside
    weights = slot_weights(block_size, gamma, anchors.device)[:slots] * supervised
    return labels, weights


def label_positions(anchors: torch.Tensor, num_slots: int, width: int, *, shift: int = 0) -> torch.Tensor:
    """``[B, N, K]`` gather indices ``anchor + k + shift`` for slots k = 1..K, clamped to ``width - 1``.

    A block near the end of a row reaches past the padded width ``width``; its clamped
    slots read the row's last position, and :func:`labels_and_weights` gives them weight 0.
    ``shift=-1`` indexes what predicts slot k (the target's state at ``anchor + k - 1``).
    """
    offsets = torch.arange(1 + shift, num_slots + 1 + shift, device=anchors.device)
    return (anchors[:, :, None] + offsets).clamp(max=width - 1)


def position_ids(block_positions: torch.Tensor, context_len: int) -> torch.Tensor:
    """``[B, S + N*B]`` drafter positions: ``0..S-1`` for the context, then the block positions."""
    ctx = torch.arange(context_len, device=block_positions.device).expand(block_positions.shape[0], -1)
    return torch.cat([ctx, block_positions], dim=1)


def allow(b: Any, q: Any, kv: Any, *, anchors: torch.Tensor, keep: torch.Tensor, context_len: int,
          block_size: int) -> Any:
    """May query q (block token) of sequence b attend to key kv? The single visibility rule.

    Context keys (kv < S) strictly before the query's anchor; the query's own block, both
    directions; no other block; a dropped block (keep False) sees nothing. Works on
    broadcastable index tensors (dense mask) and on FlexAttention's scalar indices.
    """
    blk = torch.clamp(q // block_size, max=anchors.shape[1] - 1)
    is_ctx = kv < context_len
    sees_ctx = is_ctx & (kv < anchors[b, blk])
    sees_own = ~is_ctx & ((kv - context_len) // block_size == blk)
    return (sees_ctx | sees_own) & keep[b, blk]


def dense_block_mask(anchors: torch.Tensor, keep: torch.Tensor, context_len: int,
                     block_size: int) -> torch.Tensor:
    """Bool ``[B, 1, Q, S + Q]`` mask (True = attend) for SDPA, from :func:`allow`."""
    batch, num = anchors.shape
    q_len = num * block_size
    device = anchors.device
    b = torch.arange(batch, device=device)[:, None, None]
    q = torch.arange(q_len, device=device)[None, :, None]
    kv = torch.arange(context_len + q_len, device=device)[None, None, :]
    return allow(b, q, kv, anchors=anchors, keep=keep, context_len=context_len, block_size=block_size)[:, None]


def flex_block_mask(anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int) -> Any:
    """FlexAttention ``BlockMask`` equal to :func:`dense_block_mask`, from :func:`allow`."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, num = anchors.shape
    q_len = num * block_size

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return allow(b, q, kv, anchors=anchors, keep=keep, context_len=context_len, block_size=block_size)

    # Compiled mask construction avoids materialising [Q, KV] per sequence on the GPU.
    return create_block_mask(mask_mod, batch, None, q_len, context_len + q_len, device=anchors.device,
                             _compile=anchors.is_cuda)
