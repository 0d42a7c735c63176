"""An export people can publish and use again: its README.md model card, the target recorded in
config.json (eval and generate find it without --target), counts with their unit, eval's output
next to the drafter without overwriting, and the memory estimate of train against its measured
peak."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.core.units import format_bytes, format_count
from dflash_trainer.training.model_card import RunFacts, model_card
from helpers_e2e import make_chat_jsonl, make_tiny_target, tiny_run_overrides


@pytest.mark.parametrize(("count", "text"), [(812, "812"), (41_248, "41.2K"), (7_750_000, "7.75M"),
                                             (135_000_000, "135M"), (1_050_000_000, "1.05B"), (999_600, "1M")])
def test_counts_carry_their_unit(count: int, text: str) -> None:
    assert format_count(count) == text


def test_sizes_carry_their_binary_unit() -> None:
    assert [format_bytes(n) for n in (512, 29.4 * 2**20, 1.4 * 2**30)] == ["512 B", "29.4 MiB", "1.4 GiB"]


def _config(architecture: str, block: int) -> dict:
    return {"architectures": [architecture], "block_size": block, "num_hidden_layers": 2, "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "dtype": "bfloat16",
            "dflash_config": {"block_size": block, "target_layer_ids": [1, 2], "mask_token_id": 7},
            "dflash_trainer": {"vocab_size": 100, "hidden_size": 64,
                               "target": {"name": "Qwen/Qwen3-8B", "revision": "abc123", "weights_sha256": None}}}


def test_the_card_names_the_target_the_drafter_and_each_engine_command() -> None:
    run = RunFacts(config={"data": {"paths": ["/data/chat.jsonl"], "max_length": 2048, "heldout_samples": 64},
                           "training": {"lr": 6e-4, "schedule": "cosine", "labels": "data"},
                           "model": {"drafter_init": "target"},
                           "eval": {"prompts": "mtbench", "in_training_prompts": 8, "max_new_tokens": 64}},
                   step=1200, samples=5000, tokens=1_000_000, tau=1.734, tau_step=1200, lossless=True)
    card = model_card(_config("DFlashDraftModel", 16), num_params=41_248, run=run)
    assert card.startswith("# DFlash drafter for Qwen/Qwen3-8B\n")
    for line in ["- target: `Qwen/Qwen3-8B`", "- target revision (Hugging Face commit): `abc123`",
                 "- block size: 16 (an anchor and 15 drafts)", "- tapped target layers: [1, 2]",
                 "- parameters: 41.2K (41,248), stored as bfloat16", "`chat.jsonl`", "5,000 training samples",
                 "- steps: 1200 (1,000,000 tokens)", "Acceptance length tau **1.734** at step 1200",
                 "first 8 prompts of `mtbench`, 64 new tokens each, lossless",
                 "dflash-trainer eval --drafter DRAFTER_FOLDER --target Qwen/Qwen3-8B --prompts mtbench "
                 "eval.num_prompts=8 eval.first_turn_only=true eval.max_new_tokens=64",
                 '"method": "dflash", "model": "DRAFTER_FOLDER", "num_speculative_tokens": 15',
                 "--speculative-algorithm DFLASH", "--speculative-num-draft-tokens 16",
                 "--spec-type draft-dflash", "--spec-draft-n-max 15"]:
        assert line in card, line


def test_the_card_of_a_dspark_export_serves_it_as_dspark_and_without_a_run() -> None:
    card = model_card(_config("DSparkDraftModel", 8), num_params=2_000_000, run=None)
    assert '"method": "dspark"' in card and "--spec-type draft-dspark" in card and "--spec-draft-n-max 7" in card
    assert "--speculative-algorithm" not in card and "## Training" not in card


@pytest.mark.slow
def test_a_run_exports_a_card_and_eval_finds_its_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = make_tiny_target(tmp_path / "target", layers=3)
    data = make_chat_jsonl(tmp_path / "chat.jsonl", num=16)
    run = tmp_path / "run"
    overrides = [*tiny_run_overrides(target=target, data=data, cache=tmp_path / "cache", run_dir=run),
                 "training.max_steps=4", "eval.every_steps=4", "eval.in_training_prompts=2",
                 "eval.max_new_tokens=8", "checkpoint.every_steps=2"]
    assert cli_main(["train", *overrides]) == 0
    out = capsys.readouterr().out
    assert re.search(r"memory: drafter [\d.]+K parameters \([\d.]+ [KM]iB float32\) \+ gradients .* estimated peak",
                     out), out
    assert "memory: peak resident memory while training" in out
    config = json.loads((run / "drafter" / "config.json").read_text())
    record = config["dflash_trainer"]["target"]
    assert record["name"] == str(target) and record["folder"] == str(target.resolve())
    assert len(record["weights_sha256"]) == 64 and record["revision"] is None
    card = (run / "drafter" / "README.md").read_text()
    assert f"# DFlash drafter for {target}" in card and "- steps: 4 (" in card
    assert re.search(r"Acceptance length tau \*\*[\d.]+\*\* at step 4", card), card

    # eval without --target: the recorded target, results next to the drafter (the run's eval/).
    argv = ["eval", "--drafter", str(run / "drafter"), "eval.num_prompts=1", "eval.max_new_tokens=8",
            "eval.first_turn_only=true", "model.dtype=float32"]
    assert cli_main(argv) == 0
    assert f"eval: target {target} as recorded in {run / 'drafter' / 'config.json'}" in capsys.readouterr().out
    assert (run / "eval" / "results.json").is_file()
    assert cli_main(argv) == 2
    assert "holds the results of an earlier evaluation (results.json); pass --overwrite" in capsys.readouterr().err
    assert cli_main([*argv, "--overwrite"]) == 0

    # export from a checkpoint: its own card; eval of an export elsewhere writes beside it.
    exported = tmp_path / "shared" / "my-drafter"
    assert cli_main(["export", "--checkpoint", str(run / "checkpoints" / "step-2"), "--out", str(exported)]) == 0
    assert re.search(r"exported drafter \(DFlash, [\d.]+K parameters", capsys.readouterr().out)
    card = (exported / "README.md").read_text()
    assert "- steps: 2 (" in card and "The run did not evaluate this drafter" in card
    assert cli_main(["eval", "--drafter", str(exported), "eval.num_prompts=1", "eval.max_new_tokens=4",
                     "model.dtype=float32"]) == 0
    assert (tmp_path / "shared" / "my-drafter-eval" / "results.json").is_file()


@pytest.mark.slow
def test_the_card_shows_the_final_evaluation(tmp_path: Path) -> None:
    """Without eval.every_steps the run evaluates after the export (eval.final): the card is
    written again with that tau."""
    target = make_tiny_target(tmp_path / "target", layers=3)
    data = make_chat_jsonl(tmp_path / "chat.jsonl", num=16)
    run = tmp_path / "run"
    assert cli_main(["train", *tiny_run_overrides(target=target, data=data, cache=tmp_path / "cache", run_dir=run),
                     "training.max_steps=2", "eval.final=true", "eval.in_training_prompts=1",
                     "eval.max_new_tokens=4"]) == 0
    card = (run / "drafter" / "README.md").read_text()
    assert re.search(r"Acceptance length tau \*\*[\d.]+\*\* at step 2: .* first 1 prompts of `mtbench`", card), card


@pytest.mark.slow
def test_a_recorded_target_that_is_gone_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(
        {"architectures": ["DFlashDraftModel"],
         "dflash_trainer": {"target": {"name": str(tmp_path / "gone"), "folder": str(tmp_path / "gone")}}}))
    assert cli_main(["eval", "--drafter", str(drafter)]) == 1
    assert (f"target error: --drafter {drafter} was trained for the target '{tmp_path / 'gone'}'"
            in capsys.readouterr().err)


@pytest.mark.slow
def test_the_memory_estimate_meets_the_measured_peak_on_the_demo_target(tmp_path: Path) -> None:
    """The demo's target and drafter (SmolLM2, two layers, 256 tokens per batch), float32: the peak
    resident memory while training, above the process before loading, lies within 25% of the
    estimate printed at the start (about 0.87 GiB; measured 1.05x-1.09x of it on a 2-core Xeon).
    In a process of its own: inside the test session, memory that earlier tests freed is reused
    by the allocator and hides part of the run's peak (0.78x seen there)."""
    run = subprocess.run([sys.executable, "-m", "dflash_trainer", "train", "--config", "demo-cpu.yaml",
                          "model.dtype=float32", "training.max_steps=10", f"run_dir={tmp_path / 'run'}",
                          "data.max_samples=300", "logging.console=false", "logging.tensorboard=false",
                          "checkpoint.async_save=false", "eval.final=false"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    measured = re.search(r"memory: peak resident memory while training, above the .* before loading: "
                         r"([\d.]+) (MiB|GiB) \(estimated ([\d.]+) (MiB|GiB), ([\d.]+)x the estimate\)", out)
    assert measured, out
    assert 0.8 <= float(measured.group(5)) <= 1.25, measured.group(0)
