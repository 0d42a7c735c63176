"""Asynchronous, atomic checkpoints with retention and validated resume.

Layout under ``RUN_DIR/checkpoints``::

    step-N/            a complete checkpoint (renamed into place only once fully written)
      state.pt         training state of this rank set (weights, optimizer, schedule, data cursor, RNG)
      rank-R.pt        per-rank state (RNG, data cursor) for R > 0
      drafter/         the drafter in the z-lab export format (servable as is)
      config.yaml      the run configuration the checkpoint was written with
      manifest.json    file sizes and SHA-256 of every file above, written last
    latest             text file naming the newest complete checkpoint (replaced atomically)

The training loop only takes a snapshot (tensors copied to CPU) between steps; a background
thread writes it to ``step-N.tmp/``, fsyncs every file and the folder, renames it to
``step-N/`` and then moves ``latest``. A crash at any moment leaves ``latest`` naming a
complete checkpoint; a partial or corrupt folder fails manifest validation and is skipped.
Retention renames a folder out of the ``step-N`` namespace before deleting it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
_TRASH = ".deleting"
WRITER_NICE = 10
"""Niceness of the writer thread (Linux): the training threads win the CPU when both want it."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (missing, partial, corrupt or incompatible)."""


class ResumeError(CheckpointError):
    """A resume request the user must change (no checkpoint, incompatible config or world)."""


def snapshot(obj: Any) -> Any:
    """Deep copy of a state tree with every tensor detached and copied to CPU.

    This is the only part of a save that runs on the training thread; it must finish
    before the optimizer mutates parameters again.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(folder: Path, step: int) -> None:
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        files[rel] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = folder / MANIFEST
    manifest.write_text(json.dumps({"step": step, "files": files}, indent=1))
    for path in folder.rglob("*"):
        _fsync_path(path)
    _fsync_path(folder)


def validate_checkpoint(folder: Path) -> int:
    """Return the step of a complete checkpoint folder; raise CheckpointError otherwise."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST} (partial write?)")
    try:
        meta = json.loads(manifest.read_text())
        files = meta["files"]
        step = int(meta["step"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{folder}/{MANIFEST} is corrupt: {exc}") from exc
    for rel, info in files.items():
        path = folder / rel
        if not path.is_file() or path.stat().st_size != info["size"]:
            raise CheckpointError(f"{folder}: {rel} is missing or truncated")
        if _sha256(path) != info["sha256"]:
            raise CheckpointError(f"{folder}: {rel} does not match its checksum")
    return step


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _move_to_trash(folder: Path) -> None:
    """Rename out of the ``step-N`` namespace (atomic) before deleting: a crash mid-delete
    leaves only trash that the next save removes, never a half-deleted ``step-N``."""
    trash = folder.with_name(folder.name + _TRASH)
    if trash.exists():
        shutil.rmtree(trash)
    os.replace(folder, trash)


def _step_of(folder: Path) -> int | None:
    name = folder.name
    if not name.startswith("step-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def find_resume_checkpoint(ckpt_dir: Path) -> Path | None:
    """Newest complete checkpoint: ``latest`` if valid, else the newest valid ``step-N``.

    Invalid folders are reported with a warning and never loaded.
    """
    if not ckpt_dir.is_dir():
        return None
    candidates: list[Path] = []
    pointer = ckpt_dir / LATEST
    if pointer.is_file():
        candidates.append(ckpt_dir / pointer.read_text().strip())
    steps = sorted((p for p in ckpt_dir.iterdir() if p.is_dir() and _step_of(p) is not None),
                   key=lambda p: _step_of(p) or 0, reverse=True)
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
        return find_resume_checkpoint(ckpt_dir)
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


def load_state(folder: Path, rank: int = 0) -> dict[str, Any]:
    """Load the training state of ``rank`` from a validated checkpoint folder."""
    validate_checkpoint(folder)
    state = torch.load(folder / "state.pt", map_location="cpu", weights_only=False)
    if rank > 0:
        rank_file = folder / f"rank-{rank}.pt"
        if not rank_file.is_file():
            raise CheckpointError(f"{folder}: no state for rank {rank} (different world size?)")
        state["rank"] = torch.load(rank_file, map_location="cpu", weights_only=False)
    return state


@dataclass(kw_only=True)
class SaveRequest:
    """A snapshot ready to be written by the background thread."""

    step: int
    state: dict[str, Any]
    rank_states: dict[int, Any]
    export: Callable[[Path], None] | None
    """Writes the servable drafter folder (runs on the writer thread)."""
    best: bool = False
    """Mark this checkpoint best once written (kept beyond ``keep_last``)."""
    files: dict[str, str] = field(default_factory=dict)
    """Small text files to write into the folder (name -> content)."""


class Checkpointer:
    """Writes snapshots on a background thread; the training loop never waits on disk.

    ``save`` blocks only if a previous write is still in progress when the next one is
    requested (the queue holds one pending save), which bounds memory to two snapshots.
    Retention keeps the ``keep_last`` newest ``step-N`` folders plus the one marked best.
    """

    def __init__(self, ckpt_dir: Path, *, keep_last: int, async_save: bool = True) -> None:
        self.ckpt_dir = Path(ckpt_dir)
        self.keep_last = keep_last
        self.async_save = async_save
        self.best_step: int | None = None
        """The checkpoint kept regardless of retention (see :meth:`mark_best`)."""
        self._best_lock = threading.Lock()
        self._queue: queue.Queue[SaveRequest | None] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.last_saved_step: int | None = None
        """Newest step on disk (set by the writer thread)."""
        self.write_seconds: list[float] = []
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

    def raise_if_failed(self) -> None:
        """Forward a writer-thread failure to the caller's thread."""
        if self._error is not None:
            raise CheckpointError("checkpoint write failed") from self._error

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
                log.exception("checkpoint write failed")
            finally:
                self._queue.task_done()

    def _write(self, request: SaveRequest) -> None:
        start = time.perf_counter()
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        final = self.ckpt_dir / f"step-{request.step}"
        tmp = self.ckpt_dir / f"step-{request.step}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        torch.save(request.state, tmp / "state.pt")
        for rank, rank_state in request.rank_states.items():
            torch.save(rank_state, tmp / f"rank-{rank}.pt")
        for name, text in request.files.items():
            (tmp / name).write_text(text)
        if request.export is not None:
            request.export(tmp / "drafter")
        _write_manifest(tmp, request.step)
        if final.exists():  # the same step again (a resume from an older checkpoint)
            _move_to_trash(final)
        os.replace(tmp, final)
        _fsync_path(self.ckpt_dir)
        _atomic_write_text(self.ckpt_dir / LATEST, final.name)
        self.last_saved_step = request.step
        if request.best:
            self.mark_best(request.step)
        self._apply_retention(final.name)
        self.write_seconds.append(time.perf_counter() - start)

    def _apply_retention(self, latest: str) -> None:
        folders = sorted((p for p in self.ckpt_dir.iterdir()
                          if p.is_dir() and _step_of(p) is not None),
                         key=lambda p: _step_of(p) or 0)
        # The one just written always stays, even below newer folders of an abandoned run.
        keep = {p.name for p in folders[-self.keep_last:]} | {latest}
        with self._best_lock:
            best = self.best_step
        for folder in folders:
            if folder.name not in keep and _step_of(folder) != best:
                _move_to_trash(folder)
        for folder in self.ckpt_dir.iterdir():
            if folder.is_dir() and folder.name.endswith((".tmp", _TRASH)):
                shutil.rmtree(folder, ignore_errors=True)
