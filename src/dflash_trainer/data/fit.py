"""Data defaults fitted to the target and the data, decided before anything is tokenized.

A default that does not fit the user's target or data is changed, with one line that says so;
a value the user gave is kept (and checked as before):

- ``data.max_length`` (default 3072) longer than the target's context
  (``max_position_embeddings``) becomes the context;
- ``data.heldout_samples`` (default 64) holds out at most a tenth of the first ``data.paths``
  entry (:data:`HELDOUT_SHARE`), counted before tokenizing, so a small file is never refused
  and keeps most of its records for training.

A run without a config file (:func:`fit_drafter_defaults`) also gets the drafter the evidence
in docs/quality.md favours, sized to the target: ``model.drafter_init: target`` (twice the
slot-1 agreement of a random init after 150 steps) with as many layers as that init can copy
after the reference rule's last tapped layer, at most the recipe's 5: 2 on any target of 6 or
more layers (the rule taps layers 1 and L-3, leaving L-2 and L-1 to copy), 1 on a smaller one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from dflash_trainer.config import Config
from dflash_trainer.core.assets import resolve_target
from dflash_trainer.core.errors import UserError
from dflash_trainer.data.formats import EMBEDDED_SHAREGPT, expand_paths, read_source
from dflash_trainer.data.prepare import target_context_length

__all__ = ["HELDOUT_SHARE", "fit_data_defaults"]

HELDOUT_SHARE = 10
"""By default at most one record in this many of the first data entry is held out."""


def _first_entry_records(cfg: Config, limit: int) -> int | None:
    """The records of the first ``data.paths`` entry, counted up to ``limit``; None when it does
    not read (the command that reads the data names why)."""
    count = 0
    try:
        for source in expand_paths(cfg.data.paths[:1]):
            for _ in read_source(source, format=cfg.data.format):
                count += 1
                if count >= limit:
                    return count
    except UserError:
        return None
    return count


def _context(cfg: Config) -> int | None:
    try:
        return target_context_length(resolve_target(cfg.model.target))
    except UserError:
        return None  # the command that loads the target names why


def fit_data_defaults(cfg: Config, *, given: set[str], log: Callable[[str], None]) -> Config:
    """``cfg`` with ``data.max_length`` and ``data.heldout_samples`` fitted to the target and
    the data where the user left them at their defaults (``given``: the dotted keys the config
    file and the command line set); each change is one ``log`` line."""
    data = cfg.data
    if "data.max_length" not in given:
        context = _context(cfg)
        if context is not None and data.max_length > context:
            log(f"data.max_length: {context}, the target's context (max_position_embeddings), instead of the "
                f"default {data.max_length}")
            data = dataclasses.replace(data, max_length=context)
    if ("data.heldout_samples" not in given and data.heldout_samples > 0
            and data.paths and data.paths[0] != EMBEDDED_SHAREGPT):
        limit = data.heldout_samples * HELDOUT_SHARE
        records, entry = _first_entry_records(cfg, limit), data.paths[0]
        if records is not None and records < limit:
            held = records // HELDOUT_SHARE
            log(f"data.heldout_samples: {held} of the {records} records of {Path(entry).name} held out for "
                f"evaluation (the default {data.heldout_samples} is capped at one record in {HELDOUT_SHARE} of "
                "a small first data entry; set data.heldout_samples to choose)")
            data = dataclasses.replace(data, heldout_samples=held)
    return cfg if data is cfg.data else dataclasses.replace(cfg, data=data)

