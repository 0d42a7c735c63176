"""Calling the objective from tests with plain tensors: builds the typed Batch and
TargetOutputs it takes, and returns the micro-batch's own mean loss with the sums."""

from __future__ import annotations

import torch

from dflash_trainer.model.batch import Batch
from dflash_trainer.model.loss import LossSums
from dflash_trainer.model.target import TargetOutputs


def run_objective(objective: torch.nn.Module, tensors: dict[str, torch.Tensor],
                  features: torch.Tensor, step: int = 0) -> tuple[torch.Tensor, LossSums]:
    """``objective`` on ``tensors`` (input_ids, loss_mask, seq_lens, anchors, keep and
    optionally target_labels / final_hidden): (loss sum / weight sum, the sums)."""
    batch = Batch.of_rows(tensors["input_ids"], tensors["loss_mask"], anchors=tensors["anchors"],
                          keep=tensors["keep"], seq_lens=tensors.get("seq_lens"))
    target = TargetOutputs(features=features, target_labels=tensors.get("target_labels"),
                           final_hidden=tensors.get("final_hidden"))
    sums = objective(batch, target, step)
    return sums.mean_loss(), sums
