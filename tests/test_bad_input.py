"""Bad input and faults through the real command line: one clear line, the documented exit code,
no traceback, and nothing lost silently.

Each case of :data:`CASES` builds real files, runs ``dflash-trainer`` in-process and checks the
exit code and the first line of the message; docs/errors.md lists the same table.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_e2e import JsonHandler, make_chat_jsonl, make_tiny_target, serving
from transformers import AutoConfig

from dflash_trainer.training.checkpoint import Checkpointer, SaveRequest, resolve_resume
from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import ModelConfig
from dflash_trainer.data.formats import Location, normalize_record
from dflash_trainer.data.regen_backends import SamplingParams
from dflash_trainer.data.regenerate import OpenAIBackend, regenerate
from dflash_trainer.core.fsutil import disk_error
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.training.export import export_drafter
from conftest import with_guard


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("bad-input") / "target", layers=3)


def chat(i: int, words: int = 30) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"question {i}"},
                         {"role": "assistant", "content": " ".join(["answer"] * words)}]}


def jsonl(records: list[Any]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def data_args(target: Path, tmp: Path, data: Path | str | list[Path], *extra: str) -> list[str]:
    paths = data if isinstance(data, list) else [data]
    return [*(a for p in paths for a in ("--data", str(p))), f"model.target={target}",
            f"data.cache_dir={tmp / 'cache'}",
            "data.max_length=256", "pipeline.tokens_per_batch=512", "data.heldout_samples=0",
            "data.min_supervised_tokens=4", *extra]


def train_args(target: Path, tmp: Path, data: Path, *extra: str) -> list[str]:
    return ["train", *data_args(target, tmp, data), f"run_dir={tmp / 'run'}",
            "model.target_layer_ids=[0,1]", "training.max_steps=1", "pipeline.num_threads=1",
            "logging.console=false", "logging.tensorboard=false", "training.num_anchors=4",
            "eval.final=false", *extra]


def checkpoint(tmp: Path, target: Path) -> Path:
    """A real checkpoint folder (manifest, state, exported drafter) of a tiny drafter."""
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[0, 1]),
                            AutoConfig.from_pretrained(target), mask_token_id=16)
    Checkpointer(tmp / "run" / "checkpoints", keep_last=2, async_save=False).save(SaveRequest(
        step=2, state={"step": 2},
        export=lambda folder: export_drafter(drafter, folder, dtype=torch.float32)))
    return tmp / "run" / "checkpoints" / "step-2"


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-8:] = b"\x7f" * 8
    path.write_bytes(bytes(data))


@dataclass(frozen=True)
class Case:
    name: str
    argv: Callable[[Path, Path], list[str]]
    """(target, tmp folder) -> command line; writes the files it needs into the tmp folder."""
    code: int
    message: str
    """A regex the first stderr line of the error matches."""


def _write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def _small_file(t: Path, d: Path) -> list[str]:
    data = make_chat_jsonl(d / "small.jsonl", num=40)
    return ["prepare", *data_args(t, d, data, "data.heldout_samples=64")]


def _all_invalid_skip(t: Path, d: Path) -> list[str]:
    data = _write(d / "bad.jsonl", b"{not json\n[1, 2]\n")
    return ["prepare", *data_args(t, d, data, "data.on_error=skip")]


def _bom_json_array_skip(t: Path, d: Path) -> list[str]:
    data = _write(d / "bom.json", b"\xef\xbb\xbf" + json.dumps([chat(i) for i in range(3)]).encode())
    return ["prepare", *data_args(t, d, data, "data.on_error=skip")]


def _edited_drafter(t: Path, d: Path) -> list[str]:
    folder = checkpoint(d, t) / "drafter"
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    return ["eval", "--drafter", str(folder), f"model.target={t}", "eval.num_prompts=1",
            f"run_dir={d / 'run'}"]


def _drafter_for_another_target(t: Path, d: Path) -> list[str]:
    folder = checkpoint(d, t) / "drafter"
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 7]  # same weight shapes, a layer this target lacks
    (folder / "config.json").write_text(json.dumps(config))
    return ["eval", "--drafter", str(folder), f"model.target={t}", "eval.num_prompts=1",
            f"run_dir={d / 'run'}"]


def _eval(*extra: str, prompts: bytes | None = None) -> Callable[[Path, Path], list[str]]:
    """``eval`` of a drafter folder that does not exist: the prompts are read first."""
    def argv(t: Path, d: Path) -> list[str]:
        source = [f"eval.prompts={_write(d / 'prompts.jsonl', prompts)}"] if prompts is not None else []
        return ["eval", "--drafter", str(d / "no-drafter"), f"model.target={t}", f"run_dir={d / 'run'}",
                *source, *extra]
    return argv


def _corrupt_export(t: Path, d: Path) -> list[str]:
    ckpt = checkpoint(d, t)
    flip_bytes(ckpt / "drafter" / "model.safetensors")
    return ["export", "--checkpoint", str(ckpt), "--out", str(d / "out")]


def _missing_weights(t: Path, d: Path) -> list[str]:
    ckpt = checkpoint(d, t)
    (ckpt / "drafter" / "model.safetensors").unlink()
    return ["export", "--checkpoint", str(ckpt), "--out", str(d / "out")]


def _corrupt_resume(t: Path, d: Path) -> list[str]:
    data = make_chat_jsonl(d / "chat.jsonl", num=8)
    ckpt = checkpoint(d, t)
    flip_bytes(ckpt / "train" / ".metadata")
    return train_args(t, d, data, f"checkpoint.resume={ckpt}")


def _train(*extra: str, data: bytes | None = None) -> Callable[[Path, Path], list[str]]:
    def argv(t: Path, d: Path) -> list[str]:
        path = (_write(d / "chat.jsonl", data) if data is not None
                else make_chat_jsonl(d / "chat.jsonl", num=8))
        return train_args(t, d, path, *extra)
    return argv


def _prepare(name: str, content: bytes, *extra: str) -> Callable[[Path, Path], list[str]]:
    def argv(t: Path, d: Path) -> list[str]:
        return ["prepare", *data_args(t, d, _write(d / name, content), *extra)]
    return argv




def _named_twice(t: Path, d: Path) -> list[str]:
    (d / "chats").mkdir()
    data = _write(d / "chats" / "a.jsonl", jsonl([chat(i) for i in range(4)]))
    return ["prepare", *data_args(t, d, [data.parent, data])]

# --- library boundaries: builders of broken targets, datasets and exports ----------------------

def _target_copy(t: Path, d: Path, name: str = "target-copy") -> Path:
    import shutil

    return Path(shutil.copytree(t, d / name))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _retokenize(folder: Path, **attributes: str) -> None:
    """Save the tokenizer of ``folder`` again with some attributes (tokens, template) changed."""
    from dflash_trainer.core.assets import load_tokenizer

    tokenizer = load_tokenizer(folder)
    for name, value in attributes.items():
        setattr(tokenizer, name, value)
    tokenizer.save_pretrained(folder)


def _broken_target(damage: Callable[[Path], None], command: str = "train") -> Callable[[Path, Path], list[str]]:
    """``command`` on a copy of the target that ``damage`` broke."""
    def argv(t: Path, d: Path) -> list[str]:
        target = _target_copy(t, d)
        damage(target)
        data = make_chat_jsonl(d / "chat.jsonl", num=8)
        return train_args(target, d, data) if command == "train" else ["prepare", *data_args(target, d, data)]
    return argv


def _signed_drafter(t: Path, d: Path) -> Path:
    """An export of a drafter built with the target's tokenizer (so it records its fingerprint)."""
    from dflash_trainer.core.assets import load_tokenizer

    drafter = build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[0, 1]),
                            AutoConfig.from_pretrained(t), mask_token_id=16, tokenizer=load_tokenizer(t))
    return export_drafter(drafter, d / "export", dtype=torch.float32)


def _wider_vocabulary(t: Path, d: Path) -> Path:
    """The target with 512 more embedding rows (49,664 against 49,152), the same tokenizer."""
    from transformers import LlamaForCausalLM

    from dflash_trainer.core.assets import load_tokenizer

    config = AutoConfig.from_pretrained(t)
    config.vocab_size += 512
    LlamaForCausalLM(config).save_pretrained(d / "wider")
    load_tokenizer(t).save_pretrained(d / "wider")
    return d / "wider"


