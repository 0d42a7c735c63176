"""Every error kind the commands print has its exit code documented, and the docs agree.

docs/errors.md's kind table (``| `KIND` | CODES | what failed |``) is compared with every
:class:`~dflash_trainer.core.errors.UserError` type in the package: each type's ``kind`` is a row,
its ``exit_code`` one of that row's codes, and each row's kind is printed by some type. Every
other table in the docs that gives an exit code per row and names a kind (``| 1 | ... `data
error` ... |``) gives one of that kind's codes.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import dflash_trainer
from dflash_trainer.core.errors import UserError

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            for line in text.splitlines() if line.startswith("|") and not line.startswith("|---")]


def documented_kinds() -> dict[str, set[int]]:
    """docs/errors.md: kind -> its exit codes."""
    rows = _rows((REPO / "docs" / "errors.md").read_text(encoding="utf-8"))
    header = rows.index(["kind", "exit code", "what failed"])
    kinds: dict[str, set[int]] = {}
    for cells in rows[header + 1:]:
        match = re.fullmatch(r"`([a-z ]+)`", cells[0])
        if match is None:
            break
        kinds[match.group(1)] = {int(n) for n in re.findall(r"\b\d+\b", cells[1])}
    return kinds


def error_types() -> list[type[UserError]]:
    """Every UserError type defined in the package (each module imported)."""
    for module in pkgutil.walk_packages(dflash_trainer.__path__, "dflash_trainer."):
        # The entry point runs on import; the vLLM plug-in runs inside vLLM's own virtualenv.
        if not module.name.endswith(("__main__", "vllm_hidden_states")):
            importlib.import_module(module.name)
    found: list[type[UserError]] = []
    todo = [UserError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [cls for cls in found if cls is not UserError and cls.__module__.startswith("dflash_trainer.")]


def test_every_error_kind_and_its_exit_code_is_documented() -> None:
    kinds = documented_kinds()
    types = error_types()
    assert len(kinds) >= 10 and len(types) >= 10, (kinds, types)
    wrong = [f"{cls.__module__}.{cls.__name__}: {cls.kind!r} exits {cls.exit_code}, docs say {kinds.get(cls.kind)}"
             for cls in types if cls.exit_code not in kinds.get(cls.kind, set())]
    assert not wrong, wrong
    assert set(kinds) == {cls.kind for cls in types}, "documented kinds no error type prints: " \
        f"{set(kinds) - {cls.kind for cls in types}}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_exit_code_tables_give_each_kind_its_documented_code(doc: Path) -> None:
    kinds = documented_kinds()
    text = doc.read_text(encoding="utf-8")
    wrong = []
    for cells in _rows(text):
        codes = [i for i, cell in enumerate(cells) if re.fullmatch(r"\d+", cell)]
        if not codes:
            continue
        code = int(cells[codes[0]])
        text = " ".join(cells)
        for kind in (k for k in kinds if f"`{k}`" in text):
            if code not in kinds[kind]:
                wrong.append(f"{doc.name}: {kind!r} with exit code {code} (documented: {kinds[kind]}) in {cells}")
    assert not wrong, wrong


def test_the_evaluation_exit_codes_name_the_drafter_that_does_not_fit() -> None:
    """docs/evaluation.md gives the incompatible drafter the checkpoint error's code."""
    rows = {cells[0]: cells[1] for cells in _rows((REPO / "docs" / "evaluation.md").read_text(encoding="utf-8"))
            if len(cells) == 2 and re.fullmatch(r"\d+", cells[0])}
    assert "does not fit the target" in rows["1"] and "`checkpoint error`" in rows["1"]
    assert "checkpoint" not in rows["2"]
