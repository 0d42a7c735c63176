"""Layouts: every layout people keep chat data in becomes the same Conversation; every field left
out is counted; a record of no layout is one located error; the same file is never read twice."""

import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trainer.config import CHAT_ROLES, ConfigError, FieldsConfig, load_config
from dflash_trainer.data.formats import (Conversation, DataError, Rejected, SourceStats, expand_paths,
                                         read_records)
from dflash_trainer.data.layouts import normalize_record
from dflash_trainer.data.readers import Location

HERE = Location("chats.jsonl", 0, 1)
CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
WEATHER_TOOL = {"name": "weather", "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _adapt(raw, **kwargs):
    drops: dict[str, int] = {}
    record = normalize_record(raw, HERE, drops=drops, **kwargs)
    return record, drops


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# --- one test per layout -------------------------------------------------------------------------

def test_openai_messages_keep_every_renderable_field():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    raw = {"messages": [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": "I should call it."},
        {"role": "tool", "tool_call_id": "call_1", "name": "weather", "content": "sunny"},
        {"role": "assistant", "content": "<think>easy</think>Sunny.", "reasoning_content": None},
    ], "tools": [{"type": "function", "function": WEATHER_TOOL}]}
    record, drops = _adapt(raw)
    assert isinstance(record, Conversation) and drops == {}
    assert record.messages == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call it.", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "weather"},
        {"role": "assistant", "content": "<think>easy</think>Sunny."},  # inline think stays in content
    ]
    assert record.tools == [{"type": "function", "function": WEATHER_TOOL}]


def test_openai_legacy_function_call_and_function_role():
    raw = {"messages": [CHAT[0], {"role": "assistant", "content": None,
                                  "function_call": {"name": "weather", "arguments": "{}"}},
                        {"role": "function", "name": "weather", "content": "sunny"}, CHAT[1]]}
    record, drops = _adapt(raw)
    assert record.messages[1:3] == [
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "name": "weather"}]


def test_sharegpt_function_call_and_observation_become_tool_calls_and_tool_messages():
    raw = {"conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "gpt", "value": "Let me check."},
        {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": '{"sky": "sunny"}'},
        {"from": "function_call", "value": json.dumps([{"name": "weather", "arguments": {"city": "Rome"}},
                                                       {"name": "weather", "arguments": {"city": "Oslo"}}])},
        {"from": "observation", "value": "rainy"},
        {"from": "gpt", "value": "Sunny in Paris."},
    ], "system": "You are a weather bot.", "tools": json.dumps([WEATHER_TOOL])}
    record, drops = _adapt(raw)
    assert drops == {}

    def call(city):
        return {"type": "function", "function": {"name": "weather", "arguments": {"city": city}}}

    assert record.messages == [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
        # The call joins the text answer right before it: one assistant turn, as OpenAI writes it.
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call("Paris")]},
        {"role": "tool", "content": '{"sky": "sunny"}'},
        {"role": "assistant", "content": "", "tool_calls": [call("Rome"), call("Oslo")]},
        {"role": "tool", "content": "rainy"},
        {"role": "assistant", "content": "Sunny in Paris."},
    ]
    assert record.tools == [{"type": "function", "function": WEATHER_TOOL}]


def test_lmsys_conversation():
    raw = {"conversation_id": "x", "model": "vicuna", "conversation": CHAT, "turn": 1, "language": "English"}
    record, drops = _adapt(raw)
    assert record.messages == CHAT and drops == {}


@pytest.mark.parametrize("raw,user", [
    ({"instruction": "Translate.", "input": "Bonjour", "output": "Hello"}, "Translate.\n\nBonjour"),
    ({"instruction": "Say hi.", "input": "", "output": "Hello"}, "Say hi."),
    ({"instruction": "Say hi.", "output": "Hello"}, "Say hi."),
])
def test_alpaca(raw, user):
    record, _ = _adapt(raw)
    assert record.messages == [{"role": "user", "content": user}, {"role": "assistant", "content": "Hello"}]


