"""Memory-mapped token store: the tokenized data set on disk, read one sample at a time.

A store is a folder::

    tokens.bin      int32, all samples' token ids back to back
    loss_mask.bin   uint8, the matching loss mask (1 = supervised)
    offsets.npy     int64, sample i is [offsets[i], offsets[i+1])
    supervised.npy  int64, supervised tokens per sample
    meta.json       format version, counts, the content hash, the cache key and the
                    preparation statistics

Stores live under a cache folder, named by a fingerprint of everything that decides their
content (data files, tokenizer, chat template, options), and are written under a temporary name
and renamed into place, so a reader never sees a half-written store and an unchanged input finds
its store again. One process builds a store at a time: the builder holds ``.KEY.lock`` in the
cache folder, and a second process that wants the same store waits for it (at most
:data:`BUILD_WAIT_S`) and then reads the finished store.

The content hash (:attr:`TokenStore.content_hash`) is a sha256 over the token ids, the loss
mask and the sample boundaries: what training reads, whatever the path of the data file. A
checkpoint records it, and a resume over different content is refused.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from dflash_trainer.core.fsutil import DISK_FIX, memoised_scan, sha256_file, write_dir_atomically
from dflash_trainer.core.locks import FolderLock

FORMAT_VERSION = 1
_FILES = ("tokens.bin", "loss_mask.bin", "offsets.npy", "supervised.npy", "meta.json")
BUILD_WAIT_S = 3600.0
"""How long a process waits for another one that builds the same store before giving up."""


def content_hash(tokens_sha256: str, mask_sha256: str, offsets: np.ndarray) -> str:
    """sha256 (hex) of a store's content from the hashes of its token and mask files and its
    sample offsets."""
    digest = hashlib.sha256(b"dflash token store content v1\n")
    digest.update(f"{tokens_sha256}\n{mask_sha256}\n".encode())
    digest.update(np.ascontiguousarray(offsets, dtype=np.int64).tobytes())
    return digest.hexdigest()


def build_lock(path: Path) -> FolderLock:
    """The lock of the store at ``path`` while it is built: ``.KEY.lock`` beside it."""
    path = Path(path)
    return FolderLock(path.parent / f".{path.name}.lock", what=f"token store {path}",
                      setting="data.cache_dir")


def fingerprint(parts: Any) -> str:
    """Stable sha256 (hex, 24 chars) of JSON-serialisable parts."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of what decides token ids: the tokenizer model, special tokens and chat template."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update(backend.to_str().encode() if backend is not None
                  else json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    digest.update(json.dumps(
        {"class": type(tokenizer).__name__, "special": tokenizer.special_tokens_map,
         "template": tokenizer.chat_template}, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:24]


HASH_MEMO = ".file-sha256.json"
"""The memo of data files' content hashes, in the token cache folder (:func:`file_fingerprint`)."""


_CHAT_KEYS = ("reasoning_content", "reasoning", "tool_calls", "tools")
_CHAT_ROLES = ("developer", "tool", "function_call", "observation")
_JSON_CHAT_FIELDS = re.compile(
    rb'"(' + b"|".join(k.encode() for k in _CHAT_KEYS) + rb')"\s*:'
    rb'|"(?:role|from)"\s*:\s*"(' + b"|".join(r.encode() for r in _CHAT_ROLES) + rb')"')
_BINARY_CHAT_FIELDS = re.compile(b"(" + b"|".join(k.encode() for k in (*_CHAT_KEYS, "developer")) + b")")
_OVERLAP = 64
"""Bytes kept from the previous chunk, so that a field split by a chunk boundary is seen."""


class ChatFieldScan:
    """Which fields that earlier readers dropped or refused a data file holds: reasoning
    (``reasoning_content``, ``reasoning``), tool calls, a ``tools`` list, and the ``developer``,
    ``tool``, ``function_call`` and ``observation`` roles.

    A store built from such a file before the readers kept these fields holds other samples
    than a build now gives, so they are part of the file's identity in the store key; a file
    without any keeps the identity (and the store) it had. JSON text is matched as keys and
    role values; Parquet and Arrow files by the field names in their schema (a rare false match
    costs one rebuild)."""

    name = "chat_fields"

    def __init__(self, *, json_text: bool) -> None:
        self._pattern = _JSON_CHAT_FIELDS if json_text else _BINARY_CHAT_FIELDS
        self._tail = b""
        self._found: set[bytes] = set()

    def update(self, chunk: bytes) -> None:
        """Looks for the fields in ``chunk`` (and the end of the one before)."""
        window = self._tail + chunk
        for match in self._pattern.finditer(window):
            self._found.add(next(g for g in match.groups() if g))
        self._tail = window[-_OVERLAP:]

    def result(self) -> list[str]:
        """The fields found, sorted."""
        return sorted(f.decode() for f in self._found)


def file_fingerprint(path: Path, cache: Path) -> tuple[dict[str, Any], bool]:
    """Identity of a data file by resolved path and content (sha256 of its bytes, never its
    size and mtime alone: an edit that keeps both is a new store) plus the fields of
    :class:`ChatFieldScan` it holds (only when it holds some), and whether the memo in the
    token cache folder ``cache`` answered it (see :func:`~dflash_trainer.core.fsutil.memoised_scan`)."""
    scan = ChatFieldScan(json_text=Path(path).suffix.lower() in (".json", ".jsonl"))
    digest, fields, memoised = memoised_scan(path, cache / HASH_MEMO, scan)
    identity = {"path": str(Path(path).resolve()), "size": Path(path).stat().st_size, "sha256": digest}
    return ({**identity, "chat_fields": fields} if fields else identity), memoised


class TokenStoreWriter:
    """Appends samples to a store folder being built (see :meth:`TokenStore.build`)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._tokens: BinaryIO = open(folder / "tokens.bin", "wb")
        self._mask: BinaryIO = open(folder / "loss_mask.bin", "wb")
        self._offsets = [0]
        self._supervised: list[int] = []
        self._tokens_sha = hashlib.sha256()
        self._mask_sha = hashlib.sha256()

    def add(self, input_ids: np.ndarray, loss_mask: np.ndarray) -> None:
        """Append one sample."""
        ids = np.ascontiguousarray(input_ids, dtype=np.int32)
        mask = np.ascontiguousarray(loss_mask, dtype=np.uint8)
        assert ids.ndim == 1 and ids.shape == mask.shape, (ids.shape, mask.shape)
        ids_bytes, mask_bytes = ids.tobytes(), mask.tobytes()
        self._tokens.write(ids_bytes)
        self._mask.write(mask_bytes)
        self._tokens_sha.update(ids_bytes)
        self._mask_sha.update(mask_bytes)
        self._offsets.append(self._offsets[-1] + len(ids))
        self._supervised.append(int(mask.sum()))

    def __len__(self) -> int:
        return len(self._supervised)

    def close(self, meta: dict[str, Any]) -> None:
        """Flush the arrays and write ``meta.json`` (counts are added to ``meta``)."""
        self._tokens.close()
        self._mask.close()
        offsets = np.asarray(self._offsets, dtype=np.int64)
        np.save(self.folder / "offsets.npy", offsets)
        np.save(self.folder / "supervised.npy", np.asarray(self._supervised, dtype=np.int64))
        meta = {"format_version": FORMAT_VERSION, "num_samples": len(self),
                "num_tokens": self._offsets[-1],
                "content_sha256": content_hash(self._tokens_sha.hexdigest(),
                                               self._mask_sha.hexdigest(), offsets), **meta}
        (self.folder / "meta.json").write_text(json.dumps(meta, indent=1))


class TokenStore:
    """Read-only view of a store folder; samples are memory-mapped, never loaded all at once."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        missing = [name for name in _FILES if not (self.path / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{self.path} is not a token store (missing {missing})")
        self.meta: dict[str, Any] = json.loads((self.path / "meta.json").read_text())
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{self.path}: token store format {self.meta.get('format_version')}"
                             f" is not {FORMAT_VERSION}; delete it and run prepare again")
        self.offsets: np.ndarray = np.load(self.path / "offsets.npy", mmap_mode="r")
        self.supervised: np.ndarray = np.load(self.path / "supervised.npy")
        """Supervised (loss-mask) tokens per sample."""
        self.lengths: np.ndarray = np.diff(self.offsets)
        """Tokens per sample."""
        total = int(self.offsets[-1])
        self._tokens = self._map("tokens.bin", np.int32, total)
        self._mask = self._map("loss_mask.bin", np.uint8, total)
        self.built_here = False
        """Whether :meth:`build` wrote this store in this call (not found finished)."""

    def _map(self, name: str, dtype: type, size: int) -> np.ndarray:
        # np.memmap refuses empty files; an empty store has nothing to map.
        if size == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(self.path / name, dtype=dtype, mode="r", shape=(size,))

    @property
    def stats(self) -> dict[str, Any]:
        """The preparation statistics stored with the data."""
        return self.meta.get("stats", {})

    @property
    def content_hash(self) -> str:
        """sha256 (hex) of the token ids, loss mask and sample boundaries (see
        :func:`content_hash`); computed once from the files for a store older than the hash."""
        if "content_sha256" not in self.meta:
            self.meta["content_sha256"] = content_hash(
                sha256_file(self.path / "tokens.bin"), sha256_file(self.path / "loss_mask.bin"),
                np.asarray(self.offsets))
        return self.meta["content_sha256"]

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def __len__(self) -> int:
        return len(self.lengths)

    def token_ids(self) -> np.ndarray:
        """The distinct token ids in the store, ascending (one pass over the token file)."""
        return np.flatnonzero(np.bincount(self._tokens)) if len(self._tokens) else self._tokens

    def supervised_token_counts(self, vocab_size: int) -> np.ndarray:
        """``[vocab_size]`` int64: how often each token is supervised (loss mask 1); one pass
        over the memory-mapped files in slices of bounded memory."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        step = 1 << 24
        for start in range(0, len(self._tokens), step):
            ids = np.asarray(self._tokens[start:start + step])
            keep = np.asarray(self._mask[start:start + step]).astype(bool)
            counts += np.bincount(ids[keep], minlength=vocab_size)[:vocab_size]
        return counts

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32, loss_mask uint8) of sample ``i``, as fresh arrays."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a store of {n}")
        i %= n
        start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
        return np.array(self._tokens[start:stop]), np.array(self._mask[start:stop])

    @classmethod
    def build(cls, path: Path, fill: Callable[[TokenStoreWriter], dict[str, Any]], *,
              on_wait: Callable[[str], None] | None = None) -> TokenStore:
        """Create the store at ``path`` atomically: ``fill`` adds the samples and returns the
        extra meta data; a crash inside ``fill`` leaves no store behind.

        Holds :func:`build_lock` meanwhile. When another process is building the same store,
        waits for it (``on_wait`` gets one line) and returns its store without calling ``fill``
        (:attr:`built_here` tells which). A full or read-only disk raises
        :class:`~dflash_trainer.core.errors.DiskError` naming the store's folder.
        """
        def write(folder: Path) -> None:
            writer = TokenStoreWriter(folder)
            try:
                meta = fill(writer)
            except BaseException:
                writer._tokens.close()
                writer._mask.close()
                raise
            writer.close(meta)

        with build_lock(path).acquire(timeout_s=BUILD_WAIT_S, on_wait=on_wait):
            existing = find_store(path)
            if existing is not None:
                return existing
            write_dir_atomically(Path(path), write, fix=f"{DISK_FIX} (data.cache_dir)")
        store = cls(path)
        store.built_here = True
        return store


def find_store(path: Path) -> TokenStore | None:
    """The complete store at ``path``, or None if there is none (or an outdated one)."""
    if not (Path(path) / "meta.json").is_file():
        return None
    try:
        return TokenStore(path)
    except (FileNotFoundError, ValueError):
        return None
