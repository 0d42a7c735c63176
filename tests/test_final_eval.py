"""``eval.final``: `train` evaluates the final drafter when ``eval.every_steps`` is unset (metrics,
``RUN_DIR/eval/final``, the report), ``eval.final=false`` turns it off, and a trainer that does not
hold the whole target says how to evaluate instead."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import load_config
from dflash_trainer.core.distributed import DistInfo
from dflash_trainer.evaluation.evaluate import InTrainingEval
from dflash_trainer.evaluation.prompt_sets import mtbench_prompts
from dflash_trainer.reporting.report import read_evals, read_metrics, summarize, verdict
from dflash_trainer.training import final_eval
from dflash_trainer.training.final_eval import final_eval_obstacle
from dflash_trainer.training.trainer import Trainer
from helpers_e2e import make_chat_jsonl, make_tiny_target, run_losses, tiny_run_overrides


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("final_eval")
    return {"target": make_tiny_target(root / "target", layers=3),
            "data": make_chat_jsonl(root / "chat.jsonl", num=16), "cache": root / "cache"}


def train(setup: dict[str, Path], run_dir: Path, *extra: str) -> int:
    return cli_main(["train", *tiny_run_overrides(target=setup["target"], data=setup["data"], cache=setup["cache"],
                                                  run_dir=run_dir),
                     "training.max_steps=2", "eval.prompts=mtbench", "eval.in_training_prompts=2",
                     "eval.max_new_tokens=8", *extra])


def eval_taus(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval/tau"] for r in rows if "eval/tau" in r}


@pytest.fixture(scope="module")
def runs(setup, tmp_path_factory) -> dict[bool, tuple[Path, str]]:
    """eval.final -> (run folder, console output) of the same short run."""
    out = {}
    for final in (True, False):
        run_dir = tmp_path_factory.mktemp("runs") / f"final-{final}"
        capture = io.StringIO()
        with contextlib.redirect_stdout(capture):
            assert train(setup, run_dir, f"eval.final={str(final).lower()}") == 0
        out[final] = (run_dir, capture.getvalue())
    return out


def test_train_evaluates_the_final_drafter_and_the_report_shows_it(runs):
    run_dir, out = runs[True]
    results = json.loads((run_dir / "eval" / "final" / "results.json").read_text())
    # The first turns of the first eval.in_training_prompts prompts, greedy, lossless, with tau.
    assert [r["prompt_text"] for r in results["per_prompt"]] == [p.turns[0] for p in mtbench_prompts()[:2]]
    assert results["step"] == 2 and results["prompts_source"] == "mtbench" and results["max_new_tokens"] == 8
    assert results["lossless"] is True and results["temperature"] == 0.0
    assert 1.0 <= results["tau"] <= 16 and sum(results["acceptance_hist"]) == results["steps"] > 0
    assert (run_dir / "eval" / "final" / "acceptance_hist.png").is_file()
    # Logged at the last step, as the in-training evaluation logs.
    assert eval_taus(run_dir) == {2: pytest.approx(results["tau"])}
    line = next(line for line in out.splitlines() if line.startswith("final evaluation (step 2): "))
    assert f"tau {results['tau']:.3f} on 2 mtbench prompts x 8 tokens" in line and "lossless yes" in line
    assert out.index("drafter exported to") < out.index("final evaluation (step 2)") < out.index("report: ")
    # The report (written by train) shows it: the summary's eval tau and the first screen's source.
    evals, skipped = read_evals(run_dir / "eval")
    log = read_metrics(run_dir / "metrics.jsonl")
    assert not skipped and dict(summarize(log, evals))["eval tau"] == f"{results['tau']:.4g}"
    v = verdict(log, evals)
    assert v.trained_tau == results["tau"] and v.lossless is True
    assert v.trained_source == "eval/final, 2 mtbench prompts x 8 tokens"
    index = (run_dir / "report" / "index.html").read_text()
    assert "eval/final, 2 mtbench prompts x 8 tokens" in index


def test_eval_final_false_evaluates_nothing_and_trains_the_same(runs):
    run_dir, out = runs[False]
    assert not (run_dir / "eval").exists() and eval_taus(run_dir) == {}
    assert "final evaluation" not in out
    evals, _ = read_evals(run_dir / "eval")
    assert verdict(read_metrics(run_dir / "metrics.jsonl"), evals).trained_source == "no evaluation"
    # Building the evaluator before training draws no random number the training uses.
    assert run_losses(run_dir) == run_losses(runs[True][0])


def test_with_eval_every_steps_the_last_step_is_evaluated_once(setup, tmp_path):
    run_dir = tmp_path / "run"
    args = [*tiny_run_overrides(target=setup["target"], data=setup["data"], cache=setup["cache"], run_dir=run_dir),
            "training.max_steps=4", "eval.every_steps=2", "eval.final=true", "eval.prompts=mtbench",
            "eval.in_training_prompts=1", "eval.max_new_tokens=8"]
    trainer = Trainer(load_config(None, args), evaluator=InTrainingEval.from_config)
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/tau" in r] == [2, 4]  # step 4 not evaluated twice
    results = json.loads((run_dir / "eval" / "final" / "results.json").read_text())
    assert results["step"] == 4 and results["tau"] == pytest.approx(eval_taus(run_dir)[4])


def test_a_bad_prompt_file_is_refused_before_training(setup, tmp_path, capsys):
    run_dir = tmp_path / "run"
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"nope": 1}\n')
    assert train(setup, run_dir, "eval.final=true", f"eval.prompts={bad}") == 1  # a data error
    assert f"{bad}:2: not a prompt" in capsys.readouterr().err
    assert not (run_dir / "checkpoints").exists()


def _parts(**kw):
    return SimpleNamespace(**{"store": None, "engine": None, "tokenizer": SimpleNamespace(chat_template="{{x}}"),
                              **kw})


@pytest.mark.parametrize(("overrides", "dist", "parts", "expected"), [
    ([], False, _parts(), None),
    (["features.store=/s"], False, _parts(store=object()), None),  # loads the whole target at the end
    (["engine.kind=vllm"], False, _parts(engine=object()),
     "the engine (engine.kind=vllm) holds the target, not the trainer; "
     "evaluate the exported drafter with `dflash-trainer eval --config runs/x/config.yaml --drafter runs/x/drafter`"),
    (["distributed.target=fsdp"], True, _parts(),
     "distributed.target=fsdp shards the target over the ranks and the evaluation runs on rank 0 alone; evaluate"),
    (["distributed.target=fsdp"], False, _parts(), None),  # one process: nothing is sharded
    (["distributed.drafter=fsdp"], True, _parts(), None),  # gathered for the export, evaluated whole
    ([], False, _parts(tokenizer=SimpleNamespace(chat_template=None)),
     "the target's tokenizer has no chat template to render the evaluation prompts with"),
    ([], False, _parts(tokenizer=None), "the target's tokenizer has no chat template"),
])
def test_final_eval_obstacles(overrides, dist, parts, expected):
    cfg = load_config(None, ["run_dir=runs/x", *overrides])
    info = DistInfo(rank=0, world_size=2 if dist else 1, local_rank=0, device=torch.device("cpu"))
    found = final_eval_obstacle(cfg, info, parts)
    assert found == expected if expected is None else found.startswith(expected)


def test_a_whole_target_that_does_not_fit_beside_the_training_state_skips_with_the_eval_command(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(final_eval, "load_target", out_of_memory)
    cfg = load_config(None, ["run_dir=runs/x", "model.target=smollm2"])
    parts = SimpleNamespace(device=torch.device("cpu"), compute_dtype=torch.float32)
    assert final_eval.load_whole_target(cfg, parts) == (
        "the whole target smollm2 does not fit in cpu's memory beside the training state; evaluate the "
        "exported drafter with `dflash-trainer eval --config runs/x/config.yaml --drafter runs/x/drafter`")
