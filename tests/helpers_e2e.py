"""Shared builders for end-to-end tests: a tiny random target and a small chat data file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_trainer import assets

WORDS = ("the model drafts tokens block diffusion target verify accept speed cache layer "
         "hidden state anchor mask loss gamma decay train step batch bucket queue").split()


def make_tiny_target(folder: Path, *, layers: int = 4, hidden: int = 64, seed: int = 0) -> Path:
    """A randomly initialised Llama with the real SmolLM2 tokenizer (so chat templates work)."""
    tokenizer = assets.load_tokenizer(assets.resolve_target("smollm2"))
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_chat_jsonl(path: Path, *, num: int = 24, seed: int = 0) -> Path:
    """OpenAI-messages JSONL with varied lengths (so several length buckets fill)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(num):
            n_words = rng.choice([20, 40, 80, 160])
            answer = " ".join(rng.choice(WORDS) for _ in range(n_words))
            record = {"messages": [
                {"role": "user", "content": f"question {i}: " + " ".join(rng.sample(WORDS, 5))},
                {"role": "assistant", "content": answer}]}
            f.write(json.dumps(record) + "\n")
    return path
