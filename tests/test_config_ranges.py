"""Every option and every command-line flag has a declared valid range, and every value outside
it is one ConfigError line naming the key or flag: never a traceback, never a silent default.

The keys are enumerated from the config dataclasses and the flags from ``cli.COMMANDS``, so a
new option or flag is covered (and must declare its range) without touching this file.
"""

from __future__ import annotations

import contextlib
import io
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dflash_trainer.cli.main import COMMANDS, build_parser, check_flags
from dflash_trainer.cli.main import main as cli_main
from dflash_trainer.config import TOKENS_MAX, ConfigError, Range, is_numeric, load_config, option_ranges

OPTIONS = option_ranges()
NUMERIC = sorted(key for key, (tp, _) in OPTIONS.items() if is_numeric(tp))
TEXT = sorted(key for key, (tp, _) in OPTIONS.items() if tp in (str, str | None, list[str]))

ZERO_OK = {
    # 0 is a real value here, never "no limit" or "the default".
    "data.heldout_samples", "model.mask_token_id", "model.target_layer_ids", "training.seed",
    "training.betas", "training.weight_decay", "training.warmup_ratio", "training.warmup_steps",
    "training.min_lr", "training.noise_std", "training.noise_warmup_steps", "eval.temperature",
    "training.selector_weight", "training.markov_weight",
}
HUGE_OK = {
    # A huge value means something: no clipping, every loss slot weighted the same.
    "training.grad_clip", "training.gamma",
}
FLAG_ZERO_OK = {"--temperature", "--top-k"}  # greedy decoding; top-k off, as vLLM and HF read it

BAD_SPELLINGS = {  # value -> how a user may write it on the command line (YAML)
    0: ["0"], -1: ["-1"], math.nan: [".nan", "nan"], math.inf: [".inf", "inf", "1e999"],
    -math.inf: ["-.inf", "-inf"], 1e300: ["1e300", "1.0e+300"], 2**63: [str(2**63)],
}
SETTINGS = settings(max_examples=200, deadline=None, derandomize=True)


def _is_list(key: str) -> bool:
    return "list" in str(OPTIONS[key][0]) or "tuple" in str(OPTIONS[key][0])


def _is_int(key: str) -> bool:
    return "int" in str(OPTIONS[key][0])


def _expected_bad(key: str, value: float, zero_ok: set[str], huge_ok: set[str]) -> bool:
    if value == 0:
        return key not in zero_ok
    if value in (1e300, 2**63):
        return key not in huge_ok
    return True  # -1, nan, inf, -inf: refused everywhere


def _roomy(key: str) -> dict[str, str]:
    """Other options set so that no cross-field check stands in the way of ``key``'s value:
    the smallest block, the longest sample, the largest batch budget, the largest lr."""
    room = {"model.block_size": "2", "data.max_length": str(TOKENS_MAX),
            "pipeline.tokens_per_batch": str(2**24), "training.lr": "1"}
    if key == "training.loss_slots":
        room["model.block_size"] = "256"
    if key == "pipeline.tokens_per_batch":
        room["data.max_length"] = "3"
    if key in ("model.selector_rank", "model.selector_top_k", "model.conv_group_size", "training.selector_weight"):
        room["model.variant"] = "dflash2"  # DFlash2 options are refused with model.variant=dflash
    if key in ("model.markov_rank", "training.markov_weight"):
        room["model.variant"] = "dspark"  # and DSpark's
    return {k: v for k, v in room.items() if k != key}


def _load(key: str, text: str):
    return load_config(None, [f"{k}={v}" for k, v in _roomy(key).items()] + [f"{key}={text}"])


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _in_range(rng: Range, integer: bool) -> st.SearchStrategy:
    low = rng.ge if rng.ge is not None else rng.gt
    high = rng.le if rng.le is not None else rng.lt
    if integer:
        low = int(low) + (rng.gt is not None)
        return st.integers(min_value=low, max_value=int(high) - (rng.lt is not None) if high is not None else None)
    return st.floats(min_value=low, max_value=high, exclude_min=rng.gt is not None,
                     exclude_max=rng.lt is not None, allow_nan=False, allow_infinity=False)


def _just_outside(rng: Range, integer: bool) -> list[float]:
    step = 1 if integer else 0
    values = []
    if rng.ge is not None:
        values.append(rng.ge - 1 if integer else math.nextafter(rng.ge, -math.inf))
    if rng.gt is not None:
        values.append(rng.gt - step)
    if rng.le is not None:
        values.append(rng.le + 1 if integer else math.nextafter(rng.le, math.inf))
    if rng.lt is not None:
        values.append(rng.lt + step)
    return [int(v) if integer else v for v in values]


# --- the declarations --------------------------------------------------------------------------

