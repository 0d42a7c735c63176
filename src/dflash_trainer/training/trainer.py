"""The Trainer: runs a TrainingPipeline over the built components and checkpoints it.

Thread layout per rank: the prefetcher (W workers + dispatcher) and the target stage run
as supervised threads (:class:`~dflash_trainer.training.pipeline.pipeline.TrainingPipeline`); the
drafter step, the monitor, the in-training eval and checkpoint snapshots run on the main
thread between steps; the checkpoint writer has its own thread. See docs/architecture.md.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import yaml

from dflash_trainer.training.checkpoint import (
    TRAIN_DIR, Checkpointer, ResumeError, SaveRequest, checkpoint_names, load_drafter_weights,
    load_rank_state, load_state, load_train_state, local_part, resolve_resume, snapshot)
from dflash_trainer.training.components import Components, build, run_progress, run_steps
from dflash_trainer.config import Config, config_to_dict, save_config, upgrade_saved_config
from dflash_trainer.data.buckets import Plan, build_plan
from dflash_trainer.data.resize import Resize, ResizedPlans
from dflash_trainer.core.distributed import (
    DistInfo, apply_training_state, check_distributed_options, checkpoint_group,
    full_model_state, init_distributed, is_dtensor, is_sharded,
    target_stop_agreement, training_state)
from dflash_trainer.core.errors import ConfigError, EngineError, UserError
from dflash_trainer.core.fsutil import disk_error, step_of
from dflash_trainer.core.locks import FolderLock, run_folder_lock
from dflash_trainer.model.batch import Batch
from dflash_trainer.model.drafter import drafter_class
from dflash_trainer.training.export import check_fits_target, export_drafter, read_drafter_config
from dflash_trainer.training.optim import rescaled
from dflash_trainer.model.modeling.dflash import DFlashDraftModel
from dflash_trainer.training.pipeline.drafter_step import DrafterStep
from dflash_trainer.training.pipeline.pipeline import PipelineSettings, TrainingPipeline, plan_metrics
from dflash_trainer.training.pipeline.stage import GracefulStop
from dflash_trainer.training.trackers import build_trackers

log = logging.getLogger(__name__)

# Settings a resumed run must share with its checkpoint: they decide the data order, the
# model shape and the meaning of the saved optimizer state.
RESUME_KEYS = ("data", "model", "pipeline.num_buckets", "pipeline.bucket_boundaries",
               "pipeline.tokens_per_batch", "pipeline.max_batch_size", "pipeline.max_run", "pipeline.order",
               "training.seed", "training.num_anchors", "training.grad_accum")
# Inside RESUME_KEYS but free to change: where things are stored, not what they are.
RESUME_FREE = frozenset({"data.cache_dir"})
RUN_OUTPUTS = ("checkpoints", "drafter", "metrics.jsonl", "tensorboard", "wandb", "report", "eval",
               "config.yaml")
"""What a run writes into its run folder; ``--overwrite`` deletes these and nothing else."""


def earlier_run(run_dir: Path) -> list[str]:
    """What an earlier run left in ``run_dir`` that a fresh run would overwrite or mix with:
    its checkpoints (complete or not), its metrics and its exported drafter."""
    found = []
    names = checkpoint_names(run_dir / "checkpoints")
    if names:
        found.append(f"checkpoints {', '.join(names)}")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        found.append("metrics.jsonl")
    if (run_dir / "drafter").exists():
        found.append("drafter/")
    return found


def data_identity(data: Any) -> dict[str, Any] | None:
    """What the resume check compares: a token store's content hash, its folder and size (None
    for data passed in without a hash). A store older than the hash is hashed here, once."""
    digest = getattr(data, "content_hash", None)
    if digest is None:
        return None
    return {"sha256": digest, "store": str(getattr(data, "path", "")), "samples": len(data)}


def check_same_data(saved: dict[str, Any] | None, current: dict[str, Any] | None, *,
                    folder: Path) -> None:
    """Refuse a resume whose token store content differs from the checkpoint's (a data file
    edited in place keeps its path, so the config alone cannot tell)."""
    if saved is None or current is None or saved["sha256"] == current["sha256"]:
        return
    raise ResumeError(
        f"cannot resume from {folder}: the training data changed since the checkpoint: its token "
        f"store held {saved['samples']} samples with content sha256 {saved['sha256'][:16]} "
        f"({saved['store']}), the data now gives {current['samples']} samples with "
        f"{current['sha256'][:16]} ({current['store']}); a file in data.paths was changed in "
        f"place. Restore the data the run was started with to resume it, or start over with "
        f"--overwrite (or another run_dir)")


def _pick(cfg: dict[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def _differences(old: Any, new: Any, key: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, old, new) of every leaf that differs between two config subtrees."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [diff for k in sorted(set(old) | set(new))
                for diff in _differences(old.get(k), new.get(k), f"{key}.{k}")]
    return [] if old == new else [(key, old, new)]


def check_resume_compatible(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse a resume whose data order or model differ from the checkpoint (another world size
    is resumed, see :mod:`dflash_trainer.data.resize`)."""
    for key in RESUME_KEYS:
        for leaf, old, new in _differences(_pick(saved, key), _pick(current, key), key):
            if leaf not in RESUME_FREE:
                raise ResumeError(f"cannot resume: {leaf} was {old!r} in the checkpoint and is "
                                  f"{new!r} now; resume with the checkpoint's config.yaml")


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _reseed(seed: int, step: int, rank: int, device: torch.device) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) RNGs from (seed, step, rank)."""
    value = int(np.random.SeedSequence([seed % 2**63, step, rank]).generate_state(1)[0])
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.manual_seed(value)


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



class EvaluatorFactory(Protocol):
    """Builds the in-training evaluation (``eval.every_steps``) from the run's config, target and
    tokenizer; passed in by the command line, so that training never imports evaluation."""

    def __call__(self, cfg: Config, *, target: torch.nn.Module,
                 tokenizer: Any) -> Callable[[torch.nn.Module], dict[str, float]]: ...


class Trainer:
    """One rank's run: components, pipeline, trackers, checkpoints and in-training eval.

    :meth:`train` runs it; :meth:`close` cleans up; :meth:`state_dict` is everything a
    checkpoint holds and :meth:`load_state_dict` the one place a resume is applied.
    """

    def __init__(self, cfg: Config, *, overwrite: bool = False,
                 evaluator: EvaluatorFactory | None = None) -> None:
        self.cfg = cfg
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
            # Before the slow build: a refusal comes at once.
            self._check_run_folder()
            self.parts: Components = build(cfg, self.dist)
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
        self._resizes: list[Resize] = []
        """World size changes in the epoch being trained (resumes on another world size)."""
        try:
            # Validated before anything is written, so a refused resume leaves the run dir as
            # it was.
            resume = self._read_resume()
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
                resume_run_id=(resume or {}).get("tracker_run_id"),
                total_steps=self.total_steps, max_time_s=cfg.training.max_time_s)
            self.in_training_eval = None
            if cfg.eval.every_steps and self.dist.is_main:
                if evaluator is None:
                    raise ConfigError(f"eval.every_steps={cfg.eval.every_steps} needs an evaluator: run "
                                      "`dflash-trainer train`, or pass Trainer(evaluator=...)")
                self.in_training_eval = evaluator(cfg, target=self.target, tokenizer=self.parts.tokenizer)
            self.pipeline = TrainingPipeline(
                data=self.parts.data, plans=self.parts.plans, extract=self.parts.extractor or self.parts.engine,
                store=self.parts.store, drafter_step=self.drafter_step, dist=self.dist,
                settings=PipelineSettings.from_config(cfg, block_size=self.drafter.block_size),
                trackers=self.trackers, stop_agreement=self.target_agreement,
                engine=self.parts.engine.client if self.parts.engine is not None else None)
            if resume is not None:
                # Last, so that nothing built after it draws from the restored RNG streams.
                self.load_state_dict(resume)
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

    def _take_run_lock(self) -> None:
        """Lock the run folder (rank 0), or refuse on every rank when another process holds it.

        Only rank 0 writes into the run folder, so only rank 0 locks it; the outcome is
        broadcast so that every rank refuses together instead of waiting for rank 0 forever.
        """
        refusal: UserError | None = None
        if self.dist.is_main:
            try:
                self.run_lock = run_folder_lock(self.run_dir).acquire()
            except UserError as exc:
                refusal = exc
        if self.dist.enabled:
            box: list[Any] = [None if refusal is None else (type(refusal), str(refusal))]
            torch.distributed.broadcast_object_list(box, src=0)
            if box[0] is not None and refusal is None:
                kind, message = box[0]
                refusal = kind(message)
        if refusal is not None:
            raise refusal

    def release_run_lock(self) -> None:
        """Release the run folder's lock (idempotent)."""
        if self.run_lock is not None:
            self.run_lock.release()

    def _check_run_folder(self) -> None:
        """Refuse a fresh run into a folder that holds an earlier run (its checkpoints, metrics
        or exported drafter), unless :attr:`overwrite`; refuse ``overwrite`` with a resume."""
        resume = self.cfg.checkpoint.resume
        if self.overwrite and resume:
            raise ConfigError(f"--overwrite starts the run in {self.run_dir} over; it cannot be "
                              f"combined with checkpoint.resume={resume} (drop one of them)")
        earlier = earlier_run(self.run_dir)
        if resume or self.overwrite or not earlier:
            return
        raise ResumeError(
            f"run folder {self.run_dir} holds an earlier run ({'; '.join(earlier)}); continue it "
            f"with --resume auto (checkpoint.resume=auto), start over with --overwrite (deletes "
            f"them), or choose another run_dir")

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

    def _read_resume(self) -> dict[str, Any] | None:
        """This rank's part of ``checkpoint.resume`` (validated, checked against the config
        and the data's content).

        Rank 0 alone validates the folder (manifest, sizes, checksums) and checks it against
        this run; it broadcasts the verdict, so the other ranks neither hash the files nor
        report the same refusal again.
        """
        folder: Path | None = None
        refusal: UserError | None = None
        if self.dist.is_main:
            try:
                folder = self._choose_resume()
            except UserError as exc:
                refusal = exc
        if self.dist.enabled:
            box: list[Any] = [(None if folder is None else str(folder),
                               None if refusal is None else (type(refusal), str(refusal)))]
            torch.distributed.broadcast_object_list(box, src=0)
            chosen, refused = box[0]
            folder = None if chosen is None else Path(chosen)
            if refused is not None and refusal is None:
                refusal = refused[0](refused[1])
                refusal.reported_by_rank0 = True  # type: ignore[attr-defined]
        if refusal is not None:
            raise refusal
        if folder is None:
            return None  # a fresh start (see _check_run_folder), or resume=auto with nothing saved
        state = load_state(folder)
        resized = state["world_size"] != self.dist.world_size
        if resized:
            self._resize(state)
        elif self.dist.rank > 0:  # its own RNG streams and data position
            own = load_rank_state(folder, self.dist.rank)
            state.update(rng=own["rng"], prefetch=own["prefetch"])
        fresh_total = self.total_steps  # of an uninterrupted run of this world size
        self._use_resized_plans(state)
        if resized:
            cursor = state["prefetch"]
            state["loop"]["schedule"] = rescaled(
                step=int(state["step"]), total_steps=fresh_total, end_step=self.total_steps,
                progress=run_progress(self.parts.plans, self.cfg.training, epoch=cursor["epoch"],
                                      step=cursor["step"]))
        state["train_dir"] = folder / TRAIN_DIR
        step = int(state["step"])
        log.info("resumed from %s at optimizer step %d", folder, step)
        return state

    def _resize(self, state: dict[str, Any]) -> None:
        """A checkpoint of another world size (every rank, the same): the rest of the
        interrupted epoch is dealt to this run's ranks from the global data cursor (rank 0's;
        all ranks are at the same step), and every rank's RNG streams are reseeded from
        (seed, step, rank), as there is no saved stream for a new rank."""
        cursor = state["prefetch"]
        resize = Resize(epoch=cursor["epoch"], step=cursor["step"], old=state["world_size"],
                        new=self.dist.world_size)
        state["resizes"] = [*(r for r in state.get("resizes", []) if r["epoch"] == resize.epoch),
                            resize.as_dict()]
        state["prefetch"] = {**cursor, "world_size": self.dist.world_size}
        state["rng"] = None

    def _resized_plans(self, state: dict[str, Any]) -> ResizedPlans | None:
        """The plans with the data cursor's epoch resized (see :meth:`_resize`), or None when it
        was not; raises ValueError if the samples left cannot feed every rank."""
        epoch = state["prefetch"]["epoch"]
        resizes = [Resize(**r) for r in state.get("resizes", []) if r["epoch"] == epoch]
        if not resizes:
            return None
        cfg, base = self.cfg, self.parts.plans

        def build(epoch: int, world_size: int) -> Plan:
            return build_plan(base.lengths, cfg.pipeline, seed=cfg.training.seed, epoch=epoch,
                              world_size=world_size)

        plans = ResizedPlans(base, resizes, build)
        plans(epoch)
        return plans

    def _use_resized_plans(self, state: dict[str, Any]) -> None:
        """Plan the epoch of the data cursor as resized, if it was; the run's total steps follow."""
        plans = self._resized_plans(state)
        if plans is None:
            return
        self._resizes = plans.resizes
        self.parts.plans = plans
        self.parts.total_steps = run_steps(plans, self.cfg.training)

    def _choose_resume(self) -> Path | None:
        """Rank 0: the validated checkpoint folder to resume from (None: a fresh start), checked
        against this run's config, target, data and world size."""
        resume = self.cfg.checkpoint.resume
        folder = resolve_resume(resume, self.ckpt_dir)
        if folder is None:
            return None
        state = load_state(folder)
        if "drafter" in state:  # the weights inside state.pt: the layout before DCP shards
            raise ResumeError(
                f"cannot resume from {folder}: it is a checkpoint in the earlier single-file "
                f"layout (state.pt with the weights), which this version does not resume; start "
                f"a new run (another run_dir, or --overwrite) from its weights with "
                f"model.init_from={folder / 'drafter'} (the optimizer state and data position "
                f"start over)")
        check_resume_compatible(upgrade_saved_config(state["config"]), config_to_dict(self.cfg))
        check_fits_target(read_drafter_config(folder / "drafter"), self.target.config, self.tokenizer,
                          drafter=f"checkpoint.resume={folder}", target=self.cfg.model.target,
                          fix="resume with the target it was trained on", error=ResumeError)
        check_same_data(state.get("data"), self.data_identity, folder=folder)
        step = int(state["step"])
        if state["world_size"] != self.dist.world_size:
            self._check_resize(state, folder)
        newer = sorted(p.name for p in self.ckpt_dir.glob("step-*")
                       if p.is_dir() and (step_of(p) or 0) > step)
        if newer:
            log.warning("resuming from step %d: newer checkpoints %s belong to the abandoned "
                        "continuation and will be replaced as this run reaches their steps",
                        step, ", ".join(newer))
        print(f"resumed from {folder} at step {step}", flush=True)
        return folder

    def _check_resize(self, state: dict[str, Any], folder: Path) -> None:
        """Rank 0: refuse a world size the rest of the checkpoint's epoch cannot feed; say what
        a resume on another world size does."""
        resized = dict(state)
        self._resize(resized)
        try:
            self._resized_plans(resized)
        except ValueError as exc:
            raise ResumeError(f"cannot resume {folder} with {self.dist.world_size} rank(s): {exc}; "
                              f"resume with fewer ranks, or from another checkpoint") from exc
        epoch, step = resized["prefetch"]["epoch"], resized["prefetch"]["step"]
        print(f"resuming a checkpoint of {state['world_size']} rank(s) with "
              f"{self.dist.world_size}: the batches left in epoch {epoch} from step {step} on "
              f"are dealt to the {self.dist.world_size} rank(s); later epochs are planned for "
              f"them", flush=True)

    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint holds for this rank at a step boundary, except the weights and
        the optimizer state (:meth:`training_state`, saved as DCP shards)."""
        step_state = self.drafter_step.state_dict()
        del step_state["optimizer"]  # in training_state
        return {
            "step": self.drafter_step.optimizer_step,
            "epoch": self.drafter_step.last_epoch,
            "loop": step_state,  # the drafter step's state, under its key of every checkpoint
            **self.pipeline.state_dict(),
            "rng": _rng_state(self.device),
            "tracker_run_id": self.trackers.run_id,
            "best": self._best.best,
            "config": config_to_dict(self.cfg),
            "world_size": self.dist.world_size,
            "resizes": [r.as_dict() for r in self._resizes],
            "data": self.data_identity,
        }

    def training_state(self) -> dict[str, Any]:
        """The drafter's weights and AdamW state as this rank holds them (its shards under
        FSDP): what ``train/`` of a checkpoint holds (live tensors, not a copy)."""
        return training_state(self.drafter, self.drafter_step.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Apply a checkpoint's state: weights, optimizer and schedule (read from
        ``state["train_dir"]``, each rank its own part), data position, run totals, RNG streams
        and the best checkpoint so far (before :meth:`train`)."""
        template = self.training_state()
        load_train_state(template, state["train_dir"], group=self.checkpoint_group)
        apply_training_state(self.drafter, self.drafter_step.optimizer, template)
        step_state = {**state["loop"], "optimizer": self.drafter_step.optimizer.state_dict()}
        self.drafter_step.load_state_dict(step_state)
        self.pipeline.load_state_dict(state)
        self._best.best = state.get("best")
        if self._best.best is not None:
            self.checkpointer.mark_best(self._best.best["step"])
        self._snapshot_step = self.drafter_step.optimizer_step
        if self.drafter_step.schedule.end_step != self.total_steps:
            log.warning("the LR schedule of the checkpoint ends at step %d, this config at %d: the "
                        "schedule keeps the checkpoint's curve; the run stops at step %d",
                        self.drafter_step.schedule.end_step, self.total_steps, self.total_steps)
        if state["rng"] is None:  # resumed on another world size (see _resize)
            _reseed(self.cfg.training.seed, self.drafter_step.optimizer_step, self.dist.rank,
                    self.device)
        else:
            _set_rng_state(state["rng"], self.device)

    def save_checkpoint(self, *, eval_tau: float | None = None) -> None:
        """Snapshot between steps (main thread), then hand the write to the checkpointer.

        Every rank calls it at the same step. ``eval_tau`` is this step's in-training eval
        result (rank 0), which decides "best" when in-training eval is on.
        """
        step = self.drafter_step.optimizer_step
        self._snapshot_step = step
        score = eval_tau if self._best.metric == "eval/tau" else self.drafter_step.loss_since_checkpoint()
        is_best = self.dist.is_main and self._best.update(score, step)
        full = self.state_dict()
        # This rank's shards only: under DDP the replicated tensors are split between ranks.
        shards = snapshot(local_part(self.training_state(), self.dist.rank, self.dist.world_size))
        rank_states: dict[int, Any] = {}
        if self.dist.enabled:
            gathered: list[Any] = [None] * self.dist.world_size
            torch.distributed.all_gather_object(
                gathered, {"rng": full["rng"], "prefetch": full["prefetch"]})
            rank_states = {r: s for r, s in enumerate(gathered) if r > 0}
        if not self.dist.is_main:
            self.checkpointer.save(SaveRequest(step=step, state={}, rank_states={}, export=None,
                                               shards=shards))
            return
        state = snapshot(full)
        drafter_config = self.drafter.config
        target_config = self.target.config

        # The whole weights this rank snapshotted (all of them alone or under DDP with one
        # rank); the export reads the others back from the shards just written, in bf16, so
        # that rank 0 never holds the whole fp32 state.
        own = {key: value for key, value in shards.get("drafter", {}).items()
               if not is_dtensor(value)}

        def export(path: Path) -> None:
            weights = load_drafter_weights(path.parent, dtype=torch.bfloat16, skip=frozenset(own))
            weights.update({key: value.to(torch.bfloat16) for key, value in own.items()})
            # Built on the meta device: a CPU build would draw its random init from the global
            # RNG, concurrently with the training thread, and change the run's random stream.
            with torch.device("meta"):
                model = drafter_class(drafter_config)(drafter_config)
            model.load_state_dict(weights, assign=True)
            export_drafter(model, path, target_config=target_config)

        self.checkpointer.save(SaveRequest(
            step=step, state=state, rank_states=rank_states, export=export, best=is_best,
            files={"config.yaml": yaml.safe_dump(state["config"], sort_keys=False)},
            shards=shards))

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
            objective = getattr(self.parts.objective, "module", self.parts.objective)  # DDP
            if objective.rounds_shapes(self.device):
                print(f"drafter attention shapes (pipeline.round_shapes): "
                      f"{objective.shape_sizes.describe()}", flush=True)
        clock = RunClock(start=time.monotonic())
        self.trackers.training_started()
        try:
            with GracefulStop() as signals, self.pipeline:
                last, tau, stopped_by = self._train_loop(signals, clock, stop_after_steps, on_batch)
        except EngineError as exc:
            raise self._save_after_engine_failure(exc) from exc
        self.stopped_by = stopped_by or "completed"
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
            stepped = drafter_step.train_micro_batch(item)
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
        # A stop (signal, stop_after_steps) is a pause: exit fast, the resumed run evaluates.
        finished = stopped_by in ("completed", "max_time_s")
        if finished and self.in_training_eval is not None and self.drafter_step.optimizer_step % (
                self.cfg.eval.every_steps or 1):
            self.trackers.log(self.in_training_eval(self.drafter), self.drafter_step.optimizer_step)
        sharded_state = full_model_state(self.drafter) if is_sharded(self.drafter) else None
        if not self.dist.is_main:
            return
        drafter = self.drafter
        if sharded_state is not None:
            drafter = drafter_class(self.drafter.config)(self.drafter.config)
            drafter.load_state_dict(sharded_state)
        out = export_drafter(drafter, self.run_dir / "drafter", target_config=self.target.config)
        best = ""
        if self._best.best is not None:
            b = self._best.best
            best = f"; best checkpoint step-{b['step']} ({b['metric']} {b['value']:.4g})"
        print(f"training {stopped_by} after {self.drafter_step.optimizer_step} steps in {seconds:.0f} s; "
              f"drafter exported to {out}; checkpoints in {self.ckpt_dir}{best}", flush=True)

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
