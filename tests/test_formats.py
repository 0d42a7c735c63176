"""Data ingestion: file kinds, record formats, role normalisation, locations of bad input."""

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_trainer.data import readers
from dflash_trainer.data.formats import (Conversation, DataError, Rejected, Source,
                                         SourceStats, Tokenized, expand_paths, read_records,
                                         read_source)

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}]
SHAREGPT = {"id": "x", "conversations": [{"from": "system", "value": "Be brief."},
                                         {"from": "human", "value": "Hi"},
                                         {"from": "gpt", "value": "Hello"}]}


def _read(path: Path, **kwargs) -> list:
    return list(read_records(expand_paths([str(path)]), **kwargs))


def _write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_openai_and_sharegpt_records_normalise_to_the_same_messages(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"messages": CHAT}])
    b = tmp_path / "b.json"
    b.write_text(json.dumps([SHAREGPT], indent=2))
    (ra,), (rb,) = _read(a), _read(b)
    assert isinstance(ra, Conversation) and isinstance(rb, Conversation)
    assert ra.messages == rb.messages == CHAT  # system prompt kept, roles normalised
    assert str(ra.location) == f"{a}:1 (record 0)"
    assert str(rb.location) == f"{b}:2 (record 0)"


@pytest.mark.parametrize("raw,role", [("human", "user"), ("USER", "user"), ("gpt", "assistant"),
                                      ("chatgpt", "assistant"), ("bing", "assistant"),
                                      ("bard", "assistant"), ("assistant", "assistant"),
                                      ("system", "system")])
def test_role_aliases(tmp_path, raw, role):
    path = _write_jsonl(tmp_path / "r.jsonl", [{"conversations": [{"from": raw, "value": "x"}]}])
    (record,) = _read(path)
    assert record.messages == [{"role": role, "content": "x"}]


def test_openai_text_content_parts_are_joined(tmp_path):
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    path = _write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": parts}]}])
    # Parts are separate pieces of text: joined with a newline, as vLLM and SGLang do.
    assert _read(path)[0].messages == [{"role": "user", "content": "Hel\nlo"}]


def test_truncated_mark_of_an_answer_is_kept(tmp_path):
    cut = [*CHAT[:2], {"role": "assistant", "content": "Hel", "truncated": True}]
    whole = [*CHAT[:2], {"role": "assistant", "content": "Hello", "truncated": False}]
    path = _write_jsonl(tmp_path / "t.jsonl", [{"messages": cut}, {"messages": whole}])
    first, second = _read(path)
    assert first.messages == cut
    assert second.messages == CHAT[:2] + [{"role": "assistant", "content": "Hello"}]


def test_pretokenized_records(tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}])
    (record,) = _read(path)
    assert isinstance(record, Tokenized)
    assert (record.input_ids, record.loss_mask) == ([5, 6, 7], [0, 1, 1])


