"""The demo's evaluations run on every core and hand the training split back after; the dtype
choice is shown on the console."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from dflash_trainer.demo import _all_cores, _console_info


def test_evaluations_get_every_core_and_the_training_split_comes_back():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _all_cores():
            assert torch.get_num_threads() == max(1, os.cpu_count() or 1)
        assert torch.get_num_threads() == 1
        with pytest.raises(RuntimeError), _all_cores():
            raise RuntimeError("an evaluation failed")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


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
