"""Layering: the model, data and engine layers never import the layers built on them.

``model/`` and ``data/`` are used by the pipeline, the trainer, the evaluation and the command
line, ``engines/`` (llama.cpp and vLLM servers) by the evaluation and the serve check; an import
the other way (at module level or inside a function) would tie a lower layer to a higher one.
Every import statement of every module is read from its source (ast), so an import that runs
only on some paths counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dflash_trainer

PACKAGE = Path(dflash_trainer.__file__).parent
LOWER = ("dflash_trainer.model", "dflash_trainer.data", "dflash_trainer.engines")
HIGHER = ("dflash_trainer.pipeline", "dflash_trainer.cli", "dflash_trainer.train",
          "dflash_trainer.evaluate")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, *, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, dotted name) of everything ``module``'s source imports, relative imports resolved;
    ``from a import b`` gives ``a.b`` (b may be a module)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def violations(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """The imports of a lower-layer module that reach a higher layer."""
    if not module.startswith(LOWER):
        return []
    return [f"{module}:{line} imports {name}"
            for line, name in imported_modules(source, module, is_package=is_package)
            if any(name == higher or name.startswith(higher + ".") for higher in HIGHER)]


def test_the_checker_sees_imports_in_functions_and_relative_ones():
    source = ("import dflash_trainer.pipeline.channel\n"
              "def encode():\n    from dflash_trainer.evaluate import render_prompt\n"
              "from .. import cli\nfrom ..train import Trainer\n"
              "from dflash_trainer import fsutil\n")
    assert sorted(violations(source, "dflash_trainer.data.example")) == [
        "dflash_trainer.data.example:1 imports dflash_trainer.pipeline.channel",
        "dflash_trainer.data.example:3 imports dflash_trainer.evaluate.render_prompt",
        "dflash_trainer.data.example:4 imports dflash_trainer.cli",
        "dflash_trainer.data.example:5 imports dflash_trainer.train.Trainer",
    ]
    assert violations(source, "dflash_trainer.report") == []


@pytest.mark.parametrize("layer", ["model", "data"])
def test_lower_layers_do_not_import_higher_ones(layer):
    modules = sorted((PACKAGE / layer).rglob("*.py"))
    assert modules, f"no modules under {PACKAGE / layer}"
    found = [v for path in modules
             for v in violations(path.read_text(encoding="utf-8"), module_name(path),
                                 is_package=path.name == "__init__.py")]
    assert found == []
