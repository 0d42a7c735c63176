"""What a feature store holds and how it is laid out: its manifest, shard names and records.

A store is a folder::

    manifest.json             what the features are of (:class:`Manifest`): the token store's
                              content hash, the target's weights hash, tokenizer fingerprint,
                              layer ids, dtypes, max length, label mode; the shard layout
    shard-00000.safetensors   samples [k * samples_per_shard, (k + 1) * samples_per_shard)
    shard-00000.json          the shard's record (:class:`ShardRecord`): sample range, tokens,
                              size, sha256; written after the shard, so it marks a finished shard
    index.json                every shard's record, written last: the store is complete

A shard holds ``offsets`` (int64 [n + 1], sample i is rows offsets[i]:offsets[i + 1]),
``features`` ([tokens, K * H], the tapped layers concatenated in ``layer_ids`` order) and what
the label mode needs: ``labels`` (int32 [tokens], ``target_greedy``) or ``final_hidden``
([tokens, H], the target's final post-norm hidden state, ``kl``). A float8 store adds a
float32 scale per row (``features_scale``, ``final_hidden_scale``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trainer.core.errors import DataError
from dflash_trainer.core.fsutil import atomic_write_text

__all__ = ["FORMAT_VERSION", "INDEX", "MANIFEST", "Manifest", "ShardRecord", "StoreError",
           "read_json", "shard_path", "record_path"]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.json"

STORAGE_BYTES = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
"""Bytes per stored element of each ``features.dtype``."""


class StoreError(DataError):
    """A feature store that is missing, incomplete, corrupt or of other settings than the run."""

    kind = "feature store error"


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a store's features are of; two stores with equal manifests hold the same features."""

    format_version: int = FORMAT_VERSION
    token_store: str
    """Content hash of the token store the features were computed from."""
    num_samples: int
    num_tokens: int
    target: str
    """The target as the config named it (informative; ``target_weights`` decides)."""
    target_weights: str
    """sha256 over the target's weight files (:func:`~.target_parts.weights_hash`)."""
    tokenizer: str
    """The tokenizer's fingerprint (chat template and special ids)."""
    layer_ids: list[int]
    hidden_size: int
    vocab_size: int
    target_dtype: str
    """The dtype the target's forward ran in."""
    storage_dtype: str
    max_length: int
    labels: str
    """``training.labels`` of the store: what besides the features it holds."""
    samples_per_shard: int
    num_shards: int

    @property
    def bytes_per_token(self) -> int:
        """Stored bytes of one token (features, labels or final hidden state, float8 scales)."""
        elem = STORAGE_BYTES[self.storage_dtype]
        scale = 4 if self.storage_dtype == "float8_e4m3fn" else 0
        per = len(self.layer_ids) * self.hidden_size * elem + scale
        if self.labels == "target_greedy":
            per += 4
        elif self.labels == "kl":
            per += self.hidden_size * elem + scale
        return per

    def to_json(self) -> str:
        """The manifest file's text."""
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        """The manifest of the store ``folder``; StoreError when missing or unreadable."""
        data = read_json(folder / MANIFEST, what="feature store manifest")
        if data.get("format_version") != FORMAT_VERSION:
            raise StoreError(f"{folder / MANIFEST}: format version {data.get('format_version')!r}, "
                             f"this version reads {FORMAT_VERSION}; build the store again with "
                             "dflash-trainer features")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(names - set(data))
        if missing:
            raise StoreError(f"{folder / MANIFEST}: missing {', '.join(missing)}; build the store "
                             "again with dflash-trainer features")
        return cls(**{k: v for k, v in data.items() if k in names})

    def write(self, folder: Path) -> None:
        """Write ``manifest.json`` atomically."""
        atomic_write_text(folder / MANIFEST, self.to_json(), durable=True)

    def differences(self, other: Manifest, *, ignore: frozenset[str] = frozenset()) -> list[tuple[str, Any, Any]]:
        """(field, self's value, other's value) of every field that differs."""
        out = []
        for f in dataclasses.fields(self):
            if f.name in ignore:
                continue
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                out.append((f.name, mine, theirs))
        return out

    def shard_samples(self, shard: int) -> range:
        """The sample ids of shard ``shard``."""
        start = shard * self.samples_per_shard
        return range(start, min(start + self.samples_per_shard, self.num_samples))


@dataclass(frozen=True, kw_only=True)
class ShardRecord:
    """One finished shard: which samples it holds, how big it is, its checksum."""

    shard: int
    first_sample: int
    num_samples: int
    num_tokens: int
    bytes: int
    sha256: str

    def write(self, folder: Path) -> None:
        """Write the shard's record atomically (after the shard itself)."""
        atomic_write_text(record_path(folder, self.shard), json.dumps(dataclasses.asdict(self)) + "\n",
                          durable=True)

    @classmethod
    def read(cls, folder: Path, shard: int) -> ShardRecord | None:
        """The record of shard ``shard``; None when the shard is not finished or its record is
        unreadable (the shard is then built again)."""
        path = record_path(folder, shard)
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


def shard_path(folder: Path, shard: int) -> Path:
    """The safetensors file of shard ``shard``."""
    return folder / f"shard-{shard:05d}.safetensors"


def record_path(folder: Path, shard: int) -> Path:
    """The record file of shard ``shard``."""
    return folder / f"shard-{shard:05d}.json"


def read_json(path: Path, *, what: str) -> dict[str, Any]:
    """A JSON object file of the store; StoreError naming ``path`` when missing or broken."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise StoreError(f"{path}: no {what} there; build the store with dflash-trainer features "
                         "--out FOLDER, or name the folder it was built in") from exc
    except (OSError, ValueError) as exc:
        raise StoreError(f"{path}: the {what} is unreadable ({type(exc).__name__}); build the "
                         "store again with dflash-trainer features") from exc
    if not isinstance(data, dict):
        raise StoreError(f"{path}: the {what} is not a JSON object; build the store again")
    return data
