"""Generation backends for ``regenerate``: the target in-process, or an OpenAI-compatible server.

Both answer one chat prompt (a list of ``{"role", "content"}`` messages ending in a user turn)
with a :class:`Generation`. :class:`TransformersBackend` works on batches of pre-tokenized
prompts (left padded, one ``model.generate`` call per batch); :class:`OpenAIBackend` answers one
prompt per call and is meant to be called from several threads at once.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from dflash_trainer.data.tokenize import reads_enable_thinking, render_prompt

Message = dict[str, str]


DEFAULT_REQUEST_TIMEOUT_S = 120.0
"""Longest wait for one server answer (``--request-timeout``); a hung server is retried, then
the conversation fails, instead of the run looking frozen."""


class GenerationError(RuntimeError):
    """One prompt could not be answered (too long, rejected by the server, retries exhausted).

    ``cause`` names the kind of failure in a few words, the same for every conversation that
    failed alike, so that a run can count them: ``HTTP 500``, ``timeout``, ``invalid JSON``,
    ``not a chat completion``, ``empty content``, ``connection reset``, ``connection refused``;
    ``input`` for a conversation that cannot be asked at all."""

    def __init__(self, message: str, *, cause: str = "input") -> None:
        super().__init__(message)
        self.cause = cause


class _MalformedBody(Exception):
    """A 200 answer whose body is not a chat completion: retried like a 5xx."""


def transport_cause(exc: Exception) -> str:
    """The cause (see :class:`GenerationError`) of an ``httpx`` transport failure."""
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        return "connection refused"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        # The server closed or reset the connection before a whole answer came back.
        return "connection reset"
    return type(exc).__name__


def check_answer(generation: Generation, *, allow_empty: bool) -> Generation:
    """``generation`` itself; an empty (or whitespace) answer is a :class:`GenerationError`
    unless ``allow_empty`` (an empty assistant turn teaches the drafter nothing but the end)."""
    if not allow_empty and not generation.text.strip():
        raise GenerationError("the target answered with an empty text (pass --allow-empty to "
                              "keep such turns)", cause="empty content")
    return generation


@dataclass(kw_only=True, frozen=True)
class Generation:
    """One generated assistant answer."""

    text: str
    num_tokens: int
    """Generated tokens, the end-of-turn token included when there is one."""
    truncated: bool
    """The answer hit ``max_new_tokens`` before the model ended its turn."""


@dataclass(kw_only=True, frozen=True)
class SamplingParams:
    """Sampling settings of a regeneration run; ``None`` leaves the choice to the server."""

    max_new_tokens: int
    temperature: float | None = None
    """0 is greedy decoding."""
    top_p: float | None = None
    top_k: int | None = None
    """0 disables top-k filtering."""

    def describe(self) -> str:
        """One line for the log, e.g. ``temperature=0.7 top_p=0.9 top_k=off max_new_tokens=512``."""
        def show(value: float | None) -> str:
            return "server default" if value is None else f"{value:g}"
        top_k = "off" if self.top_k == 0 else show(self.top_k)
        return (f"temperature={show(self.temperature)} top_p={show(self.top_p)} "
                f"top_k={top_k} max_new_tokens={self.max_new_tokens}")


def read_generation_config(model_dir: str | Path) -> dict[str, Any]:
    """The raw ``generation_config.json`` of a model folder (``{}`` when it has none)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise GenerationError(f"{path}: not valid JSON ({exc})") from exc
    return data if isinstance(data, dict) else {}


def resolve_sampling(generation_config: Mapping[str, Any] | None, *, max_new_tokens: int,
                     temperature: float | None = None, top_p: float | None = None,
                     top_k: int | None = None) -> SamplingParams:
    """Flags first, then the target's generation config, then neutral sampling.

    With ``generation_config=None`` (the target's config is not known here, as with a remote
    server) unset values stay ``None`` and the server applies its own defaults, which for vLLM
    and SGLang are again the model's generation config. A config that sets ``do_sample: false``
    and no temperature means greedy decoding; missing values mean temperature 1, no top-p and
    no top-k filtering, as vLLM does.
    """
    if generation_config is None:
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, top_k=top_k)
    gc = generation_config
    if temperature is None:
        default_t = 0.0 if gc.get("do_sample") is False else 1.0
        temperature = float(gc["temperature"]) if gc.get("temperature") is not None else default_t
    if top_p is None:
        top_p = float(gc["top_p"]) if gc.get("top_p") is not None else 1.0
    if top_k is None:
        top_k = max(0, int(gc["top_k"])) if gc.get("top_k") is not None else 0
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, top_k=top_k)


