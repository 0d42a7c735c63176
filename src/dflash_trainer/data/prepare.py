"""``dflash-trainer prepare``: read the chat data, tokenize it into the token store, report.

:func:`build_dataset` is what the trainer calls: it returns the memory-mapped
:class:`~dflash_trainer.data.cache.TokenStore` for the config, reusing the cached one when the
data files, tokenizer, chat template and options are unchanged. The first
``data.heldout_samples`` records of the first ``data.paths`` entry never enter training; they are
the evaluation prompts of :func:`heldout_conversations`; they may be at most
:data:`HELDOUT_MAX_SHARE` of that entry's records (a larger share is refused).

No data disappears silently: a file with no records, a file none of whose records became a
sample and a store with no samples are errors; every dropped record is counted by reason and
listed with its file and line in the store's ``dropped.jsonl``; :func:`build_dataset` logs the
counts (``prepare`` and ``train`` both print them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

if TYPE_CHECKING:
    from dflash_trainer.core.distributed import DistInfo

from dflash_trainer.core.assets import cache_root, load_tokenizer, resolve_target
from dflash_trainer.config import Config, FieldsConfig, config_to_dict, save_config
from dflash_trainer.data.cache import (
    FORMAT_VERSION,
    TokenStore,
    TokenStoreWriter,
    file_fingerprint,
    find_store,
    fingerprint,
    tokenizer_fingerprint,
)
from dflash_trainer.data.coverage import format_coverage, store_coverage
from dflash_trainer.data.formats import (
    Conversation,
    DataError,
    Record,
    Rejected,
    Source,
    SourceStats,
    Tokenized,
    apply_on_error,
    drop_leading_assistant,
    expand_paths,
    on_error_policy,
    read_source,
)
from dflash_trainer.data.show import show_samples
from dflash_trainer.data.tokenize import (
    RULES_VERSION,
    ChatTokenizer,
    Dropped,
    Samples,
    TokenizeOptions,
)
from dflash_trainer.core.errors import ConfigError
from dflash_trainer.core.fsutil import atomic_write_text, remove_stale_temp_dirs

DROP_REASONS = ("malformed", "empty", "no_assistant", "empty_answer", "too_short", "too_long",
                "unrenderable", "tools_unsupported")
_DROP_LABELS = {"malformed": "malformed", "empty": "empty conversation",
                "no_assistant": "no assistant turn", "empty_answer": "empty answers",
                "too_short": "too short (supervised)", "too_long": "too long",
                "unrenderable": "template cannot render", "tools_unsupported": "tools unsupported"}
RENDER_REASONS = ("unrenderable", "tools_unsupported")
"""Drops that stop ``prepare`` only with an explicit ``data.on_error=raise``."""
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_BATCH = 256
_EXAMPLES_PER_REASON = 3
_PROGRESS_EVERY_S = 5.0
HELDOUT_MAX_SHARE = 0.5
"""The held-out split takes at most this share of the first ``data.paths`` entry's records."""
DROPPED_FILE = "dropped.jsonl"
"""Every dropped record of a store: ``{"reason", "message"}`` (the message names file and line)."""

Log = Callable[[str], None]