def test_alpaca_with_system_and_history():
    raw = {"instruction": "And now?", "input": None, "output": "Later.", "system": "Be brief.",
           "history": [["When?", "Soon."]]}
    record, _ = _adapt(raw)
    assert [(m["role"], m["content"]) for m in record.messages] == [
        ("system", "Be brief."), ("user", "When?"), ("assistant", "Soon."), ("user", "And now?"),
        ("assistant", "Later.")]


def test_trl_prompt_completion_strings_and_conversational():
    record, _ = _adapt({"prompt": "Hi", "completion": "Hello"})
    assert record.messages == CHAT
    conversational = {"prompt": [{"role": "system", "content": "Be brief."}, CHAT[0]], "completion": [CHAT[1]]}
    record, _ = _adapt(conversational)
    assert record.messages == [{"role": "system", "content": "Be brief."}, *CHAT]
    bad, _ = _adapt({"prompt": "Hi", "completion": [CHAT[1]]})
    assert isinstance(bad, Rejected) and "both be strings or both be lists" in bad.message


def test_original_ultrachat_data_list():
    record, _ = _adapt({"id": "0", "data": ["Hi", "Hello", "How are you?", "Fine."]})
    assert [m["role"] for m in record.messages] == ["user", "assistant", "user", "assistant"]
    assert record.messages[2]["content"] == "How are you?"


def test_field_map_reads_any_other_layout():
    fields = FieldsConfig(messages="dialog", role="speaker", content="text",
                          roles=["prompter=user", "bot=assistant"])
    raw = {"dialog": [{"speaker": "prompter", "text": "Hi"}, {"speaker": "BOT", "text": "Hello"}]}
    record, _ = _adapt(raw, fields=fields)
    assert record.messages == CHAT
    missing, _ = _adapt({"messages": CHAT}, fields=fields)
    assert isinstance(missing, Rejected) and "no 'dialog' field (data.fields.messages)" in missing.message
    # The role names apply to the detected layouts too.
    record, _ = _adapt({"conversations": [{"from": "prompter", "value": "Hi"}, {"from": "bot", "value": "Hello"}]},
                       fields=FieldsConfig(roles=["prompter=user", "bot=assistant"]))
    assert record.messages == CHAT
    # A name mapped to function_call is a tool-call turn, as ShareGPT's own.
    record, _ = _adapt({"conversations": [{"from": "human", "value": "Hi"},
                                          {"from": "tool_call", "value": '{"name": "f", "arguments": {}}'}]},
                       fields=FieldsConfig(roles=["tool_call=function_call"]))
    assert record.messages[1] == {"role": "assistant", "content": "",
                                  "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}


def test_a_message_list_may_use_either_key_pair():
    record, _ = _adapt({"conversations": CHAT})  # role/content under a ShareGPT key
    assert record.messages == CHAT
    record, _ = _adapt({"messages": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]})
    assert record.messages == CHAT


def test_required_format_names_its_fields():
    record, _ = _adapt({"messages": CHAT}, format="alpaca")
    assert isinstance(record, Rejected)
    assert record.message.startswith("no 'instruction' and 'output' fields (data.format=alpaca)")
    record, _ = _adapt({"data": ["Hi", "Hello"]}, format="ultrachat")
    assert isinstance(record, Conversation)
    # A required layout is read even where detection would pick another first.
    both = {"messages": [{"role": "user", "content": "other"}], "conversations": [{"from": "human", "value": "Hi"}]}
    record, _ = _adapt(both, format="sharegpt")
    assert record.messages == CHAT[:1]


def test_a_record_of_no_layout_is_one_line_naming_file_and_line(tmp_path):
    path = _write_jsonl(tmp_path / "odd.jsonl", [{"messages": CHAT}, {"text": "just text"}])
    with pytest.raises(DataError) as err:
        list(read_records(expand_paths([str(path)])))
    message = str(err.value)
    assert "\n" not in message
    assert re.search(r"odd\.jsonl:2 \(record 1\): record matches no layout: .*'instruction'\+'output' "
                     r"\(Alpaca\).*keys: \['text'\]; map its fields with data.fields", message), message


# --- drops: one test per reason ------------------------------------------------------------------

