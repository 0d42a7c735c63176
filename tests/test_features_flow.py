"""One config for every command: docs/features.md's two-command flow (``features``, then
``train`` from the store) with ``model.dtype: auto`` runs as written, through the real command
line, on a tiny random target; ``auto`` is decided once per machine (one probe, whatever thread
count the command runs with), the store records it, and ``train`` from a store takes the store's
dtype and says so.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml

from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import load_config
from dflash_trainer.features.manifest import Manifest
from dflash_trainer.model.dtypes import DTYPES, config_dtype, probe_cache_path
from dflash_trainer.training.trainer import Trainer
from helpers_e2e import make_chat_jsonl, make_tiny_target, tiny_run_overrides

# Two feature builds and a training on a tiny target, with the data prepared twice: about 40 s.
pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[1] / "docs" / "features.md"


@pytest.fixture
def probe_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty user cache of this test alone: the probe's file counts the decisions."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "user-cache"))
    threads = torch.get_num_threads()
    yield probe_cache_path()
    torch.set_num_threads(threads)  # train sets its own


def config_file(tmp_path: Path, *extra: str) -> Path:
    """A config file of a short run on a tiny target with ``model.dtype: auto`` and ``eval.final:
    true`` (the defaults)."""
    root = tmp_path / "assets"
    target = make_tiny_target(root / "target", layers=3, hidden=32)
    data = make_chat_jsonl(root / "chat.jsonl", num=12)
    overrides = [o for o in tiny_run_overrides(target=target, data=data, cache=root / "tokens",
                                               run_dir=tmp_path / "unused")
                 if not o.startswith(("model.dtype=", "run_dir=", "eval.final="))]
    overrides += ["training.epochs=1", *extra]
    cfg: dict = {}
    for item in overrides:
        key, value = item.split("=", 1)
        node = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def documented_commands() -> list[list[str]]:
    """The ``features`` command and the first ``train`` of the docs' first code block."""
    block = re.search(r"```bash\n(.*?)```", DOCS.read_text(), re.S)[1]
    commands = [shlex.split(line) for line in block.splitlines() if line.startswith("dflash-trainer ")]
    features = next(c for c in commands if c[1] == "features")
    train = next(c for c in commands if c[1] == "train")
    return [features, train]


def test_the_docs_two_command_flow_runs_as_written_with_dtype_auto(tmp_path: Path, probe_cache: Path, capsys):
    config = config_file(tmp_path, "eval.in_training_prompts=2", "eval.max_new_tokens=8")
    assert load_config(str(config)).model.dtype == "auto"
    store, run_dir = tmp_path / "stores" / "demo", tmp_path / "runs" / "lr1"
    written = {"configs/demo-cpu.yaml": str(config), "stores/demo": str(store), "runs/lr1": str(run_dir)}
    def in_tmp(arg: str) -> str:
        key, eq, value = arg.rpartition("=")
        return f"{key}{eq}{written.get(value, value)}"

    for command in documented_commands():
        args = [in_tmp(a) for a in command[1:]]
        assert cli_main(args) == 0, args
    out = capsys.readouterr().out
    # One decision on this machine, recorded by the store and taken by train.
    (entry,) = json.loads(probe_cache.read_text()).values()
    stored = Manifest.read(store).target_dtype
    assert stored == entry["choice"]
    assert f"model.dtype auto: {stored}, the dtype the feature store {store} was computed in" in out
    assert (run_dir / "drafter" / "model.safetensors").is_file()
    # The store run holds only the target's embedding and head: the final evaluation loads it whole.
    results = json.loads((run_dir / "eval" / "final" / "results.json").read_text())
    assert results["lossless"] is True and results["dtype"] == stored and len(results["per_prompt"]) == 2
    assert f"final evaluation (step {results['step']}): tau {results['tau']:.3f} on 2 mtbench prompts" in out
    # eval and demo resolve the config the same way, from the same decision.
    assert config_dtype(load_config(str(config)).model, "cpu") is DTYPES[stored]
    assert len(json.loads(probe_cache.read_text())) == 1


def test_train_from_a_store_with_auto_takes_the_stores_dtype(tmp_path: Path, probe_cache: Path, capsys):
    config = config_file(tmp_path)
    store = tmp_path / "store"
    assert cli_main(["features", "--config", str(config), "--out", str(store), "model.dtype=bfloat16"]) == 0
    capsys.readouterr()
    trainer = Trainer(load_config(str(config), [f"features.store={store}", f"run_dir={tmp_path / 'run'}"]))
    try:
        assert trainer.compute_dtype is torch.bfloat16
    finally:
        trainer.close()
    assert (f"model.dtype auto: bfloat16, the dtype the feature store {store} was computed in"
            in capsys.readouterr().out)
    assert not probe_cache.exists(), "the store decided: no probe"
