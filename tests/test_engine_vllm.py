"""The target served by a real vLLM server (``engine.kind=vllm``) on a tiny random Llama:
features equal to the in-process target's, into the store and online, training with the same
batches and losses, refusals of an engine serving another model, and an engine that dies or
hangs mid-run (one line, a final checkpoint, ``--resume auto`` continuing as an uninterrupted
run).

One server (started by the project's own code, in ``.venv-vllm``) serves every test that names
it by ``engine.url``; the death test starts and kills its own. ``.venv-vllm`` is built by
``make serve-check`` (``.ci/run`` builds it before ``make test``); without it these tests skip
outside CI and fail in CI.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import EngineConfig, load_config
from dflash_trainer.core.distributed import DistInfo
from dflash_trainer.core.errors import ConfigError, EngineError
from dflash_trainer.features.build import build_store
from dflash_trainer.features.engine import EngineLayout, engine_command, start_engine
from dflash_trainer.features.store import FeatureStore
from dflash_trainer.training.trainer import Trainer
from helpers_e2e import make_chat_jsonl, make_tiny_target, run_losses as losses, tiny_run_overrides
from helpers_e2e import train_recording as train

VENV = Path(__file__).resolve().parents[1] / ".venv-vllm"
SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
LOSS_RTOL = 1e-4
"""Per-step losses from vLLM's features and from the in-process target's, float32: the same
arithmetic in other kernels (features agree to about 1e-6 relative)."""
FEATURE_RTOL = 1e-4


def test_layout_maps_the_run_layers_onto_vllms_sorted_unique_numbering():
    layout = EngineLayout(layer_ids=(5, 1, 5), num_layers=8, hidden_size=16, final=True)
    assert layout.aux_ids == [2, 6, 8]  # layer L is vLLM's L + 1; the last layer's output is 8
    assert layout.feature_columns == [1, 0, 1] and layout.final_column == 2
    assert EngineLayout(layer_ids=(0, 3), num_layers=8, hidden_size=16, final=False).aux_ids == [1, 4]


def test_engine_command_names_the_connector_layers_and_exchange_folder(tmp_path: Path):
    layout = EngineLayout(layer_ids=(0, 2), num_layers=4, hidden_size=8, final=True)
    command = engine_command(Path("/v/bin/python"), Path("/m"), port=9, dtype="float32", max_model_len=129,
                             layout=layout, exchange=tmp_path, cfg=EngineConfig(extra_args=["--x", "1"]))
    spec = json.loads(command[command.index("--speculative-config") + 1])
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert transfer["kv_connector"] == "DFlashHiddenStatesConnector"
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path)
    assert "--enforce-eager" in command and command[-2:] == ["--x", "1"]


@pytest.mark.parametrize("override, message", [
    (["engine.url=http://127.0.0.1:1"], "engine.url='http://127.0.0.1:1' is set but engine.kind is transformers"),
    (["engine.kind=vllm", "eval.every_steps=5"], "eval.every_steps needs the whole target in the trainer"),
    (["engine.kind=vllm", "distributed.target=fsdp"], "with engine.kind=vllm the engine holds the target"),
])
def test_engine_options_that_cannot_work_are_refused(override: list[str], message: str):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override)


# --- a real vLLM server --------------------------------------------------------------------

def _need_vllm() -> None:
    if not (VENV / "bin" / "python").is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{VENV} is missing: .ci/run builds it before make test")
        pytest.skip(f"{VENV} is missing (make serve-check builds it)")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Any]:
    _need_vllm()
    root = tmp_path_factory.mktemp("engine")
    # 4 heads of 64: a head size vLLM's CPU attention supports.
    return {"root": root, "target": make_tiny_target(root / "target", layers=3, hidden=256),
            "data": make_chat_jsonl(root / "chat.jsonl", num=16), "cache": root / "cache",
            "exchange": root / "exchange"}


@pytest.fixture(scope="module")
def engine(setup) -> Iterator[Any]:
    """One server for layers [0, 1] and the last layer (the runs' greedy labels)."""
    layout = EngineLayout(layer_ids=(0, 1), num_layers=3, hidden_size=256, final=True)
    server = start_engine(EngineConfig(venv=str(VENV), startup_timeout_s=600), model=setup["target"],
                          layout=layout, exchange=setup["exchange"], dtype="float32", max_model_len=129,
                          log_path=setup["root"] / "engine.log", say=lambda _: None)
    try:
        yield server
    finally:
        server.stop()


def overrides(setup: dict[str, Any], run_dir: Path, *extra: str) -> list[str]:
    return [*tiny_run_overrides(target=setup["target"], data=setup["data"], cache=setup["cache"],
                                run_dir=run_dir),
            "training.labels=target_greedy", "features.dtype=float32", "checkpoint.every_steps=2",
            "checkpoint.keep_last=10", f"engine.venv={VENV}", *extra]


def via(engine: Any, setup: dict[str, Any]) -> list[str]:
    return ["engine.kind=vllm", f"engine.url={engine.url}", f"engine.exchange_dir={setup['exchange']}"]


def assert_close(a: dict[int, float], b: dict[int, float]) -> None:
    assert a.keys() == b.keys() and a
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=LOSS_RTOL), step