def _other_template(t: Path, d: Path) -> Path:
    target = _target_copy(t, d, "other-template")
    _retokenize(target, chat_template=_template(target).replace("named SmolLM", "named Smol"))
    return target


def _template(folder: Path) -> str:
    from dflash_trainer.core.assets import load_tokenizer

    return load_tokenizer(folder).chat_template


def _drafter_on(make_target: Callable[[Path, Path], Path], command: str = "eval") -> Callable[[Path, Path], list[str]]:
    """``eval`` (or ``generate``) of a drafter trained for the target on the target ``make_target`` gives."""
    def argv(t: Path, d: Path) -> list[str]:
        drafter = _signed_drafter(t, d)
        extra = ["eval.num_prompts=1", f"run_dir={d / 'run'}"] if command == "eval" else ["--prompt", "hi"]
        return [command, "--drafter", str(drafter), f"model.target={make_target(t, d)}", *extra]
    return argv


def _truncated_export(t: Path, d: Path) -> list[str]:
    drafter = _signed_drafter(t, d)
    _truncate(drafter / "model.safetensors")
    return ["eval", "--drafter", str(drafter), f"model.target={t}", "eval.num_prompts=1", f"run_dir={d / 'run'}"]


def _export_to(out: Callable[[Path, Path], Path], *extra: str) -> Callable[[Path, Path], list[str]]:
    def argv(t: Path, d: Path) -> list[str]:
        return ["export", "--checkpoint", str(checkpoint(d, t)), "--out", str(out(t, d)), *extra]
    return argv


def _existing_file(t: Path, d: Path) -> Path:
    return _write(d / "drafter.bin", b"mine")


def _folder_with_files(t: Path, d: Path) -> Path:
    (d / "mine").mkdir()
    _write(d / "mine" / "notes.txt", b"keep me")
    return d / "mine"


def _damaged_datasets_folder(t: Path, d: Path) -> list[str]:
    folder = d / "ds"
    folder.mkdir()
    _write(folder / "state.json", b'{"_data_files": [{"filename": "data-00000-of-00001.arrow"}')
    _write(folder / "dataset_info.json", b"{}")
    return ["prepare", *data_args(t, d, folder)]


def _resume_on_another_tokenizer(t: Path, d: Path) -> list[str]:
    """A run trained on a target whose tokenizer then changed its pad token (same data tokens)."""
    target = _target_copy(t, d)
    data = make_chat_jsonl(d / "chat.jsonl", num=8)
    assert cli_main(train_args(target, d, data)) == 0
    _retokenize(target, pad_token="<|endoftext|>")
    return train_args(target, d, data, "checkpoint.resume=auto", "training.max_steps=2")


EMPTY_ANSWERS = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " \n "},
                              {"role": "user", "content": "again"}, {"role": "assistant", "content": ""}]}



# --- input kinds: links, loops, FIFOs, devices ----------------------------------------------------

def _data_at(make: Callable[[Path], Path], *extra: str) -> Callable[[Path, Path], list[str]]:
    """``prepare`` of the data path that ``make`` builds in the tmp folder."""
    def argv(t: Path, d: Path) -> list[str]:
        return ["prepare", *data_args(t, d, make(d), *extra)]
    return argv


def _loop(d: Path) -> Path:
    (d / "a.jsonl").symlink_to(d / "b.jsonl")
    (d / "b.jsonl").symlink_to(d / "a.jsonl")
    return d / "a.jsonl"


def _folder_with(extra: Callable[[Path], None]) -> Callable[[Path], Path]:
    """A data folder holding one good file and what ``extra`` adds."""
    def make(d: Path) -> Path:
        folder = d / "data"
        folder.mkdir()
        make_chat_jsonl(folder / "good.jsonl", num=4)
        extra(folder)
        return folder
    return make


def _fifo(d: Path) -> Path:
    import os

    os.mkfifo(d / "pipe.jsonl")
    return d / "pipe.jsonl"


def _fifo_config(t: Path, d: Path) -> list[str]:
    return ["prepare", "--config", str(_fifo(d)), *data_args(t, d, make_chat_jsonl(d / "chat.jsonl", num=4))]


# --- library boundaries, broken on purpose: builders ----------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000
"""A JSON value nested 100,000 levels deep: beyond the decoder's recursion."""


def _yaml_config(text: str) -> Callable[[Path, Path], list[str]]:
    def argv(t: Path, d: Path) -> list[str]:
        config = _write(d / "cfg.yaml", text.encode())
        return ["prepare", "--config", str(config), *data_args(t, d, make_chat_jsonl(d / "chat.jsonl", num=4))]
    return argv


def _garbage_latest(content: bytes) -> Callable[[Path, Path], list[str]]:
    """``--resume auto`` over a checkpoints folder whose only entry is a ``latest`` holding ``content``."""
    def argv(t: Path, d: Path) -> list[str]:
        (d / "run" / "checkpoints").mkdir(parents=True)
        _write(d / "run" / "checkpoints" / "latest", content)
        return train_args(t, d, make_chat_jsonl(d / "chat.jsonl", num=8), "checkpoint.resume=auto")
    return argv


def _narrow_vocabulary(t: Path, d: Path) -> Path:
    """The target with 512 fewer embedding rows (48,640) than its tokenizer has tokens (49,152)."""
    from transformers import LlamaForCausalLM

    from dflash_trainer.core.assets import load_tokenizer

    config = AutoConfig.from_pretrained(t)
    config.vocab_size -= 512
    LlamaForCausalLM(config).save_pretrained(d / "narrow")
    load_tokenizer(t).save_pretrained(d / "narrow")
    return d / "narrow"


def _bert(t: Path, d: Path) -> Path:
    """A tiny BERT (an encoder, BertForMaskedLM) with the target's tokenizer."""
    from transformers import BertConfig, BertForMaskedLM

    from dflash_trainer.core.assets import load_tokenizer

    BertForMaskedLM(BertConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
                               intermediate_size=128)).save_pretrained(d / "bert")
    load_tokenizer(t).save_pretrained(d / "bert")
    return d / "bert"


def _train_on(make_target: Callable[[Path, Path], Path]) -> Callable[[Path, Path], list[str]]:
    def argv(t: Path, d: Path) -> list[str]:
        return train_args(make_target(t, d), d, make_chat_jsonl(d / "chat.jsonl", num=8))
    return argv


def _config_json_list(t: Path, d: Path) -> Path:
    (d / "mine").mkdir()
    _write(d / "mine" / "config.json", b"[1, 2, 3]")
    return d / "mine"


# --- nothing overwritten or resumed silently; one writer per folder: builders -------------------

def _earlier_checkpoints(t: Path, d: Path) -> list[str]:
    """A run folder with an earlier run's step-2 and step-4 but no ``latest`` pointer."""
    ck = Checkpointer(d / "run" / "checkpoints", keep_last=5, async_save=False)
    for step in (2, 4):
        ck.save(SaveRequest(step=step, state={"step": step}, export=None))
    ck.close()
    (d / "run" / "checkpoints" / "latest").unlink()
    return train_args(t, d, make_chat_jsonl(d / "chat.jsonl", num=8))


def _damaged_checkpoints_only(t: Path, d: Path) -> list[str]:
    flip_bytes(checkpoint(d, t) / "train" / ".metadata")
    return train_args(t, d, make_chat_jsonl(d / "chat.jsonl", num=8), "checkpoint.resume=auto")


def _data_edited_in_place(t: Path, d: Path) -> list[str]:
    """A real one-step run, then its data file rewritten with more records (same path)."""
    data = make_chat_jsonl(d / "chat.jsonl", num=8)
    assert cli_main(train_args(t, d, data)) == 0
    make_chat_jsonl(data, num=12, seed=1)
    return train_args(t, d, data, "checkpoint.resume=auto")


def edit_one_byte_keeping_size_and_mtime(path: Path) -> None:
    """Change one letter of the first answer in place (same inode and size), then put the old
    mtime back, as ``cp -p``, ``rsync -t`` or a restored backup do."""
    import os

    stat = path.stat()
    data = path.read_bytes()
    at = data.index(b"answer") if b"answer" in data else data.rindex(b'"') - 1
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"A" if data[at:at + 1] != b"A" else b"B")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)


