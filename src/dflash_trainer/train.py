"""``dflash-trainer train``: build the pipeline, run it, and always close it.

Thread layout per rank: the prefetcher (W workers + dispatcher) and the target stage run
as supervised threads; the drafter step, the monitor, the in-training eval and checkpoint
snapshots run on the main thread between steps; the checkpoint writer has its own thread.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import math
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from dflash_trainer import assets
from dflash_trainer.checkpoint import (
    LATEST, Checkpointer, ResumeError, SaveRequest, load_state, resolve_resume, snapshot)
from dflash_trainer.config import Config, config_to_dict, save_config
from dflash_trainer.data.buckets import Plan, build_plan
from dflash_trainer.flops import StepShape, layer_dims, step_flops
from dflash_trainer.data.prepare import build_dataset
from dflash_trainer.distributed import (
    DistInfo, check_distributed_options, close_distributed, full_model_state,
    full_optimizer_state, init_distributed, is_sharded, load_model_state, load_optimizer_state,
    reduce_metrics, target_load_device, wrap_drafter, wrap_target)
from dflash_trainer.model.blocks import sample_anchors
from dflash_trainer.model.drafter import build_drafter, init_from_target, text_config
from dflash_trainer.model.export import export_drafter
from dflash_trainer.model.modeling.dflash import DFlashDraftModel
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.target import FeatureExtractor, load_target, resolve_mask_token_id
from dflash_trainer.optim import LRSchedule, build_optimizer
from dflash_trainer.pipeline.batch import Batch
from dflash_trainer.pipeline.channel import Channel
from dflash_trainer.pipeline.monitor import Monitor
from dflash_trainer.pipeline.prefetch import BatchPrefetcher
from dflash_trainer.pipeline.stage import GracefulStop, Supervisor
from dflash_trainer.pipeline.target_stage import TargetStage
from dflash_trainer.pipeline.train_loop import DrafterTrainLoop
from dflash_trainer.trackers import build_trackers

log = logging.getLogger(__name__)

# Settings a resumed run must share with its checkpoint: they decide the data order, the
# model shape and the meaning of the saved optimizer state.
RESUME_KEYS = ("data", "model", "pipeline.num_buckets", "pipeline.bucket_boundaries",
               "pipeline.tokens_per_batch", "pipeline.max_batch_size", "pipeline.max_run",
               "training.seed", "training.num_anchors", "training.grad_accum")
# Inside RESUME_KEYS but free to change: where things are stored, not what they are.
RESUME_FREE = frozenset({"data.cache_dir"})

# bf16 dense peak FLOP/s by device name, for perf/mfu (benchmarks/gpu_check.py measures the
# achievable matmul ceiling instead).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def _dtype(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.model.dtype == "bfloat16" or (cfg.model.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def _peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


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


def check_resume_compatible(saved: dict[str, Any], current: dict[str, Any], *,
                            saved_world: int, world: int) -> None:
    """Refuse a resume whose data order, model or world size differ from the checkpoint."""
    if saved_world != world:
        raise ResumeError(
            f"cannot resume: the checkpoint was written by {saved_world} rank(s), this run has "
            f"{world}; the data plan is step-aligned per rank, so resume with the same number "
            f"of ranks")
    for key in RESUME_KEYS:
        for leaf, old, new in _differences(_pick(saved, key), _pick(current, key), key):
            if leaf not in RESUME_FREE:
                raise ResumeError(f"cannot resume: {leaf} was {old!r} in the checkpoint and is "
                                  f"{new!r} now; resume with the checkpoint's config.yaml")


class Trainer:
    """Everything one rank needs for a run; :meth:`train` runs it, :meth:`close` cleans up."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.dist: DistInfo = init_distributed(cfg.pipeline, cfg.distributed)
        check_distributed_options(cfg.distributed, self.dist,
                                  in_training_eval=bool(cfg.eval.every_steps))
        if cfg.pipeline.num_threads:
            torch.set_num_threads(cfg.pipeline.num_threads)
        elif self.dist.device.type == "cpu":
            # The target stage and the drafter loop compute at the same time; two intra-op
            # pools of all cores oversubscribe them (2.9x slower measured on 2 cores).
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        self.device = self.dist.device
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        # Same seed on every rank for the drafter init (DDP also broadcasts rank 0's weights).
        torch.manual_seed(cfg.training.seed)
        self.compute_dtype = _dtype(cfg, self.device)

        target_path = assets.resolve_target(cfg.model.target)
        self.target, self.tokenizer = load_target(
            str(target_path), device=target_load_device(self.dist, cfg.distributed),
            dtype=self.compute_dtype)
        self.store, self.data_stats = self._build_dataset()
        embed_rows = self.target.get_input_embeddings().weight.shape[0]
        data_ids = np.flatnonzero(np.bincount(np.asarray(self.store._tokens),
                                              minlength=embed_rows))
        mask_id = resolve_mask_token_id(self.tokenizer, embed_rows,
                                        explicit=cfg.model.mask_token_id,
                                        forbidden_in_data=data_ids.tolist())
        drafter = build_drafter(cfg.model, self.target.config, mask_token_id=mask_id)
        if cfg.model.init_from_target:
            copied = init_from_target(drafter, self.target)
            log.info("initialised drafter layers from the target: %s", ", ".join(copied))
        self.drafter: DFlashDraftModel = drafter.to(self.device)
        # Sharded before the feature hooks are added, so FSDP's hooks run first.
        self.target = wrap_target(self.target, self.dist, cfg.distributed)
        self.extractor = FeatureExtractor(self.target, self.drafter.target_layer_ids,
                                          labels=cfg.training.labels,
                                          label_chunk_size=cfg.training.loss_chunk_size)
        objective = DFlashObjective.from_config(self.drafter, self.extractor.embed_weight,
                                                self.extractor.head_weight, cfg)
        self.objective = wrap_drafter(objective, self.dist, cfg.distributed)

        self.steps_per_epoch = len(self._plan(0))
        micro_total = self.steps_per_epoch * cfg.training.epochs
        self.total_steps = max(1, micro_total // cfg.training.grad_accum)
        if cfg.training.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.training.max_steps)
        params = [p for p in self.objective.parameters() if p.requires_grad]
        optimizer = build_optimizer(params, cfg.training)
        schedule = LRSchedule(optimizer, total_steps=self.total_steps, cfg=cfg.training)
        self._target_dims = layer_dims(text_config(self.target.config))
        self.loop = DrafterTrainLoop(
            objective=self.objective, parameters=params, optimizer=optimizer, schedule=schedule,
            cfg=cfg.training, dist_info=self.dist, block_size=self.drafter.block_size,
            autocast_dtype=torch.bfloat16 if self.compute_dtype == torch.bfloat16 else None,
            flops_fn=self._batch_flops, peak_flops=_peak_flops(self.device))
        self._snapshot_step: int | None = None
        """Optimizer step of the last snapshot this run took (same on every rank)."""
        self.best: dict[str, Any] | None = None
        """The best checkpoint so far: ``metric``, ``value``, ``step`` (see :meth:`_improves`)."""
        self.stopped_by: str | None = None
        """Why :meth:`train` ended: completed, max_time_s, stop_after_steps or signal NAME."""
        self._resume_rng: dict[str, Any] | None = None
        # Validated before anything is written, so a refused resume leaves the run dir as it was.
        self.resume_state = self._load_resume()
        if self.dist.is_main:
            save_config(cfg, self.run_dir)
        self.stop = threading.Event()
        self.checkpointer = Checkpointer(self.ckpt_dir, keep_last=cfg.checkpoint.keep_last,
                                         async_save=cfg.checkpoint.async_save)
        if self.best is not None:
            self.checkpointer.mark_best(self.best["step"])
        try:
            self.trackers = build_trackers(
                cfg.logging, self.run_dir, config_dict=config_to_dict(cfg),
                is_rank0=self.dist.is_main,
                resume_run_id=(self.resume_state or {}).get("tracker_run_id"),
                total_steps=self.total_steps, max_time_s=cfg.training.max_time_s)
            self.in_training_eval = None
            if cfg.eval.every_steps and self.dist.is_main:
                from dflash_trainer.evaluate import InTrainingEval

                self.in_training_eval = InTrainingEval.from_config(
                    cfg, target=self.target, tokenizer=self.tokenizer)
        except BaseException:
            self.close()  # the checkpointer thread is running already
            raise

    def _build_dataset(self) -> tuple[Any, Any]:
        # Rank 0 tokenizes; the others then find the finished cache instead of racing to write it.
        if self.dist.enabled and not self.dist.is_main:
            torch.distributed.barrier()
        store, stats = build_dataset(self.cfg, tokenizer=self.tokenizer)
        if self.dist.enabled and self.dist.is_main:
            torch.distributed.barrier()
        if len(store) == 0:
            raise ValueError("no training samples left after preparation; see the prepare "
                             "statistics above (data.max_length, data.min_supervised_tokens)")
        return store, stats

    @functools.lru_cache(maxsize=4)
    def _plan(self, epoch: int) -> Plan:
        return build_plan(self.store.lengths, self.cfg.pipeline, seed=self.cfg.training.seed,
                          epoch=epoch, world_size=self.dist.world_size)

    def _batch_flops(self, batch: Batch) -> float:
        """Model FLOPs of one micro-batch from its host-side shapes (no device sync)."""
        rows, seq_len = batch.shape
        layer_ids = self.drafter.target_layer_ids
        needs_final = self.cfg.training.labels != "data"
        shape = StepShape(rows=rows, seq_len=seq_len, num_anchors=batch.anchors.shape[1],
                          block_size=self.drafter.block_size,
                          mean_anchor=seq_len / 2,  # anchors are uniform over the sequence
                          supervised_slots=self.cfg.training.loss_slots,
                          soft_labels=self.cfg.training.labels == "kl")
        return step_flops(
            target=self._target_dims,
            target_layers_run=(self.target.config.num_hidden_layers if needs_final
                               else max(layer_ids) + 1),
            target_head=needs_final, drafter=layer_dims(self.drafter.config),
            drafter_layers=self.drafter.config.num_hidden_layers, num_features=len(layer_ids),
            vocab=self.extractor.head_weight.shape[0], shape=shape)["total"]

    def _load_resume(self) -> dict[str, Any] | None:
        """Load and apply ``checkpoint.resume``; refuse a fresh run over earlier checkpoints."""
        resume = self.cfg.checkpoint.resume
        folder = resolve_resume(resume, self.ckpt_dir)
        if folder is None:
            if resume is None and (self.ckpt_dir / LATEST).is_file():
                raise ResumeError(
                    f"{self.ckpt_dir} holds checkpoints of an earlier run; continue it with "
                    f"--resume auto (checkpoint.resume=auto) or choose a new run_dir")
            return None  # resume=auto and nothing saved yet: a fresh start
        state = load_state(folder, rank=self.dist.rank)
        check_resume_compatible(state["config"], config_to_dict(self.cfg),
                                saved_world=state["world_size"], world=self.dist.world_size)
        load_model_state(self.drafter, state["drafter"])
        loop_state = state["loop"]
        if is_sharded(self.objective):
            # Saved unsharded (see save_checkpoint); each rank keeps its shard.
            load_optimizer_state(self.objective, self.loop.optimizer, loop_state["optimizer"])
            loop_state = {**loop_state, "optimizer": self.loop.optimizer.state_dict()}
        self.loop.load_state_dict(loop_state)
        self._snapshot_step = self.loop.optimizer_step
        # Restored at the start of train(), so nothing built in between draws from them.
        self._resume_rng = state["rank"]["rng"] if self.dist.rank > 0 else state["rng"]
        self.best = state.get("best")
        step = self.loop.optimizer_step
        if self.loop.schedule.total_steps != self.total_steps:
            log.warning("the LR schedule of the checkpoint spans %d steps, this config %d: the "
                        "schedule keeps the checkpoint's curve; the run stops at step %d",
                        self.loop.schedule.total_steps, self.total_steps, self.total_steps)
        newer = sorted(p.name for p in self.ckpt_dir.glob("step-*")
                       if p.is_dir() and p.name[5:].isdigit() and int(p.name[5:]) > step)
        if newer and self.dist.is_main:
            log.warning("resuming from step %d: newer checkpoints %s belong to the abandoned "
                        "continuation and will be replaced as this run reaches their steps",
                        step, ", ".join(newer))
        log.info("resumed from %s at optimizer step %d", folder, step)
        if self.dist.is_main:
            print(f"resumed from {folder} at step {step}", flush=True)
        return state

    def _rng_state(self) -> dict[str, Any]:
        state = {"python": random.getstate(), "numpy": np.random.get_state(),
                 "torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _restore_rng(self) -> None:
        rng = self._resume_rng
        if rng is None:
            return
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        self._resume_rng = None

    def save_checkpoint(self, prefetcher: BatchPrefetcher, monitor: Monitor, *,
                        eval_tau: float | None = None) -> None:
        """Snapshot between steps (main thread), then hand the write to the checkpointer.

        Every rank calls it at the same step. ``eval_tau`` is this step's in-training eval
        result (rank 0), which decides "best" when in-training eval is on.
        """
        step = self.loop.optimizer_step
        self._snapshot_step = step
        metric, _ = self._best_metric()
        score = eval_tau if metric == "eval/tau" else self.loop.loss_since_checkpoint()
        is_best = self.dist.is_main and self._improves(score)
        if is_best:
            self.best = {"metric": metric, "value": score, "step": step}
        rng = self._rng_state()
        # Collectives when the drafter is sharded, so every rank takes part.
        drafter_state = full_model_state(self.drafter)
        loop_state = self.loop.state_dict()
        if is_sharded(self.objective):
            loop_state["optimizer"] = full_optimizer_state(self.objective, self.loop.optimizer)
        rank_states: dict[int, Any] = {}
        if self.dist.enabled:
            gathered: list[Any] = [None] * self.dist.world_size
            torch.distributed.all_gather_object(
                gathered, {"rng": rng, "prefetch": prefetcher.state_dict()})
            rank_states = {r: s for r, s in enumerate(gathered) if r > 0}
        if not self.dist.is_main:
            return
        state = snapshot({
            "step": step,
            "epoch": self.loop.last_epoch,
            "drafter": drafter_state,
            "loop": loop_state,
            "prefetch": prefetcher.state_dict(),
            "monitor": monitor.state_dict(),
            "rng": rng,
            "tracker_run_id": self.trackers.run_id,
            "best": self.best,
            "config": config_to_dict(self.cfg),
            "world_size": self.dist.world_size,
        })
        drafter_config = self.drafter.config
        target_config = self.target.config

        def export(path: Path) -> None:
            # Built on the meta device: a CPU build would draw its random init from the global
            # RNG, concurrently with the training thread, and change the run's random stream.
            with torch.device("meta"):
                model = DFlashDraftModel(drafter_config)
            model.load_state_dict(state["drafter"], assign=True)
            export_drafter(model, path, target_config=target_config)

        self.checkpointer.save(SaveRequest(
            step=step, state=state, rank_states=rank_states, export=export, best=is_best,
            files={"config.yaml": yaml.safe_dump(state["config"], sort_keys=False)}))

    def _best_metric(self) -> tuple[str, bool]:
        """(name, higher is better) of the metric that decides the best checkpoint.

        ``eval/tau`` (acceptance length, what a drafter is for) when in-training eval is on;
        otherwise the mean ``train/loss`` since the previous checkpoint.
        """
        return ("eval/tau", True) if self.cfg.eval.every_steps else ("train/loss", False)

    def _improves(self, value: float | None) -> bool:
        if value is None or not math.isfinite(value):
            return False
        if self.best is None:
            return True
        higher = self._best_metric()[1]
        return value > self.best["value"] if higher else value < self.best["value"]

    def _new_best_eval(self, tau: float | None, step: int) -> bool:
        """Whether this step's eval beat every earlier one (rank 0 decides at eval steps)."""
        every = self.cfg.eval.every_steps
        if not every or step % every:
            return False
        better = self.dist.is_main and self._improves(tau)
        if self.dist.enabled:
            flag = torch.tensor([float(better)], device=self.device)
            torch.distributed.broadcast(flag, src=0)
            better = bool(flag.item())
        return better

    def _should_checkpoint(self, last_save: float) -> bool:
        ck = self.cfg.checkpoint
        step = self.loop.optimizer_step
        due = bool(ck.every_steps and step % ck.every_steps == 0)
        if ck.every_minutes and time.monotonic() - last_save >= 60 * ck.every_minutes:
            due = True
        if self.dist.enabled and ck.every_minutes:
            # Ranks' clocks differ: rank 0 decides, everyone follows (a collective and a
            # host sync per step, only when time-based saving is on).
            flag = torch.tensor([float(due)], device=self.device)
            torch.distributed.broadcast(flag, src=0)
            due = bool(flag.item())
        return due

    def train(self, *, stop_after_steps: int | None = None,
              on_batch: Callable[[Batch], None] | None = None) -> dict[str, float]:
        """Run until the planned steps are done, max_steps/max_time_s, or a stop signal.

        ``stop_after_steps`` stops once the optimizer step count reaches it, like a signal:
        final checkpoint, no change to the LR schedule (for tests and staged runs).
        ``on_batch`` is called on the main thread with each batch after it was trained on.
        Returns the last logged metrics; :attr:`stopped_by` says why it ended.
        """
        cfg = self.cfg
        batches = Channel("batches", cfg.pipeline.batch_queue_size, self.stop)
        features = Channel("features", cfg.pipeline.feature_queue_size, self.stop)
        prefetcher = BatchPrefetcher(
            self.store, self._plan, rank=self.dist.rank, num_workers=cfg.pipeline.prefetch_workers,
            out_channels=[batches], sample_anchors=sample_anchors,
            num_anchors=cfg.training.num_anchors, block_size=self.drafter.block_size,
            seed=cfg.training.seed, pin_memory=self.device.type == "cuda", stop=self.stop,
            epochs=cfg.training.epochs)
        target_stage = TargetStage(extract=self.extractor, inputs=batches, output=features,
                                   device=self.device, stop=self.stop)
        reduce = (lambda m: reduce_metrics(m, self.dist)) if self.dist.enabled else None
        monitor = Monitor({"prefetch": prefetcher, "target": target_stage, "train": self.loop},
                          {"batches": batches, "features": features}, self.trackers,
                          every_steps=cfg.logging.every_steps, every_s=cfg.logging.every_s,
                          reduce=reduce)
        if self.resume_state is not None:
            own = self.resume_state.get("rank", {}).get("prefetch") if self.dist.rank else None
            prefetcher.load_state_dict(own or self.resume_state["prefetch"])
            monitor.load_state_dict(self.resume_state["monitor"])
        self._restore_rng()
        if self.dist.is_main:
            print(f"training: {self.total_steps} optimizer steps ({self.steps_per_epoch} "
                  f"batches/epoch x {cfg.training.epochs} epochs / grad_accum "
                  f"{cfg.training.grad_accum}), {len(self.store)} samples, device {self.device}, "
                  f"run dir {self.run_dir}", flush=True)
        start = time.monotonic()
        last_save = start
        stopped_by: str | None = None
        tau: float | None = None
        last: dict[str, float] = {}
        with GracefulStop() as signals, Supervisor(self.stop) as sup:
            sup.add(prefetcher)
            sup.add(target_stage)
            sup.start()
            items = sup.iterate(features)
            while self.loop.optimizer_step < self.total_steps:
                wait_start = time.perf_counter()
                item = next(items, None)
                self.loop.note_wait(time.perf_counter() - wait_start)
                if item is None:
                    break
                self.loop.train_micro_batch(item)
                prefetcher.acknowledge(item.batch)
                if on_batch is not None:
                    on_batch(item.batch)
                if self.loop.micro_step % cfg.training.grad_accum:
                    continue
                step = self.loop.optimizer_step
                last = monitor.maybe_log(step) or last
                tau = self._maybe_eval(step)
                new_best = self._new_best_eval(tau, step)
                stopped_by = self._stop_reason(signals, start, step, stop_after_steps)
                if stopped_by is not None:
                    break  # the final checkpoint below
                if new_best or self._should_checkpoint(last_save):
                    # A checkpoint step is a log step: the run totals it saves are exact.
                    last = monitor.final(step) or last
                    self.save_checkpoint(prefetcher, monitor, eval_tau=tau)
                    last_save = time.monotonic()
            self.loop.check_nonfinite()
            last = monitor.final(self.loop.optimizer_step) or last
            # Not checkpointer.last_saved_step: only rank 0 writes, and asynchronously, so
            # ranks would disagree and the snapshot's collectives would hang.
            if self._snapshot_step != self.loop.optimizer_step:
                self.save_checkpoint(prefetcher, monitor, eval_tau=tau)
        self.stopped_by = stopped_by or "completed"
        self._finish(self.stopped_by, time.monotonic() - start)
        return last

    def _stop_reason(self, signals: GracefulStop, start: float, step: int,
                     stop_after_steps: int | None) -> str | None:
        """Why the run stops after ``step`` (None: it goes on); the same on every rank."""
        if stop_after_steps is not None and stop_after_steps <= step < self.total_steps:
            return "stop_after_steps"
        reason = None
        if signals.requested and signals.signum is not None:
            reason = f"signal {signal.Signals(signals.signum).name}"
        elif self.cfg.training.max_time_s and (
                time.monotonic() - start >= self.cfg.training.max_time_s):
            reason = "max_time_s"
        if not self.dist.enabled:
            return reason
        # Ranks see a signal or their clock at different moments but must stop at the same
        # step, or the final collectives hang. Agreeing costs a host sync, so it happens at
        # log steps only (the monitor syncs there anyway).
        if step % self.cfg.logging.every_steps:
            return None
        flag = torch.tensor([float(reason is not None)], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if not flag.item():
            return None
        return reason or "a stop on another rank"

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
        if finished and self.in_training_eval is not None and self.loop.optimizer_step % (
                self.cfg.eval.every_steps or 1):
            self.trackers.log(self.in_training_eval(self.drafter), self.loop.optimizer_step)
        sharded_state = full_model_state(self.drafter) if is_sharded(self.drafter) else None
        if not self.dist.is_main:
            return
        drafter = self.drafter
        if sharded_state is not None:
            drafter = DFlashDraftModel(self.drafter.config)
            drafter.load_state_dict(sharded_state)
        out = export_drafter(drafter, self.run_dir / "drafter", target_config=self.target.config)
        best = ""
        if self.best is not None:
            best = (f"; best checkpoint step-{self.best['step']} "
                    f"({self.best['metric']} {self.best['value']:.4g})")
        print(f"training {stopped_by} after {self.loop.optimizer_step} steps in {seconds:.0f} s; "
              f"drafter exported to {out}; checkpoints in {self.ckpt_dir}{best}", flush=True)

    def close(self) -> None:
        """Finish pending checkpoint writes, close trackers and hooks; idempotent.

        Safe after a failure and on a partly built trainer. Every part is closed; the first
        error is re-raised afterwards.
        """
        if hasattr(self, "stop"):
            self.stop.set()
        first_error: BaseException | None = None
        for name in ("checkpointer", "trackers", "extractor"):
            part = getattr(self, name, None)
            if part is None:
                continue
            try:
                part.close()
            except BaseException as exc:  # noqa: BLE001 - the others must still be closed
                first_error = first_error or exc
        if first_error is not None:
            raise first_error


def main(cfg: Config, args: argparse.Namespace | None = None) -> int:
    """``dflash-trainer train``: exit 0 on completion or on a graceful SIGTERM/SIGINT stop.

    A stop requested by a signal exits 0 (schedulers send SIGTERM to ask for exactly that)
    after the final checkpoint, without the final eval and report. A refused resume exits 2
    with the reason; any other failure propagates (exit 1 with its traceback).
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        trainer = Trainer(cfg)
    except ResumeError as exc:
        print(f"dflash-trainer train: {exc}", file=sys.stderr, flush=True)
        close_distributed()
        return 2
    try:
        trainer.train()
    except BaseException:
        try:
            trainer.close()
        except BaseException:  # noqa: BLE001 - the original failure is the one to report
            log.exception("error while closing after a failure")
        raise
    trainer.close()
    stopped_by_signal = (trainer.stopped_by or "").startswith("signal")
    if trainer.dist.is_main and not stopped_by_signal:
        from dflash_trainer.report import write_report

        print(f"report: {write_report(trainer.run_dir)}", flush=True)
    elif trainer.dist.is_main:
        print(f"stopped by {trainer.stopped_by}: resume with --resume auto; write the report "
              f"with `dflash-trainer report {trainer.run_dir}`", flush=True)
    close_distributed()
    return 0
