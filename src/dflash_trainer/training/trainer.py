"""The Trainer: runs a TrainingPipeline over the built components and checkpoints it.

Thread layout per rank: the prefetcher (W workers + dispatcher) and the target stage run
as supervised threads (:class:`~dflash_trainer.training.pipeline.pipeline.TrainingPipeline`); the
drafter step, the monitor, the in-training eval and checkpoint snapshots run on the main
thread between steps; the checkpoint writer has its own thread. See docs/architecture.md.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import yaml

from dflash_trainer.training.checkpoint import (
    TRAIN_DIR, Checkpointer, SaveRequest, load_drafter_weights, local_part, snapshot)
from dflash_trainer.training.components import Components, build, load_inputs
from dflash_trainer.config import Config, config_to_dict, save_config
from dflash_trainer.core.distributed import (
    DistInfo, check_distributed_options, checkpoint_group,
    full_model_state, init_distributed, is_dtensor, is_sharded,
    target_stop_agreement)
from dflash_trainer.core.errors import ConfigError, DivergedError, EngineError, UserError
from dflash_trainer.core.fsutil import disk_error
from dflash_trainer.core.locks import FolderLock, run_folder_lock
from dflash_trainer.model.batch import Batch
from dflash_trainer.model.drafter import drafter_class
from dflash_trainer.training.export import export_drafter, target_record
from dflash_trainer.training.final_eval import (
    EvaluatorFactory, evaluate_final, final_eval_obstacle, holds_part_of_target, load_whole_target)
from dflash_trainer.training.memory import MemoryEstimate, current_rss, estimate_memory, measured_peak, reset_peak
from dflash_trainer.training.model_card import model_card, run_facts, write_model_card
from dflash_trainer.model.modeling.dflash import DFlashDraftModel
from dflash_trainer.training.pipeline.drafter_step import DrafterStep, NonFiniteError
from dflash_trainer.training.pipeline.pipeline import PipelineSettings, TrainingPipeline, plan_metrics
from dflash_trainer.training.pipeline.stage import GracefulStop
from dflash_trainer.training.resume import Resume, check_run_folder, data_identity, decide
from dflash_trainer.training.state import PER_RANK, DrafterWeights, JsonState, OptimizerState, RngStreams
from dflash_trainer.training.tracker_checks import check_trackers
from dflash_trainer.training.trackers import build_trackers

log = logging.getLogger(__name__)

RUN_OUTPUTS = ("checkpoints", "drafter", "metrics.jsonl", "tensorboard", "wandb", "report", "eval",
               "config.yaml")
"""What a run writes into its run folder; ``--overwrite`` deletes these and nothing else."""


class BestCheckpoint:
    """Which checkpoint is the best so far, by one metric; decided on rank 0.

    ``eval/tau`` (acceptance length, what a drafter is for) when in-training eval is on;
    otherwise the mean ``train/loss`` since the previous checkpoint.
    """

    def __init__(self, *, by_eval: bool) -> None:
        self.metric, self.higher = ("eval/tau", True) if by_eval else ("train/loss", False)
        self.best: dict[str, Any] | None = None
        """``metric``, ``value``, ``step`` of the best checkpoint so far."""

    def improves(self, value: float | None) -> bool:
        """Whether ``value`` beats the best so far (a non-finite value never does)."""
        if value is None or not math.isfinite(value):
            return False
        if self.best is None:
            return True
        return value > self.best["value"] if self.higher else value < self.best["value"]

    def update(self, value: float | None, step: int) -> bool:
        """Record ``value`` at ``step`` if it improves; whether it did."""
        if not self.improves(value):
            return False
        self.best = {"metric": self.metric, "value": value, "step": step}
        return True


@dataclass(kw_only=True)
class RunClock:
    """When :meth:`Trainer.train` started and when it last saved a checkpoint (monotonic s)."""

    start: float
    last_save: float = field(init=False)

    def __post_init__(self) -> None:
        self.last_save = self.start


@dataclass(frozen=True, kw_only=True)
class StepDecision:
    """What follows an optimizer step, the same on every rank (see ``Trainer._decide``)."""

    stop: str | None = None
    """Why the run stops after this step (None: it goes on)."""
    checkpoint: bool = False
    """Whether a checkpoint is saved after this step (when the run goes on)."""


def any_rank(flags: list[bool], dist: DistInfo) -> list[bool]:
    """For each flag, whether any rank set it: one all-reduce of one small tensor on the
    rank's device (gloo and NCCL), and one host sync."""
    values = torch.tensor([float(f) for f in flags], device=dist.device)
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    return [v > 0 for v in values.tolist()]



