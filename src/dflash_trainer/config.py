"""Typed, nested run configuration: YAML file + dotted CLI overrides.

Every section is a keyword-only dataclass. Loading is strict: an unknown key, a value of
the wrong type or an inconsistent combination raises :class:`ConfigError` naming the
dotted key and what is accepted. The resolved config is written next to every output
(:func:`save_config`), so a run can be reproduced from its own ``config.yaml``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from dflash_trainer.errors import ConfigError

__all__ = ["Config", "ConfigError", "load_config", "save_config"]


@dataclass(kw_only=True)
class DataConfig:
    """Where the chat data comes from and how it becomes training samples."""

    paths: list[str] = field(default_factory=lambda: ["sharegpt"])
    """Data files or folders; ``sharegpt`` is the embedded ShareGPT set."""
    format: Literal["auto", "messages", "sharegpt", "tokenized", "hf"] = "auto"
    """Record format; ``auto`` detects it per record."""
    max_length: int = 3072
    """Longest tokenized sample, in tokens."""
    on_too_long: Literal["truncate", "drop"] = "truncate"
    """What to do with a sample longer than ``max_length``."""
    min_supervised_tokens: int = 2
    """Drop samples with fewer supervised tokens (counted as ``too_short``). 2 is the least a
    block needs: an anchor and one label, both supervised and adjacent."""
    on_error: Literal["raise", "skip", "auto"] = "auto"
    """Malformed records: ``raise`` stops at the first, ``skip`` counts them. ``auto`` is
    ``raise`` for user data and ``skip`` for the embedded data set (its file is truncated)."""
    thinking: bool = False
    """Render with thinking enabled, for templates that have it (Qwen3 style)."""
    last_turn_only: bool = False
    """Supervise only the last assistant turn."""
    max_samples: int | None = None
    """Read at most this many records (after skipping ``heldout_samples``)."""
    heldout_samples: int = 64
    """The first N records are held out of training and used as evaluation prompts."""
    cache_dir: str | None = None
    """Tokenized cache location; default ``$XDG_CACHE_HOME/dflash-trainer/tokens``."""


@dataclass(kw_only=True)
class ModelConfig:
    """The frozen target and the drafter built for it."""

    target: str = "smollm2"
    """``smollm2`` (embedded SmolLM2-135M-Instruct), an HF model folder or a hub-cached id."""
    num_layers: int = 1
    """Drafter decoder layers."""
    block_size: int = 16
    """Tokens per drafted block: 1 anchor + ``block_size - 1`` drafts."""
    target_layer_ids: list[int] | None = None
    """Target layers whose outputs condition the drafter; default by the reference rule."""
    mask_token_id: int | None = None
    """Id of the mask token inside the target's embedding table; default resolved."""
    intermediate_size: int | None = None
    """Drafter MLP width; default the target's."""
    num_attention_heads: int | None = None
    """Drafter query heads; default the target's."""
    num_key_value_heads: int | None = None
    """Drafter key/value heads; default the target's."""
    head_dim: int | None = None
    """Drafter head dimension; default the target's."""
    attention: Literal["auto", "sdpa", "blockwise", "flex"] = "auto"
    """Training attention: ``flex`` (FlexAttention BlockMask, CUDA), ``blockwise`` (each block
    scores only the context and its own keys, no dense mask), ``sdpa`` (SDPA with a dense
    ``[Q, context + Q]`` mask). ``auto`` is flex on CUDA and blockwise elsewhere."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Compute dtype: ``auto`` is bf16 autocast on CUDA; on CPU the faster of float32 and bf16
    for this target's training step, measured by a short probe at start-up and cached per
    machine (``dtype-probe.json`` in the user cache directory)."""
    init_from_target: bool = False
    """Initialise drafter layers from the target's last layers where shapes allow."""
    drafter_init: Literal["random", "target"] = "random"
    """``random``: fresh initialisation (reference). ``target``: the drafter starts as the
    target's next layer after the last tapped one (L): ``fc`` selects layer L's features (zero
    weight on other tapped layers), ``hidden_norm`` is layer L+1's input norm, drafter layer i
    a copy of target layer L+1+i, the final ``norm`` the target's final norm scaled by 0.2 (same
    argmax, less confident first predictions); so the first drafter layer's keys/values over
    the context are layer L+1's; a wider MLP (``intermediate_size`` above the target's) gets
    the target's units first and zero output weights on the extra ones. Excludes
    ``init_from_target``."""


