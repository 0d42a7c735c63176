"""The batch plan after a resume on another number of ranks.

A checkpoint's data cursor is global: every rank is at the same step of the same epoch plan
(plans are step-aligned, one batch per rank per step). A run resumed with another world size
keeps the interrupted epoch's plan up to the cursor and deals the batches that were still to
be trained, in plan order (step by step, rank by rank), to the new ranks: each new step takes
the next ``world_size`` of them. The batches themselves are unchanged (same samples, same
token budget), so every sample of the epoch is trained exactly once across the change. When
their number is not a multiple of the new world size, the batches with the most samples are
split in two until it is. Later epochs are planned for the new world size as usual.

A step of a resized epoch can hold batches of two neighbouring buckets (where the old plan
moved from one bucket to the next); its ``bucket`` is that of its first batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from dflash_trainer.data.buckets import Plan, Step


def resize_plan(plan: Plan, start: int, world_size: int) -> Plan:
    """``plan`` with its steps from ``start`` on dealt to ``world_size`` ranks (module
    docstring); raises ValueError when the samples left cannot give every rank a batch."""
    left = [(step.bucket, batch) for step in plan.steps[start:] for batch in step.batches]
    short = -len(left) % world_size
    while short:
        splittable = [i for i, (_, batch) in enumerate(left) if len(batch) > 1]
        if not splittable:
            samples = sum(len(batch) for _, batch in left)
            raise ValueError(f"the {samples} sample(s) left in epoch {plan.epoch} cannot give each "
                             f"of the {world_size} ranks a batch at every step")
        # The largest batch, the last of equals: the split stays near the end of the epoch.
        i = max(splittable, key=lambda j: (len(left[j][1]), j))
        bucket, batch = left[i]
        half = (len(batch) + 1) // 2
        left[i:i + 1] = [(bucket, batch[:half]), (bucket, batch[half:])]
        short -= 1
    steps = [Step(left[j][0], tuple(batch for _, batch in left[j:j + world_size]))
             for j in range(0, len(left), world_size)]
    return dataclasses.replace(plan, steps=[*plan.steps[:start], *steps], world_size=world_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resize:
    """A change of world size at ``step`` of ``epoch`` (a resume), from ``old`` to ``new``
    ranks."""

    epoch: int
    step: int
    old: int
    new: int

    def as_dict(self) -> dict[str, int]:
        """For the checkpoint's run record."""
        return dataclasses.asdict(self)


class ResizedPlans:
    """Epoch plans of a run resumed on another world size: ``plans`` (the new world size)
    except for the epoch the resizes happened in, which is its plan for the world size it
    started with, then each resize applied in turn (:func:`resize_plan`).

    Offers what the trainer uses of :class:`~dflash_trainer.training.components.EpochPlans`.
    """

    def __init__(self, plans: Any, resizes: list[Resize],
                 build: Callable[[int, int], Plan]) -> None:
        assert resizes and len({r.epoch for r in resizes}) == 1, resizes
        self.plans = plans
        self.resizes = resizes
        self.epoch = resizes[0].epoch
        self.lengths = plans.lengths
        self._build = build
        self._plan: Plan | None = None

    def __call__(self, epoch: int) -> Plan:
        """The plan of ``epoch``."""
        if epoch != self.epoch:
            return self.plans(epoch)
        if self._plan is None:
            plan = self._build(epoch, self.resizes[0].old)
            for resize in self.resizes:
                plan = resize_plan(plan, resize.step, resize.new)
            self._plan = plan
        return self._plan

    def num_steps(self, epoch: int) -> int:
        """Steps in ``epoch``'s plan."""
        return len(self(epoch)) if epoch == self.epoch else self.plans.num_steps(epoch)

    def total_steps(self, epochs: int) -> int:
        """Steps of epochs ``0 .. epochs - 1``."""
        return sum(self.num_steps(e) for e in range(epochs))