@dataclass(kw_only=True)
class PrepareStats:
    """What one preparation read, kept and dropped (stored in the token store's meta)."""

    records_read: int = 0
    """Records read for training (after the held-out ones, up to ``max_samples``)."""
    heldout: int = 0
    kept: int = 0
    """Records that gave at least one sample."""
    samples: int = 0
    """Samples written: one per kept record, plus the per-turn samples of expanded ones."""
    expanded: int = 0
    """Kept conversations some of whose turns became samples of their own (the template renders
    them differently as history)."""
    turn_samples: int = 0
    """Per-turn samples (each repeats its conversation's history as context)."""
    expansion_tokens: int = 0
    """Tokens of the per-turn samples: the cost of the expansion."""
    turns_skipped_long: int = 0
    """Per-turn samples left out because their context alone is longer than ``data.max_length``."""
    turn_drops: dict[str, int] = field(default_factory=dict)
    """Per-turn samples dropped by reason (too short, too long) in conversations kept otherwise."""
    reasoning_answers: int = 0
    """Supervised answers that carried reasoning (a reasoning field or an inline think block)."""
    reasoning_unrendered: int = 0
    """Of those, answers whose reasoning the chat template does not render (trained without it)."""
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    examples: dict[str, list[str]] = field(default_factory=dict)
    """The first few messages of each drop reason, with file and line."""
    truncated: int = 0
    """Kept samples cut to ``data.max_length``."""
    trimmed_leading: int = 0
    """Conversations whose assistant messages before the first user message were removed."""
    dropped_fields: dict[str, int] = field(default_factory=dict)
    """Fields of the records read that no chat template renders, left out, by name (summed over
    the files; held-out records included)."""
    cut_answers: int = 0
    """Kept answers marked ``truncated`` (cut before the model ended its turn)."""
    empty_answers: int = 0
    """Empty or whitespace-only answers of kept conversations, left unsupervised (a conversation
    whose every answer is empty is dropped as ``empty_answer`` instead)."""
    total_tokens: int = 0
    supervised_tokens: int = 0
    max_samples_reached: bool = False
    sources: list[dict[str, Any]] = field(default_factory=list)
    template_mode: str = ""
    notes: list[str] = field(default_factory=list)
    build_time_s: float = 0.0
    cache_path: str = ""
    reused: bool = False
    """True when an existing store was found and nothing was tokenized."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrepareStats:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def drop(self, reason: str, message: str) -> None:
        self.dropped[reason] += 1
        examples = self.examples.setdefault(reason, [])
        if len(examples) < _EXAMPLES_PER_REASON:
            examples.append(message)

    def summary(self) -> str:
        """One line of counts: read, held out, kept, dropped by reason, truncated."""
        reasons = ", ".join(f"{_DROP_LABELS[r]} {n:,}" for r, n in self.dropped.items() if n)
        dropped = sum(self.dropped.values())
        return (f"{self.records_read:,} records read (+{self.heldout:,} held out), "
                f"{self.kept:,} kept" + (f" ({self.samples:,} samples)" if self.samples > self.kept else "")
                + f", {dropped:,} dropped"
                + (f" ({reasons})" if reasons else "")
                + f", {self.truncated:,} truncated to data.max_length"
                + (f", {self.empty_answers:,} empty answers unsupervised" if self.empty_answers else "")
                + (f", fields dropped: {format_counts(self.dropped_fields)}" if self.dropped_fields else ""))


def format_counts(counts: dict[str, int]) -> str:
    """``name N, name M`` by count, largest first (dropped field names and their counts)."""
    return ", ".join(f"{name} {n:,}" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def cache_dir(cfg: Config) -> Path:
    """Folder holding the token stores: ``data.cache_dir`` or ``<user cache>/tokens``."""
    return Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else cache_root() / "tokens"


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_dataset(cfg: Config, *, tokenizer: Any = None,
                  log: Log | None = _stderr) -> tuple[TokenStore, PrepareStats]:
    """The token store for ``cfg`` (built, or reused when its inputs are unchanged) and its
    statistics. ``tokenizer`` defaults to the target's; ``log`` receives progress lines."""
    log = log or (lambda _: None)
    sources = expand_paths(cfg.data.paths)
    if tokenizer is None:
        target = resolve_target(cfg.model.target)
        tokenizer = load_tokenizer(target)
    else:
        # The folder the tokenizer was loaded from is the target's (unless built in memory).
        name = getattr(tokenizer, "name_or_path", "")
        target = Path(name) if name and Path(name).is_dir() else None
    if target is not None:
        check_context_length(cfg, target)
    options = TokenizeOptions.from_config(cfg)
    key_parts = {
        "format_version": FORMAT_VERSION,
        "tokenize_rules": RULES_VERSION,
        "files": _file_identities(sources, cache_dir(cfg), log),
        "origins": [s.origin for s in sources],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "options": dataclasses.asdict(options),
        "format": cfg.data.format,
        # Only a set field map is part of the key, so stores built before it existed stay valid.
        **({"fields": dataclasses.asdict(cfg.data.fields)} if cfg.data.fields != FieldsConfig() else {}),
        "on_error": [on_error_policy(cfg.data.on_error, s) for s in sources],
        "heldout_samples": cfg.data.heldout_samples,
        "max_samples": cfg.data.max_samples,
    }
    if _GENERATION_TAG.search(str(getattr(tokenizer, "chat_template", None) or "")):
        # Stores of such templates were built from their {% generation %} spans before per-turn
        # samples; the spans now come from engine renders, so those stores are rebuilt. The key
        # of every other store is unchanged (see tokenize.RULES_VERSION).
        key_parts["spans"] = "engine renders"
    path = cache_dir(cfg) / fingerprint(key_parts)
    remove_stale_temp_dirs(path.parent)  # stores whose build was killed
    store = find_store(path)
    if store is not None:
        stats = PrepareStats.from_dict(store.stats)
        stats.reused, stats.cache_path = True, str(path)
        _refuse_render_drops(cfg, stats)
        log(f"prepare: reusing the token store {path}")
        log(f"data: {stats.summary()}; dropped records listed in {path / DROPPED_FILE}")
        log(sample_choice(stats))
        if len(store) == 0:
            raise DataError(f"the token store {path} has no samples ({stats.summary()}); "
                            "delete it and check data.paths")
        return store, stats

    chat = ChatTokenizer(tokenizer, options)
    stats = PrepareStats(template_mode="engine renders")
    if options.thinking and not chat.supports_thinking:
        stats.notes.append("data.thinking=true has no effect: the chat template does not read "
                           "enable_thinking")

    def fill(writer: TokenStoreWriter) -> dict[str, Any]:
        started = time.monotonic()
        with open(writer.folder / DROPPED_FILE, "w", encoding="utf-8") as dropped_file:
            _tokenize_into(writer, cfg, sources, chat, stats, log, dropped_file)
        stats.build_time_s = round(time.monotonic() - started, 3)
        stats.cache_path = str(path)
        return {"key": key_parts, "stats": stats.to_dict(), "config": config_to_dict(cfg)}

    log(f"prepare: tokenizing {', '.join(cfg.data.paths)} into {path}")
    store = TokenStore.build(path, fill, on_wait=log)
    if not store.built_here:  # another process built it while this one waited
        stats = PrepareStats.from_dict(store.stats)
        stats.reused, stats.cache_path = True, str(path)
    log(f"data: {stats.summary()}; dropped records listed in {path / DROPPED_FILE}")
    log(sample_choice(stats))
    return store, stats


