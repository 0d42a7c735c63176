"""Response regeneration: both backends on the real SmolLM2, resume after a crash, multi-turn."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_trainer.data.regen_backends import (
    Generation,
    GenerationError,
    OpenAIBackend,
    SamplingParams,
    TransformersBackend,
    read_generation_config,
    resolve_sampling,
)
from dflash_trainer.data.regenerate import (
    ConversationJob,
    RegenerateError,
    failures_path_for,
    recover_output,
    regenerate,
)
from helpers_e2e import JsonHandler, serving

MAX_NEW = 6
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, top_p=1.0, top_k=0)

ORIGINAL = "I refuse to answer; ask me about volcanoes instead."
CONVERSATIONS = [
    ("a.jsonl:1", [{"role": "user", "content": "What is 2+2?"},
                   {"role": "assistant", "content": ORIGINAL}]),
    ("a.jsonl:2", [{"role": "system", "content": "You are terse."},
                   {"role": "user", "content": "Name a color."},
                   {"role": "assistant", "content": ORIGINAL},
                   {"role": "user", "content": "Why that one?"},
                   {"role": "assistant", "content": ORIGINAL}]),
    ("a.jsonl:3", [{"role": "user", "content": "Say hello in French."}]),
]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def smollm2() -> Iterator[tuple[Path, Any, Any]]:
    from transformers import AutoModelForCausalLM

    from dflash_trainer.core.assets import load_tokenizer, resolve_target

    # One intra-op thread: tiny matmuls gain nothing from more, and on the shared 2-core
    # machine spinning OpenMP workers cost several times the work itself.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    path = resolve_target("smollm2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield path, model, load_tokenizer(path)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def local_backend(smollm2: tuple[Path, Any, Any]) -> TransformersBackend:
    _, model, tokenizer = smollm2
    return TransformersBackend(model, tokenizer, GREEDY)


def greedy_answer(backend: TransformersBackend, messages: list[dict[str, str]]) -> str:
    """The target's greedy answer to one prompt, generated alone (no batch)."""
    return backend.generate([backend.encode(messages)])[0].text


# --- pure logic -------------------------------------------------------------------------------

def _answer(text: str, *, truncated: bool = False) -> Generation:
    return Generation(text=text, num_tokens=len(text.split()) + 1, truncated=truncated)


def test_an_answer_cut_at_max_new_tokens_is_marked_truncated() -> None:
    job = ConversationJob("x", CONVERSATIONS[1][1])
    job.answer(_answer("Blue is a calm", truncated=True))
    # The mark is for training; the next prompt is plain chat messages.
    assert job.prompt()[-2] == {"role": "assistant", "content": "Blue is a calm"}
    job.answer(_answer("Calm."))
    answers = [m for m in job.record()["messages"] if m["role"] == "assistant"]
    assert answers == [{"role": "assistant", "content": "Blue is a calm", "truncated": True},
                       {"role": "assistant", "content": "Calm."}]


def test_max_turns_answers_only_the_first_turns() -> None:
    job = ConversationJob("x", CONVERSATIONS[1][1], max_turns=1)
    assert job.dropped_turns == 1
    job.answer(_answer("Blue."))
    assert job.done and [m["role"] for m in job.record()["messages"]] == ["system", "user", "assistant"]
    # A trailing user turn counts as a turn to answer.
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    capped = ConversationJob("t", messages, max_turns=1)
    assert capped.dropped_turns == 1 and capped.prompt() == messages[:1]
    assert ConversationJob("u", messages, max_turns=2).dropped_turns == 0


