"""``dflash-trainer prepare --show N``: the first N training samples as text, supervised tokens marked.

The samples come from the code path that fills the token store (the same reader, held-out
split, :class:`~dflash_trainer.data.tokenize.ChatTokenizer` and options), so what is printed is
what the drafter trains on. Each sample's text is its tokens decoded; the supervised runs are
wrapped in :data:`OPEN` and :data:`CLOSE`. A per-turn sample names the assistant turn it
supervises; a dropped record is printed with its reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TextIO

import numpy as np

from dflash_trainer.config import Config
from dflash_trainer.core.assets import load_tokenizer, resolve_target
from dflash_trainer.data.formats import Rejected, expand_paths
from dflash_trainer.data.tokenize import ChatTokenizer, Dropped, Encoded, Samples, TokenizeOptions

OPEN, CLOSE = "⟦", "⟧"
"""Marks around supervised text (characters chat data hardly holds)."""


def marked_text(tokenizer: Any, encoded: Encoded) -> str:
    """A sample's text with its supervised runs between :data:`OPEN` and :data:`CLOSE`."""
    ids, mask = encoded.input_ids, encoded.loss_mask.astype(bool)
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    pieces = []
    for run in np.split(np.arange(len(ids)), edges):
        if not len(run):
            continue
        text = tokenizer.decode(ids[run].tolist())
        pieces.append(f"{OPEN}{text}{CLOSE}" if mask[run[0]] else text)
    return "".join(pieces)


def _turn_label(result: Samples, encoded: Encoded) -> str:
    assistant = [k for k, m in enumerate(result.messages) if m["role"] == "assistant"]
    turns = ", ".join(f"{assistant.index(k) + 1}" for k in encoded.turns)
    kind = "the whole conversation" if encoded.whole else "its own sample (history repeated as context)"
    return f"assistant turn{'s' if len(encoded.turns) > 1 else ''} {turns} of {len(assistant)}, {kind}"


def _results(cfg: Config, chat: ChatTokenizer) -> Iterator[tuple[str, Samples | Dropped]]:
    from dflash_trainer.data.prepare import split_records

    for held, _, record in split_records(cfg, expand_paths(cfg.data.paths), []):
        if held:
            continue
        if isinstance(record, Rejected):
            yield str(record.location), Dropped(record.reason, record.describe())  # type: ignore[arg-type]
            continue
        yield str(record.location), chat.encode(record)


def show_samples(cfg: Config, count: int, out: TextIO, *, tokenizer: Any = None) -> int:
    """Print the first ``count`` samples of ``cfg``'s training data; returns how many."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(resolve_target(cfg.model.target))
    chat = ChatTokenizer(tokenizer, TokenizeOptions.from_config(cfg))
    shown = 0
    for location, result in _results(cfg, chat):
        if isinstance(result, Dropped):
            print(f"--- {location}: dropped ({result.reason}): {result.message}", file=out)
            continue
        for encoded in result.encoded:
            if shown == count:
                return shown
            shown += 1
            where = f", {_turn_label(result, encoded)}" if encoded.turns else ""
            print(f"--- sample {shown}: {location}{where}; {len(encoded.input_ids)} tokens, "
                  f"{int(encoded.loss_mask.sum())} supervised {OPEN}marked{CLOSE}"
                  + (", truncated to data.max_length" if encoded.truncated else ""), file=out)
            print(marked_text(tokenizer, encoded), file=out)
    return shown
