"""The GPU check and the pipeline benchmark run their own code paths on CPU at tiny shapes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers_e2e import make_chat_jsonl, make_tiny_target

from benchmarks import gpu_check, gpu_parts
from dflash_trainer.model.blocks import dense_block_mask, sample_anchors
from dflash_trainer.model.modeling.dflash import block_slots
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.target import FeatureExtractor
from helpers_objective import run_objective

ROOT = Path(__file__).resolve().parents[1]


def _run(name: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m benchmarks.NAME ARGS`` from the repository root, as the docs run it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def _fraction(value: float) -> bool:
    return 0.0 <= value <= 1.0 + 1e-9


@pytest.mark.slow
def test_gpu_check_dry_run_of_every_section_on_cpu(tmp_path: Path):
    out = tmp_path / "gpu_check.json"
    # One thread: on a shared 2-core machine two OpenMP threads mostly wait for each other.
    proc = _run("gpu_check", "--device", "cpu", "--tiny", "--threads", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    sections = report["sections"]
    expected = list(gpu_check.SECTIONS)
    assert list(sections) == expected
    assert report["failed"] == []
    for name in expected:
        assert sections[name]["status"] in ("ok", "warn"), (name, sections[name])
    # The table comes last on stdout, one row per section.
    table = proc.stdout[proc.stdout.index("section"):]
    assert [line.split()[0] for line in table.splitlines()[2:2 + len(expected)]] == expected

    assert sections["matmul"]["ceiling_tflops"] > 0
    flex = sections["flex_vs_sdpa"]
    assert flex["dropped_blocks"] > 0
    assert flex["flex_vs_sdpa"]["hidden"] < gpu_check.FP32_REL_TOL
    assert flex["padded_flex_vs_sdpa"]["hidden"] < gpu_check.FP32_REL_TOL
    losses = sections["losses"]
    assert losses["pipelined"] == losses["sequential"], "CPU: bitwise the same steps"
    assert losses["bitwise_equal_steps"] == losses["steps"] > 0
    sanitizer = sections["sanitizer"]
    assert sanitizer["exit"] == 0 and len(sanitizer["result"]["losses"]) == sanitizer["steps"]
    recompiles = sections["recompiles"]
    assert recompiles["batch_shapes"] > 1, "bucketed data: the shapes change"
    assert recompiles["recompile_limit_hits"] == []
    assert len(recompiles["compiles_per_step"]) == recompiles["steps"]
    memory = sections["memory"]
    assert memory["step_s"] > 0 and memory["tflops"] > 0 and memory["peak_gib"] is None
    kill = sections["kill_resume"]
    assert kill["resumed"] and kill["stopped_by_sigterm"] and kill["sigterm_exit"] == 0
    two = sections["two_gpu"]
    assert two["exit"] == 0 and not two["stage_threads_left"]
    assert [r["rank"] for r in two["ranks"]] == [0, 1]


def test_step_flops_linear_terms_match_the_flop_counter():
    """The analytic matmul count equals what torch counts in one real step (SDPA on CPU is
    not counted by FlopCounterMode, so the attention terms are checked separately below)."""
    geom = gpu_parts.TINY
    device = torch.device("cpu")
    target = gpu_parts.make_target(geom, device, torch.float32)
    drafter = gpu_parts.make_drafter(geom, target.config, device)
    extractor = FeatureExtractor(target, drafter.target_layer_ids)
    # attention="sdpa": FlopCounterMode does not count SDPA, so the linear terms stand alone.
    objective = DFlashObjective(drafter, extractor.embed_weight, extractor.head_weight, gamma=7.0,
                                loss_chunk_size=1024, attention="sdpa")
    data = gpu_parts.SyntheticTokens(geom.batch, geom.seq_len, geom.vocab, seed=0)
    input_ids = torch.stack([torch.from_numpy(data[i][0]).long() for i in range(geom.batch)])
    loss_mask = torch.stack([torch.from_numpy(data[i][1]).bool() for i in range(geom.batch)])
    seq_lens = torch.full((geom.batch,), geom.seq_len)
    anchors, keep = sample_anchors(loss_mask, geom.num_anchors, geom.block_size,
                                   torch.Generator().manual_seed(0), seq_lens=seq_lens)
    assert bool(keep.all())
    batch = {"input_ids": input_ids, "loss_mask": loss_mask, "seq_lens": seq_lens,
             "anchors": anchors, "keep": keep}
    counter = FlopCounterMode(display=False)
    with counter:
        features = extractor(input_ids, torch.ones_like(input_ids, dtype=torch.bool)).features
        loss, _ = run_objective(objective, batch, features, 0)
        loss.backward()
    counted = counter.get_flop_counts()["Global"]
    flops = gpu_check.step_flops(geom, mean_anchor=float(anchors.float().mean()))
    linear = flops["target_linear"] + flops["drafter_linear"] + flops["lm_head"]
    assert sum(counted.values()) == linear

    # Attention: the entries the dense mask allows, 2 matmuls forward, 4 backward; the last
    # layer has queries for the supervised slots 1..B-1 only.
    mask = dense_block_mask(anchors, keep, geom.seq_len, geom.block_size)
    last = block_slots(mask, 2, geom.block_size, geom.block_size - 1)
    allowed = (geom.drafter_layers - 1) * float(mask.sum()) + float(last.sum())
    q_dim = geom.heads * geom.head_dim
    assert math.isclose(flops["drafter_attention"], 3 * 2 * 2 * q_dim * allowed, rel_tol=1e-9)


@pytest.mark.slow
def test_pipeline_benchmark_tiny(tmp_path: Path):
    target = make_tiny_target(tmp_path / "target", layers=3)
    data = make_chat_jsonl(tmp_path / "chat.jsonl", num=24)
    out = tmp_path / "pipeline.json"
    proc = _run("pipeline", "--target", str(target), "--data", str(data), "--cache-dir",
                str(tmp_path / "cache"), "--steps", "3", "--warmup", "1", "--threads", "1/1",
                "--sequential-threads", "1", "--out", str(out), "--set",
                "data.max_length=256", "data.heldout_samples=0", "data.max_samples=null",
                "training.num_anchors=8", "pipeline.tokens_per_batch=512")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    seq, pipe = report["results"]
    assert (seq["mode"], pipe["mode"]) == ("sequential", "pipelined")
    # The same steps: the same plan positions, so the same tokens.
    assert seq["tokens"] == pipe["tokens"] > 0
    assert seq["tokens_per_s"] > 0 and pipe["tokens_per_s"] > 0
    assert _fraction(pipe["data_wait_frac"])
    assert set(pipe["busy"]) == {"prefetch", "target", "drafter"}
    assert all(_fraction(v) for v in pipe["busy"].values())
    assert set(seq["stage_s"]) == {"collate", "target", "drafter"}
    summary = report["summary"]
    assert summary["pipelined_vs_sequential"] == pipe["tokens_per_s"] / seq["tokens_per_s"]
    assert summary["ideal_overlap_bound"] >= 1.0
    assert "pipelined (1/1) / sequential (1)" in proc.stdout
    assert "tok/s" in proc.stdout


@pytest.mark.slow
def test_attention_benchmark_compares_both_modes_at_small_shapes():
    proc = _run("attention_cpu", "--anchors", "4", "--seq-len", "64", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr
    header, row = proc.stdout.strip().splitlines()
    assert header.split()[0] == "anchors"
    anchors, sdpa, blockwise, ratio = row.split()
    assert anchors == "4" and float(sdpa) > 0 and float(blockwise) > 0
    assert math.isclose(float(ratio), float(blockwise) / float(sdpa), rel_tol=0.05, abs_tol=0.01)


@pytest.mark.slow
def test_dflash2_step_benchmark_tiny(tmp_path: Path):
    out = tmp_path / "dflash2_step.json"
    proc = _run("dflash2_step", "--vocab", "512", "--hidden", "64", "--blocks", "4", "--ranks", "8",
                "--rank", "8", "--top-k", "4", "--repeats", "2", "--warmup", "1", "--memory-steps", "1",
                "--samples", "1", "--threads", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    (group,) = report["groups"]
    assert group["shape"] == {"hidden": 64, "block": 4, "all_slots": False, "vocab": 512}
    base, arm = group["arms"]["dflash"], group["arms"]["dflash2-r8"]
    # The arms took turns: as many timed steps each.
    assert len(base["step_s"]) == len(arm["step_s"]) == 2
    assert base["time_ratio"] == 1.0
    assert math.isclose(arm["time_ratio"], sum(arm["step_s"]) / sum(base["step_s"]))
    assert base["peak_extra_mb"] > 0 and arm["peak_extra_mb"] > 0
    # The selector's codebooks and projection: 2 x vocab x rank + rank x hidden parameters more,
    # and the convolutions' (2 x 2 x 64 + 64 x 64 / 4 per sublayer, 2 per layer, 2 layers).
    conv = 2 * 2 * (2 * 2 * 64 + 64 * 2 * 2 * 64 // 16)
    assert arm["trainable_params"] - base["trainable_params"] == 2 * 512 * 8 + 8 * 64 + conv
    assert arm["adamw_state_mb"] == 2 * arm["weights_mb"]
    assert arm["extra_time_by_op"][0]["op"] == "total"
    assert isinstance(report["busy"], bool) and report["load_before"]["load_1m"] is not None
    assert "dflash2-r8" in proc.stdout and "ms/step" in proc.stdout


@pytest.mark.slow
def test_draft_vocab_benchmark_tiny(tmp_path: Path):
    out = tmp_path / "draft_vocab.json"
    proc = _run("draft_vocab", "--vocab", "512", "--hidden", "64", "--sizes", "64", "--blocks", "4",
                "--repeats", "2", "--warmup", "1", "--drafts", "1", "--samples", "1", "--no-coverage",
                "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    (group,) = report["groups"]
    assert group["shape"] == {"hidden": 64, "block": 4, "all_slots": False, "vocab": 512}
    full, pruned = group["arms"]["full"], group["arms"]["64"]
    # The arms took turns: as many timed steps and drafted blocks each.
    assert len(full["step_s_all"]) == len(pruned["step_s_all"]) == len(pruned["draft_s_all"]) == 2
    assert full["step_ratio"] == full["draft_ratio"] == 1.0
    assert math.isclose(pruned["step_ratio"], pruned["step_s_median"] / full["step_s_median"])
    assert isinstance(report["busy"], bool) and report["data_coverage"] is None
    assert "64 tokens: step" in proc.stdout