def test_every_numeric_option_declares_a_range():
    assert {"training.lr", "training.max_steps", "training.betas", "model.block_size",
            "pipeline.bucket_boundaries", "model.target_layer_ids"} <= set(NUMERIC)
    assert [key for key in NUMERIC if OPTIONS[key][1] is None] == []
    assert [key for key, (tp, rng) in OPTIONS.items() if rng is not None and key not in NUMERIC] == []
    assert (ZERO_OK | HUGE_OK) <= set(NUMERIC), "an expectation names an option that is gone"


def test_every_number_flag_declares_a_range():
    flags = [(name, flag, kwargs) for name, cmd in COMMANDS.items() for flag, kwargs in cmd.extra
             if kwargs.get("type") in (int, float)]
    assert {"--max-new-tokens", "--temperature", "--top-k", "--request-timeout"} <= {f for _, f, _ in flags}
    assert [(name, flag) for name, flag, kwargs in flags if not isinstance(kwargs.get("range"), Range)] == []


def test_nullable_options_say_what_none_means():
    nullable = [key for key in NUMERIC if "None" in str(OPTIONS[key][0])]
    assert "training.max_steps" in nullable
    assert [key for key in nullable if not OPTIONS[key][1].none] == []


def test_help_shows_the_ranges(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        cli_main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "training.lr = 0.0006  [float; in (0, 1]]" in out
    assert "training.max_steps = None  [int or none; in [1, 1_000_000_000], or none for no limit" in out
    assert "training.betas = (0.9, 0.999)  [list of 2 float; each in [0, 1)]" in out
    assert "model.target = 'smollm2'  [str; not empty]" in out
    assert "--max-new-tokens N" in out and "in [1, 1_048_576]" in out


# --- config options ----------------------------------------------------------------------------

@st.composite
def bad_option(draw):
    key = draw(st.sampled_from(NUMERIC))
    value = draw(st.sampled_from(list(BAD_SPELLINGS)))
    assume(_expected_bad(key, value, ZERO_OK, HUGE_OK))
    return key, value, draw(st.sampled_from(BAD_SPELLINGS[value]))


def _as_override(key: str, text: str, index: int) -> tuple[str, str]:
    """The override text and the key the error must name (``key[i]`` inside a list)."""
    if not _is_list(key):
        return text, key
    if key == "training.betas":
        pair = ["0.9", "0.9"]
        pair[index] = text
        return f"[{', '.join(pair)}]", f"{key}[{index}]"
    return f"[{text}]", f"{key}[0]"


@pytest.mark.parametrize("key", NUMERIC)
def test_out_of_range_option_is_one_config_error_naming_it(key: str):
    for value, spellings in BAD_SPELLINGS.items():
        if not _expected_bad(key, value, ZERO_OK, HUGE_OK):
            continue
        for text in spellings:
            for index in (0, 1) if key == "training.betas" else (0,):
                override, named = _as_override(key, text, index)
                with pytest.raises(ConfigError) as info:
                    _load(key, override)
                message = str(info.value)
                assert "\n" not in message
                assert message.startswith((f"{named} ", f"{named}:")), message
                if value == 0 and "None" in str(OPTIONS[key][0]) and not _is_list(key):
                    assert "none" in message, f"{key}=0 must point to none: {message}"


def test_huge_is_accepted_where_it_means_something():
    for key in sorted(HUGE_OK):
        assert _get(_load(key, "1e300"), key) == 1e300


@SETTINGS
@given(st.sampled_from(NUMERIC), st.data())
@pytest.mark.slow
def test_just_outside_a_bound_is_refused(key, data):
    rng = OPTIONS[key][1]
    value = data.draw(st.sampled_from(_just_outside(rng, _is_int(key))))
    override, named = _as_override(key, repr(value), 0)
    with pytest.raises(ConfigError, match=rf"^{named.replace('[', '.').replace(']', '.')} must be "):
        _load(key, override)


@SETTINGS
@given(st.sampled_from(NUMERIC), st.data())
@pytest.mark.slow
def test_in_range_option_is_accepted_as_given(key, data):
    rng = OPTIONS[key][1]
    values = _in_range(rng, _is_int(key))
    if key == "training.betas":
        value = data.draw(st.tuples(values, values))
    elif key == "pipeline.bucket_boundaries":
        value = sorted(data.draw(st.sets(values, min_size=1, max_size=6)))
    elif _is_list(key):
        value = data.draw(st.lists(values, min_size=1, max_size=6, unique=rng.unique))
    else:
        value = data.draw(values)
    if key == "data.max_length":
        assume(value > 2)  # above model.block_size, itself at least 2
    if key == "pipeline.tokens_per_batch":
        assume(value >= 3)  # holds a sample of data.max_length, itself at least 3
    text = f"[{', '.join(map(repr, value))}]" if _is_list(key) else repr(value)
    got = _get(_load(key, text), key)
    assert got == (list(value) if isinstance(got, list) else value)


def test_every_list_of_layers_slots_or_ids_refuses_a_member_named_twice():
    unique = sorted(key for key in NUMERIC if OPTIONS[key][1].unique)
    assert unique == ["model.target_layer_ids", "pipeline.bucket_boundaries"]
    for key in unique:
        with pytest.raises(ConfigError, match=rf"^{key}=\[3, 5, 3\] names 3 more than once; name each once$"):
            _load(key, "[3, 5, 3]")


@pytest.mark.parametrize("key", [k for k in NUMERIC if "None" in str(OPTIONS[k][0])])
def test_none_unsets_a_nullable_option(key: str):
    for text in ("none", "None", "null"):
        assert _get(_load(key, text), key) is None


@SETTINGS
@given(st.sampled_from(TEXT), st.sampled_from(["''", "'   '", "'\t'"]))
def test_empty_text_option_is_refused(key, text):
    override = f"[{text}]" if _is_list(key) else text
    named = f"{key}[0]" if _is_list(key) else key
    with pytest.raises(ConfigError, match=rf"^{named.replace('[', '.').replace(']', '.')} must not be empty"):
        load_config(None, [f"{key}={override}"])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(bad_option())
@pytest.mark.slow
def test_out_of_range_option_through_the_cli_is_one_line_and_exit_2(bad):
    key, _, text = bad
    override, named = _as_override(key, text, 0)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli_main(["prepare", f"{key}={override}"])
    lines = err.getvalue().splitlines()
    assert code == 2 and "Traceback" not in err.getvalue()
    assert len(lines) == 1 and lines[0].startswith(f"dflash-trainer prepare: config error: {named}"), lines


# --- command-line flags ------------------------------------------------------------------------

RANGED_FLAGS = sorted((name, flag) for name, cmd in COMMANDS.items() for flag, kwargs in cmd.extra
                      if "range" in kwargs)


def _flag_spec(command: str, flag: str) -> dict:
    return dict(COMMANDS[command].extra)[flag]


def _base_argv(command: str) -> list[str]:
    """The command with its required flags and positionals set to a placeholder."""
    argv = [command]
    for flag, kwargs in COMMANDS[command].extra:
        if not flag.startswith("-"):
            argv.append("x")
        elif kwargs.get("required"):
            argv += [flag, "x"]
    return argv


@pytest.mark.parametrize("command, flag", RANGED_FLAGS)
def test_out_of_range_flag_is_one_config_error_line_naming_it(command: str, flag: str):
    unparsable = ["abc", "1.5" if _flag_spec(command, flag)["type"] is int else "one"]
    texts = [text for value, spellings in BAD_SPELLINGS.items()
             if _expected_bad(flag, value, FLAG_ZERO_OK, set()) for text in spellings]
    for text in texts + unparsable:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli_main([*_base_argv(command), f"{flag}={text}"])
        lines = err.getvalue().splitlines()
        assert code == 2 and "Traceback" not in err.getvalue(), (text, err.getvalue())
        assert len(lines) == 1, (text, lines)
        assert lines[0].startswith(f"dflash-trainer {command}: config error: {flag} must be "), (text, lines)


@SETTINGS
@given(st.sampled_from(RANGED_FLAGS), st.data())
@pytest.mark.slow
def test_in_range_flag_is_accepted_as_given(command_flag, data):
    command, flag = command_flag
    spec = _flag_spec(command, flag)
    value = data.draw(_in_range(spec["range"], spec["type"] is int))
    args = build_parser().parse_args([*_base_argv(command), f"{flag}={value!r}"])
    check_flags(COMMANDS[command], args)
    assert getattr(args, flag.lstrip("-").replace("-", "_")) == value


TEXT_FLAGS = sorted({(name, flag) for name, cmd in COMMANDS.items() for flag in cmd.flags}
                    | {(name, flag) for name, cmd in COMMANDS.items() for flag, kwargs in cmd.extra
                       if "type" not in kwargs and "action" not in kwargs and "choices" not in kwargs}
                    | {(name, "--config") for name, cmd in COMMANDS.items() if cmd.reads_config})


@pytest.mark.parametrize("command, flag", TEXT_FLAGS)
def test_empty_text_flag_is_one_config_error_line(command: str, flag: str, capsys: pytest.CaptureFixture[str]):
    argv = _base_argv(command)
    if flag.startswith("-"):
        argv += [f"{flag}= "]
    else:
        argv[argv.index("x")] = " "
    assert cli_main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0] == (f"dflash-trainer {command}: config error: {flag} must not be empty "
                                            "or only whitespace, got ' '"), lines