def test_parquet_file(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": CHAT}, {"messages": CHAT[1:]}]), path)
    records = _read(path)
    assert [r.messages for r in records] == [CHAT, CHAT[1:]]
    assert str(records[1].location) == f"{path} (record 1)"


def _save_to_disk(folder: Path, rows: list[dict]) -> None:
    """What datasets' save_to_disk writes: Arrow IPC stream shards + state/info JSON."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    names = []
    for i, part in enumerate([table.slice(0, 1), table.slice(1)]):
        name = f"data-{i:05d}-of-00002.arrow"
        with pa.ipc.new_stream(folder / name, part.schema) as writer:
            writer.write_table(part)
        names.append(name)
    (folder / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": n} for n in names], "_split": "train"}))
    (folder / "dataset_info.json").write_text("{}")


def test_hf_save_to_disk_folder_and_dataset_dict(tmp_path):
    rows = [SHAREGPT, {"id": "y", "conversations": SHAREGPT["conversations"][1:]}]
    _save_to_disk(tmp_path / "ds", rows)
    assert [r.messages for r in _read(tmp_path / "ds")] == [CHAT, CHAT[1:]]
    _save_to_disk(tmp_path / "dd" / "train", rows)
    _save_to_disk(tmp_path / "dd" / "test", rows[:1] * 2)
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    assert len(_read(tmp_path / "dd")) == 2
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["test"]}')
    with pytest.raises(DataError, match="without a 'train' split"):
        expand_paths([str(tmp_path / "dd")])


def test_plain_folder_is_expanded_in_sorted_order(tmp_path):
    _write_jsonl(tmp_path / "b.jsonl", [{"messages": CHAT[1:]}])
    _write_jsonl(tmp_path / "a.jsonl", [{"messages": CHAT}])
    (tmp_path / "notes.txt").write_text("ignored")
    sources = expand_paths([str(tmp_path)])
    assert [s.path.name for s in sources] == ["a.jsonl", "b.jsonl"]


def test_truncated_json_array_recovers_every_complete_record(tmp_path, monkeypatch):
    # A tiny buffer makes records straddle chunk boundaries.
    monkeypatch.setattr(readers, "_CHUNK_CHARS", 7)
    text = json.dumps([SHAREGPT] * 3, indent=1)
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) - 40])
    stats = SourceStats(path=str(path))
    records = list(read_source(Source(path=path, kind="json"), stats=stats))
    assert [type(r) for r in records] == [Conversation, Conversation, Rejected]
    assert "truncated" in records[-1].message and stats.truncated_tail
    # The user-data default raises, naming the file and line of the cut record.
    with pytest.raises(DataError, match=rf"cut\.json:{records[-1].location.line} \(record 2\)"):
        _read(path)
    assert len(_read(path, on_error="skip")) == 3


@pytest.mark.slow
def test_embedded_sharegpt_file_is_read_incrementally_and_its_tail_is_truncated():
    stats: list[SourceStats] = []
    records = list(read_records(expand_paths(["sharegpt"]), stats=stats))
    (source,) = stats
    assert source.truncated_tail and source.malformed == 1
    assert source.records - 1 == 17671  # every complete record of the cut-off array
    assert sum(isinstance(r, Conversation) for r in records) == 17545


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl",
                        [{"messages": CHAT}, "{not json", {"messages": CHAT}])
    with pytest.raises(DataError, match=r"bad\.jsonl:2 \(record 1\): invalid JSON"):
        _read(path)
    records = _read(path, on_error="skip")
    assert [type(r) for r in records] == [Conversation, Rejected, Conversation]


@pytest.mark.parametrize("record,message", [
    ({"messages": [{"role": "user"}]}, "message 0: missing field 'content'"),
    ({"conversations": [{"value": "x"}]}, "message 0: missing field 'from'"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "message 0: unknown role 'wizard'"),
    ({"messages": [{"role": "user", "content": None}]}, "content must be a string"),
    ({"messages": "hi"}, "expected a list of messages"),
    ({"text": "hi"}, "none of the fields 'messages'"),
    ({"messages": [{"role": "assistant", "content": "x", "truncated": "yes"}]},
     "'truncated' must be true or false"),
    ({"messages": [{"role": "user", "content": "x", "truncated": True}]},
     "only assistant messages can be 'truncated'"),
    ({"input_ids": [1, 2]}, "no 'loss_mask'"),
    ({"input_ids": [1, 2], "loss_mask": [1]}, "'input_ids' has 2 tokens but 'loss_mask' 1"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_records_raise_with_location_or_are_skipped(tmp_path, record, message):
    path = _write_jsonl(tmp_path / "x.jsonl", [{"messages": CHAT}, record])
    with pytest.raises(DataError, match=r"x\.jsonl:2 \(record 1\): .*" + re.escape(message)):
        _read(path)
    skipped = _read(path, on_error="skip")
    assert isinstance(skipped[1], Rejected) and skipped[1].reason == "malformed"


def test_empty_conversation_is_rejected_but_not_an_error(tmp_path):
    path = _write_jsonl(tmp_path / "e.jsonl", [{"conversations": []}, {"messages": CHAT}])
    first, second = _read(path)  # no DataError even under on_error=raise
    assert isinstance(first, Rejected) and first.reason == "empty"
    assert "e.jsonl:1" in first.describe()
    assert isinstance(second, Conversation)


def test_explicit_format_requires_its_field(tmp_path):
    path = _write_jsonl(tmp_path / "f.jsonl", [SHAREGPT])
    with pytest.raises(DataError, match=r"no 'messages' field \(data.format=messages\)"):
        _read(path, format="messages")
    assert isinstance(_read(path, format="sharegpt")[0], Conversation)


def test_missing_path_and_unsupported_file(tmp_path):
    with pytest.raises(DataError, match="'nope.jsonl': no such file or folder"):
        expand_paths(["nope.jsonl"])
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported type '.csv'"):
        expand_paths([str(tmp_path / "d.csv")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="contains no"):
        expand_paths([str(tmp_path / "empty")])


# --- broken dataset folders and files: one DataError line naming the file --------------------------

def test_a_damaged_datasets_folder_is_named(tmp_path):
    rows = [SHAREGPT, {"id": "y", "conversations": SHAREGPT["conversations"][1:]}]
    _save_to_disk(tmp_path / "ds", rows)
    state = tmp_path / "ds" / "state.json"
    good = state.read_text()
    state.write_text(good[:-10])  # cut off, as by a copy that did not finish
    with pytest.raises(DataError, match=r"ds/state.json: not readable JSON \(.*\); the datasets folder is "
                                        r"damaged: save it again with save_to_disk"):
        expand_paths([str(tmp_path / "ds")])
    for files in ('[{"name": "data-00000-of-00002.arrow"}]', "5", '["data-00000-of-00002.arrow"]'):
        state.write_text(f'{{"_data_files": {files}}}')
        with pytest.raises(DataError, match=r"'_data_files' is not a list of \{\"filename\": \.\.\.\} entries"):
            expand_paths([str(tmp_path / "ds")])
    state.write_text(good)
    (tmp_path / "ds" / "data-00001-of-00002.arrow").unlink()
    with pytest.raises(DataError, match=r"state.json names data-00001-of-00002.arrow, which is missing"):
        expand_paths([str(tmp_path / "ds")])
    _save_to_disk(tmp_path / "dd" / "train", rows)
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", ')
    with pytest.raises(DataError, match=r"dd/dataset_dict.json: not readable JSON"):
        expand_paths([str(tmp_path / "dd")])


def test_arrow_and_parquet_files_damaged_after_their_header_are_named(tmp_path):
    table = pa.Table.from_pylist([{"messages": CHAT}] * 40)
    stream = tmp_path / "d.arrow"
    with pa.ipc.new_stream(stream, table.schema) as writer:
        for start in range(0, 40, 10):
            writer.write_table(table.slice(start, 10))
    data = stream.read_bytes()
    stream.write_bytes(data[:len(data) * 3 // 4])  # the last batch cut off
    with pytest.raises(DataError, match=r"d.arrow: the Arrow data is damaged or truncated after record "
                                        r"\d+ \(.*\); write the file again"):
        _read(stream)
    parquet = tmp_path / "d.parquet"
    pq.write_table(table, parquet)
    parquet.write_bytes(parquet.read_bytes()[:200])
    with pytest.raises(DataError, match=r"d.parquet: not a readable Parquet file"):
        _read(parquet)


@pytest.mark.parametrize("record", [{"messages": CHAT}, {"data": [{"messages": CHAT}]}])
def test_a_pretty_printed_json_object_is_refused_with_the_accepted_layouts(tmp_path, record):
    path = tmp_path / "one.json"
    path.write_text(json.dumps(record, indent=2))
    with pytest.raises(DataError, match=r"one.json:1: not a JSON array, and its first line is not a complete "
                                        r"JSON object .*accepted layouts: JSON Lines \(one JSON object per "
                                        r"line\), a JSON array of objects"):
        _read(path, on_error="skip")
    path.write_text(json.dumps([record], indent=2))  # the same inside [ ] is read
    assert len(_read(path, on_error="skip")) == 1


def test_a_json_file_of_json_lines_with_a_bad_first_record_is_one_malformed_record(tmp_path):
    path = _write_jsonl(tmp_path / "lines.json", ['{"messages": oops}', {"messages": CHAT}])
    first, second = _read(path, on_error="skip")
    assert isinstance(first, Rejected) and "invalid JSON" in first.message
    assert isinstance(second, Conversation)


def test_a_pretty_printed_jsonl_file_says_so(tmp_path):
    path = tmp_path / "pretty.jsonl"
    path.write_text(json.dumps({"messages": CHAT}, indent=2) + "\n")
    with pytest.raises(DataError, match=r"pretty.jsonl:1 \(record 0\): invalid JSON: .*; the file looks "
                                        r"pretty-printed, but JSON Lines needs one whole object per line"):
        _read(path)
