"""The vLLM arm of ``make serve-check`` and ``eval --engine``: the drafter server, then the plain one.

vLLM serves the target on 127.0.0.1 twice, with the drafter (DFlash speculative decoding, block
size - 1 draft tokens) and without it, one server at a time (two CPU engines at once would not
fit a small machine), and both answer the same conversations at temperature 0, batch size 1.
The drafter server's cumulative speculative-decoding counters are read from ``/metrics`` before
the first prompt and after each one, so any run of consecutive prompts (one domain's) has its
own counts. The 1-minute load average is recorded before and after each server's prompts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dflash_trainer.engines.vllm_server import (Completion, SpecCounters, VllmServer, chat, fetch_counters,
                                                free_port, server_command)

Messages = Sequence[Mapping[str, str]]


@dataclass(kw_only=True)
class VllmOptions:
    """How the vLLM arm starts its servers."""

    python: Path
    """The python of the vLLM virtualenv."""
    dtype: str = "float32"
    max_model_len: int = 2048
    port: int = 0
    """0: a free port."""
    eager: bool = False
    """``--enforce-eager``: no torch.compile, a much shorter startup and slower decoding."""
    extra_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 1500.0


@dataclass(kw_only=True)
class ServedRun:
    """The prompts answered by one server."""

    label: str
    completions: list[Completion] = field(default_factory=list)
    counters: SpecCounters | None = None
    snapshots: list[SpecCounters] = field(default_factory=list)
    """The server's cumulative counters before the first prompt and after each one (with a
    drafter): the counters of any run of consecutive prompts, such as one domain's."""
    startup_s: float | None = None
    load_before: float | None = None
    load_after: float | None = None
    """1-minute load average before the first prompt and after the last."""

    @property
    def tokens_per_s(self) -> float | None:
        """Generated tokens / request wall time, batch size 1, prefill included."""
        return completions_tokens_per_s(self.completions)


def completions_tokens_per_s(completions: Sequence[Completion]) -> float | None:
    """Generated tokens / request wall time of some completions (prefill included)."""
    wall = sum(c.wall_s for c in completions)
    return sum(c.completion_tokens for c in completions) / wall if wall else None


def same_output(spec: Completion, plain: Completion) -> bool:
    """Whether the drafter server answered exactly as the plain one (token ids where both give them)."""
    if spec.token_ids is not None and plain.token_ids is not None:
        return spec.token_ids == plain.token_ids
    return spec.text == plain.text


def server_env() -> dict[str, str]:
    """Environment for vLLM: offline, no usage reporting, a small CPU KV cache by default."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default is far larger
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def start_server(options: VllmOptions, target_dir: Path, speculative: Mapping[str, Any] | None, out_dir: Path,
                 label: str, *, log: Callable[[str], None]) -> VllmServer:
    """A started :class:`VllmServer`, waited until ready (stopped again if that fails);
    ``speculative`` is vLLM's ``--speculative-config``, None for the target alone."""
    port = options.port or free_port()
    extra = ["--enforce-eager"] * options.eager + list(options.extra_args)
    command = server_command(options.python, target_dir, port=port, speculative=speculative, dtype=options.dtype,
                             max_model_len=options.max_model_len, extra_args=extra)
    server = VllmServer(command, port=port, log_path=out_dir / f"vllm-{label}.log", env=server_env())
    wait = "about a minute or two" if options.eager else "a few minutes on a small CPU (torch.compile)"
    log(f"vLLM: starting {label} on {server.url} (log {server.log_path}); startup takes {wait}")
    server.start()
    try:
        startup = server.wait_ready(options.startup_timeout_s)
    except BaseException:
        server.stop()
        raise
    log(f"vLLM: {label} ready after {startup:.0f} s")
    return server


def answer_prompts(server: VllmServer, conversations: Sequence[Messages], *, max_tokens: int, label: str,
                   speculative: bool, log: Callable[[str], None]) -> ServedRun:
    """Warm up, then answer every conversation one at a time; counters cover the prompts only."""
    run = ServedRun(label=label, startup_s=server.startup_s)
    with httpx.Client(timeout=httpx.Timeout(900.0, connect=10.0)) as client:
        # The first request pays one-time costs (graph capture, allocation); keep it out of the timing.
        chat(client, server.url, conversations[0], max_tokens=8)
        run.load_before = os.getloadavg()[0]
        if speculative:
            run.snapshots.append(fetch_counters(client, server.url))
        for i, messages in enumerate(conversations):
            completion = chat(client, server.url, messages, max_tokens=max_tokens)
            run.completions.append(completion)
            if speculative:
                run.snapshots.append(fetch_counters(client, server.url))
            log(f"vLLM: {label} [{i + 1}/{len(conversations)}] {completion.completion_tokens} tokens "
                f"in {completion.wall_s:.1f} s")
        run.load_after = os.getloadavg()[0]
        if run.snapshots:
            run.counters = run.snapshots[-1].minus(run.snapshots[0])
    return run


def serve_vllm(options: VllmOptions, target_dir: Path, speculative: Mapping[str, Any],
               conversations: Sequence[Messages], *, max_tokens: int, out_dir: Path, log: Callable[[str], None],
               with_plain: Callable[[VllmServer], None] | None = None) -> tuple[ServedRun, ServedRun]:
    """(drafter, plain): the drafter server answers every conversation, then the plain one;
    ``with_plain`` runs while the plain server is still up (serve-check's regeneration checks)."""
    with start_server(options, target_dir, speculative, out_dir, "drafter", log=log) as server:
        spec = answer_prompts(server, conversations, max_tokens=max_tokens, label="drafter", speculative=True,
                              log=log)
    with start_server(options, target_dir, None, out_dir, "plain", log=log) as server:
        plain = answer_prompts(server, conversations, max_tokens=max_tokens, label="plain", speculative=False,
                               log=log)
        if with_plain is not None:
            with_plain(server)
    return spec, plain
