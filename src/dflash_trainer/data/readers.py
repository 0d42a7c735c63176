"""Reading data files: one file in, its raw records out, each with its location (file and line,
or record index).

Kinds: JSON files holding an array of records (read element by element, so a file truncated at
the end still yields every complete record), JSON Lines, Parquet and Arrow (IPC stream or file).
A ``.json`` file holding one pretty-printed object is refused with the layouts that are accepted
(:data:`LAYOUT_HINT`). Text files may start with a UTF-8 byte order mark; a record holding bytes
that are not UTF-8, invalid JSON and a cut-off record come out as :class:`Rejected` (``malformed``),
located, so that they can be skipped and counted.

What a record *means* (its layout: OpenAI messages, ShareGPT, Alpaca, ...) is not decided here:
:mod:`dflash_trainer.data.layouts` turns each raw record into a conversation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dflash_trainer.core.errors import DataError

FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".arrow")
LAYOUT_HINT = ("accepted layouts: JSON Lines (one JSON object per line), a JSON array of objects "
               "([{...}, {...}]), Parquet/Arrow files or a Hugging Face datasets folder (save_to_disk); "
               "a single pretty-printed object is neither: put it inside [ ] or write one object per line")
_CHUNK_CHARS = 1 << 20
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_UNDECODABLE = re.compile("[\udc80-\udcff]")
"""Bytes that are not UTF-8, as ``surrogateescape`` decodes them."""


@dataclass(frozen=True)
class Location:
    """Where a record came from: file, 1-based line (text files) and 0-based record index."""

    file: str
    index: int
    line: int | None = None

    def __str__(self) -> str:
        if self.line is not None:
            return f"{self.file}:{self.line} (record {self.index})"
        return f"{self.file} (record {self.index})"


@dataclass(frozen=True)
class Rejected:
    """A record that is not used: ``malformed`` (an input error) or ``empty`` (no messages)."""

    reason: Literal["malformed", "empty"]
    message: str
    location: Location

    def describe(self) -> str:
        return f"{self.location}: {self.message}"


@dataclass(kw_only=True)
class Source:
    """One input file."""

    path: Path
    kind: Literal["json", "jsonl", "parquet", "arrow"]
    embedded: bool = False
    """Part of the embedded ShareGPT set (``data.on_error=auto`` skips its malformed records)."""
    origin: str = ""
    """The ``data.paths`` entry this file came from."""


@dataclass(kw_only=True)
class SourceStats:
    """What reading one file found."""

    path: str
    records: int = 0
    malformed: int = 0
    truncated_tail: bool = False
    """The file ends inside a record (a cut-off JSON array); complete records were kept."""
    stopped_at_error: bool = False
    """Reading stopped at an invalid JSON array element (the rest cannot be resynchronised)."""
    stopped_early: bool = False
    """Reading stopped before the end of the file (``max_samples`` reached)."""
    dropped_fields: dict[str, int] = field(default_factory=dict)
    """Fields of the kept records that no chat template renders, left out, by name (see
    :func:`dflash_trainer.data.layouts.normalize_record`)."""


RawItem = tuple[Location, Any]
"""A record as read: its location and the decoded JSON value, or :class:`Rejected`."""


def read_raw(source: Source, stats: SourceStats) -> Iterator[RawItem]:
    """(location, decoded record or :class:`Rejected`) of every record of one file, in order."""
    readers = {"json": _json_records, "jsonl": _jsonl_records,
               "parquet": _parquet_records, "arrow": _arrow_records}
    yield from readers[source.kind](source.path, stats)


TOO_DEEP = ("invalid JSON: nested too deeply for the JSON decoder (more levels of [ and { than the "
            "interpreter's recursion limit); no chat record is nested like that: check how the file was made")
"""The message of a record nested beyond the decoder's recursion (``RecursionError``)."""


def _undecodable(text: str) -> str | None:
    """A message naming the first non-UTF-8 byte of ``text`` (decoded with surrogateescape)."""
    found = _UNDECODABLE.search(text)
    if found is None:
        return None
    byte = ord(found.group()) - 0xDC00
    return (f"invalid UTF-8 byte 0x{byte:02x} at character {found.start() + 1} of the record; "
            "re-encode the file as UTF-8")


def _open_text(path: Path) -> Any:
    # utf-8-sig reads a byte order mark; surrogateescape keeps invalid bytes so that the one
    # record holding them is reported (and skippable) instead of the whole file failing.
    return open(path, encoding="utf-8-sig", errors="surrogateescape")


def _jsonl_records(path: Path, stats: SourceStats) -> Iterator[RawItem]:
    index = 0
    with _open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            location = Location(str(path), index, line_no)
            index += 1
            problem = _undecodable(line)
            if problem is not None:
                yield location, Rejected("malformed", problem, location)
                continue
            try:
                yield location, json.loads(line)
            except RecursionError:
                yield location, Rejected("malformed", TOO_DEEP, location)
            except json.JSONDecodeError as exc:
                pretty = ("; the file looks pretty-printed, but JSON Lines needs one whole object per "
                          "line" if line.strip() in ("{", "[") else "")
                yield location, Rejected("malformed", f"invalid JSON: {exc.msg} "
                                         f"(column {exc.colno}){pretty}", location)


