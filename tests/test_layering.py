"""Layering: the package's parts import only the parts below them, and no module imports itself
through others (docs/architecture.md, "Layout").

Every import statement of every module is read from its source (ast), so an import that runs only
on some paths (inside a function) counts too; imports under ``if TYPE_CHECKING:`` serve
annotations only and count for the part rule, not for cycles.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import dflash_trainer

PACKAGE = Path(dflash_trainer.__file__).parent
ROOT = "dflash_trainer"

LAYERS: dict[str, int] = {
    "core": 0,        # errors, files, inputs, assets, processes and process groups
    "config": 1,      # the schema every part reads its section of
    "data": 2, "model": 2, "engines": 2,
    "features": 3,    # the feature store: target hidden states computed once, read by training
    "training": 4,    # the runtime: pipeline stages, drafter step, checkpoints, exports
    "evaluation": 5,  # speculative decoding, engines compared, generation
    "reporting": 6,
    "cli": 7,
    "__main__": 8,
    "": 9,            # the package itself (its __init__)
}
"""Each part's rank: a part imports parts of lower rank only (never its equals or those above)."""

TYPING_ONLY = {("core", "config")}
"""(part, imported part) pairs allowed for annotations only, under ``if TYPE_CHECKING:``."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else ""


def _typing_blocks(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return found


def imported_modules(source: str, module: str, *, is_package: bool = False) -> list[tuple[int, str, bool]]:
    """(line, dotted name, typing only) of everything ``module``'s source imports, relative
    imports resolved; ``from a import b`` gives ``a.b`` (b may be a module)."""
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    typing = _typing_blocks(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, id(node) in typing) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, f"{base}.{alias.name}", id(node) in typing) for alias in node.names]
    return found


def violations(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """The imports of ``module`` that reach a part of its own rank or above."""
    own = part_of(module)
    assert own in LAYERS, f"{module}: part {own!r} has no rank in LAYERS; add it (and to docs/architecture.md)"
    found = []
    for line, name, typing in imported_modules(source, module, is_package=is_package):
        other = part_of(name)
        if not name.startswith(ROOT + ".") or other == own:
            continue
        if other not in LAYERS or LAYERS[other] >= LAYERS[own]:
            if not (typing and (own, other) in TYPING_ONLY):
                found.append(f"{module}:{line} imports {name}")
    return found


def sources() -> dict[str, tuple[str, bool]]:
    return {module_name(path): (path.read_text(encoding="utf-8"), path.name == "__init__.py")
            for path in sorted(PACKAGE.rglob("*.py"))}


def module_graph(modules: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the package modules it imports at run time (``from a import b`` reaches ``a.b``
    when that is a module, else ``a``)."""
    graph: dict[str, set[str]] = {}
    for module, (source, is_package) in modules.items():
        edges = set()
        for _, name, typing in imported_modules(source, module, is_package=is_package):
            if typing or not name.startswith(ROOT + "."):
                continue
            target = name if name in modules else name.rpartition(".")[0]
            if target in modules and target != module:
                edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checker_sees_imports_in_functions_relative_ones_and_typing_ones():
    source = ("import dflash_trainer.training.pipeline.channel\n"
              "def encode():\n    from dflash_trainer.evaluation.evaluate import render_prompt\n"
              "from .. import cli\nfrom ..training.trainer import Trainer\n"
              "from dflash_trainer.core import fsutil\nfrom dflash_trainer.data import tokenize\n"
              "if TYPE_CHECKING:\n    from dflash_trainer.features.store import FeatureStore\n")
    assert sorted(violations(source, "dflash_trainer.data.example")) == [
        "dflash_trainer.data.example:1 imports dflash_trainer.training.pipeline.channel",
        "dflash_trainer.data.example:3 imports dflash_trainer.evaluation.evaluate.render_prompt",
        "dflash_trainer.data.example:4 imports dflash_trainer.cli",
        "dflash_trainer.data.example:5 imports dflash_trainer.training.trainer.Trainer",
        "dflash_trainer.data.example:9 imports dflash_trainer.features.store.FeatureStore",
    ]
    assert violations(source, "dflash_trainer.cli.example") == []
    assert violations("if TYPE_CHECKING:\n    from dflash_trainer.config import Config\n",
                      "dflash_trainer.core.example") == []
    assert violations("from dflash_trainer.config import Config\n", "dflash_trainer.core.example") == [
        "dflash_trainer.core.example:1 imports dflash_trainer.config.Config"]


def test_the_cycle_finder_finds_one_hidden_in_a_function():
    modules = {"dflash_trainer.model.a": ("from dflash_trainer.model.b import x\n", False),
               "dflash_trainer.model.b": ("def f():\n    from dflash_trainer.model import a\n", False),
               "dflash_trainer.model.c": ("from dflash_trainer.model import a\n", False)}
    assert cycles(module_graph(modules)) == [["dflash_trainer.model.a", "dflash_trainer.model.b"]]


def test_every_part_imports_only_parts_below_it():
    found = [v for module, (source, is_package) in sources().items()
             for v in violations(source, module, is_package=is_package)]
    assert found == []


def test_the_top_level_holds_parts_only():
    """The package's top level names its parts; a new module goes into one of them. ``configs``
    is no part: the shipped config files (package data, a link to the repository's configs/)."""
    top = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__" and not p.name.endswith(".egg-info"))
    assert top == sorted(["__init__.py", "__main__.py", "config.py", "configs",
                          *(name for name in LAYERS if name not in ("config", "__main__", ""))])


@pytest.mark.parametrize("part", ["training", "features", "model", "data", "core"])
def test_the_training_runtime_never_reaches_evaluation_serving_or_reporting(part):
    """The rank rule implies it; spelled out because it is the rule that keeps the trainer small."""
    banned = ("evaluation", "reporting", "cli", "engines") if part == "training" else ("evaluation", "reporting", "cli")
    found = [f"{module}:{line} imports {name}"
             for module, (source, is_package) in sources().items() if part_of(module) == part
             for line, name, _ in imported_modules(source, module, is_package=is_package)
             if part_of(name) in banned and name.startswith(ROOT + ".")]
    assert found == []


def test_no_import_cycles():
    assert cycles(module_graph(sources())) == []


def test_the_layout_in_the_docs_is_the_one_tested():
    """docs/architecture.md, "Layout": one row per part with its rank, as LAYERS has them."""
    text = (PACKAGE.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| `([\w_]+)`", section, re.M)
    assert {part: int(rank) for rank, part in rows} == {k: v for k, v in LAYERS.items() if k}
