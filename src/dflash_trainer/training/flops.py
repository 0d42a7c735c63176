"""Model FLOPs of one training step (for perf/mfu and benchmarks/gpu_check.py).

Matmuls only, no recomputation. Target: causal forward of the layers it actually runs
(attention: half the S x S scores), plus its LM head over all positions when the labels
need the target's logits. Drafter: forward + backward (backward = 2x forward) of the context
K/V projections over the S context tokens, the block-token projections and MLP over the N*B
block tokens (in the last layer only the N*K supervised slots get queries, attention output
and MLP, and only the N*B block tokens' keys and values), and the attention entries the mask
allows (each block sees ``anchor`` context keys and its own B keys); ``fc`` gets only a
weight gradient (the features need none). LM
head: logits and the hidden-state gradient over the N*K supervised slots (the head is
frozen; K = B-1 or ``training.loss_slots``), plus the target's logits of those slots for KL
labels. Dropped blocks count as real ones: they cost the same.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LayerDims:
    """Shapes of one decoder layer."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def proj_flops_per_token(self) -> int:
        """Forward FLOPs of q/k/v/o and the SwiGLU MLP for one token."""
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * (2 * q_dim * self.hidden + 2 * kv_dim * self.hidden
                    + 3 * self.hidden * self.intermediate)


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """What one training step processes, per row."""

    rows: int
    seq_len: int
    num_anchors: int
    block_size: int
    mean_anchor: float
    """Expected anchor position (context keys each block attends to)."""
    supervised_slots: int | None = None
    """Slots per block under the LM head (``training.loss_slots``); None: ``block_size - 1``."""
    soft_labels: bool = False
    """KL labels: the head also maps the target's hidden state of every supervised slot."""


def step_flops(*, target: LayerDims, target_layers_run: int, target_head: bool,
               drafter: LayerDims, drafter_layers: int, num_features: int, vocab: int,
               shape: StepShape, draft_vocab: int | None = None) -> dict[str, float]:
    """FLOPs of one step by component, and their ``total``; ``draft_vocab``: the rows of the
    drafter's LM head when it drafts from a pruned vocabulary (else ``vocab``)."""
    s, q_tok = shape.seq_len, shape.num_anchors * shape.block_size
    t_q_dim = target.heads * target.head_dim
    d_q_dim, d_kv_dim = drafter.heads * drafter.head_dim, drafter.kv_heads * drafter.head_dim
    fc_fwd = 2 * s * num_features * target.hidden * drafter.hidden
    slots = shape.supervised_slots or shape.block_size - 1
    block_proj = 2 * (2 * d_q_dim * drafter.hidden + 3 * drafter.hidden * drafter.intermediate)
    # Rows that get queries, attention output and MLP: every block token in all but the last
    # layer, the supervised slots in the last (the drafter's output_slots).
    query_rows = (drafter_layers - 1) * q_tok + shape.num_anchors * slots
    layers_fwd = query_rows * block_proj + drafter_layers * 2 * (s + q_tok) * 2 * d_kv_dim * drafter.hidden
    per_row = {
        "target_linear": target_layers_run * s * target.proj_flops_per_token,
        "target_attention": target_layers_run * 2 * s * s * t_q_dim,
        "target_head": (2 * s * target.hidden * vocab) if target_head else 0,
        "drafter_linear": 2 * fc_fwd + 3 * layers_fwd,
        "drafter_attention": 3 * 4 * query_rows * (shape.mean_anchor + shape.block_size) * d_q_dim,
        "lm_head": ((6 if shape.soft_labels else 4) * shape.num_anchors * slots * drafter.hidden
                    * (draft_vocab or vocab)),
    }
    out = {k: float(v * shape.rows) for k, v in per_row.items()}
    out["total"] = sum(out.values())
    return out


def layer_dims(config: object) -> LayerDims:
    """LayerDims of an HF decoder config (head_dim derived when absent)."""
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return LayerDims(hidden=hidden, intermediate=int(config.intermediate_size), heads=heads,
                     kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                     head_dim=int(head_dim))
