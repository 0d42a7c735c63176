"""llama.cpp's ``llama-server`` with and without a drafter: conversion, command, requests.

The drafter export is converted unchanged by llama.cpp's own ``convert_hf_to_gguf.py`` (it reads
``architectures``, ``dflash_config.block_size``, ``mask_token_id`` and ``target_layer_ids`` from
``config.json`` and takes the tokenizer from ``--target-model-dir``). Conversions are cached
next to the drafter's weights' sha256, so a re-run converts nothing.

Requests go to the native ``/completion`` endpoint with the prompt as token ids (rendered by
the project's own chat template), so the plain and the speculative servers see exactly the same
tokens and return token ids, the server's decode timings and, for the drafter, its drafted and
accepted counts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from dflash_trainer.engines.llama_cpp_build import source_dir
from dflash_trainer.engines.vllm_server import HOST, ServerError

# convert_hf_to_gguf.py imports these; they are not the trainer's own dependencies.
CONVERT_REQUIREMENTS = ("sentencepiece",)


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert(model_dir: Path, out: Path, *, build_dir: Path, outtype: str, log_path: Path,
            target_model_dir: Path | None = None) -> Path:
    """``convert_hf_to_gguf.py`` of ``model_dir`` into ``out`` (skipped when ``out`` exists).

    ``target_model_dir`` is given for a drafter (it takes the target's tokenizer). Raises
    :class:`ServerError` with the end of the conversion log when it fails.
    """
    if out.is_file():
        return out
    missing = [name for name in CONVERT_REQUIREMENTS if importlib.util.find_spec(name) is None]
    if missing:
        raise ServerError(f"llama.cpp's convert_hf_to_gguf.py needs {', '.join(missing)}, which this Python "
                          f"({sys.executable}) lacks: pip install {' '.join(missing)} (the test extra has it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    command = [sys.executable, str(source_dir(build_dir) / "convert_hf_to_gguf.py"), str(model_dir),
               "--outtype", outtype, "--outfile", str(tmp)]
    if target_model_dir is not None:
        command += ["--target-model-dir", str(target_model_dir)]
    with open(log_path, "a", encoding="utf-8") as log_file:
        log_file.write(f"\n$ {' '.join(command)}\n")
        log_file.flush()
        code = subprocess.call(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if code != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise ServerError(f"llama.cpp's convert_hf_to_gguf.py refused {model_dir} (exit {code}); "
                          f"log {log_path}:\n{tail}")
    tmp.replace(out)
    return out


def converted_drafter(drafter_dir: Path, target_dir: Path, cache: Path, *, build_dir: Path,
                      outtype: str = "f32") -> Path:
    """The drafter as GGUF, cached by its weights' sha256 and the output type."""
    key = file_sha256(drafter_dir / "model.safetensors")[:16]
    return convert(drafter_dir, cache / f"drafter-{key}-{outtype}.gguf", build_dir=build_dir, outtype=outtype,
                   log_path=cache / "convert.log", target_model_dir=target_dir)


DEFAULT_SPEC_TYPE = "draft-dflash"
"""``--spec-type`` of a DFlash drafter; the caller passes its drafter's variant's
(``Variant.llama_cpp_spec_type``: this layer does not read the variant registry)."""


def server_command(binary: Path, model: Path, *, port: int, draft: Path | None, draft_n_max: int,
                   threads: int, ctx_size: int, spec_type: str = DEFAULT_SPEC_TYPE) -> list[str]:
    """``llama-server`` on 127.0.0.1; with ``draft``, speculative decoding of type ``spec_type``."""
    command = [str(binary), "-m", str(model), "--host", HOST, "--port", str(port), "-t", str(threads),
               "-tb", str(threads), "-c", str(ctx_size), "-np", "1", "--no-webui", "--seed", "0"]
    if draft is not None:
        command += ["-md", str(draft), "--spec-type", spec_type, "--spec-draft-n-max", str(draft_n_max),
                    "-td", str(threads), "-tbd", str(threads)]
    return command


@dataclass(kw_only=True, frozen=True)
class LlamaCompletion:
    """One greedy completion from ``/completion`` at batch size 1."""

    token_ids: list[int]
    text: str
    decode_ms: float
    """The server's own decode time (prefill excluded)."""
    decode_tokens: int
    draft_n: int
    """Tokens the drafter proposed (0 without a drafter)."""
    draft_accepted: int
    wall_s: float
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per generated token, the target's top candidates as (id, log-probability), when asked."""

    @property
    def tokens_per_s(self) -> float | None:
        """Decode tokens per second by the server's clock."""
        return self.decode_tokens / (self.decode_ms / 1000.0) if self.decode_ms > 0 else None


def complete(client: httpx.Client, url: str, prompt_ids: list[int], *, max_tokens: int,
             n_probs: int = 0) -> LlamaCompletion:
    """One greedy completion of ``prompt_ids``; ``n_probs`` > 0 also returns the top candidates."""
    payload: dict[str, Any] = {"prompt": prompt_ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                               "seed": 0, "cache_prompt": False, "return_tokens": True, "n_probs": n_probs}
    started = time.perf_counter()
    response = client.post(url + "/completion", json=payload)
    wall = time.perf_counter() - started
    if response.status_code != 200:
        raise ServerError(f"POST /completion: HTTP {response.status_code}: {response.text[:500]}")
    body = response.json()
    timings = body.get("timings") or {}
    top = None
    if n_probs:
        top = [[(int(c["id"]), float(c["logprob"])) for c in entry.get("top_logprobs", [])]
               for entry in body.get("completion_probabilities", [])]
    return LlamaCompletion(token_ids=[int(t) for t in body.get("tokens", [])], text=body.get("content", ""),
                           decode_ms=float(timings.get("predicted_ms", 0.0)),
                           decode_tokens=int(timings.get("predicted_n", 0)),
                           draft_n=int(timings.get("draft_n", 0)),
                           draft_accepted=int(timings.get("draft_n_accepted", 0)),
                           wall_s=wall, top_logprobs=top)