def _file_identities(sources: list[Source], cache: Path, log: Log) -> list[dict[str, Any]]:
    """:func:`file_fingerprint` of every source (by content), with one line of what hashing cost."""
    started = time.perf_counter()
    found = [file_fingerprint(s.path, cache) for s in sources]
    hashed = [f for (f, memoised) in found if not memoised]
    size_mb = sum(f["size"] for f in hashed) / 1e6
    log(f"prepare: content hash of {len(found)} data file(s): {len(hashed)} hashed ({size_mb:.1f} MB) in "
        f"{time.perf_counter() - started:.2f} s, {len(found) - len(hashed)} unchanged since their last hash")
    return [f for f, _ in found]


def target_context_length(target: Path) -> int | None:
    """``max_position_embeddings`` of a target folder's ``config.json`` (None when unknown)."""
    try:
        config = json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config") or config
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def check_context_length(cfg: Config, target: Path) -> None:
    """Refuse a ``data.max_length`` longer than the target's context (its positions past the
    context have no trained rotary embedding, so its features there are meaningless)."""
    context = target_context_length(target)
    if context is not None and cfg.data.max_length > context:
        raise ConfigError(f"data.max_length={cfg.data.max_length} is longer than the target's "
                          f"context of {context} tokens ({Path(target) / 'config.json'}: "
                          f"max_position_embeddings); set data.max_length <= {context}")


