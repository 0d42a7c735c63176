"""The drafter's training step: loss -> backward -> clip -> AdamW -> schedule, with metrics.

Runs on the main thread, called by the trainer for each input the target stage delivers. Every statistic stays on the
device as a running sum; the only host syncs are in :meth:`get_metrics` (log steps) and in
the periodic non-finite check, so the GPU queue never drains inside the hot path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from dflash_trainer.config import TrainingConfig
from dflash_trainer.core.distributed import (
    CollectiveTimer, DistInfo, all_reduce_sum, gradient_sync, replicated_value)
from dflash_trainer.model.batch import Batch, StepInput
from dflash_trainer.model.loss import BACKBONE_METRICS, LossSums, MetricSpec
from dflash_trainer.training.optim import LRSchedule, step_unless
from dflash_trainer.training.pipeline.metrics import Max, MeanSpread, Metric, Ratio, Sum


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient norm.

    The trainer turns it into the run's result (a checkpoint and one line naming the source,
    :class:`~dflash_trainer.core.errors.DivergedError`); this carries what it needs for that.
    """

    def __init__(self, message: str, *, first_step: int, last_step: int, features_nonfinite: bool) -> None:
        super().__init__(message)
        self.first_step = first_step
        """The first optimizer step of the non-finite run (1-based, as logged)."""
        self.last_step = last_step
        self.features_nonfinite = features_nonfinite
        """Whether the target's features held a NaN or inf at a real token during the run (this rank)."""


def features_nonfinite(item: StepInput) -> torch.Tensor:
    """Whether the target's outputs of ``item`` hold a NaN or inf at a token of the batch (a
    device bool; padding is left out: it never reaches the loss)."""
    valid = item.batch.attention_mask.bool()
    bad = torch.zeros((), dtype=torch.bool, device=valid.device)
    for values in (item.target.features, item.target.final_hidden):
        if values is not None:
            # A token's sum is non-finite iff one of its values is (short of a float32 overflow,
            # itself a divergence); a [B, S] temporary instead of a bool copy of the features.
            sums = values.sum(dim=-1, dtype=torch.float32)
            bad = bad | (~torch.isfinite(sums) & valid).any()
    return bad


