"""The frozen target's forward as a pipeline stage: batches in, layer features out.

On CUDA the forward runs on the stage's own stream so it overlaps the drafter step on the
default stream; a recorded event travels with the features and the consumer waits on it
(device-side, no host sync) before use.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import torch

from dflash_trainer.model.batch import StepInput
from dflash_trainer.model.target import TargetOutputs
from dflash_trainer.pipeline.channel import Channel
from dflash_trainer.pipeline.metrics import Metric, Sum
from dflash_trainer.pipeline.stage import Stage

FeatureFn = Callable[[torch.Tensor, torch.Tensor], TargetOutputs]
"""(input_ids [B,S], attention_mask [B,S]) -> features [B,S,K*H] (+ label inputs)."""


class TargetStage(Stage):
    """Moves each batch to the device and runs the target's feature extraction.

    ``threads`` sets the torch intra-op threads of the stage's own thread (unset: the count
    the thread inherits, ``pipeline.num_threads``).
    """

    def __init__(self, *, extract: FeatureFn, inputs: Channel, output: Channel,
                 device: torch.device, stop: threading.Event, name: str = "target",
                 threads: int | None = None) -> None:
        super().__init__(name, stop=stop, outputs=[output])
        self.extract = extract
        self.inputs = inputs
        self.output = output
        self.device = device
        self.threads = threads
        self._tokens = 0
        self._forward_s = 0.0
        self._lock = threading.Lock()

    def run(self) -> None:
        """Consume batches until end-of-stream."""
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self.threads is not None:
            # Per thread once set here: the drafter loop's thread keeps its own count.
            torch.set_num_threads(self.threads)
        for batch in self.inputs:
            with self.busy():
                start = time.perf_counter()
                tokens = int(batch.seq_lens.sum())  # CPU tensor: no device sync
                ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
                with ctx:
                    batch = batch.to(self.device, non_blocking=True)
                    with torch.no_grad():
                        out = self.extract(batch.input_ids, batch.attention_mask)
                    ready = None
                    if stream is not None:
                        ready = torch.cuda.Event()
                        ready.record(stream)
                with self._lock:
                    self._tokens += tokens
                    self._forward_s += time.perf_counter() - start
            self.output.put(StepInput(batch=batch, target=out, ready=ready))

    def collect_metrics(self) -> dict[str, Metric]:
        """Tokens through the target and its forward time in the window."""
        with self._lock:
            metrics: dict[str, Metric] = {f"pipe/{self.name}/tokens": Sum(float(self._tokens)),
                       f"pipe/{self.name}/forward_s": self._forward_s}
            self._tokens = 0
            self._forward_s = 0.0
        return metrics
