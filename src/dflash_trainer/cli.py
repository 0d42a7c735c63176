"""Command line: ``dflash-trainer {prepare,train,eval,export,regenerate,demo,report,generate} [options]``.

Every command takes ``--config FILE`` and dotted overrides (``training.lr=3e-4``). Command
flags such as ``--target`` are shorthands for config keys. Handlers are imported lazily so
that ``--help`` and config errors answer quickly.

Errors: a :class:`~dflash_trainer.errors.UserError` (and a disk that is full, read-only or not
writable) is printed as one line and exits with its code (2 usage/config, 1 data, target,
checkpoint, disk and runtime errors); any other exception is a bug and keeps its traceback.
``--debug`` or ``DFLASH_DEBUG=1`` shows the traceback of user errors too.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dflash_trainer.config import Config, describe_options, load_config
from dflash_trainer.errors import EXIT_RUNTIME, DiskError, UserError
from dflash_trainer.fsutil import disk_oserror


@dataclass(kw_only=True)
class Command:
    """One sub-command: its handler and the flags that map onto config keys."""

    handler: str
    """``module:function`` called as ``function(cfg, args)``; returns an exit code."""
    help: str
    flags: dict[str, str] = field(default_factory=dict)
    """``--flag`` -> dotted config key it sets (``--data`` may be repeated: one path each)."""
    extra: list[tuple[str, dict]] = field(default_factory=list)
    """Additional argparse arguments that are not config keys."""


COMMANDS: dict[str, Command] = {
    "prepare": Command(
        handler="dflash_trainer.data.prepare:main",
        help="Tokenize the chat data into the memory-mapped cache and print statistics.",
        flags={"--target": "model.target", "--data": "data.paths"},
    ),
    "train": Command(
        handler="dflash_trainer.train:main",
        help="Train a drafter (the full pipeline); torchrun-launchable.",
        flags={"--target": "model.target", "--data": "data.paths", "--run-dir": "run_dir",
               "--resume": "checkpoint.resume"},
    ),
    "eval": Command(
        handler="dflash_trainer.evaluate:main",
        help="Speculative decoding with a drafter: acceptance length, speedup, lossless check.",
        flags={"--target": "model.target", "--prompts": "eval.prompts", "--run-dir": "run_dir"},
        extra=[("--drafter", {"required": True, "help": "exported drafter folder"}),
               ("--out", {"default": None, "help": "output folder (default RUN_DIR/eval)"})],
    ),
    "export": Command(
        handler="dflash_trainer.model.export:main",
        help="Export a training checkpoint as a z-lab format drafter folder.",
        extra=[("--checkpoint", {"required": True, "help": "checkpoint folder"}),
               ("--out", {"required": True, "help": "output folder"})],
    ),
    "regenerate": Command(
        handler="dflash_trainer.data.regenerate:main",
        help="Regenerate assistant turns with the target model (OpenAI messages JSONL out).",
        flags={"--target": "model.target", "--data": "data.paths"},
        extra=[("--out", {"required": True, "help": "output JSONL file"}),
               ("--backend", {"default": "transformers", "choices": ["transformers", "openai"]}),
               ("--server-url", {"default": None, "help": "OpenAI-compatible base URL"}),
               ("--concurrency", {"type": int, "default": 8}),
               ("--batch-size", {"type": int, "default": 8}),
               ("--max-new-tokens", {"type": int, "default": 512}),
               ("--temperature", {"type": float, "default": None}),
               ("--top-p", {"type": float, "default": None}),
               ("--top-k", {"type": int, "default": None}),
               ("--limit", {"type": int, "default": None, "help": "at most N conversations"}),
               ("--max-turns", {"type": int, "default": None,
                                "help": "answer only the first N assistant turns of each conversation"}),
               ("--request-timeout", {"type": float, "default": 120.0,
                                      "help": "seconds to wait for one server answer before retrying"}),
               ("--allow-empty", {"action": "store_true",
                                  "help": "keep empty answers (by default they fail the conversation)"})],
    ),
    "demo": Command(
        handler="dflash_trainer.demo:main",
        help="The main job: prepare, train, evaluate before/after, export, report.",
        flags={"--target": "model.target", "--data": "data.paths", "--run-dir": "run_dir"},
    ),
    "report": Command(
        handler="dflash_trainer.report:main",
        help="Write plots and an index.html for a run folder.",
        extra=[("run", {"help": "run folder"})],
    ),
    "generate": Command(
        handler="dflash_trainer.generate:main",
        help="Answer prompts with speculative decoding, accepted draft tokens highlighted.",
        flags={"--target": "model.target"},
        extra=[("--drafter", {"required": True, "help": "exported drafter folder"}),
               ("--prompt", {"default": None, "help": "one prompt"}),
               ("--prompts", {"default": None, "help": "JSONL (as for eval) or text file, one prompt a line"}),
               ("--interactive", {"action": "store_true", "help": "a chat loop on the terminal"}),
               ("--check", {"action": "store_true",
                            "help": "check each answer equals the target's greedy answer"}),
               ("--max-new-tokens", {"type": int, "default": None, "help": "default eval.max_new_tokens"}),
               ("--temperature", {"type": float, "default": None, "help": "default eval.temperature"})],
    ),
}


def _options_epilog() -> str:
    lines = ["config options (set in --config FILE or as key=value overrides):"]
    for key, tp, default, doc in describe_options(Config):
        lines.append(f"  {key} = {default}  [{tp}]")
        if doc:
            lines.extend(textwrap.wrap(doc, 88, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of all sub-commands."""
    parser = argparse.ArgumentParser(
        prog="dflash-trainer", description="Train DFlash block-diffusion drafters.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    epilog = _options_epilog()
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--config", "-c", default=None, help="YAML config file")
        p.add_argument("--debug", action="store_true",
                       help="show the traceback of user errors too (or set DFLASH_DEBUG=1)")
        for flag, key in cmd.flags.items():
            if key == "data.paths":
                p.add_argument(flag, dest="flag_" + key.replace(".", "__"), default=None,
                               action="append", metavar="PATH",
                               help="a data file or folder; repeat for several (data.paths)")
                continue
            p.add_argument(flag, dest="flag_" + key.replace(".", "__"), default=None,
                           metavar="VALUE", help=f"shorthand for {key}=VALUE")
        for flag, kwargs in cmd.extra:
            p.add_argument(flag, **kwargs)
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="dotted config overrides, e.g. training.lr=3e-4")
    return parser