def test_conversation_job_walks_turns_and_rejects_unanswerable_turns() -> None:
    job = ConversationJob("x", CONVERSATIONS[1][1])
    assert job.prompt() == CONVERSATIONS[1][1][:2]
    job.answer(_answer("Blue."))
    assert job.prompt()[-2:] == [{"role": "assistant", "content": "Blue."},
                                 {"role": "user", "content": "Why that one?"}]
    job.answer(_answer("Calm."))
    assert job.done and job.turns == 2
    assert [m["role"] for m in job.record()["messages"]] == [
        "system", "user", "assistant", "user", "assistant"]
    # A trailing user turn is answered too.
    trailing = ConversationJob("y", CONVERSATIONS[2][1])
    assert not trailing.done
    # An assistant opening answers no prompt: dropped and counted, as prepare does.
    opening = ConversationJob("z", [{"role": "assistant", "content": "hi"},
                                    {"role": "user", "content": "hello"}])
    assert opening.trimmed_leading == 1 and opening.prompt() == [{"role": "user", "content": "hello"}]
    with pytest.raises(GenerationError, match="message 2 does not follow a user turn"):
        ConversationJob("v", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                              {"role": "assistant", "content": "c"}])
    with pytest.raises(GenerationError, match="no user turn"):
        ConversationJob("w", [{"role": "system", "content": "s"}])


def test_resolve_sampling_precedence() -> None:
    gc = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20}
    s = resolve_sampling(gc, max_new_tokens=8, top_p=0.5)
    assert (s.temperature, s.top_p, s.top_k) == (0.6, 0.5, 20)
    assert resolve_sampling({}, max_new_tokens=8).temperature == 1.0
    assert resolve_sampling({"do_sample": False}, max_new_tokens=8).temperature == 0.0
    remote = resolve_sampling(None, max_new_tokens=8, temperature=0.3)
    assert (remote.temperature, remote.top_p, remote.top_k) == (0.3, None, None)
    assert "server default" in remote.describe()


