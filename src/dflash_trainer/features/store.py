"""Reading a feature store: checked against the run before training starts, read per sample.

:meth:`FeatureStore.open` refuses a store that is incomplete, whose manifest differs from what
the run would compute online (one line naming the field and both values), or one of whose shard
files is missing or of the wrong size (named by path). Each shard's sha256 is verified the first
time the run reads it, so a corrupt shard is named before any of its features are trained on.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.features.codec import decode
from dflash_trainer.features.manifest import INDEX, MANIFEST, Manifest, ShardRecord, StoreError, read_json, shard_path
from dflash_trainer.core.fsutil import sha256_file

__all__ = ["FIELD_SETTINGS", "FeatureStore", "SampleFeatures", "read_index"]

FIELD_SETTINGS = {
    "token_store": "the data (data.paths, data.max_length, the chat template and options of prepare)",
    "num_samples": "the data", "num_tokens": "the data",
    "target_weights": "model.target", "tokenizer": "model.target's tokenizer",
    "layer_ids": "model.target_layer_ids", "hidden_size": "model.target", "vocab_size": "model.target",
    "target_dtype": "model.dtype", "max_length": "data.max_length", "labels": "training.labels",
}
"""The config setting behind each manifest field, for the refusal's fix."""

_OPEN_SHARDS = 64
"""Shard files kept open (memory-mapped) at once: a batch's samples come from any shard, since
the plan groups samples by length, not by position."""


def read_index(folder: Path) -> list[ShardRecord]:
    """The shard records of a complete store; StoreError when it is not complete."""
    if not (folder / INDEX).exists() and (folder / MANIFEST).exists():
        m = Manifest.read(folder)
        done = sum(1 for k in range(m.num_shards) if ShardRecord.read(folder, k) is not None)
        raise StoreError(f"{folder}: the feature store is incomplete ({done} of {m.num_shards} shards "
                         "finished); rerun dflash-trainer features with the same config and --out to "
                         "finish it")
    data = read_json(folder / INDEX, what="feature store index")
    try:
        return [ShardRecord(**r) for r in data["shards"]]
    except (KeyError, TypeError) as exc:
        raise StoreError(f"{folder / INDEX}: not a feature store index; build the store again") from exc


@dataclass(frozen=True, kw_only=True)
class SampleFeatures:
    """One sample's stored features, in the compute dtype."""

    features: torch.Tensor
    """[L, K * H]"""
    labels: torch.Tensor | None = None
    """[L] int64 target greedy tokens (``target_greedy``)."""
    final_hidden: torch.Tensor | None = None
    """[L, H] (``kl``)."""


class _Shard:
    def __init__(self, path: Path, record: ShardRecord, *, verify: bool) -> None:
        from safetensors import SafetensorError, safe_open

        if verify and sha256_file(path) != record.sha256:
            raise StoreError(f"{path}: the shard does not match its checksum in {INDEX} (corrupt or "
                             "overwritten); delete it and its .json record and rerun dflash-trainer "
                             "features to compute it again")
        try:
            self.file = safe_open(str(path), framework="pt")
            self.offsets = self.file.get_tensor("offsets").tolist()
            self.names = set(self.file.keys())  # noqa: SIM118 - safe_open has no iteration
        except SafetensorError as exc:
            raise StoreError(f"{path}: not a readable shard ({exc}); delete it and its .json record "
                             "and rerun dflash-trainer features") from exc
        self.first = record.first_sample

    def rows(self, name: str, local: int) -> torch.Tensor | None:
        if name not in self.names:
            return None
        return self.file.get_slice(name)[self.offsets[local]:self.offsets[local + 1]]


class FeatureStore:
    """A complete feature store, checked against the run; :meth:`sample` reads one sample."""

    def __init__(self, folder: Path, manifest: Manifest, records: list[ShardRecord], *,
                 dtype: torch.dtype) -> None:
        self.folder = folder
        self.manifest = manifest
        self.records = records
        self.dtype = dtype
        self._open: OrderedDict[int, _Shard] = OrderedDict()
        self._verified: set[int] = set()
        """Shards whose checksum this run checked (once each, however often they are reopened)."""
        self._lock = threading.Lock()
        self.bytes_read = 0

    @classmethod
    def open(cls, folder: str | Path, *, expected: Manifest, dtype: torch.dtype) -> FeatureStore:
        """The store at ``folder`` if it holds ``expected``'s features (``storage_dtype`` and the
        shard layout are the store's own; ``training.labels=data`` reads any label mode)."""
        folder = Path(folder)
        if not folder.is_dir():
            raise StoreError(f"features.store={folder}: no such folder; build it with "
                             f"dflash-trainer features --out {folder}")
        manifest = Manifest.read(folder)
        ignore = {"target", "storage_dtype", "samples_per_shard", "num_shards"}
        if expected.labels == "data":
            ignore.add("labels")
        diffs = manifest.differences(expected, ignore=frozenset(ignore))
        if diffs:
            field, stored, run = diffs[0]
            raise StoreError(f"features.store={folder}: the store's {field} is {stored!r}, this run's is "
                             f"{run!r} (from {FIELD_SETTINGS.get(field, field)}); build a store for this "
                             "config with dflash-trainer features, or train with the store's settings")
        records = read_index(folder)
        if len(records) != manifest.num_shards:
            raise StoreError(f"{folder / INDEX}: {len(records)} shards listed, the manifest says "
                             f"{manifest.num_shards}; build the store again")
        for record in records:
            path = shard_path(folder, record.shard)
            if not path.is_file():
                raise StoreError(f"{path}: shard missing from the feature store; rerun dflash-trainer "
                                 "features with the store's config and --out to compute it again")
            if path.stat().st_size != record.bytes:
                raise StoreError(f"{path}: {path.stat().st_size:,} bytes, its record says "
                                 f"{record.bytes:,} (truncated or overwritten); delete it and its .json "
                                 "record and rerun dflash-trainer features")
        return cls(folder, manifest, records, dtype=dtype)

    def _shard(self, index: int) -> _Shard:
        with self._lock:
            shard = self._open.get(index)
            if shard is not None:
                self._open.move_to_end(index)
                return shard
        shard = _Shard(shard_path(self.folder, index), self.records[index],
                       verify=index not in self._verified)
        with self._lock:
            self._verified.add(index)
            self._open[index] = shard
            while len(self._open) > _OPEN_SHARDS:
                self._open.popitem(last=False)
        return shard

    def sample(self, sample_id: int) -> SampleFeatures:
        """The features of sample ``sample_id`` of the token store."""
        per = self.manifest.samples_per_shard
        shard = self._shard(sample_id // per)
        local = sample_id - shard.first
        values = shard.rows("features", local)
        assert values is not None, "a shard without features"
        out: dict[str, Any] = {"features": decode(values, shard.rows("features_scale", local), self.dtype)}
        nbytes = values.numel() * values.element_size()
        labels = shard.rows("labels", local)
        if labels is not None:
            out["labels"] = labels.long()
            nbytes += labels.numel() * 4
        final = shard.rows("final_hidden", local)
        if final is not None:
            out["final_hidden"] = decode(final, shard.rows("final_hidden_scale", local), self.dtype)
            nbytes += final.numel() * final.element_size()
        self.bytes_read += nbytes
        return SampleFeatures(**out)

    def close(self) -> None:
        """Close the open shard files."""
        with self._lock:
            self._open.clear()
