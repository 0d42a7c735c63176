"""``dflash-trainer regenerate``: answer the data's prompts again with the target model.

A drafter learns to predict the target, so it trains best on text the target itself wrote.
For every conversation the system prompt and user turns are kept and each assistant turn is
generated anew, turn by turn, each conditioned on the regenerated answers before it. The output
is OpenAI ``messages`` JSONL, one ``{"id", "messages"}`` line per conversation, which
``prepare`` and ``train`` read directly.

The output is resumable: each record is one complete line, appended and fsynced on its own, so
a crash loses only the conversations in flight; a rerun skips ids already written and cuts off a
partial trailing line. Failed conversations go to ``<out>.failures.jsonl`` with their error and
are retried by the next run. An empty answer fails its conversation (unless ``allow_empty``), and
a progress line is printed at least every 10 s, also while nothing completes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from dflash_trainer.config import save_config
from dflash_trainer.data.formats import (
    TRUNCATED,
    Conversation,
    Rejected,
    drop_leading_assistant,
    expand_paths,
    read_records,
)
from dflash_trainer.data.regen_backends import (
    Generation,
    GenerationError,
    Message,
    OpenAIBackend,
    TransformersBackend,
    check_answer,
    read_generation_config,
    resolve_sampling,
    template_has_thinking,
)
from dflash_trainer.core.errors import ConfigError, ServerError, UserError

SourceConversation = tuple[str, Sequence[Message]]
"""(stable id, messages) of one input conversation."""


@dataclass(frozen=True)
class RejectedInput:
    """An input record that cannot be regenerated (malformed, empty, pre-tokenized)."""

    id: str
    reason: str


class RegenerateError(UserError, RuntimeError):
    """A user-facing error that stops the run (bad output file, too many failures)."""

    kind = "regenerate error"


class ConversationJob:
    """One conversation being regenerated: the prompt of its next turn and its output so far.

    System and user messages are copied; every assistant turn is replaced by a generated
    answer, and a conversation that ends on a user turn gets one more answer. Assistant
    messages before the first user turn are dropped (``trimmed_leading``); any other assistant
    turn that does not directly follow a user turn is an error (checked up front): there is no
    prompt the target could have answered. ``max_turns`` answers only the first N turns.
    """

    def __init__(self, conversation_id: str, messages: Sequence[Message], *,
                 max_turns: int | None = None) -> None:
        self.id = conversation_id
        source = list(messages)
        first_user = next((i for i, m in enumerate(source) if m["role"] == "user"), None)
        if first_user is None:
            raise GenerationError("conversation has no user turn")
        # As in prepare: an assistant opening (a greeting before any user turn) answers no
        # prompt, so it is dropped (and counted) rather than failing the conversation.
        source, self.trimmed_leading = drop_leading_assistant(source)
        for i, message in enumerate(source):
            if message["role"] == "assistant" and source[i - 1]["role"] != "user":
                raise GenerationError(f"assistant turn at message {i} does not follow a user "
                                      f"turn; there is no prompt to answer")
        self.dropped_turns = 0
        """Assistant turns past ``max_turns`` (with the messages after them) not regenerated."""
        if max_turns is not None:
            answers = [i for i, m in enumerate(source) if m["role"] == "assistant"]
            total = len(answers) + (source[-1]["role"] == "user")  # a trailing user turn is answered too
            if total > max_turns:
                self.dropped_turns = total - max_turns
                source = source[:answers[max_turns]] if len(answers) > max_turns else source
                # The kept part ends on an answered turn, not on the next user message.
                while source[-1]["role"] != "assistant":
                    source.pop()
        self._source = source
        self._next = 0
        self.messages: list[dict[str, Any]] = []
        self.pending = False
        self.turns = 0
        self.prompt_ids: list[int] | None = None
        """The encoded prompt, kept by the batched scheduler."""
        self._advance()

    @property
    def done(self) -> bool:
        """Every turn has been answered."""
        return not self.pending

    def prompt(self) -> list[Message]:
        """The messages the next answer is conditioned on (without the ``truncated`` marks,
        which are this tool's, not the chat format's)."""
        assert self.pending, "prompt() of a finished conversation"
        return [{"role": m["role"], "content": m["content"]} for m in self.messages]

    def answer(self, generation: Generation) -> None:
        """Record the generated answer of the pending turn and move to the next one; an answer
        cut at ``max_new_tokens`` is marked ``"truncated": true`` so that training does not
        supervise the end-of-turn token the chat template appends to it."""
        assert self.pending, "answer() of a finished conversation"
        message: dict[str, Any] = {"role": "assistant", "content": generation.text}
        if generation.truncated:
            message[TRUNCATED] = True
        self.messages.append(message)
        self.pending = False
        self.turns += 1
        self.prompt_ids = None
        self._advance()

    def record(self) -> dict[str, Any]:
        """The output line of a finished conversation."""
        assert self.done
        return {"id": self.id, "messages": self.messages}

    def _advance(self) -> None:
        while self._next < len(self._source):
            message = self._source[self._next]
            self._next += 1
            if message["role"] != "assistant":
                self.messages.append({"role": message["role"], "content": message["content"]})
                continue
            self.pending = True
            return
        self.pending = bool(self.messages) and self.messages[-1]["role"] == "user"


def failures_path_for(out: str | Path) -> Path:
    """Where the failures of a run writing ``out`` are listed: ``<stem>.failures.jsonl``."""
    out = Path(out)
    return out.with_name(out.stem + ".failures.jsonl")


def recover_output(path: str | Path) -> set[str]:
    """Ids already in an output file; cut off a partial trailing line a crash left behind.

    A complete line that is not a record with an ``id`` is an error (the file is not ours or
    was edited); a trailing line without its newline is dropped unless it is a complete record.
    """
    path = Path(path)
    if not path.exists():
        return set()
    ids: set[str] = set()
    keep = 0
    unterminated = False
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                record = json.loads(line)
                ok = isinstance(record, dict) and isinstance(record.get("id"), str)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                ok = False
            complete = line.endswith(b"\n")
            if not ok:
                if complete:
                    raise RegenerateError(
                        f"{path}:{lineno}: not a regenerated record ({line[:80]!r}); "
                        f"fix or remove the line, or choose another --out")
                break
            ids.add(record["id"])
            keep += len(line)
            unterminated = not complete
        size = f.seek(0, os.SEEK_END)
    if keep < size or unterminated:
        with path.open("r+b") as f:
            f.truncate(keep)
            if unterminated:
                # The last record is complete; only its newline was lost.
                f.seek(keep)
                f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
    return ids


class JsonlAppender:
    """Appends one JSON record per line; each line is flushed and fsynced before returning."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab")

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one complete line, durable on return."""
        self._file.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._file.close()


class ProgressReporter:
    """Conversations done of total, with rate and ETA: a rich bar on a TTY, else plain lines,
    at least every ``every_s`` seconds (a heartbeat thread prints while nothing completes)."""

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool = True,
                 every_s: float = 10.0) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.total = total
        self.done = 0
        self.tokens = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.every_s = every_s
        self.start = time.monotonic()
        self._last_print = self.start
        self._rich: Any = None
        if enabled and self.stream.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            self._rich = Progress(
                TextColumn("regenerate"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
                TimeRemainingColumn(), console=Console(file=self.stream))
            self._task = self._rich.add_task("regenerate", total=total, rate="")
            self._rich.start()
        elif enabled:
            self._heartbeat = threading.Thread(target=self._beat, name="regenerate-progress",
                                               daemon=True)
            self._heartbeat.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s / 4):
            self._print(force=False)

    def _print(self, *, force: bool) -> None:
        with self._lock:
            now = time.monotonic()
            if not force and now - self._last_print < self.every_s:
                return
            self._last_print = now
            elapsed = max(now - self.start, 1e-9)
            rate = f"{self.done / elapsed:.2f} conv/s {self.tokens / elapsed:.0f} tok/s"
            left = (self.total - self.done) * elapsed / self.done if self.done else 0.0
            pct = 100.0 * self.done / self.total if self.total else 100.0
            eta = _hms(left) if self.done else "unknown (nothing finished yet)"
            print(f"regenerate: {self.done}/{self.total} ({pct:.1f}%) {rate} "
                  f"elapsed {_hms(elapsed)} ETA {eta}", file=self.stream, flush=True)

    def update(self, *, conversations: int = 1, tokens: int = 0) -> None:
        """Count finished conversations (written or failed) and generated tokens."""
        self.done += conversations
        self.tokens += tokens
        if not self.enabled:
            return
        if self._rich is not None:
            elapsed = max(time.monotonic() - self.start, 1e-9)
            rate = f"{self.done / elapsed:.2f} conv/s {self.tokens / elapsed:.0f} tok/s"
            self._rich.update(self._task, completed=self.done, rate=rate)
            return
        self._print(force=self.done == self.total and conversations > 0)

    def close(self) -> None:
        """Stop the heartbeat and the live bar (idempotent)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5.0)
            self._heartbeat = None
        if self._rich is not None:
            self._rich.stop()
            self._rich = None


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