def _one_byte_edited_in_place(t: Path, d: Path) -> list[str]:
    """A real one-step run, then one byte of its data changed with size and mtime kept."""
    data = _write(d / "chat.jsonl", jsonl([chat(i) for i in range(8)]))
    assert cli_main(train_args(t, d, data)) == 0
    edit_one_byte_keeping_size_and_mtime(data)
    return train_args(t, d, data, "checkpoint.resume=auto")


def _run_dir_in_use(t: Path, d: Path) -> list[str]:
    """The run folder locked by another process (it lets go after 30 s)."""
    import os
    import subprocess
    import sys

    ready = d / "held"
    script = ("import sys, time; from pathlib import Path; from dflash_trainer.core.locks import "
              "run_folder_lock; run_folder_lock(sys.argv[1]).acquire(); "
              "Path(sys.argv[2]).write_text('held'); time.sleep(30)")
    src = str(Path(__file__).resolve().parents[1] / "src")
    subprocess.Popen([sys.executable, "-c", script, str(d / "run"), str(ready)],
                     env={**os.environ, "PYTHONPATH": with_guard(src)})
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline, "the lock holder did not start"
        time.sleep(0.05)
    return train_args(t, d, make_chat_jsonl(d / "chat.jsonl", num=8))


def _a_file_at(name: str, command: str) -> Callable[[Path, Path], list[str]]:
    """``command`` whose run folder or cache folder (``name``) is an existing file."""
    def argv(t: Path, d: Path) -> list[str]:
        (d / name).write_text("not a folder")
        data = make_chat_jsonl(d / "chat.jsonl", num=8)
        return train_args(t, d, data) if command == "train" else ["prepare", *data_args(t, d, data)]
    return argv


# --- sharded checkpoints (DCP): builders ----------------------------------------------------------

def _sharded_resume(damage: Callable[[Path], None] | None, *extra: str) -> Callable[[Path, Path], list[str]]:
    """A real one-step run (its step-1 checkpoint: DCP shards in train/), damaged by ``damage``,
    then resumed from step-1 with ``extra``."""
    def argv(t: Path, d: Path) -> list[str]:
        data = make_chat_jsonl(d / "chat.jsonl", num=8)
        assert cli_main(train_args(t, d, data, "model.num_layers=1")) == 0
        ckpt = d / "run" / "checkpoints" / "step-1"
        if damage is not None:
            damage(ckpt)
        return train_args(t, d, data, "model.num_layers=1", f"checkpoint.resume={ckpt}", *extra)
    return argv


def _flip_shard(ckpt: Path) -> None:
    flip_bytes(ckpt / "train" / "__0_0.distcp")


def _remove_shard(ckpt: Path) -> None:
    (ckpt / "train" / "__0_0.distcp").unlink()