@pytest.mark.parametrize("raw,dropped", [
    ({"messages": [{"role": "user", "content": "Hi", "weight": 0.5}, CHAT[1]]}, {"weight": 1}),
    ({"messages": [{"role": "user", "content": "Hi", "name": "ann"}, CHAT[1]]}, {"name": 1}),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                 {"type": "image_url", "image_url": {"url": "x"}}]}, CHAT[1]]},
     {"content part image_url": 1}),
    ({"messages": [CHAT[0], {"role": "assistant", "content": "", "tool_calls": [
        {"index": 0, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     {"tool_calls.index": 1}),
    ({"messages": [CHAT[0], {**CHAT[1], "reasoning_content": "a", "reasoning": "b"}]}, {"reasoning": 1}),
    ({"messages": [CHAT[0], {**CHAT[1], "tool_call_id": "c1"}]}, {"tool_call_id": 1}),
    ({"messages": [{"role": "system", "content": "A"}, *CHAT], "system": "B"}, {"system (record)": 1}),
    ({"conversations": [{"from": "human", "value": "Hi", "loss": False}, {"from": "gpt", "value": "Hello"}]},
     {"loss": 1}),
])
def test_every_field_left_out_is_counted(raw, dropped):
    record, drops = _adapt(raw)
    assert isinstance(record, Conversation)
    assert drops == dropped


def test_null_fields_hold_nothing_and_are_not_counted():
    raw = {"messages": [{"role": "user", "content": "Hi", "name": None, "tool_calls": None},
                        {**CHAT[1], "refusal": None, "tool_calls": [], "function_call": None}]}
    record, drops = _adapt(raw)
    assert record.messages == CHAT and drops == {}


def test_a_rejected_record_counts_no_fields():
    record, drops = _adapt({"messages": [{"role": "user", "content": "Hi", "weight": 1},
                                         {"role": "wizard", "content": "x"}]})
    assert isinstance(record, Rejected) and drops == {}


@pytest.mark.parametrize("raw,message", [
    ({"messages": [{"role": "user", "content": None}]}, "message 0: content must be a string"),
    ({"messages": [{"role": "user", "content": [{"text": 3}]}]}, "message 0: a content part must be"),
    ({"messages": [CHAT[0], {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "message 1: tool call 0: needs a function name"),
    ({"messages": [CHAT[0], {"role": "assistant", "content": None, "tool_calls": "f()"}]},
     "message 1: 'tool_calls' must be a list"),
    ({"messages": [CHAT[0], {"role": "assistant", "content": "x", "reasoning_content": 3}]},
     "message 1: 'reasoning_content' must be a string"),
    ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "function_call", "value": "weather(Paris)"}]},
     "message 1: the function_call value is not JSON"),
    ({"messages": CHAT, "tools": "not json"}, "'tools' is a string but not JSON"),
    ({"messages": CHAT, "tools": [{"description": "no name"}]}, "tools[0]: expected a function definition"),
    ({"instruction": 3, "output": "x"}, "Alpaca 'instruction' must be a string"),
    ({"data": ["Hi", 3]}, "UltraChat 'data' must be a list of strings"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "(map others with data.fields.roles)"),
])
def test_malformed_records_name_the_message(raw, message):
    record, _ = _adapt(raw)
    assert isinstance(record, Rejected) and record.reason == "malformed"
    assert message in record.message, record.message


def test_prepare_sums_dropped_fields_per_file(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": "user", "content": "Hi", "weight": 1}, CHAT[1]]},
        {"messages": [{"role": "user", "content": "Hi", "weight": 2}, {**CHAT[1], "name": "bot"}]}])
    stats: list[SourceStats] = []
    assert len(list(read_records(expand_paths([str(path)]), stats=stats))) == 2
    assert stats[0].dropped_fields == {"weight": 2, "name": 1}


# --- property: whatever the extra keys, the output keeps the contract and counts each once -------

_EXTRA = st.dictionaries(st.sampled_from(["weight", "loss", "name", "meta", "tool_call_id", "refusal"]),
                         st.text(max_size=3), max_size=3)
_MESSAGE = st.tuples(st.sampled_from(["system", "developer", "user", "human", "assistant", "gpt", "tool"]),
                     st.text(max_size=5), _EXTRA)
_KEPT = {"system": {"role", "content"}, "developer": {"role", "content"}, "user": {"role", "content"},
         "assistant": {"role", "content", "reasoning_content", "tool_calls", "truncated"},
         "tool": {"role", "content", "tool_call_id", "name"}}


@settings(max_examples=150, deadline=None)
@given(st.lists(_MESSAGE, min_size=1, max_size=6), st.booleans())
def test_adapter_output_keeps_the_contract_and_counts_every_extra_key(turns, sharegpt):
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    raw_messages = [{**extra, role_key: role, content_key: text} for role, text, extra in turns]
    record, drops = _adapt({"conversations" if sharegpt else "messages": raw_messages})
    assert isinstance(record, Conversation)
    assert len(record.messages) == len(raw_messages)
    expected: dict[str, int] = {}
    for message, raw in zip(record.messages, raw_messages):
        assert message["role"] in CHAT_ROLES and isinstance(message["content"], str)
        assert set(message) <= _KEPT[message["role"]]
        assert message["content"] == raw[content_key]
        for key in raw:
            if key not in (role_key, content_key) and key not in message:
                expected[key] = expected.get(key, 0) + 1
    assert drops == expected


# --- config --------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    (["data.fields.roles=[bot]"], r"data.fields.roles\[0\]='bot': expected NAME=ROLE"),
    (["data.fields.roles=[bot=robot]"], r"data.fields.roles\[0\]='bot=robot'"),
    (["data.fields.role=speaker"], r"data.fields.role name message keys, but data.fields.messages .* is not set"),
    (["data.fields.messages=dialog", "data.format=sharegpt"],
     r"data.fields.messages='dialog' is the layout of every record, but data.format=sharegpt"),
])
def test_field_map_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


