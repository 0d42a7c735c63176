"""The demo's table shows each speedup with its reliability mark; the dtype choice is shown on
the console."""

from __future__ import annotations

import logging

from dflash_trainer.cli.demo import _console_info, _results_table
from dflash_trainer.evaluation.speedup import LoadSample, PairedTiming, SpeedupMeasurement


def test_an_unreliable_speedup_is_marked_in_the_table():
    timing = PairedTiming(index=0, target_first=True, threads=2, target_s=6.0, target_tokens=63, spec_s=7.5,
                          spec_tokens=63, spec_steps=50)
    quiet, loaded = LoadSample(load_1m=0.2, others_running=0.0), LoadSample(load_1m=4.1, others_running=1.5)
    untrained = SpeedupMeasurement.from_pairs([timing], threads=2, cpus=2, before=quiet, after=quiet)
    trained = SpeedupMeasurement.from_pairs([timing], threads=2, cpus=2, before=quiet, after=loaded)
    metrics = {"eval/tau": 1.0, "eval/lossless": 1}
    lines = _results_table(metrics, {"eval/tau": 1.282, "eval/lossless": 1}, (untrained, trained)).splitlines()
    assert lines[2].split() == ["decode", "speedup", "(CPU)", "0.800", "0.800", "(unreliable)"]
    assert len({len(line) for line in lines[:4]}) == 1  # the trained column widened for the mark
    assert lines[4] == ("  trained speedup unreliable: busy: load 2.1 from other work beside 2 eval threads "
                        "on 2 cores")
    # 0.15 s per verify step against 6.0 / 63 s per plain token: 1.575 plain steps per verify step.
    assert trained.step_cost == 0.15 / (6.0 / 63)
    assert lines[5:] == [f"  the drafter does not pay on this machine: one verify step costs {trained.step_cost:.2f} "
                         f"plain decode steps here, so a drafter pays from tau {trained.step_cost:.2f} (1.3x at "
                         f"{1.3 * trained.step_cost:.2f}, 2x at {2 * trained.step_cost:.2f}); this drafter's tau "
                         f"is 1.282"]


def test_the_dtype_choice_is_printed_once_and_the_logger_is_restored(capsys):
    logger = logging.getLogger("dflash_trainer.model.dtypes")
    level, propagate = logger.level, logger.propagate
    with _console_info("dflash_trainer.model.dtypes"):
        logger.info("model.dtype auto on CPU: %s (probe)", "bfloat16")
        logger.debug("not shown")
    logger.info("after the set-up: back to the trainer's log only")
    out = capsys.readouterr().out
    assert out == "demo: model.dtype auto on CPU: bfloat16 (probe)\n"
    assert (logger.level, logger.propagate, logger.handlers) == (level, propagate, [])


def test_the_expected_duration_uses_this_machines_last_demo_once_one_recorded(tmp_path):
    from dflash_trainer.cli import duration

    cache = tmp_path / "demo-durations.json"
    key = duration.settings_key(probe_key="cpu | torch | threads 1", settings={"steps": [4]})
    first = duration.estimate(key, steps=1600, probe_s=0.2, cache_path=cache)
    assert first.ratios == duration.DEFAULT_RATIOS
    assert first.total_s == 2 * 0.2 * first.ratios.eval_per_probe + 1600 * 0.2 * first.ratios.step_per_probe
    assert first.describe().startswith("demo: expected about ")
    assert "benchmarks/results/" in first.describe()
    measured = duration.measured_ratios(probe_s=0.2, train_s=800.0, steps=1600, eval_s=[60.0, 100.0])
    assert measured == {"step_per_probe": 2.5, "eval_per_probe": 400.0}
    duration.record(key, measured, cache_path=cache)
    second = duration.estimate(key, steps=1600, probe_s=0.2, cache_path=cache)
    assert (second.step_s, second.eval_s, second.total_s) == (0.5, 80.0, 960.0)
    assert "the last demo on this machine" in second.describe()
    other = duration.settings_key(probe_key="cpu | torch | threads 1", settings={"steps": [8]})
    assert duration.estimate(other, steps=10, probe_s=0.2, cache_path=cache).ratios == duration.DEFAULT_RATIOS


def test_an_unreadable_or_nonsense_durations_cache_falls_back_to_the_defaults(tmp_path, caplog):
    from dflash_trainer.cli import duration

    cache = tmp_path / "demo-durations.json"
    cache.write_text("{not json")
    assert duration.estimate("k", steps=1, probe_s=0.1, cache_path=cache).ratios == duration.DEFAULT_RATIOS
    assert "ignoring unreadable" in caplog.text
    cache.write_text('{"k": {"step_per_probe": -1, "eval_per_probe": 3}}')
    assert duration.recorded_ratios("k", cache_path=cache) is None
