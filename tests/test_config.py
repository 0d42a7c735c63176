"""Config loading: YAML + dotted overrides, strict keys and types, resolved config on disk."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_trainer.cli import main as cli
from dflash_trainer.cli.main import main as cli_main

from dflash_trainer.config import (EQUAL, MAY_CHANGE, RECOMPUTED, Config, ConfigError, TrainingConfig, config_to_dict,
                                   load_config, option_resume_rules, save_config)
from dflash_trainer.training.checkpoint import ResumeError
from dflash_trainer.training.resume import check_resume_compatible


def test_defaults_follow_the_reference_recipe():
    cfg = load_config()
    assert cfg.training.lr == 6e-4
    assert cfg.training.betas == (0.9, 0.999)
    assert cfg.training.warmup_ratio == 0.04
    assert cfg.training.num_anchors == 512
    assert cfg.model.block_size == 16
    assert cfg.data.max_length == 3072


def test_yaml_and_overrides(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  lr: 1.0e-3\nmodel:\n  num_layers: 2\n")
    cfg = load_config(path, ["training.lr=3e-4", "training.betas=[0.8, 0.95]",
                             "data.paths=[a.jsonl, b.jsonl]", "training.gamma=null"])
    assert cfg.training.lr == 3e-4
    assert cfg.training.betas == (0.8, 0.95)
    assert cfg.model.num_layers == 2
    assert cfg.data.paths == ["a.jsonl", "b.jsonl"]
    assert cfg.training.gamma is None


@pytest.mark.parametrize("override, fragment", [
    ("training.lrr=1", "unknown config key 'training.lrr'"),
    ("bogus.x=1", "unknown config key 'bogus'"),
    ("training.lr=abc", "training.lr: expected a number"),
    ("model.num_layers=1.5", "model.num_layers: expected an integer"),
    ("model.attention=fast", "accepted values: 'auto', 'sdpa', 'blockwise', 'flex'"),
    ("training.betas=[0.9]", "training.betas: expected 2 values"),
    ("model.block_size=1", "model.block_size must be in [2, 256], got 1"),
    ("training.lr=inf", "training.lr must be in (0, 1], got inf"),
    ("training.lr=.nan", "training.lr must be in (0, 1], got nan"),
    ("training.max_steps=0", "training.max_steps must be in [1, 1_000_000_000], or none for no limit"),
    ("training.betas=[1.5, 0.9]", "training.betas[0] must be in [0, 1), got 1.5"),
    ("training.betas=[0.9, .nan]", "training.betas[1] must be in [0, 1), got nan"),
    ("model.target_layer_ids=[0, x]", "model.target_layer_ids[1]: expected an integer, got 'x'"),
    ("training.gamma=0", "training.gamma must be > 0, or none for the reference value"),
    ("data.paths=[a.jsonl, ' ']", "data.paths[1] must not be empty or only whitespace"),
    ("pipeline.tokens_per_batch=10", "pipeline.tokens_per_batch"),
    ("training.lr", "must look like section.key=value"),
])
def test_errors_name_the_key(override: str, fragment: str):
    with pytest.raises(ConfigError, match=None) as info:
        load_config(None, [override])
    assert fragment in str(info.value)


def test_none_unsets_and_zero_is_a_value():
    cfg = load_config(None, ["training.max_steps=none", "eval.num_prompts=None", "training.warmup_steps=0"])
    assert cfg.training.max_steps is None and cfg.eval.num_prompts is None
    assert cfg.training.warmup_steps == 0
    assert load_config(None, ["training.max_steps=1_000"]).training.max_steps == 1000


def test_ranges_hold_for_configs_built_in_code():
    with pytest.raises(ConfigError, match=r"^training.lr must be in \(0, 1\], got inf$"):
        Config(training=TrainingConfig(lr=float("inf")))


def test_missing_file_and_bad_yaml(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_resolved_config_round_trips(tmp_path: Path):
    cfg = load_config(None, ["training.lr=1e-3", "logging.tags=[a, b]"])
    path = save_config(cfg, tmp_path)
    again = load_config(path)
    assert again == cfg
    assert yaml.safe_load(path.read_text())["training"]["lr"] == 1e-3


def test_repo_configs_load():
    for path in sorted(Path(__file__).parents[1].glob("configs/*.yaml")):
        assert isinstance(load_config(path), Config), path


def test_cli_config_error_exit_code(capsys):
    assert cli_main(["prepare", "training.nope=1"]) == 2
    assert "unknown config key 'training.nope'" in capsys.readouterr().err


def test_cli_takes_options_and_overrides_in_any_order(monkeypatch):
    seen = {}

    def handler(cfg, args):
        seen.update(cfg=cfg, args=args)
        return 0

    monkeypatch.setattr(cli, "_resolve", lambda name: handler)
    assert cli_main(["train", "training.lr=3e-4", "--resume", "auto", "training.epochs=3",
                     "--overwrite", "data.max_length=64", "--data", "a.jsonl"]) == 0
    cfg = seen["cfg"]
    assert (cfg.training.lr, cfg.training.epochs, cfg.data.max_length) == (3e-4, 3, 64)
    assert cfg.checkpoint.resume == "auto" and cfg.data.paths == ["a.jsonl"] and seen["args"].overwrite
    assert cli_main(["report", "--debug", "runs/x"]) == 0
    assert seen["args"].run == "runs/x"


@pytest.mark.slow
def test_console_script_reads_an_override_after_an_option():
    """Through the installed ``dflash-trainer``: the override after ``--resume`` reaches the
    config (its range error, not argparse's "unrecognized arguments"); an unknown option after
    overrides stays a usage error. Both exit 2."""
    script = str(Path(sys.executable).parent / "dflash-trainer")
    late = subprocess.run([script, "train", "training.lr=3e-4", "--resume", "auto", "training.epochs=0"],
                          capture_output=True, text=True, timeout=120)
    assert late.returncode == 2, late.stderr
    assert late.stderr.startswith("dflash-trainer train: config error: training.epochs must be "), late.stderr
    unknown = subprocess.run([script, "train", "training.lr=3e-4", "--nope"],
                             capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "unrecognized arguments: --nope" in unknown.stderr, unknown.stderr


def test_cli_help_documents_options(capsys):
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    out = capsys.readouterr().out
    assert "training.lr = 0.0006" in out
    assert "Linear warmup" in out


def test_every_option_declares_how_it_resumes():
    """A new option must say whether a resume may change it: left undeclared, it would resume
    silently with, say, another data order. Declare it in its section's ``@resume_rules``."""
    rules = option_resume_rules()
    undeclared = [key for key, rule in rules.items() if rule is None]
    assert not undeclared, f"options without a resume rule (config.py @resume_rules): {undeclared}"
    assert set(rules.values()) == {EQUAL, MAY_CHANGE, RECOMPUTED}
    # What decides the data order, the model and the meaning of the saved state stays equal.
    assert {key for key, rule in rules.items() if rule == EQUAL} >= {
        "data.paths", "model.num_layers", "training.seed", "training.grad_accum", "training.num_anchors",
        "pipeline.tokens_per_batch", "pipeline.num_buckets", "pipeline.order"}
    assert rules["data.cache_dir"] == rules["training.lr"] == MAY_CHANGE
    assert rules["training.epochs"] == rules["distributed.drafter"] == RECOMPUTED


def test_a_resume_refuses_an_equal_option_that_changed_and_names_the_others():
    saved = config_to_dict(load_config())
    changed = check_resume_compatible(saved, config_to_dict(load_config(None, [
        "training.lr=1e-3", "data.cache_dir=/elsewhere", "training.epochs=9", "logging.every_steps=3",
        "checkpoint.resume=auto"])))
    # Every option that may change and did, with both values; the resume itself is no news.
    assert changed == [
        "resume: data.cache_dir changed from None (checkpoint) to '/elsewhere'; applies from the first resumed step",
        "resume: training.epochs changed from 6 (checkpoint) to 9; what depends on it is recomputed",
        "resume: training.lr changed from 0.0006 (checkpoint) to 0.001; applies from the first resumed step",
        "resume: logging.every_steps changed from 10 (checkpoint) to 3; applies from the first resumed step"]
    with pytest.raises(ResumeError, match=r"^cannot resume: training.grad_accum was 1 in the checkpoint and "
                                          r"is 2 now; resume with the checkpoint's config.yaml$"):
        check_resume_compatible(saved, config_to_dict(load_config(None, ["training.grad_accum=2"])))
    # An option the saved config lacks (added later) counts as unset.
    del saved["model"]["markov_rank"]
    check_resume_compatible(saved, config_to_dict(load_config()))
