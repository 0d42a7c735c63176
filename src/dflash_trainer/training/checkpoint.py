"""Asynchronous, atomic checkpoints with retention and validated resume.

Layout under ``RUN_DIR/checkpoints``::

    step-N/            a complete checkpoint (renamed into place only once fully written)
      train/           the whole training state (``training.state``): one
                       torch.distributed.checkpoint (DCP) folder, one shard file per rank plus
                       its ``.metadata``
      drafter/         the drafter in the z-lab export format (servable as is)
      config.yaml      the run configuration the checkpoint was written with
      manifest.json    file sizes and SHA-256 of every file above, written last
    latest             text file naming the newest complete checkpoint (replaced atomically)

The training loop only takes a snapshot between steps: a CPU copy of the tensors this rank
writes (its own shards; replicated tensors are split between the ranks). Every rank's
background thread then writes its part with ``dcp.save`` into ``step-N.tmp/train/``, on a
process group of its own. ``dcp.save`` returns on rank 0 once every rank's shards are written
and synced, and only then does rank 0's thread write the other files, the manifest, rename the
folder to ``step-N/`` and move ``latest``: no rank waits for another in the training loop.
A crash at any moment leaves ``latest`` naming a complete checkpoint; a partial or corrupt
folder fails manifest validation and is skipped.
Retention renames a folder out of the ``step-N`` namespace before deleting it. A ``step-N.tmp``
left by a crash is never loaded and is deleted when the next :class:`Checkpointer` starts.
A write that fails because the disk is full or the folder is read-only raises
:class:`~dflash_trainer.core.errors.DiskError` naming the folder, and leaves no ``.tmp`` behind.

Nothing here deletes a checkpoint of another run: the trainer refuses a fresh run into a run
folder that holds one (``--overwrite`` deletes them explicitly), ``checkpoint.resume=auto``
refuses to start fresh over damaged ones, and only the process holding the run folder's lock
(:mod:`dflash_trainer.core.locks`) writes or cleans up there.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dflash_trainer.core.errors import EXIT_USAGE, CheckpointError, DiskError, UserError
from dflash_trainer.training.state import JSON_SECTIONS
from dflash_trainer.core.fsutil import (
    atomic_write_text,
    disk_oserror,
    fsync_path,
    sha256_file,
    step_name,
    step_of,
)

log = logging.getLogger(__name__)
# A single process saves and loads DCP folders without a process group on purpose (no_dist).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)

MANIFEST = "manifest.json"
LATEST = "latest"
TRAIN_DIR = "train"
"""The DCP folder of a checkpoint: the training state of ``training.state`` (drafter weights
under ``drafter.*``, AdamW state under ``optimizer.*``, the other objects' JSON)."""
_TRASH = ".deleting"
WRITER_NICE = 10
"""Niceness of the writer thread (Linux): the training threads win the CPU when both want it."""


class ResumeError(CheckpointError):
    """A resume request the user must change (no checkpoint, incompatible config or world)."""

    exit_code = EXIT_USAGE


def _is_dtensor(obj: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(obj, DTensor)


def snapshot(obj: Any) -> Any:
    """Deep copy of a state tree with every tensor detached and copied to CPU.

    This is the only part of a save that runs on the training thread; it must finish
    before the optimizer mutates parameters again. A DTensor copies only its local shard and
    keeps its mesh and placements (``DTensor.from_local`` would move the copy back to the
    mesh's device).
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj


def local_part(state: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """The part of a training state tree that ``rank`` writes: its own shard of every sharded
    DTensor, its share of the plain (replicated) tensors, and on rank 0 the other values.

    Replicated tensors (every tensor under DDP) are split by size, largest first, each to the
    rank with the fewest bytes so far, so that every rank copies and writes about
    1/world_size of them. Every rank computes the same split from the same shapes.
    """
    leaves: list[tuple[tuple[Any, ...], torch.Tensor]] = []

    def collect(node: Any, path: tuple[Any, ...]) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                collect(value, (*path, key))
        elif isinstance(node, torch.Tensor) and not _is_dtensor(node):
            leaves.append((path, node))

    collect(state, ())
    load = [0] * world_size
    mine: set[tuple[Any, ...]] = set()
    for path, tensor in sorted(leaves, key=lambda leaf: (-leaf[1].numel() * leaf[1].element_size(),
                                                         repr(leaf[0]))):
        owner = min(range(world_size), key=lambda r: (load[r], r))
        load[owner] += tensor.numel() * tensor.element_size()
        if owner == rank:
            mine.add(path)

    def keep(node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, dict):
            kept = {key: keep(value, (*path, key)) for key, value in node.items()}
            return {key: value for key, value in kept.items() if value is not _DROP}
        if _is_dtensor(node):
            return node
        if isinstance(node, torch.Tensor):
            return node if path in mine else _DROP
        return node if rank == 0 else _DROP

    return keep(state, ())


_DROP = object()


def save_train_state(state: dict[str, Any], folder: Path, *, group: Any = None) -> None:
    """Write this rank's part of the training state (see :func:`local_part`) into the DCP
    folder ``folder``; a collective over ``group`` (None: a single process)."""
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), process_group=group,
             no_dist=group is None)


def load_train_state(template: dict[str, Any], folder: Path, *, group: Any = None) -> None:
    """Read a DCP folder into ``template``'s tensors, in place; each rank reads the parts of
    its own tensors, whatever the world size that wrote them (a collective over ``group``)."""
    dcp.load(template, storage_reader=dcp.FileSystemReader(folder), process_group=group,
             no_dist=group is None)


def load_drafter_weights(folder: Path, *, dtype: torch.dtype | None = None,
                         skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The drafter's whole (unsharded) weights from checkpoint ``folder`` in one process, cast to
    ``dtype`` tensor by tensor (the drafter export reads them in bf16), except those named in
    ``skip``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(Path(folder) / TRAIN_DIR)
    prefix = "drafter."
    template = {key: torch.empty(meta.size, dtype=dtype or meta.properties.dtype)
                for key, meta in reader.read_metadata().state_dict_metadata.items()
                if key.startswith(prefix) and key.removeprefix(prefix) not in skip
                and isinstance(meta, TensorStorageMetadata)}
    if template:
        dcp.load(template, storage_reader=reader, no_dist=True)
    return {key.removeprefix(prefix): value for key, value in template.items()}


def _write_manifest(folder: Path, step: int) -> None:
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = folder / MANIFEST
    manifest.write_text(json.dumps({"step": step, "files": files}, indent=1))
    for path in folder.rglob("*"):
        fsync_path(path)
    fsync_path(folder)


def validate_checkpoint(folder: Path) -> int:
    """Return the step of a complete checkpoint folder (every file present with the size and
    sha256 its manifest lists); raise CheckpointError naming the folder and file otherwise."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    manifest = folder / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST}, so it is not a complete checkpoint "
                              "(a partial write, or not a checkpoint folder); use a step-N folder "
                              "of RUN_DIR/checkpoints")
    try:
        meta = json.loads(manifest.read_text())
        files = meta["files"]
        step = int(meta["step"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{folder}/{MANIFEST} is corrupt: {exc}") from exc
    for rel, info in files.items():
        path = folder / rel
        if not path.is_file() or path.stat().st_size != info["size"]:
            raise CheckpointError(f"{folder}: {rel} is missing or truncated; the checkpoint is "
                                  "damaged, use an earlier one")
        if sha256_file(path) != info["sha256"]:
            raise CheckpointError(f"{folder}: {rel} does not match its checksum in {MANIFEST} "
                                  "(corrupted); use an earlier checkpoint")
    return step


def _move_to_trash(folder: Path) -> None:
    """Rename out of the ``step-N`` namespace (atomic) before deleting: a crash mid-delete
    leaves only trash that the next save removes, never a half-deleted ``step-N``."""
    trash = folder.with_name(folder.name + _TRASH)
    if trash.exists():
        shutil.rmtree(trash)
    os.replace(folder, trash)


def checkpoint_names(ckpt_dir: Path) -> list[str]:
    """The ``step-N`` folders (complete or not, by step) and ``latest`` in ``ckpt_dir``: what a
    run left there."""
    if not ckpt_dir.is_dir():
        return []
    steps = sorted((p for p in ckpt_dir.iterdir() if p.is_dir() and step_of(p) is not None),
                   key=lambda p: step_of(p) or 0)
    return [p.name for p in steps] + ([LATEST] if (ckpt_dir / LATEST).exists() else [])


def _read_pointer(pointer: Path) -> str | None:
    """The ``step-N`` name a ``latest`` file holds, or None (warned) when it holds anything else:
    bytes that are not ASCII, a path, or garbage never reach a path operation."""
    if not pointer.is_file():
        return None
    raw = pointer.read_bytes()[:256]
    try:
        name = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        name = None
    if name is None or step_of(name) is None:
        log.warning("skipping %s: it should name a step-N folder, but holds %r (damaged); looking for "
                    "the newest complete step-N folder instead", pointer, raw[:40])
        return None
    return name


def find_resume_checkpoint(ckpt_dir: Path) -> Path | None:
    """Newest complete checkpoint: ``latest`` if valid, else the newest valid ``step-N``.

    Invalid folders are reported with a warning and never loaded.
    """
    if not ckpt_dir.is_dir():
        return None
    candidates: list[Path] = []
    named = _read_pointer(ckpt_dir / LATEST)
    if named is not None:
        candidates.append(ckpt_dir / named)
    steps = sorted((p for p in ckpt_dir.iterdir() if p.is_dir() and step_of(p) is not None),
                   key=lambda p: step_of(p) or 0, reverse=True)
    candidates.extend(steps)
    seen: set[Path] = set()
    for folder in candidates:
        if folder in seen:
            continue
        seen.add(folder)
        try:
            validate_checkpoint(folder)
            return folder
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s", exc)
    return None


def resolve_resume(resume: str | None, ckpt_dir: Path) -> Path | None:
    """Map ``checkpoint.resume`` (None, ``auto`` or a path) to a validated folder."""
    if resume is None or resume == "":
        return None
    if resume == "auto":
        found = find_resume_checkpoint(ckpt_dir)
        if found is None:
            left = checkpoint_names(ckpt_dir)
            if left:
                # Starting fresh would replace them as the new run reaches their steps.
                raise ResumeError(
                    f"checkpoint.resume=auto: no complete checkpoint in {ckpt_dir}, but it holds "
                    f"{', '.join(left)} (damaged or partial, see the warnings above); resume "
                    f"from a checkpoint folder you trust (checkpoint.resume=PATH), start over "
                    f"with --overwrite (deletes them), or choose another run_dir")
            print(f"checkpoint.resume=auto: no complete checkpoint in {ckpt_dir}; starting a "
                  "fresh run", flush=True)
        return found
    folder = Path(resume)
    if folder.is_dir() and (folder / LATEST).is_file():
        found = find_resume_checkpoint(folder)
        if found is None:
            raise ResumeError(f"checkpoint.resume={resume}: no complete checkpoint in it")
        return found
    if not folder.is_dir():
        raise ResumeError(f"checkpoint.resume={resume}: no such checkpoint folder")
    try:
        validate_checkpoint(folder)
    except CheckpointError as exc:
        raise ResumeError(f"checkpoint.resume={resume}: {exc}") from exc
    return folder


def read_state(folder: Path, sections: tuple[str, ...] = JSON_SECTIONS) -> dict[str, Any]:
    """The JSON objects of the training state in checkpoint ``folder`` (validated by
    :func:`resolve_resume` or :func:`validate_checkpoint`), read in this process alone: a
    section saved for all ranks as its object, a per-rank section as ``{rank: object}``.
    ``sections`` chooses them (see ``training.state``); the tensors stay on disk."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    reader = dcp.FileSystemReader(Path(folder) / TRAIN_DIR)
    template: dict[str, Any] = {
        key: None for key, meta in reader.read_metadata().state_dict_metadata.items()
        if isinstance(meta, BytesStorageMetadata) and key.split(".", 1)[0] in sections}
    if template:
        dcp.load(template, storage_reader=reader, no_dist=True)
    state: dict[str, Any] = {}
    for key, text in template.items():
        section, part = key.split(".", 1)
        if part == "all":
            state[section] = json.loads(text)
        else:
            state.setdefault(section, {})[int(part.removeprefix("rank-"))] = json.loads(text)
    return state


@dataclass(kw_only=True)
class SaveRequest:
    """A snapshot ready to be written by the background thread."""

    step: int
    state: dict[str, Any]
    """This rank's part of the training state (see :func:`local_part`), written to ``train/``
    with DCP (every rank)."""
    export: Callable[[Path], None] | None
    """Writes the servable drafter folder (runs on rank 0's writer thread)."""
    best: bool = False
    """Mark this checkpoint best once written (kept beyond ``keep_last``)."""
    files: dict[str, str] = field(default_factory=dict)
    """Small text files to write into the folder (name -> content; rank 0)."""


class Checkpointer:
    """Writes snapshots on a background thread; the training loop never waits on disk.

    ``save`` blocks only if a previous write is still in progress when the next one is
    requested (the queue holds one pending save), which bounds memory to two snapshots.
    Retention keeps the ``keep_last`` newest ``step-N`` folders plus the one marked best.

    Every rank has one: each writes its shards (``dcp.save`` over ``group``, a process group
    the training loop does not use, so the writer threads' collectives never interleave with
    the training's). Only rank 0 writes the rest of the folder, renames it and moves
    ``latest``; it does so when its ``dcp.save`` returns, which is after every rank's shards
    are on disk. ``group`` None: a single process.
    """

    def __init__(self, ckpt_dir: Path, *, keep_last: int, async_save: bool = True, rank: int = 0,
                 group: Any = None) -> None:
        self.ckpt_dir = Path(ckpt_dir)
        self.rank = rank
        self.group = group
        self.keep_last = keep_last
        self.async_save = async_save
        self.best_step: int | None = None
        """The checkpoint kept regardless of retention (see :meth:`mark_best`)."""
        self._best_lock = threading.Lock()
        self._queue: queue.Queue[SaveRequest | None] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._forwarded = False
        self._thread: threading.Thread | None = None
        self._closed = False
        self.last_saved_step: int | None = None
        """Newest step on disk (set by the writer thread)."""
        self.write_seconds: list[float] = []
        self._remove_stale()
        if async_save:
            self._thread = threading.Thread(target=self._worker, name="checkpointer", daemon=True)
            self._thread.start()

    def save(self, request: SaveRequest) -> None:
        """Queue (async) or write (sync) a snapshot; re-raises an earlier write failure."""
        self.raise_if_failed()
        if self._closed:
            raise CheckpointError("save() after close()")
        if not self.async_save:
            self._write(request)
            return
        self._queue.put(request)

    def mark_best(self, step: int) -> None:
        """Keep ``step-N`` regardless of retention; it replaces the previous best."""
        with self._best_lock:
            self.best_step = step

    def _remove_stale(self) -> None:
        """Delete ``step-N.tmp`` and trash folders a crashed run left (never loaded; rank 0)."""
        if self.rank != 0 or not self.ckpt_dir.is_dir():
            return
        for folder in self.ckpt_dir.iterdir():
            if folder.is_dir() and folder.name.endswith((".tmp", _TRASH)):
                log.info("removing %s, left by an interrupted checkpoint write", folder)
                shutil.rmtree(folder, ignore_errors=True)

    def raise_if_failed(self) -> None:
        """Forward a writer-thread failure to the caller's thread, once (a user error as
        itself), so closing after the failure does not report it again."""
        error = self._error
        if error is None or self._forwarded:
            return
        self._forwarded = True
        if isinstance(error, UserError):
            raise error
        raise RuntimeError("checkpoint write failed") from error

    def wait(self) -> None:
        """Block until every queued snapshot is on disk."""
        if self._thread is not None:
            self._queue.join()
        self.raise_if_failed()

    def close(self) -> None:
        """Finish pending writes and stop the writer thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=600)
        self.raise_if_failed()

    def _worker(self) -> None:
        try:
            # Linux threads are tasks: this lowers the priority of this thread only.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (AttributeError, OSError) as exc:
            log.debug("checkpoint writer keeps its priority: %s", exc)
        while True:
            request = self._queue.get()
            try:
                if request is None:
                    return
                if self._error is None:
                    self._write(request)
            except BaseException as exc:  # forwarded to the training thread by raise_if_failed
                self._error = exc
                if not isinstance(exc, UserError):
                    log.exception("checkpoint write failed")
            finally:
                self._queue.task_done()

    def _write(self, request: SaveRequest) -> None:
        tmp = self.ckpt_dir / f"{step_name(request.step)}.tmp"
        try:
            if self.rank == 0:
                self._write_folder(request, tmp)
            else:
                save_train_state(request.state, tmp / TRAIN_DIR, group=self.group)
        except (OSError, RuntimeError, CheckpointException) as exc:
            if self.rank == 0:  # the other ranks' dcp.save has returned (or failed) by now
                shutil.rmtree(tmp, ignore_errors=True)
            problem = _disk_problem(self.ckpt_dir, exc)
            if problem is None:
                raise
            raise DiskError(f"cannot write checkpoint {tmp}: {problem}; free space or make "
                            f"{self.ckpt_dir} writable (or choose another run_dir), then resume "
                            "with --resume auto") from exc

    def _write_folder(self, request: SaveRequest, tmp: Path) -> None:
        start = time.perf_counter()
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        final = self.ckpt_dir / step_name(request.step)
        # Other ranks may have created it already (their dcp.save); a stale one was removed
        # when this checkpointer started.
        tmp.mkdir(exist_ok=True)
        # Returns once every rank's shards are written and fsynced, and .metadata too.
        save_train_state(request.state, tmp / TRAIN_DIR, group=self.group)
        for name, text in request.files.items():
            (tmp / name).write_text(text)
        if request.export is not None:
            request.export(tmp / "drafter")
        _write_manifest(tmp, request.step)
        if final.exists():  # the same step again (a resume from an older checkpoint)
            _move_to_trash(final)
        os.replace(tmp, final)
        fsync_path(self.ckpt_dir)
        atomic_write_text(self.ckpt_dir / LATEST, final.name, durable=True)
        self.last_saved_step = request.step
        if request.best:
            self.mark_best(request.step)
        self._apply_retention(final.name)
        self.write_seconds.append(time.perf_counter() - start)

    def _apply_retention(self, latest: str) -> None:
        folders = sorted((p for p in self.ckpt_dir.iterdir()
                          if p.is_dir() and step_of(p) is not None),
                         key=lambda p: step_of(p) or 0)
        # The one just written always stays, even below newer folders of an abandoned run.
        keep = {p.name for p in folders[-self.keep_last:]} | {latest}
        with self._best_lock:
            best = self.best_step
        for folder in folders:
            if folder.name not in keep and step_of(folder) != best:
                _move_to_trash(folder)
        for folder in self.ckpt_dir.iterdir():
            if folder.is_dir() and folder.name.endswith((".tmp", _TRASH)):
                shutil.rmtree(folder, ignore_errors=True)


def _disk_problem(folder: Path, exc: BaseException) -> str | None:
    """Why ``folder`` cannot take a checkpoint (full, read-only, not writable), or None.

    Besides the exception chain, the folder itself is examined: a failure that lost its errno
    on the way (a library's own error) is still recognised as a full or read-only disk.
    """
    # DCP collects each rank's failure, (exception, stack), instead of chaining it.
    causes = [exc, *(f[0] for f in getattr(exc, "failures", {}).values())]
    error = next((e for e in map(disk_oserror, causes) if e is not None), None)
    if error is not None:
        return os.strerror(error.errno or 0)
    probe = folder if folder.is_dir() else folder.parent
    if not os.access(probe, os.W_OK):
        return "the folder is not writable"
    try:
        if shutil.disk_usage(probe).free < (1 << 20):
            return "no space left on the device"
    except OSError:
        return None
    return None
