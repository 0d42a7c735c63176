"""model.dtype: parsing, the CPU probe behind ``auto`` (made, cached, reused) and the trainer honouring it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from helpers_e2e import make_chat_jsonl, make_tiny_target

from dflash_trainer.config import load_config
from dflash_trainer.model.dtypes import (
    BF16_MIN_GAIN,
    DTYPES,
    ProbeShape,
    config_dtype,
    cpu_model_name,
    parse_dtype,
    probe_cache_path,
    probe_step_seconds,
    resolve_dtype,
)
from dflash_trainer.core.errors import ConfigError

TINY = {"hidden_size": 64, "vocab_size": 256, "intermediate_size": 128, "num_target_layers": 4}


def test_parse_dtype_names_and_errors():
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("float32") is torch.float32
    with pytest.raises(ConfigError, match="resolve_dtype"):
        parse_dtype("auto")
    with pytest.raises(ConfigError, match="float16"):
        parse_dtype("float16")


def test_fixed_names_and_cuda_need_no_probe(tmp_path: Path):
    cache = tmp_path / "probe.json"
    assert resolve_dtype("float32", "cpu", **_sizes(), cache_path=cache) is torch.float32
    assert resolve_dtype("bfloat16", "cpu", **_sizes(), cache_path=cache) is torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda"), **_sizes(), cache_path=cache) is torch.bfloat16
    assert not cache.exists()


def test_probe_times_both_dtypes_and_leaves_the_global_rng_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    seconds = probe_step_seconds(ProbeShape(**TINY), repeats=1)
    assert torch.equal(torch.rand(4), expected)
    assert set(seconds) == set(DTYPES)
    assert all(0 < s < 10 for s in seconds.values())


@pytest.mark.slow
def test_cpu_auto_probes_once_then_reuses_the_cache(tmp_path: Path, caplog):
    cache = tmp_path / "probe.json"
    with caplog.at_level(logging.INFO, logger="dflash_trainer.model.dtypes"):
        chosen = resolve_dtype("auto", "cpu", **_sizes(), cache_path=cache)
    assert "probe step" in caplog.text and "float32" in caplog.text and "bfloat16" in caplog.text
    entries = json.loads(cache.read_text())
    (key, entry), = entries.items()
    assert cpu_model_name() in key and torch.__version__ in key
    assert "threads" not in key
    faster = entry["seconds"]["bfloat16"] <= (1 - BF16_MIN_GAIN) * entry["seconds"]["float32"]
    assert entry["choice"] == ("bfloat16" if faster else "float32")
    assert DTYPES[entry["choice"]] is chosen
    # Reused, not measured again: a hand-edited choice comes back as it is.
    other = next(name for name, dtype in DTYPES.items() if dtype is not chosen)
    entries[key]["choice"] = other
    cache.write_text(json.dumps(entries))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash_trainer.model.dtypes"):
        assert resolve_dtype("auto", "cpu", **_sizes(), cache_path=cache) is DTYPES[other]
    assert "cached probe" in caplog.text
    # Another thread count (train sets its own, features and eval do not) is the same machine:
    # the same choice, no second probe.
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert resolve_dtype("auto", "cpu", **_sizes(), cache_path=cache) is DTYPES[other]
    finally:
        torch.set_num_threads(threads)
    assert len(json.loads(cache.read_text())) == 1


def test_unreadable_cache_is_measured_again(tmp_path: Path):
    cache = tmp_path / "probe.json"
    cache.write_text("{not json")
    assert resolve_dtype("auto", "cpu", **_sizes(), cache_path=cache) in DTYPES.values()
    assert len(json.loads(cache.read_text())) == 1


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dtypes")
    return make_tiny_target(root / "target"), make_chat_jsonl(root / "chat.jsonl", num=12)


@pytest.mark.parametrize("choice", ["bfloat16", "float32"])
@pytest.mark.slow
def test_trainer_honours_the_cached_choice(tiny_setup, tmp_path: Path, monkeypatch, choice: str):
    from dflash_trainer.training.trainer import Trainer

    target, data = tiny_setup
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    cfg = load_config(None, [
        f"model.target={target}", f"data.paths=[{data}]", f"run_dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'data'}", "data.max_length=256", "data.heldout_samples=0",
        "pipeline.tokens_per_batch=512", "pipeline.device=cpu", "pipeline.num_threads=1",
        "training.num_anchors=8", "logging.console=false", "model.dtype=auto"])
    threads = torch.get_num_threads()
    # The trainer's own resolution (at its pipeline.num_threads) writes the entry; force the
    # choice under test into it.
    torch.set_num_threads(1)
    config_dtype(cfg.model, "cpu")
    cache = probe_cache_path()
    entries = json.loads(cache.read_text())
    (key, entry), = entries.items()
    assert "hidden 64 " in key and "threads" not in key  # one dtype for every command's thread count
    entry["choice"] = choice
    cache.write_text(json.dumps(entries))
    trainer = Trainer(cfg)
    try:
        dtype = DTYPES[choice]
        assert trainer.compute_dtype is dtype
        assert trainer.target.get_input_embeddings().weight.dtype is dtype
        assert trainer.drafter_step.autocast_dtype is (torch.bfloat16 if choice == "bfloat16" else None)
        ids = torch.randint(0, 100, (1, 16))
        features = trainer.parts.extractor(ids).features
        assert features.dtype is dtype
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=trainer.drafter_step.autocast_dtype is not None):
            context = trainer.drafter.fc(features.float())
        assert context.dtype is dtype
    finally:
        trainer.close()
        torch.set_num_threads(threads)


def _sizes() -> dict[str, int]:
    return dict(TINY)
