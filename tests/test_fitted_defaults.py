"""Defaults that fit the user's target and data: ``data.max_length`` clamped to the target's
context, the held-out count of a small file decided before tokenizing (never a refusal), each
said in one line; values the user gave are kept and checked as before. A run without a config
file gets a drafter sized for ``drafter_init: target`` on its target."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import load_config
from dflash_trainer.data.fit import fit_data_defaults
from dflash_trainer.training.drafter_init import drafter_layers_for, fit_drafter_defaults
from helpers_e2e import make_chat_jsonl, make_tiny_target


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("fit") / "target", layers=3)  # a 2048-token context


def test_defaults_fit_a_short_context_and_a_small_file(target: Path, tmp_path: Path) -> None:
    data = make_chat_jsonl(tmp_path / "small.jsonl", num=40)
    cfg = load_config(None, [f"model.target={target}", f"data.paths=[{data}]"])
    lines: list[str] = []
    fitted = fit_data_defaults(cfg, given={"model.target", "data.paths"}, log=lines.append)
    assert (fitted.data.max_length, fitted.data.heldout_samples) == (2048, 4)
    assert lines == ["data.max_length: 2048, the target's context (max_position_embeddings), instead of the "
                     "default 3072",
                     "data.heldout_samples: 4 of the 40 records of small.jsonl held out for evaluation (the "
                     "default 64 is capped at one record in 10 of a small first data entry; set "
                     "data.heldout_samples to choose)"]


def test_given_values_and_large_files_keep_their_settings(target: Path, tmp_path: Path) -> None:
    small = make_chat_jsonl(tmp_path / "small.jsonl", num=40)
    large = make_chat_jsonl(tmp_path / "large.jsonl", num=700)
    given = {"model.target", "data.paths", "data.max_length", "data.heldout_samples"}
    cfg = load_config(None, [f"model.target={target}", f"data.paths=[{small}]", "data.max_length=512",
                             "data.heldout_samples=8"])
    assert fit_data_defaults(cfg, given=given, log=pytest.fail) is cfg
    cfg = load_config(None, [f"model.target={target}", f"data.paths=[{large}]", "data.max_length=512"])
    assert fit_data_defaults(cfg, given={"model.target", "data.paths", "data.max_length"}, log=pytest.fail) is cfg


def test_prepare_takes_a_small_file_with_the_defaults(target: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    data = make_chat_jsonl(tmp_path / "small.jsonl", num=40)
    assert cli_main(["prepare", "--data", str(data), "--target", str(target),
                     f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    out = capsys.readouterr().out
    assert out.index("data.heldout_samples: 4 of the 40 records") < out.index("prepare: tokenizing")
    assert "data.max_length: 2048, the target's context" in out
    assert "records read                 36   (+4 held out for evaluation)" in out


def test_a_given_max_length_beyond_the_context_is_still_refused(target: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    data = make_chat_jsonl(tmp_path / "small.jsonl", num=40)
    assert cli_main(["prepare", "--data", str(data), "--target", str(target), "data.max_length=4096",
                     "data.heldout_samples=0", f"data.cache_dir={tmp_path / 'cache'}"]) == 2
    assert "data.max_length=4096 is longer than the target's context of 2048" in capsys.readouterr().err


@pytest.mark.parametrize(("layers", "expected"), [(4, 1), (5, 2), (30, 2), (36, 2)])
def test_the_drafter_without_a_config_is_sized_for_target_init(layers: int, expected: int) -> None:
    assert drafter_layers_for(layers) == expected


def test_a_run_without_a_config_starts_from_the_target(target: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [f"model.target={target}"])
    lines: list[str] = []
    fitted = fit_drafter_defaults(cfg, given={"model.target"}, log=lines.append)
    assert (fitted.model.num_layers, fitted.model.drafter_init) == (1, "target")
    assert lines == ["drafter: 1 layer(s) starting as copies of the target's layers [2] over its layers [1] "
                     "(model.num_layers=1, model.drafter_init=target: the default without a config file, sized to "
                     "this target; see docs/quality.md)"]
    for given in ("model.num_layers", "model.drafter_init", "model.init_from", "model.target_layer_ids"):
        assert fit_drafter_defaults(cfg, given={"model.target", given}, log=pytest.fail) is cfg
