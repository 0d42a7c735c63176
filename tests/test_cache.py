"""Memory-mapped token store: layout, random access, atomic creation, fingerprints."""

import hashlib
import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dflash_trainer.core.assets import sharegpt_file
from dflash_trainer.core.fsutil import memoised_sha256
from dflash_trainer.data.cache import (ChatFieldScan, TokenStore, file_fingerprint, find_store, fingerprint,
                                       tokenizer_fingerprint)


def _samples(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(1, 50))
        out.append((rng.integers(0, 50_000, length).astype(np.int32),
                    rng.integers(0, 2, length).astype(np.uint8)))
    return out


def _build(path, samples):
    def fill(writer):
        for ids, mask in samples:
            writer.add(ids, mask)
        return {"stats": {"kept": len(samples)}}
    return TokenStore.build(path, fill)


def test_round_trip_random_access_and_per_sample_arrays(tmp_path):
    samples = _samples(200)
    store = _build(tmp_path / "s", samples)
    assert len(store) == 200
    assert store.lengths.tolist() == [len(ids) for ids, _ in samples]
    assert store.supervised.tolist() == [int(m.sum()) for _, m in samples]
    assert store.num_tokens == sum(len(ids) for ids, _ in samples)
    assert store.stats == {"kept": 200}
    for i in [0, 199, 57, -1]:
        ids, mask = store[i]
        assert ids.dtype == np.int32 and mask.dtype == np.uint8
        assert ids.tolist() == samples[i][0].tolist() and mask.tolist() == samples[i][1].tolist()
    with pytest.raises(IndexError):
        store[200]
    # A second reader maps the same files without loading them into memory.
    again = TokenStore(tmp_path / "s")
    assert isinstance(again._tokens, np.memmap) and again[3][0].tolist() == samples[3][0].tolist()
    assert (tmp_path / "s" / "tokens.bin").stat().st_size == 4 * store.num_tokens
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    assert meta["num_samples"] == 200 and meta["format_version"] == 1


def test_empty_store(tmp_path):
    store = _build(tmp_path / "e", [])
    assert len(store) == 0 and store.lengths.tolist() == [] and store.num_tokens == 0


def test_a_crash_while_filling_leaves_no_store(tmp_path):
    def fill(writer):
        writer.add(np.arange(5), np.ones(5))
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        TokenStore.build(tmp_path / "c", fill)
    assert list(tmp_path.iterdir()) == []
    assert find_store(tmp_path / "c") is None


def test_concurrent_builders_keep_the_first_store(tmp_path):
    first = _build(tmp_path / "s", _samples(3, seed=1))
    second = _build(tmp_path / "s", _samples(5, seed=2))
    assert len(first) == len(second) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_a_one_byte_edit_that_keeps_size_and_mtime_changes_the_fingerprint(tmp_path):
    """``cp -p``, rsync or a restored backup: same size, the old mtime put back; the memo of the
    hash must not answer for the new bytes."""
    import os

    cache = tmp_path / "cache"
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"a": "hello"}\n')
    first, memoised = file_fingerprint(path, cache)
    assert not memoised and file_fingerprint(path, cache) == (first, True)  # the shortcut, unchanged file
    stat = path.stat()
    with open(path, "r+b") as f:  # in place: same inode
        f.seek(8)
        f.write(b"j")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns, path.stat().st_ino) == \
        (stat.st_size, stat.st_mtime_ns, stat.st_ino)
    second, memoised = file_fingerprint(path, cache)
    assert not memoised and second["sha256"] != first["sha256"]
    assert json.loads((cache / ".file-sha256.json").read_text())[str(path.resolve())]["sha256"] == second["sha256"]


def test_fingerprints_change_with_their_inputs(tmp_path):
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})

    path = tmp_path / "d.jsonl"
    path.write_text("{}\n")
    before, _ = file_fingerprint(path, tmp_path / "cache")
    path.write_text("{}\n{}\n")
    assert file_fingerprint(path, tmp_path / "cache")[0] != before

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    plain = tokenizer_fingerprint(tok)
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    templated = tokenizer_fingerprint(tok)
    tok.chat_template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    assert len({plain, templated, tokenizer_fingerprint(tok)}) == 3


def test_files_with_fields_earlier_readers_dropped_get_another_identity_and_the_demo_keeps_its_own(tmp_path):
    cache = tmp_path / "cache"
    plain = {"conversations": [{"from": "human", "value": "tools"}, {"from": "gpt", "value": "developer"}]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(plain) + "\n")
    identity, _ = file_fingerprint(path, cache)
    # the identity main computed for a file (and so every store key built from it) is unchanged
    assert identity == {"path": str(path.resolve()), "size": path.stat().st_size,
                        "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    reasoning = {"messages": [{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "a", "reasoning_content": "r"}]}
    path.write_text(json.dumps(reasoning) + "\n")
    marked, memoised = file_fingerprint(path, cache)
    assert not memoised and marked["chat_fields"] == ["reasoning_content"]
    unmarked = {k: v for k, v in marked.items() if k != "chat_fields"}
    assert fingerprint({"files": [marked]}) != fingerprint({"files": [unmarked]})
    assert file_fingerprint(path, cache) == (marked, True)  # the memo answers the scan too
    memo = json.loads((cache / ".file-sha256.json").read_text())
    assert memo[str(path.resolve())]["chat_fields"] == ["reasoning_content"]

    agentic = {"messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "q"},
                            {"role": "assistant", "content": None, "tool_calls": []},
                            {"role": "tool", "content": "r"}], "tools": []}
    path.write_text(json.dumps(agentic, indent=1) + "\n")
    assert file_fingerprint(path, cache)[0]["chat_fields"] == ["developer", "tool", "tool_calls", "tools"]
    path.write_text(json.dumps({"conversations": [{"from": "function_call", "value": "{}"}]}) + "\n")
    assert file_fingerprint(path, cache)[0]["chat_fields"] == ["function_call"]


def test_a_field_split_by_a_chunk_boundary_is_found():
    scan = ChatFieldScan(json_text=True)
    for chunk in (b'{"messages": [{"role": "assistant", "reason', b'ing": "r", "content": "a"}]}'):
        scan.update(chunk)
    assert scan.result() == ["reasoning"]


def test_the_embedded_sharegpt_file_keeps_the_identity_its_store_key_was_built_from(tmp_path):
    path = sharegpt_file()
    identity, _ = file_fingerprint(path, tmp_path / "cache")
    assert set(identity) == {"path", "size", "sha256"}


def test_a_parquet_file_is_marked_by_the_field_names_of_its_schema(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    rows = [{"messages": [{"role": "assistant", "content": "a", "reasoning_content": "r"}]}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert file_fingerprint(path, tmp_path / "cache")[0]["chat_fields"] == ["reasoning_content"]
    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "assistant", "content": "a"}]}]), path)
    assert "chat_fields" not in file_fingerprint(path, tmp_path / "cache")[0]


def test_a_hash_memoised_before_the_field_scan_is_read_once_more(tmp_path):
    cache = tmp_path / "cache"
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "developer", "content": "d"}]}) + "\n")
    digest, _ = memoised_sha256(path, cache / ".file-sha256.json")  # an entry as older versions wrote it
    identity, memoised = file_fingerprint(path, cache)
    assert not memoised and identity["sha256"] == digest and identity["chat_fields"] == ["developer"]
    assert file_fingerprint(path, cache) == (identity, True)
