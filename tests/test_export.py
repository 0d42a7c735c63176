"""Export in the z-lab format: files, config keys, round trip, and loading with transformers alone."""

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig

from dflash_trainer.checkpoint import Checkpointer, SaveRequest
from dflash_trainer.config import ModelConfig, load_config
from dflash_trainer.errors import CheckpointError
from dflash_trainer.model import export
from dflash_trainer.model.drafter import build_drafter

H, V, BLOCK = 64, 256, 4


def target_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=H, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=V, rope_theta=100000.0, tie_word_embeddings=True)


def trained_drafter():
    torch.manual_seed(0)
    drafter = build_drafter(ModelConfig(num_layers=2, block_size=BLOCK, target_layer_ids=[1, 3, 4]),
                            target_config(), mask_token_id=9)
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
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("fc.weight").shape == (H, 3 * H) and f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert keys == set(drafter.state_dict())
    assert not any("embed" in k or "lm_head" in k or "rotary" in k for k in keys)
    assert (out / "dflash.py").read_text() == export.MODELING_FILE.read_text()


def test_round_trip_gives_identical_outputs(tmp_path):
    drafter = trained_drafter()
    out = export.export_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    loaded = export.load_drafter(out)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs()), drafter(**inputs()), atol=0, rtol=0)
    assert loaded.target_layer_ids == [1, 3, 4] and loaded.mask_token_id == 9 and loaded.block_size == BLOCK


def test_replaces_a_previous_export_but_not_other_folders(tmp_path):
    drafter = trained_drafter()
    out = export.export_drafter(drafter, tmp_path / "d")
    export.export_drafter(drafter, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a drafter export"):
        export.export_drafter(drafter, other)
    assert (other / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_transformers_alone_loads_it_with_no_missing_keys(tmp_path):
    drafter = trained_drafter()
    out = export.export_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    torch.save(inputs(), tmp_path / "inputs.pt")
    script = textwrap.dedent(f"""
        import json, sys, torch
        from transformers import AutoModel
        model, info = AutoModel.from_pretrained({str(out)!r}, trust_remote_code=True, output_loading_info=True)
        assert "dflash_trainer" not in sys.modules
        with torch.no_grad():
            hidden = model.eval()(**torch.load({str(tmp_path / 'inputs.pt')!r}))
        torch.save(hidden, {str(tmp_path / 'hidden.pt')!r})
        print(json.dumps({{k: sorted(v) for k, v in info.items()}}))
    """)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), PYTHONPATH="")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [] and info["mismatched_keys"] == []
    with torch.no_grad():
        expected = drafter(**inputs())
    torch.testing.assert_close(torch.load(tmp_path / "hidden.pt"), expected, atol=1e-6, rtol=1e-6)


def _checkpoint(tmp_path: Path, drafter) -> Path:
    ck = Checkpointer(tmp_path / "checkpoints", keep_last=2, async_save=False)
    ck.save(SaveRequest(step=3, state={"step": 3}, rank_states={},
                        export=lambda folder: export.export_drafter(drafter, folder,
                                                                    dtype=torch.float32)))
    return tmp_path / "checkpoints" / "step-3"


def test_cli_main_from_a_checkpoint_verifies_its_manifest(tmp_path, capsys):
    drafter = trained_drafter()
    ckpt = _checkpoint(tmp_path, drafter)
    code = export.main(load_config(), argparse.Namespace(checkpoint=str(ckpt), out=str(tmp_path / "out")))
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


def test_load_reports_missing_weights(tmp_path):
    out = export.export_drafter(trained_drafter(), tmp_path / "d")
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    cfg["layer_types"] = ["full_attention"] * 3
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="layers.2.* missing from the file"):
        export.load_drafter(out)