def _remove_rank_file(ckpt: Path) -> None:
    """As if written by 2 ranks (the manifest lists rank 1's shard), with rank 1's shard lost."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["train/__1_0.distcp"] = {"size": 1, "sha256": "0" * 64}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


CASES = [
    Case("file smaller than the held-out split", _small_file, 1,
         r"data error: data.heldout_samples=64 would hold out 40 of the 40 records"),
    Case("empty .jsonl file", _prepare("empty.jsonl", b""), 1,
         r"data error: data file '.*empty.jsonl' is empty \(no records\)"),
    Case("empty .json file", _prepare("empty.json", b"  \n"), 1,
         r"data error: data file '.*empty.json' is empty \(no records\)"),
    Case("every record invalid under skip", _all_invalid_skip, 1,
         r"data error: no training samples: counts: 2 records read .*\(malformed 2\)"),
    Case("every sample too long (drop)", _prepare("long.jsonl", jsonl([chat(0, 400)]),
                                                  "data.on_too_long=drop"), 1,
         r"data error: no training samples: .*too long 1"),
    Case("bad JSON line", _prepare("badline.jsonl", jsonl([chat(0)]) + b"{oops\n"), 1,
         r"data error: .*badline.jsonl:2 \(record 1\): invalid JSON"),
    Case("invalid UTF-8 byte", _prepare("latin1.jsonl", jsonl([chat(0)]).replace(b"question",
                                                                                 b"qu\xe9stion")),
         1, r"data error: .*latin1.jsonl:1 \(record 0\): invalid UTF-8 byte 0xe9"),
    Case("a record of no known layout", _prepare("text.jsonl", jsonl([{"text": "a plain text record"}])), 1,
         r"data error: .*text.jsonl:1 \(record 0\): record matches no layout: it has none of the fields "
         r"'messages' \(OpenAI\), .*; keys: \['text'\]; map its fields with data.fields"),
    Case("the same file named twice", _named_twice, 2,
         r"config error: data.paths entries '.*chats' and '.*chats/a.jsonl' both reach the file "
         r"'.*chats/a.jsonl'; its records would be trained on twice: name each file once"),
    Case("missing data path", lambda t, d: ["prepare", *data_args(t, d, d / "missing.jsonl")], 1,
         r"data error: data.paths entry '.*missing.jsonl': no such file or folder"),
    Case("--config is a folder", lambda t, d: ["prepare", "--config", str(d)], 2,
         r"config error: --config '.*' is a folder; give a YAML file"),
    Case("data.max_length above the target's context",
         _prepare("ok.jsonl", jsonl([chat(0)]), "data.max_length=4096",
                  "pipeline.tokens_per_batch=4096"), 2,
         r"config error: data.max_length=4096 is longer than the target's context of 2048"),
    Case("train: bad JSON line", _train(data=jsonl([chat(0)]) + b"{oops\n"), 1,
         r"data error: .*chat.jsonl:2 \(record 1\): invalid JSON"),
    Case("train: missing data path", lambda t, d: train_args(t, d, d / "nope.jsonl"), 1,
         r"data error: data.paths entry '.*nope.jsonl': no such file or folder"),
    Case("train: data.paths is empty", lambda t, d: ["train", f"model.target={t}", "data.paths=[]",
                                                    f"run_dir={d / 'run'}"], 2,
         r"config error: data.paths is empty; give data files or folders \(data.paths or --data\), or `sharegpt`$"),
    Case("train: no sample left", _train("data.min_supervised_tokens=64",
                                         data=jsonl([chat(0, 1)])), 1,
         r"data error: no training samples: .*too short \(supervised\) 1"),
    Case("train: target layer out of range", _train("model.target_layer_ids=[0,7]"), 2,
         r"config error: model.target_layer_ids \[7\] out of range for a target with 3 layers"),
    Case("train: target's last layer", _train("model.target_layer_ids=[2]"), 2,
         r"config error: model.target_layer_ids .*2 is the target's last layer|contains 2, the target's last layer"),
    Case("train: a target layer named twice", _train("model.target_layer_ids=[0,0]"), 2,
         r"config error: model.target_layer_ids=\[0, 0\] names 0 more than once; name each once$"),
    Case("train: a negative target layer", _train("model.target_layer_ids=[0,-1]"), 2,
         r"config error: model.target_layer_ids\[1\] must be in \[0, 4095\], got -1$"),
    Case("train: a bucket boundary named twice", _train("pipeline.bucket_boundaries=[64,64,256]"), 2,
         r"config error: pipeline.bucket_boundaries=\[64, 64, 256\] names 64 more than once; name each once$"),
    Case("train: mask id out of range", _train("model.mask_token_id=999999"), 2,
         r"config error: model.mask_token_id=999999 cannot be used: it is outside"),
    Case("train: missing target", _train("model.target=/nonexistent/target"), 1,
         r"target error: .*/nonexistent/target"),
    Case("train: corrupted checkpoint to resume", _corrupt_resume, 2,
         r"checkpoint error: checkpoint.resume=.*step-2: train/.metadata does not match its checksum"),
    Case("export: corrupted weights", _corrupt_export, 1,
         r"checkpoint error: .*step-2: drafter/model.safetensors does not match its checksum"),
    Case("export: weights missing", _missing_weights, 1,
         r"checkpoint error: .*step-2: drafter/model.safetensors is missing or truncated"),
    Case("export: not a checkpoint", lambda t, d: ["export", "--checkpoint", str(d), "--out",
                                                   str(d / "out")], 1,
         r"checkpoint error: .*: neither a training checkpoint \(no manifest.json\) nor an "
         r"exported drafter"),
    Case("eval: drafter with an edited config.json", _edited_drafter, 1,
         r"checkpoint error: .*drafter: config.json does not match model.safetensors"),
    Case("eval: drafter for another target", _drafter_for_another_target, 1,
         r"checkpoint error: --drafter .*drafter does not fit the target .*: drafter/target mismatch: "
         r"model.target_layer_ids \[7\] out of range"),
    Case("eval: not a drafter folder", _eval("eval.num_prompts=1"), 1,
         r"checkpoint error: --drafter .*no-drafter: no config.json there"),
    Case("eval: bad JSON line in the prompts", _eval(prompts=b'{"prompt": "hi"}\n{oops\n'), 1,
         r"data error: .*prompts.jsonl:2: not valid JSON"),
    Case("eval: unknown prompt source", _eval("eval.prompts=nope"), 2,
         r"config error: eval.prompts='nope': not a prompt set \(mtbench, humaneval, math, sharegpt-heldout\) or "
         r"an existing JSONL file"),
    Case("regenerate: bad option", lambda t, d: ["regenerate", "--out", str(d / "o.jsonl"),
                                                 "--backend", "openai"], 2,
         r"config error: --backend openai needs --server-url"),
    # --- input kinds: every path a command reads is checked before it is opened ---
    Case("prepare: a symlink loop as the data path", _data_at(_loop), 1,
         r"data error: data.paths entry '.*a.jsonl': .*a.jsonl is a symlink loop \(.*a.jsonl -> .*b.jsonl -> "
         r".*a.jsonl\); point the link at a real file or folder$"),
    Case("prepare: a looping link inside a data folder",
         _data_at(_folder_with(lambda f: (f / "loop").symlink_to(f / "loop"))), 1,
         r"data error: data folder '.*data': .*data/loop is a symlink loop \(.*data/loop -> .*data/loop\)"),
    Case("prepare: a link to a folder above it inside a data folder",
         _data_at(_folder_with(lambda f: (f / "up").symlink_to(f))), 1,
         r"data error: data folder '.*data': .*data/up is a symlink loop \(it leads back to .*data, a folder "
         r"above it\); remove the link$"),
    Case("prepare: a dangling link named like data inside a data folder",
         _data_at(_folder_with(lambda f: (f / "gone.jsonl").symlink_to(f / "moved.jsonl"))), 1,
         r"data error: data folder '.*data': .*gone.jsonl is a dangling symlink \(to .*moved.jsonl, which does "
         r"not exist\)"),
    Case("prepare: a FIFO as the data file (no hang)", _data_at(_fifo), 1,
         r"data error: data.paths entry '.*pipe.jsonl': .*pipe.jsonl is not a regular file \(a FIFO\); reading "
         r"it would block or never end: give a regular file or a folder$"),
    Case("prepare: a FIFO inside a data folder", _data_at(_folder_with(lambda f: _fifo(f) and None)), 1,
         r"data error: data folder '.*data': .*data/pipe.jsonl is not a regular file \(a FIFO\)"),
    Case("prepare: a device as the data file", _data_at(lambda d: Path("/dev/zero")), 1,
         r"data error: data.paths entry '/dev/zero': /dev/zero is not a regular file \(a character device\)"),
    Case("prepare: a FIFO as the target", lambda t, d: ["prepare", *data_args(_fifo(d), d, make_chat_jsonl(
        d / "chat.jsonl", num=4))], 1,
         r"target error: target '.*pipe.jsonl': .*pipe.jsonl is not a regular file \(a FIFO\)"),
    Case("eval: a symlink loop as --drafter", lambda t, d: ["eval", "--drafter", str(_loop(d)), f"model.target={t}",
                                                            "eval.num_prompts=1", f"run_dir={d / 'run'}"], 1,
         r"checkpoint error: --drafter: .*a.jsonl is a symlink loop"),
    Case("export: a file as --checkpoint",
         lambda t, d: ["export", "--checkpoint", str(_write(d / "step-2", b"x")), "--out", str(d / "out")], 1,
         r"checkpoint error: --checkpoint: .*step-2 is a file, not a folder; give a folder$"),
    Case("prepare: a FIFO as --config", _fifo_config, 2,
         r"config error: --config: .*pipe.jsonl is not a regular file \(a FIFO\)"),
    Case("eval: a FIFO as the prompts file",
         lambda t, d: _eval(f"eval.prompts={_fifo(d)}")(t, d), 1,
         r"data error: eval.prompts: .*pipe.jsonl is not a regular file \(a FIFO\)"),
    # --- library boundaries broken on purpose: JSON, YAML, pointers, targets, output paths ---
    Case("prepare: a JSON line nested 100,000 levels deep", _prepare("deep.jsonl", jsonl([chat(0)]) + DEEP + b"\n"),
         1, r"data error: .*deep.jsonl:2 \(record 1\): invalid JSON: nested too deeply for the JSON decoder"),
    Case("prepare: a JSON array element nested 100,000 levels deep",
         _prepare("deep.json", b"[" + json.dumps(chat(0)).encode() + b", " + DEEP + b"]"), 1,
         r"data error: .*deep.json:1 \(record 1\): invalid JSON: nested too deeply .*; the rest of the file is "
         r"unreadable"),
    Case("eval: a prompt nested 100,000 levels deep", _eval(prompts=b'{"prompt": "hi"}\n' + DEEP + b"\n"), 1,
         r"data error: .*prompts.jsonl:2: not valid JSON \(nested too deeply for the JSON decoder\)$"),
    Case("prepare: --config with two training sections",
         _yaml_config("training:\n  lr: 0.001\nmodel:\n  num_layers: 1\ntraining:\n  epochs: 2\n"), 2,
         r"config error: .*cfg.yaml:5:1: key 'training' given twice \(first at line 1\); YAML would keep only the "
         r"last: merge them into one$"),
    Case("prepare: --config with a YAML syntax error", _yaml_config("training:\n  lr: [0.1\nmodel: x\n"), 2,
         r"config error: .*cfg.yaml:3:6: not valid YAML: while parsing a flow sequence expected ',' or ']', "
         r"but got ':'$"),
    Case("train: a latest pointer of binary garbage", _garbage_latest(b"\xff\xfe\x00garbage\x80"), 2,
         r"checkpoint error: checkpoint.resume=auto: no complete checkpoint in .*checkpoints, but it holds "
         r"latest \(damaged or partial"),
    Case("train: a latest pointer naming a path outside", _garbage_latest(b"../../../etc\n"), 2,
         r"checkpoint error: checkpoint.resume=auto: no complete checkpoint in .*checkpoints, but it holds latest"),
    Case("train: a target whose embedding is smaller than its tokenizer", _train_on(_narrow_vocabulary), 1,
         r"target error: target .*narrow: its embedding has 48640 rows, but its tokenizer has 49152 tokens \(ids up "
         r"to 49151\); the weights and the tokenizer come from different models"),
    Case("train: a BERT folder as target", _train_on(_bert), 1,
         r"target error: target .*bert: not a decoder-only causal LM \(bert, architectures BertForMaskedLM\); "
         r"DFlash drafts for a decoder-only causal LM"),
    Case("eval: --out is an existing file",
         lambda t, d: _eval("--out", str(_write(d / "results.txt", b"mine")))(t, d), 2,
         r"config error: --out .*results.txt is an existing file; give the path of a folder"),
    Case("export: --out holds a config.json that is a JSON list", _export_to(_config_json_list), 2,
         r"config error: --out .*mine is a folder that holds other files \(config.json\), not a drafter export"),
    # --- option ranges and CLI flags ---
    Case("train: training.lr=inf", _train("training.lr=inf"), 2,
         r"config error: training.lr must be in \(0, 1\], got inf$"),
    Case("train: training.max_steps=0", _train("training.max_steps=0"), 2,
         r"config error: training.max_steps must be in \[1, 1_000_000_000\], or none for no limit "
         r"\(training.epochs decides\), got 0$"),
    Case("train: AdamW betas out of range", _train("training.betas=[1.5, 0.9]"), 2,
         r"config error: training.betas\[0\] must be in \[0, 1\), got 1.5$"),
    Case("generate: --max-new-tokens 0",
         lambda t, d: ["generate", "--drafter", str(d / "no-drafter"), f"model.target={t}", "--prompt", "hi",
                       "--max-new-tokens", "0"], 2,
         r"config error: --max-new-tokens must be in \[1, 1_048_576\], got 0$"),
    Case("generate: whitespace-only --prompt",
         lambda t, d: ["generate", "--drafter", str(d / "no-drafter"), f"model.target={t}", "--prompt", "  "], 2,
         r"config error: --prompt must not be empty or only whitespace, got '  '$"),
    Case("regenerate: --top-p out of range",
         lambda t, d: ["regenerate", "--out", str(d / "o.jsonl"), "--top-p", "1.5"], 2,
         r"config error: --top-p must be in \(0, 1\], got 1.5$"),
    Case("regenerate: --concurrency not a number",
         lambda t, d: ["regenerate", "--out", str(d / "o.jsonl"), "--concurrency", "many"], 2,
         r"config error: --concurrency must be an integer in \[1, 1024\], got 'many'$"),
    # --- library boundaries: targets, datasets, checkpoints, exports, drafter/target agreement ---
    Case("train: target folder without weights",
         _broken_target(lambda target: (target / "model.safetensors").unlink()), 1,
         r"target error: target .*target-copy: no model weights in the folder \(model.safetensors, "
         r"pytorch_model.bin or a sharded index; it holds .*config.json"),
    Case("train: truncated target weights",
         _broken_target(lambda target: _truncate(target / "model.safetensors")), 1,
         r"target error: target .*target-copy: the model does not load \(SafetensorError: .*incomplete "
         r"metadata.*\); its weights are truncated, damaged"),
    Case("prepare: target config.json not JSON",
         _broken_target(lambda target: _write(target / "config.json", b'{"model_type": '), "prepare"), 1,
         r"target error: target '.*target-copy': .*config.json is not valid JSON \(Expecting value"),
    Case("prepare: damaged target tokenizer",
         _broken_target(lambda target: _write(target / "tokenizer.json", b'{"model": {'), "prepare"), 1,
         r"target error: the tokenizer of .*target-copy does not load \(.*\); the folder needs tokenizer.json"),
    Case("prepare: damaged GGUF target",
         lambda t, d: ["prepare", *data_args(_write(d / "broken.gguf", b"GGUF" + bytes(64)), d,
                                             make_chat_jsonl(d / "chat.jsonl", num=4))], 1,
         r"target error: .*broken.gguf: not a readable GGUF file \(.*\); the file is damaged or truncated"),
    Case("prepare: datasets folder with a damaged state.json", _damaged_datasets_folder, 1,
         r"data error: .*ds/state.json: not readable JSON \(.*\); the datasets folder is damaged"),
    Case("prepare: one pretty-printed JSON object", _prepare("one.json", json.dumps(chat(0), indent=2).encode()),
         1, r"data error: .*one.json:1: not a JSON array, and its first line is not a complete JSON object "
            r".*accepted layouts: JSON Lines \(one JSON object per line\), a JSON array of objects"),
    Case("prepare: every assistant answer empty", _prepare("empty.jsonl", jsonl([EMPTY_ANSWERS])), 1,
         r"data error: no training samples: counts: 1 records read \(\+0 held out\), 0 kept, 1 dropped "
         r"\(empty answers 1\)"),
    Case("train: drafter heads do not divide the KV heads", _train("model.num_attention_heads=3"), 2,
         r"config error: the drafter's 3 attention heads \(model.num_attention_heads\) are not a multiple "
         r"of its 2 key/value heads \(model.num_key_value_heads, from the target\)"),
    Case("export: --out is an existing file", _export_to(_existing_file), 2,
         r"config error: --out .*drafter.bin is an existing file, not a folder"),
    Case("export: --out is a folder with other files", _export_to(_folder_with_files), 2,
         r"config error: --out .*mine is a folder that holds other files \(notes.txt\), not a drafter export"),
    Case("export: --out holds an earlier export", _export_to(lambda t, d: _signed_drafter(t, d)), 2,
         r"config error: --out .*export holds a drafter export already; pass --overwrite to replace it"),
    Case("eval: truncated drafter weights", _truncated_export, 1,
         r"checkpoint error: .*export/model.safetensors is not a readable safetensors file \(.*incomplete "
         r"metadata"),
    Case("eval: drafter for another vocabulary", _drafter_on(_wider_vocabulary), 1,
         r"checkpoint error: --drafter .*export does not fit the target .*wider: drafter/target mismatch: "
         r"vocabulary: the drafter was trained for 49152 tokens, the target has 49664"),
    Case("generate: drafter for another vocabulary", _drafter_on(_wider_vocabulary, "generate"), 1,
         r"checkpoint error: --drafter .*export does not fit the target .*wider: drafter/target mismatch: "
         r"vocabulary: the drafter was trained for 49152 tokens"),
    Case("eval: drafter for another chat template", _drafter_on(_other_template), 1,
         r"checkpoint error: --drafter .*export does not fit the target .*other-template: drafter/target "
         r"mismatch: tokenizer: the chat template differs"),
    Case("train: resume on a target whose tokenizer changed", _resume_on_another_tokenizer, 2,
         r"checkpoint error: checkpoint.resume=.*step-1 does not fit the target .*target-copy: drafter/target "
         r"mismatch: tokenizer: pad_token_id 2 \(drafter's target\) vs 0 \(this target\); resume with the "
         r"target it was trained on"),
    # --- nothing overwritten or resumed silently; one writer per folder; disk errors ---
    Case("train: fresh run over an earlier run's checkpoints", _earlier_checkpoints, 2,
         r"checkpoint error: run folder .*run holds an earlier run \(checkpoints step-2, step-4\); "
         r"continue it with --resume auto \(checkpoint.resume=auto\), start over with --overwrite"),
    Case("train: --overwrite with --resume", lambda t, d: [
        "train", "--overwrite", *train_args(t, d, make_chat_jsonl(d / "chat.jsonl", num=8))[1:],
        "checkpoint.resume=auto"], 2,
         r"config error: --overwrite starts the run in .*run over; it cannot be combined with "
         r"checkpoint.resume=auto"),
    Case("train: resume=auto over damaged checkpoints only", _damaged_checkpoints_only, 2,
         r"checkpoint error: checkpoint.resume=auto: no complete checkpoint in .*checkpoints, but it "
         r"holds step-2, latest \(damaged or partial"),
    Case("train: resume after the data file was edited in place", _data_edited_in_place, 2,
         r"checkpoint error: cannot resume from .*step-1: the training data changed since the "
         r"checkpoint: its token store held 8 samples with content sha256 [0-9a-f]{16} .*, the data "
         r"now gives 12 samples"),
    Case("train: resume after a one-byte edit that kept size and mtime", _one_byte_edited_in_place, 2,
         r"checkpoint error: cannot resume from .*step-1: the training data changed since the "
         r"checkpoint: its token store held 8 samples with content sha256 [0-9a-f]{16} .*, the data "
         r"now gives 8 samples"),
    Case("train: run folder in use by another process", _run_dir_in_use, 1,
         r"lock error: run folder .*run is in use by pid \d+ on .*; wait for it to finish or stop "
         r"it, or choose another run_dir"),
    Case("train: run_dir is a file", _a_file_at("run", "train"), 1,
         r"disk error: cannot write .*run: it is a file, not a folder; choose another run_dir"),
    Case("prepare: data.cache_dir is a file", _a_file_at("cache", "prepare"), 1,
         r"disk error: cannot write .*cache: it is a file, not a folder; choose another "
         r"data.cache_dir"),
    # --- DFlash2 ---
    Case("train: a DFlash2 option with model.variant dflash", _train("model.selector_rank=64"), 2,
         r"config error: model.selector_rank is a DFlash2 option, but model.variant is dflash; set "
         r"model.variant=dflash2 or remove it$"),
    Case("train: selector rank out of range", _train("model.variant=dflash2", "model.selector_rank=0"), 2,
         r"config error: model.selector_rank must be in \[1, 8192\], or none for 256 \(model.variant: "
         r"dflash2 only\), got 0$"),
    Case("train: selector top-k out of range", _train("model.variant=dflash2", "model.selector_top_k=5000"), 2,
         r"config error: model.selector_top_k must be in \[1, 1024\], or none for 16 .*got 5000$"),
    Case("train: conv group size does not divide the hidden size",
         _train("model.variant=dflash2", "model.conv_group_size=24"), 2,
         r"config error: model.conv_group_size=24 does not divide the target's hidden size 64; choose a "
         r"divisor of it"),
    Case("train: a DFlash2 export to warm-start a DFlash drafter",
         lambda t, d: _train("model.init_from=" + str(export_drafter(build_drafter(
             ModelConfig(num_layers=1, block_size=4, target_layer_ids=[0, 1], variant="dflash2", selector_rank=4),
             AutoConfig.from_pretrained(t), mask_token_id=16), d / "dflash2-export")))(t, d), 1,
         r"checkpoint error: .*dflash2-export holds a DFlash2 drafter \(architectures DFlash2DraftModel\), but a "
         r"DFlash one \(DFlashDraftModel\) is expected here; warm-start it with model.variant=dflash2"),
    Case("train: resume a DFlash run's checkpoint as DFlash2",
         lambda t, d: cli_main(train_args(t, d, make_chat_jsonl(d / "chat.jsonl", num=8))) == 0 and train_args(
             t, d, d / "chat.jsonl", "checkpoint.resume=auto", "training.max_steps=2", "model.variant=dflash2"), 2,
         r"checkpoint error: cannot resume: model.variant was 'dflash' in the checkpoint and is 'dflash2' now; "
         r"resume with the checkpoint's config.yaml"),
    # --- eval suite (domains): `eval --suite` of a missing drafter folder (the domains are read first) ---
    Case("eval --suite: unknown domain",
         lambda t, d: ["eval", "--suite", "--drafter", str(d / "no-drafter"), f"model.target={t}",
                       f"run_dir={d / 'run'}", "eval.suite=[mtbench,gsm8k]"], 2,
         r"config error: eval.suite: 'gsm8k' is not a prompt set \(mtbench, humaneval, math, sharegpt-heldout\) "
         r"or an existing JSONL file$"),
    Case("eval --suite: a domain named twice",
         lambda t, d: ["eval", "--suite", "--drafter", str(d / "no-drafter"), f"model.target={t}",
                       f"run_dir={d / 'run'}", "eval.suite=[math,math]"], 2,
         r"config error: eval.suite names the domain math twice; name each once$"),
    Case("eval --suite: eval.suite_prompts=0",
         lambda t, d: ["eval", "--suite", "--drafter", str(d / "no-drafter"), f"model.target={t}",
                       f"run_dir={d / 'run'}", "eval.suite_prompts=0"], 2,
         r"config error: eval.suite_prompts must be in \[1, "),
    Case("eval --suite with --prompts",
         lambda t, d: ["eval", "--suite", "--prompts", "humaneval", "--drafter", str(d / "no-drafter"),
                       f"model.target={t}", f"run_dir={d / 'run'}"], 2,
         r"config error: --prompts and --suite exclude each other: --suite evaluates the domains of eval.suite"),
    # --- sharded checkpoints (DCP): validated once by rank 0, one line ---
    Case("train: corrupt checkpoint shard", _sharded_resume(_flip_shard), 2,
         r"checkpoint error: checkpoint.resume=.*step-1: train/__0_0.distcp does not match its "
         r"checksum in manifest.json \(corrupted\); use an earlier checkpoint$"),
    Case("train: missing checkpoint shard", _sharded_resume(_remove_shard), 2,
         r"checkpoint error: checkpoint.resume=.*step-1: train/__0_0.distcp is missing or "
         r"truncated; the checkpoint is damaged, use an earlier one$"),
    Case("train: missing rank file", _sharded_resume(_remove_rank_file), 2,
         r"checkpoint error: checkpoint.resume=.*step-1: train/__1_0.distcp is missing or truncated"),
    Case("train: resume with another model", _sharded_resume(None, "model.num_layers=3"), 2,
         r"checkpoint error: cannot resume: model.num_layers was 1 in the checkpoint and is 3 now; "
         r"resume with the checkpoint's config.yaml$"),
    Case("train: resume with another data order", _sharded_resume(None, "training.seed=7"), 2,
         r"checkpoint error: cannot resume: training.seed was \d+ in the checkpoint and is 7 now"),
    # --- eval --engine: an unknown engine, before any model loads ---
    Case("eval --engine: unknown engine",
         lambda t, d: ["eval", "--suite", "--engine", "sglang", "--drafter", str(d / "no-drafter"),
                       f"model.target={t}", f"run_dir={d / 'run'}"], 2,
         r"config error: --engine must be llama.cpp, vllm or all, got 'sglang'$"),
    Case("eval --engine at temperature > 0",
         lambda t, d: ["eval", "--engine", "llama.cpp", "--drafter", str(d / "no-drafter"), f"model.target={t}",
                       f"run_dir={d / 'run'}", "eval.temperature=0.7"], 2,
         r"config error: --engine compares greedy outputs with and without the drafter; eval.temperature is 0.7, "
         r"set eval.temperature=0$"),
]


SLOW_CASES = {
    "train: resume a DFlash run's checkpoint as DFlash2",
    "train: resume after a one-byte edit that kept size and mtime",
    "train: resume after the data file was edited in place", "train: resume on a target whose tokenizer changed",
    "train: resume with another data order", "train: resume with another model", "train: missing checkpoint shard",
    "train: missing rank file", "train: corrupt checkpoint shard", "train: bad JSON line",
    "train: a target whose embedding is smaller than its tokenizer", "train: target's last layer",
    "eval: drafter for another vocabulary", "eval: drafter for another chat template",
    "eval: drafter for another target",
    "generate: drafter for another vocabulary", "prepare: a JSON array element nested 100,000 levels deep",
    "prepare: a JSON line nested 100,000 levels deep", "prepare: every assistant answer empty",
    "empty .json file", "empty .jsonl file", "a record of no known layout", "every sample too long (drop)",
    "train: missing data path", "train: mask id out of range", "train: a BERT folder as target",
    "train: drafter heads do not divide the KV heads", "train: conv group size does not divide the hidden size",
    "train: no sample left", "train: resume=auto over damaged checkpoints only",
    "train: a latest pointer naming a path outside", "train: a latest pointer of binary garbage",
    "train: a DFlash2 export to warm-start a DFlash drafter", "train: target layer out of range",
    "eval: truncated drafter weights", "train: corrupted checkpoint to resume", "prepare: data.cache_dir is a file",
}
"""Cases of over half a second on 2 busy cores (a training run, a target or drafter load, a deep
parse): `make test` runs them, `make test-fast` leaves them out."""
assert SLOW_CASES <= {c.name for c in CASES}, SLOW_CASES - {c.name for c in CASES}


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.name in SLOW_CASES else [])
                                  for c in CASES])
def test_bad_input_gives_one_line_and_its_exit_code(case: Case, target: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    argv = case.argv(target, tmp_path)
    capsys.readouterr()
    code = cli_main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith(f"dflash-trainer {argv[0]}: ")]
    assert len(errors) == 1, err
    assert code == case.code, err
    assert re.search(case.message, errors[0]), errors[0]


def test_debug_shows_the_traceback_of_a_user_error(target: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["prepare", *data_args(target, tmp_path, tmp_path / "missing.jsonl")]
    assert cli_main(["prepare", "--debug", *argv[1:]]) == 1
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("DFLASH_DEBUG", "1")
    assert cli_main(argv) == 1
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.slow
def test_train_prints_the_counts_its_messages_point_to(target: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    data = _write(tmp_path / "chat.jsonl", jsonl([chat(i) for i in range(6)]) + b"{oops\n")
    assert cli_main(train_args(target, tmp_path, data, "data.on_error=skip",
                               "model.target_layer_ids=[9]")) == 2
    err = capsys.readouterr().err
    assert "data: 7 records read (+0 held out), 6 kept, 1 dropped (malformed 1)" in err
    (store,) = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]
    dropped = [json.loads(line) for line in (store / "dropped.jsonl").read_text().splitlines()]
    assert dropped == [{"reason": "malformed",
                        "message": f"{data}:7 (record 6): invalid JSON: Expecting property name "
                                   "enclosed in double quotes (column 2)"}]


# --- data is read, not lost --------------------------------------------------------------------

@pytest.mark.slow
def test_bom_and_invalid_utf8_under_skip_are_read_and_counted(
        target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = [chat(i) for i in range(4)]
    bom = _write(tmp_path / "bom.jsonl", b"\xef\xbb\xbf" + jsonl(good))
    array = _write(tmp_path / "bom.json", b"\xef\xbb\xbf" + json.dumps(good[:3]).encode()[:-1]
                   + b', {"messages": [{"role": "user", "content": "caf\xe9"}]}]')
    latin = _write(tmp_path / "latin1.jsonl", jsonl(good[:2]) + b'{"messages": "\xff"}\n')
    assert cli_main(["prepare", *data_args(target, tmp_path, [bom, array, latin],
                                           "data.on_error=skip")]) == 0
    out = capsys.readouterr().out
    assert f"{bom}: 4 records read\n" in out
    assert f"{array}: 4 records read, 1 malformed" in out
    assert f"{latin}: 3 records read, 1 malformed" in out
    assert "data: 11 records read (+0 held out), 9 kept, 2 dropped (malformed 2)" in out


@pytest.mark.slow
def test_a_data_path_with_a_comma_is_one_path(target: Path, tmp_path: Path) -> None:
    data = make_chat_jsonl(tmp_path / "a,b.jsonl", num=4)
    assert cli_main(["prepare", *data_args(target, tmp_path, data)]) == 0


def test_a_file_whose_records_all_drop_is_an_error_even_beside_good_ones(
        target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = make_chat_jsonl(tmp_path / "good.jsonl", num=4)
    bad = _write(tmp_path / "short.jsonl", jsonl([chat(0, 1), chat(1, 1)]))
    assert cli_main(["prepare", *data_args(target, tmp_path, [good, bad],
                                           "data.min_supervised_tokens=8")]) == 1
    assert f"data file '{bad}': none of its 2 records read for training became a sample" \
        in capsys.readouterr().err


@pytest.mark.slow
def test_heldout_split_within_its_share_is_accepted(target: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    data = make_chat_jsonl(tmp_path / "small.jsonl", num=40)
    assert cli_main(["prepare", *data_args(target, tmp_path, data, "data.heldout_samples=20")]) == 0
    assert "records read                 20   (+20 held out for evaluation)" \
        in capsys.readouterr().out


def test_text_content_parts_are_joined_with_a_newline() -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    record = normalize_record({"messages": [{"role": "user", "content": parts}]}, Location("f", 0))
    assert record.messages[0]["content"] == "Hello\nworld"


def test_resume_auto_says_when_it_starts_fresh(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert resolve_resume("auto", tmp_path / "checkpoints") is None
    assert "no complete checkpoint in" in capsys.readouterr().out


def test_a_full_or_read_only_disk_is_one_line(tmp_path: Path) -> None:
    import errno
    import os

    error = OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "run" / "config.yaml"))
    wrapped = RuntimeError("metrics writer failed")
    wrapped.__cause__ = error
    found = disk_error(wrapped)
    assert found is not None and str(found).startswith(
        f"cannot write {tmp_path / 'run' / 'config.yaml'}: Read-only file system; free space")
    assert disk_error(RuntimeError("a bug")) is None


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
@pytest.mark.slow
def test_a_metrics_file_on_a_full_disk_is_one_line_and_closes_cleanly(
        target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """metrics.jsonl on a full disk: its first line fails the run in one line; the failed line
    was rolled back, so closing the trainer has nothing left to write and stays quiet (a close
    that fails too is one warning: tests/test_full_disk_logs.py)."""
    data = make_chat_jsonl(tmp_path / "chat.jsonl", num=8)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    with caplog.at_level(logging.WARNING, logger="dflash_trainer.training.trainer"):
        assert cli_main(train_args(target, tmp_path, data)) == 1
    errors = [line for line in capsys.readouterr().err.splitlines()
              if line.startswith("dflash-trainer train: ")]
    assert len(errors) == 1 and errors[0].startswith(
        "dflash-trainer train: disk error: cannot write"), errors
    assert not [r for r in caplog.records if r.name == "dflash_trainer.training.trainer"], caplog.text


# --- regenerate against a server that misbehaves on purpose -------------------------------------

class BadServer(ThreadingHTTPServer):
    """An OpenAI-compatible server on 127.0.0.1 whose chat answers follow ``script``: one mode per
    request (``hang``, ``garbage``, ``no-choices``, ``null``, ``empty``, ``500``, ``reset``), then
    ``ok``."""

    daemon_threads = True

    def __init__(self, script: list[str], hang_s: float = 1.5) -> None:
        super().__init__(("127.0.0.1", 0), BadHandler)
        self.script = list(script)
        self.hang_s = hang_s
        self.lock = threading.Lock()
        self.requests = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up on a hung answer closed its end: expected here

    def next_mode(self) -> str:
        with self.lock:
            self.requests += 1
            return self.script.pop(0) if self.script else "ok"


class BadHandler(JsonHandler):
    server: BadServer

    def do_GET(self) -> None:
        self._send(json.dumps({"data": [{"id": "m"}]}).encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        mode = self.server.next_mode()
        if mode == "500":
            self.send_error(500, "model crashed")
            return
        if mode == "reset":
            # SO_LINGER 0: close() sends a TCP RST, as a crashed or restarted server does.
            import socket
            import struct

            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        if mode == "hang":
            time.sleep(self.server.hang_s)  # bounded: the client gave up long before
        if mode == "garbage":
            self._send(b"<html>502 from a proxy</html>")
            return
        if mode == "no-choices":
            self._send(b'{"choices": []}')
            return
        content = {"null": None, "empty": "  "}.get(mode, "an answer")
        self._send(json.dumps({"choices": [{"message": {"role": "assistant", "content": content},
                                            "finish_reason": "stop"}],
                               "usage": {"completion_tokens": 2}}).encode())


@pytest.fixture()
def server(request: pytest.FixtureRequest):
    with serving(BadServer(*request.param), join_timeout=5) as srv:
        yield srv


ONE = [("c1", [{"role": "user", "content": "hi"}])]


def _backend(srv: BadServer, **kwargs: Any) -> OpenAIBackend:
    return OpenAIBackend(srv.url, SamplingParams(max_new_tokens=4), backoff_s=0.01, **kwargs)


@pytest.mark.parametrize("server", [(["garbage", "no-choices"],)], indirect=True)
def test_malformed_bodies_are_retried(server: BadServer, tmp_path: Path) -> None:
    summary = regenerate(ONE, tmp_path / "o.jsonl", _backend(server), progress=False)
    assert (summary.written, summary.failed, server.requests) == (1, 0, 3)


@pytest.mark.parametrize("server", [(["null", "empty"],)], indirect=True)
@pytest.mark.slow
def test_null_and_empty_answers_are_failures_unless_allowed(server: BadServer,
                                                            tmp_path: Path) -> None:
    two = [*ONE, ("c2", [{"role": "user", "content": "hey"}])]
    summary = regenerate(two, tmp_path / "o.jsonl", _backend(server), progress=False,
                         concurrency=1)
    assert (summary.written, summary.failed) == (0, 2)
    failures = (tmp_path / "o.failures.jsonl").read_text()
    assert failures.count("empty text (pass --allow-empty") == 2
    summary = regenerate(two, tmp_path / "o.jsonl", _backend(server), progress=False,
                         allow_empty=True)
    assert (summary.written, summary.failed) == (2, 0)


@pytest.mark.parametrize("server", [(["hang", "hang"], 1.5)], indirect=True)
@pytest.mark.slow
def test_a_hung_server_times_out_and_progress_keeps_printing(
        server: BadServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    summary = regenerate(ONE, tmp_path / "o.jsonl", _backend(server, timeout_s=0.5, max_retries=1),
                         progress_every_s=0.2)
    elapsed = time.monotonic() - started
    assert (summary.written, summary.failed) == (0, 1) and elapsed < 5
    assert "ReadTimeout" in (tmp_path / "o.failures.jsonl").read_text()
    waiting = [line for line in capsys.readouterr().err.splitlines()
               if line.startswith("regenerate: 0/1 ") and "nothing finished yet" in line]
    assert len(waiting) >= 3


@pytest.mark.parametrize("server", [(["null"],)], indirect=True)
def test_cli_request_timeout_and_allow_empty(server: BadServer, tmp_path: Path) -> None:
    data = _write(tmp_path / "chat.jsonl", jsonl([chat(0)]))
    out = tmp_path / "o.jsonl"
    assert cli_main(["regenerate", "--backend", "openai", "--server-url", server.url, "--data",
                     str(data), "--out", str(out), "--request-timeout", "5",
                     "--allow-empty"]) == 0
    assert json.loads(out.read_text())["messages"][-1] == {"role": "assistant", "content": ""}


class FastRetries(OpenAIBackend):
    """The CLI's backend with millisecond backoff: the same retries, without their waits."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "backoff_s": 0.001})


