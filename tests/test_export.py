"""Export in the z-lab format: files, config keys, round trip, and loading with transformers alone."""

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig
from helpers_e2e import load_with_transformers_alone

from dflash_trainer.core import assets
from dflash_trainer.training.checkpoint import Checkpointer, SaveRequest
from dflash_trainer.config import ModelConfig, load_config
from dflash_trainer.core.errors import CheckpointError, ConfigError
from dflash_trainer.training import export
from dflash_trainer.model.drafter import SIGNATURE_KEY, build_drafter, tokenizer_signature

H, V, BLOCK = 64, 256, 4


def target_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=H, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=V, rope_theta=100000.0, tie_word_embeddings=True)


def tokenizer():
    return assets.load_tokenizer(assets.resolve_target("smollm2"))


def trained_drafter():
    torch.manual_seed(0)
    drafter = build_drafter(ModelConfig(num_layers=2, block_size=BLOCK, target_layer_ids=[1, 3, 4]),
                            target_config(), mask_token_id=9, tokenizer=tokenizer())
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return drafter.eval()


def inputs():
    torch.manual_seed(1)
    return {"position_ids": torch.arange(10 + BLOCK)[None], "noise_embedding": torch.randn(1, BLOCK, H),
            "target_hidden": torch.randn(1, 10, 3 * H)}


def test_files_config_and_weights(tmp_path):
    drafter = trained_drafter()
    out = export.export_drafter(drafter, tmp_path / "drafter", target_config=target_config())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "dflash.py", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["drafter"]  # no temporary folder left behind
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert cfg["model_type"] == "qwen3" and cfg["block_size"] == BLOCK and cfg["num_target_layers"] == 6
    assert cfg["dflash_config"] == {"mask_token_id": 9, "target_layer_ids": [1, 3, 4], "block_size": BLOCK}
    assert cfg["rope_theta"] == 100000.0 and cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["head_dim"] == 16
    assert cfg["hidden_act"] == "silu" and cfg["tie_word_embeddings"] is False and cfg["dtype"] == "bfloat16"
    assert cfg[SIGNATURE_KEY] == {"vocab_size": V, "hidden_size": H, "tokenizer": tokenizer_signature(tokenizer())}
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("fc.weight").shape == (H, 3 * H) and f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert keys == set(drafter.state_dict())
    assert not any("embed" in k or "lm_head" in k or "rotary" in k for k in keys)
    assert (out / "dflash.py").read_text() == export.MODELING_FILE.read_text()


@pytest.mark.slow
def test_round_trip_gives_identical_outputs(tmp_path):
    drafter = trained_drafter()
    out = export.export_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    loaded = export.load_drafter(out)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs()), drafter(**inputs()), atol=0, rtol=0)
    assert loaded.target_layer_ids == [1, 3, 4] and loaded.mask_token_id == 9 and loaded.block_size == BLOCK
    # The target's signature travels through a load and a second export (export from a checkpoint).
    again = export.export_drafter(loaded, tmp_path / "again", dtype=torch.float32)
    assert (json.loads((again / "config.json").read_text())[SIGNATURE_KEY]
            == json.loads((out / "config.json").read_text())[SIGNATURE_KEY])


