"""BatchPrefetcher: W worker threads turn plan steps into padded batches, in plan order.

Threads and ownership: W workers each claim the next stream index from ONE shared counter
(under ``_cond``), collate that step's batch for this rank and park it in a reorder buffer;
the stage thread (dispatcher) takes the buffer in stream order and puts stream index i into
output channel ``i % len(outputs)``. Workers may not claim more than ``reorder_window``
indices ahead of the dispatcher, which bounds memory when the consumer is slow.

Several outputs: consumers that share one prefetcher (e.g. several target-stage threads)
take the batches round-robin, so together they still see plan order; the trainer uses one.

Results do not depend on which worker built a batch: anchors come from a generator seeded
by (seed, epoch, step, rank). Resume: the consumer calls :meth:`BatchPrefetcher.acknowledge`
for every batch it trained on; :meth:`state_dict` is the first position not acknowledged,
so batches in flight (queued or being built) at checkpoint time are produced again, and
:meth:`load_state_dict` starts a new prefetcher there.

Metrics: ``data/bucket/{i}/dispatched`` counts batches the dispatcher sent on (a batch in
flight at a checkpoint is dispatched again after resume); everything else (``trained`` per
bucket, lengths, padding, same-bucket runs) describes the acknowledged batches.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from dflash_trainer.data.buckets import Plan
from dflash_trainer.model.batch import Batch
from dflash_trainer.model.blocks import sample_anchors
from dflash_trainer.training.pipeline.channel import POLL_S, Channel, StopRequested
from dflash_trainer.training.pipeline.metrics import Max, Metric, Min, Ratio
from dflash_trainer.training.pipeline.stage import Stage

STATE_VERSION = 1


class TokenDataset(Protocol):
    """What the prefetcher reads: a memory-mapped token store or anything alike."""

    lengths: np.ndarray

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32 [L], loss_mask uint8 [L]) of sample ``index``."""
        ...


def step_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """Seed of the per-step anchor generator (independent of worker scheduling)."""
    high, low = np.random.SeedSequence([seed % 2**63, epoch, step, rank]).generate_state(2)
    return ((int(high) << 32) | int(low)) & (2**63 - 1)


@dataclass(frozen=True, kw_only=True)
class PrefetchOptions:
    """What a :class:`BatchPrefetcher` builds and how many threads build it."""

    rank: int
    """The data-parallel rank whose batches of each plan step are built."""
    num_workers: int
    """Worker threads (``pipeline.prefetch_workers``)."""
    num_anchors: int
    block_size: int
    seed: int
    """``training.seed``: with (epoch, step, rank) it seeds each step's anchor generator."""
    epochs: int
    """Epochs ``0 .. epochs - 1``; end-of-stream follows the last step of the last."""
    pin_memory: bool = False
    """Page-locked batches, for asynchronous copies to a CUDA device."""
    device: torch.device | None = None
    """The rank's device: a worker that pins memory makes this CUDA device its current one."""
    reorder_window: int | None = None
    """Steps workers may claim beyond those dispatched (None: ``2 * num_workers``)."""


