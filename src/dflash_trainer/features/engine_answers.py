"""What a vLLM engine answers, checked before the trainer uses it.

An engine at ``engine.url`` is another process, possibly on another machine, possibly buggy:
its JSON bodies, the file its answer names and the tensors in that file are untrusted input.
Every check here raises one :class:`~dflash_trainer.core.errors.EngineError` line that names the
server and what it answered; nothing is read, moved or deleted outside the exchange folder.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.core.errors import EngineError

__all__ = ["ExchangeFile", "check_hidden_file", "completion_file", "exchange_file", "listed_model",
           "request_text", "token_list"]

SUFFIX = ".safetensors"
HEADER_SLACK_BYTES = 1 << 20
"""Room for a safetensors header above the tensors' bytes: a file larger than that is refused
before it is read (a server must not make the trainer read a huge file into memory)."""


def _shown(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def request_text(ids: Sequence[int]) -> str:
    """A request named in a message: its length and first token ids."""
    head = ", ".join(str(i) for i in ids[:8])
    return f"the request of {len(ids)} tokens [{head}{', ...' if len(ids) > 8 else ''}]"


def token_list(body: Any, *, server: str) -> list[int]:
    """The ``tokens`` of a ``/tokenize`` answer: a list of non-negative integers."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise EngineError(f"the vLLM engine at {server} answered /tokenize without a list of token ids "
                          f"under 'tokens' (got {_shown(body)}); it is not a vLLM server or another "
                          "version: point engine.url at the vLLM server that serves the target")
    return tokens


