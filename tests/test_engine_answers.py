"""An engine's answers are untrusted input (``engine.kind=vllm`` with ``engine.url``).

Each case runs ``dflash-trainer train`` through the real command line against a stub vLLM server
(:mod:`helpers_engine_stub`) that misbehaves in one way: it names a file outside the exchange
folder, a link or a FIFO in it, or answers with JSON, tensors, dtypes, shapes, token ids or
values that are wrong. Each is refused in one line naming the server, with the exit code of
docs/errors.md, and nothing outside the exchange folder is read, moved or deleted.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from helpers_e2e import make_chat_jsonl, make_tiny_target, serving
from helpers_engine_stub import StubEngine

from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.core import assets
from dflash_trainer.core.errors import EngineError
from dflash_trainer.features.engine_answers import exchange_file

LAYERS = (0, 1)
"""The runs' tapped layers: vLLM's auxiliary layers 1 and 2."""
HIDDEN = 64


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("engine-answers")
    target = make_tiny_target(root / "target", layers=3, hidden=HIDDEN)
    return {"target": target, "data": make_chat_jsonl(root / "chat.jsonl", num=8), "cache": root / "cache",
            "tokenizer": assets.load_tokenizer(target)}


def train_args(world: dict[str, Any], tmp: Path, url: str, exchange: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(world["data"]), f"model.target={world['target']}",
            f"data.cache_dir={world['cache']}", f"run_dir={tmp / 'run'}", "data.max_length=128",
            "pipeline.tokens_per_batch=256", "data.heldout_samples=0", "model.target_layer_ids=[0,1]",
            "model.dtype=float32", "pipeline.num_threads=1", "training.num_anchors=4",
            "logging.console=false", "logging.tensorboard=false", "training.max_steps=4",
            "engine.kind=vllm", f"engine.url={url}", f"engine.exchange_dir={exchange}",
            "engine.max_inflight=2", *extra]


def run(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, list[str]]:
    """Exit code and the ``dflash-trainer train:`` lines on stderr (a traceback fails)."""
    capsys.readouterr()
    code = cli_main(args)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, [line for line in err.splitlines() if line.startswith("dflash-trainer train: ")]


def stub(world: dict[str, Any], exchange: Path, **kwargs: Any) -> StubEngine:
    return StubEngine(exchange=exchange, tokenizer=world["tokenizer"], layers=len(LAYERS), hidden=HIDDEN,
                      **kwargs)


# --- the exchange folder is a boundary ------------------------------------------------------

@pytest.mark.parametrize("fault, why", [
    ("outside", "which lies outside the exchange folder"),
    ("dotdot", "which climbs out of its folder with '..'"),
    ("symlink", "a symbolic link: the trainer does not follow links in engine.exchange_dir"),
    ("fifo", "which is not a regular file"),
])
def test_a_file_outside_the_exchange_folder_is_neither_read_nor_deleted(
        world: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], fault: str, why: str):
    exchange = tmp_path / "exchange"
    # victim.safetensors beside the exchange folder: what `exchange/../victim.safetensors` reaches.
    victim = tmp_path / ("victim.safetensors" if fault == "dotdot" else "victim.txt")
    victim.write_text("the user's own file\n")
    with serving(stub(world, exchange, fault=fault, victim=victim), join_timeout=5) as server:
        code, lines = run(capsys, train_args(world, tmp_path, server.url, exchange))
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"dflash-trainer train: engine error: the vLLM engine at {server.url} named "), lines
    assert why in lines[0] and "nothing was read or deleted" in lines[0], lines
    assert victim.read_text() == "the user's own file\n"
    if fault == "symlink":
        [link] = exchange.glob("*.safetensors")
        assert link.is_symlink() and link.resolve() == victim
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- every answer is validated before it is used ---------------------------------------------

ANSWER_CASES = [
    ("float-ids", "wrote token_ids as float32 for the request of"),
    ("int8-hidden", "wrote hidden_states as int8 for the request of"),
    ("no-token-ids", "has no token_ids tensor (it holds ['hidden_states'])"),
    ("nan", "returned 1 non-finite hidden-state value(s) (NaN or inf, the first at token"),
    ("inf", "returned 1 non-finite hidden-state value(s) (NaN or inf, the first at token"),
    ("other-tokens", "with the hidden states of other tokens"),
    ("wrong-shape", f"this run needs [tokens, 2, {HIDDEN}] ({{n}} tokens, the requested layers, the hidden size)"),
    ("damaged-file", "the engine's hidden-states file does not load"),
    ("no-path", "returned no hidden_states_path"),
    ("path-not-text", "named the hidden-states file [", ),
    ("list-body", "returned no hidden_states_path"),
    ("not-json", "answered /v1/completions with something that is not JSON"),
    ("tokens-missing", "answered /tokenize without a list of token ids under 'tokens'"),
    ("tokens-floats", "answered /tokenize without a list of token ids under 'tokens'"),
    ("models-empty", "answered /v1/models without a model"),
]


@pytest.mark.parametrize("fault, fragment", ANSWER_CASES)
def test_a_wrong_answer_is_refused_in_one_line_before_training(
        world: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], fault: str, fragment: str):
    exchange = tmp_path / "exchange"
    with serving(stub(world, exchange, fault=fault), join_timeout=5) as server:
        code, lines = run(capsys, train_args(world, tmp_path, server.url, exchange))
    assert code == 1 and len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("dflash-trainer train: engine error: ") and server.url in line, line
    if "{n}" in fragment:
        fragment = fragment.format(n=line.split("for the request of ")[1].split()[0])
    assert fragment in line, line
    if fault in ("float-ids", "int8-hidden", "nan", "inf", "other-tokens", "no-token-ids", "wrong-shape"):
        assert "the request of " in line, line  # the request is named
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused at the probe, before any step
    if fault not in ("no-path", "path-not-text", "list-body", "not-json"):
        assert not list(exchange.glob("*.safetensors")), "a file read is deleted, good or bad"


def test_nan_hidden_states_mid_run_stop_with_the_engine_named_and_a_checkpoint(
        world: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """NaNs from the engine after some steps: one line naming the engine and the request, never
    an optimizer step on them, a checkpoint of the steps before and a resume that continues."""
    exchange = tmp_path / "exchange"
    args = train_args(world, tmp_path, "URL", exchange, "training.max_steps=none", "training.epochs=2",
                      "logging.every_steps=1")
    with serving(stub(world, exchange, fault="nan", fault_from=6), join_timeout=5) as server:
        code, lines = run(capsys, [a.replace("URL", server.url) for a in args])
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"dflash-trainer train: engine error: {exchange}/"), lines
    assert f"the vLLM engine at {server.url} returned 1 non-finite hidden-state value(s)" in lines[0]
    assert "nothing of it was trained on; training stopped with a checkpoint at step " in lines[0], lines
    step = int(lines[0].split("checkpoint at step ")[1].split()[0])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert step >= 1 and (tmp_path / "run" / "checkpoints" / f"step-{step}").is_dir()
    assert losses and all(math.isfinite(v) for v in losses)
    assert all(r.get("train/skipped_nonfinite", 0) == 0 for r in rows)
    with serving(stub(world, exchange), join_timeout=5) as server:
        code, lines = run(capsys, [a.replace("URL", server.url) for a in args] + ["checkpoint.resume=auto"])
    assert code == 0 and not lines, lines


def test_an_engine_url_that_is_not_http_is_a_config_error_before_anything_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    missing = tmp_path / "no-target"  # never loaded: the URL is refused first
    code, lines = run(capsys, ["train", "--data", str(tmp_path / "no-data.jsonl"), f"model.target={missing}",
                               f"run_dir={tmp_path / 'run'}", "engine.kind=vllm", "engine.url=not a url"])
    assert code == 2 and lines == [
        "dflash-trainer train: config error: engine.url='not a url' is not an http(s) URL; give the vLLM "
        "server's address, e.g. engine.url=http://127.0.0.1:8000 (or unset it to start a server)"], lines
    assert not (tmp_path / "run").exists()


def test_the_exchange_boundary_by_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Paths an engine may name: inside the folder (also through a link to the folder itself, as
    a shared mount may be reached); not in a subfolder, beside it, without the suffix, or not text."""
    real = tmp_path / "real-exchange"
    (real / "sub").mkdir(parents=True)
    link = tmp_path / "exchange"
    link.symlink_to(real, target_is_directory=True)
    ok = exchange_file(str(link / "a.safetensors"), exchange=link, server="S")
    assert ok.folder == real.resolve() and ok.name == "a.safetensors"
    assert exchange_file(str(real / "b.safetensors"), exchange=link, server="S").name == "b.safetensors"
    monkeypatch.chdir(tmp_path)
    assert exchange_file("exchange/c.safetensors", exchange=link, server="S").name == "c.safetensors"
    for named, why in [(str(real / "sub" / "d.safetensors"), "lies outside the exchange folder"),
                       (str(tmp_path / "e.safetensors"), "lies outside the exchange folder"),
                       (str(real / "f.txt"), "is not a .safetensors file"),
                       (str(real / ".safetensors"), "is not a .safetensors file"),
                       (str(real / "sub" / ".." / "g.safetensors"), "climbs out of its folder with '..'"),
                       (str(real / "h\x00.safetensors"), "holds a NUL byte"),
                       (7, "is not a path")]:
        with pytest.raises(EngineError, match=re.escape(why)):
            exchange_file(named, exchange=link, server="S")


def test_the_model_folder_the_engine_names_is_compared_only_when_it_reads_as_a_config(
        world: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """``/v1/models`` names the engine's model folder: another hidden size there is refused; a
    config.json that is not JSON is skipped with a warning (the tokenizer and the probe's hidden
    states still check the engine), never a traceback."""
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"hidden_size": 128, "num_hidden_layers": 3}))
    exchange = tmp_path / "exchange"
    with serving(stub(world, exchange, root=other), join_timeout=5) as server:
        code, lines = run(capsys, train_args(world, tmp_path, server.url, exchange))
    assert code == 1 and len(lines) == 1, lines
    assert (f"engine error: the vLLM engine at {server.url} serves {other} with hidden_size=128, the target "
            f"{world['target']} has hidden_size={HIDDEN}") in lines[0], lines
    (other / "config.json").write_text("{not json")
    with serving(stub(world, exchange, root=other), join_timeout=5) as server:
        code, lines = run(capsys, train_args(world, tmp_path / "again", server.url, exchange, "training.max_steps=1"))
    assert code == 0 and not lines, lines
