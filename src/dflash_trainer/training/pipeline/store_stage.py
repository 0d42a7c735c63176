"""The feature store as a pipeline stage: batches in, the stored features of their rows out.

It takes the target stage's place behind the same channels, so the drafter step receives the
same :class:`~dflash_trainer.model.batch.StepInput` whether the features were computed now or
read from a store: ``[B, S, K * H]`` features right-padded with zeros, and the label mode's
tensors. Padded positions are never read by the objective (no anchor or context there).
"""

from __future__ import annotations

import threading
import time

import torch

from dflash_trainer.features.store import FeatureStore
from dflash_trainer.model.batch import Batch, StepInput
from dflash_trainer.model.target import TargetOutputs
from dflash_trainer.training.pipeline.channel import Channel
from dflash_trainer.training.pipeline.metrics import Metric, Ratio, Sum
from dflash_trainer.training.pipeline.stage import Stage

__all__ = ["StoreReaderStage", "batch_outputs"]


def batch_outputs(store: FeatureStore, batch: Batch, *, labels: str) -> TargetOutputs:
    """The target outputs of ``batch`` (host tensors) from the store, as the target would give
    them for the label mode ``labels``."""
    rows, width = batch.shape
    m = store.manifest
    features = torch.zeros((rows, width, len(m.layer_ids) * m.hidden_size), dtype=store.dtype)
    target_labels = torch.zeros((rows, width), dtype=torch.long) if labels == "target_greedy" else None
    final_hidden = torch.zeros((rows, width, m.hidden_size), dtype=store.dtype) if labels == "kl" else None
    for r, sample_id in enumerate(batch.sample_ids.tolist()):
        sample = store.sample(int(sample_id))
        n = sample.features.shape[0]
        features[r, :n] = sample.features
        if target_labels is not None:
            assert sample.labels is not None, "the store check admits target_greedy stores only"
            target_labels[r, :n] = sample.labels
        if final_hidden is not None:
            assert sample.final_hidden is not None, "the store check admits kl stores only"
            final_hidden[r, :n] = sample.final_hidden
    return TargetOutputs(features=features, target_labels=target_labels, final_hidden=final_hidden)


class StoreReaderStage(Stage):
    """Reads each batch's features from a :class:`FeatureStore` and moves batch and features to
    the device. Metrics: ``pipe/store/read_mb_s`` (stored bytes over read time),
    ``pipe/store/read_mb``, ``pipe/store/wait_frac`` (waiting for batches) and busy time."""

    def __init__(self, *, store: FeatureStore, labels: str, inputs: Channel, output: Channel,
                 device: torch.device, stop: threading.Event, name: str = "store") -> None:
        super().__init__(name, stop=stop, outputs=[output])
        self.store = store
        self.labels = labels
        self.inputs = inputs
        self.output = output
        self.device = device
        self._lock = threading.Lock()
        self._bytes = 0
        self._read_s = 0.0
        self._wait_s = 0.0
        self._window = time.perf_counter()

    def run(self) -> None:
        """Consume batches until end-of-stream."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        items = iter(self.inputs)
        while True:
            wait_start = time.perf_counter()
            batch = next(items, None)
            waited = time.perf_counter() - wait_start
            if batch is None:
                return
            with self.busy():
                start, before = time.perf_counter(), self.store.bytes_read
                out = batch_outputs(self.store, batch, labels=self.labels)
                read_s = time.perf_counter() - start
                nbytes = self.store.bytes_read - before
                # Synchronous copies on this thread's default stream: the drafter step's stream
                # is ordered after them, so no tensor crosses streams.
                batch = batch.to(self.device)
                out = TargetOutputs(**{k: (v.to(self.device) if v is not None else None)
                                       for k, v in vars(out).items()})
            with self._lock:
                self._bytes += nbytes
                self._read_s += read_s
                self._wait_s += waited
            self.output.put(StepInput(batch=batch, target=out, ready=None))

    def collect_metrics(self) -> dict[str, Metric]:
        """Bytes read, read throughput and the wait for batches in the window."""
        now = time.perf_counter()
        with self._lock:
            window, self._window = now - self._window, now
            metrics: dict[str, Metric] = {
                f"pipe/{self.name}/read_mb": Sum(self._bytes / 1e6),
                f"pipe/{self.name}/read_mb_s": Ratio(self._bytes / 1e6, self._read_s),
                f"pipe/{self.name}/wait_frac": Ratio(self._wait_s, window)}
            self._bytes, self._read_s, self._wait_s = 0, 0.0, 0.0
        return metrics
