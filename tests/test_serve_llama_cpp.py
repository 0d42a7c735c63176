"""The llama.cpp arm of the serve check without a server: build stamp, commands, the comparison
of plain and speculative outputs, acceptance bookkeeping and the cost model.

The end-to-end run against a real ``llama-server`` is ``make serve-check`` (CI runs it).
"""

import sys

import pytest

from dflash_trainer.engines import llama_cpp_build, llama_cpp_server, serve_llama_cpp


def completion(tokens, *, draft_n=0, accepted=0, ms=100.0):
    return llama_cpp_server.LlamaCompletion(token_ids=list(tokens), text="", decode_ms=ms,
                                            decode_tokens=len(tokens), draft_n=draft_n,
                                            draft_accepted=accepted, wall_s=ms / 1000)


def test_build_stamp_must_match_pin_and_options(tmp_path):
    assert not llama_cpp_build.is_built(tmp_path)
    binary = llama_cpp_build.binary(tmp_path)
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    (tmp_path / llama_cpp_build.STAMP).write_text("an older pin")
    assert not llama_cpp_build.is_built(tmp_path)
    (tmp_path / llama_cpp_build.STAMP).write_text(llama_cpp_build.stamp_content())
    assert llama_cpp_build.is_built(tmp_path)


def test_a_failed_build_step_names_the_step_and_the_log(tmp_path):
    log_path = tmp_path / "build.log"
    with open(log_path, "w") as log_file, pytest.raises(llama_cpp_build.BuildError,
                                                        match=r"step 'configure' failed.*build.log"):
        llama_cpp_build._run("configure", [sys.executable, "-c", "raise SystemExit(3)"], log_file)


def test_a_missing_converter_requirement_is_named_before_converting(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp_server, "CONVERT_REQUIREMENTS", ("sentencepiece", "no_such_module_for_the_test"))
    with pytest.raises(llama_cpp_server.ServerError,
                       match=r"needs no_such_module_for_the_test, .* pip install no_such_module_for_the_test "):
        llama_cpp_server.convert(tmp_path / "drafter", tmp_path / "d.gguf", build_dir=tmp_path, outtype="f32",
                                 log_path=tmp_path / "convert.log")
    assert not (tmp_path / "convert.log").exists()


def test_server_commands_bind_loopback_and_draft_only_with_a_drafter(tmp_path):
    plain = llama_cpp_server.server_command(tmp_path / "llama-server", tmp_path / "t.gguf", port=8123, draft=None,
                                            draft_n_max=3, threads=2, ctx_size=2048)
    spec = llama_cpp_server.server_command(tmp_path / "llama-server", tmp_path / "t.gguf", port=8124,
                                           draft=tmp_path / "d.gguf", draft_n_max=3, threads=2, ctx_size=2048)
    assert plain[plain.index("--host") + 1] == "127.0.0.1" and "-md" not in plain
    assert spec[spec.index("-md") + 1] == str(tmp_path / "d.gguf")
    assert spec[spec.index("--spec-type") + 1] == "draft-dflash"
    assert spec[spec.index("--spec-draft-n-max") + 1] == "3"


def test_first_difference_and_verify_steps():
    assert serve_llama_cpp.compare(completion([1, 2, 3]), completion([1, 2, 3])) is None
    assert serve_llama_cpp.compare(completion([1, 2, 3]), completion([1, 5, 3])) == 1
    assert serve_llama_cpp.compare(completion([1, 2, 3]), completion([1, 2])) == 2
    # 13 tokens: the prefill's, then 12 committed by steps that accepted 4 drafts in all: 8 steps.
    assert serve_llama_cpp.verify_steps(completion([1] * 13, draft_n=24, accepted=4)) == 8
    assert serve_llama_cpp.verify_steps(completion([1] * 6)) == 5


def test_cost_model_break_even_and_targets():
    # A speculative step costs 2.7 plain tokens: it pays from tau 2.7 on.
    cost = serve_llama_cpp.cost_model(10.0, 27.0)
    assert cost["break_even_tau"] == pytest.approx(2.7)
    assert cost["tau_for_1.3x"] == pytest.approx(3.51)
    assert cost["tau_for_2x"] == pytest.approx(5.4)
    assert serve_llama_cpp.cost_model(None, 27.0)["break_even_tau"] is None


def pair(i, plain_ms, spec_ms, identical=True):
    spec = completion([1] * 13, draft_n=24, accepted=4, ms=spec_ms)
    return {"index": i, "prompt": "p", "order": ["plain", "drafter"], "identical": identical,
            "first_difference": None if identical else 3, "top2_margin": None if identical else 0.002,
            "near_tie": not identical, "steps": 8, "tau": 1.5,
            "plain": vars(completion([1] * 13, ms=plain_ms)), "drafter": vars(spec)}


