"""Command line: ``dflash-trainer {prepare,features,train,eval,export,regenerate,demo,report,generate} [options]``.

Every command takes ``--config FILE`` and dotted overrides (``training.lr=3e-4``), options and
overrides in any order. Command flags such as ``--target`` are shorthands for config keys.
Handlers are imported lazily so that ``--help`` and config errors answer quickly.

Errors: a :class:`~dflash_trainer.core.errors.UserError` (and a disk that is full, read-only or not
writable) is printed as one line and exits with its code (2 usage/config, 1 data, target,
checkpoint, disk and runtime errors); any other exception is a bug and keeps its traceback.
``--debug`` or ``DFLASH_DEBUG=1`` shows the traceback of user errors too. SIGINT and SIGTERM
end a command with one line, ``dflash-trainer CMD: interrupted (SIGTERM); ...``, and exit 130 /
143 (``train`` stops gracefully while it trains and exits 0); see :mod:`dflash_trainer.core.interrupts`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dflash_trainer.core.version import __version__
from dflash_trainer.config import (COUNT_MAX, DURATION_MAX_S, Config, ConfigError, Range, check_text,
                                   describe_options, explicit_keys, load_config, option_ranges)
from dflash_trainer.core.bundled_configs import bundled_names
from dflash_trainer.core.errors import EXIT_RUNTIME, UserError
from dflash_trainer.core.fsutil import disk_error
from dflash_trainer.core.interrupts import report_interrupt, signal_of, stop_signals_raise


@dataclass(kw_only=True)
class Command:
    """One sub-command: its handler and the flags that map onto config keys."""

    handler: str
    """``module:function`` called as ``function(cfg, args)``; returns an exit code."""
    help: str
    flags: dict[str, str] = field(default_factory=dict)
    """``--flag`` -> dotted config key it sets (``--data`` may be repeated: one path each)."""
    extra: list[tuple[str, dict]] = field(default_factory=list)
    """Additional argparse arguments that are not config keys. A number's ``"range"`` (a
    :class:`~dflash_trainer.config.Range`, required with ``"type": int`` or ``float``) is checked
    by :func:`check_flags`, which also parses the number, so a bad value is one config error line."""
    reads_config: bool = True
    fits_data: bool = False
    """Whether the command reads the training data: its ``data.max_length`` and
    ``data.heldout_samples`` defaults are fitted to the target and the data first
    (:func:`~dflash_trainer.data.fit.fit_data_defaults`)."""
    builds_drafter: bool = False
    """Whether the command builds a drafter: without ``--config`` its shape and init are fitted
    to the target (:func:`~dflash_trainer.training.drafter_init.fit_drafter_defaults`)."""
    """False for a command whose inputs carry their own settings (a checkpoint, a run folder): it
    takes no ``--config`` and no overrides, and its ``--help`` lists no config options."""


def _range_of(key: str) -> Range:
    """The range of config key ``key``, for a flag that overrides it (unset is not an option there)."""
    rng = option_ranges()[key][1]
    assert rng is not None, key
    return dataclasses.replace(rng, none="")


COMMANDS: dict[str, Command] = {
    "prepare": Command(
        handler="dflash_trainer.data.prepare:main",
        help="Tokenize the chat data into the memory-mapped cache and print statistics.",
        flags={"--target": "model.target", "--data": "data.paths"},
        extra=[("--show", {"type": int, "default": None, "metavar": "N",
                           "help": "print the first N training samples, supervised tokens marked and "
                                   "per-turn samples named, from the token store's code path; write no store",
                           "range": Range(ge=1, le=COUNT_MAX)})],
        fits_data=True,
    ),
    "features": Command(
        handler="dflash_trainer.features.build:main",
        help="Compute the target's features of every training sample once, into a feature store "
             "that train reads with features.store=FOLDER; resumable, torchrun-launchable.",
        flags={"--target": "model.target", "--data": "data.paths", "--out": "features.store"},
        fits_data=True, builds_drafter=True,
        extra=[("--print-engine-command", {
            "action": "store_true",
            "help": "print the vLLM server command that serves this config's hidden states "
                    "(for engine.url) and exit"})],
    ),
    "train": Command(
        handler="dflash_trainer.cli.train:main",
        help="Train a drafter (the full pipeline); torchrun-launchable.",
        flags={"--target": "model.target", "--data": "data.paths", "--run-dir": "run_dir",
               "--resume": "checkpoint.resume", "--features": "features.store"},
        fits_data=True, builds_drafter=True,
        extra=[("--overwrite", {"action": "store_true",
                                "help": "start over in a run folder that holds an earlier run: "
                                        "delete its checkpoints, metrics, drafter and report "
                                        "first"})],
    ),
    "eval": Command(
        handler="dflash_trainer.evaluation.evaluate:main",
        help="Speculative decoding with a drafter: acceptance length, speedup, lossless check.",
        flags={"--target": "model.target", "--prompts": "eval.prompts", "--run-dir": "run_dir"},
        extra=[("--drafter", {"required": True, "help": "exported drafter folder"}),
               ("--suite", {"action": "store_true",
                            "help": "evaluate every domain of eval.suite (default mtbench, humaneval, math), "
                                    "eval.suite_prompts first turns each, and report tau per domain"}),
               ("--engine", {"default": None, "metavar": "{llama.cpp,vllm,all}",
                             "help": "after the project's own loop, serve the same requests with each engine, "
                                     "plain and with the drafter, and put its tau per domain, identical outputs "
                                     "and tokens/s beside the project's (eval.engine_threads, "
                                     "eval.llama_cpp_build, eval.llama_cpp_target, eval.vllm_venv)"}),
               ("--out", {"default": None, "help": "output folder (default next to the drafter: RUN_DIR/eval for a "
                                                   "run's drafter/ folder, else DRAFTER-eval; with --suite its "
                                                   "suite/ subfolder)"}),
               ("--overwrite", {"action": "store_true",
                                "help": "replace the results of an earlier evaluation in the output folder"})],
    ),
    "export": Command(
        handler="dflash_trainer.training.export:main",
        help="Export a training checkpoint as a z-lab format drafter folder.",
        extra=[("--checkpoint", {"required": True, "help": "checkpoint folder"}),
               ("--out", {"required": True, "help": "output folder (new or empty)"}),
               ("--overwrite", {"action": "store_true",
                                "help": "replace an earlier drafter export in --out"})],
        reads_config=False,
    ),
    "regenerate": Command(
        handler="dflash_trainer.data.regenerate:main",
        help="Regenerate assistant turns with the target model (OpenAI messages JSONL out).",
        flags={"--target": "model.target", "--data": "data.paths"},
        extra=[("--out", {"required": True, "help": "output JSONL file"}),
               ("--backend", {"default": "transformers", "choices": ["transformers", "openai"]}),
               ("--server-url", {"default": None, "help": "OpenAI-compatible base URL"}),
               ("--concurrency", {"type": int, "default": 8, "range": Range(ge=1, le=1024)}),
               ("--batch-size", {"type": int, "default": 8, "range": Range(ge=1, le=4096)}),
               ("--max-new-tokens", {"type": int, "default": 512, "range": _range_of("eval.max_new_tokens")}),
               ("--temperature", {"type": float, "default": None, "range": _range_of("eval.temperature")}),
               ("--top-p", {"type": float, "default": None, "range": Range(gt=0, le=1)}),
               ("--top-k", {"type": int, "default": None,
                            "range": Range(ge=0, le=2**31 - 1, why="0 turns top-k off")}),
               ("--limit", {"type": int, "default": None, "help": "at most N conversations",
                            "range": Range(ge=1, le=COUNT_MAX)}),
               ("--max-turns", {"type": int, "default": None,
                                "help": "answer only the first N assistant turns of each conversation",
                                "range": Range(ge=1, le=COUNT_MAX)}),
               ("--request-timeout", {"type": float, "default": 120.0,
                                      "help": "seconds to wait for one server answer before retrying",
                                      "range": Range(gt=0, le=DURATION_MAX_S, why="a year")}),
               ("--allow-empty", {"action": "store_true",
                                  "help": "keep empty answers (by default they fail the conversation)"})],
    ),
    "demo": Command(
        handler="dflash_trainer.cli.demo:main",
        help="The main job: prepare, train, evaluate before/after, export, report.",
        flags={"--target": "model.target", "--data": "data.paths", "--run-dir": "run_dir"},
        fits_data=True, builds_drafter=True,
    ),
    "report": Command(
        handler="dflash_trainer.reporting.report:main",
        help="Write plots and an index.html for a run folder.",
        extra=[("run", {"help": "run folder"})],
        reads_config=False,
    ),
    "generate": Command(
        handler="dflash_trainer.evaluation.generate:main",
        help="Answer prompts with speculative decoding, accepted draft tokens highlighted.",
        flags={"--target": "model.target"},
        extra=[("--drafter", {"required": True, "help": "exported drafter folder"}),
               ("--prompt", {"default": None, "help": "one prompt"}),
               ("--prompts", {"default": None, "help": "JSONL (as for eval) or text file, one prompt a line"}),
               ("--interactive", {"action": "store_true", "help": "a chat loop on the terminal"}),
               ("--check", {"action": "store_true",
                            "help": "check each answer equals the target's greedy answer"}),
               ("--max-new-tokens", {"type": int, "default": None, "help": "default eval.max_new_tokens",
                                     "range": _range_of("eval.max_new_tokens")}),
               ("--temperature", {"type": float, "default": None, "help": "default eval.temperature",
                                  "range": _range_of("eval.temperature")})],
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
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    epilog = _options_epilog()
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help, epilog=epilog if cmd.reads_config else None,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if cmd.reads_config:
            p.add_argument("--config", "-c", default=None,
                           help="YAML config file, or the name of a shipped one (" + ", ".join(bundled_names()) + ")")
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
            p.add_argument(flag, **_argparse_kwargs(kwargs))
        if cmd.reads_config:
            p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                           help="dotted config overrides, e.g. training.lr=3e-4")
    return parser


def version_line() -> str:
    """``dflash-trainer VERSION (torch X, transformers Y, Python Z)``, read without importing torch."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return (f"dflash-trainer {__version__} (torch {installed('torch')}, transformers {installed('transformers')}, "
            f"Python {sys.version.split()[0]})")


