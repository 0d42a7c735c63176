"""torch.distributed in one place: process group, device, drafter wrapping, metric reduction.

Launched by torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the environment) or as a
single process. gloo on CPU, NCCL on GPU. Model code stays single-device; wrapping happens
here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash_trainer.config import DistributedConfig, PipelineConfig


@dataclass(kw_only=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 writes trackers, exports and checkpoint weights."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """A process group with more than one rank exists."""
        return self.world_size > 1


def resolve_device(pipeline: PipelineConfig, local_rank: int = 0) -> torch.device:
    """``pipeline.device``: auto picks CUDA when available."""
    if pipeline.device == "cuda" or (pipeline.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("pipeline.device=cuda but no CUDA device is available; "
                             "use pipeline.device=auto or cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(pipeline: PipelineConfig, cfg: DistributedConfig) -> DistInfo:
    """Join the torchrun process group if launched by torchrun; otherwise single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(pipeline, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = cfg.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl" and device.type != "cuda":
            raise ValueError("distributed.backend=nccl needs CUDA devices; use gloo on CPU")
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=30), **kwargs)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def close_distributed() -> None:
    """Destroy the process group (idempotent)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def wrap_drafter(module: torch.nn.Module, info: DistInfo, cfg: DistributedConfig) -> torch.nn.Module:
    """DDP by default; FSDP2 ``fully_shard`` per decoder layer when asked."""
    if not info.enabled:
        return module
    if cfg.drafter == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in getattr(module, "layers", []):
            fully_shard(layer)
        fully_shard(module)
        return module
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    # Loss normalisation is global (see DrafterTrainLoop), so DDP's gradient averaging is
    # undone by scaling the loss by world_size there; broadcast_buffers is off because the
    # drafter's buffers (rotary tables) are constants.
    return torch.nn.parallel.DistributedDataParallel(
        module, device_ids=device_ids, broadcast_buffers=False)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum across ranks (no-op in a single process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def reduce_metrics(metrics: dict[str, float], info: DistInfo) -> dict[str, float]:
    """Reduce a metrics dict across ranks at log time only.

    Keys ending in ``_max`` take the max; token, sample and skip counters sum; everything
    else (rates, fractions, per-rank dispatch counts, which are equal on step-aligned ranks)
    is averaged. Adds the per-rank spread of step time (straggler wait).
    """
    if not info.enabled:
        return metrics
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    gathered = [torch.zeros_like(values) for _ in range(info.world_size)]
    dist.all_gather(gathered, values)
    stacked = torch.stack(gathered)
    out: dict[str, float] = {}
    for i, key in enumerate(keys):
        column = stacked[:, i]
        if key.endswith("_max"):
            out[key] = float(column.max())
        elif key.endswith(("/tokens", "/samples", "skipped_nonfinite")):
            out[key] = float(column.sum())
        else:
            out[key] = float(column.mean())
        if key == "perf/step_time_s":
            out["perf/step_time_spread_s"] = float(column.max() - column.min())
    return out
