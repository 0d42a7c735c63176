"""What the GPU check builds: shapes, a random target and drafter, synthetic token data, the
trainer's components on them, and the training loops whose per-step losses it compares.

Everything is the trainer's own code (``components.build``, ``TrainingPipeline``,
``DrafterStep``); only the target's weights and the data are random.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from benchmarks.pipeline import Parts
from dflash_trainer.training.components import build
from dflash_trainer.config import ModelConfig, load_config
from dflash_trainer.core.distributed import DistInfo
from dflash_trainer.model.batch import StepInput
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.model.modeling.dflash import build_target_layer_ids
from dflash_trainer.training.pipeline.metrics import combine
from dflash_trainer.training.pipeline.pipeline import PipelineSettings

GAMMA = 7.0
LOSS_CHUNK = 1024
GPU_CLOCK_HZ = 1.5e9
"""About the clock of a data-centre GPU: turns a delay into spin cycles (its length need not
be exact)."""


@dataclass(frozen=True, kw_only=True)
class Geometry:
    """Model and batch shapes of one section."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    target_layers: int
    drafter_layers: int
    block_size: int
    num_anchors: int
    seq_len: int
    """The longest sample (every sample with ``min_len`` unset)."""
    batch: int
    """Rows per batch at ``seq_len``: the token budget is ``batch * seq_len``."""
    min_len: int | None = None
    """Samples of lengths uniform in ``min_len..seq_len`` (several buckets), else all ``seq_len``."""

    @property
    def layer_ids(self) -> list[int]:
        """Target layers feeding the drafter: the trainer's default rule (z-lab's)."""
        return build_target_layer_ids(self.target_layers, self.drafter_layers)


QWEN3_8B = Geometry(hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128,
                    vocab=151936, target_layers=36, drafter_layers=5, block_size=16,
                    num_anchors=512, seq_len=3072, batch=1)
"""Qwen3-8B (all 36 layers, the weights random) and its DFlash-b16 drafter at a 3072-token
sample: the shapes and memory of a real run."""
CHECK = Geometry(hidden=1024, intermediate=3072, heads=8, kv_heads=2, head_dim=128, vocab=32000,
                 target_layers=6, drafter_layers=2, block_size=16, num_anchors=64,
                 seq_len=1024, batch=2)
"""Small enough for an fp32 reference and many steps, with GQA and 2 rows."""
BUCKETED = Geometry(hidden=1024, intermediate=3072, heads=8, kv_heads=2, head_dim=128,
                    vocab=32000, target_layers=6, drafter_layers=2, block_size=16,
                    num_anchors=256, seq_len=2048, batch=2, min_len=48)
"""CHECK's model over samples of 48..2048 tokens in 6 buckets: batch shapes change every step."""
TINY = Geometry(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=512,
                target_layers=6, drafter_layers=2, block_size=16, num_anchors=16, seq_len=128,
                batch=2)
TINY_BUCKETED = Geometry(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16,
                         vocab=512, target_layers=6, drafter_layers=2, block_size=16,
                         num_anchors=16, seq_len=256, batch=2, min_len=24)
"""The CPU dry run's shapes."""


def make_target(geom: Geometry, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random frozen Qwen3 causal LM with the geometry's width and ``target_layers`` layers,
    initialised on ``device`` in ``dtype`` (no fp32 or host copy of the weights)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=geom.vocab, hidden_size=geom.hidden,
                         intermediate_size=geom.intermediate,
                         num_hidden_layers=geom.target_layers,
                         num_attention_heads=geom.heads, num_key_value_heads=geom.kv_heads,
                         head_dim=geom.head_dim, max_position_embeddings=max(4096, geom.seq_len),
                         tie_word_embeddings=False, rope_theta=1e6)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def make_drafter(geom: Geometry, target_config: Any, device: torch.device) -> torch.nn.Module:
    """The trainer's drafter for ``target_config`` (fp32 weights, as the trainer keeps them)."""
    model_cfg = ModelConfig(num_layers=geom.drafter_layers, block_size=geom.block_size,
                            target_layer_ids=geom.layer_ids)
    with torch.device(device):
        drafter = build_drafter(model_cfg, target_config, mask_token_id=geom.vocab - 1)
    return drafter.to(device)