def split_records(cfg: Config, sources: list[Source], source_stats: list[SourceStats]
           ) -> Iterator[tuple[bool, Source, Record]]:
    """(held_out, source, record) for every record, the first ``heldout_samples`` records of
    the first ``data.paths`` entry marked held out; malformed records raise under ``raise``."""
    heldout_left = cfg.data.heldout_samples
    for source in sources:
        stats = SourceStats(path=str(source.path))
        source_stats.append(stats)
        policy = on_error_policy(cfg.data.on_error, source)
        for record in read_source(source, format=cfg.data.format, fields=cfg.data.fields, stats=stats):
            record = apply_on_error(record, policy)
            held = heldout_left > 0 and source.origin == sources[0].origin
            if held:
                heldout_left -= 1
            yield held, source, record


def _tokenize_into(writer: TokenStoreWriter, cfg: Config, sources: list[Source],
                   chat: ChatTokenizer, stats: PrepareStats, log: Log, dropped_file: TextIO) -> None:
    source_stats: list[SourceStats] = []
    batch: list[tuple[Conversation | Tokenized, Source]] = []
    kept_per_file: dict[str, int] = {}
    read_per_file: dict[str, int] = {}
    started = last_log = time.monotonic()

    def drop(reason: str, message: str) -> None:
        stats.drop(reason, message)
        dropped_file.write(json.dumps({"reason": reason, "message": message}) + "\n")

    def flush() -> None:
        for (_record, source), result in zip(batch, chat.encode_batch([r for r, _ in batch])):
            if isinstance(result, Dropped):
                if ((result.reason == "malformed" and on_error_policy(cfg.data.on_error, source) == "raise")
                        or (result.reason in RENDER_REASONS and cfg.data.on_error == "raise")):
                    raise DataError(f"{result.message} (with data.on_error=skip such records "
                                    "are skipped and counted instead)")
                drop(result.reason, result.message)
                continue
            assert isinstance(result, Samples)
            add_samples(stats, result)
            for encoded in result.encoded:
                writer.add(encoded.input_ids, encoded.loss_mask)
            for turn_drop in result.turn_drops:
                dropped_file.write(json.dumps({"reason": turn_drop.reason, "turn": True,
                                               "message": turn_drop.message}) + "\n")
            kept_per_file[str(source.path)] = kept_per_file.get(str(source.path), 0) + 1
        batch.clear()

    limit = cfg.data.max_samples
    try:
        for held, source, record in split_records(cfg, sources, source_stats):
            if held:
                stats.heldout += 1
                continue
            if limit is not None and stats.records_read >= limit:
                break  # only reached with max_samples=0
            stats.records_read += 1
            read_per_file[str(source.path)] = read_per_file.get(str(source.path), 0) + 1
            if isinstance(record, Rejected):
                drop(record.reason, record.describe())
            else:
                batch.append((record, source))
            if len(batch) >= _BATCH:
                flush()
                now = time.monotonic()
                if now - last_log >= _PROGRESS_EVERY_S:
                    last_log = now
                    rate = stats.records_read / (now - started)
                    log(f"  {stats.records_read} records read, {stats.kept} kept, "
                        f"{stats.total_tokens:,} tokens ({rate:.0f} records/s)")
            if limit is not None and stats.records_read >= limit:
                # Stop before reading another record, so no file is read further than needed.
                stats.max_samples_reached = True
                source_stats[-1].stopped_early = True
                break
        flush()
    finally:
        stats.sources = [dataclasses.asdict(s) for s in source_stats]
        for source in source_stats:
            for name, count in source.dropped_fields.items():
                stats.dropped_fields[name] = stats.dropped_fields.get(name, 0) + count
    _check_heldout_share(cfg, sources, source_stats, stats)
    _check_nothing_lost(read_per_file, kept_per_file, stats)