class DrafterStep:
    """The drafter's training step: owns its optimizer step and its windowed training metrics.

    One call of :meth:`train_micro_batch` per micro-batch; every ``grad_accum`` calls make
    one optimizer step. The objective returns sums; the loss backpropagated is the
    micro-batch's weighted loss sum divided by its weight sum over all data-parallel ranks
    (one all-reduce), so the gradient does not depend on how tokens fall across ranks.
    """

    def __init__(self, *, objective: torch.nn.Module, parameters: list[torch.nn.Parameter],
                 optimizer: torch.optim.Optimizer, schedule: LRSchedule, cfg: TrainingConfig,
                 dist_info: DistInfo, block_size: int, autocast_dtype: torch.dtype | None,
                 flops_fn: Callable[[Batch], float] | None = None,
                 peak_flops: float | None = None) -> None:
        self.objective = objective
        self.parameters = parameters
        self.optimizer = optimizer
        self.schedule = schedule
        self.last_lr = schedule.lr
        """The lr of the last optimizer step (``train/lr``; before the first, the first's)."""
        self.cfg = cfg
        self.dist = dist_info
        self.device = dist_info.device
        self.autocast_dtype = autocast_dtype
        self.flops_fn = flops_fn
        """Model FLOPs of one micro-batch (from host-side shapes: no device sync)."""
        self._flops = 0.0
        self.peak_flops = peak_flops
        self.optimizer_step = 0
        """Optimizer steps taken (skipped non-finite steps included)."""
        self.micro_step = 0
        self.last_epoch = 0
        self.total_skipped = 0
        slots = cfg.loss_slots or block_size - 1
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, device=self.device, dtype=torch.float64)
        # Window sums of the objective, by the names LossSums gives them: the backbone's from
        # the start, a variant's from the first micro-batch that reports them.
        self._sums = {name: zeros(*shape) for name, shape in LossSums.backbone_shapes(slots).items()}
        self._metric_specs: tuple[MetricSpec, ...] = BACKBONE_METRICS
        # Window sums of the optimizer step.
        self._step_sums = {name: zeros() for name in ("grad_norm", "grad_norm_max", "skipped")}
        self._tokens = 0
        self._samples = 0
        # (weighted loss sum, weight sum) since the last checkpoint, for "best" checkpoints.
        self._since_checkpoint = zeros(2)
        self._consecutive_bad = torch.zeros((), device=self.device, dtype=torch.int64)
        # Whether the features of this step's micro-batches, and of the current run of
        # non-finite steps, were non-finite: names the source when the run diverges.
        self._step_bad_features = torch.zeros((), device=self.device, dtype=torch.bool)
        self._run_bad_features = torch.zeros((), device=self.device, dtype=torch.bool)
        self._window_steps = 0
        self._window_start = time.perf_counter()
        self._step_time = 0.0
        self._wait_time = 0.0
        self._weight_reduce = CollectiveTimer(self.device)
        self._check_every = max(1, min(cfg.max_nonfinite_steps, 10))

    def note_wait(self, seconds: float) -> None:
        """Record time spent waiting for the next input (for perf/data_wait_frac)."""
        self._wait_time += seconds

    def train_micro_batch(self, item: StepInput) -> bool:
        """Forward + backward of one micro-batch; steps the optimizer every grad_accum calls.

        Returns whether this call took an optimizer step.
        """
        start = time.perf_counter()
        if item.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(item.ready)
            for tensor in item.tensors():
                tensor.record_stream(stream)
        batch = item.batch
        with torch.no_grad():
            self._step_bad_features |= features_nonfinite(item)
        # Gradients are reduced across ranks only on the micro-batch that ends a step.
        last_micro = (self.micro_step + 1) % self.cfg.grad_accum == 0
        with gradient_sync(self.objective, last_micro):
            with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                                enabled=self.autocast_dtype is not None):
                sums: LossSums = self.objective(batch, item.target, self.optimizer_step)
            # The one division: by the weight of this micro-batch over every rank (one
            # all-reduce, which is also where ranks wait for the slowest). DDP and FSDP
            # average gradients over ranks, hence the world_size factor.
            global_weight = self._weight_reduce.all_reduce_sum(sums.weight.detach().clone())
            scale = self.dist.world_size / (global_weight.clamp_min(1e-6) * self.cfg.grad_accum)
            (sums.objective() * scale).backward()
        self._accumulate(sums, batch)
        if self.flops_fn is not None:
            self._flops += self.flops_fn(batch)
        self.micro_step += 1
        self.last_epoch = batch.epoch
        if last_micro:
            self._optimizer_step()
        self._step_time += time.perf_counter() - start
        return last_micro

    def _accumulate(self, sums: LossSums, batch: Batch) -> None:
        with torch.no_grad():
            # A non-finite micro-batch is skipped by the optimizer; keep it out of the means.
            loss = sums.loss.detach().double()
            finite = torch.isfinite(loss)
            loss = torch.where(finite, loss, 0)
            weight = torch.where(finite, sums.weight.double(), 0)
            self._since_checkpoint += torch.stack((loss, weight))
            self._add("loss", loss)
            self._add("weight", weight)
            for name, term in sums.terms.items():
                term = term.detach().double()
                self._add(name, torch.where(torch.isfinite(term), term, 0))
            for name, count in sums.count_sums().items():
                self._add(name, count.double())
            self._metric_specs = sums.metrics
        self._tokens += batch.num_tokens
        self._samples += batch.seq_lens.numel()

    def _add(self, name: str, value: torch.Tensor) -> None:
        window = self._sums.get(name)
        if window is None:
            self._sums[name] = value.clone()
        else:
            window += value

    def _optimizer_step(self) -> None:
        grad_norm = replicated_value(torch.nn.utils.clip_grad_norm_(
            self.parameters, self.cfg.grad_clip, foreach=True))
        bad = ~torch.isfinite(grad_norm)
        step_unless(self.optimizer, bad)
        self.optimizer.zero_grad(set_to_none=True)
        # The metric is the lr this step used: the schedule now holds the next step's, which
        # after the last step is min_lr and would read as a step trained at it.
        self.last_lr = self.schedule.lr
        self.schedule.step()
        with torch.no_grad():
            good = ~bad
            self._step_sums["grad_norm"] += torch.where(good, grad_norm, 0).double()
            self._step_sums["grad_norm_max"].copy_(torch.maximum(
                self._step_sums["grad_norm_max"], torch.where(good, grad_norm, 0).double()))
            self._step_sums["skipped"] += bad.double()
            self._consecutive_bad.copy_((self._consecutive_bad + 1) * bad.long())
            self._run_bad_features.copy_(bad & (self._run_bad_features | self._step_bad_features))
            self._step_bad_features.zero_()
        self.optimizer_step += 1
        self._window_steps += 1
        if self.optimizer_step % self._check_every == 0:
            self.check_nonfinite()

    def check_nonfinite(self) -> None:
        """Host sync: stop the run after ``max_nonfinite_steps`` bad steps in a row."""
        bad_run = int(self._consecutive_bad)
        if bad_run >= self.cfg.max_nonfinite_steps:
            first = self.optimizer_step - bad_run + 1
            raise NonFiniteError(
                f"{bad_run} consecutive optimizer steps had a non-finite loss or gradient norm "
                f"(steps {first}-{self.optimizer_step}); lower training.lr, check the data, or "
                f"raise training.max_nonfinite_steps",
                first_step=first, last_step=self.optimizer_step,
                features_nonfinite=bool(self._run_bad_features))

    def loss_since_checkpoint(self) -> float | None:
        """Mean train loss (all ranks) since the previous call; None if nothing was trained.

        One host sync and, with several ranks, one all-reduce: call it on every rank at
        checkpoint time only.
        """
        sums = all_reduce_sum(self._since_checkpoint.clone())
        self._since_checkpoint.zero_()
        loss, weight = sums.tolist()
        return loss / weight if weight > 0 else None

    def get_metrics(self) -> dict[str, Metric]:
        """Window metrics since the last call (one host sync); resets the window.

        Loss and accuracies are :class:`Ratio` s of window sums, so the monitor's cross-rank
        combine gives the ratio over every rank's tokens; grad norms, the LR and the skip
        count are the same on every rank (gradients are reduced).
        """
        now = time.perf_counter()
        window = max(now - self._window_start, 1e-9)
        sums, step_sums = _to_host(self._sums, self._step_sums)
        steps = max(self._window_steps, 1)
        skipped = step_sums["skipped"]
        good_steps = max(self._window_steps - skipped, 1)
        self.total_skipped += int(skipped)
        metrics: dict[str, Metric] = _ratios(self._metric_specs, sums)
        metrics |= {
            "train/grad_norm": step_sums["grad_norm"] / good_steps,
            "train/grad_norm_max": Max(step_sums["grad_norm_max"]),
            "train/lr": self.last_lr,
            "train/skipped_nonfinite": float(self.total_skipped),
            "train/step": float(self.optimizer_step),
            "train/tokens": Sum(float(self._tokens)),
            "train/samples": Sum(float(self._samples)),
            "perf/step_time_s": MeanSpread(self._step_time / steps, "perf/step_time_spread_s"),
            "perf/data_wait_frac": self._wait_time / window,
        }
        if self.dist.enabled:
            metrics["perf/allreduce_wait_s"] = self._weight_reduce.collect() / steps
        if self.flops_fn is not None:
            metrics["perf/tflops"] = self._flops / window / 1e12
            if self.peak_flops:
                metrics["perf/mfu"] = self._flops / window / self.peak_flops
        self._reset_window(now)
        return metrics

    def _reset_window(self, now: float) -> None:
        for value in (*self._sums.values(), *self._step_sums.values()):
            value.zero_()
        self._tokens = 0
        self._samples = 0
        self._flops = 0.0
        self._window_steps = 0
        self._step_time = 0.0
        self._wait_time = 0.0
        self._window_start = now

    def state_dict(self) -> dict[str, Any]:
        """The step counters (the weights, the optimizer and the LR schedule save their own)."""
        return {
            "optimizer_step": self.optimizer_step,
            "micro_step": self.micro_step,
            "last_epoch": self.last_epoch,
            "total_skipped": self.total_skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.optimizer_step = int(state["optimizer_step"])
        self.micro_step = int(state["micro_step"])
        self.last_epoch = int(state["last_epoch"])
        self.total_skipped = int(state["total_skipped"])


def _to_host(*windows: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Each window's sums as floats (a 0-d sum) or lists of floats (one per block slot), with
    one host sync for them all."""
    values = iter(torch.cat([t.reshape(-1) for w in windows for t in w.values()]).tolist())
    return [{name: next(values) if t.dim() == 0 else [next(values) for _ in range(t.numel())]
             for name, t in w.items()} for w in windows]


def _ratios(specs: tuple[MetricSpec, ...], sums: dict[str, Any]) -> dict[str, Metric]:
    """The metrics ``specs`` declares over the window ``sums``: ``name`` for a sum of one value,
    ``name`` with ``{k}`` set to the block slot for a per-slot sum."""
    metrics: dict[str, Metric] = {}
    for spec in specs:
        numerator, denominator = sums.get(spec.numerator), sums.get(spec.denominator)
        if numerator is None or denominator is None:
            continue  # a variant's sums before its first micro-batch
        if not isinstance(numerator, list):
            metrics[spec.name] = Ratio(numerator, denominator)
        else:
            for k, (num, den) in enumerate(zip(numerator, denominator), start=1):
                assert "{k}" in spec.name, f"{spec.name}: a per-slot metric names its slot field {{k}}"
                metrics[spec.name.format(k=k)] = Ratio(num, den)
    return metrics
