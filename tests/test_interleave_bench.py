"""benchmarks.interleave at tiny shapes: both orders through the real trainer, same start,
same batches in another order, every reported figure present, the JSON and the PNG written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import interleave as bench
from helpers_e2e import make_chat_jsonl, make_tiny_target


def test_curve_stats_on_known_curves():
    steps = 200
    buckets = np.tile([0, 1], steps // 2)
    flat = np.full(steps, 2.0)
    stats = bench.curve_stats(flat, np.ones(steps), buckets, window=21, jump=0.1, skip=20)
    assert stats["loss_residual_std"] == pytest.approx(0.0, abs=1e-12)
    assert stats["loss_jump_share"] == 0.0 and stats["grad_norm_spikes"] == 0
    assert stats["longest_run"] == 1
    # A loss level per bucket and one grad-norm spike: the bucket explains the residual.
    two_levels = np.where(buckets == 1, 3.0, 2.0)
    grad = np.ones(steps)
    grad[150] = 5.0
    stats = bench.curve_stats(two_levels, grad, buckets, window=21, jump=0.1, skip=20)
    assert stats["bucket_eta2"] > 0.99
    assert stats["loss_jump_share"] == 1.0
    assert stats["grad_norm_spikes"] == 1
    assert stats["per_bucket_late"][1]["mean_loss"] == pytest.approx(3.0)


@pytest.mark.slow
def test_benchmark_end_to_end_tiny(tmp_path: Path):
    target = make_tiny_target(tmp_path / "target", layers=4, hidden=32)
    data = make_chat_jsonl(tmp_path / "chat.jsonl", num=40)
    out, png = tmp_path / "interleave.json", tmp_path / "interleave.png"
    args = bench.parse_args([
        "--steps", "6", "--seeds", "3", "--work-dir", str(tmp_path / "runs"), "--skip", "1",
        "--window", "3", "--heldout-anchors", "8", "--out", str(out), "--png", str(png),
        "--set", f"model.target={target}", "--set", f"data.paths=[{data}]",
        "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.max_length=256",
        "--set", "data.heldout_samples=6", "--set", "pipeline.tokens_per_batch=256",
        "--set", "pipeline.bucket_boundaries=[60,120]", "--set", "model.dtype=float32",
        "--set", "training.num_anchors=8", "--set", "training.loss_slots=3",
        "--set", "pipeline.prefetch_workers=1", "--set", "model.num_layers=1"])
    report = bench.run(args)
    runs = report["results"]["3"]
    a, b = runs["interleave"], runs["shuffle"]
    assert a["steps"] == b["steps"] == 6
    assert a["init_checksum"] == b["init_checksum"]
    for run in (a, b):
        assert len(run["loss"]) == len(run["grad_norm"]) == len(run["bucket"]) == 6
        assert np.isfinite(run["heldout_loss"]) and 0 <= run["heldout_acc_slot1"] <= 1
        assert run["heldout_batches"] >= 1
        for key in ("longest_run", "loss_residual_std", "loss_jump_share", "grad_norm_spikes",
                    "bucket_eta2"):
            assert key in run
    assert json.loads(out.read_text())["results"]["3"]["shuffle"]["steps"] == 6
    assert png.stat().st_size > 10_000
    replot = tmp_path / "replot.png"
    assert bench.main(["--replot", str(out), "--png", str(replot)]) == 0
    assert replot.stat().st_size > 10_000
    assert sum(r["samples"] for r in report["histogram"]) > 0