def test_recover_output_cuts_partial_line_and_rejects_foreign_lines(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    good = json.dumps({"id": "a", "messages": []}) + "\n"
    out.write_text(good + '{"id": "b", "messa')
    assert recover_output(out) == {"a"}
    assert out.read_text() == good
    # A complete record whose newline was lost is kept and terminated.
    out.write_text(good + json.dumps({"id": "c", "messages": []}))
    assert recover_output(out) == {"a", "c"}
    assert out.read_text().endswith("\n") and len(read_jsonl(out)) == 2
    out.write_text(good + "not json\n" + good)
    with pytest.raises(RegenerateError, match=r"out.jsonl:2: not a regenerated record"):
        recover_output(out)


# --- in-process backend -----------------------------------------------------------------------

@pytest.mark.slow
def test_transformers_backend_regenerates_every_turn(
        local_backend: TransformersBackend, smollm2: tuple[Path, Any, Any],
        tmp_path: Path) -> None:
    out = tmp_path / "regen.jsonl"
    summary = regenerate(CONVERSATIONS, out, local_backend, batch_size=2, progress=False)
    assert (summary.written, summary.failed, summary.turns) == (3, 0, 4)
    records = {r["id"]: r["messages"] for r in read_jsonl(out)}
    # Answers cut at max_new_tokens (6 tokens here) carry the mark that keeps their end of
    # turn out of the loss.
    marked = sum(bool(m.get("truncated")) for messages in records.values() for m in messages)
    assert marked == summary.truncated_turns > 0
    assert set(records) == {cid for cid, _ in CONVERSATIONS}
    for cid, source in CONVERSATIONS:
        messages = records[cid]
        # User and system turns kept verbatim; every assistant turn is the target's own
        # greedy answer to exactly the messages before it.
        kept = [m for m in messages if m["role"] != "assistant"]
        assert kept == [m for m in source if m["role"] != "assistant"]
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                assert m["content"] and m["content"] != ORIGINAL
                assert m["content"] == greedy_answer(local_backend, messages[:i])
    # Sampling defaults come from the target's generation config (no sampling fields: neutral).
    path, _, _ = smollm2
    assert resolve_sampling(read_generation_config(path), max_new_tokens=4).temperature == 1.0


@pytest.mark.slow
def test_thinking_switch_reaches_the_chat_template(smollm2: tuple[Path, Any, Any]) -> None:
    import copy

    from dflash_trainer.data.regen_backends import template_has_thinking

    _, model, tokenizer = smollm2
    assert not template_has_thinking(tokenizer)
    qwen_like = copy.deepcopy(tokenizer)
    qwen_like.chat_template = tokenizer.chat_template + (
        "{% if add_generation_prompt and not enable_thinking %}{{ '<think></think>' }}"
        "{% endif %}")
    assert template_has_thinking(qwen_like)
    prompt = [{"role": "user", "content": "Hi"}]
    on = TransformersBackend(model, qwen_like, GREEDY, thinking=True).encode(prompt)
    off = TransformersBackend(model, qwen_like, GREEDY, thinking=False).encode(prompt)
    assert qwen_like.decode(off).endswith("<think></think>")
    assert off[:len(on)] == on and len(off) > len(on)


@pytest.mark.slow
def test_multi_turn_conditions_on_regenerated_answers(
        local_backend: TransformersBackend, tmp_path: Path) -> None:
    cid, source = CONVERSATIONS[1]
    regenerate([(cid, source)], tmp_path / "o.jsonl", local_backend, progress=False)
    messages = read_jsonl(tmp_path / "o.jsonl")[0]["messages"]
    first, second = messages[2]["content"], messages[4]["content"]
    with_new = [*source[:2], {"role": "assistant", "content": first}, source[3]]
    with_original = source[:4]
    assert second == greedy_answer(local_backend, with_new)
    assert second != greedy_answer(local_backend, with_original)


@pytest.mark.slow
def test_resume_after_crash_writes_each_conversation_once(
        local_backend: TransformersBackend, tmp_path: Path) -> None:
    out = tmp_path / "regen.jsonl"
    first = regenerate(CONVERSATIONS, out, local_backend, limit=2, progress=False)
    assert (first.written, first.skipped_existing) == (2, 0)
    # A crash in the middle of a write leaves a partial trailing line.
    with out.open("a") as f:
        f.write('{"id": "a.jsonl:3", "messages": [{"role": "us')
    second = regenerate(CONVERSATIONS, out, local_backend, progress=False)
    assert (second.written, second.skipped_existing, second.failed) == (1, 2, 0)
    ids = [r["id"] for r in read_jsonl(out)]
    assert sorted(ids) == sorted(cid for cid, _ in CONVERSATIONS)
    third = regenerate(CONVERSATIONS, out, local_backend, progress=False)
    assert (third.written, third.skipped_existing) == (0, 3)
    assert len(read_jsonl(out)) == 3


@pytest.mark.slow
def test_failures_are_listed_and_retried(local_backend: TransformersBackend,
                                         tmp_path: Path) -> None:
    out = tmp_path / "regen.jsonl"
    too_long = ("long:1", [{"role": "user", "content": "word " * 9000}])
    unanswerable = ("bad:1", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
                              {"role": "assistant", "content": "b"}])
    summary = regenerate([CONVERSATIONS[0], too_long, unanswerable], out, local_backend,
                         progress=False)
    assert (summary.written, summary.failed) == (1, 2)
    failures = {r["id"]: r["error"] for r in read_jsonl(failures_path_for(out))}
    assert set(failures) == {"long:1", "bad:1"}
    assert "exceeds the target's context" in failures["long:1"]
    assert "does not follow a user turn" in failures["bad:1"]
    # A rerun retries the failed conversations only; the failures file lists this run's.
    rerun = regenerate([CONVERSATIONS[0], too_long, unanswerable], out, local_backend,
                       progress=False)
    assert (rerun.written, rerun.skipped_existing, rerun.failed) == (0, 1, 2)
    assert len(read_jsonl(failures_path_for(out))) == 2
    with pytest.raises(RegenerateError, match="2 conversations failed in a row"):
        regenerate([too_long, unanswerable], tmp_path / "o2.jsonl", local_backend,
                   progress=False, max_consecutive_failures=2)


# --- OpenAI-compatible server backend ---------------------------------------------------------

