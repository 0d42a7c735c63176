"""``dflash-trainer train``: build the pipeline, run it, and always close it.

Thread layout per rank: the prefetcher (W workers + dispatcher) and the target stage run
as supervised threads; the drafter step, the monitor, the in-training eval and checkpoint
snapshots run on the main thread between steps; the checkpoint writer has its own thread.
"""

from __future__ import annotations

import argparse
import functools
import logging
import random
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_trainer import assets
from dflash_trainer.checkpoint import (
    CheckpointError, Checkpointer, SaveRequest, load_state, resolve_resume, snapshot)
from dflash_trainer.config import Config, config_to_dict, save_config
from dflash_trainer.data.buckets import Plan, build_plan
from dflash_trainer.data.prepare import build_dataset
from dflash_trainer.distributed import (
    DistInfo, close_distributed, init_distributed, reduce_metrics, wrap_drafter)
from dflash_trainer.model.blocks import sample_anchors
from dflash_trainer.model.drafter import build_drafter, init_from_target
from dflash_trainer.model.export import export_drafter
from dflash_trainer.model.modeling.dflash import DFlashDraftModel
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.target import FeatureExtractor, load_target, resolve_mask_token_id
from dflash_trainer.optim import LRSchedule, build_optimizer
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


def check_resume_compatible(saved: dict[str, Any], current: dict[str, Any], *,
                            saved_world: int, world: int) -> None:
    """Refuse a resume whose data order, model or world size differ from the checkpoint."""
    if saved_world != world:
        raise CheckpointError(
            f"the checkpoint was written by {saved_world} rank(s), this run has {world}; the data "
            f"plan is step-aligned per rank, so resume with the same number of ranks")
    for key in RESUME_KEYS:
        old, new = _pick(saved, key), _pick(current, key)
        if old != new:
            raise CheckpointError(f"cannot resume: {key} was {old!r} in the checkpoint and is "
                                  f"{new!r} now; use the checkpoint's config.yaml")