def _resolve(handler: str) -> Callable[[Config, argparse.Namespace], int | None]:
    module, _, func = handler.partition(":")
    return getattr(importlib.import_module(module), func)


def disk_error(exc: BaseException) -> DiskError | None:
    """The :class:`DiskError` behind ``exc`` (itself, or an ``OSError`` of a full, read-only or
    unwritable disk anywhere in its cause/context chain), or None."""
    if isinstance(exc, DiskError):
        return exc
    error = disk_oserror(exc)
    if error is None:
        return None
    where = error.filename or "the output folder"
    return DiskError(f"cannot write {where}: {os.strerror(error.errno or 0)}; free space or fix "
                     "the permissions there, or choose another folder (run_dir, --out, "
                     "data.cache_dir)")


def _overrides(cmd: Command, args: argparse.Namespace) -> list[str]:
    overrides = list(args.overrides)
    for key in cmd.flags.values():
        value = getattr(args, "flag_" + key.replace(".", "__"))
        if value is None:
            continue
        if key == "data.paths":
            # A JSON list is a YAML flow list: each --data path stays whole, commas included.
            value = json.dumps(list(value))
        overrides.append(f"{key}={value}")
    return overrides


def report_error(command: str, exc: UserError, *, debug: bool) -> int:
    """Print a user error as one line (and its traceback with ``debug``); its exit code."""
    if debug:
        traceback.print_exception(exc)
    print(f"dflash-trainer {command}: {exc.kind}: {exc}", file=sys.stderr, flush=True)
    return exc.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dflash-trainer`` console script; returns the exit code."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    cmd = COMMANDS[args.command]
    debug = args.debug or os.environ.get("DFLASH_DEBUG", "") not in ("", "0")
    # Model-loading progress bars drown the trainer's own output.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        cfg = load_config(args.config, _overrides(cmd, args))
        code = _resolve(cmd.handler)(cfg, args)
    except UserError as exc:
        return report_error(args.command, exc, debug=debug)
    except Exception as exc:
        disk = disk_error(exc)
        if disk is None:
            raise
        if debug:
            traceback.print_exception(exc)
        print(f"dflash-trainer {args.command}: {disk.kind}: {disk}", file=sys.stderr, flush=True)
        return EXIT_RUNTIME
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