def _refuse_render_drops(cfg: Config, stats: PrepareStats) -> None:
    """Under an explicit ``data.on_error=raise``, a reused store that dropped records the template
    cannot render is refused as a fresh build would stop (the store key does not tell ``raise``
    from ``auto``, under which such records are dropped)."""
    if cfg.data.on_error != "raise":
        return
    for reason in RENDER_REASONS:
        if stats.dropped.get(reason):
            example = (stats.examples.get(reason) or [reason])[0]
            raise DataError(f"{example} (with data.on_error=skip such records are skipped and counted "
                            "instead)")


def add_samples(stats: PrepareStats, result: Samples) -> None:
    """Count one kept record's samples into ``stats``."""
    stats.kept += 1
    stats.samples += len(result.encoded)
    own = sum(not e.whole for e in result.encoded)
    stats.expanded += own > 0
    stats.turn_samples += own
    stats.expansion_tokens += result.expansion_tokens
    stats.turns_skipped_long += result.turns_skipped_long
    for turn_drop in result.turn_drops:
        stats.turn_drops[turn_drop.reason] = stats.turn_drops.get(turn_drop.reason, 0) + 1
    stats.reasoning_answers += result.reasoning_answers
    stats.reasoning_unrendered += result.reasoning_unrendered
    stats.trimmed_leading += int(result.trimmed_leading > 0)
    stats.cut_answers += result.cut_answers
    stats.empty_answers += result.empty_answers
    for encoded in result.encoded:
        stats.total_tokens += len(encoded.input_ids)
        stats.supervised_tokens += int(encoded.loss_mask.sum())
        stats.truncated += int(encoded.truncated)


def sample_choice(stats: PrepareStats) -> str:
    """One line: one sample per conversation or per turn, why, and what the expansion cost."""
    whole = stats.kept - stats.expanded
    line = (f"samples: {whole:,} conversations as one sample each (the template renders their history "
            "as a prefix of the whole chat)")
    if stats.expanded:
        share = 100 * stats.expansion_tokens / stats.total_tokens if stats.total_tokens else 0.0
        line += (f"; {stats.expanded:,} expanded into {stats.turn_samples:,} per-turn samples (the "
                 "template renders an earlier turn differently as history, e.g. without its <think> "
                 f"block), +{stats.expansion_tokens:,} tokens ({share:.1f}% of all) of repeated history")
    if stats.turns_skipped_long:
        line += (f"; {stats.turns_skipped_long:,} turns skipped: their context alone is longer than "
                 "data.max_length")
    if stats.turn_drops:
        line += "; per-turn samples dropped: " + ", ".join(
            f"{_DROP_LABELS[r]} {n:,}" for r, n in sorted(stats.turn_drops.items()))
    return line


def reasoning_line(stats: PrepareStats) -> str | None:
    """One line on the answers that carried reasoning (None when none did)."""
    if not stats.reasoning_answers:
        return None
    line = f"reasoning: {stats.reasoning_answers:,} supervised answers carried reasoning"
    if stats.reasoning_unrendered:
        line += (f", {stats.reasoning_unrendered:,} of them trained without it (the chat template does "
                 "not render their reasoning)")
    return line + " (rendered with enable_thinking on, whatever data.thinking says)"