@dataclass(kw_only=True)
class RegenerateSummary:
    """What a run did."""

    written: int = 0
    skipped_existing: int = 0
    failed: int = 0
    rejected_input: int = 0
    """Input records that cannot be regenerated (malformed, empty, pre-tokenized, duplicate)."""
    turns: int = 0
    trimmed_leading: int = 0
    """Assistant messages before the first user turn, dropped (they answer no prompt)."""
    dropped_turns: int = 0
    """Assistant turns past ``max_turns``, dropped with the messages after them."""
    truncated_turns: int = 0
    """Answers cut off at ``max_new_tokens`` (written, but worth a larger limit)."""
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    out: str = ""
    failures_path: str | None = None
    """The failures file, when there were failures."""
    causes: dict[str, int] = field(default_factory=dict)
    """Failed conversations per cause (``HTTP 500``, ``timeout``, ... see ``GenerationError``)."""
    first_failure: str | None = None
    """The first failed conversation: its id, cause and error."""
    interrupted: bool = False
    """Stopped by Ctrl-C; the conversations in flight were not written."""

    def describe(self) -> str:
        """The final summary lines."""
        lines = [f"regenerate: written {self.written}, skipped (already in output) "
                 f"{self.skipped_existing}, failed {self.failed}, rejected input "
                 f"{self.rejected_input} -> {self.out}",
                 f"  {self.turns} turns ({self.truncated_turns} cut at max_new_tokens), "
                 f"{self.generated_tokens} tokens in {_hms(self.elapsed_s)}"]
        if self.trimmed_leading or self.dropped_turns:
            lines.append(f"  dropped: {self.trimmed_leading} assistant messages before the first user "
                         f"turn, {self.dropped_turns} turns past --max-turns")
        if self.causes:
            counts = ", ".join(f"{cause} {n}" for cause, n in sorted(self.causes.items(), key=lambda c: (-c[1], c[0])))
            lines.append(f"  failed by cause: {counts}")
            lines.append(f"  first failure: {self.first_failure}")
        if self.failures_path:
            lines.append(f"  failures listed in {self.failures_path}; rerun to retry them")
        if self.interrupted:
            lines.append("  interrupted: rerun the same command to resume")
        return "\n".join(lines)


