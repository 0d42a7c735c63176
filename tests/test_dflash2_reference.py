"""The project's speculative decoding of a DFlash2 export against an independent implementation
of the DFlash2 draft step, written here after z-lab's ``dflash/model.py`` (``DFlash2DraftModel``,
``GroupedDynamicCausalConv``, ``CandidateSelector.select``, ``dflash_generate``).

The reference half of this file reads only the exported ``config.json`` and
``model.safetensors`` and uses torch and the transformers target; it imports nothing of
dflash_trainer. It recomputes the whole drafter by hand (RMSNorm, RoPE, attention over the
cached context and the block, the two-tap convolutions, the selector's greedy walk), so a
mistake in the project's modeling file shows up as a different draft, token or acceptance
length.

The target is ``make_tiny_target``'s random Llama. Its greedy continuation repeats one token,
so the drafter is built to draft that token often (mask id = the repeated token, small layer
outputs, so each slot's logits favour it): some blocks are accepted in part or whole, and the
selector's random (not identity) codebooks make it leave the logits' argmax at some slots.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from helpers_e2e import make_tiny_target
from safetensors.torch import load_file
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, DynamicCache

BLOCK, MAX_NEW = 4, 24
PROMPTS = ([1, 2, 3, 4, 5], [100, 2000, 30000, 7], [42, 42, 42], [7, 8, 9, 10, 11, 12])


# --- the independent reference (config.json + model.safetensors + the target only) -------------

def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _grouped_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group: int) -> torch.Tensor:
    # z-lab: each tap adds (base + dynamic) * the row `tap` places earlier, zero before the block.
    length, hidden = x.shape
    groups = hidden // group
    blocks = x.view(length, groups, group)
    out = torch.zeros_like(blocks)
    for offset in range(base.shape[0]):
        values = blocks if offset == 0 else F.pad(blocks[:-offset], (0, 0, 0, 0, offset, 0))
        out = out + base[offset].view(groups, group) * values + dynamic[:, offset, :, None] * values
    return out.view(length, hidden)


class ReferenceDFlash2:
    """A DFlash2 drafter from an export's files, computed op by op."""

    def __init__(self, folder: Path, target: torch.nn.Module) -> None:
        config = json.loads((folder / "config.json").read_text())
        section = config["dflash_config"]
        self.w = load_file(str(folder / "model.safetensors"))
        self.layers = config["num_hidden_layers"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim, self.eps = config["head_dim"], config["rms_norm_eps"]
        self.theta = config["rope_parameters"]["rope_theta"]
        self.block, self.mask = section["block_size"], section["mask_token_id"]
        self.layer_ids = section["target_layer_ids"]
        self.taps, self.group = section["conv_kernel_size"], section["conv_group_size"]
        self.top_k = section["selector_top_k"]
        self.embed = target.get_input_embeddings().weight
        self.head = target.get_output_embeddings().weight
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _conv(self, prefix: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        groups = x.shape[-1] // self.group
        dynamic = (x @ self.w[prefix + "kernel_projection.weight"].T).view(x.shape[0], 2, self.taps, groups)
        base = self.w[prefix + "base_kernel"]
        return _grouped_conv(x, dynamic[:, 0], base[0], self.group), dynamic[:, 1]

    def _conv_after(self, prefix: str, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return _grouped_conv(y, dynamic, self.w[prefix + "base_kernel"][1], self.group)

    def _attention(self, i: int, x: torch.Tensor, ctx: torch.Tensor, ctx_pos: torch.Tensor,
                   block_pos: torch.Tensor) -> torch.Tensor:
        p, w = f"layers.{i}.self_attn.", self.w
        q = _rms((x @ w[p + "q_proj.weight"].T).view(len(x), self.heads, self.head_dim), w[p + "q_norm.weight"],
                 self.eps)
        both = torch.cat([ctx, x])
        k = _rms((both @ w[p + "k_proj.weight"].T).view(len(both), self.kv_heads, self.head_dim),
                 w[p + "k_norm.weight"], self.eps)
        v = (both @ w[p + "v_proj.weight"].T).view(len(both), self.kv_heads, self.head_dim)
        cos, sin = _rope(torch.cat([ctx_pos, block_pos]), self.head_dim, self.theta)
        q = _rotate(q, cos[len(ctx):], sin[len(ctx):])
        k = _rotate(k, cos, sin)
        if i == len(self.cache):
            self.cache.append((k[:0], v[:0]))
        old_k, old_v = self.cache[i]
        self.cache[i] = (torch.cat([old_k, k[:len(ctx)]]), torch.cat([old_v, v[:len(ctx)]]))
        keys = torch.cat([self.cache[i][0], k[len(ctx):]]).repeat_interleave(self.heads // self.kv_heads, dim=1)
        values = torch.cat([self.cache[i][1], v[len(ctx):]]).repeat_interleave(self.heads // self.kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * self.head_dim ** -0.5
        out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).reshape(len(x), -1)
        return out @ w[p + "o_proj.weight"].T

    def hidden(self, features: torch.Tensor, ctx_pos: torch.Tensor, block_ids: torch.Tensor,
               block_pos: torch.Tensor) -> torch.Tensor:
        """Final-normed drafter states of the block, the new context features cached."""
        w = self.w
        ctx = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], self.eps)
        h = F.embedding(block_ids, self.embed)
        for i in range(self.layers):
            p = f"layers.{i}."
            x, dynamic = self._conv(p + "attention_conv.", _rms(h, w[p + "input_layernorm.weight"], self.eps))
            attn = self._attention(i, x, ctx, ctx_pos, block_pos)
            h = h + self._conv_after(p + "attention_conv.", attn, dynamic)
            x, dynamic = self._conv(p + "mlp_conv.", _rms(h, w[p + "post_attention_layernorm.weight"], self.eps))
            mlp = (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
                   ) @ w[p + "mlp.down_proj.weight"].T
            h = h + self._conv_after(p + "mlp_conv.", mlp, dynamic)
        return _rms(h, w["norm.weight"], self.eps)

    def select(self, hidden: torch.Tensor, anchor: int) -> tuple[list[int], list[int]]:
        """z-lab's CandidateSelector.select at temperature 0: (path, the logits' argmax)."""
        logits = hidden @ self.head.T
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        projected = hidden @ self.w["candidate_selector.hidden_projection.weight"].T
        predecessor, path = anchor, []
        for position in range(len(hidden)):
            query = self.w["candidate_selector.predecessor_codebook"][predecessor] * projected[position]
            scores = unary[position] + self.w["candidate_selector.successor_codebook"][candidates[position]] @ query
            predecessor = int(candidates[position, int(scores.argmax())])
            path.append(predecessor)
        return path, logits.argmax(dim=-1).tolist()


def _features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    return torch.cat([hidden_states[i + 1][0] for i in layer_ids], dim=-1)


@torch.no_grad()
def reference_generate(folder: Path, target: torch.nn.Module, prompt: list[int], max_new: int) -> dict:
    """Greedy speculative decoding with :class:`ReferenceDFlash2` drafting: z-lab's
    ``dflash_generate`` loop, with full blocks to the end (z-lab shortens the last block to the
    tokens left; the project drafts full blocks and cuts the output) and ``accepted + 1``
    recorded per step."""
    drafter = ReferenceDFlash2(folder, target)
    cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    cache = DynamicCache()
    ids = torch.tensor([prompt])
    out = target(ids, use_cache=True, output_hidden_states=True, **{cache_arg: cache})
    tokens = [int(out.logits[0, -1].argmax())]
    features, ctx_start = _features(out.hidden_states, drafter.layer_ids), 0
    start, steps = len(prompt), []
    while len(tokens) < max_new:
        block_pos = torch.arange(start, start + drafter.block)
        block = torch.tensor([tokens[-1]] + [drafter.mask] * (drafter.block - 1))
        hidden = drafter.hidden(features, torch.arange(ctx_start, start), block, block_pos)
        drafts, argmax = drafter.select(hidden[1:], tokens[-1])
        block[1:] = torch.tensor(drafts)
        out = target(block[None], position_ids=block_pos[None], use_cache=True, output_hidden_states=True,
                     **{cache_arg: cache})
        posterior = out.logits[0].argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == posterior[accepted]:
            accepted += 1
        tokens += drafts[:accepted] + [posterior[accepted]]
        steps.append({"drafted": drafts, "argmax": argmax, "accepted": accepted})
        features, ctx_start = _features(out.hidden_states, drafter.layer_ids)[:accepted + 1], start
        start += accepted + 1
        excess = cache.get_seq_length() - start
        if excess > 0:
            cache.crop(-excess)
    return {"tokens": tokens[:max_new], "steps": steps}


# --- the project's side ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    from dflash_trainer.config import ModelConfig
    from dflash_trainer.model.drafter import build_drafter
    from dflash_trainer.training.export import export_drafter

    folder = tmp_path_factory.mktemp("dflash2-reference")
    target = AutoModelForCausalLM.from_pretrained(make_tiny_target(folder / "target", layers=4)).eval()
    with torch.no_grad():
        repeated = int(target.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=2, do_sample=False)[0, -1])
    torch.manual_seed(0)
    drafter = build_drafter(ModelConfig(num_layers=2, block_size=BLOCK, target_layer_ids=[1, 2], variant="dflash2",
                                        selector_rank=16, selector_top_k=8), target.config, mask_token_id=repeated)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(0.1)  # small layer outputs: the block's own tokens dominate its logits
            elif name.endswith("base_kernel"):
                param.add_(torch.randn_like(param) * 0.3)
            elif name.endswith("kernel_projection.weight"):
                param.normal_(0.0, 0.3)
            elif name.startswith("candidate_selector.") and "codebook" in name:
                param.normal_(0.0, 0.6)  # pair scores near the logits' margins: some slots leave the argmax
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
    return target, export_drafter(drafter, folder / "export", dtype=torch.float32)


@pytest.mark.slow
def test_project_decoding_equals_the_reference_prompt_by_prompt(setup) -> None:
    from dflash_trainer.training.export import load_drafter
    from dflash_trainer.evaluation.spec_decode import speculative_generate, target_generate

    target, folder = setup
    drafter = load_drafter(folder)
    accepted, off_argmax = 0, 0
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        ours = speculative_generate(drafter, target, ids, max_new_tokens=MAX_NEW, stop_token_ids=[])
        ref = reference_generate(folder, target, prompt, MAX_NEW)
        assert ours.tokens == ref["tokens"], prompt
        assert ours.acceptance_lengths == [s["accepted"] + 1 for s in ref["steps"]], prompt
        assert [s.drafted for s in ours.steps] == [s["drafted"] for s in ref["steps"]], prompt
        assert ours.tokens == target_generate(target, ids, max_new_tokens=MAX_NEW, stop_token_ids=[]).tokens
        accepted += sum(s["accepted"] for s in ref["steps"])
        off_argmax += sum(d != a for s in ref["steps"] for d, a in zip(s["drafted"], s["argmax"]))
    # The comparison means something: drafts were accepted, and the selector's path left the
    # plain argmax of the logits.
    assert accepted > 0 and off_argmax > 0, (accepted, off_argmax)
