"""DFlash: the backbone alone (z-lab ``DFlashDraftModel``): the base :class:`Variant` as it is."""

from __future__ import annotations

from dflash_trainer.model.variants.base import Variant

__all__ = ["DFlash"]


class DFlash(Variant):
    """No modules, terms or keys beyond the backbone's; warm-starts only from DFlash drafters."""

    name = "dflash"
    title = "DFlash"
    architecture = "DFlashDraftModel"
    warm_starts_from = ("dflash",)
