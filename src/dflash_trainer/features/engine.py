"""The target's features from a vLLM server (``engine.kind=vllm``), for the store and online.

vLLM serves the target with its ``extract_hidden_states`` speculative method: a prefill-only
request (``max_tokens=1``) caches the auxiliary hidden states of the requested layers, and the
project's connector (:mod:`dflash_trainer.engines.vllm_hidden_states`) writes them to one
safetensors file per request (``hidden_states`` ``[tokens, layers, hidden]``, ``token_ids``) in
the exchange folder; the response names the file. The client reads each file once its writer
released the lock and deletes it. Everything the server says is checked first
(:mod:`~dflash_trainer.features.engine_answers`): the file must lie in the exchange folder, the
JSON bodies hold what is used, and the tensors are of the request's tokens, of the dtypes and
shape asked for, and finite.

Layer numbering: vLLM's auxiliary layer ``j`` is transformers' ``hidden_states[j]``, the output
of decoder layer ``j - 1``; the trainer's layer id ``L`` (the output of layer ``L``) is vLLM's
``L + 1``. vLLM keeps its layer ids sorted and unique, so the client maps each of the run's
layer ids to its column. The label modes that need the target's predictions also request
``num_layers`` (the last layer's output before the final norm); the trainer applies the final
norm and the LM head itself, as the in-process target does.

Requests in flight are bounded (``engine.max_inflight``): each waits for a worker of a bounded
pool, so a slow drafter, which stops asking for features, stops the requests too, and at most
that many files lie in the exchange folder. A server that exits, stops answering or answers
with an error ends the run with one :class:`~dflash_trainer.core.errors.EngineError` line
naming its log; nothing waits longer than ``engine.request_timeout_s``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from torch import nn

from dflash_trainer.config import EngineConfig
from dflash_trainer.core.errors import EngineError
from dflash_trainer.engines import vllm_server
from dflash_trainer.features import engine_answers as answers
from dflash_trainer.model.target import TargetOutputs, greedy_next_tokens

log = logging.getLogger(__name__)

__all__ = ["EngineFeatures", "EngineLayout", "EngineWindow", "VllmFeatureClient", "check_engine_model",
           "connector_files", "engine_command", "start_engine"]

CONNECTOR = "DFlashHiddenStatesConnector"
CONNECTOR_MODULE = "dflash_hidden_states_connector"
"""The module name the connector has on the server's ``PYTHONPATH`` (a copy of
``engines/vllm_hidden_states.py``: the server's venv must not see the trainer's packages)."""
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 1234567890"
MODEL_CONFIG_MAX_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class EngineLayout:
    """Which hidden states a run asks the engine for, and where each lands in its features."""

    layer_ids: tuple[int, ...]
    """The run's tapped layers (the output of decoder layer ``L``), in the drafter's order."""
    num_layers: int
    """The target's decoder layers."""
    hidden_size: int
    final: bool
    """Whether the last layer's output is requested too (greedy or kl labels)."""

    @property
    def aux_ids(self) -> list[int]:
        """vLLM's ``eagle_aux_hidden_state_layer_ids``: sorted, unique, shifted by one."""
        ids = {i + 1 for i in self.layer_ids}
        if self.final:
            ids.add(self.num_layers)
        return sorted(ids)

    @property
    def feature_columns(self) -> list[int]:
        """Column of each of :attr:`layer_ids` in the engine's ``[tokens, layers, hidden]``."""
        return [self.aux_ids.index(i + 1) for i in self.layer_ids]

    @property
    def final_column(self) -> int:
        assert self.final, "the final layer was not requested"
        return self.aux_ids.index(self.num_layers)


def connector_files(exchange: Path) -> Path:
    """A folder holding only the connector module, for the server's ``PYTHONPATH``."""
    folder = exchange / ".connector"
    folder.mkdir(parents=True, exist_ok=True)
    source = Path(__file__).resolve().parents[1] / "engines" / "vllm_hidden_states.py"
    shutil.copyfile(source, folder / f"{CONNECTOR_MODULE}.py")
    return folder


