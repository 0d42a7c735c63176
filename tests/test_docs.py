"""The user docs (README.md, docs/*.md) against what they describe: the config files, the
result files in benchmarks/results/ and the metrics the code logs.

- Every file in benchmarks/results/ is cited by its path somewhere in the docs, and every
  cited ``benchmarks/results/...`` path exists.
- A markdown table whose header names config files (`` `configs/NAME.yaml` ``) states, in each
  row that starts with a backticked dotted key, that key's value in each named file: the first
  backticked token of the cell is compared with the file as ``load_config`` resolves it.
- In the sections about the demo, every backticked ``key: value`` is a value of
  configs/demo-cpu.yaml, and the sentences that give the demo's numbers in words match it.
- The README's metrics glossary lists every metric the code logs, and nothing else.
- docs/ holds user documentation: no dated entries, process words or paths of one machine,
  and no words that date a fact ("today", "this machine", "it is not done").
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from dflash_trainer.config import Config, load_config

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RESULTS = REPO / "benchmarks" / "results"
DEMO_CONFIG = "configs/demo-cpu.yaml"
UNSET = object()


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _section(path: Path, heading: str) -> str:
    """The text under the markdown heading ``heading`` up to the next heading of its level or above."""
    text = _text(path)
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.M)
    assert match, f"{_rel(path)}: no heading {heading!r} (update tests/test_docs.py if it moved)"
    level = len(match.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, match.end())
    return text[match.end():end.start() if end else len(text)]


def _tables(text: str) -> list[list[list[str]]]:
    """Markdown tables as rows of cells (the separator row dropped; ``\\|`` stays in its cell)."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def _config_value(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        if not hasattr(node, part):
            return UNSET
        node = getattr(node, part)
    return node


def _doc_value(text: str) -> Any:
    """A value as the docs write it: YAML, with ``none`` for unset."""
    if text in ("none", "null"):
        return None
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads 6e-4 as a string
        except ValueError:
            return value
    return value


def _same(doc: Any, actual: Any) -> bool:
    if isinstance(actual, tuple):
        actual = list(actual)
    if isinstance(doc, list) and isinstance(actual, list):
        return len(doc) == len(actual) and all(_same(d, a) for d, a in zip(doc, actual))
    if isinstance(doc, (int, float)) and isinstance(actual, (int, float)) and not isinstance(doc, bool):
        return math.isclose(doc, actual, rel_tol=1e-9)
    return doc == actual


# --- result files ----------------------------------------------------------------------------

CITED = re.compile(r"benchmarks/results/[A-Za-z0-9_.-]*[A-Za-z0-9_-]")


def _cited() -> dict[str, list[str]]:
    cited: dict[str, list[str]] = {}
    for doc in DOCS:
        for path in CITED.findall(_text(doc)):
            cited.setdefault(path, []).append(_rel(doc))
    return cited


def test_every_result_file_is_cited():
    cited = _cited()
    uncited = [_rel(p) for p in sorted(RESULTS.iterdir()) if p.is_file() and _rel(p) not in cited]
    assert not uncited, (f"result files no doc cites by path (cite them where their figures are "
                         f"shown, or git rm them): {uncited}")


def test_every_cited_result_file_exists():
    missing = {path: docs for path, docs in _cited().items() if not (REPO / path).is_file()}
    assert not missing, f"docs cite result files that do not exist: {missing}"


# --- config values ---------------------------------------------------------------------------

def _config_tables() -> list[tuple[str, str, str, str]]:
    """(doc, config file, key, cell) for every config-table cell in the docs."""
    claims = []
    for doc in DOCS:
        for table in _tables(_text(doc)):
            header = table[0]
            columns = {i: m.group(1) for i, cell in enumerate(header)
                       if (m := re.fullmatch(r"`(configs/[\w.-]+\.yaml)`", cell))}
            for row in table[1:] if columns else []:
                key = re.fullmatch(r"`([a-z_]+\.[a-z_.]+)`", row[0])
                if key:
                    claims += [(_rel(doc), config, key.group(1), row[i]) for i, config in columns.items()]
    return claims