class _Run:
    """Output, failures file, counters and progress shared by both schedulers."""

    def __init__(self, out: Path, total: int, summary: RegenerateSummary, *, progress: bool,
                 max_consecutive_failures: int, max_turns: int | None = None,
                 allow_empty: bool = False, progress_every_s: float = 10.0) -> None:
        self.max_turns = max_turns
        self.allow_empty = allow_empty
        self.writer = JsonlAppender(out)
        self.failures_path = failures_path_for(out)
        self.failures: JsonlAppender | None = None
        self.summary = summary
        self.progress = ProgressReporter(total, enabled=progress, every_s=progress_every_s)
        self.max_consecutive_failures = max_consecutive_failures
        self.consecutive_failures = 0

    def count_turn(self, generation: Generation) -> None:
        self.summary.turns += 1
        self.summary.truncated_turns += int(generation.truncated)
        self.summary.generated_tokens += generation.num_tokens
        self.progress.update(conversations=0, tokens=generation.num_tokens)

    def finished(self, job: ConversationJob) -> None:
        self.writer.write(job.record())
        self.summary.written += 1
        self.consecutive_failures = 0
        self.progress.update()

    def rejected(self, item: RejectedInput) -> None:
        self._list_failure({"id": item.id, "cause": "input", "error": f"input: {item.reason}"})
        self.summary.rejected_input += 1

    def failed(self, conversation_id: str, exc: BaseException) -> None:
        cause = exc.cause if isinstance(exc, GenerationError) else f"bug ({type(exc).__name__})"
        record: dict[str, Any] = {"id": conversation_id, "cause": cause, "error": f"{type(exc).__name__}: {exc}"}
        if not isinstance(exc, GenerationError):
            # Not an expected generation failure: keep the traceback for the bug report.
            record["traceback"] = "".join(traceback.format_exception(exc))
        self._list_failure(record)
        self.summary.failed += 1
        self.summary.causes[cause] = self.summary.causes.get(cause, 0) + 1
        if self.summary.first_failure is None:
            # One line: a server's error page spans many.
            self.summary.first_failure = " ".join(f"{conversation_id}: {cause}: {exc}".split())[:400]
        self.consecutive_failures += 1
        self.progress.update()
        if self.consecutive_failures >= self.max_consecutive_failures:
            raise RegenerateError(
                f"{self.consecutive_failures} conversations failed in a row ({cause}); last error: "
                f"{record['error']} (all listed in {self.failures_path})")

    def _list_failure(self, record: dict[str, Any]) -> None:
        if self.failures is None:
            self.failures = JsonlAppender(self.failures_path)
            self.summary.failures_path = str(self.failures_path)
        self.failures.write(record)

    def close(self) -> None:
        self.progress.close()
        self.writer.close()
        if self.failures is not None:
            self.failures.close()


