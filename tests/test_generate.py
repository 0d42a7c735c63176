"""``dflash-trainer generate`` on the drafter of a real (tiny) training run: streamed answer,
marked spans, statistics, the lossless check, prompt files and the interactive loop."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from dflash_trainer.core.assets import load_tokenizer, resolve_target
from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.evaluation.generate import SpanWriter, generate_answer, legend, span_colour
from dflash_trainer.evaluation.spec_decode import Span
from helpers_e2e import make_chat_jsonl, make_tiny_target

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, Path]:
    """(target folder, exported drafter folder) of a short real training run."""
    root = tmp_path_factory.mktemp("generate")
    target = make_tiny_target(root / "target")
    data = make_chat_jsonl(root / "chat.jsonl", num=16)
    run = root / "run"
    code = cli_main(["train", f"model.target={target}", f"data.paths=[{data}]", f"run_dir={run}",
                     f"data.cache_dir={root / 'cache'}", "data.max_length=128", "data.heldout_samples=0",
                     "pipeline.tokens_per_batch=512", "pipeline.num_buckets=2", "training.num_anchors=8",
                     "training.max_steps=3", "logging.every_steps=1", "logging.console=false",
                     "logging.tensorboard=false", "eval.final=false"])
    assert code == 0
    # The run logs the bucket of every micro-batch (the report's strip under the loss curve).
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    buckets = [b for r in records for b in r.get("data/step_buckets", [])]
    assert len(buckets) == 3 and set(buckets) <= {0.0, 1.0}
    return target, run / "drafter"


def generate(capsys, target: Path, drafter: Path, *args: str) -> tuple[int, str, str]:
    code = cli_main(["generate", "--drafter", str(drafter), "--target", str(target), "--max-new-tokens", "12",
                     *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_generate_command_on_a_trained_drafter(tiny_run, capsys, tmp_path, monkeypatch):
    target, drafter = tiny_run
    code, out, _ = generate(capsys, target, drafter, "--prompt", "the model drafts tokens", "--check")
    assert code == 0, out
    assert "[accepted draft tokens]" in out  # the plain-text legend: stdout is not a terminal
    assert "you> the model drafts tokens" in out and "assistant> " in out
    assert re.search(r"tau \d\.\d\d: 12 tokens in \d+ verify steps", out), out
    assert re.search(r"^ +1 tokens/step +\d+ +#+$", out, re.M), out
    assert re.search(r"speculative [\d.]+, target-only [\d.]+, "
                     r"speedup [\d.]+( \(unreliable[^)]*\))? \(back to back\)", out), out
    assert "lossless: identical to the target's greedy answer (12 tokens)" in out

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first question\n\nsecond question\n")
    code, out, _ = generate(capsys, target, drafter, "--prompts", str(prompts))
    assert code == 0 and out.count("=== prompt") == 2 and out.count("assistant> ") == 2
    assert "lossless" not in out  # no --check

    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\nand again\n\n"))
    code, out, _ = generate(capsys, target, drafter, "--interactive")
    assert code == 0 and out.count("assistant> ") == 2 and "interactive:" in out

    code, _, err = generate(capsys, target, drafter)  # no prompt source
    assert code == 2 and "exactly one of --prompt TEXT, --prompts FILE or --interactive" in err
    code, _, err = generate(capsys, target, tmp_path, "--prompt", "x")  # not a drafter folder
    assert code == 1 and "checkpoint error: " in err and "no config.json" in err


@pytest.mark.slow
def test_streamed_spans_spell_the_answer(tiny_run):
    from dflash_trainer.config import load_config
    from dflash_trainer.evaluation.evaluate import load_models
    from dflash_trainer.data.tokenize import end_of_turn_ids

    target_dir, drafter_dir = tiny_run
    cfg = load_config(None, [f"model.target={target_dir}", "pipeline.device=cpu"])
    drafter, target, tokenizer, _ = load_models(cfg, drafter_dir)
    spans: list[Span] = []
    stops = end_of_turn_ids(tokenizer, target.generation_config)
    answer = generate_answer(drafter, target, tokenizer, [{"role": "user", "content": "speed cache layer"}],
                             max_new_tokens=20, temperature=0.0, stop_token_ids=stops, on_span=spans.append,
                             check=True)
    assert [t for s in spans for t in s.tokens] == answer.spec.tokens
    assert answer.checked and answer.mismatch is None
    assert len(spans) == 1 + len(answer.spec.acceptance_lengths)
    stream = io.StringIO()
    writer = SpanWriter(tokenizer, stream, colour=True)
    for span in spans:
        writer.write(span)
    assert ANSI.sub("", stream.getvalue()) == tokenizer.decode(answer.spec.tokens, skip_special_tokens=True)


def test_span_writer_marks_accepted_drafts_and_leaves_the_bonus_plain():
    tokenizer = load_tokenizer(resolve_target("smollm2"))
    ids = tokenizer("The cat sat on the mat.\nIt purred.", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 10
    spans = [Span(ids[:1], 0), Span(ids[1:4], 2), Span(ids[4:5], 0), Span(ids[5:], len(ids) - 6)]
    pieces = [tokenizer.decode(ids[:1]), tokenizer.decode(ids[:3])[len(tokenizer.decode(ids[:1])):]]

    plain = io.StringIO()
    writer = SpanWriter(tokenizer, plain, colour=False)
    for span in spans:
        writer.write(span)
    text = plain.getvalue()
    assert text.startswith(f"{pieces[0]}[{pieces[1]}]")
    assert text.replace("[", "").replace("]", "") == tokenizer.decode(ids)
    assert text.count("[") == 2  # two spans with accepted drafts

    coloured = io.StringIO()
    writer = SpanWriter(tokenizer, coloured, colour=True)
    for span in spans:
        writer.write(span)
    out = coloured.getvalue()
    assert span_colour(2) in out and span_colour(len(ids) - 6) in out
    assert ANSI.sub("", out) == tokenizer.decode(ids)
    # The background stops at a newline inside a span instead of running to the screen edge.
    assert all(not line.startswith("\x1b[0m") for line in out.split("\n")[1:])
    assert span_colour(1) in legend(True) and "[accepted draft tokens]" in legend(False)