class SyntheticTokens:
    """Random token samples of ``length`` tokens (``min_length..length`` when given); the first
    10% of each is an unsupervised prompt."""

    def __init__(self, num: int, length: int, vocab: int, seed: int,
                 min_length: int | None = None) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = (np.full(num, length, dtype=np.int64) if min_length is None
                        else rng.integers(min_length, length + 1, size=num).astype(np.int64))
        # The last id is the mask token; keep it out of the data.
        self._ids = [rng.integers(0, vocab - 1, size=n, dtype=np.int32) for n in self.lengths]
        self._masks = []
        for n in self.lengths:
            mask = np.ones(n, dtype=np.uint8)
            mask[: max(1, n // 10)] = 0
            self._masks.append(mask)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self._ids[index], self._masks[index]

    def token_ids(self) -> np.ndarray:
        """The distinct token ids of the samples."""
        return np.unique(np.concatenate(self._ids))


def build_train_parts(geom: Geometry, device: torch.device, dtype: torch.dtype, *,
                      samples: int = 32, overrides: tuple[str, ...] = ()) -> Parts:
    """The trainer's components (``components.build``) on a random target and synthetic data
    at ``geom``, ``overrides`` applied to the config; every call builds the same target and
    drafter."""
    torch.manual_seed(0)  # the target's random weights (build seeds the drafter's itself)
    target = make_target(geom, device, dtype)
    dataset = SyntheticTokens(samples, geom.seq_len, geom.vocab, seed=0, min_length=geom.min_len)
    cfg = load_config(None, [
        f"model.num_layers={geom.drafter_layers}", f"model.block_size={geom.block_size}",
        f"model.target_layer_ids={geom.layer_ids}", f"model.mask_token_id={geom.vocab - 1}",
        f"training.gamma={GAMMA}", f"training.loss_chunk_size={LOSS_CHUNK}",
        f"training.num_anchors={geom.num_anchors}", "training.seed=0",
        f"data.max_length={geom.seq_len}",
        f"pipeline.num_buckets={1 if geom.min_len is None else 6}",
        f"pipeline.tokens_per_batch={geom.batch * geom.seq_len}",
        f"pipeline.device={device.type}", *overrides])
    c = build(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=device),
              target=target, data=dataset)
    return Parts(components=c, settings=PipelineSettings.from_config(cfg,
                                                                     block_size=geom.block_size),
                 info={"drafter_params": sum(p.numel() for p in c.drafter.parameters()),
                       "target_params": sum(p.numel() for p in target.parameters()),
                       "objective": c.objective})


def drafter_delay(device: torch.device, seconds: float) -> Callable[[], None]:
    """A delay put in front of each drafter step: on CUDA a kernel that spins for about
    ``seconds`` on the drafter's stream (the host runs ahead and drops the step's inputs while
    the GPU still has to read them: a missing ``record_stream`` lets the target stage's next
    copy overwrite them); on CPU a sleep."""
    if device.type != "cuda":
        return lambda: time.sleep(seconds)
    cycles = int(seconds * GPU_CLOCK_HZ)
    return lambda: torch.cuda._sleep(cycles)


@dataclass(kw_only=True)
class StepLog:
    """What one run of training steps gives, step by step."""

    losses: list[float]
    tokens: list[int]
    """Real tokens of each step's batch."""
    shapes: list[tuple[int, int, int]]
    """(rows, padded width, anchors) of each step's batch."""
    seconds: list[float]
    """Wall time of each step (host, synchronised at the step's end)."""
    after_step: list[Any]
    """What ``after_step`` returned at each step."""


def _record(log: StepLog, parts: Parts, item: StepInput, started: float,
            after_step: Callable[[], Any] | None) -> None:
    step = parts.drafter_step
    log.losses.append(float(combine([step.get_metrics()])["train/loss"]))  # host sync
    log.seconds.append(time.perf_counter() - started)
    batch = item.batch
    log.tokens.append(batch.num_tokens)
    log.shapes.append((*batch.shape, batch.anchors.shape[1]))
    log.after_step.append(after_step() if after_step is not None else None)


def pipelined_steps(parts: Parts, steps: int, *, delay: Callable[[], None] | None = None,
                    after_step: Callable[[], Any] | None = None) -> StepLog:
    """``steps`` optimizer steps through the trainer's pipeline (prefetch workers, the target
    stage on its own stream and thread, the drafter step here), each step's loss read back."""
    log = StepLog(losses=[], tokens=[], shapes=[], seconds=[], after_step=[])
    step = parts.drafter_step
    first = step.optimizer_step
    with parts.pipeline(steps) as pipe:
        started = time.perf_counter()
        for item in pipe.step_inputs(until=lambda: step.optimizer_step - first >= steps):
            if delay is not None:
                delay()
            step.train_micro_batch(item)
            pipe.acknowledge(item.batch)
            _record(log, parts, item, started, after_step)
            started = time.perf_counter()
        pipe.close()  # the plan may hold more steps: stop the stages instead of draining them
    if len(log.losses) < steps:
        raise RuntimeError(f"the pipeline ended after {len(log.losses)} of {steps} steps")
    return log


def sequential_steps(parts: Parts, steps: int) -> StepLog:
    """The same steps in this thread alone: collate, copy, target forward, drafter step."""
    log = StepLog(losses=[], tokens=[], shapes=[], seconds=[], after_step=[])
    c = parts.components
    collater = parts.pipeline(steps).prefetcher  # never started: its collate is the real one
    positions = [(e, s) for e in range(parts.epochs_for(steps))
                 for s in range(c.plans.num_steps(e))][:steps]
    for index, (epoch, position) in enumerate(positions):
        started = time.perf_counter()
        batch = collater.collate(c.plans(epoch), position, index).to(parts.device)
        item = StepInput(batch=batch, target=c.extractor(batch.input_ids, batch.attention_mask))
        c.drafter_step.train_micro_batch(item)
        _record(log, parts, item, started, None)
    return log
