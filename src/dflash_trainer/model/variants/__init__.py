"""The registry of drafter variants (:class:`~dflash_trainer.model.variants.base.Variant`): each
lives in one module here (its modeling class in :mod:`dflash_trainer.model.modeling`), and the
rest of the package finds it by ``model.variant`` or by a drafter config's ``architectures``.

Adding a variant: a module with a :class:`Variant` subclass (and, for new modules, a standalone
modeling file), one line in :data:`VARIANTS`, and its name among ``model.variant``'s values in
the config schema (tests/test_variants.py checks both lists agree).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from dflash_trainer.core.errors import ConfigError
from dflash_trainer.model.variants.base import LossTerms, ReportLines, SlotInputs, TermSums, Variant
from dflash_trainer.model.variants.dflash import DFlash
from dflash_trainer.model.variants.dflash2 import DFlash2
from dflash_trainer.model.variants.dspark import DSpark

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from dflash_trainer.model.modeling.dflash import DFlashDraftModel

__all__ = ["DEFAULT", "VARIANTS", "LossTerms", "ReportLines", "SlotInputs", "TermSums", "Variant",
           "architectures", "drafter_class", "get_variant", "titles", "variant_of", "variant_of_export"]

VARIANTS: dict[str, Variant] = {variant.name: variant for variant in (DFlash(), DFlash2(), DSpark())}
"""``model.variant`` -> its variant."""
DEFAULT = VARIANTS["dflash"]
"""The variant of a drafter config that names no known architecture (exports from before
``architectures`` told variants apart)."""


def get_variant(name: str) -> Variant:
    """The variant called ``name`` (``model.variant``); :class:`ConfigError` naming the known ones."""
    try:
        return VARIANTS[name]
    except KeyError:
        raise ConfigError(f"model.variant: got {name!r}, accepted values: "
                          f"{', '.join(map(repr, VARIANTS))}") from None


def variant_of(config: PretrainedConfig) -> Variant:
    """The variant a drafter config describes, by its ``architectures`` (:data:`DEFAULT` when
    none is known)."""
    names = list(getattr(config, "architectures", None) or [])
    return next((v for v in VARIANTS.values() if v is not DEFAULT and v.architecture in names), DEFAULT)


def variant_of_export(folder: Path) -> Variant:
    """The variant of an exported drafter folder, by the ``architectures`` of its
    ``config.json`` (:func:`variant_of`): what the engines serve it as
    (:attr:`Variant.llama_cpp_spec_type`, :attr:`Variant.vllm_method`)."""
    config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    return variant_of(SimpleNamespace(architectures=config.get("architectures")))  # type: ignore[arg-type]


def drafter_class(config: PretrainedConfig) -> type[DFlashDraftModel]:
    """The model class of a drafter config (:func:`variant_of`)."""
    return variant_of(config).model_class


def architectures() -> list[str]:
    """The ``architectures`` entries of every known variant."""
    return [variant.architecture for variant in VARIANTS.values()]


def titles(names: Iterable[str]) -> str:
    """``DFlash or DFlash2``: the titles of the named variants, for messages."""
    return " or ".join(VARIANTS[name].title for name in names)
