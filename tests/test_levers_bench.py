"""benchmarks.levers end to end at tiny shapes: cache the target once, train two variants, print the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import levers
from helpers_e2e import make_chat_jsonl, make_tiny_target


@pytest.mark.slow
def test_levers_caches_once_and_measures_each_variant(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    target = make_tiny_target(tmp_path / "target", layers=4)
    data = make_chat_jsonl(tmp_path / "chat.jsonl", num=16)
    common = [f"model.target={target}", f"data.paths=[{data}]", f"data.cache_dir={tmp_path / 'tokens'}",
              "data.max_length=128", "data.heldout_samples=0", "model.dtype=float32", "model.num_layers=1",
              "training.num_anchors=4", "training.labels=kl", "training.loss_slots=3"]
    args = ["--config", "configs/demo-cpu.yaml", "--train-samples", "4", "--heldout-samples", "2",
            "--checkpoints", "2,4", "--seeds", "0", "--eval-anchors", "8",
            "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out.json")]
    for item in common:
        args += ["--set", item]
    variants = ["--variant", "rand:model.drafter_init=random,model.target_layer_ids=[1]",
                "--variant", "init:model.drafter_init=target,model.target_layer_ids=[1]",
                "--variant", "greedy:model.target_layer_ids=[1],training.labels=target_greedy,training.loss_slots=1"]
    assert levers.main(args + variants) == 0
    first = capsys.readouterr().out
    assert "cached target outputs of 6 samples, layers [1]" in first
    result = json.loads((tmp_path / "out.json").read_text())
    rows = {r["variant"]: r for r in result["results"]}
    assert set(rows) == {"rand", "init", "greedy"}
    for name, row in rows.items():
        assert set(row["agreement"]) == {"2", "4"}
        assert len(row["agreement"]["4"]) == (1 if name == "greedy" else 3)  # slots 1..loss_slots
        assert all(0.0 <= a <= 1.0 for a in row["agreement"]["4"])
    assert levers.main(["--markdown", str(tmp_path / "out.json")]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].startswith("| variant | overrides | seeds | slot-1 @ 2 | slot-1 @ 4 |")
    assert [line.split(" | ")[0] for line in table.splitlines()[2:]] == ["| rand", "| init", "| greedy"]
    # Same data, a layer the cache lacks: the cache is rebuilt with both layers, then reused.
    more = args[:-2] + ["--variant", "late:model.target_layer_ids=[2]"]
    assert levers.main(more) == 0
    assert "layers [1, 2]" in capsys.readouterr().out
    assert levers.main(more) == 0
    assert "cached target outputs" not in capsys.readouterr().out
