"""The demo's table shows each speedup with its reliability mark; the dtype choice is shown on
the console."""

from __future__ import annotations

import logging

from dflash_trainer.demo import _console_info, _results_table
from dflash_trainer.speedup import LoadSample, PairedTiming, SpeedupMeasurement


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
    assert lines[4:] == ["  trained speedup unreliable: busy: load 2.1 from other work beside 2 eval threads "
                         "on 2 cores"]


def test_the_dtype_choice_is_printed_once_and_the_logger_is_restored(capsys):
    logger = logging.getLogger("dflash_trainer.dtypes")
    level, propagate = logger.level, logger.propagate
    with _console_info("dflash_trainer.dtypes"):
        logger.info("model.dtype auto on CPU: %s (probe)", "bfloat16")
        logger.debug("not shown")
    logger.info("after the set-up: back to the trainer's log only")
    out = capsys.readouterr().out
    assert out == "demo: model.dtype auto on CPU: bfloat16 (probe)\n"
    assert (logger.level, logger.propagate, logger.handlers) == (level, propagate, [])
