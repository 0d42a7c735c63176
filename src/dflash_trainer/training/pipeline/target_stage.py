"""The frozen target's forward as a pipeline stage: batches in, layer features out.

On CUDA the copy of each batch to the device and the forward run on the stage's own stream,
so they overlap the drafter step on the default stream; a recorded event travels with the
:class:`~dflash_trainer.model.batch.StepInput` and the consumer waits on it (device-side, no
host sync) and records every one of its tensors on its own stream
(:meth:`~dflash_trainer.model.batch.StepInput.tensors`).

With a sharded target (``distributed.target=fsdp``) each forward is a sequence of collectives
that every rank must enter: the stages of all ranks agree before each forward whether any of
them stops (:class:`~dflash_trainer.core.distributed.StopAgreement`), so every rank runs the same
forwards, whenever and wherever a stop comes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from dflash_trainer.core.distributed import StopAgreement
from dflash_trainer.model.batch import Batch, StepInput
from dflash_trainer.model.target import TargetOutputs
from dflash_trainer.training.pipeline.channel import END, Channel, StageFailure, StopRequested
from dflash_trainer.training.pipeline.metrics import Metric, Sum
from dflash_trainer.training.pipeline.stage import Stage

FeatureFn = Callable[[torch.Tensor, torch.Tensor], TargetOutputs]
"""(input_ids [B,S], attention_mask [B,S]) -> features [B,S,K*H] (+ label inputs)."""


class PeerStopped(RuntimeError):
    """Another rank's target stage stopped before this rank's pipeline did."""


def stage_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The calling stage thread's own CUDA stream on ``device`` (None off CUDA).

    Sets the thread's current device first: a new thread starts on GPU 0, and entering and
    leaving ``torch.cuda.stream()`` or allocating there would create a CUDA context on GPU 0
    for every rank above 0 (about 0.5 GB each).
    """
    if device.type != "cuda":
        return None
    torch.cuda.set_device(device)
    return torch.cuda.Stream(device)


class TargetStage(Stage):
    """Moves each batch to the device and runs the target's feature extraction.

    ``threads`` sets the torch intra-op threads of the stage's own thread (unset: the count
    the thread inherits, ``pipeline.num_threads``). ``agreement`` (a sharded target only) is
    consulted before every forward; when another rank stopped first, this rank's consumer
    gets :class:`PeerStopped` if it asks for more.
    """

    def __init__(self, *, extract: FeatureFn, inputs: Channel, output: Channel,
                 device: torch.device, stop: threading.Event, name: str = "target",
                 threads: int | None = None, agreement: StopAgreement | None = None) -> None:
        super().__init__(name, stop=stop, outputs=[output])
        self.extract = extract
        self.inputs = inputs
        self.output = output
        self.device = device
        self.threads = threads
        self.agreement = agreement
        self._tokens = 0
        self._forward_s = 0.0
        self._lock = threading.Lock()

    def run(self) -> None:
        """Consume batches until end-of-stream, a stop, or (sharded) another rank's stop."""
        stream = stage_stream(self.device)
        if self.threads is not None:
            # Per thread once set here: the drafter loop's thread keeps its own count.
            torch.set_num_threads(self.threads)
        stopping = False
        while True:
            batch: Any = END
            if not stopping:
                try:
                    batch = self.inputs.get()
                except StopRequested:
                    stopping = True
                except BaseException:
                    self._any_rank_stops(True)  # the peers must not wait for this rank
                    raise
            # A stop seen here while the peers go on would leave them in the next forward's
            # collectives; end-of-stream comes at the same batch on every rank.
            if self._any_rank_stops(stopping or batch is END):
                if stopping:
                    raise StopRequested
                if batch is not END:
                    self._fail_consumer()
                return
            try:
                self.output.put(self._forward(batch, stream))
            except StopRequested:
                stopping = True

    def _any_rank_stops(self, stop: bool) -> bool:
        return self.agreement.any_stops(stop) if self.agreement is not None else stop

    def _forward(self, batch: Batch, stream: torch.cuda.Stream | None) -> StepInput:
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
        return StepInput(batch=batch, target=out, ready=ready)

    def _fail_consumer(self) -> None:
        """End the output with :class:`PeerStopped` (not a failure of this stage: after a
        graceful stop agreed by every rank, nothing reads it)."""
        exc = PeerStopped("the target stage stopped because another rank's pipeline stopped "
                          "first (with distributed.target=fsdp every rank runs each target "
                          "forward together); that rank's output says why")
        self.output.fail(StageFailure.capture(exc, self.name))

    def collect_metrics(self) -> dict[str, Metric]:
        """Tokens through the target and its forward time in the window."""
        with self._lock:
            metrics: dict[str, Metric] = {f"pipe/{self.name}/tokens": Sum(float(self._tokens)),
                                          f"pipe/{self.name}/forward_s": self._forward_s}
            self._tokens = 0
            self._forward_s = 0.0
        return metrics
