"""Reading chat data: files and folders in, normalised samples with their source location out.

Accepted inputs (``data.paths``): JSON files holding an array of records (read element by
element, so a file truncated at the end still yields every complete record), JSON Lines files,
Parquet files, Arrow files, Hugging Face ``datasets`` folders written by ``save_to_disk`` (read
with pyarrow directly) and plain folders of any of these. ``sharegpt`` names the embedded
ShareGPT set. A ``.json`` file holding one pretty-printed object is refused with the layouts
that are accepted (:data:`LAYOUT_HINT`); a folder whose ``datasets`` metadata or Arrow/Parquet
files do not read is refused with one :class:`DataError` line naming the file.

Accepted records: OpenAI ``{"messages": [{"role", "content"}]}``, ShareGPT
``{"conversations": [{"from", "value"}]}`` and pre-tokenized ``{"input_ids", "loss_mask"}``.
Roles are normalised to ``system`` / ``user`` / ``assistant``. An assistant message may carry
``"truncated": true`` (``dflash-trainer regenerate`` writes it on answers cut at
``--max-new-tokens``): its text stops where the model had not ended its turn, so the end-of-turn
tokens the template appends to it are not supervised. Text files may start with a
UTF-8 byte order mark; a record holding bytes that are not UTF-8 is malformed (file and line
named, skippable with ``data.on_error=skip``). Tool-use messages (role ``tool``/``function``,
``tool_calls``, ``function_call``) are malformed too: see :data:`TOOL_USE_MESSAGE`.

Every record comes out as a :class:`Conversation`, a :class:`Tokenized` sample or a
:class:`Rejected` one, each carrying its :class:`Location` (file and line, or record index), so
that errors and drop counts can point at the offending input.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dflash_trainer.core import assets
from dflash_trainer.core.errors import DataError
from dflash_trainer.core.inputs import check_input, input_files

EMBEDDED_SHAREGPT = "sharegpt"
ROLE_ALIASES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant",
}
FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".arrow")
TOOL_ROLES = ("tool", "function", "ipython")
TOOL_USE_MESSAGE = ("tool-use messages are not supported (role 'tool'/'function', 'tool_calls' or "
                    "'function_call'): the default target's chat template has no tool rendering; "
                    "drop these conversations or use data.on_error=skip (see docs/data.md)")
LAYOUT_HINT = ("accepted layouts: JSON Lines (one JSON object per line), a JSON array of objects "
               "([{...}, {...}]), Parquet/Arrow files or a Hugging Face datasets folder (save_to_disk); "
               "a single pretty-printed object is neither: put it inside [ ] or write one object per line")
CONTENT_PART_SEPARATOR = "\n"
"""Joins the text parts of one OpenAI ``content`` list (as vLLM and SGLang do)."""
TRUNCATED = "truncated"
"""Message key marking an assistant answer cut before the model ended its turn."""
_CHUNK_CHARS = 1 << 20
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_UNDECODABLE = re.compile("[\udc80-\udcff]")
"""Bytes that are not UTF-8, as ``surrogateescape`` decodes them."""

Format = Literal["auto", "messages", "sharegpt", "tokenized", "hf"]
OnError = Literal["raise", "skip", "auto"]


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
class Conversation:
    """A chat with normalised messages ``{"role": system|user|assistant, "content": str}``; an
    assistant message cut before the model ended its turn also has ``"truncated": True``."""

    messages: list[dict[str, Any]]
    location: Location


@dataclass(frozen=True)
class Tokenized:
    """A pre-tokenized sample."""

    input_ids: list[int]
    loss_mask: list[int]
    location: Location


@dataclass(frozen=True)
class Rejected:
    """A record that is not used: ``malformed`` (an input error) or ``empty`` (no messages)."""

    reason: Literal["malformed", "empty"]
    message: str
    location: Location

    def describe(self) -> str:
        return f"{self.location}: {self.message}"


Record = Conversation | Tokenized | Rejected


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


def on_error_policy(on_error: OnError, source: Source) -> Literal["raise", "skip"]:
    """``auto`` raises for user data and skips malformed records of the embedded set."""
    if on_error == "auto":
        return "skip" if source.embedded else "raise"
    return on_error


def expand_paths(paths: list[str]) -> list[Source]:
    """The files behind ``data.paths`` entries, in a stable order; errors name the entry."""
    if not paths:
        raise DataError("data.paths is empty; give data files or folders, or `sharegpt`")
    sources: list[Source] = []
    for entry in paths:
        if entry == EMBEDDED_SHAREGPT:
            try:
                path = assets.sharegpt_file()
            except assets.AssetError as exc:
                raise DataError(f"data.paths entry 'sharegpt': {exc}") from exc
            sources.append(Source(path=path, kind="json", embedded=True, origin=entry))
            continue
        path = check_input(entry, what=f"data.paths entry {entry!r}")
        if path.is_dir():
            found = _expand_folder(path, entry)
        else:
            found = [_file_source(path, entry)]
        sources.extend(found)
    return sources


def _file_source(path: Path, origin: str) -> Source:
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise DataError(f"data file {str(path)!r}: unsupported type {suffix or '(none)'!r}; "
                        f"expected one of {', '.join(FILE_SUFFIXES)} or a folder of them")
    return Source(path=path, kind=suffix[1:], origin=origin)  # type: ignore[arg-type]


def _metadata(path: Path) -> dict[str, Any]:
    """A ``datasets`` metadata file (``dataset_dict.json``, ``state.json``) as a dict, or DataError."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DataError(f"{path}: not readable JSON ({exc}); the datasets folder is damaged: save it "
                        "again with save_to_disk, or remove the file if the folder is a plain one") from exc
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(value).__name__}; the datasets folder "
                        "is damaged: save it again with save_to_disk")
    return value