class ChatServer(ThreadingHTTPServer):
    """A minimal OpenAI-compatible server that really generates with SmolLM2."""

    daemon_threads = True

    def __init__(self, model: Any, tokenizer: Any, generation_config: dict[str, Any]) -> None:
        super().__init__(("127.0.0.1", 0), ChatHandler)
        self.model = model
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        self.fail_next = 0
        """Answer this many chat requests with HTTP 503 (an overloaded server)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class ChatHandler(JsonHandler):
    server: ChatServer

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self.reply(status=200, body={"object": "list", "data": [{"id": "smollm2", "object": "model"}]})
        else:
            self.reply(status=404, body={"error": "not found"})

    def do_POST(self) -> None:
        if self.path != "/v1/chat/completions":
            self.reply(status=404, body={"error": "not found"})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        with srv.lock:
            if srv.fail_next > 0:
                srv.fail_next -= 1
                self.reply(status=503, body={"error": "overloaded"})
                return
            srv.requests.append(body)
        tok = srv.tokenizer
        kwargs = body.get("chat_template_kwargs") or {}
        text = tok.apply_chat_template(body["messages"], tokenize=False,
                                       add_generation_prompt=True, **kwargs)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        max_tokens = body["max_tokens"]
        if ids.shape[1] + max_tokens > srv.model.config.max_position_embeddings:
            self.reply(status=400, body={"error": {"message": "prompt too long for the context"}})
            return
        # Omitted sampling fields fall back to the model's generation config, as vLLM does.
        gc = resolve_sampling(srv.generation_config, max_new_tokens=max_tokens,
                              temperature=body.get("temperature"), top_p=body.get("top_p"),
                              top_k=max(0, body["top_k"]) if "top_k" in body else None)
        sample = {"do_sample": False} if gc.temperature == 0 else {
            "do_sample": True, "temperature": gc.temperature, "top_p": gc.top_p, "top_k": gc.top_k}
        with srv.lock, torch.inference_mode():
            out = srv.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=max_tokens, pad_token_id=tok.eos_token_id,
                                     **sample)
        new = out[0, ids.shape[1]:].tolist()
        stopped = tok.eos_token_id in new
        answer = new[:new.index(tok.eos_token_id)] if stopped else new
        self.reply(status=200, body={
            "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop" if stopped else "length",
                         "message": {"role": "assistant",
                                     "content": tok.decode(answer, skip_special_tokens=True)}}],
            "usage": {"prompt_tokens": ids.shape[1], "completion_tokens": len(new)}})


@pytest.fixture()
def chat_server(smollm2: tuple[Path, Any, Any]):
    path, model, tokenizer = smollm2
    with serving(ChatServer(model, tokenizer, read_generation_config(path)), join_timeout=10) as server:
        yield server


@pytest.mark.slow
def test_openai_backend_against_a_real_local_server(
        chat_server: ChatServer, local_backend: TransformersBackend, tmp_path: Path) -> None:
    chat_server.fail_next = 2  # the first requests meet an overloaded server and are retried
    backend = OpenAIBackend(chat_server.url, GREEDY, backoff_s=0.01, max_connections=2)
    assert backend.model == "smollm2"
    out = tmp_path / "regen.jsonl"
    too_long = ("long:1", [{"role": "user", "content": "word " * 9000}])
    try:
        summary = regenerate([*CONVERSATIONS, too_long], out, backend, concurrency=2,
                             progress=False)
    finally:
        backend.close()
    assert (summary.written, summary.failed, summary.turns) == (3, 1, 4)
    assert "HTTP 400" in read_jsonl(failures_path_for(out))[0]["error"]
    records = {r["id"]: r["messages"] for r in read_jsonl(out)}
    for cid, source in CONVERSATIONS:
        messages = records[cid]
        assert [m for m in messages if m["role"] != "assistant"] == \
            [m for m in source if m["role"] != "assistant"]
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                # The server generated it (same model, greedy): identical to a local answer.
                assert m["content"] == greedy_answer(local_backend, messages[:i])
    # Turn 2 was requested with turn 1's regenerated answer in context, not the original.
    multi = records["a.jsonl:2"]
    turn2 = [r for r in chat_server.requests if len(r["messages"]) == 4]
    # (the server gets plain chat messages: the truncated mark of a cut answer stays in the file)
    assert multi[2].get("truncated") == (summary.truncated_turns > 0)
    assert [r["messages"] for r in turn2] == [[{"role": m["role"], "content": m["content"]}
                                               for m in multi[:4]]]
    assert all(r["chat_template_kwargs"] == {"enable_thinking": False} and r["top_k"] == -1
               and r["temperature"] == 0.0 and r["max_tokens"] == MAX_NEW
               for r in chat_server.requests)


def test_openai_backend_gives_up_after_retries() -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler) as probe:
        port = probe.server_address[1]  # closed once the block ends: connections are refused
    with pytest.raises(GenerationError, match="failed after 3 attempts.*ConnectError"):
        OpenAIBackend(f"http://127.0.0.1:{port}/v1", GREEDY, max_retries=2, backoff_s=0.01)


# --- command line -----------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_writes_messages_jsonl_that_prepare_reads(
        smollm2: tuple[Path, Any, Any], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from dflash_trainer.cli.main import main as cli_main
    from dflash_trainer.data.formats import Conversation, expand_paths, read_records

    data = tmp_path / "chats.jsonl"
    lines = [
        {"messages": CONVERSATIONS[0][1]},
        {"conversations": [{"from": "human", "value": "Count to three."},
                           {"from": "gpt", "value": ORIGINAL}]},
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
        {"messages": "not a list"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "out" / "regen.jsonl"
    argv = ["regenerate", "--data", str(data), "--out", str(out), "--max-new-tokens", "4",
            "--temperature", "0", "data.on_error=skip"]
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    assert "temperature=0 top_p=1 top_k=off max_new_tokens=4" in err
    assert "regenerate: 2/2 (100.0%)" in err and "ETA" in err
    assert "written 2, skipped (already in output) 0, failed 0, rejected input 2" in err
    assert (out.parent / "regen.config.yaml").is_file()
    rejected = {r["id"]: r["error"] for r in read_jsonl(failures_path_for(out))}
    assert set(rejected) == {f"{data}:3", f"{data}:4"}
    assert "pre-tokenized" in rejected[f"{data}:3"] and "malformed" in rejected[f"{data}:4"]
    # The output is OpenAI messages JSONL that the data reader takes as it is.
    records = list(read_records(expand_paths([str(out)]), on_error="raise"))
    assert all(isinstance(r, Conversation) for r in records) and len(records) == 2
    assert {r["id"] for r in read_jsonl(out)} == {f"{data}:1", f"{data}:2"}
    users = sorted(r.messages[0]["content"] for r in records)
    assert users == ["Count to three.", "What is 2+2?"]
    assert all(r.messages[1]["content"] != ORIGINAL for r in records)
    # Rerun: everything is already there.
    assert cli_main(argv) == 0
    assert "written 0, skipped (already in output) 2" in capsys.readouterr().err
    # Usage errors are reported, not raised.
    assert cli_main(["regenerate", "--out", str(out), "--backend", "openai"]) == 2
    assert "--server-url" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_openai_backend(chat_server: ChatServer, tmp_path: Path) -> None:
    from dflash_trainer.cli.main import main as cli_main

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for _, m in CONVERSATIONS))
    out = tmp_path / "regen.jsonl"
    argv = ["regenerate", "--backend", "openai", "--server-url", chat_server.url, "--data",
            str(data), "--out", str(out), "--max-new-tokens", "4", "--limit", "2",
            "--concurrency", "2"]
    assert cli_main(argv) == 0
    assert {r["id"] for r in read_jsonl(out)} == {f"{data}:1", f"{data}:2"}
    # No sampling flags: the request leaves them to the server (its generation config).
    assert all("temperature" not in r and "top_p" not in r and "top_k" not in r
               and r["model"] == "smollm2" for r in chat_server.requests)


@pytest.mark.slow
def test_regenerate_with_max_turns_counts_the_dropped_turns(local_backend: TransformersBackend,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "first-turns.jsonl"
    summary = regenerate(CONVERSATIONS, out, local_backend, max_turns=1, progress=False)
    assert (summary.written, summary.turns, summary.dropped_turns) == (3, 3, 1)
    assert "1 turns past --max-turns" in summary.describe()
    for record in read_jsonl(out):
        assert [m["role"] for m in record["messages"]].count("assistant") == 1
