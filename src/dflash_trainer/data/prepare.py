"""``dflash-trainer prepare``: read the chat data, tokenize it into the token store, report.

:func:`build_dataset` is what the trainer calls: it returns the memory-mapped
:class:`~dflash_trainer.data.cache.TokenStore` for the config, reusing the cached one when the
data files, tokenizer, chat template and options are unchanged. The first
``data.heldout_samples`` records of the first ``data.paths`` entry never enter training; they are
the evaluation prompts of :func:`heldout_conversations`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_trainer.assets import (AssetError, atomic_write_text, cache_root, load_tokenizer,
                                   resolve_target)
from dflash_trainer.config import Config, config_to_dict, save_config
from dflash_trainer.data.cache import (FORMAT_VERSION, TokenStore, TokenStoreWriter,
                                       file_fingerprint, find_store, fingerprint,
                                       tokenizer_fingerprint)
from dflash_trainer.data.formats import (Conversation, DataError, Record, Rejected, Source,
                                         SourceStats, Tokenized, expand_paths, on_error_policy,
                                         read_source)
from dflash_trainer.data.tokenize import ChatTokenizer, Dropped, Encoded, TokenizeOptions

DROP_REASONS = ("malformed", "empty", "no_assistant", "too_short", "too_long")
_DROP_LABELS = {"malformed": "malformed", "empty": "empty conversation",
                "no_assistant": "no assistant turn", "too_short": "too short (supervised)",
                "too_long": "too long"}
_BATCH = 256
_EXAMPLES_PER_REASON = 3
_PROGRESS_EVERY_S = 5.0

Log = Callable[[str], None]


@dataclass(kw_only=True)
class PrepareStats:
    """What one preparation read, kept and dropped (stored in the token store's meta)."""

    records_read: int = 0
    """Records read for training (after the held-out ones, up to ``max_samples``)."""
    heldout: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    examples: dict[str, list[str]] = field(default_factory=dict)
    """The first few messages of each drop reason, with file and line."""
    truncated: int = 0
    """Kept samples cut to ``data.max_length``."""
    trimmed_leading: int = 0
    """Conversations whose assistant messages before the first user message were removed."""
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
        tokenizer = load_tokenizer(resolve_target(cfg.model.target))
    options = TokenizeOptions.from_config(cfg)
    key_parts = {
        "format_version": FORMAT_VERSION,
        "files": [file_fingerprint(s.path) for s in sources],
        "origins": [s.origin for s in sources],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "options": dataclasses.asdict(options),
        "format": cfg.data.format,
        "on_error": [on_error_policy(cfg.data.on_error, s) for s in sources],
        "heldout_samples": cfg.data.heldout_samples,
        "max_samples": cfg.data.max_samples,
    }
    path = cache_dir(cfg) / fingerprint(key_parts)
    store = find_store(path)
    if store is not None:
        stats = PrepareStats.from_dict(store.stats)
        stats.reused, stats.cache_path = True, str(path)
        log(f"prepare: reusing the token store {path}")
        return store, stats

    chat = ChatTokenizer(tokenizer, options)
    stats = PrepareStats(template_mode=chat.mode)
    if options.thinking and not chat.supports_thinking:
        stats.notes.append("data.thinking=true has no effect: the chat template does not read "
                           "enable_thinking")

    def fill(writer: TokenStoreWriter) -> dict[str, Any]:
        started = time.monotonic()
        _tokenize_into(writer, cfg, sources, chat, stats, log)
        stats.build_time_s = round(time.monotonic() - started, 3)
        stats.cache_path = str(path)
        return {"key": key_parts, "stats": stats.to_dict(), "config": config_to_dict(cfg)}

    log(f"prepare: tokenizing {', '.join(cfg.data.paths)} into {path}")
    return TokenStore.build(path, fill), stats


def _split(cfg: Config, sources: list[Source], source_stats: list[SourceStats]
           ) -> Iterator[tuple[bool, Source, Record]]:
    """(held_out, source, record) for every record, the first ``heldout_samples`` records of
    the first ``data.paths`` entry marked held out; malformed records raise under ``raise``."""
    heldout_left = cfg.data.heldout_samples
    for source in sources:
        stats = SourceStats(path=str(source.path))
        source_stats.append(stats)
        policy = on_error_policy(cfg.data.on_error, source)
        for record in read_source(source, format=cfg.data.format, stats=stats):
            if isinstance(record, Rejected) and record.reason == "malformed" and policy == "raise":
                raise DataError(f"{record.describe()}\n(with data.on_error=skip such records are "
                                "skipped and counted instead)")
            held = heldout_left > 0 and source.origin == sources[0].origin
            if held:
                heldout_left -= 1
            yield held, source, record


def _tokenize_into(writer: TokenStoreWriter, cfg: Config, sources: list[Source],
                   chat: ChatTokenizer, stats: PrepareStats, log: Log) -> None:
    source_stats: list[SourceStats] = []
    batch: list[tuple[Conversation | Tokenized, Source]] = []
    started = last_log = time.monotonic()

    def flush() -> None:
        for (record, source), result in zip(batch, chat.encode_batch([r for r, _ in batch])):
            if isinstance(result, Dropped):
                if (result.reason == "malformed"
                        and on_error_policy(cfg.data.on_error, source) == "raise"):
                    raise DataError(result.message)
                stats.drop(result.reason, result.message)
                continue
            assert isinstance(result, Encoded)
            writer.add(result.input_ids, result.loss_mask)
            stats.kept += 1
            stats.total_tokens += len(result.input_ids)
            stats.supervised_tokens += int(result.loss_mask.sum())
            stats.truncated += int(result.truncated)
            stats.trimmed_leading += int(result.trimmed_leading > 0)
        batch.clear()

    limit = cfg.data.max_samples
    try:
        for held, source, record in _split(cfg, sources, source_stats):
            if held:
                stats.heldout += 1
                continue
            if limit is not None and stats.records_read >= limit:
                break  # only reached with max_samples=0
            stats.records_read += 1
            if isinstance(record, Rejected):
                stats.drop(record.reason, record.describe())
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


def heldout_conversations(cfg: Config) -> list[list[dict[str, str]]]:
    """Normalised messages of the held-out conversations: the first ``data.heldout_samples``
    records of the first ``data.paths`` entry, without assistant messages before the first user
    message. Malformed, empty, pre-tokenized and user-less records give none."""
    conversations = []
    for held, _, record in _split(cfg, expand_paths(cfg.data.paths), []):
        if not held:
            break
        if not isinstance(record, Conversation):
            continue
        roles = [m["role"] for m in record.messages]
        if "user" not in roles:
            continue
        first_user = roles.index("user")
        conversations.append([m for i, m in enumerate(record.messages)
                              if i >= first_user or m["role"] != "assistant"])
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
        lines.append(line)
    lines = ["sources:"] + lines
    dropped = sum(stats.dropped.values())
    lines += [
        f"records read         {stats.records_read:>10,}"
        + (f"   (+{stats.heldout} held out for evaluation)" if stats.heldout else ""),
        f"kept                 {stats.kept:>10,}",
        f"dropped              {dropped:>10,}",
    ]
    for reason in DROP_REASONS:
        lines.append(f"  {_DROP_LABELS[reason]:<24}{stats.dropped.get(reason, 0):>8,}")
    lines += [
        f"truncated to {max_length:<8}{stats.truncated:>10,}",
        f"leading assistant turns removed in {stats.trimmed_leading:,} conversations",
        f"tokens               {stats.total_tokens:>10,}",
        f"supervised tokens    {stats.supervised_tokens:>10,}"
        + (f"   ({100 * stats.supervised_tokens / stats.total_tokens:.1f}%)"
           if stats.total_tokens else ""),
        "assistant spans from " + ("the template's {% generation %} markers"
                                   if stats.template_mode == "generation" else "prefix renders"),
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
    """The ``prepare`` command: build (or reuse) the token store and print its statistics."""
    started = time.monotonic()
    try:
        store, stats = build_dataset(cfg, log=lambda m: print(m, flush=True))
    except (DataError, AssetError) as exc:
        print(f"dflash-trainer prepare: error: {exc}", file=sys.stderr)
        return 1
    print(format_report(stats, store, cfg.data.max_length))
    save_config(cfg, store.path)
    elapsed = time.monotonic() - started
    atomic_write_text(store.path / "stats.json",
                      json.dumps({**stats.to_dict(), "elapsed_s": round(elapsed, 3)}, indent=1))
    origin = (f"reused (built in {stats.build_time_s:.1f} s)" if stats.reused
              else f"built in {stats.build_time_s:.1f} s")
    print(f"token store: {store.path} ({len(store):,} samples, {origin}); "
          f"config.yaml and stats.json written there; total {elapsed:.1f} s")
    return 0