def _expand_folder(folder: Path, origin: str) -> list[Source]:
    if (folder / "dataset_dict.json").is_file():
        # A DatasetDict: train on its train split only, never silently on test/validation.
        splits = _metadata(folder / "dataset_dict.json").get("splits", [])
        if not isinstance(splits, list):
            raise DataError(f"{folder / 'dataset_dict.json'}: 'splits' is not a list; the datasets "
                            "folder is damaged: save it again with save_to_disk")
        if "train" not in splits:
            raise DataError(f"data folder {str(folder)!r} is a datasets DatasetDict without a "
                            f"'train' split (splits: {splits}); point data.paths at a split folder")
        return _expand_folder(folder / "train", origin)
    if (folder / "state.json").is_file() or (folder / "dataset_info.json").is_file():
        names: list[str] = []
        if (folder / "state.json").is_file():
            files = _metadata(folder / "state.json").get("_data_files", [])
            names = [f.get("filename") for f in files if isinstance(f, dict)] if isinstance(files, list) else []
            if not isinstance(files, list) or len(names) != len(files) or not all(isinstance(n, str) for n in names):
                raise DataError(f"{folder / 'state.json'}: '_data_files' is not a list of "
                                "{\"filename\": ...} entries; the datasets folder is damaged: save it "
                                "again with save_to_disk")
            missing = [n for n in names if not (folder / n).is_file()]
            if missing:
                raise DataError(f"data folder {str(folder)!r}: state.json names {', '.join(missing)}, "
                                "which is missing; the datasets folder is incomplete: copy or save it again")
        if not names:
            names = sorted(p.name for p in folder.glob("data-*.arrow"))
        if not names:
            raise DataError(f"data folder {str(folder)!r} looks like a datasets save_to_disk "
                            "folder but has no data-*.arrow files")
        return [Source(path=check_input(folder / name, what=f"data folder {str(folder)!r}", kind="file"),
                       kind="arrow", origin=origin) for name in names]
    files = input_files(folder, what=f"data folder {str(folder)!r}",
                        accept=lambda p: p.suffix.lower() in FILE_SUFFIXES)
    if not files:
        raise DataError(f"data folder {str(folder)!r} contains no "
                        f"{', '.join(FILE_SUFFIXES)} files")
    return [_file_source(p, origin) for p in files]


def read_source(source: Source, *, format: Format = "auto",
                stats: SourceStats | None = None) -> Iterator[Record]:
    """Every record of one file, normalised; malformed ones come out as :class:`Rejected`.

    ``stats`` (if given) is updated as records are read.
    """
    stats = stats if stats is not None else SourceStats(path=str(source.path))
    readers = {"json": _json_records, "jsonl": _jsonl_records,
               "parquet": _parquet_records, "arrow": _arrow_records}
    for location, raw in readers[source.kind](source.path, stats):
        stats.records += 1
        if isinstance(raw, Rejected):
            record: Record = raw
        else:
            record = normalize_record(raw, location, format)
        if isinstance(record, Rejected) and record.reason == "malformed":
            stats.malformed += 1
        yield record
    if stats.records == 0:
        raise DataError(f"data file {str(source.path)!r} is empty (no records); remove it from "
                        "data.paths or fill it")


def apply_on_error(record: Record, policy: Literal["raise", "skip"]) -> Record:
    """``record`` itself, unless it is malformed under the ``raise`` policy: then
    :class:`DataError` naming its file and line (``skip`` lets it through to be counted)."""
    if isinstance(record, Rejected) and record.reason == "malformed" and policy == "raise":
        raise DataError(f"{record.describe()} (with data.on_error=skip such records are skipped "
                        "and counted instead)")
    return record