def engine_command(python: Path, model: Path, *, port: int, dtype: str, max_model_len: int,
                   layout: EngineLayout, exchange: Path, cfg: EngineConfig) -> list[str]:
    """The vLLM server command line that serves ``layout``'s hidden states into ``exchange``."""
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layout.aux_ids}}}
    transfer = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(exchange)}}
    extra = ["--kv-transfer-config", json.dumps(transfer)]
    if cfg.enforce_eager:
        extra.append("--enforce-eager")
    return vllm_server.server_command(python, model, port=port, speculative=speculative, dtype=dtype,
                                      max_model_len=max_model_len, extra_args=[*extra, *cfg.extra_args])


def start_engine(cfg: EngineConfig, *, model: Path, layout: EngineLayout, exchange: Path, dtype: str,
                 max_model_len: int, log_path: Path, say: Any = print) -> vllm_server.VllmServer:
    """Start a vLLM server for ``layout`` in ``engine.venv`` and wait until it is ready."""
    from dflash_trainer.engines.serve_vllm import server_env

    python = Path(cfg.venv) / "bin" / "python"
    if not python.is_file():
        raise EngineError(f"engine.venv={cfg.venv}: no vLLM virtualenv there ({python} is missing); build it "
                          "with `make serve-check` (or python -m dflash_trainer.engines.vllm_env "
                          f"{cfg.venv}) or point engine.venv at one")
    exchange.mkdir(parents=True, exist_ok=True)
    env = server_env()
    env["PYTHONPATH"] = str(connector_files(exchange))
    port = vllm_server.free_port()
    command = engine_command(python, model, port=port, dtype=dtype, max_model_len=max_model_len,
                             layout=layout, exchange=exchange, cfg=cfg)
    server = vllm_server.VllmServer(command, port=port, log_path=log_path, env=env, name="the vLLM engine")
    say(f"engine: starting vLLM on {model} (layers {layout.aux_ids} of vLLM's numbering), log {log_path}")
    server.start()
    try:
        seconds = server.wait_ready(cfg.startup_timeout_s)
    except vllm_server.ServerError as exc:
        server.stop()
        raise EngineError(f"{exc}".splitlines()[0] + " (engine.startup_timeout_s, engine.extra_args)") from exc
    say(f"engine: vLLM ready at {server.url} in {seconds:.0f} s")
    return server


@dataclass(frozen=True, kw_only=True)
class EngineWindow:
    """The engine's work over one metrics window."""

    seconds: float
    requests: int
    tokens: int
    request_s: float
    """Summed time of the window's requests, from send to the file read."""
    inflight: int
    """Requests sent and not yet read back, at the end of the window."""
    exchange_bytes: int
    """Bytes of hidden-states files on disk, at the end of the window."""