def listed_model(body: Any, *, server: str) -> dict[str, Any]:
    """The first model of a ``/v1/models`` answer, with ``id`` (text) and, when given, ``root``
    (text) and ``max_model_len`` (an integer)."""
    data = body.get("data") if isinstance(body, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    valid = (isinstance(first, dict) and isinstance(first.get("id"), str) and first["id"]
             and isinstance(first.get("root", ""), (str, type(None)))
             and isinstance(first.get("max_model_len", 0), (int, type(None)))
             and not isinstance(first.get("max_model_len"), bool))
    if not valid:
        raise EngineError(f"the vLLM engine at {server} answered /v1/models without a model (a 'data' list "
                          f"whose first entry has an 'id'; got {_shown(body)}); point engine.url at the "
                          "vLLM server that serves the target")
    return first


def completion_file(body: Any, *, server: str) -> Any:
    """The ``kv_transfer_params.hidden_states_path`` of a ``/v1/completions`` answer (unchecked:
    :func:`exchange_file` checks it)."""
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    path = params.get("hidden_states_path") if isinstance(params, dict) else None
    if path is None or path == "":
        raise EngineError(f"the vLLM engine at {server} returned no hidden_states_path: it does not run the "
                          "hidden-states connector (start it with the command of "
                          "`dflash-trainer features --print-engine-command`)")
    return path


@dataclass(frozen=True, kw_only=True)
class ExchangeFile:
    """A hidden-states file an engine named, known to lie directly in the exchange folder."""

    folder: Path
    """The exchange folder, resolved."""
    name: str
    """The file's name in it (``*.safetensors``; its lock is ``NAME.lock``)."""

    @property
    def path(self) -> Path:
        return self.folder / self.name

    @property
    def lock_name(self) -> str:
        return f"{self.name}.lock"


def exchange_file(named: Any, *, exchange: Path, server: str) -> ExchangeFile:
    """The file ``named`` by an engine's answer, if it lies directly in ``exchange``.

    Refused, without touching anything: a path that is not text, holds ``..`` or a NUL byte,
    does not end in ``.safetensors``, or whose folder (links resolved) is not the exchange
    folder. A link in the exchange folder itself is refused when it is opened
    (:func:`open_in_exchange`).
    """
    def refuse(why: str) -> EngineError:
        return EngineError(f"the vLLM engine at {server} named the hidden-states file {_shown(named, 300)}, "
                           f"which {why}; the trainer reads and deletes files in engine.exchange_dir "
                           f"({exchange}) only: nothing was read or deleted. Point engine.url at a "
                           "server started with this exchange folder")

    if not isinstance(named, str):
        raise refuse("is not a path")
    if "\x00" in named:
        raise refuse("holds a NUL byte")
    path = Path(named)
    if ".." in path.parts:
        raise refuse("climbs out of its folder with '..'")
    root = exchange.resolve()
    if path.absolute().parent.resolve() != root:
        raise refuse("lies outside the exchange folder")
    if not path.name.endswith(SUFFIX) or path.name == SUFFIX:
        raise refuse(f"is not a {SUFFIX} file")
    return ExchangeFile(folder=root, name=path.name)


@contextmanager
def open_in_exchange(file: ExchangeFile, name: str, *, server: str) -> Iterator[int | None]:
    """A read-only descriptor of ``name`` in the exchange folder, or None when it does not exist.

    Opened relative to the folder without following a link (a link there could point anywhere)
    and without blocking (a FIFO would block forever); anything but a regular file is refused.
    """
    folder = os.open(file.folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
        except FileNotFoundError:
            yield None
            return
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise EngineError(f"the vLLM engine at {server} named {file.folder / name}, a symbolic link: "
                                  "the trainer does not follow links in engine.exchange_dir (one could point "
                                  "at any file); nothing was read or deleted") from None
            raise
        try:
            kind = os.fstat(fd).st_mode
            if not stat.S_ISREG(kind):
                raise EngineError(f"the vLLM engine at {server} named {file.folder / name}, which is not a "
                                  "regular file; nothing was read or deleted")
            os.set_blocking(fd, True)
            yield fd
        finally:
            os.close(fd)
    finally:
        os.close(folder)


def remove_from_exchange(file: ExchangeFile) -> None:
    """Delete the file and its lock from the exchange folder (links themselves, never a target)."""
    folder = os.open(file.folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in (file.name, file.lock_name):
            try:
                os.unlink(name, dir_fd=folder)
            except FileNotFoundError:
                pass
    finally:
        os.close(folder)


def read_bytes(fd: int, *, limit: int, where: str) -> bytes:
    """The whole file behind ``fd``, refused when it is larger than ``limit`` bytes."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise EngineError(f"{where} holds {size:,} bytes, more than the request's hidden states can take "
                          f"({limit:,}); nothing of it was used")
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 24)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def max_file_bytes(tokens: int, *, layers: int, hidden: int) -> int:
    """The largest hidden-states file a request of ``tokens`` tokens can give (8-byte values)."""
    return tokens * (layers * hidden + 1) * 8 + HEADER_SLACK_BYTES


def check_hidden_file(tensors: dict[str, torch.Tensor], *, ids: Sequence[int], layers: int, hidden: int,
                      where: str, server: str) -> torch.Tensor:
    """The ``hidden_states`` of one request's file, once the file holds what was asked.

    ``token_ids``: integer, one dimension, equal to the request's ids; ``hidden_states``:
    floating, ``[tokens, layers, hidden]``, every value finite. ``where`` names the file.
    """
    engine = f"the vLLM engine at {server}"
    request = request_text(ids)
    missing = [key for key in ("hidden_states", "token_ids") if key not in tensors]
    if missing:
        raise EngineError(f"{where}: the engine's file for {request} has no {' and no '.join(missing)} "
                          f"tensor (it holds {sorted(tensors)}); {engine} does not run the project's "
                          "hidden-states connector (see `dflash-trainer features --print-engine-command`)")
    token_ids, states = tensors["token_ids"], tensors["hidden_states"]
    if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
        raise EngineError(f"{where}: {engine} wrote token_ids as {str(token_ids.dtype).removeprefix('torch.')} "
                          f"for {request}; token ids are integers: the server runs another connector")
    if token_ids.dim() != 1 or token_ids.tolist() != list(ids):
        got = token_ids.reshape(-1).tolist()
        raise EngineError(f"{where}: {engine} answered {request} with the hidden states of other tokens "
                          f"({len(got)} tokens {_shown(got[:8])}); another client shares the exchange folder, "
                          "or the server serves another request")
    if not states.dtype.is_floating_point:
        raise EngineError(f"{where}: {engine} wrote hidden_states as {str(states.dtype).removeprefix('torch.')} "
                          f"for {request}; hidden states are floating point: the server runs another connector")
    if states.dim() != 3 or tuple(states.shape) != (len(ids), layers, hidden):
        raise EngineError(f"{where}: {engine} returns hidden states of shape {list(states.shape)} for "
                          f"{request}, this run needs [tokens, {layers}, {hidden}] ({len(ids)} tokens, the "
                          f"requested layers, the hidden size); start it with the command of "
                          "`dflash-trainer features --print-engine-command`")
    finite = torch.isfinite(states)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        token = int((~finite).any(dim=2).any(dim=1).nonzero()[0])
        raise EngineError(f"{where}: {engine} returned {bad} non-finite hidden-state value(s) (NaN or inf, the "
                          f"first at token {token}) for {request}: the engine's numerics failed (its dtype, "
                          "or the target's weights); nothing of it was trained on")
    return states