@dataclass(kw_only=True)
class TrainingConfig:
    """Objective, optimizer and schedule."""

    seed: int = 42
    epochs: int = 6
    max_steps: int | None = None
    """Stop after this many optimizer steps (overrides ``epochs`` when smaller)."""
    max_time_s: float | None = None
    """Stop after this many seconds of training (a final checkpoint is written)."""
    lr: float = 6e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    """Linear warmup over this fraction of optimizer steps."""
    warmup_steps: int | None = None
    """Linear warmup over this many optimizer steps (replaces ``warmup_ratio``): for runs
    bounded by ``max_time_s``, whose planned step count says nothing about their length."""
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """Decay after warmup, down to ``min_lr``; ``wsd`` (warmup-stable-decay) holds ``lr`` and
    decays linearly over the last ``decay_ratio`` of the steps only."""
    decay_ratio: float = 0.2
    """``schedule: wsd``: the final fraction of the optimizer steps over which lr decays."""
    min_lr: float = 0.0
    grad_clip: float = 1.0
    """Global L2 gradient norm clip; its return value is logged as train/grad_norm."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    num_anchors: int = 512
    """Random anchors (blocks) per sequence per step."""
    gamma: float | None = None
    """Loss decay over block slots, w_k = exp(-(k-1)/gamma); default 7/5/4 for B = 16/10/8."""
    loss_slots: int | None = None
    """Supervise only block slots 1..K (None: all ``block_size - 1``). Inference still drafts
    the whole block; the frozen LM head over every slot is most of a CPU step, and at small
    budgets the acceptance length comes from the first slots."""
    labels: Literal["data", "target_greedy", "kl"] = "data"
    """``data``: dataset tokens (reference); ``target_greedy``: the target's argmax at each
    position; ``kl``: distil the target's distribution."""
    loss_chunk_size: int = 256
    """Block slots per LM-head/cross-entropy chunk (bounds the logits memory: on CPU 256
    peaked at 1.01 GiB where 1024 peaked at 1.40 GiB, at the same speed)."""
    noise_std: float = 0.0
    """Hidden-state noise augmentation (EAGLE extension, off in the DFlash recipe)."""
    noise_warmup_steps: int = 0
    """Ramp the noise linearly from 0 to ``noise_std`` over this many steps."""
    max_nonfinite_steps: int = 10
    """Stop after this many consecutive steps with a non-finite loss or gradient norm."""


@dataclass(kw_only=True)
class PipelineConfig:
    """Batching and the threaded pipeline."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_buckets: int = 6
    bucket_boundaries: list[int] | None = None
    """Explicit upper length bounds per bucket; default equal-count quantiles of the data."""
    tokens_per_batch: int = 4096
    """Token budget per batch, counting padding (rows * padded length)."""
    max_batch_size: int | None = None
    """Cap on sequences per batch."""
    max_run: int = 2
    """Most consecutive steps from one bucket while another has batches left."""
    order: Literal["interleave", "shuffle"] = "interleave"
    """Step order of the bucketed batches: ``interleave`` draws buckets diversity-first within
    ``max_run``; ``shuffle`` is a plain shuffle of the same batches (for comparison: it lets
    one large bucket run for several steps; see docs/interleave.md)."""
    prefetch_workers: int = 2
    batch_queue_size: int = 4
    feature_queue_size: int = 2
    num_threads: int | None = None
    """torch intra-op threads; default half the cores on CPU (the target stage and the drafter
    loop run at the same time), torch's own choice on GPU."""


@dataclass(kw_only=True)
class LoggingConfig:
    """Metrics and trackers."""

    every_steps: int = 10
    every_s: float | None = None
    """Also log when this many seconds passed since the last log."""
    wandb: Literal["online", "offline", "disabled"] = "disabled"
    wandb_project: str = "dflash-trainer"
    wandb_entity: str | None = None
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)
    tensorboard: bool = True
    console: bool = True


@dataclass(kw_only=True)
class CheckpointConfig:
    """Periodic asynchronous checkpoints and resume."""

    every_steps: int | None = None
    every_minutes: float | None = None
    keep_last: int = 3
    resume: str | None = None
    """``auto`` (latest in the run dir, if any) or a checkpoint path."""
    async_save: bool = True


@dataclass(kw_only=True)
class EvalConfig:
    """Speculative-decoding evaluation."""

    prompts: str = "mtbench"
    """``mtbench``, ``sharegpt-heldout`` or a JSONL file of prompts."""
    num_prompts: int | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    every_steps: int | None = None
    """In-training eval interval; None evaluates only at the end."""
    in_training_prompts: int = 8
    first_turn_only: bool = False


@dataclass(kw_only=True)
class DistributedConfig:
    """torch.distributed wrapping (launch with torchrun)."""

    drafter: Literal["ddp", "fsdp"] = "ddp"
    target: Literal["replicate", "fsdp"] = "replicate"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float = 1800.0
    """How long a collective (and the wait while rank 0 tokenizes the data) may block before
    the rank fails with an error naming it, instead of waiting forever for a stuck rank."""


@dataclass(kw_only=True)
class Config:
    """The root run configuration."""

    run_dir: str = "runs/default"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        validate(self)


