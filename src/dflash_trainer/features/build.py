"""``dflash-trainer features``: the target's features of every training sample, computed once
into a feature store (layout: :mod:`dflash_trainer.features.manifest`).

The store is built shard by shard. A shard is computed in memory, written under a temporary
name, fsynced and renamed into place, and only then gets its record (size and sha256), so a
killed build leaves finished shards and nothing half-written that looks finished. A rerun with
the same settings verifies each finished shard by its checksum, keeps it, and computes the rest;
other settings are refused. Under torchrun each rank computes the shards ``k`` with
``k % world_size == rank``; rank 0 writes the index when every shard is there.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dflash_trainer.core import assets
from dflash_trainer.config import Config
from dflash_trainer.core.distributed import DistInfo, init_distributed
from dflash_trainer.model.dtypes import config_dtype
from dflash_trainer.core.errors import DiskError
from dflash_trainer.features.codec import encode
from dflash_trainer.features.engine import EngineFeatures, EngineLayout, open_engine
from dflash_trainer.features.manifest import (INDEX, MANIFEST, Manifest, ShardRecord, StoreError,
                                              record_path, shard_path)
from dflash_trainer.core.fsutil import DISK_FIX, atomic_write_text, byte_size, disk_oserror, fsync_path, sha256_file
from dflash_trainer.core.locks import FolderLock
from dflash_trainer.data.prepare import load_training_data
from dflash_trainer.model.drafter import tapped_layer_ids, text_config, tokenizer_signature
from dflash_trainer.model.target import FeatureExtractor, load_target

__all__ = ["BuildResult", "build_store", "expected_manifest", "main"]

log = logging.getLogger(__name__)

_TMP_PREFIX = ".tmp-shard-"
DISK_MARGIN = 1.02
"""Free space needed beyond the bytes left to write (the shard records, the index)."""


@dataclass(frozen=True, kw_only=True)
class BuildResult:
    """What one ``features`` run did on this rank."""

    manifest: Manifest
    folder: Path
    built: int
    """Shards this rank computed."""
    kept: int
    """Finished shards this rank found, verified and kept."""
    tokens: int
    """Tokens this rank computed."""
    seconds: float
    complete: bool
    """Whether the index is written (every shard is there)."""


def expected_manifest(cfg: Config, *, target: nn.Module, tokenizer: Any, data: Any, weights: str,
                      target_dtype: torch.dtype) -> Manifest:
    """The manifest a store of ``cfg``'s features over ``data`` must have (shard layout from
    ``features.shard_mb`` and the data's mean length)."""
    config = text_config(target.config)
    layer_ids = tapped_layer_ids(cfg.model, int(config.num_hidden_layers))
    num_tokens = int(np.asarray(data.lengths).sum())
    base = Manifest(token_store=str(data.content_hash), num_samples=len(data), num_tokens=num_tokens,
                    target=cfg.model.target, target_weights=weights,
                    tokenizer=tokenizer_signature(tokenizer)["sha256"] if tokenizer is not None else "",
                    layer_ids=layer_ids, hidden_size=int(config.hidden_size),
                    vocab_size=int(target.get_input_embeddings().weight.shape[0]),
                    target_dtype=str(target_dtype).removeprefix("torch."),
                    storage_dtype=cfg.features.dtype, max_length=cfg.data.max_length,
                    labels=cfg.training.labels, samples_per_shard=1, num_shards=1)
    mean_tokens = max(1.0, num_tokens / max(1, len(data)))
    per_shard = max(1, int(cfg.features.shard_mb * 2**20 / (base.bytes_per_token * mean_tokens)))
    per_shard = min(per_shard, max(1, len(data)))
    return dataclasses.replace(base, samples_per_shard=per_shard,
                               num_shards=max(1, -(-len(data) // per_shard)))


def _prepare_folder(folder: Path, manifest: Manifest) -> None:
    """Rank 0: a new store's folder and manifest, or the same settings as the store there."""
    if (folder / MANIFEST).exists():
        found = Manifest.read(folder)
        diffs = found.differences(manifest, ignore=frozenset({"target"}))
        if diffs:
            field, old, new = diffs[0]
            raise StoreError(f"{folder}: the feature store there was built with {field}={old!r}, "
                             f"this config gives {new!r}; use another --out (features.store) or "
                             "delete that folder")
    elif folder.is_dir() and any(p.name != ".lock" for p in folder.iterdir()):
        raise StoreError(f"{folder}: the folder holds files but no {MANIFEST}, so it is not a "
                         "feature store; give an empty or new folder as --out")
    else:
        folder.mkdir(parents=True, exist_ok=True)
        manifest.write(folder)
    for stale in folder.glob(f"{_TMP_PREFIX}*"):
        stale.unlink(missing_ok=True)


def _finished(folder: Path, manifest: Manifest, shard: int) -> ShardRecord | None:
    """The record of ``shard`` if the shard is finished and its bytes match the checksum."""
    record = ShardRecord.read(folder, shard)
    path = shard_path(folder, shard)
    samples = manifest.shard_samples(shard)
    if (record is None or not path.is_file() or path.stat().st_size != record.bytes
            or record.first_sample != samples.start or record.num_samples != len(samples)):
        return None
    if sha256_file(path) != record.sha256:
        log.warning("%s does not match its checksum: computing the shard again", path)
        return None
    return record


def _forward_batches(ids: range, lengths: np.ndarray, token_budget: int,
                     max_rows: int | None) -> list[list[int]]:
    """The shard's samples in forward passes of at most ``token_budget`` padded tokens and
    ``max_rows`` rows (``pipeline.tokens_per_batch``, ``pipeline.max_batch_size``), sorted by
    length so that little is padded."""
    order = sorted(ids, key=lambda i: (int(lengths[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = int(lengths[i])
        if current and (width * (len(current) + 1) > token_budget
                        or (max_rows is not None and len(current) >= max_rows)):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _compute_shard(samples: range, *, data: Any, extractor: FeatureExtractor, device: torch.device,
                   storage_dtype: str, token_budget: int, max_rows: int | None,
                   on_tokens: Callable[[int], None]) -> tuple[dict[str, torch.Tensor], int]:
    """The tensors of one shard (in sample order) and its token count; ``on_tokens`` hears the
    real tokens of every forward pass."""
    rows: dict[int, dict[str, torch.Tensor]] = {}
    for group in _forward_batches(samples, data.lengths, token_budget, max_rows):
        width = max(int(data.lengths[i]) for i in group)
        input_ids = torch.zeros((len(group), width), dtype=torch.long)
        attention = torch.zeros((len(group), width), dtype=torch.bool)
        for r, i in enumerate(group):
            ids, _ = data[i]
            input_ids[r, :len(ids)] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
            attention[r, :len(ids)] = True
        out = extractor(input_ids.to(device), attention.to(device))
        for r, i in enumerate(group):
            n = int(data.lengths[i])
            row = {"features": out.features[r, :n].cpu()}
            if out.target_labels is not None:
                row["labels"] = out.target_labels[r, :n].to(torch.int32).cpu()
            if out.final_hidden is not None:
                row["final_hidden"] = out.final_hidden[r, :n].cpu()
            rows[i] = row
        on_tokens(int(attention.sum()))
    ordered = [rows[i] for i in samples]
    lengths = [int(data.lengths[i]) for i in samples]
    tensors: dict[str, torch.Tensor] = {
        "offsets": torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))}
    for name in ordered[0]:
        joined = torch.cat([row[name] for row in ordered])
        if name == "labels":
            tensors[name] = joined.contiguous()
            continue
        coded = encode(joined, storage_dtype)
        tensors[name] = coded["values"]
        if "scale" in coded:
            tensors[f"{name}_scale"] = coded["scale"]
    return tensors, sum(lengths)


def _write_shard(folder: Path, shard: int, first_sample: int, tensors: dict[str, torch.Tensor],
                 tokens: int) -> ShardRecord:
    """Write one shard atomically (temporary name, fsync, rename), then its record."""
    from safetensors.torch import save

    path = shard_path(folder, shard)
    blob = save(tensors)
    tmp = folder / f"{_TMP_PREFIX}{shard:05d}-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(folder)
        record = ShardRecord(shard=shard, first_sample=first_sample,
                             num_samples=int(tensors["offsets"].numel() - 1), num_tokens=tokens,
                             bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
        record.write(folder)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        error = disk_oserror(exc)
        if error is None:
            raise
        raise DiskError(f"cannot write {path}: {os.strerror(error.errno or 0)}; {DISK_FIX}, then "
                        "rerun the same features command: finished shards are kept") from exc
    return record


def _check_space(folder: Path, manifest: Manifest, todo_tokens: int, say: Callable[[str], None]) -> None:
    need = todo_tokens * manifest.bytes_per_token
    free = shutil.disk_usage(folder).free
    say(f"features: {manifest.num_tokens:,} tokens x {manifest.bytes_per_token:,} bytes/token = "
        f"{byte_size(manifest.num_tokens * manifest.bytes_per_token)} in {manifest.num_shards} shards; "
        f"{byte_size(need)} left to write, {byte_size(free)} free in {folder}")
    if need * DISK_MARGIN > free:
        raise DiskError(f"{folder}: the feature store needs {byte_size(need)} more and the disk has "
                        f"{byte_size(free)} free; {DISK_FIX} (--out), or store float8 "
                        "(features.dtype=float8_e4m3fn)")


def _write_index(folder: Path, manifest: Manifest) -> None:
    records = []
    for shard in range(manifest.num_shards):
        record = ShardRecord.read(folder, shard)
        if record is None:
            raise StoreError(f"{record_path(folder, shard)}: missing after every rank finished; rerun "
                             "the same features command")
        records.append(dataclasses.asdict(record))
    atomic_write_text(folder / INDEX, json.dumps({"shards": records}, indent=1) + "\n",
                      durable=True)


class _Progress:
    """This rank's progress line (rank 0 prints it): tokens done, rate and ETA, every
    ``every_s`` seconds and after the last shard; the job's ETA assumes the ranks keep pace."""

    def __init__(self, *, say: Callable[[str], None] | None, total: int, shards: int, every_s: float,
                 world_size: int) -> None:
        self.say, self.total, self.shards, self.every_s = say, total, shards, every_s
        self.world_size = world_size
        self.done = 0
        self.shards_done = 0
        self.start = self.last = time.perf_counter()

    def add(self, tokens: int) -> None:
        self.done += tokens
        if time.perf_counter() - self.last >= self.every_s:
            self._print()

    def shard_done(self) -> None:
        self.shards_done += 1
        if self.shards_done == self.shards:
            self._print()

    def _print(self) -> None:
        now = self.last = time.perf_counter()
        if self.say is None:
            return
        rate = self.done / max(now - self.start, 1e-9)
        left = (self.total - self.done) / max(rate, 1e-9)
        ranks = f" on each of {self.world_size} ranks" if self.world_size > 1 else ""
        self.say(f"features: {self.shards_done}/{self.shards} shards, {self.done:,}/{self.total:,} tokens "
                 f"({100 * self.done / max(1, self.total):.0f}%){ranks}, {rate:,.0f} tok/s, ETA {_eta(left)}")


def _eta(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def build_store(cfg: Config, dist: DistInfo, *, out: Path, target: nn.Module | None = None,
                tokenizer: Any = None, data: Any = None, say: Callable[[str], None] = print,
                progress_every_s: float = 10.0, after_shard: Callable[[int], None] | None = None
                ) -> BuildResult:
    """Build (or continue) the feature store of ``cfg`` at ``out``; this rank's share.

    ``target``/``tokenizer``/``data`` replace ``model.target`` and the prepared token store
    (tests, benchmarks); ``after_shard`` is called with each shard this rank wrote.
    """
    from dflash_trainer.features.target_parts import load_target_parts, weights_hash

    started = time.perf_counter()
    device = dist.device
    dtype = config_dtype(cfg.model, device) if target is None else next(target.parameters()).dtype
    folder = assets.resolve_target(cfg.model.target)
    from_engine = cfg.engine.kind == "vllm"
    if target is None:
        if from_engine:
            # The engine runs the target; the labels need its final norm and LM head only.
            target, tokenizer = load_target_parts(str(folder), device=device, dtype=dtype, layers=())
        else:
            target, tokenizer = load_target(str(folder), device=device, dtype=dtype)
    weights = weights_hash(folder)
    if data is None:
        data, _ = load_training_data(cfg, dist, tokenizer)
    manifest = expected_manifest(cfg, target=target, tokenizer=tokenizer, data=data, weights=weights,
                                 target_dtype=dtype)
    lock = FolderLock(out / ".lock", what=f"feature store {out}", setting="--out") if dist.is_main else None
    try:
        if lock is not None:
            lock.acquire()
            _prepare_folder(out, manifest)
        if dist.enabled:
            torch.distributed.barrier()
        mine = [k for k in range(manifest.num_shards) if k % dist.world_size == dist.rank]
        todo, kept = [], 0
        for shard in mine:
            if _finished(out, manifest, shard) is None:
                todo.append(shard)
            else:
                kept += 1
        todo_tokens = sum(int(data.lengths[manifest.shard_samples(k)].sum()) for k in todo)
        if dist.is_main:
            _check_space(out, manifest, todo_tokens * dist.world_size, say)
            if kept:
                say(f"features: {kept} finished shard(s) verified and kept")
        extractor: FeatureExtractor | EngineFeatures
        if from_engine:
            layout = EngineLayout(layer_ids=tuple(manifest.layer_ids), num_layers=int(
                text_config(target.config).num_hidden_layers), hidden_size=manifest.hidden_size,
                final=cfg.training.labels != "data")
            extractor = open_engine(
                cfg.engine, dist, model=folder, target=target, tokenizer=tokenizer, layout=layout,
                exchange=Path(cfg.engine.exchange_dir) if cfg.engine.exchange_dir else out / "engine-exchange",
                dtype=dtype, max_model_len=cfg.data.max_length + 1, log_path=out / "engine-vllm.log",
                labels=cfg.training.labels, label_chunk_size=cfg.training.loss_chunk_size,
                say=say if dist.is_main else (lambda _: None))
        else:
            extractor = FeatureExtractor(target, manifest.layer_ids, labels=cfg.training.labels,
                                         label_chunk_size=cfg.training.loss_chunk_size)
        progress = _Progress(say=say if dist.is_main else None, total=todo_tokens, shards=len(todo),
                             every_s=progress_every_s, world_size=dist.world_size)
        try:
            for shard in todo:
                samples = manifest.shard_samples(shard)
                tensors, tokens = _compute_shard(samples, data=data, extractor=extractor, device=device,
                                                 storage_dtype=manifest.storage_dtype,
                                                 token_budget=cfg.pipeline.tokens_per_batch,
                                                 max_rows=cfg.pipeline.max_batch_size,
                                                 on_tokens=progress.add)
                _write_shard(out, shard, samples.start, tensors, tokens)
                progress.shard_done()
                if after_shard is not None:
                    after_shard(shard)
        finally:
            extractor.close()
        if dist.enabled:
            torch.distributed.barrier()
        if dist.is_main:
            _write_index(out, manifest)
    finally:
        if lock is not None:
            lock.release()
    seconds = time.perf_counter() - started
    return BuildResult(manifest=manifest, folder=out, built=len(todo), kept=kept, tokens=progress.done,
                       seconds=seconds, complete=(out / INDEX).is_file())


def print_engine_command(cfg: Config) -> str:
    """The command line of a vLLM server that serves ``cfg``'s hidden states (``engine.url``),
    writing into ``engine.exchange_dir``, with the connector's folder on its ``PYTHONPATH``."""
    import shlex

    from transformers import AutoConfig

    from dflash_trainer.features.engine import connector_files, engine_command, run_layout

    folder = assets.resolve_target(cfg.model.target)
    layout = run_layout(cfg.model, AutoConfig.from_pretrained(folder), labels=cfg.training.labels)
    exchange = Path(cfg.engine.exchange_dir or "engine-exchange").resolve()
    connector = connector_files(exchange)
    dtype = str(config_dtype(cfg.model, torch.device("cpu"))).removeprefix("torch.")
    command = engine_command(Path(cfg.engine.venv) / "bin" / "python", folder, port=8000, dtype=dtype,
                             max_model_len=cfg.data.max_length + 1, layout=layout, exchange=exchange,
                             cfg=cfg.engine)
    return f"PYTHONPATH={shlex.quote(str(connector))} {shlex.join(command)}"


def main(cfg: Config, args: argparse.Namespace | None = None) -> int:
    """The ``features`` command: build the feature store ``features.store`` (``--out``), or
    print the vLLM server command for ``engine.url`` (``--print-engine-command``)."""
    if args is not None and getattr(args, "print_engine_command", False):
        print(print_engine_command(cfg))
        return 0
    if cfg.features.store is None:
        from dflash_trainer.core.errors import ConfigError

        raise ConfigError("features needs the store folder: --out FOLDER (or features.store=FOLDER)")
    dist = init_distributed(cfg.pipeline, cfg.distributed)
    try:
        result = build_store(cfg, dist, out=Path(cfg.features.store))
    finally:
        if dist.enabled:
            torch.distributed.destroy_process_group()
    if dist.is_main:
        m = result.manifest
        print(f"feature store: {result.folder} ({m.num_samples:,} samples, {m.num_tokens:,} tokens, "
              f"{m.num_shards} shards, {m.bytes_per_token:,} bytes/token, {m.storage_dtype}); "
              f"{result.built} shard(s) computed, {result.kept} kept, {result.seconds:.1f} s; "
              f"train from it with features.store={result.folder}")
    return 0

