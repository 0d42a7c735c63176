"""``dflash-trainer eval --suite``: the prompt sets of each domain read from their installed
packages, one evaluation across domains with tau per domain, the report's per-domain table and
a bad domain name as one line.

The end-to-end run uses a tiny random target with the real SmolLM2 tokenizer (so the chat
template renders the real prompts) and a random drafter: seconds on a CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import ModelConfig, load_config
from dflash_trainer.core.errors import ConfigError
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.training.export import export_drafter
from dflash_trainer.evaluation.prompt_sets import (PROMPT_SETS, EvalPrompt, humaneval_prompts, load_prompts,
                                                   math_prompts, mtbench_prompts, spread, suite_prompts)
from dflash_trainer.reporting.report import write_report
from helpers_e2e import make_tiny_target


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("suite") / "target", layers=3)


@pytest.fixture(scope="module")
def drafter(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = build_drafter(ModelConfig(num_layers=1, block_size=4, target_layer_ids=[0, 1]),
                          AutoConfig.from_pretrained(target), mask_token_id=16)
    return export_drafter(model, tmp_path_factory.mktemp("suite") / "drafter", dtype=torch.float32)


# --- the prompt sets, from the installed packages ---------------------------------------------

@pytest.mark.slow
def test_each_domain_reads_its_package_data():
    mtbench, humaneval, math = mtbench_prompts(), humaneval_prompts(), math_prompts()
    assert len(mtbench) == 80 and all(len(p.turns) == 2 for p in mtbench)
    assert len(humaneval) == 164 and humaneval[0].id == "HumanEval/0"
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in humaneval[0].turns[0]
    assert humaneval[0].turns[0].startswith("Complete the following Python function:")
    assert len(math) == 270 and math[0].id == "P_Combinatorics_1"
    assert {p.category for p in math} == {"combinatorics", "inequality", "number-theory", "polynomial", "sequence"}
    assert math[0].turns[0].startswith("Let a string consist of digit 1, 2, 3.")
    assert math[0].turns[0].endswith("put your final answer within \\boxed{}.")
    # One set alone through eval.prompts, as for MT-Bench.
    assert load_prompts(load_config(None, ["eval.prompts=humaneval", "eval.num_prompts=3"]))[2].id == "HumanEval/2"


@pytest.mark.slow
def test_the_suite_spreads_first_turns_over_each_set():
    items = [EvalPrompt(id=str(i), turns=["t"]) for i in range(10)]
    assert [p.id for p in spread(items, 3)] == ["0", "3", "6"]
    assert spread(items, 50) == items
    suite = suite_prompts(load_config(None, ["eval.suite_prompts=8"]))
    assert list(suite) == ["mtbench", "humaneval", "math"]
    assert all(len(group) == 8 and all(p.domain == name and len(p.turns) == 1 for p in group)
               for name, group in suite.items())
    # MT-Bench is sorted by category, 10 each: 8 spread prompts see all 8 categories.
    assert len({p.category for p in suite["mtbench"]}) == 8


def test_a_jsonl_file_is_a_domain_named_after_it(tmp_path: Path):
    path = tmp_path / "support.jsonl"
    path.write_text(json.dumps({"prompt": "My order is late."}) + "\n")
    suite = suite_prompts(load_config(None), [str(path), "mtbench"], per_domain=1)
    assert list(suite) == ["support", "mtbench"] and suite["support"][0].turns == ["My order is late."]


@pytest.mark.parametrize(("overrides", "message"), [
    (["eval.suite=[mtbench,gsm8k]"], r"^eval.suite: 'gsm8k' is not a prompt set \(mtbench, humaneval, math, "
                                     r"sharegpt-heldout\) or an existing JSONL file$"),
    (["eval.suite=[]"], r"^eval.suite is empty; name one or more of mtbench, humaneval, math"),
    (["eval.suite=[math,math]"], r"^eval.suite names the domain math twice; name each once$"),
])
def test_a_bad_suite_is_one_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        suite_prompts(load_config(None, overrides))


def test_an_unknown_prompt_set_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"eval.prompts='gsm8k': not a prompt set \(mtbench, humaneval, math, "
                                          r"sharegpt-heldout\) or an existing JSONL file"):
        load_prompts(load_config(None, ["eval.prompts=gsm8k"]))
    assert list(PROMPT_SETS) == ["mtbench", "humaneval", "math", "sharegpt-heldout"]


@pytest.mark.slow
def test_an_unknown_domain_on_the_command_line_is_one_line(target: Path, drafter: Path, tmp_path: Path, capsys):
    code = cli_main(["eval", "--suite", "--drafter", str(drafter), f"model.target={target}",
                     "eval.suite=[mtbench,gsm8k]", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0] == ("dflash-trainer eval: config error: eval.suite: 'gsm8k' is not a prompt set (mtbench, "
                      "humaneval, math, sharegpt-heldout) or an existing JSONL file")
    assert not (tmp_path / "run").exists()  # refused before any model was loaded or file written
    code = cli_main(["eval", "--suite", "--prompts", "humaneval", "--drafter", str(drafter), f"model.target={target}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["dflash-trainer eval: config error: --prompts and --suite exclude each other: "
                                 "--suite evaluates the domains of eval.suite (choose them with "
                                 "eval.suite=[mtbench,humaneval,...])"]


# --- one evaluation across the domains --------------------------------------------------------

@pytest.mark.slow
def test_the_suite_reports_tau_per_domain_end_to_end(target: Path, drafter: Path, tmp_path: Path, capsys):
    run = tmp_path / "run"
    code = cli_main(["eval", "--suite", "--drafter", str(drafter), f"model.target={target}", f"run_dir={run}",
                     "eval.suite_prompts=2", "eval.max_new_tokens=6", "pipeline.device=cpu", "model.dtype=float32"])
    out = capsys.readouterr().out
    assert code == 0, out
    results = json.loads((run / "eval" / "suite" / "results.json").read_text())
    assert list(results["domains"]) == ["mtbench", "humaneval", "math"]
    assert results["prompts_source"] == "suite" and results["requests"] == 6
    assert results["suite"]["humaneval"] == {"source": PROMPT_SETS["humaneval"].description, "prompts": 2}
    for name, d in results["domains"].items():
        assert d["prompts"] == 2 and d["requests"] == 2 and d["lossless"] is True
        assert 1.0 <= d["tau"] <= 4.0 and len(d["acceptance_hist"]) == 4
        assert d["tokens"] == sum(r["tokens"] for r in results["per_prompt"] if r["domain"] == name)
        assert d["speedup_measurement"]["pairs"] == 2
    assert sum(d["steps"] for d in results["domains"].values()) == results["steps"]
    assert [r["domain"] for r in results["per_prompt"]] == ["mtbench"] * 2 + ["humaneval"] * 2 + ["math"] * 2
    assert (run / "eval" / "suite" / "acceptance_hist.png").read_bytes()[:4] == b"\x89PNG"
    table = out[out.index("domain "):].splitlines()
    assert [line.split()[0] for line in table[1:5]] == ["mtbench", "humaneval", "math", "all"]
    assert table[1].split()[1:3] == ["2", str(results["domains"]["mtbench"]["tokens"])]
    assert table[1].split()[-1] == "2/2"

    # The run report shows tau per domain on its first screen and in the evaluation section.
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 0.0, "train/loss": 5.0}) + "\n")
    html = write_report(run).read_text()
    first_screen = html[html.index("Did it work?"):html.index("<h2>Answers")]
    assert "Tau per domain (eval/suite)" in first_screen
    for name in ("mtbench", "humaneval", "math"):
        assert f"<td>{name}</td><td>2</td>" in first_screen
    assert f"<td>{results['domains']['math']['tau']:.3f}</td>" in first_screen
    assert html.count("<th>domain</th>") == 2  # and again under the evaluation's own table