def _start(run: _Run, conversation: SourceConversation) -> ConversationJob | None:
    conversation_id, messages = conversation
    try:
        job = ConversationJob(conversation_id, messages, max_turns=run.max_turns)
    except GenerationError as exc:
        run.failed(conversation_id, exc)
        return None
    run.summary.trimmed_leading += job.trimmed_leading
    run.summary.dropped_turns += job.dropped_turns
    return job


def _run_batched(backend: TransformersBackend, conversations: Iterator[SourceConversation],
                 run: _Run, batch_size: int) -> None:
    """Keep a pool of pending turns; generate them in batches of similar prompt length.

    The batch is the length-sorted slice that holds the oldest pending turn, so long prompts
    are not starved while short ones keep arriving.
    """
    pool: list[ConversationJob] = []
    capacity = 4 * batch_size

    def enqueue(job: ConversationJob) -> None:
        try:
            job.prompt_ids = backend.encode(job.prompt())
        except GenerationError as exc:
            run.failed(job.id, exc)
            return
        pool.append(job)

    exhausted = False
    while True:
        while not exhausted and len(pool) < capacity:
            conversation = next(conversations, None)
            if conversation is None:
                exhausted = True
            elif (job := _start(run, conversation)) is not None:
                enqueue(job)
        if not pool:
            return
        oldest = pool[0]
        ordered = sorted(pool, key=lambda j: len(j.prompt_ids or ()))
        at = ordered.index(oldest) // batch_size * batch_size
        batch = ordered[at:at + batch_size]
        taken = {id(j) for j in batch}
        pool = [j for j in pool if id(j) not in taken]
        try:
            generations = backend.generate([j.prompt_ids or [] for j in batch])
        except Exception as exc:  # noqa: BLE001 - counted per conversation, run continues
            for job in batch:
                run.failed(job.id, exc)
            continue
        assert len(generations) == len(batch)
        for job, generation in zip(batch, generations):
            run.count_turn(generation)
            try:
                check_answer(generation, allow_empty=run.allow_empty)
            except GenerationError as exc:
                run.failed(job.id, exc)
                continue
            job.answer(generation)
            if job.done:
                run.finished(job)
            else:
                enqueue(job)


def _answer_all(backend: OpenAIBackend, job: ConversationJob, stop: threading.Event,
                allow_empty: bool) -> list[Generation]:
    generations = []
    while not job.done:
        if stop.is_set():
            raise GenerationError("stopped", cause="stopped")
        generation = check_answer(backend.chat(job.prompt()), allow_empty=allow_empty)
        generations.append(generation)
        job.answer(generation)
    return generations


_Outcome = tuple[ConversationJob, list[Generation], BaseException | None]


def _worker(backend: OpenAIBackend, inbox: queue.Queue[ConversationJob],
            outbox: queue.Queue[_Outcome], stop: threading.Event, allow_empty: bool) -> None:
    while not stop.is_set():
        try:
            job = inbox.get(timeout=0.2)
        except queue.Empty:
            continue
        try:
            outbox.put((job, _answer_all(backend, job, stop, allow_empty), None))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the main thread
            outbox.put((job, [], exc))