class VllmFeatureClient:
    """Prefill-only requests to a vLLM server; each returns one sample's hidden states.

    ``server`` (a server this process started) is watched: its exit is reported as such.
    :meth:`take_window` reports requests, tokens, request time, requests in flight and the
    exchange folder's bytes on disk.
    """

    def __init__(self, *, url: str, layout: EngineLayout, exchange: Path, cfg: EngineConfig,
                 server: vllm_server.VllmServer | None = None, log_path: Path | None = None) -> None:
        self.url = url.rstrip("/")
        self.layout = layout
        self.exchange = exchange
        self.cfg = cfg
        self.server = server
        self.log_path = log_path
        self.model_name = vllm_server.SERVED_NAME
        # httpx logs every request at INFO: thousands of lines per epoch.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        self._http = httpx.Client(timeout=httpx.Timeout(cfg.request_timeout_s, connect=30.0),
                                  limits=httpx.Limits(max_connections=cfg.max_inflight))
        self._pool = ThreadPoolExecutor(cfg.max_inflight, thread_name_prefix="engine-request")
        self._lock = threading.Lock()
        self._inflight = 0
        self.total_requests = 0
        """Requests answered and read back since the client started."""
        self._requests = 0
        self._tokens = 0
        self._request_s = 0.0
        self._window = time.perf_counter()
        self._closed = False

    # -- requests ---------------------------------------------------------------------------

    def hidden_states(self, rows: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """``[len(row), layers, hidden]`` host tensors of every row, in order (concurrently,
        at most ``engine.max_inflight`` at a time)."""
        futures = [self._pool.submit(self._request, list(map(int, row))) for row in rows]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def _where(self) -> str:
        if self.log_path is not None:
            return f"its log: {self.log_path}"
        return f"see the log of the server at {self.url}"

    def _died(self, wait_s: float = 0.0) -> EngineError | None:
        """The error of a started server that exited (waiting up to ``wait_s`` for the exit of a
        server whose connection just broke: its sockets close before its exit is seen)."""
        if self.server is None or self.server.process is None:
            return None
        deadline = time.monotonic() + wait_s
        code = self.server.process.poll()
        while code is None and time.monotonic() < deadline:
            time.sleep(0.05)
            code = self.server.process.poll()
        if code is None:
            return None
        return EngineError(f"the vLLM engine exited with status {code} while serving hidden states; "
                           f"{self._where()}")

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        died = self._died()
        if died is not None:
            raise died
        try:
            response = self._http.post(self.url + path, json=payload)
        except httpx.TimeoutException as exc:
            raise self._died() or EngineError(
                f"the vLLM engine did not answer {path} within {self.cfg.request_timeout_s:.0f} s "
                f"(engine.request_timeout_s): it hangs or is overloaded; {self._where()}") from exc
        except httpx.TransportError as exc:
            raise self._died(wait_s=5.0) or EngineError(
                f"the vLLM engine at {self.url} does not answer ({type(exc).__name__}: {exc}); "
                f"{self._where()}") from exc
        if response.status_code != 200:
            raise EngineError(f"the vLLM engine answered {path} with HTTP {response.status_code}: "
                              f"{' '.join(response.text.split())[:300]}; {self._where()}")
        try:
            return response.json()
        except ValueError as exc:
            raise EngineError(f"the vLLM engine answered {path} with something that is not JSON: "
                              f"{response.text[:200]!r}; {self._where()}") from exc

    def _request(self, ids: list[int]) -> torch.Tensor:
        with self._lock:
            self._inflight += 1
        start = time.perf_counter()
        try:
            body = self._post("/v1/completions", {"model": self.model_name, "prompt": ids, "max_tokens": 1,
                                                  "temperature": 0.0})
            named = answers.completion_file(body, server=self.url)
            file = answers.exchange_file(named, exchange=self.exchange, server=self.url)
            hidden = self._read(file, ids)
        finally:
            with self._lock:
                self._inflight -= 1
        with self._lock:
            self._requests += 1
            self.total_requests += 1
            self._tokens += len(ids)
            self._request_s += time.perf_counter() - start
        return hidden

    def _read(self, file: answers.ExchangeFile, ids: list[int]) -> torch.Tensor:
        """The hidden states of ``file`` once its writer released the lock, checked against the
        request ``ids``; the file and its lock are deleted once opened (never a link or a file
        outside the exchange folder)."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        layers, hidden = len(self.layout.aux_ids), self.layout.hidden_size
        opened = False
        try:
            with answers.open_in_exchange(file, file.lock_name, server=self.url) as lock:
                if lock is not None:
                    self._wait_for_writer(lock, file.path)
            with answers.open_in_exchange(file, file.name, server=self.url) as fd:
                if fd is None:
                    raise EngineError(f"the vLLM engine wrote no file {file.path}: engine.exchange_dir must be "
                                      "the folder the server writes to, at the same path on both sides")
                opened = True
                data = answers.read_bytes(fd, limit=answers.max_file_bytes(len(ids), layers=layers,
                                                                            hidden=hidden),
                                          where=f"{file.path} (from the vLLM engine at {self.url})")
            try:
                tensors = load(data)
            except SafetensorError as exc:
                raise EngineError(f"{file.path}: the engine's hidden-states file does not load ({exc}); "
                                  f"{self._where()}") from exc
            return answers.check_hidden_file(tensors, ids=ids, layers=layers, hidden=hidden,
                                             where=str(file.path), server=self.url)
        finally:
            if opened:
                answers.remove_from_exchange(file)

    def _wait_for_writer(self, lock: int, path: Path) -> None:
        """Wait until the engine's writer released ``lock`` (at most engine.request_timeout_s)."""
        deadline = time.monotonic() + self.cfg.request_timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                died = self._died()
                if died is not None:
                    raise died from None
                if time.monotonic() > deadline:
                    raise EngineError(
                        f"the vLLM engine did not finish writing {path} within "
                        f"{self.cfg.request_timeout_s:.0f} s (engine.request_timeout_s); "
                        f"{self._where()}") from None
                time.sleep(0.002)

    # -- identity ---------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        """The first model the server lists (``id``, ``root``, ``max_model_len``)."""
        try:
            response = self._http.get(self.url + "/v1/models")
            response.raise_for_status()
            body = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise self._died() or EngineError(f"the vLLM engine at {self.url} does not list its model "
                                              f"(/v1/models: {exc}); {self._where()}") from exc
        return answers.listed_model(body, server=self.url)

    def tokenize(self, text: str) -> list[int]:
        """The engine's token ids of ``text``."""
        return answers.token_list(self._post("/tokenize", {"model": self.model_name, "prompt": text}),
                                  server=self.url)

    # -- metrics and shutdown -----------------------------------------------------------------

    def exchange_bytes(self) -> int:
        """Bytes of the hidden-states files waiting in the exchange folder."""
        total = 0
        try:
            with os.scandir(self.exchange) as entries:
                for entry in entries:
                    if entry.name.endswith(".safetensors") and entry.is_file():
                        total += entry.stat().st_size
        except OSError:
            return 0
        return total

    def take_window(self) -> EngineWindow:
        """What the engine served since the previous call (resets the window)."""
        now = time.perf_counter()
        with self._lock:
            window = EngineWindow(seconds=now - self._window, requests=self._requests, tokens=self._tokens,
                                  request_s=self._request_s, inflight=self._inflight,
                                  exchange_bytes=self.exchange_bytes())
            self._window, self._requests, self._tokens, self._request_s = now, 0, 0, 0.0
        return window

    def close(self) -> None:
        """Stop the request pool, and the server if this process started it (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()
        if self.server is not None:
            self.server.stop()


def _model_config(root: Path) -> dict[str, Any] | None:
    """The text config of the model folder the engine names, when it is readable here (a
    regular ``config.json`` holding a JSON object); else None, and the engine is checked by its
    tokenizer and its hidden states alone."""
    path = root / "config.json"
    # A model's config.json is a few kB: anything far larger is not one (a server names it).
    if not root.parts or not path.is_file() or path.stat().st_size > MODEL_CONFIG_MAX_BYTES:
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("engine: %s does not read as JSON (%s); the engine's model is checked by its tokenizer "
                    "and hidden states only", path, exc)
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config", config)
    return text if isinstance(text, dict) else None


def check_engine_model(client: VllmFeatureClient, *, target_folder: Path, target_config: Any,
                       tokenizer: Any) -> None:
    """Refuse an engine that serves another model than ``target_folder`` (its config's
    vocabulary, hidden size and layer count when the engine's model folder is readable here;
    its tokenizer; the shape of its hidden states), one line with both values."""
    listed = client.models()
    client.model_name = str(listed.get("id") or client.model_name)
    root = Path(str(listed.get("root") or ""))
    engine_config = _model_config(root)
    if engine_config is not None:
        for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
            ours, theirs = getattr(target_config, key, None), engine_config.get(key)
            if isinstance(theirs, int) and ours is not None and int(ours) != theirs:
                raise EngineError(f"the vLLM engine at {client.url} serves {root} with {key}={theirs}, the "
                                  f"target {target_folder} has {key}={ours}: start the engine on the target "
                                  "(model.target) or point engine.url at one that serves it")
    probe = [int(t) for t in tokenizer(PROBE_TEXT)["input_ids"]] if tokenizer is not None else list(range(1, 9))
    if tokenizer is not None:
        theirs_ids = client.tokenize(PROBE_TEXT)
        if probe != theirs_ids:
            raise EngineError(f"the vLLM engine at {client.url} tokenizes {PROBE_TEXT!r} as {theirs_ids[:12]}, "
                              f"the target's tokenizer as {probe[:12]}: the engine serves another "
                              "tokenizer; start it on the target (model.target)")
    client.hidden_states([probe])


class EngineFeatures:
    """The target's feature function over a :class:`VllmFeatureClient`: the same
    ``(input_ids, attention_mask) -> TargetOutputs`` as the in-process extractor.

    ``norm`` and ``head_weight`` are the target's final norm and LM head (from the target's
    parts): the greedy labels and the kl distribution are computed from the last layer's
    output here, as the in-process target computes them from its own.
    """

    def __init__(self, client: VllmFeatureClient, *, labels: str, norm: nn.Module | None,
                 head_weight: torch.Tensor | None, label_chunk_size: int = 1024) -> None:
        if labels != "data" and (norm is None or head_weight is None):
            raise ValueError(f"labels={labels} needs the target's final norm and LM head")
        self.client = client
        self.labels = labels
        self.norm = norm
        self.head_weight = head_weight
        self.label_chunk_size = label_chunk_size

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> TargetOutputs:
        """Features (and label inputs) of right-padded ``[B, S]`` ids, on the ids' device."""
        device = input_ids.device
        ids = input_ids.cpu()
        lengths = (attention_mask.sum(dim=1).cpu().tolist() if attention_mask is not None
                   else [ids.shape[1]] * ids.shape[0])
        rows = [ids[r, :int(n)].tolist() for r, n in enumerate(lengths)]
        hidden = self.client.hidden_states(rows)
        layout = self.client.layout
        batch, width = ids.shape
        columns = layout.feature_columns
        dtype = hidden[0].dtype
        features = torch.zeros((batch, width, len(columns) * layout.hidden_size), dtype=dtype)
        final = torch.zeros((batch, width, layout.hidden_size), dtype=dtype) if layout.final else None
        for r, (n, h) in enumerate(zip(lengths, hidden)):
            n = int(n)
            features[r, :n] = h[:, columns].reshape(n, -1)
            if final is not None:
                final[r, :n] = h[:, layout.final_column]
        features = features.to(device)
        if self.labels == "data":
            return TargetOutputs(features=features)
        assert final is not None and self.norm is not None and self.head_weight is not None
        weight = self.head_weight
        final_hidden = self.norm(final.to(device=weight.device, dtype=weight.dtype))
        if self.labels == "target_greedy":
            labels = greedy_next_tokens(final_hidden, weight, ids.to(weight.device), self.label_chunk_size)
            return TargetOutputs(features=features, target_labels=labels.to(device))
        return TargetOutputs(features=features, final_hidden=final_hidden.to(device))

    def close(self) -> None:
        """Close the client (and stop a server it started)."""
        self.client.close()


