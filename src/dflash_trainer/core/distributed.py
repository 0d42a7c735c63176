"""torch.distributed in one place: process group, device, model wrapping, state, metrics.

Launched by torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the environment) or as a
single process. gloo on CPU, NCCL on GPU. Model code stays single-device; wrapping happens
here:

- drafter: DDP (default) or FSDP2 ``fully_shard`` per decoder layer + root, on the default
  process group (all its collectives are issued from the main thread).
- target: replicated (default) or FSDP2 ``fully_shard`` per decoder layer, forward-only, on a
  process group of its own, because its collectives come from the target-stage thread while
  the main thread runs the drafter's; two threads on one group could interleave their
  collectives differently on different ranks and deadlock. The target stages of all ranks
  agree before each forward whether one of them stops (:class:`StopAgreement`), so every
  rank issues the same forwards' collectives.

Checkpoints hold the training state as ``torch.distributed.checkpoint`` shards
(:func:`training_state`, :func:`apply_training_state`): each rank writes and reads only its
part, and a checkpoint loads at any world size and with either wrapping.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:  # annotations only: the core does not depend on the config at run time
    from dflash_trainer.config import DistributedConfig, PipelineConfig

__all__ = ["CollectiveTimer", "DistInfo", "StopAgreement", "all_reduce_sum", "apply_training_state",
           "check_distributed_options", "checkpoint_group", "close_distributed",
           "full_model_state", "gather_objects", "gradient_sync", "init_distributed", "is_dtensor",
           "is_sharded",
           "replicated_value", "resolve_device", "target_load_device", "target_stop_agreement",
           "training_state", "wrap_drafter", "wrap_target"]


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
    """``pipeline.device``: auto picks CUDA when available; rank r uses GPU ``LOCAL_RANK``."""
    if pipeline.device == "cuda" or (pipeline.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("pipeline.device=cuda but no CUDA device is available; "
                             "use pipeline.device=auto or cpu")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but this node has "
                             f"{torch.cuda.device_count()} GPU(s); start at most that many "
                             f"processes per node (torchrun --nproc-per-node)")
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
        backend = _backend(cfg, device)
        kwargs = {"device_id": device} if backend == "nccl" else {}
        # A rank waiting in a collective that another rank never enters fails after
        # distributed.timeout_s with the backend's timeout error, naming the operation.
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=cfg.timeout_s),
                                **kwargs)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def checkpoint_group(info: DistInfo, cfg: DistributedConfig) -> dist.ProcessGroup | None:
    """A gloo process group for the checkpoint writer threads (None in a single process).

    Their ``dcp.save`` collectives run while the training thread runs its own on the default
    group; on one group, the two threads' collectives could interleave differently on
    different ranks and deadlock. gloo, as the snapshots are CPU tensors. Every rank must
    call this at the same point (it creates a group).
    """
    if not info.enabled:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout_s))


def _backend(cfg: DistributedConfig, device: torch.device) -> str:
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("distributed.backend=nccl needs CUDA devices; use gloo (or auto) on CPU")
    return backend


def close_distributed() -> None:
    """Destroy the process groups and free those only reference cycles still hold
    (idempotent).

    Call it once the wrapped models are no longer referenced. FSDP2's modules hold their
    device mesh's group in reference cycles; left to the interpreter's final collection, the
    group's destructor lets gloo's worker threads finish their queue while the interpreter
    finalizes, and a worker releasing a Python-owned tensor must take the GIL, which a
    finalizing interpreter refuses by ending the thread: the rank aborts (SIGABRT,
    "terminate called without an active exception") after a run that succeeded, most
    likely when it exits right after its last collective. Collected here, the destructor
    runs with the interpreter alive and releases the GIL while it waits. (DTensor's
    sharding caches can still hold a mesh, and so its group, until exit; by then its
    workers have long been idle.)
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()


