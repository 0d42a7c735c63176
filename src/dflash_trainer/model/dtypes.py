"""Compute dtype: the one place that turns ``model.dtype`` into a ``torch.dtype``.

``model.dtype: auto`` is bf16 on CUDA. On CPU the faster dtype depends on the machine: bf16
matmuls ran 3x faster than float32 on an AMD EPYC and 1.7x slower on an Intel Xeon with
avx512_bf16, so ``auto`` times an eighth-size training step of the configured target's shapes
in both dtypes (1-2 s on a quiet machine) and keeps the faster one (bf16 only with a clear
margin, :data:`BF16_MIN_GAIN`). The result is cached per machine
(CPU model, torch version, shapes) in ``dtype-probe.json`` under the user cache directory, so
only the first command on a machine pays for the probe, and ``features``, ``train``, ``eval``
and ``demo`` with one config all take the same dtype.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import dataclass
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from dflash_trainer.core.errors import ConfigError
from dflash_trainer.core.fsutil import atomic_write_text, read_json_cache

__all__ = ["BF16_MIN_GAIN", "DTYPES", "ProbeShape", "config_dtype", "config_probe_seconds", "cpu_model_name",
           "parse_dtype", "probe_cache_path", "probe_step_seconds", "resolve_dtype"]

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
"""``model.dtype`` names other than ``auto`` and what they mean."""

_CACHE_NAME = "dtype-probe.json"

BF16_MIN_GAIN = 0.1
"""bf16 is chosen only when its probe step is at least this much (10%) faster than float32's:
float32 is exact (and the evaluation's yardstick), and on a shared machine a near-tie can flip
from one probe to the next."""


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"float32"`` -> the torch dtype; anything else is a config error."""
    if name in DTYPES:
        return DTYPES[name]
    if name == "auto":
        raise ConfigError("model.dtype=auto depends on the device and the machine: resolve it with "
                          "dflash_trainer.model.dtypes.resolve_dtype")
    raise ConfigError(f"model.dtype={name!r} is not supported; use auto, {' or '.join(DTYPES)}")


@dataclass(frozen=True, kw_only=True)
class ProbeShape:
    """The target's sizes that decide the probe's matmuls."""

    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_target_layers: int
    context_tokens: int = 64
    """Tokens of the probe's target forward and drafter context (an eighth of the demo's 512)."""


def cpu_model_name() -> str:
    """The CPU's model string (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def probe_cache_path() -> Path:
    """Where probe results are cached: ``dtype-probe.json`` in the user cache directory."""
    from dflash_trainer.core.assets import cache_root

    return cache_root() / _CACHE_NAME


def _cache_key(shape: ProbeShape) -> str:
    # No thread count: train sets its own (half the cores) before it resolves the dtype and
    # features, eval and demo do not, and one config must get one dtype on one machine.
    return (f"{cpu_model_name()} | torch {torch.__version__} | "
            f"hidden {shape.hidden_size} vocab {shape.vocab_size} ffn {shape.intermediate_size} "
            f"layers {shape.num_target_layers}")


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # As HF's RMSNorm: statistics in float32, result back in the input dtype, then the weight.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * h.to(x.dtype)


def _layer(x: torch.Tensor, w: dict[str, torch.Tensor], heads: int, context: torch.Tensor | None) -> torch.Tensor:
    """A pre-norm decoder layer; with ``context``, keys/values also cover the context (drafter)."""
    batch, length, hidden = x.shape
    h = _rms(x, w["norm"])
    q = F.linear(h, w["q"]).view(batch, length, heads, -1).transpose(1, 2)
    kv_in = h if context is None else torch.cat([context, h], dim=1)
    k = F.linear(kv_in, w["k"]).view(batch, kv_in.shape[1], heads, -1).transpose(1, 2)
    v = F.linear(kv_in, w["v"]).view(batch, kv_in.shape[1], heads, -1).transpose(1, 2)
    attn = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=context is None)
    x = x + F.linear(attn.transpose(1, 2).reshape(batch, length, hidden), w["o"])
    h = _rms(x, w["norm"])
    return x + F.linear(F.silu(F.linear(h, w["gate"])) * F.linear(h, w["up"]), w["down"])


def _uniform(size: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # Values only need a realistic scale; uniform_ is several times cheaper than normal_. A
    # private generator leaves the global RNG (the run's seeded drafter init) untouched.
    return torch.empty(size, dtype=dtype).uniform_(-0.03, 0.03, generator=gen)


def _weights(shape: ProbeShape, dtype: torch.dtype, requires_grad: bool,
             gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, i = shape.hidden_size, shape.intermediate_size
    sizes = {"q": (h, h), "k": (h, h), "v": (h, h), "o": (h, h), "gate": (i, h), "up": (i, h),
             "down": (h, i), "fc": (h, h)}
    w = {name: _uniform(size, gen, dtype).requires_grad_(requires_grad) for name, size in sizes.items()}
    w["norm"] = torch.ones(h, dtype=dtype, requires_grad=requires_grad)
    return w


def probe_step_seconds(shape: ProbeShape, *, repeats: int = 2,
                       dtypes: tuple[str, ...] = tuple(DTYPES)) -> dict[str, float]:
    """Seconds of one probe step per dtype name (the best of ``repeats`` after a warm-up).

    The probe step mirrors a training step of the demo at an eighth of its size: the target's
    forward (one decoder layer over ``context_tokens`` tokens, no grad, weights in the dtype,
    scaled by the number of target layers), then the drafter step: fp32 master weights (under
    bf16 autocast for bf16), the context cast from the target dtype, one layer over twice as
    many block tokens, and the frozen LM head (in the target dtype) over 3/8 of the context
    length in slots: logits, the target's logits (KL) and the gradient.
    """
    heads = max(1, shape.hidden_size // 64)
    ctx_len = shape.context_tokens
    slots = max(1, ctx_len * 3 // 8)
    gen = torch.Generator().manual_seed(0)
    head32 = _uniform((shape.vocab_size, shape.hidden_size), gen)
    drafter = _weights(shape, torch.float32, requires_grad=True, gen=gen)
    setups = {name: (DTYPES[name], _weights(shape, DTYPES[name], requires_grad=False, gen=gen),
                     head32.to(DTYPES[name])) for name in dtypes}
    inputs = _uniform((1, ctx_len, shape.hidden_size), gen) * 30
    blocks = _uniform((1, 2 * ctx_len, shape.hidden_size), gen) * 30

    def step(dtype: torch.dtype, target: dict[str, torch.Tensor], head: torch.Tensor) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            features = _layer(inputs.to(dtype), target, heads, None)
            final = _layer(features, target, heads, None)
        target_s = (time.perf_counter() - start) / 2 * shape.num_target_layers
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            context = _rms(F.linear(features.to(torch.float32), drafter["fc"]), drafter["norm"])
            out = _layer(blocks.to(dtype).to(torch.float32), drafter, heads, context)
            hidden = _rms(out, drafter["norm"])[0, :slots]
            logits = (hidden.to(dtype) @ head.T).float()
            with torch.no_grad():
                target_probs = torch.softmax((final[0, :slots] @ head.T).float(), dim=-1)
            loss = (torch.logsumexp(logits, dim=-1) - (target_probs * logits).sum(-1)).sum()
        loss.backward()
        for param in drafter.values():
            param.grad = None
        return target_s + time.perf_counter() - start

    best = {name: float("inf") for name in dtypes}
    for round_ in range(repeats + 1):  # round 0 warms up kernels and allocators
        for name, setup in setups.items():
            seconds = step(*setup)
            if round_:
                best[name] = min(best[name], seconds)
    return best


def _probe_entry(shape: ProbeShape, cache_path: Path) -> dict[str, Any]:
    """The cached probe of ``shape`` on this machine, measured (and cached) when missing:
    ``choice``, ``seconds`` per dtype name, ``probe_s``, ``measured`` (and ``cached``: whether it
    came from the cache)."""
    key = _cache_key(shape)
    entry = read_json_cache(cache_path, what="dtype probe cache").get(key)
    if isinstance(entry, dict) and entry.get("choice") in DTYPES and isinstance(entry.get("seconds"), dict):
        return {**entry, "cached": True}
    start = time.perf_counter()
    seconds = probe_step_seconds(shape)
    probe_s = time.perf_counter() - start
    choice = "bfloat16" if seconds["bfloat16"] <= (1 - BF16_MIN_GAIN) * seconds["float32"] else "float32"
    entry = {"choice": choice, "seconds": seconds, "probe_s": round(probe_s, 3),
             "measured": datetime.now(UTC).isoformat(timespec="seconds")}
    cache = read_json_cache(cache_path, what="dtype probe cache")
    cache[key] = entry
    try:
        atomic_write_text(cache_path, json.dumps(cache, indent=1, sort_keys=True))
    except OSError as exc:
        log.warning("could not cache the dtype probe in %s (%s); the next run probes again", cache_path, exc)
    return {**entry, "cached": False}


def _cpu_auto(shape: ProbeShape, cache_path: Path) -> torch.dtype:
    entry = _probe_entry(shape, cache_path)
    seconds = entry["seconds"]
    if entry["cached"]:
        log.info("model.dtype auto on CPU: %s (cached probe of %s: float32 %.3f s, bfloat16 %.3f s per "
                 "probe step; %s; delete it to measure again)", entry["choice"], entry.get("measured", "?"),
                 seconds.get("float32", float("nan")), seconds.get("bfloat16", float("nan")), cache_path)
    else:
        log.info("model.dtype auto on CPU: %s (probe step of this target's shapes on %d thread(s): "
                 "float32 %.3f s, bfloat16 %.3f s, bf16 needs a %d%% gain; the probe took %.1f s; cached in %s)",
                 entry["choice"], torch.get_num_threads(), seconds["float32"], seconds["bfloat16"],
                 round(100 * BF16_MIN_GAIN), entry["probe_s"], cache_path)
    return DTYPES[entry["choice"]]


def _without_probe(name: str, device: torch.device | str) -> torch.dtype | None:
    """The dtype when it needs no probe (a fixed name, or ``auto`` off the CPU), else None."""
    if name != "auto":
        return parse_dtype(name)
    device_type = torch.device(device).type
    if device_type == "cuda":
        return torch.bfloat16
    return None if device_type == "cpu" else torch.float32


def resolve_dtype(name: str, device: torch.device | str, *, hidden_size: int, vocab_size: int,
                  intermediate_size: int | None = None, num_target_layers: int = 1,
                  cache_path: Path | None = None) -> torch.dtype:
    """The compute dtype for ``model.dtype = name`` on ``device``.

    ``bfloat16``/``float32`` are taken as they are. ``auto`` is bf16 on CUDA, float32 on other
    accelerators, and on CPU the faster of the two for a training step of a target with these
    sizes (:func:`probe_step_seconds`; bf16 only when :data:`BF16_MIN_GAIN` faster), cached
    in ``cache_path`` (default :func:`probe_cache_path`) per CPU model, torch version and shape.
    Logs the choice and the measured step times.
    """
    fixed = _without_probe(name, device)
    if fixed is not None:
        return fixed
    shape = ProbeShape(hidden_size=hidden_size, vocab_size=vocab_size,
                       intermediate_size=intermediate_size or 4 * hidden_size,
                       num_target_layers=num_target_layers)
    return _cpu_auto(shape, cache_path or probe_cache_path())


def _target_shape(model_cfg: Any) -> ProbeShape:
    """The probe's shape for the target that ``model_cfg`` names (its config is read)."""
    from transformers import AutoConfig

    from dflash_trainer.core.assets import resolve_target
    from dflash_trainer.model.drafter import text_config

    target = text_config(AutoConfig.from_pretrained(resolve_target(model_cfg.target)))
    return ProbeShape(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                      intermediate_size=getattr(target, "intermediate_size", None) or 4 * target.hidden_size,
                      num_target_layers=target.num_hidden_layers)


def config_dtype(model_cfg: Any, device: torch.device | str, *, cache_path: Path | None = None) -> torch.dtype:
    """:func:`resolve_dtype` for a :class:`~dflash_trainer.config.ModelConfig`; the target's
    config is read only when the CPU probe needs its sizes."""
    fixed = _without_probe(model_cfg.dtype, device)
    if fixed is not None:
        return fixed
    return _cpu_auto(_target_shape(model_cfg), cache_path or probe_cache_path())


def config_probe_seconds(model_cfg: Any, dtype: torch.dtype) -> tuple[float, str]:
    """Seconds of one CPU probe step of ``model_cfg``'s target in ``dtype``, measured now (about
    a second), and the probe's cache key (CPU, torch, target shape). Measured rather
    than read from the cache: the demo scales it to its expected duration
    (:mod:`dflash_trainer.cli.duration`), and a probe taken under the load of the moment carries
    that load into the estimate."""
    names = {v: k for k, v in DTYPES.items()}
    if dtype not in names:
        raise ValueError(f"no CPU probe for {dtype}")
    shape = _target_shape(model_cfg)
    return probe_step_seconds(shape, dtypes=(names[dtype],))[names[dtype]], _cache_key(shape)