# --- the same file named twice (issue 54) --------------------------------------------------------

@pytest.fixture
def chats(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    return _write_jsonl(folder / "a.jsonl", [{"messages": CHAT}])


def test_a_file_listed_twice_is_refused(chats):
    with pytest.raises(ConfigError, match=rf"data.paths names '{re.escape(str(chats))}' twice; its records "
                                          "would be trained on twice: name each file once"):
        expand_paths([str(chats), str(chats)])


def test_a_folder_and_a_file_inside_it_are_refused_naming_both(chats):
    with pytest.raises(ConfigError) as err:
        expand_paths([str(chats.parent), str(chats)])
    assert f"entries '{chats.parent}' and '{chats}' both reach the file '{chats}'" in str(err.value)


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_link_to_a_listed_file_is_refused(chats, tmp_path, link):
    other = tmp_path / "other.jsonl"
    (os.symlink if link == "symlink" else os.link)(chats, other)
    with pytest.raises(ConfigError, match=f"entries '{re.escape(str(chats))}' and '{re.escape(str(other))}' "
                                          "both reach the file"):
        expand_paths([str(chats), str(other)])


def test_a_link_inside_a_folder_to_a_file_of_it_is_refused(chats):
    os.symlink(chats, chats.parent / "b.jsonl")
    with pytest.raises(ConfigError, match="reaches the same file twice, as .*a.jsonl' and .*b.jsonl'"):
        expand_paths([str(chats.parent)])


def test_two_files_with_the_same_content_are_both_read(chats):
    copy = chats.parent / "copy.jsonl"
    copy.write_bytes(chats.read_bytes())
    assert [s.path.name for s in expand_paths([str(chats.parent)])] == ["a.jsonl", "copy.jsonl"]


# --- the readers of the data use the one adapter -------------------------------------------------

def test_regenerate_reads_every_layout_and_rejects_tool_calls_by_name(tmp_path):
    from dflash_trainer.data.regenerate import RejectedInput, read_conversations

    tool_chat = {"messages": [CHAT[0], {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42"}, CHAT[1]]}
    path = _write_jsonl(tmp_path / "mixed.jsonl", [{"instruction": "Hi", "output": "Hello"},
                                                   {"data": ["Hi", "Hello"]}, tool_chat])
    cfg = load_config(None, [f"data.paths=[{path}]"])
    first, second, third = read_conversations(cfg)
    assert first == (f"{path}:1", CHAT) and second == (f"{path}:2", CHAT)
    assert isinstance(third, RejectedInput) and third.id == f"{path}:3"
    assert third.reason.startswith("tool calls: an answer generated anew would not match")


def test_eval_prompt_files_and_heldout_prompts_read_every_layout(tmp_path):
    from dflash_trainer.data.prepare import heldout_conversations
    from dflash_trainer.evaluation.prompt_sets import read_prompt_file

    path = _write_jsonl(tmp_path / "prompts.jsonl", [
        {"instruction": "Say hi.", "output": "Hello"},
        {"conversation": [{"role": "developer", "content": "Be brief."}, *CHAT]},
        {"data": ["Q1", "A1", "Q2", "A2"]},
        {"prompt": [{"role": "user", "content": "Hey"}], "completion": [CHAT[1]]}])
    prompts = read_prompt_file(path)
    assert [p.turns for p in prompts] == [["Say hi."], ["Hi"], ["Q1", "Q2"], ["Hey"]]
    assert prompts[1].system == "Be brief."
    cfg = load_config(None, [f"data.paths=[{path}]", "data.heldout_samples=1"])
    assert heldout_conversations(cfg) == [[{"role": "user", "content": "Say hi."},
                                           {"role": "assistant", "content": "Hello"}]]


def test_a_parquet_file_of_several_layouts_reads_each_row_by_its_own(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": CHAT}, {"instruction": "Hi", "output": "Hello"}, {"data": ["Hi", "Hello"]},
            {"messages": [CHAT[0], {**CHAT[1], "tool_calls": None, "reasoning_content": None}]}]
    columns = {key for row in rows for key in row}
    path = tmp_path / "mixed.parquet"
    # One schema for every row, as datasets writes concatenated sets: absent keys are nulls.
    pq.write_table(pa.Table.from_pylist([{key: row.get(key) for key in sorted(columns)} for row in rows]), path)
    stats: list[SourceStats] = []
    records = list(read_records(expand_paths([str(path)]), stats=stats))
    assert [r.messages for r in records] == [CHAT] * 4
    assert stats[0].dropped_fields == {}


@pytest.mark.slow
def test_cli_prepare_reads_a_custom_layout_through_data_fields(tmp_path, capsys):
    from dflash_trainer.cli.main import main as cli_main

    answer = " ".join(f"word{i}" for i in range(30))
    path = _write_jsonl(tmp_path / "dialogs.jsonl", [
        {"dialog": [{"speaker": "prompter", "text": f"question {i}", "mood": "calm"},
                    {"speaker": "bot", "text": answer}]} for i in range(3)])
    argv = ["prepare", "--data", str(path), f"data.cache_dir={tmp_path / 'cache'}", "data.heldout_samples=0",
            "data.fields.messages=dialog", "data.fields.role=speaker", "data.fields.content=text",
            "data.fields.roles=[prompter=user, bot=assistant]"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert f"{path}: 3 records read; fields dropped: mood 3" in out
    assert "data: 3 records read (+0 held out), 3 kept, 0 dropped" in out
    # Without the map the same file is refused on its first record, naming file and line.
    assert cli_main(argv[:5]) == 1
    assert f"{path}:1 (record 0): record matches no layout" in capsys.readouterr().err


def test_every_example_of_the_layouts_section_in_docs_data_md_reads():
    doc = (Path(__file__).parents[1] / "docs" / "data.md").read_text()
    section = doc[doc.index("\n## Layouts\n"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```json\n(.*?)```", section, flags=re.S)
    decoder, records = json.JSONDecoder(), []
    for block in blocks:  # one or more JSON objects, each over one or more lines
        pos = 0
        while block[pos:].strip():
            pos += len(block[pos:]) - len(block[pos:].lstrip())
            record, pos = decoder.raw_decode(block, pos)
            records.append(record)
    assert len(records) >= 7  # OpenAI, ShareGPT, lmsys, Alpaca, TRL (2), UltraChat
    for raw in records:
        record, drops = _adapt(raw)
        assert isinstance(record, Conversation), (raw, record)
        assert drops == {}
        assert any(m["role"] == "assistant" for m in record.messages)