def _json_records(path: Path, stats: SourceStats) -> Iterator[RawItem]:
    """Elements of a JSON array, decoded one by one from a sliding text buffer.

    A file that does not start with ``[`` is read as JSON Lines. A file that ends inside a
    record (cut off) yields every complete record and then one ``Rejected`` for the cut one, with
    ``stats.truncated_tail`` set. Any other decoding error cannot be resynchronised inside an
    array, so reading stops there (``stats.stopped_at_error``).
    """
    decoder = json.JSONDecoder()
    with _open_text(path) as f:
        buf = f.read(_CHUNK_CHARS)
        eof = len(buf) < _CHUNK_CHARS
        if eof and not buf.strip():
            return  # an empty file has no records (the caller reports it as empty)

        def refill(keep_from: int, size: int = _CHUNK_CHARS) -> None:
            # Drop what was consumed, so memory stays bounded by the largest record.
            nonlocal buf, eof
            chunk = f.read(size)
            eof = len(chunk) < size
            buf = buf[keep_from:] + chunk

        pos = _WHITESPACE.match(buf).end()
        if pos < len(buf) and buf[pos] != "[":
            _refuse_pretty_printed(path, buf, pos)
            yield from _jsonl_records(path, stats)
            return
        pos += 1
        line = 1 + buf.count("\n", 0, pos)
        index = 0
        expect_element = True
        while True:
            start = _WHITESPACE.match(buf, pos).end()
            line += buf.count("\n", pos, start)
            pos = start
            if pos >= len(buf) - 1 and not eof:
                refill(pos)
                pos = 0
                continue
            location = Location(str(path), index, line)
            if pos >= len(buf):
                stats.truncated_tail = True
                yield location, Rejected("malformed", "the file ends before the JSON array is "
                                         f"closed (truncated after {index} records)", location)
                return
            char = buf[pos]
            if char == "]" and (expect_element is False or index == 0):
                return
            if not expect_element:
                if char != ",":
                    stats.stopped_at_error = True
                    yield location, Rejected("malformed", f"expected ',' or ']' between records, "
                                             f"found {char!r}; the rest of the file is unreadable",
                                             location)
                    return
                pos += 1
                expect_element = True
                continue
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except RecursionError:
                stats.stopped_at_error = True
                yield location, Rejected("malformed", f"{TOO_DEEP}; the rest of the file is unreadable", location)
                return
            except json.JSONDecodeError as exc:
                if not eof:
                    refill(pos, max(_CHUNK_CHARS, len(buf)))
                    pos = 0
                    continue
                # Running out of input inside the record means the file was cut off.
                cut_off = (exc.msg.startswith("Unterminated string")
                           or _only_whitespace_after(buf, exc.pos))
                if cut_off:
                    stats.truncated_tail = True
                    message = (f"the file ends inside this record (truncated); the {index} "
                               "complete records before it were read")
                else:
                    stats.stopped_at_error = True
                    at = line + buf.count("\n", pos, exc.pos)
                    message = (f"invalid JSON at line {at}: {exc.msg}; the rest of the file is "
                               "unreadable")
                yield location, Rejected("malformed", message, location)
                return
            if end >= len(buf) and not eof:
                # A value ending exactly at the buffer end may continue (a cut number).
                refill(pos)
                pos = 0
                continue
            problem = _undecodable(buf[pos:end])
            yield location, (obj if problem is None else Rejected("malformed", problem, location))
            index += 1
            line += buf.count("\n", pos, end)
            pos = end
            expect_element = False


def _refuse_pretty_printed(path: Path, buf: str, pos: int) -> None:
    """DataError with :data:`LAYOUT_HINT` when a ``.json`` file that is not an array is not JSON
    Lines either: its first line neither parses alone nor ends like a record (``}``), as the
    first line of a pretty-printed object (``{`` or ``{"messages": [``). A first line that ends
    with ``}`` but does not parse is left to the JSON Lines reader: one malformed record."""
    end = buf.find("\n", pos)
    first_line = buf[pos:end if end >= 0 else len(buf)].rstrip()
    if first_line.endswith("}"):
        return
    try:
        json.loads(first_line)
    except RecursionError:
        return  # one deeply nested record: the JSON Lines reader reports it
    except json.JSONDecodeError as exc:
        line = 1 + buf.count("\n", 0, pos)
        raise DataError(f"{path}:{line}: not a JSON array, and its first line is not a complete JSON "
                        f"object ({exc.msg}); {LAYOUT_HINT}") from exc


def _only_whitespace_after(buf: str, pos: int) -> bool:
    return _WHITESPACE.match(buf, pos).end() >= len(buf)


def _arrow_records(path: Path, stats: SourceStats) -> Iterator[RawItem]:
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(path)
    except pa.ArrowInvalid:
        try:
            reader = pa.ipc.open_file(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{path}: not an Arrow IPC stream or file ({exc})") from exc
    except OSError as exc:
        raise DataError(f"{path}: not readable as Arrow ({exc})") from exc
    batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) \
        if isinstance(reader, pa.ipc.RecordBatchFileReader) else reader
    yield from _rows(path, batches, "Arrow")


def _parquet_records(path: Path, stats: SourceStats) -> Iterator[RawItem]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from exc
    yield from _rows(path, batches, "Parquet")


def _rows(path: Path, batches: Any, kind: str) -> Iterator[RawItem]:
    """Rows of record batches; a batch that does not decode (a file cut off or damaged after
    its header) is a DataError naming the file and the rows read before it."""
    import pyarrow as pa

    index = 0
    iterator = iter(batches)
    while True:
        try:
            batch = next(iterator, None)
            rows = batch.to_pylist() if batch is not None else None
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{path}: the {kind} data is damaged or truncated after record {index} ({exc}); "
                            "write the file again") from exc
        if rows is None:
            return
        for row in rows:
            yield Location(str(path), index), row
            index += 1