def test_config_tables_match_the_config_files():
    configs: dict[str, Config] = {}
    wrong = []
    for doc, config, key, cell in _config_tables():
        cfg = configs.setdefault(config, load_config(REPO / config))
        value = re.match(r"`([^`]*)`", cell)
        actual = _config_value(cfg, key)
        if value is None or actual is UNSET or not _same(_doc_value(value.group(1)), actual):
            wrong.append(f"{doc}: {key} in {config}: the docs say {cell!r}, the file resolves to "
                         f"{'no such key' if actual is UNSET else repr(actual)}")
    assert not wrong, "\n".join(wrong)


def test_the_demo_config_table_names_the_settings_that_define_the_demo():
    stated = {key for doc, config, key, _ in _config_tables() if doc == "README.md" and config == DEMO_CONFIG}
    required = {"training.max_steps", "model.block_size", "model.num_layers", "training.labels",
                "data.max_length"}
    assert required <= stated, f"README's demo config table lacks {sorted(required - stated)}"


# The sections about the demo: every backticked `key: value` in them is a demo-config value.
DEMO_SECTIONS = [("README.md", "Quick start"), ("README.md", "The demo config"),
                 ("docs/data.md", "The demo"), ("docs/quality.md", "CPU, `make demo`: `configs/demo-cpu.yaml`")]


@pytest.mark.parametrize(("doc", "heading"), DEMO_SECTIONS)
def test_demo_sections_name_demo_config_values(doc, heading):
    cfg = load_config(REPO / DEMO_CONFIG)
    claims = re.findall(r"`([a-z_]+\.[a-z_.]+): ([^`]+)`", _section(REPO / doc, heading))
    wrong = [f"{key}: {text} (the config: {_config_value(cfg, key)!r})" for key, text in claims
             if not _same(_doc_value(text), _config_value(cfg, key))]
    assert not wrong, f"{doc} '{heading}' disagrees with {DEMO_CONFIG}: {wrong}"


def _number(text: str) -> int:
    return int(text.replace(",", ""))


# (doc, pattern, config keys of its groups, with a function from the config value to the number
# the sentence gives); each sentence must be there, so that rewording it updates this list.
DEMO_SENTENCES = [
    ("README.md", r"trains ([\d,]+) optimizer steps with", [("training.max_steps", int)]),
    ("README.md", r"the same ([\d,]+)-step demo", [("training.max_steps", int)]),
    ("README.md", r"on (\d+) MT-Bench first turns x (\d+) tokens",
     [("eval.in_training_prompts", int), ("eval.max_new_tokens", int)]),
    ("README.md", r"`training\.max_steps` \| `\d+` \| optimizer steps, one (\d+)-token sample each",
     [("data.max_length", int)]),
    ("README.md", r"an anchor and (\d+) drafts", [("model.block_size", lambda b: b - 1)]),
    ("docs/quality.md", r"([\d,]+)\s+optimizer steps of one (\d+)-token sample each",
     [("training.max_steps", int), ("data.max_length", int)]),
    ("docs/quality.md", r"the first (\d+)\s+MT-Bench first turns x (\d+) tokens",
     [("eval.in_training_prompts", int), ("eval.max_new_tokens", int)]),
]


@pytest.mark.parametrize(("doc", "pattern", "keys"), DEMO_SENTENCES)
def test_demo_sentences_match_the_config(doc, pattern, keys):
    cfg = load_config(REPO / DEMO_CONFIG)
    matches = list(re.finditer(pattern, _text(REPO / doc)))
    assert matches, f"{doc}: no sentence matching {pattern!r} (update tests/test_docs.py if it was reworded)"
    for match in matches:
        for group, (key, expected) in zip(match.groups(), keys):
            assert _number(group) == expected(_config_value(cfg, key)), (
                f"{doc}: {match.group(0)!r} but {DEMO_CONFIG} has {key} = {_config_value(cfg, key)!r}")


# --- metrics glossary ------------------------------------------------------------------------

