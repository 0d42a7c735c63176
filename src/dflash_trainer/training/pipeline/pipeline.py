"""TrainingPipeline: the prefetcher and target stage threads, their channels, the supervisor
and the monitor of one rank; the caller trains on what it delivers, on its own thread.

::

    BatchPrefetcher --"batches"--> TargetStage --"features"--> caller: DrafterStep

Use it as a context manager: entering starts the stage threads; leaving (normally or by an
exception) stops and joins them, and re-raises a stage's failure with its original traceback.
The caller's loop is ``for item in pipeline.step_inputs(until=...)``: train on ``item``, then
:meth:`~TrainingPipeline.acknowledge` its batch. :meth:`state_dict` is the data position
(first batch not acknowledged) and the monitor's run totals; load it before entering.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from dflash_trainer.config import Config
from dflash_trainer.data.buckets import Plan
from dflash_trainer.features.engine import VllmFeatureClient
from dflash_trainer.features.store import FeatureStore
from dflash_trainer.core.distributed import DistInfo, StopAgreement, gather_objects
from dflash_trainer.model.batch import Batch, StepInput
from dflash_trainer.training.pipeline.channel import Channel
from dflash_trainer.training.pipeline.drafter_step import DrafterStep
from dflash_trainer.training.pipeline.monitor import Monitor
from dflash_trainer.training.pipeline.prefetch import BatchPrefetcher, PrefetchOptions, TokenDataset
from dflash_trainer.training.pipeline.stage import Stage, Supervisor
from dflash_trainer.training.pipeline.engine_metrics import EngineMetrics
from dflash_trainer.training.pipeline.store_stage import StoreReaderStage
from dflash_trainer.training.pipeline.target_stage import FeatureFn, TargetStage
from dflash_trainer.training.trackers import StepValues, Tracker

__all__ = ["PipelineSettings", "TrainingPipeline", "plan_metrics"]


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """The sizes and intervals of one pipeline (from ``pipeline.*``, ``training.*`` and
    ``logging.*``; see :meth:`from_config`)."""

    prefetch_workers: int
    batch_queue_size: int
    feature_queue_size: int
    num_anchors: int
    block_size: int
    seed: int
    epochs: int
    log_every_steps: int = 1
    log_every_s: float | None = None
    target_threads: int | None = None
    labels: str = "data"
    """``training.labels``: what a feature store reader hands the objective besides features."""

    @classmethod
    def from_config(cls, cfg: Config, *, block_size: int) -> PipelineSettings:
        """Settings of the run config ``cfg`` for a drafter of ``block_size``."""
        return cls(prefetch_workers=cfg.pipeline.prefetch_workers,
                   batch_queue_size=cfg.pipeline.batch_queue_size,
                   feature_queue_size=cfg.pipeline.feature_queue_size,
                   num_anchors=cfg.training.num_anchors, block_size=block_size,
                   seed=cfg.training.seed, epochs=cfg.training.epochs,
                   log_every_steps=cfg.logging.every_steps, log_every_s=cfg.logging.every_s,
                   target_threads=cfg.pipeline.target_threads, labels=cfg.training.labels)


class TrainingPipeline:
    """One rank's pipeline feeding ``drafter_step``; :meth:`step_inputs` delivers its inputs.

    ``extract`` is the target's feature function (a ``FeatureExtractor``); ``trackers``
    receives the monitor's logs, with the bucket of every acknowledged micro-batch added
    (``data/step_buckets``). Thread ownership: the prefetcher's workers and dispatcher and the
    target stage run on their own threads; the drafter step, the monitor and this object's
    methods run on the caller's thread. ``stop_agreement`` (a sharded target's,
    ``distributed.target_stop_agreement``) makes the target stages of all ranks run the same
    forwards. ``engine`` (an engine-served target, whose feature function ``extract`` is) adds
    the engine's metrics.
    """

    def __init__(self, *, data: TokenDataset, plans: Callable[[int], Plan], extract: FeatureFn | None,
                 drafter_step: DrafterStep, dist: DistInfo, settings: PipelineSettings,
                 store: FeatureStore | None = None,
                 trackers: Tracker | None = None,
                 stop_agreement: StopAgreement | None = None,
                 engine: VllmFeatureClient | None = None) -> None:
        self.drafter_step = drafter_step
        self.stop = threading.Event()
        self.batches = Channel("batches", settings.batch_queue_size, self.stop)
        self.features = Channel("features", settings.feature_queue_size, self.stop)
        self.prefetcher = BatchPrefetcher(
            data, plans, PrefetchOptions(
                rank=dist.rank, num_workers=settings.prefetch_workers,
                num_anchors=settings.num_anchors, block_size=settings.block_size,
                seed=settings.seed, epochs=settings.epochs,
                pin_memory=dist.device.type == "cuda", device=dist.device),
            outputs=[self.batches], stop=self.stop)
        self.target_stage: Stage
        if store is not None:
            self.target_stage = StoreReaderStage(store=store, labels=settings.labels, inputs=self.batches,
                                                 output=self.features, device=dist.device, stop=self.stop)
        else:
            assert extract is not None, "a pipeline needs the target's extractor or a feature store"
            self.target_stage = TargetStage(extract=extract, inputs=self.batches,
                                            output=self.features, device=dist.device,
                                            stop=self.stop, threads=settings.target_threads,
                                            agreement=stop_agreement)
        self.supervisor = Supervisor(self.stop)
        self.supervisor.add(self.prefetcher)
        self.supervisor.add(self.target_stage)
        self.step_buckets = StepValues(trackers or Tracker(), "data/step_buckets")
        gather = (lambda window: gather_objects(window, dist)) if dist.enabled else None
        sources: dict[str, Any] = {"prefetch": self.prefetcher, self.target_stage.name: self.target_stage,
                                   "train": drafter_step}
        if engine is not None:
            sources["engine"] = EngineMetrics(engine)
        self.monitor = Monitor(
            sources,
            {"batches": self.batches, "features": self.features}, self.step_buckets,
            every_steps=settings.log_every_steps, every_s=settings.log_every_s, gather=gather)

    def __enter__(self) -> TrainingPipeline:
        self.supervisor.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.supervisor.__exit__(exc_type, exc, tb)

    def close(self) -> None:
        """Stop the stages and join their threads (idempotent)."""
        self.supervisor.close()

    def step_inputs(self, *, until: Callable[[], bool]) -> Iterator[StepInput]:
        """The drafter step's inputs in plan order, as the target stage delivers them, until
        ``until()`` is true (checked before each one is fetched) or the data ends.

        Waiting for an input is timed for ``perf/data_wait_frac``. A stage's failure is
        re-raised here with its original traceback.
        """
        items = self.supervisor.iterate(self.features)
        while not until():
            wait_start = time.perf_counter()
            item = next(items, None)
            self.drafter_step.note_wait(time.perf_counter() - wait_start)
            if item is None:
                return
            yield item

    def acknowledge(self, batch: Batch) -> None:
        """Record that the drafter step trained on ``batch``: a checkpoint taken from now on
        resumes after it, and its bucket goes into the next log (``data/step_buckets``)."""
        self.prefetcher.acknowledge(batch)
        self.step_buckets.record(batch.bucket)

    def stage_metrics(self) -> dict[str, float]:
        """Every stage's window metrics (resets the windows), without logging them."""
        return self.supervisor.get_metrics()


def plan_metrics(plan: Plan) -> dict[str, float]:
    """The plan statistics of one epoch, as logged metrics (``plan/*``)."""
    s = plan.stats
    return {"plan/epoch": float(plan.epoch), "plan/steps": float(len(plan)),
            "plan/samples": float(s.num_samples), "plan/dropped": float(s.num_dropped),
            "plan/carried": float(s.num_carried),
            "plan/padding_efficiency": s.padding_efficiency,
            "plan/max_run": float(s.max_run), "plan/run_limit": float(s.run_limit)}

