"""The one assembly of a training run: target -> data (:func:`load_inputs`), then, with what
the resume decided (``training.resume``), mask id -> plans -> drafter -> feature extractor ->
objective -> optimizer and schedule -> drafter step (:func:`build`).

:func:`build` is used by ``train``, ``demo`` and the benchmarks, so what they run is what the
trainer runs; :func:`build_drafter_step` is its drafter side alone, for a benchmark that
trains on target outputs it computed before (``benchmarks/levers.py``). Runtime objects that
replace a part (a random target, synthetic data) are passed in, never put into the config.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from dflash_trainer.core import assets
from dflash_trainer.config import Config, ModelConfig, TrainingConfig
from dflash_trainer.data.buckets import Plan, build_plan
from dflash_trainer.data.draft_vocab import DraftVocab, choose_draft_vocab
from dflash_trainer.data.prepare import load_training_data
from dflash_trainer.core.distributed import DistInfo, target_load_device, wrap_drafter, wrap_target
from dflash_trainer.model.dtypes import DTYPES, config_dtype
from dflash_trainer.core.errors import ConfigError
from dflash_trainer.training.flops import StepShape, layer_dims, step_flops
from dflash_trainer.model.batch import Batch
from dflash_trainer.features.engine import EngineFeatures
from dflash_trainer.features.manifest import MANIFEST, Manifest
from dflash_trainer.features.store import FeatureStore
from dflash_trainer.model.drafter import build_drafter, set_draft_vocab, tapped_layer_ids, text_config
from dflash_trainer.training.drafter_init import initialise_drafter
from dflash_trainer.model.modeling.dflash import DFlashDraftModel
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.target import (FeatureExtractor, input_embedding_weight, lm_head_weight, load_target,
                                         resolve_mask_token_id)
from dflash_trainer.training.optim import LRSchedule, build_optimizer
from dflash_trainer.training.pipeline.drafter_step import DrafterStep

__all__ = ["PEAK_BF16_FLOPS", "Components", "DrafterSide", "EpochPlans", "RunInputs", "TrainingData", "build",
           "build_drafter_step", "choose_run_draft_vocab", "load_inputs", "peak_flops", "run_dtype",
           "run_mask_token_id", "run_progress", "run_steps"]

log = logging.getLogger(__name__)

# bf16 dense peak FLOP/s by device name, for perf/mfu (benchmarks/gpu_check.py measures the
# achievable matmul ceiling instead).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


class TrainingData(Protocol):
    """The token store (``data.cache.TokenStore``) or anything alike, e.g. synthetic data."""

    lengths: np.ndarray

    def __len__(self) -> int:
        """Number of samples."""
        ...

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32 [L], loss_mask uint8 [L]) of sample ``index``."""
        ...

    def token_ids(self) -> np.ndarray:
        """The distinct token ids in the data (the mask token must not be one of them)."""
        ...