METRIC = re.compile(r"(train|perf|data|pipe|plan|eval)/[A-Za-z0-9_{}/]*[A-Za-z0-9_}]")
# Window counters the monitor turns into rates and run totals; they are not logged as such.
CONSUMED = {"train/tokens": "train/tokens_total", "train/samples": "train/samples_total"}


def _logged_metrics() -> set[str]:
    """Metric names in the package's string literals; an f-string's fields become ``{}``.
    report.py only reads them (and names evaluation files the same way)."""
    names: set[str] = set()
    for path in (REPO / "src" / "dflash_trainer").rglob("*.py"):
        if path.name == "report.py":
            continue
        for node in ast.walk(ast.parse(_text(path))):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            if METRIC.fullmatch(text):
                names.add(CONSUMED.get(text, text))
    return names


def _glossary() -> set[str]:
    tables = _tables(_section(REPO / "README.md", "Metrics glossary"))
    assert len(tables) == 1, "README's metrics glossary should be one table"
    return {name for row in tables[0][1:] for name in re.findall(r"`([^`]+)`", row[0])}


def _matches(code_name: str, glossary_name: str) -> bool:
    """A ``{}`` field of the code matches a ``{placeholder}`` or a literal part of the glossary."""
    parts = [re.escape(p) for p in code_name.split("{}")]
    return re.fullmatch(r"(\{[a-z_]+\}|[A-Za-z0-9_]+)".join(parts), glossary_name) is not None


def test_the_metrics_glossary_lists_every_logged_metric():
    logged, glossary = _logged_metrics(), _glossary()
    assert len(logged) > 30, f"the scan found too few metric names to be right: {sorted(logged)}"
    missing = sorted(n for n in logged if not any(_matches(n, g) for g in glossary))
    unknown = sorted(g for g in glossary if not any(_matches(n, g) for n in logged))
    assert not missing, f"metrics the code logs that README's glossary lacks: {missing}"
    assert not unknown, f"README's glossary lists metrics the code does not log: {unknown}"


# --- user docs only --------------------------------------------------------------------------

NOT_FOR_USERS = {
    "a dated entry": r"\b20\d\d-[01]\d-[0-3]\d\b",
    "a process word": r"\b(TODO|backlog|goal|session|we tried)\b",
    "a document that is not in the repository": r"DESIGN\.md|dflash-method",
    "a path of one machine": r"(?<![\w.~])/(tmp|work|home|root)/",
}


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_docs_hold_user_documentation_only(doc):
    text = _text(doc)
    found = [f"{what}: {m.group(0)!r} at line {text.count(chr(10), 0, m.start()) + 1}"
             for what, pattern in NOT_FOR_USERS.items() for m in re.finditer(pattern, text, re.I)]
    assert not found, f"{_rel(doc)}: {found}"


# Docs state facts that hold for every reader, not the day they were written: when, where and
# how far along a measurement or a piece of work was belongs in its result file (or nowhere).
WEATHER = re.compile(
    r"\b(that day|today|tonight|yesterday|tomorrow|this week|these days|right now|at the moment"
    r"|for now|this (?:busy |shared |quiet |loaded )?machine|(?:it|this|that) is not done"
    r"|not (?:done|finished|implemented) yet|the (?:old|new) (?:behaviou?r|code|default|layout)"
    r"|older code|before the fix)\b".replace(" ", r"\s+"), re.I)  # a phrase may wrap


def _prose(text: str) -> str:
    """``text`` with code spans and blocks blanked (newlines kept, so line numbers hold): quoted
    program output (`the drafter does not pay on this machine`) is what a command prints."""
    return re.sub(r"(`+).+?\1", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_docs_state_facts_not_the_days_weather(doc):
    text = _prose(_text(doc))
    found = [f"{m.group(0)!r} at line {text.count(chr(10), 0, m.start()) + 1}: "
             f"{text.splitlines()[text.count(chr(10), 0, m.start())].strip()}"
             for m in WEATHER.finditer(text)]
    assert not found, f"{_rel(doc)}: {found}"
