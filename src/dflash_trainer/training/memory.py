"""What a run will hold in memory, said before its first step, and what it held, said after.

:func:`estimate_memory` adds up the drafter's float32 weights, their gradients and the AdamW
state (two float32 moments per weight), the target's weights as they are loaded on this rank,
and the activations of one step at ``pipeline.tokens_per_batch``: the target's forward (one
layer's intermediates, its attention scores, the logits when the labels come from the target),
the tapped features in flight between the target stage and the drafter, the drafter's
activations kept for the backward pass and one LM-head loss chunk. It is an estimate of the
peak, not a bound: allocator caches and the libraries come on top.

:func:`measured_peak` reads what the process held: the CUDA allocator's peak on a GPU, the peak
resident set size above the one at start-up on a CPU.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dflash_trainer.config import DataConfig, PipelineConfig, TrainingConfig
from dflash_trainer.core.units import format_bytes, format_count

__all__ = ["MemoryEstimate", "current_rss", "estimate_memory", "measured_peak", "peak_line", "reset_peak"]

_FP32 = 4
_ADAM_MOMENTS = 2


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """The parts of one rank's estimated peak memory, in bytes."""

    drafter_params: int
    weights: int
    """The drafter's float32 master weights."""
    grads: int
    optimizer: int
    """AdamW's two float32 moments per weight."""
    target: int
    """The target's weights (and buffers) as loaded on this rank; 0 when none are loaded."""
    activations: int
    """One step's activations at ``tokens_per_batch``."""
    tokens_per_batch: int

    @property
    def total(self) -> int:
        """The estimated peak of one step."""
        return self.weights + self.grads + self.optimizer + self.target + self.activations

    def describe(self) -> str:
        """One console line: each part and the estimated peak per step."""
        target = f", target weights {format_bytes(self.target)}" if self.target else ""
        return (f"memory: drafter {format_count(self.drafter_params)} parameters ({format_bytes(self.weights)} "
                f"float32) + gradients {format_bytes(self.grads)} + AdamW state {format_bytes(self.optimizer)}"
                f"{target}, activations about {format_bytes(self.activations)} at {self.tokens_per_batch} tokens "
                f"per batch: estimated peak {format_bytes(self.total)} per step")


def module_bytes(module: nn.Module | None) -> int:
    """Bytes of a module's parameters and buffers as they are stored (0 for None or meta tensors)."""
    if module is None:
        return 0
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")


def _activations(drafter: nn.Module, target_config: object, *, data: DataConfig, training: TrainingConfig,
                 pipeline: PipelineConfig, compute_bytes: int, runs_target: bool) -> int:
    c = drafter.config
    tokens = pipeline.tokens_per_batch
    length = min(data.max_length, tokens)
    rows = max(1, tokens // length)
    hidden, inter = c.hidden_size, c.intermediate_size
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    taps = len(drafter.target_layer_ids)
    block = int(drafter.block_size)
    slots = training.loss_slots or block - 1
    vocab = int(getattr(drafter, "draft_vocab_size", None) or c.vocab_size)
    anchors = min(training.num_anchors * rows, tokens)
    queries = anchors * block
    # The tapped features: in the queue, in the drafter step, and being produced.
    features = tokens * taps * hidden * compute_bytes * (pipeline.feature_queue_size + 2)
    target = 0
    if runs_target:
        t_hidden = getattr(target_config, "hidden_size", hidden)
        t_inter = getattr(target_config, "intermediate_size", inter)
        t_heads = getattr(target_config, "num_attention_heads", heads)
        target = tokens * (4 * t_hidden + 3 * t_inter + length * t_heads) * compute_bytes
        if training.labels != "data":  # the target's logits give the labels or the distribution
            target += tokens * int(getattr(target_config, "vocab_size", vocab)) * compute_bytes
    layers = int(c.num_hidden_layers)
    per_layer = (queries * (6 * hidden + 4 * inter + heads * (length + block))
                 + tokens * 2 * kv_heads * head_dim) * compute_bytes
    context = tokens * (taps + 1) * hidden * compute_bytes
    chunk = min(training.loss_chunk_size, anchors * slots)
    loss = 3 * chunk * vocab * _FP32  # logits, their softmax and its gradient
    return features + target + layers * per_layer + context + loss


def estimate_memory(drafter: nn.Module, target: nn.Module | None, *, data: DataConfig, training: TrainingConfig,
                    pipeline: PipelineConfig, compute_dtype: torch.dtype, runs_target: bool) -> MemoryEstimate:
    """The estimated peak memory of one training step on this rank (see the module's docstring).

    ``target``: the target's modules loaded on this rank (the whole target, or only its
    embedding and LM head with a feature store); ``runs_target``: whether this rank runs its
    forward (not with a feature store or an engine-served target).
    """
    params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    weights = params * _FP32
    compute_bytes = torch.empty((), dtype=compute_dtype).element_size()
    target_config = getattr(target, "config", None)
    target_config = getattr(target_config, "get_text_config", lambda **_: target_config)(decoder=True)
    activations = _activations(drafter, target_config, data=data, training=training, pipeline=pipeline,
                               compute_bytes=compute_bytes, runs_target=runs_target)
    return MemoryEstimate(drafter_params=params, weights=weights, grads=weights,
                          optimizer=_ADAM_MOMENTS * weights, target=module_bytes(target),
                          activations=activations, tokens_per_batch=pipeline.tokens_per_batch)


def current_rss() -> int:
    """This process's resident set size now, in bytes (0 where /proc is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * resource.getpagesize()


def reset_peak() -> None:
    """Start the measured peak anew: the CUDA allocator's, and on Linux the resident set's
    high-water mark (``/proc/self/clear_refs``), so that the loading before the first step
    (a target converted, a data file parsed) does not count as the step's."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux, or not permitted: the peak then covers the whole process


def _peak_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB on Linux


def measured_peak(device: torch.device, *, rss_at_start: int) -> tuple[int, str]:
    """(bytes, what they are) of the peak this process held for training since :func:`reset_peak`:
    the CUDA allocator's peak on a GPU, else the peak resident set size above ``rss_at_start``
    (the process before the run loaded anything: Python and its libraries)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "peak CUDA memory allocated"
    return (max(0, _peak_rss() - rss_at_start),
            f"peak resident memory while training, above the {format_bytes(rss_at_start)} before loading")


def peak_line(estimate: MemoryEstimate, peak: tuple[int, str]) -> str:
    """One console line: the measured peak (:func:`measured_peak`) beside the estimate of the
    run's start."""
    peak_bytes, what = peak
    ratio = f", {peak_bytes / estimate.total:.2f}x the estimate" if estimate.total else ""
    return f"memory: {what}: {format_bytes(peak_bytes)} (estimated {format_bytes(estimate.total)}{ratio})"