@pytest.mark.slow
def test_a_store_built_by_vllm_holds_the_in_process_features(setup, engine, tmp_path: Path):
    stores = {}
    for name, extra in (("local", []), ("vllm", via(engine, setup))):
        cfg = load_config(None, overrides(setup, tmp_path / "unused", f"features.store={tmp_path / name}", *extra))
        result = build_store(cfg, SINGLE, out=tmp_path / name, say=lambda _: None)
        assert result.complete
        stores[name] = FeatureStore.open(tmp_path / name, expected=result.manifest, dtype=torch.float32)
    local, served = stores["local"], stores["vllm"]
    assert local.manifest == served.manifest  # one format, whoever computed it
    for i in range(local.manifest.num_samples):
        a, b = local.sample(i), served.sample(i)
        assert torch.allclose(b.features, a.features, rtol=FEATURE_RTOL, atol=FEATURE_RTOL), i
        assert torch.equal(b.labels, a.labels), i
    assert not list(setup["exchange"].glob("*.safetensors"))  # every file read and removed


@pytest.mark.slow
def test_training_online_from_vllm_equals_the_in_process_target(setup, engine, tmp_path: Path):
    local, _ = train(overrides(setup, tmp_path / "local"))
    served, trainer = train(overrides(setup, tmp_path / "vllm", *via(engine, setup)))
    assert served == local  # the same batches in the same order
    assert_close(losses(tmp_path / "local"), losses(tmp_path / "vllm"))
    rows = [json.loads(line) for line in (tmp_path / "vllm" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("pipe/engine/requests", 0) for r in rows) >= 16
    assert all(r.get("pipe/engine/inflight", 0) <= 8 for r in rows)  # engine.max_inflight
    assert any("pipe/engine/exchange_mb" in r for r in rows) and any("perf/data_wait_frac" in r for r in rows)
    # No decoder layer of the target is in the trainer: the engine runs them.
    assert all(p.is_meta for n, p in trainer.target.named_parameters() if n.startswith("model.layers."))


@pytest.mark.slow
def test_a_slow_drafter_pauses_the_requests(setup, engine, tmp_path: Path):
    """Backpressure: the engine answers no more rows than the batches trained and the few
    between the engine and the drafter (the one the target stage holds, the one in the bounded
    features channel, the one the step loop took), of 32 rows in two epochs."""
    rows: list[int] = []
    ahead: list[int] = []

    def slow_drafter(batch: Any) -> None:
        rows.append(len(batch.sample_ids))
        time.sleep(0.5)  # the engine would answer every row of the epoch meanwhile
        ahead.append(trainer.parts.engine.client.total_requests - sum(rows))

    trainer = Trainer(load_config(None, overrides(setup, tmp_path / "run", *via(engine, setup),
                                                  "pipeline.feature_queue_size=1")))
    try:
        trainer.train(on_batch=slow_drafter)
    finally:
        trainer.close()
    assert sum(rows) == 32 and max(ahead) <= 3 * max(rows), (ahead, rows)


def refusal(capsys, args: list[str]) -> tuple[int, str]:
    """Exit code and the error line (the progress lines of prepare come before it)."""
    capsys.readouterr()
    code = cli_main(args)
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    return code, err.splitlines()[-1]


@pytest.mark.slow
def test_an_engine_serving_another_model_is_refused_before_training(setup, engine, tmp_path: Path, capsys):
    other = make_tiny_target(tmp_path / "other", layers=3, hidden=128)
    args = overrides(setup, tmp_path / "run", *via(engine, setup))
    code, err = refusal(capsys, ["train", *args, f"model.target={other}"])
    assert code == 1 and err.startswith("dflash-trainer train: engine error:"), err
    assert "hidden_size=256" in err and "hidden_size=128" in err
    assert not (tmp_path / "run" / "checkpoints").exists()
    # The engine started for other layers: its hidden states have another shape.
    code, err = refusal(capsys, ["train", *args, "training.labels=data"])
    assert code == 1 and "print-engine-command" in err, err
    assert "[tokens, 2, 256]" in err and ", 3, 256]" in err


@pytest.mark.slow
def test_an_engine_that_dies_stops_training_with_a_checkpoint_and_resume_continues(setup, engine,
                                                                                   tmp_path: Path):
    full, _ = train(overrides(setup, tmp_path / "full", *via(engine, setup)))
    split = overrides(setup, tmp_path / "split", "engine.kind=vllm", f"engine.venv={VENV}")
    trainer = Trainer(load_config(None, split))
    records: list[tuple] = []

    def kill_engine_at_step_5(batch: Any) -> None:
        records.append((batch.epoch, batch.step, tuple(batch.sample_ids.tolist())))
        server = trainer.parts.engine.client.server
        if trainer.drafter_step.optimizer_step == 5 and server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGKILL)

    try:
        with pytest.raises(EngineError) as caught:
            trainer.train(on_batch=kill_engine_at_step_5)
    finally:
        trainer.close()
    # The features already in the pipeline's channel are trained on before the failure shows.
    step = trainer.drafter_step.optimizer_step
    message = str(caught.value)
    assert "exited with status" in message and str(tmp_path / "split" / "engine-vllm.log") in message
    assert f"checkpoint at step {step}" in message and "--resume auto" in message
    assert step >= 5 and (tmp_path / "split" / "checkpoints" / f"step-{step}").is_dir()
    # The engine restarted (here: the test's server) and the run resumed: exactly the batches
    # and losses of the uninterrupted run.
    rest, _ = train([*split, *via(engine, setup), "checkpoint.resume=auto"])
    assert records[:step] + rest == full
    assert_close(losses(tmp_path / "full"), losses(tmp_path / "split"))