def _check_heldout_share(cfg: Config, sources: list[Source], source_stats: list[SourceStats],
                         stats: PrepareStats) -> None:
    first = [s for src, s in zip(sources, source_stats) if src.origin == sources[0].origin]
    if not stats.heldout or any(s.stopped_early for s in first):
        return  # only a fully read first entry tells its size
    total = sum(s.records for s in first)
    if stats.heldout > HELDOUT_MAX_SHARE * total:
        allowed = int(HELDOUT_MAX_SHARE * total)
        raise DataError(f"data.heldout_samples={cfg.data.heldout_samples} would hold out "
                        f"{stats.heldout} of the {total} records of {sources[0].origin!r} "
                        f"(at most {HELDOUT_MAX_SHARE:.0%} may be held out); set "
                        f"data.heldout_samples={allowed} or less (0 holds none out)")


def _check_nothing_lost(read_per_file: dict[str, int], kept_per_file: dict[str, int],
                        stats: PrepareStats) -> None:
    where = (f"counts: {stats.summary()}; see the examples in the prepare report and check "
             "data.max_length, data.min_supervised_tokens and data.on_too_long")
    if stats.kept == 0:
        raise DataError(f"no training samples: {where}")
    for path, read in read_per_file.items():
        if not kept_per_file.get(path):
            raise DataError(f"data file {path!r}: none of its {read} records read for training "
                            f"became a sample; {where}")


def heldout_conversations(cfg: Config) -> list[list[dict[str, str]]]:
    """Normalised messages of the held-out conversations: the first ``data.heldout_samples``
    records of the first ``data.paths`` entry, without assistant messages before the first user
    message. Malformed, empty, pre-tokenized and user-less records give none."""
    conversations = []
    for held, _, record in split_records(cfg, expand_paths(cfg.data.paths), []):
        if not held:
            break
        if not isinstance(record, Conversation):
            continue
        if not any(m["role"] == "user" for m in record.messages):
            continue
        conversations.append(drop_leading_assistant(record.messages)[0])
    return conversations


def length_histogram(lengths: np.ndarray, max_length: int) -> list[tuple[int, int, int]]:
    """(low, high, count) bins over sample lengths: powers of two up to ``max_length``."""
    edges = [0]
    edge = 32
    while edge < max_length:
        edges.append(edge)
        edge *= 2
    edges.append(max_length)
    edges.append(max(max_length, int(lengths.max()) if lengths.size else 0) + 1)
    counts, _ = np.histogram(lengths, bins=edges)
    return [(lo, hi - 1, int(c)) for lo, hi, c in zip(edges[:-1], edges[1:], counts)]