def check_distributed_options(cfg: DistributedConfig, info: DistInfo, *,
                              in_training_eval: bool) -> None:
    """Refuse combinations that cannot work, before anything is built."""
    if not info.enabled:
        return
    sharded = [name for name, value in (("drafter", cfg.drafter), ("target", cfg.target))
               if value == "fsdp"]
    if sharded and in_training_eval:
        raise ValueError(
            f"eval.every_steps is set with distributed.{sharded[0]}=fsdp: the in-training "
            f"evaluation runs on rank 0 alone and cannot run a sharded model; unset "
            f"eval.every_steps and run `dflash-trainer eval` on the exported drafter instead")


# -- wrapping ------------------------------------------------------------------------------


def _decoder_layers(module: nn.Module) -> list[nn.Module]:
    """Blocks of every ``layers`` ModuleList inside ``module`` (the FSDP2 unit of sharding)."""
    return [layer for name, child in module.named_modules()
            if name.rsplit(".", 1)[-1] == "layers" and isinstance(child, nn.ModuleList)
            for layer in child]


def wrap_drafter(module: nn.Module, info: DistInfo, cfg: DistributedConfig) -> nn.Module:
    """DDP by default; FSDP2 ``fully_shard`` per decoder layer, then the root, when asked.

    Both average gradients over ranks; the train loop's loss scaling turns that into the
    global token-weighted mean (see ``DrafterStep``).
    """
    if not info.enabled:
        return module
    if cfg.drafter == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in _decoder_layers(module):
            fully_shard(layer)
        fully_shard(module)
        return module
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    # The drafter's buffers (rotary tables) are constants: no re-sync at every forward.
    return nn.parallel.DistributedDataParallel(module, device_ids=device_ids,
                                               forward_sync_buffers=False)


def target_load_device(info: DistInfo, cfg: DistributedConfig) -> torch.device:
    """Where to load the target: host memory when it will be sharded, else the device."""
    if info.enabled and cfg.target == "fsdp":
        return torch.device("cpu")
    return info.device


def wrap_target(model: nn.Module, info: DistInfo, cfg: DistributedConfig) -> nn.Module:
    """Shard the frozen target's decoder layers (``distributed.target=fsdp``), else no-op.

    Each decoder layer is all-gathered just before its forward and freed right after, so a
    device holds one layer at a time plus 1/world of the others. The embedding, final norm
    and LM head stay whole on every rank: the drafter uses them directly. Layer outputs are
    full activations, so the feature hooks see the same hidden states as without sharding.
    The model must have been loaded on the CPU (:func:`target_load_device`).
    """
    if not info.enabled or cfg.target != "fsdp":
        return model
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    # new_group does not inherit the default group's timeout.
    group = dist.new_group(backend=_backend(cfg, info.device),
                           timeout=timedelta(seconds=cfg.timeout_s))
    mesh = DeviceMesh.from_group(group, info.device.type)
    layers = _decoder_layers(model)
    if not layers:
        raise ValueError(f"distributed.target=fsdp: target {type(model).__name__} has no "
                         f"`layers` ModuleList to shard; use distributed.target=replicate")
    for layer in layers:
        # Every layer is its own FSDP root (nothing above it is sharded); roots keep their
        # parameters gathered after forward unless told otherwise.
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    # The rest (embedding, final norm, LM head, rotary tables) goes to the device whole.
    # Same tensor objects, new storage: tied embeddings stay tied.
    for sub in model.modules():
        for tensor in (*sub._parameters.values(), *sub._buffers.values()):
            if tensor is not None and not is_dtensor(tensor) and tensor.device != info.device:
                tensor.data = tensor.data.to(info.device)
    return model