@pytest.mark.slow
def test_an_engine_that_hangs_is_reported_after_the_request_timeout(setup, engine, tmp_path: Path):
    group = engine.process.pid
    stopped: list[bool] = []

    def stop_engine_at_step_3(batch: Any) -> None:
        if trainer.drafter_step.optimizer_step == 3 and not stopped:
            stopped.append(True)
            os.killpg(group, signal.SIGSTOP)

    trainer = Trainer(load_config(None, overrides(setup, tmp_path / "run", *via(engine, setup),
                                                  "engine.request_timeout_s=3")))
    try:
        with pytest.raises(EngineError, match=r"within 3 s \(engine.request_timeout_s\)"):
            trainer.train(on_batch=stop_engine_at_step_3)
    finally:
        os.killpg(group, signal.SIGCONT)
        trainer.close()
    step = trainer.drafter_step.optimizer_step
    assert step >= 3 and (tmp_path / "run" / "checkpoints" / f"step-{step}").is_dir()


RESULT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "engine-features.json"


def test_the_committed_comparison_meets_its_stated_tolerances():
    """benchmarks/engine_features.py on the demo's first 64 samples (docs/features.md quotes it):
    every tapped layer within the tolerances the result states, and the greedy labels agree."""
    from benchmarks.engine_features import TOLERANCES

    result = json.loads(RESULT.read_text())["features"]
    assert result["samples"] == 64 and result["dtype"] == "float32"
    assert result["tolerances"] == TOLERANCES
    assert len(result["per_layer"]) == len(result["layer_ids"]) >= 2
    for row in result["per_layer"]:
        assert row["cosine_min"] >= TOLERANCES["cosine_min"], row
        assert row["rel_err_max"] <= TOLERANCES["rel_err_max"], row
        assert row["rel_err_mean"] <= TOLERANCES["rel_err_mean"], row
    assert result["label_agreement"] >= TOLERANCES["label_agreement"]
    assert len(result["throughput"]["rounds"]) >= 4  # both arms, alternating, load recorded
    assert all("load_before" in r for r in result["throughput"]["rounds"])


def test_the_committed_training_rows_agree_within_the_seed_spread():
    """300 demo steps online from vLLM and from the in-process target (seed 0), and in-process
    with seed 1: vLLM's tau lies within the two seeds' spread of the same seed's, and every
    evaluated output is lossless."""
    rows = {(r["arm"], r["seed"]): r for r in json.loads(RESULT.read_text())["training"]}
    served, local, other = rows["vllm", 0], rows["in_process", 0], rows["in_process", 1]
    assert served["steps"] == local["steps"] == other["steps"] == 300
    assert abs(served["tau"] - local["tau"]) <= abs(local["tau"] - other["tau"])
    for row in rows.values():
        assert row["lossless_failures"] == 0 and row["lossless_identical"] + row["lossless_numerics"] == 20, row
        assert row["steps_per_s"] > 0 and "load_before" in row["train"]
