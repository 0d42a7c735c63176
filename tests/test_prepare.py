"""prepare: read -> tokenize -> token store, drop accounting, reuse, held-out, CLI."""

import copy
import json
import re

import numpy as np
import pytest
import yaml

from dflash_trainer.core.assets import load_tokenizer, resolve_target
from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import load_config
from dflash_trainer.data.formats import Conversation, DataError, Location
from dflash_trainer.data.prepare import build_dataset, format_report, heldout_conversations
from dflash_trainer.data.tokenize import ChatTokenizer, TemplateError, TokenizeOptions

LONG = " ".join(f"w{i}" for i in range(40))  # ~80 tokens: enough supervision


def _chat(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


@pytest.fixture(scope="module")
def smol():
    return load_tokenizer(resolve_target("smollm2"))


@pytest.fixture
def data(tmp_path):
    lines = [
        _chat("held 0", LONG), _chat("held 1", LONG),           # held out (heldout_samples=2)
        _chat("q0", LONG),
        {"conversations": []},                                   # empty
        {"messages": [{"role": "user", "content": "alone"}]},    # no assistant turn
        _chat("q1", "short"),                                    # too short (< 32 supervised)
        _chat("q2", LONG + " " + LONG + " " + LONG),             # too long (max_length 200, drop)
        "{broken json",                                          # malformed
        _chat("q3", LONG),
        _chat("q4", LONG),
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _cfg(tmp_path, path, *extra):
    return load_config(None, [f"data.paths=[{path}]", f"data.cache_dir={tmp_path / 'cache'}",
                              "data.heldout_samples=2", "data.max_length=200",
                              "data.on_too_long=drop", "data.on_error=skip",
                              # The "too short" record has fewer supervised tokens than this.
                              "data.min_supervised_tokens=32", *extra])


@pytest.mark.slow
def test_build_counts_every_drop_reason_and_stores_the_samples(tmp_path, data, smol):
    cfg = _cfg(tmp_path, data)
    store, stats = build_dataset(cfg, tokenizer=smol, log=None)
    assert stats.heldout == 2 and stats.records_read == 8
    assert stats.dropped == {"malformed": 1, "empty": 1, "no_assistant": 1, "empty_answer": 0,
                             "too_short": 1, "too_long": 1, "unrenderable": 0, "tools_unsupported": 0}
    assert stats.kept == len(store) == 3
    assert "chats.jsonl:8 (record 7): invalid JSON" in stats.examples["malformed"][0]
    chat = ChatTokenizer(smol, TokenizeOptions.from_config(cfg))
    for i, question in enumerate(["q0", "q3", "q4"]):
        (expected,) = chat.encode(Conversation(_chat(question, LONG)["messages"], Location("x", 0))).encoded
        ids, mask = store[i]
        assert ids.tolist() == expected.input_ids.tolist()
        assert mask.tolist() == expected.loss_mask.tolist()
    assert stats.total_tokens == int(store.lengths.sum())
    assert stats.supervised_tokens == int(store.supervised.sum()) > 0
    report = format_report(stats, store, cfg.data.max_length)
    for label in ("records read", "kept", "malformed", "empty conversation", "no assistant turn",
                  "too short", "too long", "supervised tokens", "#"):
        assert label in report


def test_empty_answers_are_dropped_or_left_unsupervised_and_counted(tmp_path, smol):
    partial = {"messages": [{"role": "user", "content": "q3"}, {"role": "assistant", "content": " "},
                            {"role": "user", "content": "again"}, {"role": "assistant", "content": LONG}]}
    both_empty = {"messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": ""},
                               {"role": "user", "content": "again"}, {"role": "assistant", "content": "\n\t"}]}
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [_chat("q0", LONG), _chat("q1", "   "), both_empty,
                                                           partial]))
    cfg = load_config(None, [f"data.paths=[{path}]", f"data.cache_dir={tmp_path / 'cache'}",
                             "data.heldout_samples=0", "data.min_supervised_tokens=8"])
    store, stats = build_dataset(cfg, tokenizer=smol, log=None)
    assert stats.records_read == 4 and stats.kept == len(store) == 2
    assert stats.dropped["empty_answer"] == 2 and sum(stats.dropped.values()) == 2
    assert stats.empty_answers == 1
    assert stats.summary() == ("4 records read (+0 held out), 2 kept, 2 dropped (empty answers 2), "
                               "0 truncated to data.max_length, 1 empty answers unsupervised")
    dropped = [json.loads(line) for line in (store.path / "dropped.jsonl").read_text().splitlines()]
    assert dropped == [
        {"reason": "empty_answer", "message": f"{path}:2 (record 1): every assistant answer is empty or "
                                              "whitespace (it would teach the drafter to end the turn at once)"},
        {"reason": "empty_answer", "message": f"{path}:3 (record 2): every assistant answer is empty or "
                                              "whitespace (it would teach the drafter to end the turn at once)"}]
    ids, mask = store[1]  # the partial one: only its real answer is supervised
    assert smol.decode(ids[mask.astype(bool)].tolist()) == LONG + "<|im_end|>\n"
    report = format_report(stats, store, cfg.data.max_length)
    assert "  empty answers                  2" in report
    assert "empty answers unsupervised     1" in report