def _run_concurrent(backend: OpenAIBackend, conversations: Iterator[SourceConversation],
                    run: _Run, concurrency: int) -> None:
    """At most ``concurrency`` conversations in flight, each answered turn by turn in a worker
    thread; only this thread writes output.

    The workers are daemon threads: on Ctrl-C the main thread returns at once and requests
    still waiting for the server are abandoned rather than awaited.
    """
    # in_flight <= concurrency bounds both queues, so no put() below can block.
    inbox: queue.Queue[ConversationJob] = queue.Queue(maxsize=concurrency)
    outbox: queue.Queue[_Outcome] = queue.Queue(maxsize=concurrency)
    stop = threading.Event()
    workers = [threading.Thread(target=_worker,
                                args=(backend, inbox, outbox, stop, run.allow_empty),
                                name=f"regenerate-{i}", daemon=True) for i in range(concurrency)]
    for worker in workers:
        worker.start()
    in_flight = 0
    exhausted = False
    try:
        while True:
            while not exhausted and in_flight < concurrency:
                conversation = next(conversations, None)
                if conversation is None:
                    exhausted = True
                elif (job := _start(run, conversation)) is not None:
                    inbox.put(job)
                    in_flight += 1
            if not in_flight:
                break
            try:
                job, generations, exc = outbox.get(timeout=1.0)
            except queue.Empty:
                continue
            in_flight -= 1
            if exc is not None:
                run.failed(job.id, exc)
                continue
            for generation in generations:
                run.count_turn(generation)
            run.finished(job)
    except BaseException:
        # Error or Ctrl-C: end the retry waits; abandon requests in flight.
        stop.set()
        backend.close()
        raise
    stop.set()
    for worker in workers:
        worker.join(timeout=5.0)


def regenerate(conversations: Iterable[SourceConversation | RejectedInput], out: str | Path,
               backend: TransformersBackend | OpenAIBackend, *, batch_size: int = 8,
               concurrency: int = 8, limit: int | None = None, max_turns: int | None = None,
               progress: bool = True, max_consecutive_failures: int = 32,
               allow_empty: bool = False, progress_every_s: float = 10.0) -> RegenerateSummary:
    """Regenerate the assistant turns of ``conversations`` into the JSONL file ``out``.

    Ctrl-C stops the run cleanly: the summary comes back with ``interrupted`` set.

    ``limit`` keeps the first N input records (written and rejected ones included), so a rerun
    with the same arguments is a no-op. Ids already in ``out`` are skipped. Failed
    conversations and rejected input records are listed in :func:`failures_path_for` ``(out)``,
    which each run rewrites. Stops with :class:`RegenerateError` after
    ``max_consecutive_failures`` generation failures in a row. ``max_turns`` regenerates only
    the first N assistant turns of each conversation (first turns are most of the tokens a
    drafter trains on per generated token; later turns re-encode the whole history). An empty
    answer fails its conversation unless ``allow_empty``. With ``progress``, a line is printed
    at least every ``progress_every_s`` seconds.
    """
    start = time.monotonic()
    out = Path(out)
    existing = recover_output(out)
    failures = failures_path_for(out)
    if failures.exists():
        failures.unlink()
    summary = RegenerateSummary(out=str(out))
    todo: list[SourceConversation] = []
    rejected: list[RejectedInput] = []
    seen: set[str] = set()
    for index, item in enumerate(conversations):
        if limit is not None and index >= limit:
            break
        if isinstance(item, RejectedInput):
            rejected.append(item)
        elif item[0] in seen:
            rejected.append(RejectedInput(item[0], "duplicate id in the input; only its first "
                                                   "record is regenerated"))
        elif item[0] in existing:
            seen.add(item[0])
            summary.skipped_existing += 1
        else:
            seen.add(item[0])
            todo.append(item)
    run = _Run(out, len(todo), summary, progress=progress,
               max_consecutive_failures=max_consecutive_failures, max_turns=max_turns,
               allow_empty=allow_empty, progress_every_s=progress_every_s)
    try:
        for item in rejected:
            run.rejected(item)
        if isinstance(backend, TransformersBackend):
            _run_batched(backend, iter(todo), run, batch_size)
        else:
            _run_concurrent(backend, iter(todo), run, concurrency)
    except KeyboardInterrupt:
        # Everything written so far is complete and durable; a rerun resumes from it.
        summary.interrupted = True
    finally:
        summary.elapsed_s = time.monotonic() - start
        run.close()
    return summary


