"""Chat template -> input ids + assistant-only loss mask, with exact expected masks.

Expected samples are written as (text piece, supervised) segments: the expected ids are those of
the joined text, the expected mask is 1 exactly on the tokens inside supervised pieces (no token
may straddle two pieces).
"""

import copy

import numpy as np
import pytest

from dflash_trainer.core.assets import load_tokenizer, resolve_target
from dflash_trainer.data.formats import Conversation, Location, Tokenized
from dflash_trainer.data.tokenize import (ChatTokenizer, Dropped, Encoded, Samples, TemplateError,
                                          TokenizeOptions, trim_conversation)

LOC = Location("test.jsonl", 0, 1)
SMOL_SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
               "Hugging Face<|im_end|>\n")

# Qwen3-style (as the real Qwen3 template): a reasoning_content field or an inline think block is
# rendered as a <think> block only in the assistant turns after the last user message; earlier
# turns lose it, and enable_thinking=false pre-fills an empty think block in the prompt.
QWEN3_LIKE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if m.reasoning_content is defined and m.reasoning_content -%}"
    "{%- set reasoning = m.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)
SMOL_UPPER = ("{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content.upper() "
              "+ '<|im_end|>\\n' -}}{%- endfor -%}"
              "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
# The same with {% generation %} markers: they change nothing, spans come from engine renders.
QWEN3_MARKED = (QWEN3_LIKE.replace("{{- '<think>\\n' + reasoning", "{% generation %}{{- '<think>\\n' + reasoning")
                .replace(" content + '<|im_end|>\\n' -}}", " content + '<|im_end|>\\n' -}}{% endgeneration %}")
                .replace("{{- content + '<|im_end|>", "{% generation %}{{- content + '<|im_end|>"))
QWEN3_HEAD = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smol():
    return load_tokenizer(resolve_target("smollm2"))


def _with_template(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def _opts(**kw) -> TokenizeOptions:
    return TokenizeOptions(**{"min_supervised_tokens": 1, **kw})


def _conv(*turns: tuple[str, str]) -> Conversation:
    return Conversation([{"role": r, "content": c} for r, c in turns], LOC)


def _expect(tok, segments: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """Ids of the joined text; mask = the flag of the segment holding each token's characters
    (every token must lie inside one segment, so the expectation is unambiguous)."""
    text = "".join(t for t, _ in segments)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    bounds, flags, pos = [], [], 0
    for piece, supervised in segments:
        bounds.append((pos, pos + len(piece)))
        flags.append(supervised)
        pos += len(piece)
    mask = []
    for start, end in enc["offset_mapping"]:
        (k,) = [k for k, (a, b) in enumerate(bounds) if a <= start and end <= b]
        mask.append(flags[k])
    return list(enc["input_ids"]), mask


def _one(result) -> Encoded:
    """The one sample of a record (a conversation the template renders as a prefix)."""
    assert isinstance(result, Samples), result
    (encoded,) = result.encoded
    return encoded


def _check(tok, options, conversation, segments) -> Samples:
    """The record's samples, checked: exactly one, whose ids and mask are ``segments``."""
    result = ChatTokenizer(tok, options).encode(conversation)
    encoded = _one(result)
    ids, mask = _expect(tok, segments)
    assert encoded.input_ids.tolist() == ids
    assert encoded.loss_mask.tolist() == mask
    assert encoded.input_ids.dtype == np.int32 and encoded.loss_mask.dtype == np.uint8
    return result


def test_smollm2_chatml_mask_spelled_out(smol):
    encoded = _one(ChatTokenizer(smol, _opts()).encode(
        _conv(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello there"))))
    tokens = smol.convert_ids_to_tokens(encoded.input_ids.tolist())
    supervised = [t for t, m in zip(tokens, encoded.loss_mask) if m]
    # content, end-of-turn token and the newline the template emits after it; no header
    assert supervised == ["Hello", "Ġthere", "<|im_end|>", "Ċ"]
    assert tokens[-8:-4] == ["<|im_start|>", "ass", "istant", "Ċ"]
    assert encoded.loss_mask[-8:-4].tolist() == [0, 0, 0, 0]


def test_smollm2_multi_turn_exact_and_equal_to_apply_chat_template(smol):
    conversation = _conv(("user", "Hi"), ("assistant", "Hello there"), ("user", "Bye"),
                         ("assistant", "Ciao"))
    encoded = _check(smol, _opts(), conversation, [
        (SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hello there<|im_end|>\n", 1),
        ("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Ciao<|im_end|>\n", 1),
    ])
    reference = smol.apply_chat_template(conversation.messages, tokenize=True, return_dict=True)
    assert _one(encoded).input_ids.tolist() == list(reference["input_ids"])


def test_truncated_answer_leaves_its_end_of_turn_unsupervised(smol):
    # An answer cut at max_new_tokens: the <|im_end|> the template appends was never the
    # model's choice, so it is not a label; a complete answer after it keeps its end.
    conversation = Conversation([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there, how", "truncated": True},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Ciao"}], LOC)
    encoded = _check(smol, _opts(), conversation, [
        (SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hello there, how", 1),
        ("<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Ciao<|im_end|>\n", 1),
    ])
    assert encoded.cut_answers == 1
    # The same text without the mark supervises both ends of turn.
    unmarked = Conversation([{k: v for k, v in m.items() if k != "truncated"}
                             for m in conversation.messages], LOC)
    plain = ChatTokenizer(smol, _opts()).encode(unmarked)
    assert _one(plain).input_ids.tolist() == _one(encoded).input_ids.tolist()
    assert int(_one(plain).loss_mask.sum()) == int(_one(encoded).loss_mask.sum()) + 2
    assert plain.cut_answers == 0


def test_last_turn_only_supervises_only_the_last_answer(smol):
    _check(smol, _opts(last_turn_only=True),
           _conv(("user", "Hi"), ("assistant", "Hello"), ("user", "Bye"), ("assistant", "Ciao")), [
        (SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
         "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Ciao<|im_end|>\n", 1),
    ])


def test_leading_assistant_and_trailing_user_turns_are_trimmed(smol):
    messages, trimmed = trim_conversation(_conv(
        ("system", "S"), ("assistant", "orphan"), ("user", "Q"), ("assistant", "A"),
        ("user", "unanswered")).messages)
    assert trimmed == 1
    assert [m["content"] for m in messages] == ["S", "Q", "A"]
    orphan = _conv(("assistant", "orphan"), ("user", "Q"), ("assistant", "A"))
    encoded = _check(smol, _opts(), orphan, [
        (SMOL_SYSTEM + "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n", 0),
        ("A<|im_end|>\n", 1),
    ])
    assert encoded.trimmed_leading == 1


def test_no_assistant_turn_is_dropped(smol):
    result = ChatTokenizer(smol, _opts()).encode(_conv(("user", "Q"), ("user", "again")))
    assert isinstance(result, Dropped) and result.reason == "no_assistant"
    assert "test.jsonl:1" in result.message


@pytest.mark.parametrize("answers", [[""], ["  \n\t"], ["", " "]])
@pytest.mark.parametrize("template", [None, QWEN3_LIKE], ids=["chatml", "qwen3"])
def test_a_conversation_whose_every_answer_is_empty_is_dropped(smol, template, answers):
    tok = smol if template is None else _with_template(smol, template)
    turns = [t for i, answer in enumerate(answers) for t in (("user", f"Q{i}"), ("assistant", answer))]
    result = ChatTokenizer(tok, _opts()).encode(_conv(*turns))
    assert isinstance(result, Dropped) and result.reason == "empty_answer"
    assert result.message.startswith("test.jsonl:1 (record 0): every assistant answer is empty or whitespace")


def test_empty_answers_beside_real_ones_stay_as_context_unsupervised(smol):
    encoded = _check(smol, _opts(), _conv(("user", "Hi"), ("assistant", " "), ("user", "Bye"),
                                          ("assistant", "Ciao")), [
        (SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n <|im_end|>\n"
         "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Ciao<|im_end|>\n", 1),
    ])
    assert encoded.empty_answers == 1
    encoded = _check(smol, _opts(), _conv(("user", "Hi"), ("assistant", "Hello"), ("user", "Bye"),
                                          ("assistant", "")), [
        (SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hello<|im_end|>\n", 1),
        ("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n", 0),
    ])
    assert encoded.empty_answers == 1


def test_last_turn_only_drops_an_empty_last_answer(smol):
    conversation = _conv(("user", "Hi"), ("assistant", "Hello"), ("user", "Bye"), ("assistant", "\n"))
    result = ChatTokenizer(smol, _opts(last_turn_only=True)).encode(conversation)
    assert isinstance(result, Dropped) and result.reason == "empty_answer"
    assert "the last assistant answer (data.last_turn_only) is empty" in result.message
    encoded = ChatTokenizer(smol, _opts(last_turn_only=True)).encode(
        _conv(("user", "Hi"), ("assistant", ""), ("user", "Bye"), ("assistant", "Ciao")))
    assert isinstance(encoded, Samples) and encoded.empty_answers == 0  # earlier turns are context anyway


def test_truncate_drop_and_min_supervised(smol):
    conversation = _conv(("user", "Hi"), ("assistant", "one two three four five six"))
    full = _one(ChatTokenizer(smol, _opts()).encode(conversation))
    n = len(full.input_ids)
    cut = _one(ChatTokenizer(smol, _opts(max_length=n - 3)).encode(conversation))
    assert cut.truncated and cut.input_ids.tolist() == full.input_ids[: n - 3].tolist()
    assert cut.loss_mask.tolist() == full.loss_mask[: n - 3].tolist()
    dropped = ChatTokenizer(smol, _opts(max_length=n - 3, on_too_long="drop")).encode(conversation)
    assert isinstance(dropped, Dropped) and dropped.reason == "too_long"
    supervised = int(full.loss_mask.sum())
    short = ChatTokenizer(smol, _opts(min_supervised_tokens=supervised + 1)).encode(conversation)
    assert isinstance(short, Dropped) and short.reason == "too_short"
    assert isinstance(ChatTokenizer(smol, _opts(min_supervised_tokens=supervised)).encode(
        conversation), Samples)


@pytest.mark.parametrize("answer", [
    " ".join(f"word{i}" for i in range(300)),  # ~3 chars per token: the cut text suffices
    "-" * 2000 + " ok",  # ~60 chars per token: the cut text is too short, re-rendered in full
], ids=["cut", "fallback"])
def test_long_conversations_cut_before_tokenizing_give_identical_samples(smol, answer):
    conversation = _conv(*[t for i in range(6) for t in (("user", f"q{i}"), ("assistant", answer))])
    chat = ChatTokenizer(smol, _opts(max_length=200))
    messages = trim_conversation(conversation.messages)[0]
    full = chat.renderer.render(messages, tools=None, generation_prompt=False, thinking=False)
    assert 6 * 200 <= chat._cut_point(full, 6 * 200) < len(full) / 2  # the first tokenization really is cut
    encoded = _one(chat.encode(conversation))
    reference = _one(ChatTokenizer(smol, _opts(max_length=10**6)).encode(conversation))
    assert encoded.truncated and len(reference.input_ids) > 200
    assert encoded.input_ids.tolist() == reference.input_ids[:200].tolist()
    assert encoded.loss_mask.tolist() == reference.loss_mask[:200].tolist()


def test_pretokenized_passthrough_and_vocab_check(smol):
    chat = ChatTokenizer(smol, _opts())
    ok = _one(chat.encode(Tokenized([1, 2, 3], [0, 1, 1], LOC)))
    assert ok.input_ids.tolist() == [1, 2, 3] and ok.loss_mask.tolist() == [0, 1, 1]
    bad = chat.encode(Tokenized([1, len(smol)], [0, 1], LOC))
    assert isinstance(bad, Dropped) and bad.reason == "malformed"
    assert "outside the tokenizer's vocabulary" in bad.message


def test_tokenizer_without_chat_template_is_a_clear_error(smol):
    tok = _with_template(smol, None)
    chat = ChatTokenizer(tok, _opts())
    with pytest.raises(TemplateError, match=r"test.jsonl:1 \(record 0\): .*no chat template"):
        chat.encode(_conv(("user", "Q"), ("assistant", "A")))
    # pre-tokenized data needs no template
    assert isinstance(_one(chat.encode(Tokenized([1, 2], [0, 1], LOC))), Encoded)


def test_batch_keeps_order_and_mixes_kinds(smol):
    chat = ChatTokenizer(smol, _opts())
    records = [_conv(("user", "a"), ("assistant", "b")), Tokenized([4, 5], [1, 1], LOC),
               _conv(("user", "only")), _conv(("user", "c"), ("assistant", "d"))]
    results = chat.encode_batch(records)
    assert [type(r) for r in results] == [Samples, Samples, Dropped, Samples]
    assert _one(results[0]).input_ids.tolist() == _one(chat.encode(records[0])).input_ids.tolist()
    assert _one(results[3]).input_ids.tolist() == _one(chat.encode(records[3])).input_ids.tolist()


def _samples(tok, options, conversation) -> list[tuple[tuple[int, ...], str, str]]:
    """(turns, context text, supervised text) of every sample of a record."""
    result = ChatTokenizer(tok, options).encode(conversation)
    assert isinstance(result, Samples), result
    out = []
    for encoded in result.encoded:
        ids, mask = encoded.input_ids.tolist(), encoded.loss_mask.tolist()
        first = mask.index(1)
        assert all(mask[first:]), "one supervised run per per-turn sample here"
        out.append((encoded.turns, tok.decode(ids[:first]), tok.decode(ids[first:])))
    return out


@pytest.mark.parametrize("template", [QWEN3_LIKE, QWEN3_MARKED], ids=["plain", "markers"])
def test_qwen3_style_thinking_off_leaves_the_prefilled_think_block_as_context(smol, template):
    tok = _with_template(smol, template)
    assert ChatTokenizer(tok, _opts()).supports_thinking
    _check(tok, _opts(thinking=False), _conv(("user", "Hi"), ("assistant", "Hello")), [
        # the engine's prompt pre-fills the empty think block: the model only produces the answer
        (QWEN3_HEAD + "<think>\n\n</think>\n\n", 0),
        ("Hello<|im_end|>\n", 1),
    ])


def test_qwen3_style_thinking_on_supervises_the_think_block(smol):
    tok = _with_template(smol, QWEN3_LIKE)
    _check(tok, _opts(thinking=True), _conv(("user", "Hi"), ("assistant", "Hello")), [
        (QWEN3_HEAD, 0), ("<think>\n\n</think>\n\nHello<|im_end|>\n", 1)])


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("answer", [
    {"role": "assistant", "content": "<think>\nLet me see.\n</think>\n\nHello"},
    {"role": "assistant", "content": "Hello", "reasoning_content": "Let me see."},
], ids=["inline", "field"])
def test_reasoning_is_rendered_and_supervised_whatever_data_thinking_says(smol, thinking, answer):
    tok = _with_template(smol, QWEN3_LIKE)
    result = _check(tok, _opts(thinking=thinking), Conversation([{"role": "user", "content": "Hi"}, answer], LOC), [
        (QWEN3_HEAD, 0), ("<think>\nLet me see.\n</think>\n\nHello<|im_end|>\n", 1)])
    assert result.reasoning_answers == 1 and result.reasoning_unrendered == 0


@pytest.mark.parametrize("template", [QWEN3_LIKE, QWEN3_MARKED], ids=["plain", "markers"])
def test_qwen3_style_multi_turn_gives_each_turn_its_serving_context(smol, template):
    tok = _with_template(smol, template)
    conversation = Conversation([
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning_content": "R1"},
        {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao"}], LOC)
    history = QWEN3_HEAD + "Hello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    assert _samples(tok, _opts(thinking=False), conversation) == [
        # the whole chat supervises its last turn (history without the think block, as served)
        ((3,), history + "<think>\n\n</think>\n\n", "Ciao<|im_end|>\n"),
        # turn 1 as it was generated: the last turn then, its reasoning rendered
        ((1,), QWEN3_HEAD, "<think>\nR1\n</think>\n\nHello<|im_end|>\n"),
    ]
    result = ChatTokenizer(tok, _opts(thinking=False)).encode(conversation)
    assert result.expansion_tokens == len(result.encoded[1].input_ids) and not result.encoded[1].whole
    assert result.reasoning_answers == 1
    # last_turn_only: one sample, only the last answer
    assert _samples(tok, _opts(last_turn_only=True), conversation) == [
        ((3,), history + "<think>\n\n</think>\n\n", "Ciao<|im_end|>\n")]


def test_a_scaffolded_generation_prompt_falls_back_to_the_common_prefix(smol):
    # QwQ / DeepSeek-R1 distills: the prompt opens the think block, the recorded turn repeats it.
    scaffold = QWEN3_LIKE.replace("{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}",
                                  "{%- endif -%}{{- '<think>\\n' -}}")
    tok = _with_template(smol, scaffold)
    assert _samples(tok, _opts(thinking=True), Conversation([
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning_content": "R"}],
        LOC)) == [((1,), QWEN3_HEAD + "<think>\n", "R\n</think>\n\nHello<|im_end|>\n")]


def test_a_turn_whose_context_alone_is_too_long_is_skipped_not_the_conversation(smol):
    tok = _with_template(smol, QWEN3_LIKE)
    long_question = " ".join(f"w{i}" for i in range(120))
    conversation = _conv(("user", "Hi"), ("assistant", "Hello"), ("user", long_question), ("assistant", "Ciao"),
                         ("user", "x"), ("assistant", "Bye"))
    everything = ChatTokenizer(tok, _opts()).encode(conversation)
    assert [e.turns for e in everything.encoded] == [(5,), (1,), (3,)]
    turn3 = len(everything.encoded[2].input_ids)
    result = ChatTokenizer(tok, _opts(max_length=turn3 - 8)).encode(conversation)
    # turn 3's context fills max_length: skipped; turn 1 fits; the whole chat, cut at max_length,
    # has no supervised token left: dropped as too short and counted
    assert [e.turns for e in result.encoded] == [(1,)] and result.turns_skipped_long == 1
    assert [d.reason for d in result.turn_drops] == ["too_short"]


def test_unrenderable_records_are_dropped_with_their_reason(smol):
    tok = _with_template(smol, QWEN3_LIKE.replace("{%- for m in messages -%}{%- if m.role == 'assistant'",
                                                  "{%- for m in messages -%}{%- if m.role == 'bad' -%}"
                                                  "{{- raise_exception('no bad roles') -}}"
                                                  "{%- elif m.role == 'assistant'"))
    result = ChatTokenizer(tok, _opts()).encode(_conv(("user", "Hi"), ("bad", "x"), ("assistant", "Hello")))
    assert isinstance(result, Dropped) and result.reason == "unrenderable"
    assert "test.jsonl:1 (record 0): the chat template of" in result.message and "no bad roles" in result.message
    shouting = _with_template(smol, SMOL_UPPER)
    cut = Conversation([{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello", "truncated": True}], LOC)
    result = ChatTokenizer(shouting, _opts()).encode(cut)
    assert isinstance(result, Dropped) and result.reason == "unrenderable" and "marked truncated" in result.message


def test_tool_calls_and_developer_role_under_a_template_without_them(smol):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    tools = Conversation([{"role": "user", "content": "Weather?"},
                          {"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}], LOC)
    result = ChatTokenizer(smol, _opts(), template_name="SmolLM2").encode(tools)
    assert isinstance(result, Dropped) and result.reason == "tools_unsupported"
    assert "the chat template of SmolLM2 has no tool rendering" in result.message
    # developer becomes system where the template has no developer role (SmolLM2's ChatML)
    _check(smol, _opts(), _conv(("developer", "Be brief."), ("user", "Hi"), ("assistant", "Hello")), [
        ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hello<|im_end|>\n", 1)])