@pytest.mark.slow
def test_unchanged_input_reuses_the_store_without_tokenizing(tmp_path, data, smol, monkeypatch):
    cfg = _cfg(tmp_path, data)
    first, _ = build_dataset(cfg, tokenizer=smol, log=None)

    def refuse(*args, **kwargs):
        raise AssertionError("retokenized")

    monkeypatch.setattr(ChatTokenizer, "encode_batch", refuse)
    again, stats = build_dataset(cfg, tokenizer=smol, log=None)
    assert stats.reused and again.path == first.path and stats.kept == 3
    # Any change of data, options or chat template is a different store.
    monkeypatch.undo()
    with open(data, "a") as f:
        f.write(json.dumps(_chat("q5", LONG)) + "\n")
    changed, stats = build_dataset(cfg, tokenizer=smol, log=None)
    assert not stats.reused and changed.path != first.path and len(changed) == 4
    other_template = copy.deepcopy(smol)
    other_template.chat_template = smol.chat_template.replace("\n'}}", "\n\n'}}")
    _, stats = build_dataset(cfg, tokenizer=other_template, log=None)
    assert not stats.reused
    _, stats = build_dataset(_cfg(tmp_path, data, "data.max_length=300"), tokenizer=smol, log=None)
    assert not stats.reused


def test_heldout_and_max_samples(tmp_path, data, smol):
    cfg = _cfg(tmp_path, data)
    assert heldout_conversations(cfg) == [_chat("held 0", LONG)["messages"],
                                          _chat("held 1", LONG)["messages"]]
    store, stats = build_dataset(_cfg(tmp_path, data, "data.max_samples=1"), tokenizer=smol,
                                 log=None)
    assert stats.records_read == 1 and stats.max_samples_reached and len(store) == 1
    ids, _ = store[0]
    assert "q0" in smol.decode(ids.tolist())  # the held-out records never reach training
    assert stats.sources[0]["stopped_early"] and stats.sources[0]["records"] == 3


def test_heldout_conversations_of_the_embedded_set_start_with_a_user_turn():
    cfg = load_config(None, ["data.heldout_samples=20"])
    conversations = heldout_conversations(cfg)
    assert 15 <= len(conversations) <= 20
    for messages in conversations:
        roles = [m["role"] for m in messages if m["role"] != "system"]
        assert roles[0] == "user" and set(roles) <= {"user", "assistant"}


def test_malformed_user_data_raises_by_default(tmp_path, data, smol):
    cfg = _cfg(tmp_path, data, "data.on_error=auto")
    with pytest.raises(DataError, match=r"chats\.jsonl:8 \(record 7\): invalid JSON"):
        build_dataset(cfg, tokenizer=smol, log=None)
    # Nothing half-written is left (the memo of the data file's hash is complete, and kept).
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [".file-sha256.json"]


