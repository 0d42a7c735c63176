"""Optimizer and learning-rate schedule of the drafter (reference: AdamW, 4% warmup, cosine)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

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
    """Sets the optimizer's lr before each step; stateful for exact resume.

    The curve is :func:`lr_at` over ``total_steps`` schedule steps. Optimizer step ``k`` sits
    at schedule position ``anchor_position + (k - anchor_step) * pace``: ``k`` itself in a run
    that never re-planned its schedule. A resume on another world size or with another end
    (:func:`rescaled`) moves the anchor to the run's progress in samples on the curve of an
    uninterrupted run of the new size and end, and sets the pace so that the run's last step is
    the curve's last.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, total_steps: int,
                 cfg: TrainingConfig, state: dict[str, Any] | None = None) -> None:
        self.optimizer = optimizer
        self.total_steps = total_steps
        """Length of the curve in schedule steps."""
        self.cfg = cfg
        self.step_count = 0
        self.anchor_step = 0
        self.anchor_position = 0.0
        self.pace = 1.0
        """Schedule steps per optimizer step (1 unless the world size changed)."""
        if state is not None:
            self.load_state_dict(state)
        self.apply()

    def position(self, step: int) -> float:
        """Schedule position of optimizer step ``step`` (0-based)."""
        return schedule_position(self.state_dict(), step)

    @property
    def end_step(self) -> int:
        """The optimizer step at which the curve ends (its lr is then ``min_lr``)."""
        return schedule_end(self.state_dict())

    def apply(self) -> None:
        """Set the optimizer's lr to this position's; again after loading an optimizer state,
        which brings the lr it was saved with (a resume that changed ``training.lr`` or the
        run's end must train its first step at the new curve's lr)."""
        lr = schedule_lr(self.state_dict(), self.step_count, cfg=self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        """The lr the next optimizer step will use."""
        return self.optimizer.param_groups[0]["lr"]

    def step(self) -> None:
        """Advance one optimizer step."""
        self.step_count += 1
        self.apply()

    def state_dict(self) -> dict[str, Any]:
        """Position in the schedule (the schedule itself is a function of the config)."""
        return {"step_count": self.step_count, "total_steps": self.total_steps,
                "anchor_step": self.anchor_step, "anchor_position": self.anchor_position,
                "pace": self.pace}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position and the curve of :meth:`state_dict`, so the curve is unchanged."""
        self.step_count = int(state["step_count"])
        self.total_steps = int(state["total_steps"])
        self.anchor_step = int(state.get("anchor_step", 0))
        self.anchor_position = float(state.get("anchor_position", 0.0))
        self.pace = float(state.get("pace", 1.0))
        self.apply()


def schedule_position(state: dict[str, Any], step: int) -> float:
    """Schedule position of optimizer step ``step`` (0-based) for the :class:`LRSchedule` state
    ``state``."""
    anchor_step, anchor_position = int(state.get("anchor_step", 0)), float(state.get("anchor_position", 0.0))
    pace = float(state.get("pace", 1.0))
    if anchor_step == 0 and anchor_position == 0 and pace == 1:
        return step  # the exact integer step of a run that never re-planned its schedule
    return anchor_position + (step - anchor_step) * pace


def schedule_end(state: dict[str, Any]) -> int:
    """The optimizer step at which the curve of the :class:`LRSchedule` state ``state`` ends."""
    anchor_step, pace = int(state.get("anchor_step", 0)), float(state.get("pace", 1.0))
    if pace <= 0:
        return anchor_step
    return anchor_step + round((int(state["total_steps"]) - float(state.get("anchor_position", 0.0))) / pace)


def schedule_lr(state: dict[str, Any], step: int, *, cfg: TrainingConfig) -> float:
    """The lr of optimizer step ``step`` (0-based) on the curve of the :class:`LRSchedule` state
    ``state`` under ``cfg`` (what a resume prints before anything is built)."""
    return lr_at(schedule_position(state, step), total_steps=int(state["total_steps"]), cfg=cfg)


def rescaled(*, step: int, progress: float, total_steps: int, end_step: int) -> dict[str, Any]:
    """The :class:`LRSchedule` state of a run resumed at optimizer step ``step`` on another world
    size or with another end (``training.max_steps`` or ``training.epochs`` changed), having
    trained the fraction ``progress`` of its samples.

    ``total_steps``: the steps of an uninterrupted run of the new world size and end, whose
    curve the rest of the run follows from where that run would stand after the same samples;
    ``end_step``: the step this run ends at, which lands on the curve's end. So warmup, decay
    and the final lr come where the uninterrupted run has them, instead of the checkpoint's
    curve running out early (more ranks, a longer run: steps at ``min_lr``) or late (fewer
    ranks, a shorter run: no decay).
    """
    position = min(max(progress, 0.0), 1.0) * total_steps
    pace = (total_steps - position) / max(1, end_step - step)
    return {"step_count": step, "total_steps": total_steps, "anchor_step": step,
            "anchor_position": position, "pace": pace}