class RunRecord:
    """What a checkpoint records of the run besides the state of its parts (``run`` in
    :mod:`~dflash_trainer.training.state`): read by rank 0 to decide a resume before the build
    (``training.resume``), loaded from that decision."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        """Step, epoch, config, world size, resizes, data identity, best checkpoint, tracker id."""
        t = self.trainer
        return {"step": t.drafter_step.optimizer_step, "epoch": t.drafter_step.last_epoch,
                "config": config_to_dict(t.cfg), "world_size": t.dist.world_size,
                "resizes": [r.as_dict() for r in t.resume.resizes], "data": t.data_identity,
                "best": t.best, "tracker_run_id": t.trackers.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The best checkpoint so far (the tracker run id and the rest went into the build)."""
        self.trainer._best.best = state.get("best")


class Trainer:
    """One rank's run: components, pipeline, trackers, checkpoints and in-training eval.

    :meth:`train` runs it; :meth:`close` cleans up; :meth:`state_dict` is everything a
    checkpoint holds and :meth:`load_state_dict` the one place a resume is applied.
    """

    def __init__(self, cfg: Config, *, overwrite: bool = False,
                 evaluator: EvaluatorFactory | None = None) -> None:
        self.cfg = cfg
        self.rss_at_start = current_rss()
        """Resident memory before anything of the run is loaded: the base of the measured peak."""
        self.overwrite = overwrite
        """Start over in a run folder that holds an earlier run, deleting its outputs."""
        self.dist: DistInfo = init_distributed(cfg.pipeline, cfg.distributed)
        check_distributed_options(cfg.distributed, self.dist,
                                  in_training_eval=bool(cfg.eval.every_steps))
        self.checkpoint_group = checkpoint_group(self.dist, cfg.distributed)
        """The checkpoint writer threads' process group (None in a single process)."""
        self.target_agreement = target_stop_agreement(self.dist, cfg.distributed)
        """The target stages' stop agreement (a sharded target only; see the pipeline)."""
        if cfg.pipeline.num_threads:
            torch.set_num_threads(cfg.pipeline.num_threads)
        elif self.dist.device.type == "cpu":
            # The target stage and the drafter step compute at the same time; two intra-op
            # pools of all cores oversubscribe them (2.9x slower measured on 2 cores).
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.run_lock: FolderLock | None = None
        """``RUN_DIR/.lock``, held by rank 0 from here until :meth:`close`."""
        self._take_run_lock()
        try:
            # Before the slow loading: a refusal comes at once.
            self._on_rank0(lambda: check_trackers(cfg.logging, self.run_dir))
            check_run_folder(cfg, overwrite=overwrite)
            inputs = load_inputs(cfg, self.dist)
            # Validated before anything is built or written, so a refused resume leaves the
            # run dir as it was.
            self.resume: Resume = decide(cfg, self.dist, target_config=inputs.target.config,
                                         tokenizer=inputs.tokenizer, data=inputs.data)
            """The checkpoint this run continues (or none), its plans, total steps and schedule."""
            self.parts: Components = build(cfg, self.dist, inputs, plans=self.resume.plans,
                                           total_steps=self.resume.total_steps,
                                           schedule=self.resume.schedule)
            self.data_identity = data_identity(self.parts.data)
            """The data's content hash, folder and size: saved in checkpoints, checked on resume."""
        except BaseException:
            self.release_run_lock()
            raise
        self.stopped_by: str | None = None
        """Why :meth:`train` ended: completed, max_time_s, stop_after_steps or signal NAME."""
        self._best = BestCheckpoint(by_eval=bool(cfg.eval.every_steps))
        self._snapshot_step: int | None = None
        """Optimizer step of the last snapshot this run took (same on every rank)."""
        self.rng = RngStreams(self.dist.device)
        """This process's random streams, saved per rank."""
        self.record = RunRecord(self)
        """What a checkpoint records of the run (see :meth:`state_dict`)."""
        try:
            if self.dist.is_main:
                if overwrite:
                    self._remove_earlier_run()
                save_config(cfg, self.run_dir)
            self.checkpointer = Checkpointer(self.ckpt_dir, keep_last=cfg.checkpoint.keep_last,
                                             async_save=cfg.checkpoint.async_save,
                                             rank=self.dist.rank, group=self.checkpoint_group)
            self.trackers = build_trackers(
                cfg.logging, self.run_dir, config_dict=config_to_dict(cfg),
                is_rank0=self.dist.is_main,
                resume_run_id=self.resume.run.get("tracker_run_id"),
                total_steps=self.total_steps, max_time_s=cfg.training.max_time_s)
            self.in_training_eval = None
            self.final_eval_skipped: str | None = None
            """Why ``eval.final`` cannot evaluate on this trainer (printed at the end), or None."""
            if cfg.eval.every_steps and self.dist.is_main and evaluator is None:
                raise ConfigError(f"eval.every_steps={cfg.eval.every_steps} needs an evaluator: run "
                                  "`dflash-trainer train`, or pass Trainer(evaluator=...)")
            self._final_evaluator: EvaluatorFactory | None = None
            """Builds the final evaluation at the end, with the whole target loaded then (a store run)."""
            # Without an evaluator the caller evaluates itself (the demo, before and after).
            if cfg.eval.final and not cfg.eval.every_steps and self.dist.is_main and evaluator is not None:
                self.final_eval_skipped = final_eval_obstacle(cfg, self.dist, self.parts)
                if self.final_eval_skipped is None and holds_part_of_target(self.parts):
                    self._final_evaluator = evaluator
            if self.dist.is_main and evaluator is not None and self._final_evaluator is None and (
                    cfg.eval.every_steps or (cfg.eval.final and self.final_eval_skipped is None)):
                # Built now: a bad prompt file is refused before training, not after it.
                self.in_training_eval = evaluator(cfg, target=self.target, tokenizer=self.parts.tokenizer)
            self.pipeline = TrainingPipeline(
                data=self.parts.data, plans=self.parts.plans, extract=self.parts.extractor or self.parts.engine,
                store=self.parts.store, drafter_step=self.drafter_step, dist=self.dist,
                settings=PipelineSettings.from_config(cfg, block_size=self.drafter.block_size),
                trackers=self.trackers, stop_agreement=self.target_agreement,
                engine=self.parts.engine.client if self.parts.engine is not None else None)
            if self.resume.folder is not None:
                # Last, so that nothing built after it draws from the restored RNG streams.
                self.load_checkpoint(self.resume)
        except BaseException:
            close_after_failure(self)  # the checkpointer thread and the feature hooks exist already
            raise

    # -- the parts, by name -------------------------------------------------------------

    @property
    def best(self) -> dict[str, Any] | None:
        """The best checkpoint so far: ``metric``, ``value``, ``step`` (rank 0)."""
        return self._best.best

    @property
    def device(self) -> torch.device:
        """This rank's device."""
        return self.dist.device

    @property
    def target(self) -> torch.nn.Module:
        """The frozen target."""
        return self.parts.target

    @property
    def tokenizer(self) -> Any:
        """The target's tokenizer."""
        return self.parts.tokenizer

    @property
    def drafter(self) -> DFlashDraftModel:
        """The drafter being trained (the plain module)."""
        return self.parts.drafter

    @property
    def drafter_step(self) -> DrafterStep:
        """The drafter's training step (optimizer, schedule, step counters)."""
        return self.parts.drafter_step

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the run (from every epoch's plan; see ``Components``)."""
        return self.parts.total_steps

    @functools.cached_property
    def target_record(self) -> dict[str, Any]:
        """What the exports record of the target (:func:`~dflash_trainer.training.export.target_record`)."""
        return target_record(self.cfg.model.target, getattr(self.target.config, "name_or_path", ""))

    @property
    def memory_estimate(self) -> MemoryEstimate:
        """The estimated peak memory of one step on this rank (:mod:`~dflash_trainer.training.memory`)."""
        return estimate_memory(self.drafter, self.target, data=self.cfg.data, training=self.cfg.training,
                               pipeline=self.cfg.pipeline, compute_dtype=self.compute_dtype,
                               runs_target=self.parts.extractor is not None)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The target's and the autocast dtype."""
        return self.parts.compute_dtype

    @property
    def stop_signal(self) -> int | None:
        """The signal that stopped :meth:`train` (SIGTERM, SIGINT), or None."""
        name = (self.stopped_by or "").removeprefix("signal ")
        return signal.Signals[name].value if name in signal.Signals.__members__ else None

    # -- the run folder -------------------------------------------------------------------

    def _on_rank0(self, action: Callable[[], None]) -> None:
        """Run ``action`` on rank 0 alone and refuse on every rank when it raised a user error:
        the outcome is broadcast, so that every rank refuses together instead of waiting for
        rank 0 forever (rank 0 prints the refusal; the others exit quietly)."""
        refusal: UserError | None = None
        if self.dist.is_main:
            try:
                action()
            except UserError as exc:
                refusal = exc
        if self.dist.enabled:
            box: list[Any] = [None if refusal is None else (type(refusal), str(refusal))]
            torch.distributed.broadcast_object_list(box, src=0)
            if box[0] is not None and refusal is None:
                kind, message = box[0]
                refusal = kind(message)
                refusal.reported_by_rank0 = True  # type: ignore[attr-defined]
        if refusal is not None:
            raise refusal

    def _take_run_lock(self) -> None:
        """Lock the run folder (rank 0), or refuse on every rank when another process holds it.
        Only rank 0 writes into the run folder, so only rank 0 locks it."""
        def take() -> None:
            self.run_lock = run_folder_lock(self.run_dir).acquire()

        self._on_rank0(take)

    def release_run_lock(self) -> None:
        """Release the run folder's lock (idempotent)."""
        if self.run_lock is not None:
            self.run_lock.release()

    def _remove_earlier_run(self) -> None:
        """``--overwrite``: delete what an earlier run left in the run folder (rank 0)."""
        removed = []
        for name in RUN_OUTPUTS:
            path = self.run_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
            else:
                continue
            removed.append(name)
        if removed:
            print(f"--overwrite: removed {', '.join(removed)} of the earlier run in "
                  f"{self.run_dir}", flush=True)

    # -- state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint: a dict of objects that save and load their own state (see
        :mod:`dflash_trainer.training.state`), live, for ``dcp.save`` and ``dcp.load``. Those
        of ``data`` and ``rng`` hold this rank's part only."""
        rank = self.dist.rank
        return {
            "drafter": DrafterWeights(self.drafter),
            "optimizer": OptimizerState(self.drafter, self.drafter_step.optimizer),
            "schedule": JsonState(self.drafter_step.schedule),
            "counters": JsonState(self.drafter_step),
            "data": JsonState(self.pipeline.prefetcher, rank=rank),
            "monitor": JsonState(self.pipeline.monitor),
            "rng": JsonState(self.rng, rank=rank),
            "run": JsonState(self.record),
        }

    def load_checkpoint(self, resume: Resume) -> None:
        """Load the checkpoint ``resume`` chose into the built parts (before :meth:`train`), one
        ``dcp.load`` in which each rank reads its own part: weights and optimizer, step counters,
        run totals, and on the same world size its data position and RNG streams (on another,
        the global data cursor and streams reseeded from seed, step and rank). The plans, the
        total steps and the LR schedule were built from ``resume``, which also holds the run
        record (best checkpoint, tracker run id)."""
        assert resume.folder is not None and resume.cursor is not None
        skip = {"schedule", "run", *(("data", "rng") if resume.resized else ())}
        objects = {key: value for key, value in self.state_dict().items() if key not in skip}
        dcp.load(objects, storage_reader=dcp.FileSystemReader(resume.folder / TRAIN_DIR),
                 process_group=self.checkpoint_group, no_dist=self.checkpoint_group is None)
        self.drafter_step.schedule.apply()  # the loaded optimizer state holds the checkpoint's lr
        self.record.load_state_dict(resume.run)
        if self._best.best is not None:
            self.checkpointer.mark_best(self._best.best["step"])
        self._snapshot_step = self.drafter_step.optimizer_step
        if resume.resized:  # a new rank has no saved position or streams
            self.pipeline.prefetcher.load_state_dict(resume.cursor)
            self.rng.reseed(self.cfg.training.seed, self.drafter_step.optimizer_step, self.dist.rank)

    def save_checkpoint(self, *, eval_tau: float | None = None) -> None:
        """Snapshot between steps (main thread), then hand the write to the checkpointer.

        Every rank calls it at the same step. ``eval_tau`` is this step's in-training eval
        result (rank 0), which decides "best" when in-training eval is on.
        """
        step = self.drafter_step.optimizer_step
        self._snapshot_step = step
        score = eval_tau if self._best.metric == "eval/tau" else self.drafter_step.loss_since_checkpoint()
        is_best = self.dist.is_main and self._best.update(score, step)
        state = {key: value.state_dict() for key, value in self.state_dict().items()}
        # This rank's part only: under DDP the replicated tensors are split between ranks;
        # rank 0 writes the JSON of the objects saved for all ranks, each rank its own.
        shared = local_part({k: v for k, v in state.items() if k not in PER_RANK}, self.dist.rank,
                            self.dist.world_size)
        part = snapshot({**shared, **{k: v for k, v in state.items() if k in PER_RANK}})
        if not self.dist.is_main:
            self.checkpointer.save(SaveRequest(step=step, state=part, export=None))
            return
        drafter_config = self.drafter.config
        target_config = self.target.config

        # The whole weights this rank snapshotted (all of them alone or under DDP with one
        # rank); the export reads the others back from the shards just written, in bf16, so
        # that rank 0 never holds the whole fp32 state.
        own = {key: value for key, value in part.get("drafter", {}).items() if not is_dtensor(value)}

        def export(path: Path) -> None:
            weights = load_drafter_weights(path.parent, dtype=torch.bfloat16, skip=frozenset(own))
            weights.update({key: value.to(torch.bfloat16) for key, value in own.items()})
            # Built on the meta device: a CPU build would draw its random init from the global
            # RNG, concurrently with the training thread, and change the run's random stream.
            with torch.device("meta"):
                model = drafter_class(drafter_config)(drafter_config)
            model.load_state_dict(weights, assign=True)
            export_drafter(model, path, target_config=target_config, target=self.target_record)

        self.checkpointer.save(SaveRequest(
            step=step, state=part, export=export, best=is_best,
            files={"config.yaml": yaml.safe_dump(config_to_dict(self.cfg), sort_keys=False)}))

    # -- the run ------------------------------------------------------------------------

    def _log_plan(self, epoch: int) -> None:
        """The plan statistics of ``epoch``, once per epoch: in the next logged record (JSONL,
        W&B, TensorBoard) and as a console line."""
        plan = self.parts.plans(epoch)
        self.pipeline.monitor.add_once(plan_metrics(plan))
        if self.dist.is_main:
            s = plan.stats
            print(f"epoch {epoch}: {len(plan)} steps, {s.num_samples} samples, {s.num_dropped} "
                  f"dropped and {s.num_carried} carried to keep ranks aligned, padding "
                  f"efficiency {s.padding_efficiency:.3f}, longest same-bucket run "
                  f"{s.max_run} (limit {s.run_limit})", flush=True)

    def train(self, *, stop_after_steps: int | None = None,
              on_batch: Callable[[Batch], None] | None = None) -> dict[str, float]:
        """Run until the planned steps are done, max_steps/max_time_s, or a stop signal.

        ``stop_after_steps`` stops once the optimizer step count reaches it, like a signal:
        final checkpoint, no change to the LR schedule (for tests and staged runs).
        ``on_batch`` is called on the main thread with each batch after it was trained on.
        Returns the last logged metrics; :attr:`stopped_by` says why it ended.
        """
        cfg = self.cfg
        if self.dist.is_main:
            per_epoch = [self.parts.plans.num_steps(e) for e in range(cfg.training.epochs)]
            print(f"training: {self.total_steps} optimizer steps ({sum(per_epoch)} batches in "
                  f"{cfg.training.epochs} epoch(s) / grad_accum {cfg.training.grad_accum}), "
                  f"{len(self.parts.data)} samples, device {self.device}, run dir "
                  f"{self.run_dir}", flush=True)
            if self.parts.draft_vocab is not None:
                print(self.parts.draft_vocab.describe(), flush=True)
            print(self.memory_estimate.describe(), flush=True)
            objective = getattr(self.parts.objective, "module", self.parts.objective)  # DDP
            if objective.rounds_shapes(self.device):
                print(f"drafter attention shapes (pipeline.round_shapes): "
                      f"{objective.shape_sizes.describe()}", flush=True)
        reset_peak()
        clock = RunClock(start=time.monotonic())
        self.trackers.training_started()
        try:
            with GracefulStop() as signals, self.pipeline:
                last, tau, stopped_by = self._train_loop(signals, clock, stop_after_steps, on_batch)
        except EngineError as exc:
            raise self._save_after_engine_failure(exc) from exc
        except NonFiniteError as exc:
            raise self._save_after_divergence(exc) from exc
        self.stopped_by = stopped_by or "completed"
        self.peak_memory = measured_peak(self.device, rss_at_start=self.rss_at_start)
        """The peak memory of the training steps (before the export and the final evaluation)."""
        self._finish(self.stopped_by, time.monotonic() - clock.start)
        return last

    def _save_after_engine_failure(self, exc: EngineError) -> EngineError:
        """The final checkpoint after the feature engine failed (the drafter's state is whole: the
        engine only feeds it), and the error that says where it is. Single process only: ranks
        whose engine still answers are in collectives this rank no longer enters."""
        step = self.drafter_step.optimizer_step
        at_boundary = self.drafter_step.micro_step % self.cfg.training.grad_accum == 0
        if self.dist.enabled or not at_boundary or step == 0:
            return exc
        if self._snapshot_step != step:
            self.save_checkpoint()
        self.checkpointer.wait()
        return EngineError(f"{exc}; training stopped with a checkpoint at step {step} in {self.ckpt_dir}: "
                           "restart the engine and continue with --resume auto")

    def _divergence_source(self, exc: NonFiniteError) -> tuple[str, bool]:
        """Where the non-finite values of a diverged run came from, and whether the drafter's
        weights are still finite (one pass over them; with several ranks, agreed by all)."""
        with torch.no_grad():  # this rank's shard of a sharded drafter: the ranks agree below
            finite = torch.stack([torch.isfinite(p.to_local() if is_dtensor(p) else p).all()
                                  for p in self.drafter.parameters()]).all()
        features_bad, weights_bad = exc.features_nonfinite, not bool(finite)
        if self.dist.enabled:
            features_bad, weights_bad = any_rank([features_bad, weights_bad], self.dist)
        if features_bad:
            if self.parts.engine is not None:
                source = f"the vLLM engine's hidden states ({self.parts.engine.client.url})"
            elif self.parts.store is not None:
                source = f"the feature store's features (features.store={self.cfg.features.store})"
            else:
                source = (f"the target's hidden states (model.target={self.cfg.model.target}: its weights "
                          f"or model.dtype={self.cfg.model.dtype})")
        elif weights_bad:
            source = "the drafter's weights (an optimizer step made them non-finite: lower training.lr)"
        else:
            source = ("the drafter's loss or gradients, from finite features (lower training.lr or "
                      "training.grad_clip, or set model.dtype=float32)")
        return source, not weights_bad

    def _save_after_divergence(self, exc: NonFiniteError) -> DivergedError:
        """The end of a run that diverged: the window up to it logged with where it diverged
        (``train/diverged_from_step``), a checkpoint of the last finite state (the non-finite
        steps changed no weight or moment), and the one line that says all that. Every rank
        gets here at the same step (the check reads the reduced gradient norm)."""
        step = self.drafter_step.optimizer_step
        source, weights_finite = self._divergence_source(exc)
        self.pipeline.monitor.final(step)
        self.trackers.log({"train/diverged_from_step": float(exc.first_step),
                           "train/diverged_steps": float(step - exc.first_step + 1)}, step)
        at_boundary = self.drafter_step.micro_step % self.cfg.training.grad_accum == 0
        if weights_finite and at_boundary:
            if self._snapshot_step != step:
                self.save_checkpoint()
            self.checkpointer.wait()
            kept = (f"the drafter's last finite state (before step {exc.first_step}; the non-finite steps "
                    f"were skipped) is saved in {self.ckpt_dir / f'step-{step}'}")
        else:
            self.checkpointer.wait()
            latest = self.checkpointer.last_saved_step if self.dist.is_main else None
            kept = ("no checkpoint of it was written" + (f"; the last checkpoint is step-{latest} in {self.ckpt_dir}"
                                                         if latest is not None else ""))
        error = DivergedError(
            f"{step - exc.first_step + 1} consecutive optimizer steps (steps {exc.first_step}-{step}) had a "
            f"non-finite loss or gradient norm (training.max_nonfinite_steps="
            f"{self.cfg.training.max_nonfinite_steps}); source: {source}; {kept}. Fix the source, then "
            "continue with --resume auto")
        error.reported_by_rank0 = not self.dist.is_main  # type: ignore[attr-defined]
        return error

    def _train_loop(self, signals: GracefulStop, clock: RunClock, stop_after_steps: int | None,
                    on_batch: Callable[[Batch], None] | None) -> tuple[dict[str, float], float | None, str | None]:
        """The step loop of :meth:`train` inside the running pipeline: (last metrics, last eval
        tau, why it stopped or None)."""
        drafter_step, monitor = self.drafter_step, self.pipeline.monitor
        stopped_by: str | None = None
        tau: float | None = None
        last: dict[str, float] = {}
        logged_epoch: int | None = None
        for item in self.pipeline.step_inputs(
                until=lambda: drafter_step.optimizer_step >= self.total_steps):
            try:
                stepped = drafter_step.train_micro_batch(item)
            except NonFiniteError:
                self.pipeline.acknowledge(item.batch)  # its (skipped) step was taken
                raise
            self.pipeline.acknowledge(item.batch)  # a checkpoint from here resumes after it
            if item.batch.epoch != logged_epoch:
                logged_epoch = item.batch.epoch
                self._log_plan(logged_epoch)
            if on_batch is not None:
                on_batch(item.batch)
            if not stepped:
                continue  # gradients accumulate over grad_accum micro-batches
            step = drafter_step.optimizer_step
            last = monitor.maybe_log(step) or last
            tau = self._maybe_eval(step)
            decision = self._decide(step, tau=tau, signals=signals, clock=clock,
                                    stop_after_steps=stop_after_steps)
            if decision.stop is not None:
                stopped_by = decision.stop
                break  # the final checkpoint below
            if decision.checkpoint:
                # A checkpoint step is a log step: the run totals it saves are exact.
                last = monitor.final(step) or last
                self.save_checkpoint(eval_tau=tau)
                clock.last_save = time.monotonic()
        drafter_step.check_nonfinite()
        last = monitor.final(drafter_step.optimizer_step) or last
        # Not checkpointer.last_saved_step: only rank 0 writes, and asynchronously, so
        # ranks would disagree and the snapshot's collectives would hang.
        if self._snapshot_step != drafter_step.optimizer_step:
            self.save_checkpoint(eval_tau=tau)
        return last, tau, stopped_by

    def _decide(self, step: int, *, tau: float | None, signals: GracefulStop, clock: RunClock,
                stop_after_steps: int | None) -> StepDecision:
        """Whether the run stops after ``step`` (and why) or saves a checkpoint there; the same
        on every rank, or the collectives of the next step or of the snapshot would hang.

        Counted rules (``stop_after_steps``, ``checkpoint.every_steps``) agree by themselves.
        What one rank sees alone (a signal, its clock for ``max_time_s`` and
        ``checkpoint.every_minutes``, rank 0's eval beating the best) is agreed in one
        all-reduce of the flags. That is a host sync, so a multi-rank run takes it at log and
        eval steps only, where the monitor and the eval sync anyway, and such a decision waits
        for the next of them; a single process decides after every step.
        """
        if stop_after_steps is not None and stop_after_steps <= step < self.total_steps:
            return StepDecision(stop="stop_after_steps")
        ck = self.cfg.checkpoint
        eval_step = bool(self.cfg.eval.every_steps) and step % self.cfg.eval.every_steps == 0
        counted = bool(ck.every_steps) and step % ck.every_steps == 0
        if self.dist.enabled and step % self.cfg.logging.every_steps and not eval_step:
            return StepDecision(checkpoint=counted)
        reason = None
        if signals.requested and signals.signum is not None:
            reason = f"signal {signal.Signals(signals.signum).name}"
        elif self.cfg.training.max_time_s and (
                time.monotonic() - clock.start >= self.cfg.training.max_time_s):
            reason = "max_time_s"
        # Rank 0's clock and eval decide for every rank.
        by_clock = self.dist.is_main and bool(ck.every_minutes) and (
            time.monotonic() - clock.last_save >= 60 * ck.every_minutes)
        new_best = self.dist.is_main and eval_step and self._best.improves(tau)
        if self.dist.enabled:
            stop_anywhere, by_clock, new_best = any_rank(
                [reason is not None, by_clock, new_best], self.dist)
            if stop_anywhere:
                reason = reason or "a stop on another rank"
        return StepDecision(stop=reason, checkpoint=counted or by_clock or new_best)

    def _maybe_eval(self, step: int) -> float | None:
        """Run the in-training eval at eval steps (rank 0); its ``eval/tau`` or None."""
        every = self.cfg.eval.every_steps
        if self.in_training_eval is None or not every or step % every:
            return None
        result = self.in_training_eval(self.drafter)
        self.trackers.log(result, step)
        tau = result.get("eval/tau")
        return float(tau) if tau is not None else None

    def _finish(self, stopped_by: str, seconds: float) -> None:
        self.checkpointer.wait()
        sharded_state = full_model_state(self.drafter) if is_sharded(self.drafter) else None
        if not self.dist.is_main:
            return
        drafter = self.drafter
        if sharded_state is not None:
            drafter = drafter_class(self.drafter.config)(self.drafter.config)
            drafter.load_state_dict(sharded_state)
        run = run_facts(self.run_dir, step=self.drafter_step.optimizer_step)
        out = export_drafter(drafter, self.run_dir / "drafter", target_config=self.target.config,
                             target=self.target_record,
                             card=lambda config, num_params: model_card(config, num_params=num_params, run=run))
        best = ""
        if self._best.best is not None:
            b = self._best.best
            best = f"; best checkpoint step-{b['step']} ({b['metric']} {b['value']:.4g})"
        print(f"training {stopped_by} after {self.drafter_step.optimizer_step} steps in {seconds:.0f} s; "
              f"drafter exported to {out}; checkpoints in {self.ckpt_dir}{best}", flush=True)
        # A stop (signal, stop_after_steps) is a pause: exit fast, the resumed run evaluates.
        if stopped_by in ("completed", "max_time_s") and self.cfg.eval.final:
            self._evaluate_final(drafter)
            write_model_card(out, run=run_facts(self.run_dir, step=self.drafter_step.optimizer_step))

    def _evaluate_final(self, drafter: torch.nn.Module) -> None:
        """``eval.final`` on rank 0 of ``drafter`` (the whole one that was exported), after the
        export: a failure here loses no training."""
        step, every = self.drafter_step.optimizer_step, self.cfg.eval.every_steps
        if self._final_evaluator is not None:
            target = load_whole_target(self.cfg, self.parts)
            if isinstance(target, str):
                self.final_eval_skipped = target
            else:
                self.in_training_eval = self._final_evaluator(self.cfg, target=target, tokenizer=self.tokenizer)
        if self.in_training_eval is not None:
            # An FSDP drafter was gathered into a plain one on the host for the export.
            print(evaluate_final(self.in_training_eval, drafter.to(self.device), cfg=self.cfg, step=step,
                                 evaluated=bool(every) and step % every == 0, trackers=self.trackers),
                  flush=True)
        elif self.final_eval_skipped is not None:
            print(f"final evaluation skipped: {self.final_eval_skipped} (eval.final=false turns it off)",
                  flush=True)

    def close(self, *, keep_run_lock: bool = False) -> None:
        """Stop the pipeline, finish pending checkpoint writes, close trackers and hooks, then
        release the run folder's lock (unless ``keep_run_lock``: the caller still writes there
        and calls :meth:`release_run_lock`); idempotent.

        Safe after a failure and on a partly built trainer. Every part is closed; the first
        error is re-raised afterwards.
        """
        first_error: BaseException | None = None
        for name in ("pipeline", "checkpointer", "trackers", "parts"):
            part = getattr(self, name, None)
            if part is None:
                continue
            try:
                part.close()
            except BaseException as exc:  # the others must still be closed
                first_error = first_error or exc
        if not keep_run_lock:
            self.release_run_lock()
        if first_error is not None:
            raise first_error


def close_after_failure(trainer: Trainer) -> None:
    """Close ``trainer`` after a failure that the caller re-raises.

    A second failure while closing must not hide the first: it is logged, as one line when
    it is a user or disk error (e.g. the metrics file on the same full disk), with its
    traceback when it is a bug.
    """
    try:
        trainer.close()
    except BaseException as exc:
        user = exc if isinstance(exc, UserError) else disk_error(exc, folder=trainer.run_dir)
        if user is None:
            log.exception("error while closing after a failure")
        else:
            log.warning("closing after the failure failed too: %s: %s", user.kind, user)
