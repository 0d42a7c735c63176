"""``dflash-trainer prepare --show N``: the first N training samples as text, supervised tokens marked.

The samples come from the code path that fills the token store (``prepare`` hands over the same
reader and held-out split, and a :class:`~dflash_trainer.data.tokenize.ChatTokenizer` with the
same options), so what is printed is what the drafter trains on. Each sample's text is its
tokens decoded; the supervised runs are wrapped in :data:`OPEN` and :data:`CLOSE`. A per-turn
sample names the assistant turn it supervises; a dropped record is printed with its reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TextIO

import numpy as np

from dflash_trainer.data.formats import Record, Rejected
from dflash_trainer.data.tokenize import ChatTokenizer, Dropped, Encoded, Samples

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


def show_samples(records: Iterable[Record], chat: ChatTokenizer, count: int, out: TextIO) -> int:
    """Print the samples of ``records`` until ``count`` are shown (a dropped record is printed with
    its reason in its place); returns how many were shown."""
    shown = 0
    for record in records:
        location = str(record.location)
        if isinstance(record, Rejected):
            print(f"--- {record.describe()}: dropped ({record.reason})", file=out)
            continue
        result = chat.encode(record)
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
            print(marked_text(chat.tokenizer, encoded), file=out)
    return shown
