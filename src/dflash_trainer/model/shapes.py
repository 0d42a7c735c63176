"""The fixed set of shapes the drafter's compiled attention sees.

Every batch has its own padded width, row count and anchor count, and compiled FlexAttention
(and its compiled block-mask construction) is specialised on shapes: left to themselves,
shapes vary at every step, each new one may compile again, every rank waits for the slowest
rank's compile, and past dynamo's recompile limit the attention silently falls back to the
unfused kernel, which holds the whole score matrix. With :class:`ShapeSizes` the drafter's
context width and anchor count are padded up to a few sizes known at start-up, each a whole
number of FlexAttention's 128-token blocks, so the number of (width, anchors) variants is
bounded by ``len(widths) * len(anchors)`` whatever the data.

The padding changes no result: padded context positions lie at or after every anchor, which
no block sees (:func:`~dflash_trainer.model.blocks.allow`), and padded anchors have ``keep``
False, see nothing and are cut off the drafter's output before the loss. It costs the
drafter's context projections on the padded width (not the target's forward, which runs on
the batch as it is) and its layers on the padded blocks (not the LM head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

__all__ = ["FLEX_BLOCK", "PaddedBlocks", "ShapeSizes", "pad_blocks", "shape_sizes"]

FLEX_BLOCK = 128
"""FlexAttention's default block of queries and keys: every padded size is a multiple of it."""


@dataclass(frozen=True, kw_only=True)
class ShapeSizes:
    """The context widths and anchor counts a batch is padded up to (ascending)."""

    widths: tuple[int, ...]
    anchors: tuple[int, ...]

    @property
    def max_variants(self) -> int:
        """The most (width, anchor count) pairs a run can produce (rows per batch vary too:
        dynamo compiles that dimension dynamic once it has seen two values)."""
        return len(self.widths) * len(self.anchors)

    def width(self, width: int) -> int:
        """The smallest width size >= ``width`` (``width`` itself beyond the largest)."""
        return next((w for w in self.widths if w >= width), width)

    def anchor_count(self, count: int) -> int:
        """The smallest anchor count size >= ``count`` (``count`` itself beyond the largest)."""
        return next((n for n in self.anchors if n >= count), count)

    def describe(self) -> str:
        """One line for the start-up output."""
        return (f"context widths {list(self.widths)} x anchor counts {list(self.anchors)}: "
                f"at most {self.max_variants} (width, anchors) pairs")


def shape_sizes(*, max_width: int, num_anchors: int, block_size: int) -> ShapeSizes:
    """The sizes of a run whose batches are at most ``max_width`` tokens wide with at most
    ``num_anchors`` anchors of ``block_size`` tokens.

    Widths: ``128 * 2**k`` up to ``max_width`` rounded up to 128 (one per doubling: a padded
    context position costs the drafter about 2% of what a target position costs). Anchor
    counts: two per doubling (1x and 1.5x, so at most 1.5x the blocks), each a multiple of
    the count whose blocks fill whole 128-token query blocks, up to ``num_anchors`` rounded up
    to that multiple.
    """
    top_width = math.ceil(max_width / FLEX_BLOCK) * FLEX_BLOCK
    widths = [FLEX_BLOCK * 2 ** k for k in range(int(math.log2(top_width / FLEX_BLOCK)) + 1)]
    widths = sorted({w for w in widths if w < top_width} | {top_width})
    unit = FLEX_BLOCK // math.gcd(FLEX_BLOCK, block_size)
    top_anchors = math.ceil(num_anchors / unit) * unit
    anchors = {top_anchors}
    scale = 1
    while unit * scale < top_anchors:
        anchors.update(n for n in (unit * scale, unit * scale * 3 // 2)
                       if n < top_anchors and n % unit == 0)
        scale *= 2
    return ShapeSizes(widths=tuple(widths), anchors=tuple(sorted(anchors)))


@dataclass(frozen=True, kw_only=True)
class PaddedBlocks:
    """A batch's anchors and context padded to :class:`ShapeSizes`."""

    anchors: torch.Tensor
    """``[B, N']``: the real anchors, then anchor 0 for the padding."""
    keep: torch.Tensor
    """``[B, N']``: False on the padding."""
    context: torch.Tensor
    """``[B, W', K*H]``: the target features, then zeros."""
    num_anchors: int
    """N, the real anchor count: the drafter's output keeps the first N blocks."""


def pad_blocks(sizes: ShapeSizes, anchors: torch.Tensor, keep: torch.Tensor,
               context: torch.Tensor) -> PaddedBlocks:
    """``anchors``/``keep`` ``[B, N]`` and ``context`` ``[B, W, K*H]`` padded up to ``sizes``."""
    num, width = anchors.shape[1], context.shape[1]
    extra_anchors = sizes.anchor_count(num) - num
    extra_width = sizes.width(width) - width
    return PaddedBlocks(anchors=F.pad(anchors, (0, extra_anchors)),
                        keep=F.pad(keep, (0, extra_anchors)),
                        context=F.pad(context, (0, 0, 0, extra_width)), num_anchors=num)