class StopAgreement:
    """The target stages of all ranks agree, before each forward, whether any of them stops.

    A sharded target all-gathers every layer in its forward, so each rank must run the same
    forwards: a rank that starts one more than its peers waits in an all-gather they never
    enter, until ``distributed.timeout_s``. Each rank's stage ends on its own moment (its
    pipeline stops after the last step, a signal, ``max_time_s``, ``max_steps`` or a step's
    leftover accumulation micro-batches; the main threads agree on the step, not on when
    their stage threads see the stop), so no budget of forwards is known ahead: the stages
    agree on each one. One all-reduce (MAX) of a one-element CPU tensor on a gloo group of
    their own: a host round trip on the target thread (0.6-0.75 ms measured between 2 local
    ranks on a busy 2-core CPU, against ~0.1 s of GPU time for a Qwen3-8B forward at 3072
    tokens), no device sync, so the target stream's queue of queued work never drains for it.
    Only the target-stage thread uses the group: its order is that thread's order.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def any_stops(self, stop: bool) -> bool:
        """Whether any rank passed ``stop=True`` in this round (every rank must call it)."""
        flag = torch.tensor([int(stop)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())


def target_stop_agreement(info: DistInfo, cfg: DistributedConfig) -> StopAgreement | None:
    """The :class:`StopAgreement` of a sharded target (None: replicated or one process).

    Creates a process group: every rank must call it at the same point.
    """
    if not info.enabled or cfg.target != "fsdp":
        return None
    return StopAgreement(dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout_s)))


# -- state -------------------------------------------------------------------------------


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a shard of an FSDP2-sharded tensor, or replicated)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def is_sharded(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a DTensor (FSDP2-sharded)."""
    return any(is_dtensor(p) for p in module.parameters())


def replicated_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor for a replicated DTensor result (e.g. FSDP's clip_grad_norm_); no comm."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def full_model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with sharded tensors gathered into whole CPU tensors.

    Works on any part of a sharded model (the drafter inside the FSDP root). A collective
    (one all-gather per sharded tensor) when ``module`` is sharded: call it on every rank.
    """
    state = module.state_dict()
    if not is_sharded(module):
        return state
    return {key: value.full_tensor().cpu() if is_dtensor(value) else value
            for key, value in state.items()}


def training_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"drafter": weights, "optimizer": AdamW state}`` keyed by parameter name, as this rank
    holds them (DTensor shards under FSDP2, whole tensors under DDP or alone): what DCP saves,
    and the template it loads into. Nothing is copied or gathered."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optim = get_state_dict(module, optimizer)
    return {"drafter": weights, "optimizer": optim}


def apply_training_state(module: nn.Module, optimizer: torch.optim.Optimizer,
                         state: dict[str, Any]) -> None:
    """Load :func:`training_state` (filled by ``dcp.load``) into ``module`` and ``optimizer``."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(module, optimizer, model_state_dict=state["drafter"],
                   optim_state_dict=state["optimizer"])


# -- step-time collectives ---------------------------------------------------------------


@contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce/reduce-scatter inside (accumulation micro-batches).

    Wrap forward AND backward: DDP decides at forward time.
    """
    if enabled:
        yield
    elif isinstance(module, nn.parallel.DistributedDataParallel):
        with module.no_sync():
            yield
    elif hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum across ranks (no-op in a single process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


class CollectiveTimer:
    """Sums the time spent in a per-step all-reduce: the wait for the slowest rank.

    A rank that reaches the all-reduce first waits there for the others, so this is the
    straggler wait, per rank. On CPU the (blocking) call is timed on the host; on CUDA a pair
    of events on the current stream brackets it, read only in :meth:`collect` (log time), so
    the step itself never synchronizes.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """:func:`all_reduce_sum`, timed."""
        if not (dist.is_available() and dist.is_initialized()):
            return tensor
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            all_reduce_sum(tensor)
            end.record()
            self._events.append((start, end))
        else:
            begin = time.perf_counter()
            all_reduce_sum(tensor)
            self._seconds += time.perf_counter() - begin
        return tensor

    def collect(self) -> float:
        """Seconds spent since the previous call (waits for the recorded CUDA events)."""
        seconds = self._seconds
        for start, end in self._events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1000.0
        self._seconds = 0.0
        self._events.clear()
        return seconds


# -- metrics -------------------------------------------------------------------------------


def gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj``, in rank order (one ``all_gather_object``; ``[obj]`` alone).

    The monitor gathers each log step's metric window with it and combines the windows by
    each metric's declared rule (:func:`dflash_trainer.training.pipeline.metrics.combine`).
    """
    if not info.enabled:
        return [obj]
    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, obj)
    return gathered
