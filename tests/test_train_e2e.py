"""End to end: the real pipeline (prefetch -> target stage -> drafter loop -> monitor ->
checkpoints -> export) on a tiny random target, through the CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_trainer.cli import demo
from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.core.errors import LockError
from dflash_trainer.core.locks import run_folder_lock
from dflash_trainer.evaluation.prompt_sets import mtbench_prompts
from dflash_trainer.reporting.report import write_report
from helpers_e2e import make_chat_jsonl, make_tiny_target

# Full CLI runs (train, demo with evaluation): about a minute.
pytestmark = pytest.mark.slow

REQUIRED = ["train/loss", "train/acc", "train/acc_pos/1", "train/acc_pos/15", "train/tau_sim",
            "train/grad_norm", "train/grad_norm_max", "train/lr", "train/skipped_nonfinite",
            "data/bucket/0/dispatched", "data/bucket/0/trained", "data/seq_len_mean", "data/seq_len_max",
            "data/padding_efficiency", "data/max_same_bucket_run", "pipe/queue/batches",
            "pipe/queue/features", "pipe/prefetch/busy_frac", "pipe/target/busy_frac",
            "perf/tokens_per_s", "perf/samples_per_s", "perf/data_wait_frac", "perf/step_time_s",
            "perf/tflops"]


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("e2e")
    target = make_tiny_target(root / "target")
    data = make_chat_jsonl(root / "chat.jsonl", num=40)
    return target, data


def overrides(target: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [f"model.target={target}", f"data.paths=[{data}]", f"run_dir={run_dir}",
            f"data.cache_dir={run_dir.parent / 'cache'}", "data.max_length=256",
            "data.heldout_samples=0", "pipeline.tokens_per_batch=512", "pipeline.num_buckets=3",
            "training.num_anchors=16", "training.epochs=2", "logging.every_steps=2",
            "logging.console=false", "training.lr=1e-3", "eval.final=false", *extra]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_train_end_to_end(tiny_setup, tmp_path: Path):
    target, data = tiny_setup
    run = tmp_path / "run"
    code = cli_main(["train", *overrides(target, data, run, "checkpoint.every_steps=4")])
    assert code == 0
    records = read_jsonl(run / "metrics.jsonl")
    keys = set().union(*records)
    missing = [k for k in REQUIRED if k not in keys]
    assert not missing, missing
    last = records[-1]
    assert last["train/grad_norm"] > 0
    assert all(0 < r["data/padding_efficiency"] <= 1 for r in records if "data/padding_efficiency" in r)
    steps = last["step"]

    def per_bucket(kind: str) -> float:
        return sum(v for k, v in last.items() if k.startswith("data/bucket/") and k.endswith(f"/{kind}"))

    assert per_bucket("trained") == steps and per_bucket("dispatched") == steps
    # The plan statistics, once per epoch.
    plans = [r for r in records if "plan/steps" in r]
    assert [r["plan/epoch"] for r in plans] == [0, 1]
    assert sum(r["plan/steps"] for r in plans) == steps
    assert all(r["plan/dropped"] >= 0 and r["plan/run_limit"] >= 1 for r in plans)
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert losses[-1] < losses[0]
    # Exported drafter, resolved config, checkpoints and report.
    assert (run / "drafter" / "model.safetensors").is_file()
    assert (run / "config.yaml").is_file()
    assert (run / "checkpoints" / "latest").is_file()
    assert (run / "report" / "index.html").is_file()
    assert list((run / "tensorboard").glob("events.*"))
    # Any checkpoint exports to a servable folder.
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    out = tmp_path / "exported"
    assert cli_main(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]


def test_demo_command_end_to_end(tiny_setup, tmp_path: Path, capsys, monkeypatch):
    target, data = tiny_setup
    run = tmp_path / "demo"
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "user-cache"))  # the durations it records
    written = []

    def report_under_the_lock(run_dir):
        # Another writer is refused while the demo writes its results and report.
        with pytest.raises(LockError, match="is in use by pid"):
            run_folder_lock(run_dir).acquire()
        assert (Path(run_dir) / "eval" / "results.json").is_file()
        written.append(write_report(run_dir))
        return written[-1]

    monkeypatch.setattr(demo, "write_report", report_under_the_lock)
    # bf16 training: the demo evaluates against a float32 copy of the target (exact lossless).
    # Two steps: bf16 matmuls over the 49,152-token vocabulary crawl on CPUs without bf16
    # instructions (AVX2: ~1 GFLOP/s), and the path under test is the float32 evaluation copy.
    code = cli_main(["demo", *overrides(target, data, run, "training.max_steps=2", "model.dtype=bfloat16",
                                        "eval.prompts=mtbench", "eval.in_training_prompts=2",
                                        "eval.max_new_tokens=12")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert len(written) == 1 and not (run / ".lock").exists()  # released once the report is written
    assert "acceptance length tau" in out and "exported drafter" in out
    assert "training steps in bfloat16; evaluation in float32, expected " in out
    # The expected duration is printed before the first evaluation, and the run records the
    # ratios that the next demo with these settings on this machine estimates from.
    assert out.index("demo: expected about ") < out.index("demo: evaluating the untrained drafter")
    durations = json.loads((tmp_path / "user-cache" / "demo-durations.json").read_text())
    ratios = json.loads((run / "eval" / "results.json").read_text())["duration_ratios"]
    assert list(durations.values()) == [ratios]
    assert ratios["step_per_probe"] > 0 and ratios["eval_per_probe"] > 0
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["dtype"] == "bfloat16" and 0 < results["train_s"] < results["wall_s"]
    assert results["lossless"] and results["untrained_lossless"]
    # Both speedups timed side by side (alternating order), each with its reliability mark.
    assert isinstance(results["speedup_reliable"], bool) and isinstance(results["untrained_speedup_reliable"], bool)
    assert [r["target_first"] for r in results["per_prompt"]] == [True, False]
    assert "decode speedup (CPU)" in out and "speedup_measurement" in results
    assert 1.0 <= results["tau"] <= 16 and 1.0 <= results["untrained_tau"] <= 16
    # The trained drafter's answers, each with its acceptance trace, for the report to highlight.
    assert [r["prompt_text"] for r in results["per_prompt"]] == [p.turns[0] for p in mtbench_prompts()[:2]]
    assert all(r["lossless"] and r["trace"] and all("text" in e for e in r["trace"])
               for r in results["per_prompt"])
    taus = [r for r in read_jsonl(run / "metrics.jsonl") if "eval/tau" in r]
    assert [r["step"] for r in taus][0] == 0 and len(taus) == 2
    index = (run / "report" / "index.html").read_text()
    assert "The first 2 of 2 answers of eval/results." in index and index.count("<div class='answer'>") == 2