def test_replaces_a_previous_export_but_not_other_folders(tmp_path):
    drafter = trained_drafter()
    out = export.export_drafter(drafter, tmp_path / "d")
    export.export_drafter(drafter, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=r"holds other files \(notes.txt\), not a drafter export"):
        export.export_drafter(drafter, other)
    assert (other / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("keep me too")
    with pytest.raises(ConfigError, match="is an existing file, not a folder"):
        export.export_drafter(drafter, tmp_path / "file")
    assert (tmp_path / "file").read_text() == "keep me too"


@pytest.mark.slow
def test_transformers_alone_loads_it_with_no_missing_keys(tmp_path):
    drafter = trained_drafter()
    out = export.export_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    _, info, hidden = load_with_transformers_alone(out, inputs(), tmp_path)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [] and info["mismatched_keys"] == []
    with torch.no_grad():
        expected = drafter(**inputs())
    torch.testing.assert_close(hidden, expected, atol=1e-6, rtol=1e-6)


def _checkpoint(tmp_path: Path, drafter) -> Path:
    ck = Checkpointer(tmp_path / "checkpoints", keep_last=2, async_save=False)
    ck.save(SaveRequest(step=3, state={"step": 3},
                        export=lambda folder: export.export_drafter(drafter, folder,
                                                                    dtype=torch.float32)))
    return tmp_path / "checkpoints" / "step-3"


def test_cli_main_from_a_checkpoint_verifies_its_manifest(tmp_path, capsys):
    drafter = trained_drafter()
    ckpt = _checkpoint(tmp_path, drafter)
    code = export.main(load_config(), argparse.Namespace(checkpoint=str(ckpt), out=str(tmp_path / "out"),
                                                         overwrite=False))
    assert code == 0 and "exported drafter" in capsys.readouterr().out
    loaded = export.load_drafter(tmp_path / "out")
    with torch.no_grad():  # bf16 export: close, not identical
        torch.testing.assert_close(loaded(**inputs()), drafter(**inputs()), atol=0.05, rtol=0.05)
    weights = ckpt / "drafter" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = b"\x7f" * 8  # flipped bytes inside the last tensor: same size, wrong checksum
    weights.write_bytes(bytes(data))
    for folder in (ckpt, ckpt / "drafter"):
        with pytest.raises(CheckpointError, match=r"step-3: drafter/model.safetensors does not match its checksum"):
            export.load_checkpoint_drafter(folder)
    with pytest.raises(CheckpointError, match="neither a training checkpoint"):
        export.load_checkpoint_drafter(tmp_path)


@pytest.mark.slow
def test_load_reports_missing_weights(tmp_path):
    out = export.export_drafter(trained_drafter(), tmp_path / "d")
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    cfg["layer_types"] = ["full_attention"] * 3
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="layers.2.* missing from the file"):
        export.load_drafter(out)


@pytest.mark.slow
def test_export_command_writes_only_new_or_empty_folders_or_overwrites_on_request(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path, trained_drafter())

    def run(out, overwrite=False):
        return export.main(load_config(), argparse.Namespace(checkpoint=str(ckpt), out=str(out),
                                                             overwrite=overwrite))

    (tmp_path / "empty").mkdir()
    assert run(tmp_path / "empty") == 0
    with pytest.raises(ConfigError, match=r"--out .*empty holds a drafter export already; pass --overwrite"):
        run(tmp_path / "empty")
    assert run(tmp_path / "empty", overwrite=True) == 0
    (tmp_path / "a.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"--out .*a.txt is an existing file"):
        run(tmp_path / "a.txt", overwrite=True)
    with pytest.raises(ConfigError, match=r"--out .* is a folder that holds other files \(a.txt, checkpoints, "
                                          r"empty\), not a drafter export"):
        run(tmp_path, overwrite=True)
    with pytest.raises(ConfigError, match="is inside the checkpoint"):
        run(ckpt / "drafter", overwrite=True)
    assert (tmp_path / "a.txt").read_text() == "mine"


@pytest.mark.slow
def test_a_truncated_or_damaged_export_is_refused_by_name(tmp_path):
    out = export.export_drafter(trained_drafter(), tmp_path / "d", dtype=torch.float32)
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=r"d/model.safetensors is not a readable safetensors file "
                                              r"\(.*incomplete metadata"):
        export.load_drafter(out)
    weights.write_bytes(data[:8] + b"{not json" + data[17:])  # the JSON header damaged
    with pytest.raises(CheckpointError, match=r"d/model.safetensors is not a readable safetensors file"):
        export.load_drafter(out)
    (out / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"d/config.json is not a valid drafter config"):
        export.read_drafter_config(out)


@pytest.mark.slow
def test_serve_check_refuses_a_drafter_for_another_target_before_any_server(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import serve_check

    target = assets.resolve_target("smollm2")
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=BLOCK, target_layer_ids=[1]),
                            LlamaConfig.from_pretrained(target), mask_token_id=9, tokenizer=tokenizer())
    out = export.export_drafter(drafter, tmp_path / "d")
    serve_check.check_agreement(out, target)
    cfg = json.loads((out / "config.json").read_text())
    cfg[SIGNATURE_KEY]["tokenizer"]["chat_template_sha256"] = "0" * 64
    cfg[SIGNATURE_KEY]["tokenizer"]["sha256"] = "0" * 64
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"the drafter .*d does not fit the target .*: drafter/target "
                                              r"mismatch: tokenizer: the chat template differs"):
        serve_check.check_agreement(out, target)