def parse_args(argv: Sequence[str] | None = None,
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The command line parsed with options and ``KEY=VALUE`` overrides in any order.

    argparse fills a ``nargs="*"`` positional from its first run of values only, so
    ``train K=V --resume auto K2=V2`` would leave ``K2=V2`` unrecognized; a sub-command's own
    parser reads its arguments intermixed (options first, then every positional in order).
    The top-level parser keeps ``--help`` and a missing or unknown command.
    """
    parser = parser or build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    subparsers = next(action for action in parser._actions
                      if isinstance(action, argparse._SubParsersAction))
    if not argv or argv[0] not in subparsers.choices:
        return parser.parse_args(argv)
    args = subparsers.choices[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


def _argparse_kwargs(kwargs: dict) -> dict:
    """argparse's arguments of an ``extra`` flag: a ranged number is parsed by :func:`check_flags`
    (argparse's own type errors print a usage block), and its help shows the range."""
    rng = kwargs.get("range")
    if rng is None:
        assert kwargs.get("type") not in (int, float), f"a number flag without a range: {kwargs}"
        return kwargs
    out = {k: v for k, v in kwargs.items() if k not in ("range", "type")}
    out["help"] = "; ".join(filter(None, [kwargs.get("help"), rng.explain()]))
    out.setdefault("metavar", "N" if kwargs.get("type") is int else "X")
    return out


def _dest(flag: str, kwargs: dict) -> str:
    return kwargs.get("dest") or flag.lstrip("-").replace("-", "_")


def _parse_number(flag: str, value: int | float | str, kind: type, rng: Range) -> int | float:
    try:
        number: int | float = kind(value) if isinstance(value, str) else value
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise ConfigError(f"{flag} must be {noun} {rng.explain()}, got {value!r}") from None
    rng.check(flag, number)
    return number


def check_flags(cmd: Command, args: argparse.Namespace) -> None:
    """Parse and check the flags of a command in place: a number that does not parse or lies
    outside its declared range, or an empty text, is a ConfigError naming the flag."""
    if getattr(args, "config", None) is not None:
        check_text("--config", args.config)
    for flag, kwargs in cmd.extra:
        dest = _dest(flag, kwargs)
        value = getattr(args, dest)
        if value is None or isinstance(value, bool):
            continue
        rng = kwargs.get("range")
        if rng is not None:
            setattr(args, dest, _parse_number(flag, value, kwargs["type"], rng))
        elif isinstance(value, str):
            check_text(flag, value)
    for flag, key in cmd.flags.items():
        value = getattr(args, "flag_" + key.replace(".", "__"))
        for item in value if isinstance(value, list) else [value]:
            if item is not None:
                check_text(flag, item)


def _resolve(handler: str) -> Callable[[Config, argparse.Namespace], int | None]:
    module, _, func = handler.partition(":")
    return getattr(importlib.import_module(module), func)


def output_folder(command: str, cfg: Config, args: argparse.Namespace) -> str:
    """The folder ``command`` writes into, as the config and flags give it."""
    if command == "prepare":
        from dflash_trainer.data.prepare import cache_dir

        return str(cache_dir(cfg))
    if command == "eval":
        from dflash_trainer.evaluation.evaluate import default_out_dir

        return args.out or str(default_out_dir(cfg, suite=args.suite, drafter=getattr(args, "drafter", None),
                                               run_dir_given="run_dir" in getattr(args, "set_keys", {"run_dir"})))
    if command in ("export", "regenerate"):
        return str(args.out)
    if command == "report":
        return str(args.run)
    if command == "features":
        return str(cfg.features.store)
    return str(cfg.run_dir)


def _overrides(cmd: Command, args: argparse.Namespace) -> list[str]:
    overrides = list(getattr(args, "overrides", []))
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
    args = parse_args(argv)
    cmd = COMMANDS[args.command]
    debug = args.debug or os.environ.get("DFLASH_DEBUG", "") not in ("", "0")
    # Model-loading progress bars drown the trainer's own output.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg: Config | None = None
    with stop_signals_raise() as received:
        try:
            check_flags(cmd, args)
            cfg = load_config(getattr(args, "config", None), _overrides(cmd, args))
            args.set_keys = explicit_keys(getattr(args, "config", None), _overrides(cmd, args))
            if cmd.fits_data:
                from dflash_trainer.data.fit import fit_data_defaults
                from dflash_trainer.training.drafter_init import fit_drafter_defaults

                rank0 = os.environ.get("RANK", "0") == "0"  # under torchrun every rank fits the same
                cfg = fit_data_defaults(cfg, given=args.set_keys,
                                        log=lambda line: rank0 and print(line, flush=True))
                if cmd.builds_drafter and getattr(args, "config", None) is None:
                    cfg = fit_drafter_defaults(cfg, given=args.set_keys,
                                               log=lambda line: rank0 and print(line, flush=True))
            code = _resolve(cmd.handler)(cfg, args)
        except UserError as exc:
            return report_error(args.command, exc, debug=debug)
        except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM as an Interrupted
            if debug:
                traceback.print_exception(exc)
            return report_interrupt(args.command, signal_of(exc))
        except Exception as exc:
            disk = disk_error(exc, folder=None if cfg is None else output_folder(args.command, cfg, args))
            if disk is None:
                raise
            if debug:
                traceback.print_exception(exc)
            print(f"dflash-trainer {args.command}: {disk.kind}: {disk}", file=sys.stderr, flush=True)
            return EXIT_RUNTIME
    if received:  # the command caught the interruption and kept what it had (regenerate)
        return report_interrupt(args.command, received[0])
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