def build_transformers_backend(target: str, sampling_flags: dict[str, Any], *,
                               max_new_tokens: int, thinking: bool, device: str = "auto",
                               dtype: str = "auto") -> TransformersBackend:
    """Load the target (``smollm2``, a folder or a hub-cached id) for in-process generation."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_trainer.core.assets import load_tokenizer, resolve_target

    path = resolve_target(target)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.to(device).eval()
    tokenizer = load_tokenizer(path)
    _warn_if_no_thinking(tokenizer, thinking)
    sampling = resolve_sampling(read_generation_config(path), max_new_tokens=max_new_tokens,
                                **sampling_flags)
    return TransformersBackend(model, tokenizer, sampling, thinking=thinking)


def _warn_if_no_thinking(tokenizer: Any, thinking: bool) -> None:
    if thinking and not template_has_thinking(tokenizer):
        print("regenerate: warning: data.thinking=true has no effect, the target's chat "
              "template has no enable_thinking switch", file=sys.stderr)


def main(cfg: Any, args: argparse.Namespace) -> int:
    """CLI handler: 0 when every conversation was written, 1 when some failed, 130 when
    interrupted; usage (2) and data/server (1) errors are raised as user errors. ``cli.main``
    has checked each flag against its declared range (``cli.COMMANDS``)."""
    if args.backend == "openai" and not args.server_url:
        raise ConfigError("--backend openai needs --server-url (e.g. http://127.0.0.1:8000)")
    flags = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    backend: TransformersBackend | OpenAIBackend | None = None
    try:
        # Read (and check) the input before loading the target: data errors come quickly.
        conversations = list(itertools.islice(read_conversations(cfg), args.limit))
        if args.backend == "transformers":
            import torch

            torch.manual_seed(cfg.training.seed)
            if cfg.pipeline.num_threads is not None:
                torch.set_num_threads(cfg.pipeline.num_threads)
            backend = build_transformers_backend(
                cfg.model.target, flags, max_new_tokens=args.max_new_tokens,
                thinking=cfg.data.thinking, device=cfg.pipeline.device, dtype=cfg.model.dtype)
        else:
            sampling = resolve_sampling(None, max_new_tokens=args.max_new_tokens, **flags)
            backend = OpenAIBackend(
                args.server_url, sampling, model_hint=cfg.model.target,
                thinking=cfg.data.thinking, api_key=os.environ.get("OPENAI_API_KEY"),
                max_connections=args.concurrency, timeout_s=args.request_timeout)
        print(f"regenerate: {args.backend} backend, {backend.sampling.describe()}, "
              f"thinking={'on' if cfg.data.thinking else 'off'}", file=sys.stderr)
        out = Path(args.out)
        save_config(cfg, out.parent, name=f"{out.stem}.config.yaml")
        summary = regenerate(conversations, args.out, backend, batch_size=args.batch_size,
                             concurrency=args.concurrency, limit=args.limit,
                             max_turns=args.max_turns, allow_empty=args.allow_empty)
    except GenerationError as exc:
        # Raised here only before any conversation started (the server or the target).
        raise ServerError(f"{exc}; check --server-url and that the server is up") from exc
    finally:
        if isinstance(backend, OpenAIBackend):
            backend.close()
    print(summary.describe(), file=sys.stderr)
    if summary.interrupted:
        return 130
    return 1 if summary.failed else 0


def has_tool_use(conversation: Conversation) -> bool:
    """Whether a conversation calls tools (an assistant ``tool_calls`` or a ``tool`` message)."""
    return any(m["role"] == "tool" or m.get("tool_calls") for m in conversation.messages)


def read_conversations(cfg: Any) -> Iterator[SourceConversation | RejectedInput]:
    """The records of ``cfg.data.paths`` with stable ids: ``FILE:LINE`` for text files,
    ``FILE#INDEX`` for Parquet/Arrow rows and ``sharegpt#INDEX`` for the embedded set.

    ``data.format`` and ``data.on_error`` apply as in ``prepare``; ``data.max_samples`` and
    ``data.heldout_samples`` do not (they apply when the output is trained on).
    """
    for source in expand_paths(list(cfg.data.paths)):
        for record in read_records([source], format=cfg.data.format,
                                   on_error=cfg.data.on_error, fields=cfg.data.fields):
            loc = record.location
            if source.embedded:
                record_id = f"{source.origin}#{loc.index}"
            elif loc.line is not None:
                record_id = f"{loc.file}:{loc.line}"
            else:
                record_id = f"{loc.file}#{loc.index}"
            if isinstance(record, Conversation) and has_tool_use(record):
                yield RejectedInput(record_id, "tool calls: an answer generated anew would not match the "
                                    "tool results recorded after it; train on this conversation as it is")
            elif isinstance(record, Conversation):
                yield record_id, record.messages
            elif isinstance(record, Rejected):
                yield RejectedInput(record_id, f"{record.reason}: {record.message}")
            else:
                yield RejectedInput(record_id, "pre-tokenized record: no text to regenerate")
