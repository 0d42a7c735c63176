"""Reading chat data: ``data.paths`` in, located records out (:class:`Conversation`,
:class:`Tokenized` or :class:`Rejected`).

Three steps, each in its own place: :func:`expand_paths` turns ``data.paths`` entries into
files (``sharegpt`` names the embedded ShareGPT set; a folder gives every data file inside it,
a Hugging Face ``datasets`` folder its Arrow files; the same file reached twice is refused),
:mod:`dflash_trainer.data.readers` reads each file's raw records with their file and line, and
:mod:`dflash_trainer.data.layouts` turns a record of any layout into a conversation. Every
record keeps its :class:`Location`, so that errors and drop counts point at the offending input.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from dflash_trainer.config import FieldsConfig
from dflash_trainer.core import assets
from dflash_trainer.core.errors import ConfigError, DataError
from dflash_trainer.core.inputs import check_input, input_files
from dflash_trainer.data.layouts import (
    TRUNCATED,
    Conversation,
    Format,
    Record,
    Tokenized,
    drop_leading_assistant,
    normalize_record,
)
from dflash_trainer.data.readers import (
    FILE_SUFFIXES,
    LAYOUT_HINT,
    Location,
    Rejected,
    Source,
    SourceStats,
    read_raw,
)

__all__ = ["EMBEDDED_SHAREGPT", "FILE_SUFFIXES", "LAYOUT_HINT", "TRUNCATED", "Conversation", "DataError",
           "Format", "Location", "OnError", "Record", "Rejected", "Source", "SourceStats", "Tokenized",
           "apply_on_error", "drop_leading_assistant", "expand_paths", "normalize_record",
           "on_error_policy", "read_records", "read_source"]

EMBEDDED_SHAREGPT = "sharegpt"
OnError = Literal["raise", "skip", "auto"]


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
    _refuse_files_named_twice(sources)
    return sources


def _refuse_files_named_twice(sources: list[Source]) -> None:
    """ConfigError naming both entries when two sources are the same file (listed twice, a
    symlink or hard link to it, a folder that contains it): it would be trained on twice."""
    seen: dict[tuple[int, int], Source] = {}
    for source in sources:
        info = os.stat(source.path)
        first = seen.setdefault((info.st_dev, info.st_ino), source)
        if first is source:
            continue
        if first.origin == source.origin and first.path == source.path:
            what = f"data.paths names {source.origin!r} twice"
        elif first.origin == source.origin:
            what = (f"data.paths entry {source.origin!r} reaches the same file twice, as {str(first.path)!r} "
                    f"and {str(source.path)!r}")
        else:
            what = (f"data.paths entries {first.origin!r} and {source.origin!r} both reach the file "
                    f"{os.path.realpath(source.path)!r}")
        raise ConfigError(f"{what}; its records would be trained on twice: name each file once")


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


def read_source(source: Source, *, format: Format = "auto", fields: FieldsConfig | None = None,
                stats: SourceStats | None = None) -> Iterator[Record]:
    """Every record of one file through the layout adapter; malformed ones come out as
    :class:`Rejected`. ``stats`` (if given) is updated as records are read."""
    stats = stats if stats is not None else SourceStats(path=str(source.path))
    for location, raw in read_raw(source, stats):
        stats.records += 1
        if isinstance(raw, Rejected):
            record: Record = raw
        else:
            record = normalize_record(raw, location, format, fields=fields, drops=stats.dropped_fields)
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


def read_records(sources: list[Source], *, format: Format = "auto", on_error: OnError = "auto",
                 fields: FieldsConfig | None = None, stats: list[SourceStats] | None = None) -> Iterator[Record]:
    """All records of all sources in order; a malformed record raises :class:`DataError` unless
    the source's :func:`on_error_policy` is ``skip`` (then it comes out as :class:`Rejected`).
    ``stats`` (if given) receives one :class:`SourceStats` per file as it is read."""
    for source in sources:
        source_stats = SourceStats(path=str(source.path))
        if stats is not None:
            stats.append(source_stats)
        policy = on_error_policy(on_error, source)
        for record in read_source(source, format=format, fields=fields, stats=source_stats):
            yield apply_on_error(record, policy)
