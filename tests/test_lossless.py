"""The lossless check classifies a greedy difference: bf16 numerics (exit 0) or a wrong
acceptance (exit 1), through ``dflash-trainer eval`` on the real SmolLM2 and MT-Bench."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from dflash_trainer.core.assets import load_tokenizer, resolve_target
from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import ModelConfig
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.training.export import export_drafter
from dflash_trainer.model.target import resolve_mask_token_id


@pytest.fixture(scope="module")
def drafter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random DFlash drafter for SmolLM2: it accepts almost nothing, so every step is a batched
    verify of 16 positions, which bf16 rounds apart from plain one-token decoding."""
    path = resolve_target("smollm2")
    config, tokenizer = AutoConfig.from_pretrained(path), load_tokenizer(path)
    torch.manual_seed(0)
    model = build_drafter(ModelConfig(num_layers=1), config,
                          mask_token_id=resolve_mask_token_id(tokenizer, config.vocab_size), tokenizer=tokenizer)
    return export_drafter(model, tmp_path_factory.mktemp("lossless") / "drafter", target_config=config)


def _eval(drafter: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict, str]:
    # MT-Bench's first prompt: in bf16 its second generated token is a near tie (logit gap 0)
    # that the batched verify and plain decoding break differently.
    code = cli_main(["eval", "--drafter", str(drafter), "--out", str(out), "model.dtype=bfloat16",
                     "pipeline.device=cpu", "eval.num_prompts=1", "eval.first_turn_only=true",
                     "eval.max_new_tokens=4", f"run_dir={out.parent / 'run'}"])
    return code, json.loads((out / "results.json").read_text()), capsys.readouterr().out


@pytest.mark.slow
def test_a_bf16_near_tie_is_numerics_and_exits_0(drafter: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, results, out = _eval(drafter, tmp_path / "eval", capsys)
    assert code == 0, out
    assert (results["lossless"], results["lossless_numerics"], results["lossless_failures"]) == (True, 1, 0)
    (request,) = results["per_prompt"]
    mismatch = request["first_mismatch"]
    assert request["mismatch_kind"] == "numerics" and mismatch["kind"] == "numerics"
    assert mismatch["verify_argmax"] == mismatch["speculative"]["token"]
    assert 0 <= mismatch["logit_gap"] <= mismatch["margin"] == 1.0
    assert "1 differ by numerics" in out and "0 wrong acceptance(s)" in out
    assert "numerics mtbench-81 turn 1: first difference at generated token" in out


@pytest.mark.slow
def test_an_injected_wrong_acceptance_exits_1(drafter: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The verify's bonus replaced by another token at the first step: the loop commits a token
    its verify did not choose, which no rounding explains."""
    from dflash_trainer.model.modeling import dflash

    verify = dflash._verify

    def wrong(*args: object, **kwargs: object) -> tuple[int, torch.Tensor]:
        accepted, bonus = verify(*args, **kwargs)
        return accepted, (bonus + 1) % 49152

    monkeypatch.setattr(dflash, "_verify", wrong)
    code, results, out = _eval(drafter, tmp_path / "eval", capsys)
    assert code == 1, out
    assert (results["lossless"], results["lossless_failures"]) == (False, 1)
    (request,) = results["per_prompt"]
    assert request["mismatch_kind"] == "wrong acceptance"
    assert request["first_mismatch"]["why"] == ("the speculative path emitted a token that is not its verify "
                                                "logits' argmax")
    assert "1 wrong acceptance(s)" in out and "WRONG ACCEPTANCE mtbench-81 turn 1" in out