ATTEMPTS = 6
"""Requests the backend makes for one conversation (1 + its 5 retries)."""


@pytest.mark.parametrize("server", [(["500"] * ATTEMPTS + ["garbage"] * ATTEMPTS + ["no-choices"] * ATTEMPTS
                                     + ["null"] + ["reset"] * ATTEMPTS + ["hang"] * ATTEMPTS, 1.0)],
                         indirect=True)
@pytest.mark.slow
def test_regenerate_names_the_cause_of_each_failure(server: BadServer, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Seven conversations, one at a time: each of the first six fails every attempt in its own
    way, the seventh is answered. The summary counts each cause and names the first failure;
    the failures file has the same causes; the exit status is 1 (some conversations failed)."""
    import dflash_trainer.data.regenerate as regenerate_module

    monkeypatch.setattr(regenerate_module, "OpenAIBackend", FastRetries)
    data = _write(tmp_path / "chat.jsonl", jsonl([chat(i) for i in range(7)]))
    out = tmp_path / "o.jsonl"
    code = cli_main(["regenerate", "--backend", "openai", "--server-url", server.url, "--data", str(data),
                     "--out", str(out), "--request-timeout", "0.2", "--concurrency", "1"])
    err = capsys.readouterr().err
    assert code == 1, err
    causes = ["HTTP 500", "invalid JSON", "not a chat completion", "empty content", "connection reset", "timeout"]
    assert "  failed by cause: " + ", ".join(f"{c} 1" for c in sorted(causes)) in err, err
    first = re.search(r"  first failure: (.*)", err)
    assert first and re.match(r"\S+: HTTP 500: POST http://127.0.0.1:\d+/v1/chat/completions: failed after 6 "
                              r"attempts; last error: HTTP 500", first.group(1)), err
    listed = [json.loads(line) for line in (tmp_path / "o.failures.jsonl").read_text().splitlines()]
    assert [r["cause"] for r in listed] == causes
    assert len(out.read_text().splitlines()) == 1


@pytest.mark.slow
def test_a_full_disk_stops_train_with_one_line_and_no_tmp_left(target: Path, tmp_path: Path) -> None:
    """A real write failure: the file size limit (RLIMIT_FSIZE) is smaller than the checkpoint."""
    import resource
    import signal
    import subprocess
    import sys

    data = make_chat_jsonl(tmp_path / "chat.jsonl", num=8)
    argv = train_args(target, tmp_path, data)
    assert cli_main(["prepare", *argv[1:argv.index(f"run_dir={tmp_path / 'run'}")]]) == 0

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    result = subprocess.run([sys.executable, "-m", "dflash_trainer", *argv], check=False,
                            capture_output=True,
                            text=True, timeout=300, preexec_fn=limit_file_size)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines()
              if line.startswith("dflash-trainer train: ")]
    assert len(errors) == 1 and re.match(
        r"dflash-trainer train: disk error: cannot write checkpoint .*step-1\.tmp: File too large; "
        r"free space or make .* writable", errors[0]), result.stderr[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not list(checkpoints.glob("*.tmp")) and not (checkpoints / "latest").exists()


# --- unreadable inputs: "cannot read", never "cannot write" ----------------------------------------

def _prepare_as_unprivileged(data: Path, cache: Path) -> tuple[int, str]:
    """``prepare`` of ``data`` run where file modes bind: as root (which reads a mode-000 file
    anyway) a subprocess without the capabilities that bypass them (setpriv), else in-process."""
    import contextlib
    import io
    import os
    import shutil
    import subprocess
    import sys

    argv = ["prepare", "--data", str(data), f"data.cache_dir={cache}", "data.heldout_samples=0"]
    if os.geteuid() != 0:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            return cli_main(argv), err.getvalue()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root needs setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
    caps = "-dac_override,-dac_read_search"
    src = str(Path(__file__).resolve().parents[1] / "src")
    result = subprocess.run(["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", sys.executable, "-m",
                             "dflash_trainer", *argv], capture_output=True, text=True, timeout=120, check=False,
                            env={**os.environ, "PYTHONPATH": with_guard(src), "HF_HUB_OFFLINE": "1"})
    return result.returncode, result.stderr


@pytest.mark.parametrize("layout", ["file", "folder", "file in a folder"])
@pytest.mark.slow
def test_an_unreadable_input_is_cannot_read_with_its_path(layout: str, tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    secret = make_chat_jsonl(folder / "secret.jsonl", num=4)
    locked = {"file": secret, "folder": folder, "file in a folder": secret}[layout]
    locked.chmod(0)
    try:
        code, err = _prepare_as_unprivileged(secret if layout == "file" else folder, tmp_path / "cache")
    finally:
        locked.chmod(0o755)
    errors = [line for line in err.splitlines() if line.startswith("dflash-trainer prepare: ")]
    assert "Traceback" not in err and len(errors) == 1 and code == 1, err
    assert re.match(rf"dflash-trainer prepare: data error: (data.paths entry|data folder) '.*': cannot read "
                    rf"{re.escape(str(locked))}: Permission denied", errors[0]), errors[0]


# --- a full disk under safetensors; a latest pointer in another encoding -----------------------------

@pytest.fixture()
def small_disk(tmp_path: Path):
    """A 64 KiB tmpfs: a real ``No space left on device`` (ENOSPC) from the kernel (needs root)."""
    import subprocess

    folder = tmp_path / "small-disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()})")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_export_onto_a_full_disk_is_one_disk_error(target: Path, tmp_path: Path, small_disk: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = checkpoint(tmp_path, target)
    assert (ckpt / "drafter" / "model.safetensors").stat().st_size > 64 * 1024  # it cannot fit
    out = small_disk / "export"
    assert cli_main(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("dflash-trainer export: ")]
    assert "Traceback" not in err and len(errors) == 1, err
    assert re.match(rf"dflash-trainer export: disk error: cannot write {re.escape(str(out))}: No space left on "
                    r"device; free space", errors[0]), errors[0]
    assert list(small_disk.iterdir()) == []  # no export, no temporary folder left


def test_a_latest_pointer_in_another_encoding_falls_back_to_the_step_folders(
        target: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = checkpoint(tmp_path, target)
    (ckpt.parent / "latest").write_text("step-2", encoding="utf-16")
    with caplog.at_level(logging.WARNING, logger="dflash_trainer.training.checkpoint"):
        assert resolve_resume("auto", ckpt.parent) == ckpt
    assert "latest: it should name a step-N folder, but holds b'\\xff\\xfes\\x00t" in caplog.text


@pytest.mark.slow
def test_a_one_byte_edit_that_keeps_size_and_mtime_builds_a_new_token_store(
        target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _write(tmp_path / "chat.jsonl", jsonl([chat(i) for i in range(4)]))
    argv = ["prepare", *data_args(target, tmp_path, data)]
    assert cli_main(argv) == 0
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "1 unchanged since their last hash" in out and "reusing the token store" in out
    edit_one_byte_keeping_size_and_mtime(data)
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "prepare: content hash of 1 data file(s): 1 hashed" in out and "reusing" not in out, out
    assert len([p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]) == 2