def format_report(stats: PrepareStats, store: TokenStore, max_length: int) -> str:
    """Human-readable statistics, with a text histogram of sample lengths."""
    lines = []
    for source in stats.sources:
        line = f"  {source['path']}: {source['records']} records read"
        if source["malformed"]:
            line += f", {source['malformed']} malformed"
        if source["truncated_tail"]:
            line += (f"; the file is truncated at its end: {source['records'] - 1} complete "
                     "records recovered, the cut-off one skipped")
        if source["stopped_at_error"]:
            line += "; reading stopped at an invalid JSON element (rest unreadable)"
        if source["stopped_early"]:
            line += " (stopped at data.max_samples)"
        if source.get("dropped_fields"):
            line += f"; fields dropped: {format_counts(source['dropped_fields'])}"
        lines.append(line)
    lines = ["sources:"] + lines
    dropped = sum(stats.dropped.values())
    lines += [
        f"records read         {stats.records_read:>10,}"
        + (f"   (+{stats.heldout} held out for evaluation)" if stats.heldout else ""),
        f"kept                 {stats.kept:>10,}" + (f"   ({stats.samples:,} samples)"
                                                     if stats.samples > stats.kept else ""),
        f"dropped              {dropped:>10,}",
    ]
    for reason in DROP_REASONS:
        lines.append(f"  {_DROP_LABELS[reason]:<24}{stats.dropped.get(reason, 0):>8,}")
    lines += [
        f"truncated to {max_length:<8}{stats.truncated:>10,}",
        f"leading assistant turns removed in {stats.trimmed_leading:,} conversations",
        *([f"answers marked truncated  {stats.cut_answers:>6,}   (their end of turn is not supervised)"]
          if stats.cut_answers else []),
        *([f"empty answers unsupervised {stats.empty_answers:>5,}   (in kept conversations with other answers)"]
          if stats.empty_answers else []),
        *([f"fields dropped       {sum(stats.dropped_fields.values()):>10,}   (no chat template renders them: "
           f"{format_counts(stats.dropped_fields)})"] if stats.dropped_fields else []),
        f"tokens               {stats.total_tokens:>10,}",
        f"supervised tokens    {stats.supervised_tokens:>10,}"
        + (f"   ({100 * stats.supervised_tokens / stats.total_tokens:.1f}%)"
           if stats.total_tokens else ""),
        sample_choice(stats),
        *([line] if (line := reasoning_line(stats)) else []),
    ]
    for reason, examples in stats.examples.items():
        for example in examples:
            lines.append(f"  e.g. {reason}: {example}")
    lines += [f"note: {note}" for note in stats.notes]
    if len(store):
        lengths = store.lengths
        lines.append(f"sample length (tokens): mean {lengths.mean():.0f}, median "
                     f"{int(np.median(lengths))}, max {int(lengths.max())}")
        bins = length_histogram(lengths, max_length)
        peak = max(c for _, _, c in bins) or 1
        for lo, hi, count in bins:
            bar = "#" * round(40 * count / peak)
            lines.append(f"  {lo:>6}-{hi:<6} {count:>8,} {bar}")
    return "\n".join(lines)


def main(cfg: Config, args: argparse.Namespace | None = None) -> int:
    """The ``prepare`` command: build (or reuse) the token store and print its statistics; with
    ``--show N``, print the first N samples with their supervised tokens marked instead."""
    if args is not None and getattr(args, "show", None):
        chat = ChatTokenizer(load_tokenizer(resolve_target(cfg.model.target)), TokenizeOptions.from_config(cfg))
        records = (r for held, _, r in split_records(cfg, expand_paths(cfg.data.paths), []) if not held)
        shown = show_samples(records, chat, args.show, sys.stdout)
        print(f"{shown} samples shown (supervised text between ⟦ and ⟧); no token store was written")
        return 0
    started = time.monotonic()
    store, stats = build_dataset(cfg, log=lambda m: print(m, flush=True))
    print(format_report(stats, store, cfg.data.max_length))
    print(format_coverage(store_coverage(store, cfg.model.block_size)))
    save_config(cfg, store.path)
    elapsed = time.monotonic() - started
    atomic_write_text(store.path / "stats.json",
                      json.dumps({**stats.to_dict(), "elapsed_s": round(elapsed, 3)}, indent=1))
    origin = (f"reused (built in {stats.build_time_s:.1f} s)" if stats.reused
              else f"built in {stats.build_time_s:.1f} s")
    print(f"token store: {store.path} ({len(store):,} samples, {origin}); "
          f"config.yaml and stats.json written there; total {elapsed:.1f} s")
    return 0


def load_training_data(cfg: Config, dist: DistInfo, tokenizer: Any) -> tuple[TokenStore, PrepareStats]:
    """The prepared token store of ``cfg`` (rank 0 builds it, the others wait) and its statistics."""
    import torch.distributed  # only here: preparing alone does not need torch

    # Rank 0 tokenizes; the others then find the finished cache instead of racing to write it.
    if dist.enabled and not dist.is_main:
        torch.distributed.barrier()
    store, stats = build_dataset(cfg, tokenizer=tokenizer)
    if dist.enabled and dist.is_main:
        torch.distributed.barrier()
    if len(store) == 0:
        raise DataError("no training samples left after preparation; see the prepare "
                        "statistics above (data.max_length, data.min_supervised_tokens)")
    return store, stats