def template_has_thinking(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads the ``enable_thinking`` switch."""
    return reads_enable_thinking(getattr(tokenizer, "chat_template", None))


class TransformersBackend:
    """The target model in this process: batched, left-padded ``model.generate``."""

    def __init__(self, model: Any, tokenizer: Any, sampling: SamplingParams, *,
                 thinking: bool = False) -> None:
        """``model`` is a causal LM in eval mode on its device; ``tokenizer`` its tokenizer.

        ``sampling`` must be fully resolved (see :func:`resolve_sampling`).
        """
        assert sampling.temperature is not None and sampling.top_p is not None \
            and sampling.top_k is not None, "TransformersBackend needs resolved sampling"
        self.model = model
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.thinking = thinking
        self.device = next(model.parameters()).device
        from dflash_trainer.data.tokenize import end_of_turn_ids

        self.pad_id = tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = tokenizer.eos_token_id
        eos_ids = end_of_turn_ids(tokenizer, model.generation_config)
        if not eos_ids or self.pad_id is None:
            raise GenerationError("the target's tokenizer has no end-of-sequence token; "
                                  "set eos_token_id in its generation_config.json")
        self.eos_ids = sorted(eos_ids)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)

    def encode(self, messages: Sequence[Message]) -> list[int]:
        """Prompt token ids: the chat template with the generation prompt appended."""
        ids = render_prompt(self.tokenizer, list(messages), thinking=self.thinking)
        limit = self.max_positions
        if limit is not None and len(ids) + self.sampling.max_new_tokens > limit:
            raise GenerationError(
                f"prompt has {len(ids)} tokens; with max_new_tokens="
                f"{self.sampling.max_new_tokens} it exceeds the target's context of {limit}", cause="prompt too long")
        return ids

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Generation]:
        """Answer a batch of encoded prompts with one ``model.generate`` call."""
        import torch

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            # Left padding keeps every prompt's last token at the same position, where
            # generation continues.
            input_ids[row, width - len(ids):] = torch.tensor(list(ids), dtype=torch.long)
            attention[row, width - len(ids):] = 1
        s = self.sampling
        kwargs: dict[str, Any] = {"do_sample": s.temperature > 0}
        if s.temperature > 0:
            kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                max_new_tokens=s.max_new_tokens, pad_token_id=self.pad_id,
                eos_token_id=self.eos_ids, **kwargs)
        new_tokens = out[:, width:].tolist()
        results = []
        for row in new_tokens:
            end = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            answer = row if end is None else row[:end]
            results.append(Generation(
                text=self.tokenizer.decode(answer, skip_special_tokens=True),
                num_tokens=len(answer) + (0 if end is None else 1),
                truncated=end is None))
        return results


class OpenAIBackend:
    """An OpenAI-compatible server (vLLM, SGLang) behind ``/v1/chat/completions``.

    Thread-safe: one pooled HTTP client serves every worker thread. Connection errors,
    timeouts (``timeout_s`` per request), 429 and 5xx answers and malformed bodies (not JSON,
    or not a chat completion) are retried with exponential backoff and jitter; other 4xx
    answers fail the prompt at once. A ``null`` content comes back as an empty text.
    """

    def __init__(self, base_url: str, sampling: SamplingParams, *, model: str | None = None,
                 model_hint: str | None = None, thinking: bool = False,
                 api_key: str | None = None, max_retries: int = 5, backoff_s: float = 1.0,
                 timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, max_connections: int = 8) -> None:
        """``base_url`` is the server root or its ``/v1``.

        ``model`` is the served model name; by default the server's only model, or
        ``model_hint`` when the server serves several and it is one of them.
        """
        url = base_url.rstrip("/")
        self.base_url = url if url.endswith("/v1") else url + "/v1"
        self.sampling = sampling
        self.thinking = thinking
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections))
        self.stop = threading.Event()
        try:
            self.model = model or self._served_model(model_hint)
        except BaseException:
            self.client.close()
            raise

    def close(self) -> None:
        """Stop retry waits and close the connection pool (idempotent)."""
        self.stop.set()
        self.client.close()

    def _served_model(self, hint: str | None) -> str:
        def models(body: Any) -> list[Any]:
            if not isinstance(body, dict) or not isinstance(body.get("data"), list):
                raise _MalformedBody("not a model list")
            return [m.get("id") for m in body["data"] if isinstance(m, dict)]

        ids = self._request("GET", "/models", parse=models)
        if len(ids) == 1:
            return ids[0]
        if hint in ids:
            return hint
        raise GenerationError(f"{self.base_url}/models serves {ids!r}; choose one with --target")

    def chat(self, messages: Sequence[Message]) -> Generation:
        """Answer one prompt (blocking, with retries)."""
        s = self.sampling
        payload: dict[str, Any] = {
            "model": self.model, "messages": list(messages), "max_tokens": s.max_new_tokens,
            "chat_template_kwargs": {"enable_thinking": self.thinking}}
        if s.temperature is not None:
            payload["temperature"] = s.temperature
        if s.top_p is not None:
            payload["top_p"] = s.top_p
        if s.top_k is not None:
            # vLLM and SGLang spell "no top-k filtering" as -1 (vLLM rejects 0).
            payload["top_k"] = s.top_k if s.top_k > 0 else -1
        return self._request("POST", "/chat/completions", payload, parse=_parse_completion)

    def _request(self, method: str, path: str, payload: Any = None, *,
                 parse: Callable[[Any], Any]) -> Any:
        """``parse(body)`` of the first good answer; retries transport errors, 429, 5xx and
        bodies that are not JSON or that ``parse`` rejects with ``_MalformedBody``."""
        url = self.base_url + path
        last = ""
        cause = "stopped"
        for attempt in range(self.max_retries + 1):
            if attempt:
                delay = self.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random())
                if self.stop.wait(delay):
                    break
            if self.stop.is_set():
                break
            try:
                response = self.client.request(method, url, json=payload)
            except (httpx.TransportError, RuntimeError) as exc:
                # RuntimeError: the client was closed by close() while this thread waited.
                last, cause = f"{type(exc).__name__}: {exc}", transport_cause(exc)
                continue
            if response.status_code == 429 or response.status_code >= 500:
                last, cause = f"HTTP {response.status_code}: {response.text[:300]}", f"HTTP {response.status_code}"
                continue
            if response.status_code != 200:
                raise GenerationError(f"{method} {url}: HTTP {response.status_code}: "
                                      f"{response.text[:500]}", cause=f"HTTP {response.status_code}")
            try:
                body = response.json()
            except ValueError as exc:
                last, cause = f"invalid JSON ({exc}): {response.text[:300]!r}", "invalid JSON"
                continue
            try:
                return parse(body)
            except _MalformedBody as exc:
                last, cause = f"{exc}: {response.text[:300]!r}", "not a chat completion"
                continue
        if self.stop.is_set():
            raise GenerationError(f"{method} {url}: stopped", cause="stopped")
        raise GenerationError(f"{method} {url}: failed after {self.max_retries + 1} attempts; "
                              f"last error: {last}", cause=cause)


def _parse_completion(body: Any) -> Generation:
    """A chat completion body as a :class:`Generation`; ``_MalformedBody`` if it is not one."""
    try:
        choice = body["choices"][0]
        message = choice["message"]
        text = message.get("content") or ""
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise _MalformedBody(f"not a chat completion: {json.dumps(body)[:200]}") from exc
    if not isinstance(text, str):
        raise _MalformedBody(f"content is {type(text).__name__}, not text")
    # Servers started with a reasoning parser return the thinking part separately;
    # put it back where the chat template expects it.
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        text = f"<think>\n{reasoning.strip()}\n</think>\n\n{text.lstrip()}"
    usage = body.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return Generation(text=text, num_tokens=int(tokens or 0),
                      truncated=choice.get("finish_reason") == "length")
