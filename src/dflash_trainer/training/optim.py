"""Optimizer and learning-rate schedule of the drafter (reference: AdamW, 4% warmup, cosine)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from dflash_trainer.config import TrainingConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainingConfig) -> torch.optim.AdamW:
    """AdamW with the configured hyper-parameters (what the config says is what it uses)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("the drafter has no trainable parameters")
    # The fused kernel (CPU and CUDA) reads ``optimizer.found_inf`` and skips a non-finite
    # step on the device, so skipping needs no host sync.
    return torch.optim.AdamW(trainable, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, fused=True)


def step_unless(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    """``optimizer.step()``, skipped on the device where the 0-d bool ``bad`` is true.

    The fused AdamW of :func:`build_optimizer` reads ``found_inf`` (the attribute
    ``torch.amp.GradScaler`` sets) and leaves parameters, moments and step counts as they
    were, so a non-finite step is skipped with no host sync.
    """
    optimizer.found_inf = bad.to(torch.float32)  # type: ignore[attr-defined]
    optimizer.step()


def lr_at(step: int, *, total_steps: int, cfg: TrainingConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then decay to min_lr."""
    if cfg.warmup_steps is not None:
        warmup = cfg.warmup_steps
    else:
        warmup = max(1, math.ceil(cfg.warmup_ratio * total_steps)) if cfg.warmup_ratio > 0 else 0
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.schedule == "constant":
        return cfg.lr
    decay_steps = max(1, total_steps - warmup)
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_ratio * decay_steps))
        warmup = max(warmup, total_steps - decay_steps)
    progress = min(1.0, max(0.0, (step - warmup) / decay_steps))
    if cfg.schedule in ("linear", "wsd"):
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor


class LRSchedule:
    """Sets the optimizer's lr before each step; stateful for exact resume."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, total_steps: int,
                 cfg: TrainingConfig) -> None:
        self.optimizer = optimizer
        self.total_steps = total_steps
        self.cfg = cfg
        self.step_count = 0
        self._apply()

    def _apply(self) -> None:
        lr = lr_at(self.step_count, total_steps=self.total_steps, cfg=self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        """The lr the next optimizer step will use."""
        return self.optimizer.param_groups[0]["lr"]

    def step(self) -> None:
        """Advance one optimizer step."""
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict:
        """Position in the schedule (the schedule itself is a function of the config)."""
        return {"step_count": self.step_count, "total_steps": self.total_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; the total comes from the checkpoint so the curve is unchanged."""
        self.step_count = int(state["step_count"])
        self.total_steps = int(state["total_steps"])
        self._apply()
