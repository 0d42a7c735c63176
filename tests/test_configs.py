"""The ready-made configs load, resolve, and build drafters of the reference size."""

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from dflash_trainer.config import load_config
from dflash_trainer.model.drafter import build_drafter

CONFIGS = Path(__file__).parents[1] / "configs"

# Published geometry of the targets (the weights are not needed to size a drafter).
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                rope_theta=1000000, max_position_embeddings=40960, tie_word_embeddings=False)
LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                   rope_theta=500000, max_position_embeddings=131072, tie_word_embeddings=False)


@pytest.mark.parametrize(("name", "block_size"), [("demo-cpu", 4), ("reference-cpu", 16), ("qwen3-8b", 16),
                                                   ("llama-3.1-8b", 16)])
def test_config_loads(name: str, block_size: int):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert cfg.model.block_size == block_size


def test_qwen3_8b_reference_drafter_size():
    cfg = load_config(CONFIGS / "qwen3-8b.yaml")
    assert (cfg.model.num_layers, cfg.training.lr, cfg.training.epochs, cfg.data.max_length,
            cfg.training.num_anchors, cfg.training.gamma) == (5, 6e-4, 6, 3072, 512, 7.0)
    with torch.device("meta"):
        drafter = build_drafter(cfg.model, Qwen3Config(**QWEN3_8B))
    params = sum(p.numel() for p in drafter.parameters())
    assert 1.0e9 < params < 1.1e9, params  # ~1.05 B including the 84 M fc
    assert drafter.fc.weight.shape == (4096, 5 * 4096)
    assert drafter.target_layer_ids == [1, 9, 17, 25, 33]


def test_llama_31_8b_drafter_builds():
    cfg = load_config(CONFIGS / "llama-3.1-8b.yaml")
    with torch.device("meta"):
        drafter = build_drafter(cfg.model, LlamaConfig(**LLAMA_31_8B))
    assert drafter.target_layer_ids == [1, 8, 15, 22, 29]  # round(1 + i * 28 / 4)
    assert drafter.mask_token_id == 128002