def default_gamma(block_size: int) -> float:
    """Loss decay of the reference for a block size (7 for 16, 5 for 10, 4 for 8)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7.0 / 16.0))


def validate(cfg: Config) -> None:
    """Cross-field checks; raise ConfigError naming the field."""
    checks: list[tuple[bool, str]] = [
        (cfg.model.block_size >= 2, "model.block_size must be >= 2"),
        (cfg.model.num_layers >= 1, "model.num_layers must be >= 1"),
        (not (cfg.model.init_from_target and cfg.model.drafter_init == "target"),
         "model.init_from_target and model.drafter_init=target both initialise the drafter "
         "layers from the target; set only one"),
        (cfg.data.max_length > cfg.model.block_size,
         "data.max_length must be larger than model.block_size"),
        (cfg.training.lr > 0, "training.lr must be > 0"),
        (0 <= cfg.training.warmup_ratio < 1, "training.warmup_ratio must be in [0, 1)"),
        (cfg.training.warmup_steps is None or cfg.training.warmup_steps >= 0,
         "training.warmup_steps must be >= 0"),
        (cfg.training.min_lr <= cfg.training.lr, "training.min_lr must be <= training.lr"),
        (0 < cfg.training.decay_ratio <= 1, "training.decay_ratio must be in (0, 1]"),
        (cfg.training.grad_clip > 0, "training.grad_clip must be > 0"),
        (cfg.training.grad_accum >= 1, "training.grad_accum must be >= 1"),
        (cfg.training.num_anchors >= 1, "training.num_anchors must be >= 1"),
        (cfg.training.epochs >= 1, "training.epochs must be >= 1"),
        (cfg.training.gamma is None or cfg.training.gamma >= 0, "training.gamma must be >= 0"),
        (cfg.training.noise_std >= 0, "training.noise_std must be >= 0"),
        (cfg.training.noise_warmup_steps >= 0, "training.noise_warmup_steps must be >= 0"),
        (cfg.training.loss_chunk_size >= 1, "training.loss_chunk_size must be >= 1"),
        (cfg.training.loss_slots is None or 1 <= cfg.training.loss_slots < cfg.model.block_size,
         f"training.loss_slots must be between 1 and model.block_size - 1 ({cfg.model.block_size - 1}), "
         f"got {cfg.training.loss_slots}"),
        (cfg.pipeline.num_buckets >= 1, "pipeline.num_buckets must be >= 1"),
        (cfg.pipeline.max_run >= 1, "pipeline.max_run must be >= 1"),
        (cfg.pipeline.prefetch_workers >= 1, "pipeline.prefetch_workers must be >= 1"),
        (cfg.pipeline.batch_queue_size >= 1, "pipeline.batch_queue_size must be >= 1"),
        (cfg.pipeline.feature_queue_size >= 1, "pipeline.feature_queue_size must be >= 1"),
        (cfg.pipeline.tokens_per_batch >= cfg.data.max_length,
         f"pipeline.tokens_per_batch ({cfg.pipeline.tokens_per_batch}) must be >= "
         f"data.max_length ({cfg.data.max_length}) so the longest sample fits a batch"),
        (cfg.logging.every_steps >= 1, "logging.every_steps must be >= 1"),
        (cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last must be >= 1"),
        (cfg.distributed.timeout_s > 0, "distributed.timeout_s must be > 0"),
        (cfg.eval.temperature >= 0, "eval.temperature must be >= 0"),
        (cfg.eval.max_new_tokens >= 1, "eval.max_new_tokens must be >= 1"),
    ]
    bounds = cfg.pipeline.bucket_boundaries
    if bounds is not None:
        checks.append((list(bounds) == sorted(set(bounds)) and len(bounds) > 0,
                       "pipeline.bucket_boundaries must be strictly increasing"))
    ids = cfg.model.target_layer_ids
    if ids is not None:
        checks.append((len(ids) > 0 and all(i >= 0 for i in ids),
                       "model.target_layer_ids must be a non-empty list of layer indices >= 0"))
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted where lossless."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue  # the next member may accept it; the error below names them all
        raise ConfigError(f"{key}: expected {' or '.join(_type_name(a) for a in args)}, "
                          f"got {value!r}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{key}: got {value!r}, accepted values: "
                          + ", ".join(repr(a) for a in args))
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {value!r}")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # PyYAML reads "3e-4" (no dot) as a string; accept it as the number it spells.
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    raise AssertionError(f"unsupported config annotation {tp!r} at {key}")


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"unknown config key {dotted!r}; accepted keys"
                              f"{' in ' + prefix if prefix else ''}: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b=value`` into (["a", "b"], parsed value); values are YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, _, raw = text.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from exc
    return parts, value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a config from a YAML file (optional) and apply dotted overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"--config {str(p)!r} is a folder; give a YAML file (e.g. "
                              "configs/demo-cpu.yaml)")
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8-sig"))
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping of sections")
        raw = loaded or {}
    for text in overrides or []:
        parts, value = parse_override(text)
        node = raw
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
    return _build(Config, raw, "")


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) suitable for YAML/JSON."""
    def plain(v: Any) -> Any:
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(cfg))


def save_config(cfg: Config, directory: str | Path, name: str = "config.yaml") -> Path:
    """Write the resolved config as ``name`` into ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return path


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal under a field) of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe_options(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, doc) of every option, for ``--help``."""
    rows: list[tuple[str, str, str, str]] = []
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe_options(tp, key + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append((key, _type_name(tp), repr(default), docs.get(f.name, "")))
    return rows