class BatchPrefetcher(Stage):
    """Builds this rank's batches for every step of every epoch and dispatches them in order.

    ``plans`` gives each epoch's :class:`Plan`; ``outputs`` receive the batches round-robin
    by stream index (see the module docstring). A new prefetcher starts at the first step of
    epoch 0; :meth:`load_state_dict` moves it to a saved position before :meth:`start`.
    """

    def __init__(self, dataset: TokenDataset, plans: Callable[[int], Plan],
                 options: PrefetchOptions, *, outputs: Sequence[Channel], stop: threading.Event,
                 name: str = "prefetch") -> None:
        if options.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 (pipeline.prefetch_workers), "
                             f"got {options.num_workers}")
        if not outputs:
            raise ValueError("the prefetcher needs at least one output channel")
        pin_memory = options.pin_memory
        if pin_memory and not torch.cuda.is_available():
            warnings.warn("pin_memory has no effect without CUDA; batches stay in pageable memory",
                          stacklevel=2)
            pin_memory = False
        super().__init__(name, stop=stop, outputs=outputs, num_busy_threads=options.num_workers)
        self.dataset = dataset
        self._build_plan = plans
        self.options = options
        self.rank = options.rank
        self.seed = options.seed
        self.pin_memory = pin_memory
        self.reorder_window = options.reorder_window or 2 * options.num_workers
        self._world_size: int | None = None
        self._cond = threading.Condition()
        self._plan: Plan | None = None
        self._set_position(0, 0, 0)
        self._metrics = _BatchMetrics()

    def _set_position(self, epoch: int, step: int, index: int) -> None:
        # Claim cursor (workers), dispatch cursor, end marker, and acknowledged watermark.
        self._epoch, self._step, self._next_index = epoch, step, index
        self._emitted = index
        self._final_index: int | None = None
        self._done: dict[int, Batch] = {}
        self._ack_position = (epoch, step, index)
        self._acked: dict[int, tuple[int, int]] = {}

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the dispatcher and the workers."""
        super().start()
        for w in range(self.options.num_workers):
            self.spawn(self._work, f"worker{w}")

    def run(self) -> None:
        """Dispatcher: reorder buffer -> output channels, in stream order."""
        while True:
            with self._cond:
                while self._emitted not in self._done:
                    if self._final_index is not None and self._emitted >= self._final_index:
                        return
                    if self.stop.is_set():
                        raise StopRequested
                    self._cond.wait(POLL_S)
                batch = self._done.pop(self._emitted)
            self.outputs[batch.stream_index % len(self.outputs)].put(batch)
            self._metrics.dispatched(batch.bucket)
            with self._cond:
                self._emitted += 1
                self._cond.notify_all()

    def _work(self) -> None:
        device = self.options.device
        if self.pin_memory and device is not None and device.type == "cuda":
            # Pinning allocates through the thread's current device, GPU 0 in a new thread:
            # without this every rank above 0 would create a CUDA context there.
            torch.cuda.set_device(device)
        while (claim := self._claim()) is not None:
            index, plan, step = claim
            with self.busy():
                batch = self.collate(plan, step, index)
            with self._cond:
                self._done[index] = batch
                self._cond.notify_all()

    def _claim(self) -> tuple[int, Plan, int] | None:
        """The next (stream index, plan, step) from the shared counter, or None at the end."""
        with self._cond:
            while self._next_index - self._emitted >= self.reorder_window:
                if self.stop.is_set():
                    raise StopRequested
                self._cond.wait(POLL_S)
            if self.stop.is_set():
                raise StopRequested
            while True:
                if self._epoch >= self.options.epochs:
                    self._final_index = self._next_index
                    self._cond.notify_all()
                    return None
                # Built under the lock, once per epoch (a fraction of a second); the other
                # workers would have to wait for it anyway.
                if self._plan is None or self._plan.epoch != self._epoch:
                    self._plan = self._checked_plan(self._epoch)
                if self._step < len(self._plan):
                    break
                self._epoch, self._step = self._epoch + 1, 0
            claim = (self._next_index, self._plan, self._step)
            self._next_index += 1
            self._step += 1
            return claim

    def _checked_plan(self, epoch: int) -> Plan:
        plan = self._build_plan(epoch)
        if plan.epoch != epoch:
            raise ValueError(f"the plan builder returned epoch {plan.epoch} for epoch {epoch}")
        if self._world_size is not None and plan.world_size != self._world_size:
            raise ValueError(f"data state was saved with {self._world_size} data-parallel ranks, "
                             f"this run has {plan.world_size}; resume with the same world size")
        if not 0 <= self.rank < plan.world_size:
            raise ValueError(f"rank {self.rank} outside the plan's {plan.world_size} ranks")
        self._world_size = plan.world_size
        return plan

    # -- collate -------------------------------------------------------------------------

    def collate(self, plan: Plan, step_index: int, index: int) -> Batch:
        """This rank's batch of step ``step_index`` of ``plan`` at stream ``index`` (see
        :func:`collate`), pinned if ``pin_memory``."""
        batch = collate(self.dataset, plan, step_index, self.options, stream_index=index)
        return batch.pin_memory() if self.pin_memory else batch

    # -- resume ------------------------------------------------------------------------

    def acknowledge(self, batch: Batch) -> None:
        """Record that the consumer trained on ``batch`` (call after its optimizer step).

        The batch metrics other than ``dispatched`` count acknowledged batches, so a batch
        that was in flight at a checkpoint and is produced again after resume counts once.
        """
        self._metrics.trained(batch)
        with self._cond:
            epoch, step, index = self._ack_position
            if batch.stream_index < index or batch.stream_index in self._acked:
                raise ValueError(f"batch at stream index {batch.stream_index} (epoch "
                                 f"{batch.epoch}, step {batch.step}) was already acknowledged")
            self._acked[batch.stream_index] = (batch.epoch, batch.step)
            while index in self._acked:
                epoch, step = self._acked.pop(index)
                step += 1
                index += 1
            self._ack_position = (epoch, step, index)

    def state_dict(self) -> dict[str, Any]:
        """The first position not acknowledged: a resumed run starts there."""
        with self._cond:
            epoch, step, index = self._ack_position
        return {"version": STATE_VERSION, "epoch": epoch, "step": step, "stream_index": index,
                "seed": self.seed, "world_size": self._world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (before :meth:`start`)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"prefetcher state version {state.get('version')!r} is not "
                             f"{STATE_VERSION}; this checkpoint's data position cannot be read")
        if state["seed"] != self.seed:
            raise ValueError(f"checkpoint data order used training.seed={state['seed']}, this "
                             f"run uses {self.seed}; resume with the same seed")
        if self._started:
            raise RuntimeError("load_state_dict must be called before start()")
        self._set_position(state["epoch"], state["step"], state["stream_index"])
        self._world_size = state["world_size"]

    # -- metrics ------------------------------------------------------------------------

    def collect_metrics(self) -> dict[str, Metric]:
        """Batch statistics since the previous call (see ``_BatchMetrics``)."""
        num_buckets = self._plan.num_buckets if self._plan is not None else 0
        return self._metrics.collect(num_buckets)


def collate(dataset: TokenDataset, plan: Plan, step_index: int, options: PrefetchOptions, *,
            stream_index: int = 0) -> Batch:
    """Rank ``options.rank``'s batch of step ``step_index`` of ``plan``: its samples
    right-padded with id 0, masks off on the padding, and up to ``options.num_anchors``
    anchors from the step's own generator (seeded by seed, epoch, step and rank), so the same
    step gives the same batch whoever builds it."""
    step = plan.steps[step_index]
    ids = step.batches[options.rank]
    rows = [dataset[int(i)] for i in ids]
    lens = np.asarray([len(tokens) for tokens, _ in rows], dtype=np.int64)
    for i, (tokens, mask), planned in zip(ids, rows, dataset.lengths[ids]):
        if len(tokens) != planned or len(mask) != len(tokens):
            raise ValueError(f"sample {int(i)}: dataset returned {len(tokens)} ids and "
                             f"{len(mask)} mask values, its stored length is {int(planned)}; "
                             f"the token store is inconsistent, rebuild it")
    width = int(lens.max())
    input_ids = np.zeros((len(rows), width), dtype=np.int64)
    loss_mask = np.zeros((len(rows), width), dtype=bool)
    for r, (tokens, mask) in enumerate(rows):
        input_ids[r, :lens[r]] = tokens
        loss_mask[r, :lens[r]] = mask
    loss_mask_t = torch.from_numpy(loss_mask)
    generator = torch.Generator().manual_seed(step_seed(options.seed, plan.epoch, step_index,
                                                        options.rank))
    seq_lens = torch.from_numpy(lens)
    # seq_lens keeps every anchor (and its first label) inside its row's real tokens.
    anchors, keep = sample_anchors(loss_mask_t, options.num_anchors, options.block_size,
                                   generator, seq_lens=seq_lens)
    return Batch(input_ids=torch.from_numpy(input_ids), loss_mask=loss_mask_t,
                 attention_mask=torch.from_numpy(np.arange(width) < lens[:, None]),
                 seq_lens=seq_lens, anchors=anchors, keep=keep,
                 sample_ids=np.asarray(ids, dtype=np.int64), bucket=step.bucket,
                 epoch=plan.epoch, step=step_index, stream_index=stream_index,
                 num_tokens=int(lens.sum()))


class _BatchMetrics:
    """Windowed counters of dispatched and trained batches; thread-safe (dispatcher, consumer
    and monitor threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_bucket: int | None = None
        self._run = 0
        self._reset()

    def _reset(self) -> None:
        self._dispatched: dict[int, int] = {}
        self._trained: dict[int, int] = {}
        self._num_seqs = 0
        self._len_sum = 0
        self._len_max = 0
        self._len_min: int | None = None
        self._real = 0
        self._padded = 0
        self._max_run = self._run

    def dispatched(self, bucket: int) -> None:
        with self._lock:
            self._dispatched[bucket] = self._dispatched.get(bucket, 0) + 1

    def trained(self, batch: Batch) -> None:
        rows, width = batch.shape
        shortest = int(batch.seq_lens.min())
        with self._lock:
            self._trained[batch.bucket] = self._trained.get(batch.bucket, 0) + 1
            self._run = self._run + 1 if batch.bucket == self._last_bucket else 1
            self._last_bucket = batch.bucket
            self._max_run = max(self._max_run, self._run)
            self._num_seqs += rows
            self._len_sum += batch.num_tokens
            self._len_max = max(self._len_max, width)
            self._len_min = shortest if self._len_min is None else min(self._len_min, shortest)
            self._real += batch.num_tokens
            self._padded += rows * width

    def collect(self, num_buckets: int) -> dict[str, Metric]:
        with self._lock:
            buckets = range(max(num_buckets, max((*self._dispatched, *self._trained),
                                                 default=-1) + 1))
            # Per-rank counts, averaged over ranks: every rank takes one batch per step.
            metrics: dict[str, Metric] = {
                f"data/bucket/{b}/{kind}": float(counts.get(b, 0)) for b in buckets
                for kind, counts in (("dispatched", self._dispatched), ("trained", self._trained))}
            if self._num_seqs:
                metrics.update({
                    "data/seq_len_mean": Ratio(float(self._len_sum), float(self._num_seqs)),
                    "data/seq_len_max": Max(float(self._len_max)),
                    "data/seq_len_min": Min(float(self._len_min or 0)),
                    "data/padding_efficiency": Ratio(float(self._real), float(self._padded)),
                })
            metrics["data/same_bucket_run"] = float(self._run)
            metrics["data/max_same_bucket_run"] = float(self._max_run)
            self._reset()
        return metrics