def test_tokenizer_without_chat_template(tmp_path, data, smol):
    plain = copy.deepcopy(smol)
    plain.chat_template = None
    with pytest.raises(TemplateError, match=r"chats\.jsonl:3 \(record 2\): .*no chat template"):
        build_dataset(_cfg(tmp_path, data), tokenizer=plain, log=None)


def test_truncated_user_json_array_is_reported(tmp_path, smol):
    text = json.dumps([_chat(f"q{i}", LONG) for i in range(3)])
    path = tmp_path / "cut.json"
    path.write_text(text[:-30])
    store, stats = build_dataset(_cfg(tmp_path, path, "data.heldout_samples=0"), tokenizer=smol,
                                 log=None)
    assert len(store) == 2 and stats.dropped["malformed"] == 1
    assert stats.sources[0]["truncated_tail"]
    assert "truncated at its end: 2 complete records recovered" in format_report(stats, store, 200)


@pytest.mark.slow
def test_cli_prepare_end_to_end_on_the_embedded_sharegpt(tmp_path, capsys):
    args = ["prepare", "--config", "configs/demo-cpu.yaml", "data.max_samples=40",
            "data.heldout_samples=4", f"data.cache_dir={tmp_path}"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "records read                 40   (+4 held out for evaluation)" in out
    # The store is named by the bytes of the 125.5 MB file: hashed once, with its cost printed.
    assert re.search(r"prepare: content hash of 1 data file\(s\): 1 hashed \(125.5 MB\) in \d+\.\d\d s", out), out
    (store_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    stats = json.loads((store_dir / "stats.json").read_text())
    assert stats["records_read"] == 40 and stats["kept"] > 20 and not stats["reused"]
    assert yaml.safe_load((store_dir / "config.yaml").read_text())["data"]["max_samples"] == 40
    lengths = np.diff(np.load(store_dir / "offsets.npy"))
    assert lengths.max() <= 1024 and stats["total_tokens"] == int(lengths.sum())
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "reused" in out and "0 hashed (0.0 MB)" in out and "1 unchanged since their last hash" in out


def test_cli_prepare_reports_a_missing_path(tmp_path, capsys):
    code = cli_main(["prepare", "--data", str(tmp_path / "missing.jsonl"),
                     f"data.cache_dir={tmp_path}"])
    assert code == 1
    assert "missing.jsonl': no such file or folder" in capsys.readouterr().err


def test_prepare_reports_the_fields_it_dropped(tmp_path, smol):
    extra = {"messages": [{"role": "user", "content": "q0", "weight": 1},
                          {"role": "assistant", "content": LONG, "loss": True}]}
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [extra, _chat("q1", LONG), _chat("q2", LONG)]))
    cfg = load_config(None, [f"data.paths=[{path}]", f"data.cache_dir={tmp_path / 'cache'}",
                             "data.heldout_samples=0"])
    store, stats = build_dataset(cfg, tokenizer=smol, log=None)
    assert stats.kept == len(store) == 3
    assert stats.dropped_fields == {"weight": 1, "loss": 1}
    assert stats.summary() == ("3 records read (+0 held out), 3 kept, 0 dropped, "
                               "0 truncated to data.max_length, fields dropped: loss 1, weight 1")
    report = format_report(stats, store, cfg.data.max_length)
    assert f"{path}: 3 records read; fields dropped: loss 1, weight 1" in report
    assert "fields dropped                2   (no chat template renders them: loss 1, weight 1)" in report
    assert json.loads((store.path / "meta.json").read_text())["stats"]["dropped_fields"] == {"weight": 1, "loss": 1}