def run_layout(model_cfg: Any, target_config: Any, *, labels: str) -> EngineLayout:
    """The layout of a run: its tapped layers, and the last layer when the labels need it."""
    from dflash_trainer.model.drafter import tapped_layer_ids, text_config

    config = text_config(target_config)
    num_layers = int(config.num_hidden_layers)
    return EngineLayout(layer_ids=tuple(tapped_layer_ids(model_cfg, num_layers)), num_layers=num_layers,
                        hidden_size=int(config.hidden_size), final=labels != "data")


def open_engine(cfg: EngineConfig, dist: Any, *, model: Path, target: nn.Module, tokenizer: Any,
                layout: EngineLayout, exchange: Path, dtype: torch.dtype, max_model_len: int,
                log_path: Path, labels: str, label_chunk_size: int,
                say: Any = print) -> EngineFeatures:
    """The feature function of an engine-served target: ``engine.url``'s server, or one started
    by rank 0 (the other ranks send their requests to it), checked to serve ``model``.

    ``target`` holds the target's final norm and LM head (the parts a run from the engine
    loads); ``labels`` is the run's label mode.
    """
    import torch.distributed as torch_dist

    server = None
    url = cfg.url
    if url is None:
        if dist.is_main:
            for stale in [*exchange.glob("*.safetensors"), *exchange.glob("*.safetensors.lock")]:
                stale.unlink(missing_ok=True)
            server = start_engine(cfg, model=model, layout=layout, exchange=exchange,
                                  dtype=str(dtype).removeprefix("torch."), max_model_len=max_model_len,
                                  log_path=log_path, say=say)
            url = server.url
        if dist.enabled:
            shared = [url]
            torch_dist.broadcast_object_list(shared, src=0)
            url = shared[0]
    assert url is not None
    client = VllmFeatureClient(url=url, layout=layout, exchange=exchange, cfg=cfg, server=server,
                               log_path=log_path if cfg.url is None else None)
    try:
        check_engine_model(client, target_folder=model, target_config=target.config, tokenizer=tokenizer)
    except BaseException:
        client.close()
        raise
    from dflash_trainer.model.target import lm_head_weight

    norm = target.model.norm if labels != "data" else None
    head = lm_head_weight(target) if labels != "data" else None
    return EngineFeatures(client, labels=labels, norm=norm, head_weight=head, label_chunk_size=label_chunk_size)