def peak_flops(device: torch.device) -> float | None:
    """The device's bf16 dense peak FLOP/s from :data:`PEAK_BF16_FLOPS` (None: unknown/CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


class EpochPlans:
    """Each epoch's batch plan: a pure function of (data lengths, pipeline config, seed, epoch,
    world size), built on first use; the step count of every epoch is kept."""

    def __init__(self, lengths: np.ndarray, cfg: Config, world_size: int) -> None:
        self.lengths = lengths
        self.cfg = cfg
        self.world_size = world_size
        self._recent: dict[int, Plan] = {}
        self._lengths: dict[int, int] = {}
        self._lock = threading.Lock()  # the prefetcher's workers and the main thread ask

    def build(self, epoch: int) -> Plan:
        """A fresh plan of ``epoch`` (no cache)."""
        return build_plan(self.lengths, self.cfg.pipeline, seed=self.cfg.training.seed,
                          epoch=epoch, world_size=self.world_size)

    def __call__(self, epoch: int) -> Plan:
        """The plan of ``epoch``; the last two are cached (the prefetcher asks once per epoch,
        the trainer when it logs the epoch's statistics)."""
        with self._lock:
            if epoch not in self._recent:
                if len(self._recent) >= 2:
                    self._recent.pop(min(self._recent))
                self._recent[epoch] = self.build(epoch)
                self._lengths[epoch] = len(self._recent[epoch])
            return self._recent[epoch]

    def num_steps(self, epoch: int) -> int:
        """Steps in ``epoch``'s plan."""
        if epoch not in self._lengths:
            self(epoch)
        return self._lengths[epoch]

    def total_steps(self, epochs: int) -> int:
        """Steps of epochs ``0 .. epochs - 1``, each from its own plan (lengths can differ)."""
        return sum(self.num_steps(e) for e in range(epochs))


def run_steps(plans: Any, cfg: TrainingConfig) -> int:
    """Optimizer steps of a run over ``plans``: every epoch's own plan length / grad_accum,
    capped by ``max_steps`` (the one place this is counted)."""
    total = max(1, plans.total_steps(cfg.epochs) // cfg.grad_accum)
    return total if cfg.max_steps is None else min(total, cfg.max_steps)


def run_progress(plans: Any, cfg: TrainingConfig, *, epoch: int, step: int) -> float:
    """The fraction of a run over ``plans`` done before plan step ``step`` of ``epoch``: in
    samples (steps hold more or fewer of them), or in optimizer steps when ``max_steps`` ends
    the run before its plans do."""
    total = run_steps(plans, cfg)
    if cfg.max_steps is not None and total == cfg.max_steps < plans.total_steps(cfg.epochs) // cfg.grad_accum:
        done = sum(plans.num_steps(e) for e in range(epoch)) + step
        return done / cfg.grad_accum / total

    def samples(e: int, end: int | None = None) -> int:
        return sum(len(batch) for s in plans(e).steps[:end] for batch in s.batches)

    done = sum(samples(e) for e in range(epoch)) + samples(epoch, step)
    return done / max(1, sum(samples(e) for e in range(cfg.epochs)))


@dataclass(kw_only=True)
class Components:
    """The parts of one rank's run; :meth:`close` removes the feature hooks from the target."""

    cfg: Config
    dist: DistInfo
    target: nn.Module
    """The frozen target (FSDP-sharded when ``distributed.target=fsdp``)."""
    tokenizer: Any
    data: TrainingData
    data_stats: Any
    """The preparation statistics (None for data passed in)."""
    plans: EpochPlans
    drafter: DFlashDraftModel
    """The plain drafter module (inside the objective, which DDP/FSDP wrap)."""
    extractor: FeatureExtractor | None
    """The target's feature hooks (None when the features come from ``store``)."""
    store: FeatureStore | None
    """The feature store the run reads instead of running the target (``features.store``)."""
    engine: EngineFeatures | None
    """The engine-served target's features (``engine.kind=vllm``), instead of ``extractor``."""
    objective: nn.Module
    drafter_step: DrafterStep
    total_steps: int
    """Optimizer steps of the run: every epoch's own plan length / grad_accum, capped by
    ``training.max_steps``; the LR schedule ends there."""
    compute_dtype: torch.dtype
    draft_vocab: DraftVocab | None = None
    """The pruned draft vocabulary chosen from the data (``model.draft_vocab_size``); a resume
    keeps the checkpoint's."""

    @property
    def device(self) -> torch.device:
        """This rank's device."""
        return self.dist.device

    def close(self) -> None:
        """Remove the feature hooks from the target, close the store's files, stop the engine
        (idempotent)."""
        if self.extractor is not None:
            self.extractor.close()
        if self.store is not None:
            self.store.close()
        if self.engine is not None:
            self.engine.close()


def run_mask_token_id(cfg: Config, tokenizer: Any, embed_rows: int, data: TrainingData) -> int:
    """The mask token id of a run: ``model.mask_token_id`` or the tokenizer's rule, never a token
    of ``data``; a target without a tokenizer needs it explicit."""
    data_ids = data.token_ids().tolist()
    if tokenizer is not None:
        return resolve_mask_token_id(tokenizer, embed_rows, explicit=cfg.model.mask_token_id,
                                     forbidden_in_data=data_ids)
    # A target passed in without a tokenizer (random weights): the id must be given.
    explicit = cfg.model.mask_token_id
    if explicit is None or not 0 <= explicit < embed_rows or explicit in set(data_ids):
        raise ConfigError(f"model.mask_token_id={explicit}: a target without a tokenizer needs an "
                          f"explicit mask token id below {embed_rows} that is not in the data")
    return explicit


def _flops_fn(cfg: Config, target: nn.Module, drafter: DFlashDraftModel,
              vocab: int, *, runs_target: bool) -> Callable[[Batch], float]:
    target_dims = layer_dims(text_config(target.config))
    drafter_dims = layer_dims(drafter.config)
    layer_ids = drafter.target_layer_ids
    needs_final = cfg.training.labels != "data" and runs_target
    target_layers_run = (0 if not runs_target else
                         target.config.num_hidden_layers if needs_final else max(layer_ids) + 1)

    def batch_flops(batch: Batch) -> float:
        """Model FLOPs of one micro-batch from its host-side shapes (no device sync)."""
        rows, seq_len = batch.shape
        shape = StepShape(rows=rows, seq_len=seq_len, num_anchors=batch.anchors.shape[1],
                          block_size=drafter.block_size,
                          mean_anchor=seq_len / 2,  # anchors are uniform over the sequence
                          supervised_slots=cfg.training.loss_slots,
                          soft_labels=cfg.training.labels == "kl")
        return step_flops(target=target_dims, target_layers_run=target_layers_run,
                          target_head=needs_final, drafter=drafter_dims,
                          drafter_layers=drafter.config.num_hidden_layers,
                          num_features=len(layer_ids), vocab=vocab, shape=shape,
                          draft_vocab=drafter.draft_vocab_size)["total"]

    return batch_flops


@dataclass(kw_only=True)
class DrafterSide:
    """What :func:`build_drafter_step` assembles around a target."""

    target: nn.Module
    """The target as the run uses it (FSDP-sharded when ``distributed.target=fsdp``)."""
    drafter: DFlashDraftModel
    extractor: FeatureExtractor | None
    """None for ``runs_target=False``."""
    objective: nn.Module
    drafter_step: DrafterStep


def build_drafter_step(cfg: Config, dist: DistInfo, target: nn.Module, *, mask_token_id: int,
                       tokenizer: Any, total_steps: int, compute_dtype: torch.dtype,
                       runs_target: bool = True, schedule: dict[str, Any] | None = None,
                       draft_vocab: DraftVocab | None = None) -> DrafterSide:
    """The trainer's drafter side on ``target``: drafter (built, initialised by
    ``model.drafter_init``, on the device) -> feature extractor -> objective -> optimizer and an
    LR schedule of ``total_steps`` (at the state ``schedule`` of a resume) -> :class:`DrafterStep`.

    Draws the drafter's initialisation from the global torch RNG: seed it first, as
    :func:`build` does. The caller closes the extractor (its hooks stay on the target).
    ``runs_target=False`` (features from a store): no extractor, no sharding of the target,
    whose embedding and LM head alone the objective reads. ``draft_vocab``: the tokens of a
    pruned draft vocabulary (``model.draft_vocab_size``, from :func:`choose_run_draft_vocab`).
    """
    device = dist.device
    # With the tokenizer, the drafter's config (and every export of it) records its fingerprint.
    drafter = build_drafter(cfg.model, target.config, mask_token_id=mask_token_id, tokenizer=tokenizer)
    if drafter.lm_head is not None:
        assert draft_vocab is not None, "a pruned draft vocabulary needs its tokens"
        set_draft_vocab(drafter, draft_vocab.token_ids, lm_head_weight(target))
    # A warm start from a drafter with the same pruned vocabulary keeps that drafter's tokens.
    initialise_drafter(drafter, target, cfg.model, tokenizer=tokenizer)
    drafter = drafter.to(device)
    extractor = None
    if runs_target:
        # Sharded before the feature hooks are added, so FSDP's hooks run first.
        target = wrap_target(target, dist, cfg.distributed)
        extractor = FeatureExtractor(target, drafter.target_layer_ids, labels=cfg.training.labels,
                                     label_chunk_size=cfg.training.loss_chunk_size)
    objective = wrap_drafter(
        DFlashObjective.from_config(drafter, input_embedding_weight(target), lm_head_weight(target), cfg),
        dist, cfg.distributed)
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.training)
    drafter_step = DrafterStep(
        objective=objective, parameters=params, optimizer=optimizer,
        schedule=LRSchedule(optimizer, total_steps=total_steps, cfg=cfg.training, state=schedule),
        cfg=cfg.training, dist_info=dist, block_size=drafter.block_size,
        autocast_dtype=torch.bfloat16 if compute_dtype == torch.bfloat16 else None,
        flops_fn=_flops_fn(cfg, target, drafter, lm_head_weight(target).shape[0], runs_target=runs_target),
        peak_flops=peak_flops(device))
    return DrafterSide(target=target, drafter=drafter, extractor=extractor, objective=objective,
                       drafter_step=drafter_step)


def _load_target_parts(cfg: Config, folder: str, device: torch.device,
                       dtype: torch.dtype) -> tuple[nn.Module, Any]:
    """The target's embedding, final norm, LM head and the layers the drafter's init copies."""
    from transformers import AutoConfig

    from dflash_trainer.features.target_parts import init_layers, load_target_parts

    config = text_config(AutoConfig.from_pretrained(folder))
    num_layers = int(config.num_hidden_layers)
    layers = init_layers(cfg.model, num_layers, tapped_layer_ids(cfg.model, num_layers))
    return load_target_parts(folder, device=device, dtype=dtype, layers=layers)


def _open_store(cfg: Config, *, target: nn.Module, tokenizer: Any, data: TrainingData,
                dtype: torch.dtype) -> FeatureStore:
    """``features.store``, checked against what this run would compute with the target."""
    from dflash_trainer.features.build import expected_manifest
    from dflash_trainer.features.target_parts import weights_hash

    expected = expected_manifest(cfg, target=target, tokenizer=tokenizer, data=data,
                                 weights=weights_hash(assets.resolve_target(cfg.model.target)),
                                 target_dtype=dtype)
    store = FeatureStore.open(cfg.features.store, expected=expected, dtype=dtype)
    log.info("training from the feature store %s (%d shards, %s)", cfg.features.store,
             store.manifest.num_shards, store.manifest.storage_dtype)
    return store


def _open_engine(cfg: Config, dist: DistInfo, *, folder: Path, target: nn.Module, tokenizer: Any,
                 dtype: torch.dtype) -> EngineFeatures:
    """The engine-served target of ``engine.*`` (started or reached, then checked)."""
    from dflash_trainer.features.engine import open_engine, run_layout

    run_dir = Path(cfg.run_dir)
    exchange = Path(cfg.engine.exchange_dir) if cfg.engine.exchange_dir else run_dir / "engine-exchange"
    return open_engine(cfg.engine, dist, model=folder, target=target, tokenizer=tokenizer,
                       layout=run_layout(cfg.model, target.config, labels=cfg.training.labels),
                       exchange=exchange, dtype=dtype, max_model_len=cfg.data.max_length + 1,
                       log_path=run_dir / "engine-vllm.log", labels=cfg.training.labels,
                       label_chunk_size=cfg.training.loss_chunk_size,
                       say=print if dist.is_main else (lambda _: None))


@dataclass(kw_only=True)
class RunInputs:
    """What a run is checked against before anything is built for it (see ``training.resume``):
    the target, its tokenizer and the training data."""

    target: nn.Module
    """The frozen target; with ``features.store`` or ``engine.kind=vllm``, only the parts of it
    that the run computes with (embedding, final norm, LM head, the layers the drafter's init
    copies)."""
    tokenizer: Any
    data: TrainingData
    data_stats: Any
    """The preparation statistics (None for data passed in)."""
    dtype: torch.dtype
    """The target's and the autocast dtype."""
    folder: str
    """The target's folder ("" for a target passed in without an engine)."""


def run_dtype(cfg: Config, dist: DistInfo) -> torch.dtype:
    """The run's compute dtype: ``model.dtype``, where ``auto`` with a ``features.store`` is the
    dtype the store was computed in (its manifest records it), said in one line; a store is read
    in that dtype whatever this machine's probe would choose now."""
    store = cfg.features.store
    if cfg.model.dtype != "auto" or store is None or not (Path(store) / MANIFEST).is_file():
        return config_dtype(cfg.model, dist.device)
    name = Manifest.read(Path(store)).target_dtype
    dtype = DTYPES.get(name)
    if dtype is None:
        raise ConfigError(f"features.store={store}: its target dtype {name!r} is not one of "
                          f"{', '.join(DTYPES)}; build the store again with dflash-trainer features")
    if dist.is_main:
        print(f"model.dtype auto: {name}, the dtype the feature store {store} was computed in", flush=True)
    return dtype


def load_inputs(cfg: Config, dist: DistInfo, *, target: nn.Module | None = None, tokenizer: Any = None,
                data: TrainingData | None = None) -> RunInputs:
    """The target (or its parts) and the tokenized data of ``cfg`` on this rank.

    ``target`` (a frozen HF causal LM, with or without ``tokenizer``) and ``data`` replace
    ``model.target`` and ``data.paths`` (benchmarks on random weights or synthetic tokens).
    Seeds the global torch RNG with ``training.seed`` first: every rank draws the same
    drafter init in :func:`build`, and nothing between the two draws from it.
    """
    # Before the seed: the CPU dtype probe (first run on a machine) draws random numbers.
    dtype = run_dtype(cfg, dist) if target is None else next(target.parameters()).dtype
    torch.manual_seed(cfg.training.seed)
    from_store = cfg.features.store is not None
    from_engine = cfg.engine.kind == "vllm" and not from_store
    folder = str(assets.resolve_target(cfg.model.target)) if target is None or from_engine else ""
    if target is None:
        if from_store or from_engine:
            target, tokenizer = _load_target_parts(cfg, folder, dist.device, dtype)
        else:
            target, tokenizer = load_target(folder, device=target_load_device(dist, cfg.distributed),
                                            dtype=dtype)
    data_stats = None
    if data is None:
        data, data_stats = load_training_data(cfg, dist, tokenizer)
    return RunInputs(target=target, tokenizer=tokenizer, data=data, data_stats=data_stats, dtype=dtype,
                     folder=folder)


def choose_run_draft_vocab(model_cfg: ModelConfig, data: TrainingData, vocab_size: int) -> DraftVocab | None:
    """The pruned draft vocabulary of ``model.draft_vocab_size`` from the training data's
    supervised tokens; None for the whole vocabulary (unset, or at least ``vocab_size``)."""
    size = model_cfg.draft_vocab_size
    if size is None or size >= vocab_size:
        return None
    return choose_draft_vocab(data, size, vocab_size)


def build(cfg: Config, dist: DistInfo, inputs: RunInputs | None = None, *, plans: Any = None,
          total_steps: int | None = None, schedule: dict[str, Any] | None = None,
          target: nn.Module | None = None, tokenizer: Any = None,
          data: TrainingData | None = None) -> Components:
    """Build every part of a run for ``cfg`` on this rank, from ``inputs`` (loaded here from
    ``target``, ``tokenizer`` and ``data`` when not given, see :func:`load_inputs`).

    A resume (``training.resume``) hands in its ``plans``, their ``total_steps`` and the LR
    schedule's state (``schedule``); a fresh run plans every epoch for this world size.
    """
    if inputs is None:
        inputs = load_inputs(cfg, dist, target=target, tokenizer=tokenizer, data=data)
    target, tokenizer, data, dtype = inputs.target, inputs.tokenizer, inputs.data, inputs.dtype
    from_store = cfg.features.store is not None
    from_engine = cfg.engine.kind == "vllm" and not from_store
    store = _open_store(cfg, target=target, tokenizer=tokenizer, data=data, dtype=dtype) if from_store else None
    engine = _open_engine(cfg, dist, folder=Path(inputs.folder), target=target, tokenizer=tokenizer,
                          dtype=dtype) if from_engine else None
    embed_rows = target.get_input_embeddings().weight.shape[0]
    mask_id = run_mask_token_id(cfg, tokenizer, embed_rows, data)
    # The plans use their own seeded generators: building them here draws nothing from the
    # global RNG that the drafter's initialisation below uses.
    if plans is None:
        plans = EpochPlans(data.lengths, cfg, dist.world_size)
    if total_steps is None:
        total_steps = run_steps(plans, cfg.training)
    draft_vocab = choose_run_draft_vocab(cfg.model, data, lm_head_weight(target).shape[0])
    side = build_drafter_step(cfg, dist, target, mask_token_id=mask_id, tokenizer=tokenizer,
                              total_steps=total_steps, schedule=schedule, compute_dtype=dtype,
                              runs_target=not (from_store or from_engine), draft_vocab=draft_vocab)
    return Components(cfg=cfg, dist=dist, target=side.target, tokenizer=tokenizer, data=data,
                      data_stats=inputs.data_stats, plans=plans, drafter=side.drafter,
                      extractor=side.extractor, store=store, engine=engine, objective=side.objective,
                      drafter_step=side.drafter_step, total_steps=total_steps,
                      compute_dtype=dtype, draft_vocab=draft_vocab)