def _turns(*answers: str) -> dict:
    return {"messages": [m for i, a in enumerate(answers) for m in (
        {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": a})]}


def test_multi_turn_under_a_qwen3_template_gives_per_turn_samples_and_reports_them(tmp_path, smol, capsys):
    from benchmarks.chat_template_matrix import corpus

    qwen3 = copy.deepcopy(smol)
    qwen3.chat_template = next(p for p in corpus() if p.stem == "Qwen-Qwen3-0.6B").read_text()
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        _turns(LONG, "<think>\nfirst I think\n</think>\n\n" + LONG, LONG),  # 3 turns, one reasoning
        _chat("single", LONG)]))
    cfg = load_config(None, [f"data.paths=[{path}]", f"data.cache_dir={tmp_path / 'cache'}",
                             "data.heldout_samples=0"])
    store, stats = build_dataset(cfg, tokenizer=qwen3, log=print)
    # the 3-turn chat: its whole render supervises turn 3, turns 1 and 2 get their own samples
    assert (stats.kept, stats.samples, len(store), stats.expanded, stats.turn_samples) == (2, 4, 4, 1, 2)
    assert stats.reasoning_answers == 1 and stats.reasoning_unrendered == 0
    assert stats.expansion_tokens == int(store.lengths[1:3].sum())
    out = capsys.readouterr().out
    assert "1 conversations as one sample each" in out and "1 expanded into 2 per-turn samples" in out
    report = format_report(stats, store, cfg.data.max_length)
    assert "kept                          2   (4 samples)" in report
    assert "reasoning: 1 supervised answers carried reasoning" in report
    # the reasoning turn's own sample supervises its think block
    ids, mask = store[2]
    assert smol.decode(ids[mask.astype(bool)].tolist()).startswith("<think>\nfirst I think\n</think>")
    # last_turn_only: one sample per conversation
    _, last = build_dataset(load_config(None, [f"data.paths=[{path}]", f"data.cache_dir={tmp_path / 'cache'}",
                                               "data.heldout_samples=0", "data.last_turn_only=true"]),
                            tokenizer=qwen3, log=None)
    assert (last.kept, last.samples, last.expanded) == (2, 2, 0)
    assert last.supervised_tokens < stats.supervised_tokens


def test_a_record_the_template_cannot_render_is_dropped_unless_on_error_is_raise(tmp_path, smol):
    picky = copy.deepcopy(smol)
    picky.chat_template = ("{%- for m in messages %}{%- if 'BOOM' in m.content %}"
                           "{{- raise_exception('no BOOM here') }}{%- endif %}{%- endfor %}" + smol.chat_template)
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [_chat("q0", LONG), _chat("BOOM", LONG)]))
    args = [f"data.paths=[{path}]", f"data.cache_dir={tmp_path / 'cache'}", "data.heldout_samples=0"]
    store, stats = build_dataset(load_config(None, args), tokenizer=picky, log=None)
    assert len(store) == 1 and stats.dropped["unrenderable"] == 1
    assert f"{path}:2 (record 1): the chat template of" in stats.examples["unrenderable"][0]
    assert "no BOOM here" in stats.examples["unrenderable"][0]
    with pytest.raises(DataError, match=r"chats\.jsonl:2 \(record 1\): .*no BOOM here.*data\.on_error=skip"):
        build_dataset(load_config(None, [*args, "data.on_error=raise"]), tokenizer=picky, log=None)


def test_cli_prepare_show_prints_samples_without_writing_a_store(tmp_path, capsys):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [_turns("Hello there", "Ciao"), _chat("q", "")]))
    args = ["prepare", "--data", str(path), f"data.cache_dir={tmp_path / 'cache'}", "data.heldout_samples=0"]
    assert cli_main([*args, "--show", "5"]) == 0
    out = capsys.readouterr().out
    assert f"--- sample 1: {path}:1 (record 0), assistant turns 1, 2 of 2, the whole conversation" in out
    assert "<|im_start|>assistant\n⟦Hello there<|im_end|>\n⟧<|im_start|>user" in out
    assert f"--- {path}:2 (record 1): dropped (empty_answer)" in out
    assert "1 samples shown" in out and not (tmp_path / "cache").exists()
    assert cli_main([*args, "--show", "0"]) == 2