def test_summary_is_a_ratio_of_sums_and_flags_scatter(tmp_path):
    options = serve_llama_cpp.LlamaCppOptions(build_dir=tmp_path, threads=1)
    rows = {"pairs": [pair(0, 120.0, 100.0), pair(1, 120.0, 100.0, identical=False)],
            "load_before": 0.0, "load_after": 0.0}
    s = serve_llama_cpp._summarize(rows, model=tmp_path / "t.gguf", draft=tmp_path / "d.gguf", n_max=3,
                                   options=options)
    assert s["speedup"] == pytest.approx(1.2)
    assert s["speedup_reliable"] and s["identical"] == 1 and s["near_ties"] == 1
    assert s["acceptance"]["pooled_tau"] == pytest.approx(1.5)
    # A speculative step: 100 ms / 8 steps; a plain one: 120 ms / 12 tokens after the first.
    assert s["cost"]["break_even_tau"] == pytest.approx((100.0 / 8) / (120.0 / 12))
    # One pair measured while something else ran: its step cost differs, the scatter marks the figure.
    rows["pairs"].append(pair(2, 400.0, 100.0))
    s = serve_llama_cpp._summarize(rows, model=tmp_path / "t.gguf", draft=tmp_path / "d.gguf", n_max=3,
                                   options=options)
    assert not s["speedup_reliable"] and "scatter" in s["speedup_unreliable_reasons"][0]


def test_serve_check_reports_llama_cpp_side_by_side(tmp_path):
    from tools import serve_check

    options = serve_llama_cpp.LlamaCppOptions(build_dir=tmp_path, threads=2)
    rows = {"pairs": [pair(0, 120.0, 100.0), pair(1, 120.0, 100.0, identical=False)],
            "load_before": 0.1, "load_after": 0.2}
    args = serve_check.parse_args(["--engine", "llama.cpp", "--prompts", "2"])
    result = serve_check.build_result(args, tmp_path, tmp_path / "drafter", "given", ["p0", "p1"], None, None, {},
                                      num_draft=3)
    result["llama_cpp"] = serve_llama_cpp._summarize(rows, model=tmp_path / "t.gguf", draft=tmp_path / "d.gguf",
                                                     n_max=3, options=options)
    table = serve_check.format_report(result)
    assert "outputs identical with and without the drafter: 1/2 (1 differing where the engine's batched" in table
    assert "token 3: engine numerics: top-2 margin 0.0020" in table
    assert "speedup 1.20x" in table and "pays from tau 1.25" in table
    costs = {row["engine"]: row for row in serve_check.cost_rows(result)}
    assert costs["llama.cpp"]["break_even_tau"] == pytest.approx(1.25)
    assert costs["project loop (transformers)"]["break_even_tau"] is None  # no project eval here
    assert "where the time goes" in table


def test_a_difference_is_numerics_only_where_the_verifier_ranked_its_token_first():
    classify = serve_llama_cpp.classify_difference
    # Measured with the shipped Q4_1 SmolLM2 (both servers' n_probs at the first difference):
    # the verify batch ranks the emitted token first, single-token decoding the other one.
    plain = [(9097, -1.9068), (10887, -1.9273), (1046, -2.0806)]
    spec = [(10887, -1.9530), (1046, -1.9547), (9097, -1.9801)]
    verdict = classify(plain_top=plain, spec_top=spec, spec_token=10887, target_type="q4_1")
    assert verdict["near_tie"] and "the verify batch ranks token 10887 first" in verdict["verdict"]
    assert verdict["top2_margin"] == pytest.approx(0.0205) and verdict["spec_top2_margin"] == pytest.approx(0.0017)
    # A token the verifier's own logits do not rank first was accepted: a bug, whatever the margin.
    wrong = classify(plain_top=plain, spec_top=spec, spec_token=1046, target_type="f32")
    assert not wrong["near_tie"] and "accepted although" in wrong["verdict"]
    # Plain decoding's token is not even a candidate of the verify.
    far = classify(plain_top=[(5, -0.1), (6, -3.0)], spec_top=[(7, -0.5), (8, -0.9)], spec_token=7,
                   target_type="q4_1")
    assert not far["near_tie"] and "not among" in far["verdict"]
    # Equal candidates are a tie, whichever one the server lists first.
    tied = classify(plain_top=[(5, -0.7), (6, -0.8)], spec_top=[(6, -0.75), (5, -0.75), (9, -2.0)], spec_token=5,
                    target_type="f32")
    assert tied["near_tie"] and tied["spec_top2_margin"] == 0


def test_without_the_verifiers_candidates_the_margin_bound_follows_the_target_type():
    classify = serve_llama_cpp.classify_difference
    plain = [(527, -1.4144), (617, -1.4909)]  # margin 0.076: a Q4_1 target's batch rounding, not f32's
    assert classify(plain_top=plain, spec_top=[], spec_token=617, target_type="q4_1")["near_tie"]
    f32 = classify(plain_top=plain, spec_top=[], spec_token=617, target_type="f32")
    assert not f32["near_tie"] and ">= 0.01" in f32["verdict"]
    assert classify(plain_top=[(1, -0.5), (2, -0.505)], spec_top=[], spec_token=2, target_type="f32")["near_tie"]
    assert not classify(plain_top=[(1, -0.1), (2, -2.0)], spec_top=[], spec_token=2, target_type="q4_1")["near_tie"]
