"""Memory-mapped token store: layout, random access, atomic creation, fingerprints."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dflash_trainer.data.cache import (TokenStore, file_fingerprint, find_store, fingerprint,
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
