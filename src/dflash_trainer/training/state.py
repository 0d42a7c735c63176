"""The training state as stateful objects, each saving and loading its own state.

:meth:`Trainer.state_dict() <dflash_trainer.training.trainer.Trainer.state_dict>` is a dict of
the objects below; one ``dcp.save`` writes them into a checkpoint's ``train/`` folder and one
``dcp.load`` reads them back (DCP calls ``state_dict()`` for the template and
``load_state_dict()`` after the read):

========== ============================================================= ======================
key        object                                                        written by
========== ============================================================= ======================
drafter    the drafter's weights (DCP's ``get/set_model_state_dict``)    every rank, its part
optimizer  AdamW (DCP's ``get/set_optimizer_state_dict``)                every rank, its part
schedule   the LR schedule                                               rank 0
counters   the drafter step's counters                                   rank 0
data       the prefetcher's position, keyed per rank (``rank-R``)        each rank its own
monitor    the run totals                                                rank 0
rng        Python, NumPy, torch (and CUDA) RNG streams, keyed per rank   each rank its own
run        step, epoch, config, world size, resizes, data identity,      rank 0
           best checkpoint, tracker run id
========== ============================================================= ======================

Tensors are DCP items of their own (under DDP each replicated tensor is written by one rank,
see ``checkpoint.local_part``). The state of every other object is one JSON text, one DCP
item, so that its shape need not match between the run that saved it and the one that loads
it (the monitor's totals grow with the buckets seen, the best checkpoint may be unset).
"""

from __future__ import annotations

import json
import random
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

__all__ = ["JSON_SECTIONS", "PER_RANK", "DrafterWeights", "JsonState", "OptimizerState", "RngStreams",
           "rank_key"]

JSON_SECTIONS = ("schedule", "counters", "data", "monitor", "rng", "run")
"""The keys of the state whose objects save one JSON text (per rank or for all)."""
PER_RANK = frozenset({"data", "rng"})
"""The keys whose objects every rank saves for itself (under ``rank-R``); rank 0 alone saves
the others' JSON."""


def rank_key(rank: int) -> str:
    """The key of rank ``rank``'s part of a per-rank object."""
    return f"rank-{rank}"


class HasState(Protocol):
    """An object that saves and loads its own state as JSON values."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class JsonState:
    """``source``'s state as one JSON text: ``{"all": text}``, or ``{"rank-R": text}`` for a
    per-rank object of rank ``rank``."""

    def __init__(self, source: HasState, *, rank: int | None = None) -> None:
        self.source = source
        self.key = "all" if rank is None else rank_key(rank)

    def state_dict(self) -> dict[str, str]:
        """The source's state, as JSON."""
        return {self.key: json.dumps(self.source.state_dict())}

    def load_state_dict(self, state: dict[str, str]) -> None:
        """Load the JSON of :meth:`state_dict` into the source."""
        self.source.load_state_dict(json.loads(state[self.key]))


class DrafterWeights:
    """The drafter's weights as this rank holds them (DTensor shards under FSDP2, whole tensors
    under DDP or alone), keyed by parameter name: live tensors, loaded in place."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        """:func:`~torch.distributed.checkpoint.state_dict.get_model_state_dict`."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:func:`~torch.distributed.checkpoint.state_dict.set_model_state_dict`."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, state)


class OptimizerState:
    """AdamW's moments, step counts and param groups, keyed by parameter name (DTensor shards
    under FSDP2), whatever the wrapping that wrote them."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module = module
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        """:func:`~torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:func:`~torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, state)


class RngStreams:
    """This process's Python, NumPy, torch CPU (and CUDA) random streams."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        """The streams as JSON values (exact: integers, and floats that JSON round-trips)."""
        version, keys, gauss = random.getstate()
        name, mt, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
        state = {"python": [version, list(keys), gauss],
                 "numpy": [name, np.asarray(mt).tolist(), int(pos), int(has_gauss), float(cached)],
                 "torch": torch.get_rng_state().tolist()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device).tolist()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the streams of :meth:`state_dict`."""
        version, keys, gauss = state["python"]
        random.setstate((version, tuple(keys), gauss))
        name, mt, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(mt, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8), self.device)

    def reseed(self, seed: int, step: int, rank: int) -> None:
        """Seed every stream from (seed, step, rank): a rank of a run resumed on another world
        size has no saved streams."""
        value = int(np.random.SeedSequence([seed % 2**63, step, rank]).generate_state(1)[0])
        random.seed(value)
        np.random.seed(value)
        torch.manual_seed(value)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(value)