def normalize_record(raw: Any, location: Location, format: Format = "auto") -> Record:
    """One raw record as a :class:`Conversation`, :class:`Tokenized` or :class:`Rejected`."""
    if not isinstance(raw, dict):
        return Rejected("malformed", f"expected a JSON object, got {type(raw).__name__}", location)
    kinds = {"messages": "messages", "conversations": "sharegpt", "input_ids": "tokenized"}
    kind = next((k for key, k in kinds.items() if key in raw), None)
    if format in ("messages", "sharegpt", "tokenized") and kind != format:
        wanted = {v: k for k, v in kinds.items()}[format]
        return Rejected("malformed", f"no {wanted!r} field (data.format={format}); record keys: "
                        f"{sorted(raw)}", location)
    if kind is None:
        return Rejected("malformed", "record has none of the fields 'messages' (OpenAI), "
                        "'conversations' (ShareGPT) or 'input_ids' (pre-tokenized); keys: "
                        f"{sorted(raw)}", location)
    try:
        if kind == "tokenized":
            return _tokenized(raw, location)
        turns = raw["messages" if kind == "messages" else "conversations"]
        role_key, content_key = ("role", "content") if kind == "messages" else ("from", "value")
        messages = _messages(turns, role_key, content_key)
    except _Malformed as exc:
        return Rejected("malformed", str(exc), location)
    if not messages:
        return Rejected("empty", "conversation has no messages", location)
    return Conversation(messages, location)


class _Malformed(Exception):
    pass


def drop_leading_assistant(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], int]:
    """``messages`` without the assistant messages before the first user message (they answer
    no prompt), and how many were removed; without a user message every assistant one goes."""
    roles = [m["role"] for m in messages]
    first_user = roles.index("user") if "user" in roles else len(roles)
    kept = [m for i, m in enumerate(messages) if i >= first_user or m["role"] != "assistant"]
    return kept, len(messages) - len(kept)


def _messages(turns: Any, role_key: str, content_key: str) -> list[dict[str, Any]]:
    if not isinstance(turns, list):
        raise _Malformed(f"expected a list of messages, got {type(turns).__name__}")
    messages = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _Malformed(f"message {j}: expected an object, got {type(turn).__name__}")
        if (str(turn.get(role_key, "")).strip().lower() in TOOL_ROLES
                or turn.get("tool_calls") or turn.get("function_call")):
            raise _Malformed(f"message {j}: {TOOL_USE_MESSAGE}")
        for key in (role_key, content_key):
            if key not in turn:
                raise _Malformed(f"message {j}: missing field {key!r} (has {sorted(turn)})")
        role = ROLE_ALIASES.get(str(turn[role_key]).strip().lower())
        if role is None:
            raise _Malformed(f"message {j}: unknown role {turn[role_key]!r}; accepted: "
                             f"{', '.join(ROLE_ALIASES)}")
        message: dict[str, Any] = {"role": role, "content": _content(turn[content_key], j)}
        cut = turn.get(TRUNCATED, False)
        if not isinstance(cut, bool):
            raise _Malformed(f"message {j}: {TRUNCATED!r} must be true or false, got {cut!r}")
        if cut:
            if role != "assistant":
                raise _Malformed(f"message {j}: only assistant messages can be {TRUNCATED!r} "
                                 f"(this one is {role!r})")
            message[TRUNCATED] = True
        messages.append(message)
    return messages


def _content(value: Any, j: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        # OpenAI content parts: only text can be trained on.
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _Malformed(f"message {j}: content part of type {kind!r} is not supported "
                                 "(text only)")
            texts.append(part["text"])
        return CONTENT_PART_SEPARATOR.join(texts)
    raise _Malformed(f"message {j}: content must be a string, got {type(value).__name__}")


def _tokenized(raw: dict, location: Location) -> Record:
    ids, mask = raw.get("input_ids"), raw.get("loss_mask")
    if mask is None:
        raise _Malformed("pre-tokenized record has 'input_ids' but no 'loss_mask'")
    if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                         and i >= 0 for i in ids)):
        raise _Malformed("'input_ids' must be a list of non-negative integers")
    if not (isinstance(mask, list) and all(m in (0, 1) for m in mask)):
        raise _Malformed("'loss_mask' must be a list of 0/1 values")
    if len(ids) != len(mask):
        raise _Malformed(f"'input_ids' has {len(ids)} tokens but 'loss_mask' {len(mask)}")
    if not ids:
        return Rejected("empty", "pre-tokenized record has no tokens", location)
    return Tokenized([int(i) for i in ids], [int(m) for m in mask], location)


RawItem = tuple[Location, Any]


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


def read_records(sources: list[Source], *, format: Format = "auto", on_error: OnError = "auto",
                 stats: list[SourceStats] | None = None) -> Iterator[Record]:
    """All records of all sources in order; a malformed record raises :class:`DataError` unless
    the source's :func:`on_error_policy` is ``skip`` (then it comes out as :class:`Rejected`).
    ``stats`` (if given) receives one :class:`SourceStats` per file as it is read."""
    for source in sources:
        source_stats = SourceStats(path=str(source.path))
        if stats is not None:
            stats.append(source_stats)
        policy = on_error_policy(on_error, source)
        for record in read_source(source, format=format, stats=source_stats):
            yield apply_on_error(record, policy)
