"""The demo's evaluations run on every core and hand the training split back after."""

from __future__ import annotations

import os

import pytest
import torch

from dflash_trainer.demo import _all_cores


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