class Trainer:
    """Everything one rank needs for a run; :meth:`train` runs it, :meth:`close` cleans up."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.dist: DistInfo = init_distributed(cfg.pipeline, cfg.distributed)
        if cfg.pipeline.num_threads:
            torch.set_num_threads(cfg.pipeline.num_threads)
        self.device = self.dist.device
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        if self.dist.is_main:
            save_config(cfg, self.run_dir)
        # Same seed on every rank for the drafter init (DDP also broadcasts rank 0's weights).
        torch.manual_seed(cfg.training.seed)
        self.compute_dtype = _dtype(cfg, self.device)

        target_path = assets.resolve_target(cfg.model.target)
        self.target, self.tokenizer = load_target(str(target_path), device=self.device,
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
        self.loop = DrafterTrainLoop(
            objective=self.objective, parameters=params, optimizer=optimizer, schedule=schedule,
            cfg=cfg.training, dist_info=self.dist, block_size=self.drafter.block_size,
            autocast_dtype=torch.bfloat16 if self.compute_dtype == torch.bfloat16 else None,
            flops_per_token=self._flops_per_token(), peak_flops=_peak_flops(self.device))
        self.checkpointer = Checkpointer(self.ckpt_dir, keep_last=cfg.checkpoint.keep_last,
                                         async_save=cfg.checkpoint.async_save)
        self.resume_state = self._load_resume()
        self.trackers = build_trackers(
            cfg.logging, self.run_dir, config_dict=config_to_dict(cfg), is_rank0=self.dist.is_main,
            resume_run_id=(self.resume_state or {}).get("tracker_run_id"),
            total_steps=self.total_steps)
        self.stop = threading.Event()
        self.in_training_eval = None
        if cfg.eval.every_steps and self.dist.is_main:
            from dflash_trainer.evaluate import InTrainingEval

            self.in_training_eval = InTrainingEval.from_config(
                cfg, target=self.target, tokenizer=self.tokenizer)

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

    def _flops_per_token(self) -> float:
        """Model FLOPs per sequence token: target forward + drafter fwd/bwd + LM head."""
        target_params = sum(p.numel() for p in self.target.parameters())
        drafter_params = sum(p.numel() for p in self.drafter.parameters())
        hidden, vocab = self.extractor.head_weight.shape[1], self.extractor.head_weight.shape[0]
        anchors_per_token = self.cfg.training.num_anchors * self.drafter.block_size / max(
            1.0, float(np.mean(self.store.lengths)))
        block_tokens = min(anchors_per_token, float(self.drafter.block_size))
        return 2.0 * target_params + block_tokens * (6.0 * drafter_params + 4.0 * hidden * vocab)

    def _load_resume(self) -> dict[str, Any] | None:
        folder = resolve_resume(self.cfg.checkpoint.resume, self.ckpt_dir)
        if folder is None:
            if self.cfg.checkpoint.resume not in (None, "auto"):
                raise CheckpointError(f"checkpoint.resume={self.cfg.checkpoint.resume}: not found")
            return None
        state = load_state(folder, rank=self.dist.rank)
        check_resume_compatible(state["config"], config_to_dict(self.cfg),
                                saved_world=state["world_size"], world=self.dist.world_size)
        self.drafter.load_state_dict(state["drafter"])
        self.loop.load_state_dict(state["loop"])
        rng = state["rank"]["rng"] if self.dist.rank > 0 else state["rng"]
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        log.info("resumed from %s at optimizer step %d", folder, self.loop.optimizer_step)
        if self.dist.is_main:
            print(f"resumed from {folder} at step {self.loop.optimizer_step}", flush=True)
        return state

    def _rng_state(self) -> dict[str, Any]:
        return {"python": random.getstate(), "numpy": np.random.get_state(),
                "torch": torch.get_rng_state()}

    def save_checkpoint(self, prefetcher: BatchPrefetcher, monitor: Monitor) -> None:
        """Snapshot between steps (main thread), then hand the write to the checkpointer."""
        step = self.loop.optimizer_step
        rng = self._rng_state()
        rank_states: dict[int, Any] = {}
        if self.dist.enabled:
            gathered: list[Any] = [None] * self.dist.world_size
            torch.distributed.all_gather_object(gathered, {"rng": rng})
            rank_states = {r: s for r, s in enumerate(gathered) if r > 0}
        if not self.dist.is_main:
            return
        state = snapshot({
            "step": step,
            "drafter": self.drafter.state_dict(),
            "loop": self.loop.state_dict(),
            "prefetch": prefetcher.state_dict(),
            "monitor": monitor.state_dict(),
            "rng": rng,
            "tracker_run_id": self.trackers.run_id,
            "config": config_to_dict(self.cfg),
            "world_size": self.dist.world_size,
        })
        drafter_config = self.drafter.config
        target_config = self.target.config

        def export(path: Path) -> None:
            model = DFlashDraftModel(drafter_config)
            model.load_state_dict(state["drafter"])
            export_drafter(model, path, target_config=target_config)

        self.checkpointer.save(SaveRequest(step=step, state=state, rank_states=rank_states,
                                           export=export))

    def _should_checkpoint(self, last_save: float) -> bool:
        ck = self.cfg.checkpoint
        step = self.loop.optimizer_step
        due = bool(ck.every_steps and step % ck.every_steps == 0)
        if ck.every_minutes and time.monotonic() - last_save >= 60 * ck.every_minutes:
            due = True
        if self.dist.enabled:
            # Ranks' clocks differ: rank 0 decides, everyone follows (a collective per step
            # only when time-based saving is on).
            flag = torch.tensor([float(due)], device=self.device)
            if ck.every_minutes:
                torch.distributed.broadcast(flag, src=0)
            due = bool(flag.item())
        return due

    def train(self) -> dict[str, float]:
        """Run until the planned steps are done, max_steps/max_time_s, or a stop signal."""
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
            prefetcher.load_state_dict(self.resume_state["prefetch"])
            monitor.load_state_dict(self.resume_state["monitor"])
        if self.dist.is_main:
            print(f"training: {self.total_steps} optimizer steps ({self.steps_per_epoch} "
                  f"batches/epoch x {cfg.training.epochs} epochs / grad_accum "
                  f"{cfg.training.grad_accum}), {len(self.store)} samples, device {self.device}, "
                  f"run dir {self.run_dir}", flush=True)
        start = time.monotonic()
        last_save = start
        stopped_by = "completed"
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
                if self.loop.micro_step % cfg.training.grad_accum:
                    continue
                step = self.loop.optimizer_step
                last = monitor.maybe_log(step) or last
                self._maybe_eval(step)
                if signals.requested:
                    stopped_by = f"signal {signals.signum}"
                elif cfg.training.max_time_s and time.monotonic() - start >= cfg.training.max_time_s:
                    stopped_by = "max_time_s"
                if stopped_by != "completed":
                    break
                if self._should_checkpoint(last_save):
                    self.save_checkpoint(prefetcher, monitor)
                    last_save = time.monotonic()
            self.loop.check_nonfinite()
            last = monitor.final(self.loop.optimizer_step) or last
            if self.checkpointer.last_saved_step != self.loop.optimizer_step:
                self.save_checkpoint(prefetcher, monitor)
        self._finish(stopped_by, time.monotonic() - start)
        return last

    def _maybe_eval(self, step: int) -> None:
        every = self.cfg.eval.every_steps
        if self.in_training_eval is None or not every or step % every:
            return
        result = self.in_training_eval(self.drafter)
        self.trackers.log(result, step)

    def _finish(self, stopped_by: str, seconds: float) -> None:
        self.checkpointer.wait()
        if self.in_training_eval is not None and self.loop.optimizer_step % (
                self.cfg.eval.every_steps or 1):
            self.trackers.log(self.in_training_eval(self.drafter), self.loop.optimizer_step)
        if not self.dist.is_main:
            return
        out = export_drafter(self.drafter, self.run_dir / "drafter",
                             target_config=self.target.config)
        print(f"training {stopped_by} after {self.loop.optimizer_step} steps in {seconds:.0f} s; "
              f"drafter exported to {out}; checkpoints in {self.ckpt_dir}", flush=True)

    def close(self) -> None:
        """Release threads, trackers and the process group (safe after a failure)."""
        self.stop.set()
        try:
            self.checkpointer.close()
        finally:
            if hasattr(self, "trackers"):
                self.trackers.close()
            self.extractor.close()


def main(cfg: Config, args: argparse.Namespace | None = None) -> int:
    """``dflash-trainer train``: exit 0 on completion or on a graceful SIGTERM/SIGINT stop."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    if trainer.dist.is_main:
        from dflash_trainer.report import write_report

        print(f"report: {write_report(trainer.run_dir)}", flush=True)
    close_distributed()
    return 0
