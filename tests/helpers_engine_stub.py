"""A stand-in for a vLLM server with the project's hidden-states connector, for ``engine.url``.

:class:`StubEngine` answers ``/v1/models``, ``/tokenize`` (with the target's own tokenizer) and
``/v1/completions`` as the real server does: it writes each request's ``hidden_states`` and
``token_ids`` into the exchange folder (under a ``.lock`` file, as the connector does) and names
the file in ``kv_transfer_params.hidden_states_path``. Its hidden states are random but finite and
fixed by the request's tokens, so training on them runs. ``fault`` names one way to misbehave,
from the request numbered ``fault_from`` on (the trainer's probe of the engine is request 0).
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from helpers_e2e import JsonHandler
from safetensors.torch import save_file

FAULTS = ("outside", "symlink", "dotdot", "fifo", "float-ids", "int8-hidden", "no-token-ids", "nan", "inf",
          "other-tokens", "wrong-shape", "no-path", "path-not-text", "not-json", "list-body", "damaged-file",
          "tokens-missing", "tokens-floats", "models-empty")


class StubEngine(ThreadingHTTPServer):
    """An engine on 127.0.0.1 serving ``layers`` hidden states of ``hidden`` values per token."""

    daemon_threads = True

    def __init__(self, *, exchange: Path, tokenizer: Any, layers: int, hidden: int,
                 fault: str | None = None, fault_from: int = 0, victim: Path | None = None,
                 root: Path | None = None) -> None:
        assert fault is None or fault in FAULTS, fault
        super().__init__(("127.0.0.1", 0), StubHandler)
        self.exchange = exchange
        self.tokenizer = tokenizer
        self.layers = layers
        self.hidden = hidden
        self.fault = fault
        self.fault_from = fault_from
        self.victim = victim
        """A file outside the exchange folder that the ``outside``/``symlink``/``dotdot`` faults name."""
        self.root = root
        """The model folder ``/v1/models`` names (its ``config.json`` is compared with the target's)."""
        self.lock = threading.Lock()
        self.completions = 0
        exchange.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up closed its end: expected when a run stops

    def fault_now(self) -> str | None:
        """The fault of the request being answered (counting completions)."""
        with self.lock:
            number = self.completions
            self.completions += 1
        return self.fault if self.fault is not None and number >= self.fault_from else None

    def tensors(self, ids: list[int], fault: str | None) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(zlib.crc32(json.dumps(ids).encode()))
        states = torch.randn(len(ids), self.layers, self.hidden, generator=generator)
        token_ids = torch.tensor(ids, dtype=torch.int64)
        if fault == "float-ids":
            token_ids = token_ids.float()
        elif fault == "int8-hidden":
            states = states.mul(10).to(torch.int8)
        elif fault in ("nan", "inf"):
            states[len(ids) // 2, 0, 1] = float(fault)
        elif fault == "other-tokens":
            token_ids = token_ids.flip(0) + 1
        elif fault == "wrong-shape":
            states = states[:, :, : self.hidden // 2].contiguous()
        tensors = {"hidden_states": states, "token_ids": token_ids}
        if fault == "no-token-ids":
            del tensors["token_ids"]
        return tensors

    def completion(self, ids: list[int]) -> Any:
        """The body of a ``/v1/completions`` answer (after writing its file)."""
        fault = self.fault_now()
        name = f"cmpl-{self.completions}-{os.getpid()}.safetensors"
        path = self.exchange / name
        if fault in ("outside", "symlink", "dotdot", "fifo"):
            assert self.victim is not None
            if fault == "outside":
                path = self.victim
            elif fault == "symlink":
                path.symlink_to(self.victim)
            elif fault == "fifo":
                os.mkfifo(path)
            else:
                path = self.exchange / ".." / self.victim.name
        elif fault == "damaged-file":
            path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
        else:
            lock = Path(f"{path}.lock")
            lock.touch()
            save_file(self.tensors(ids, fault), str(path))
        if fault == "no-path":
            return {"choices": [{"text": "x"}], "kv_transfer_params": {}}
        if fault == "path-not-text":
            return {"choices": [{"text": "x"}], "kv_transfer_params": {"hidden_states_path": [str(path)]}}
        if fault == "list-body":
            return [str(path)]
        return {"choices": [{"text": "x", "finish_reason": "length"}],
                "kv_transfer_params": {"hidden_states_path": str(path)}}


class StubHandler(JsonHandler):
    server: StubEngine

    def do_GET(self) -> None:
        root = str(self.server.root) if self.server.root is not None else ""
        models: Any = {"data": [{"id": "target", "root": root, "max_model_len": 4096}]}
        if self.server.fault == "models-empty":
            models = {"object": "list", "data": []}
        self._send(json.dumps(models).encode())

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        fault = self.server.fault
        if self.path == "/tokenize":
            tokens: Any = [int(t) for t in self.server.tokenizer(request["prompt"])["input_ids"]]
            if fault == "tokens-missing":
                self._send(json.dumps({"count": len(tokens)}).encode())
                return
            if fault == "tokens-floats":
                tokens = [t + 0.5 for t in tokens]
            self._send(json.dumps({"tokens": tokens, "count": len(tokens)}).encode())
            return
        body = self.server.completion([int(t) for t in request["prompt"]])
        if fault == "not-json" and self.server.completions > self.server.fault_from:
            self._send(b"<html>502 Bad Gateway</html>")
            return
        self._send(json.dumps(body).encode())
