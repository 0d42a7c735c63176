"""Typed, nested run configuration: YAML file + dotted CLI overrides.

Every section is a keyword-only dataclass. Loading is strict: an unknown key, a value of
the wrong type or an inconsistent combination raises :class:`ConfigError` naming the
dotted key and what is accepted. The resolved config is written next to every output
(:func:`save_config`), so a run can be reproduced from its own ``config.yaml``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import os
import textwrap
import types
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from dflash_trainer.core.bundled_configs import bundled_config, bundled_names
from dflash_trainer.core.errors import ConfigError
from dflash_trainer.core.inputs import check_input

__all__ = ["COUNT_MAX", "DURATION_MAX_S", "EQUAL", "MAY_CHANGE", "RECOMPUTED", "TOKENS_MAX", "Config", "ConfigError",
           "Range", "check_text", "is_numeric", "load_config", "option_ranges", "option_resume_rules", "ranged",
           "resume_rules", "save_config", "upgrade_saved_config"]

COUNT_MAX = 10**9
"""Upper bound of counts that have no natural one (steps, records, prompts): no run comes near
it, and arithmetic on such counts stays far inside 64-bit integers."""
TOKENS_MAX = 2**20
"""Upper bound of token counts (lengths, new tokens, chunk sizes): longer than any target's context."""
DURATION_MAX_S = 366 * 24 * 3600
"""Upper bound of durations: timers and collective timeouts overflow far beyond it."""


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric option, or of each element of a list option.

    ``ge``/``gt`` and ``le``/``lt`` are inclusive/exclusive bounds; every value must also be
    finite (nan and inf are refused everywhere). ``none`` says what leaving an ``X | None``
    option unset means, since 0 never stands for it; ``why`` explains a bound that is not
    obvious. Both appear in the error message and in ``--help``. ``unique``: the elements of a
    list option must differ (a layer or slot named twice is a mistake, never a weighting).
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    none: str = ""
    why: str = ""
    unique: bool = False

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def describe(self) -> str:
        """The bounds as text: ``>= 1``, ``> 0``, ``in [0, 1)``, or ``finite``."""
        low = (f"[{_number(self.ge)}" if self.ge is not None
               else f"({_number(self.gt)}" if self.gt is not None else None)
        high = (f"{_number(self.le)}]" if self.le is not None
                else f"{_number(self.lt)})" if self.lt is not None else None)
        if low and high:
            return f"in {low}, {high}"
        if low:
            return (">= " if low[0] == "[" else "> ") + low[1:]
        if high:
            return ("<= " if high[-1] == "]" else "< ") + high[:-1]
        return "finite"

    def explain(self) -> str:
        """:meth:`describe` with the reason of the bound and the meaning of none."""
        text = self.describe()
        if self.why:
            text += f" ({self.why})"
        if self.none:
            text += f", or none {self.none}"
        if self.unique:
            text += ", each named once"
        return text

    def check(self, key: str, value: Any) -> None:
        """Raise :class:`ConfigError` naming ``key`` unless ``value`` lies in the range."""
        if value not in self:
            raise ConfigError(f"{key} must be {self.explain()}, got {value!r}")


def _number(bound: float) -> str:
    if not float(bound).is_integer():
        return f"{bound:g}"
    # Large bounds grouped as YAML and Python read them back: 1_000_000_000.
    return f"{int(bound):_}" if abs(bound) >= 10_000 else str(int(bound))


def check_text(key: str, value: str) -> None:
    """Raise :class:`ConfigError` naming ``key`` when a text option is empty or only whitespace."""
    if not value.strip():
        raise ConfigError(f"{key} must not be empty or only whitespace, got {value!r}")


def ranged(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, none: str = "", why: str = "", unique: bool = False) -> Any:
    """A dataclass field with its valid :class:`Range` (for a list option: of each element)."""
    return field(default=default, metadata={"range": Range(ge=ge, gt=gt, le=le, lt=lt, none=none, why=why,
                                                           unique=unique)})

EQUAL = "equal"
"""Resume rule: the value decides the data order, the model or the meaning of the saved state; a
resume with another value is refused."""
MAY_CHANGE = "may change"
"""Resume rule: the resumed run reads the value afresh; nothing saved depends on it."""
RECOMPUTED = "recomputed"
"""Resume rule: may change; what the checkpoint derived from it is recomputed for the new value
(the run's end from ``training.epochs``, the sharding of the saved state from
``distributed.drafter``)."""


def resume_rules(*, equal: tuple[str, ...] = (), may_change: tuple[str, ...] = (),
                 recomputed: tuple[str, ...] = ()) -> Any:
    """Class decorator (above ``@dataclass``): how each field of a config section resumes, kept
    in the field's metadata under ``"resume"`` (:data:`EQUAL`, :data:`MAY_CHANGE`,
    :data:`RECOMPUTED`); ``training.resume`` checks a checkpoint's config by them, and
    ``tests/test_config.py`` fails for a field without one."""
    def declare(cls: type) -> type:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for rule, names in ((EQUAL, equal), (MAY_CHANGE, may_change), (RECOMPUTED, recomputed)):
            for name in names:
                f = fields[name]  # a name that is no field fails here, at import
                assert "resume" not in f.metadata, f"{cls.__name__}.{name} has two resume rules"
                f.metadata = types.MappingProxyType({**f.metadata, "resume": rule})
        return cls
    return declare



CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles a conversation's messages have once read (what chat templates render)."""


@resume_rules(equal=("messages", "role", "content", "roles"))
@dataclass(kw_only=True)
class FieldsConfig:
    """Where records of a layout the trainer does not detect keep their chat (``data.fields``)."""

    messages: str | None = None
    """Record key holding the list of messages; when set, every record is read through this map
    (none: the layout is detected per record)."""
    role: str | None = None
    """Message key holding the role (needs ``messages``); none: ``role`` or ``from``."""
    content: str | None = None
    """Message key holding the text (needs ``messages``); none: ``content`` or ``value``."""
    roles: list[str] = field(default_factory=list)
    """Role names of the data as ``NAME=ROLE`` (ROLE one of system, developer, user, assistant,
    tool, or function_call for a turn whose text is a JSON tool call), e.g.
    ``[prompter=user, bot=assistant]``; applies to every layout."""

    def role_map(self) -> dict[str, str]:
        """``roles`` as {lower-case name of the data: role}; ConfigError naming the bad entry."""
        mapping: dict[str, str] = {}
        for i, entry in enumerate(self.roles):
            name, sep, role = entry.partition("=")
            if not sep or not name.strip() or role.strip() not in (*CHAT_ROLES, "function_call"):
                raise ConfigError(f"data.fields.roles[{i}]={entry!r}: expected NAME=ROLE with ROLE one of "
                                  f"{', '.join(CHAT_ROLES)} or function_call (e.g. prompter=user)")
            mapping[name.strip().lower()] = role.strip()
        return mapping


@resume_rules(equal=("paths", "format", "max_length", "on_too_long", "min_supervised_tokens", "on_error",
                     "thinking", "last_turn_only", "max_samples", "heldout_samples"),
              may_change=("cache_dir",))
@dataclass(kw_only=True)
class DataConfig:
    """Where the chat data comes from and how it becomes training samples."""

    paths: list[str] = field(default_factory=lambda: ["sharegpt"])
    """Data files or folders; ``sharegpt`` is the embedded ShareGPT set."""
    format: Literal["auto", "messages", "sharegpt", "lmsys", "alpaca", "prompt_completion", "ultrachat",
                    "tokenized", "hf"] = "auto"
    """Record layout (see docs/data.md); ``auto`` (and ``hf``) detects it per record, any other
    value requires it of every record."""
    fields: FieldsConfig = field(default_factory=FieldsConfig)
    """A field map for chat data of any other layout (``data.fields.messages`` and the keys below)."""
    max_length: int = ranged(3072, ge=2, le=TOKENS_MAX)
    """Longest tokenized sample, in tokens."""
    on_too_long: Literal["truncate", "drop"] = "truncate"
    """What to do with a sample longer than ``max_length``."""
    min_supervised_tokens: int = ranged(2, ge=2, le=TOKENS_MAX)
    """Drop samples with fewer supervised tokens (counted as ``too_short``). 2 is the least a
    block needs: an anchor and one label, both supervised and adjacent."""
    on_error: Literal["raise", "skip", "auto"] = "auto"
    """Malformed records: ``raise`` stops at the first, ``skip`` counts them. ``auto`` is
    ``raise`` for user data and ``skip`` for the embedded data set (its file is truncated)."""
    thinking: bool = False
    """Render answers without reasoning with thinking enabled, for templates that have it (Qwen3
    style); an answer that carries reasoning is always rendered with it."""
    last_turn_only: bool = False
    """Supervise only the last assistant turn: one sample per conversation, also where the
    template would need one per turn."""
    max_samples: int | None = ranged(None, ge=1, le=COUNT_MAX, none="for every record")
    """Read at most this many records (after skipping ``heldout_samples``)."""
    heldout_samples: int = ranged(64, ge=0, le=COUNT_MAX)
    """The first N records are held out of training and used as evaluation prompts."""
    cache_dir: str | None = None
    """Tokenized cache location; default ``$XDG_CACHE_HOME/dflash-trainer/tokens``."""


@resume_rules(equal=("target", "num_layers", "block_size", "target_layer_ids", "mask_token_id",
                     "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "attention",
                     "dtype", "drafter_init", "variant", "selector_rank", "selector_top_k", "conv_group_size",
                     "markov_rank", "enable_confidence_head", "draft_vocab_size", "init_from"))
@dataclass(kw_only=True)
class ModelConfig:
    """The frozen target and the drafter built for it."""

    target: str = "smollm2"
    """``smollm2`` (embedded SmolLM2-135M-Instruct), an HF model folder or a hub-cached id."""
    num_layers: int = ranged(1, ge=1, le=256)
    """Drafter decoder layers."""
    block_size: int = ranged(16, ge=2, le=256)
    """Tokens per drafted block: 1 anchor + ``block_size - 1`` drafts."""
    target_layer_ids: list[int] | None = ranged(None, ge=0, le=4095, none="for the reference rule", unique=True)
    """Target layers whose outputs condition the drafter; default by the reference rule."""
    mask_token_id: int | None = ranged(None, ge=0, le=2**31 - 1, none="to resolve it")
    """Id of the mask token inside the target's embedding table; default resolved."""
    intermediate_size: int | None = ranged(None, ge=1, le=TOKENS_MAX, none="for the target's")
    """Drafter MLP width; default the target's."""
    num_attention_heads: int | None = ranged(None, ge=1, le=1024, none="for the target's")
    """Drafter query heads; default the target's."""
    num_key_value_heads: int | None = ranged(None, ge=1, le=1024, none="for the target's")
    """Drafter key/value heads; default the target's."""
    head_dim: int | None = ranged(None, ge=1, le=4096, none="for the target's")
    """Drafter head dimension; default the target's."""
    attention: Literal["auto", "sdpa", "blockwise", "flex"] = "auto"
    """Training attention: ``flex`` (FlexAttention BlockMask, CUDA), ``blockwise`` (each block
    scores only the context and its own keys, no dense mask), ``sdpa`` (SDPA with a dense
    ``[Q, context + Q]`` mask). ``auto`` is flex on CUDA and blockwise elsewhere."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Compute dtype: ``auto`` is bf16 autocast on CUDA; on CPU the faster of float32 and bf16
    for this target's training step, measured by a short probe at start-up and cached per
    machine (``dtype-probe.json`` in the user cache directory), so ``features``, ``train``,
    ``eval`` and ``demo`` take the same one; ``train`` from a ``features.store`` takes the
    dtype the store was computed in."""
    drafter_init: Literal["random", "target", "last_layers"] = "random"
    """``random``: fresh initialisation (reference). ``target``: the drafter starts as the
    target's next layer after the last tapped one (L): ``fc`` selects layer L's features (zero
    weight on other tapped layers), ``hidden_norm`` is layer L+1's input norm, drafter layer i
    a copy of target layer L+1+i, the final ``norm`` the target's final norm scaled by 0.2 (same
    argmax, less confident first predictions); so the first drafter layer's keys/values over
    the context are layer L+1's; a wider MLP (``intermediate_size`` above the target's) gets
    the target's units first and zero output weights on the extra ones. ``last_layers``:
    drafter layer i a copy of the target's layer ``n_target - n_draft + i`` where names and
    shapes match; ``fc`` and the norms stay fresh."""
    variant: Literal["dflash", "dflash2", "dspark"] = "dflash"
    """``dflash``: the DFlash drafter. ``dflash2``: DFlash2 (z-lab/Inco AI): the same backbone
    plus a two-tap dynamic depthwise convolution around each attention and MLP sublayer and a
    candidate selector that picks each draft among the top ``selector_top_k`` tokens of its
    slot given the token before it (see docs/dflash2.md). ``dspark``: DSpark (DeepSeek): the
    same backbone plus a low-rank Markov head that adds a bias from the token before each slot,
    the block drafted left to right, and an optional confidence head (see docs/dspark.md)."""
    selector_rank: int | None = ranged(None, ge=1, le=8192, none="for 256 (model.variant: dflash2 only)")
    """DFlash2: rank of the selector's predecessor/successor codebooks (each vocabulary x rank)."""
    selector_top_k: int | None = ranged(None, ge=1, le=1024, none="for 16 (model.variant: dflash2 only)")
    """DFlash2: candidates per block slot (the top-k of the drafter's logits); at most the
    target's vocabulary."""
    conv_group_size: int | None = ranged(None, ge=1, le=65536,
                                         none="for 16 (model.variant: dflash2 only)")
    """DFlash2: channels that share one dynamic kernel coefficient; must divide the hidden size."""
    markov_rank: int | None = ranged(None, ge=1, le=8192, none="for 256 (model.variant: dspark only)")
    """DSpark: rank of the Markov head (``markov_w1`` and ``markov_w2``, each vocabulary x rank)."""
    enable_confidence_head: bool | None = None
    """DSpark: add the confidence head, which estimates each draft's acceptance (drafting does
    not read it; vLLM's adaptive verification does); default true with ``model.variant: dspark``."""
    draft_vocab_size: int | None = ranged(None, ge=1, le=TOKENS_MAX, none="for the target's whole vocabulary")
    """A pruned draft vocabulary: the drafter's LM head keeps the target head's rows of the
    ``draft_vocab_size`` tokens most frequent among the training data's supervised tokens
    (chosen at the start of a run, printed with their coverage; the checkpoint and the export
    keep them, with the ``d2t`` table vLLM and llama.cpp read). Every draft is one of them, and
    the loss and each draft's LM head cost shrink with it. Labels outside it are left out of
    the loss and count as misses. Default: the whole vocabulary."""
    init_from: str | None = None
    """Warm start: an exported drafter folder or a training checkpoint (``step-N``) whose
    weights start the drafter (the run's own ``checkpoint.resume`` still wins). A DFlash
    drafter warm-starts a DFlash2 or a DSpark one: its backbone is copied, the convolutions and
    the selector (DSpark: the Markov head) start at identity, so it first drafts what the DFlash
    drafter drafts. Needs the same target layers and layer sizes; excludes
    ``model.drafter_init`` other than random."""


@resume_rules(equal=("seed", "num_anchors", "grad_accum"),
              recomputed=("epochs", "max_steps"),
              may_change=("max_time_s", "lr", "betas", "eps", "weight_decay", "warmup_ratio", "warmup_steps",
                          "schedule", "decay_ratio", "min_lr", "grad_clip", "gamma", "loss_slots", "labels",
                          "loss_chunk_size", "noise_std", "noise_warmup_steps", "max_nonfinite_steps",
                          "selector_weight", "selector_missing", "markov_weight"))
@dataclass(kw_only=True)
class TrainingConfig:
    """Objective, optimizer and schedule."""

    seed: int = ranged(42, ge=0, le=2**32 - 1)
    epochs: int = ranged(6, ge=1, le=COUNT_MAX)
    max_steps: int | None = ranged(None, ge=1, le=COUNT_MAX, none="for no limit (training.epochs decides)")
    """Stop after this many optimizer steps (overrides ``epochs`` when smaller)."""
    max_time_s: float | None = ranged(None, gt=0, le=DURATION_MAX_S, why="a year", none="for no limit")
    """Stop after this many seconds of training (a final checkpoint is written)."""
    lr: float = ranged(6e-4, gt=0, le=1)
    """Peak AdamW learning rate. Adam moves every weight by about ``lr`` per step, so above 1
    training diverges at once."""
    betas: tuple[float, float] = ranged((0.9, 0.999), ge=0, lt=1)
    """AdamW moment decay rates, each in [0, 1)."""
    eps: float = ranged(1e-8, gt=0, le=1)
    weight_decay: float = ranged(0.0, ge=0, le=1)
    """Decoupled (AdamW) decay: each step shrinks every weight by ``lr * weight_decay``."""
    warmup_ratio: float = ranged(0.04, ge=0, lt=1)
    """Linear warmup over this fraction of optimizer steps."""
    warmup_steps: int | None = ranged(None, ge=0, le=COUNT_MAX, none="to use training.warmup_ratio")
    """Linear warmup over this many optimizer steps (replaces ``warmup_ratio``): for runs
    bounded by ``max_time_s``, whose planned step count says nothing about their length."""
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """Decay after warmup, down to ``min_lr``; ``wsd`` (warmup-stable-decay) holds ``lr`` and
    decays linearly over the last ``decay_ratio`` of the steps only."""
    decay_ratio: float = ranged(0.2, gt=0, le=1)
    """``schedule: wsd``: the final fraction of the optimizer steps over which lr decays."""
    min_lr: float = ranged(0.0, ge=0, le=1)
    """The schedule's final learning rate, at most ``lr``."""
    grad_clip: float = ranged(1.0, gt=0)
    """Global L2 gradient norm clip; its return value is logged as train/grad_norm."""
    grad_accum: int = ranged(1, ge=1, le=65536)
    """Micro-batches per optimizer step."""
    num_anchors: int = ranged(512, ge=1, le=TOKENS_MAX)
    """Random anchors (blocks) per sequence per step."""
    gamma: float | None = ranged(None, gt=0, none="for the reference value of model.block_size")
    """Loss decay over block slots, w_k = exp(-(k-1)/gamma); default 7/5/4 for B = 16/10/8. A
    large gamma (1e9) weights every slot the same."""
    loss_slots: int | None = ranged(None, ge=1, le=255, none="for every slot")
    """Supervise only block slots 1..K (None: all ``block_size - 1``). Inference still drafts
    the whole block; the frozen LM head over every slot is most of a CPU step, and at small
    budgets the acceptance length comes from the first slots."""
    labels: Literal["data", "target_greedy", "kl"] = "data"
    """``data``: dataset tokens (reference); ``target_greedy``: the target's argmax at each
    position; ``kl``: distil the target's distribution."""
    loss_chunk_size: int = ranged(256, ge=1, le=TOKENS_MAX)
    """Block slots per LM-head/cross-entropy chunk (bounds the logits memory: on CPU 256
    peaked at 1.01 GiB where 1024 peaked at 1.40 GiB, at the same speed)."""
    noise_std: float = ranged(0.0, ge=0, le=1000)
    """Hidden-state noise augmentation (EAGLE extension, off in the DFlash recipe)."""
    noise_warmup_steps: int = ranged(0, ge=0, le=COUNT_MAX)
    """Ramp the noise linearly from 0 to ``noise_std`` over this many steps."""
    max_nonfinite_steps: int = ranged(10, ge=1, le=COUNT_MAX)
    """Stop after this many consecutive steps with a non-finite loss or gradient norm."""
    selector_weight: float | None = ranged(None, ge=0, le=1000, none="for 1 (model.variant: dflash2 only)")
    """DFlash2: weight of the candidate selector's loss (cross-entropy over each slot's top-k
    candidates given the true previous token) added to the full-vocabulary loss; 0 trains the
    backbone alone (the selector then keeps its initialisation)."""
    selector_missing: Literal["exclude", "insert"] | None = None
    """DFlash2: a label outside the slot's candidates is left out of the selector loss
    (``exclude``, the default) or replaces the lowest candidate in that loss only
    (``insert``)."""
    markov_weight: float | None = ranged(None, ge=0, le=1000, none="for 1 (model.variant: dspark only)")
    """DSpark: weight of the Markov-corrected loss (the same loss on the logits plus the Markov
    bias after the true previous token) added to the backbone's loss; 0 trains the backbone
    alone (the Markov head then keeps its zero bias)."""


@resume_rules(equal=("num_buckets", "bucket_boundaries", "tokens_per_batch", "max_batch_size", "max_run",
                     "order"),
              recomputed=("device",),
              may_change=("prefetch_workers", "batch_queue_size", "feature_queue_size", "num_threads",
                          "target_threads", "round_shapes"))
@dataclass(kw_only=True)
class PipelineConfig:
    """Batching and the threaded pipeline."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_buckets: int = ranged(6, ge=1, le=1024)
    bucket_boundaries: list[int] | None = ranged(None, ge=1, le=TOKENS_MAX, none="for quantiles of the data",
                                                 unique=True)
    """Explicit upper length bounds per bucket; default equal-count quantiles of the data."""
    tokens_per_batch: int = ranged(4096, ge=1, le=2**24)
    """Token budget per batch, counting padding (rows * padded length)."""
    max_batch_size: int | None = ranged(None, ge=1, le=TOKENS_MAX, none="for no cap")
    """Cap on sequences per batch."""
    max_run: int = ranged(2, ge=1, le=COUNT_MAX)
    """Most consecutive steps from one bucket while another has batches left."""
    order: Literal["interleave", "shuffle"] = "interleave"
    """Step order of the bucketed batches: ``interleave`` draws buckets diversity-first within
    ``max_run``; ``shuffle`` is a plain shuffle of the same batches (for comparison: it lets
    one large bucket run for several steps; see docs/interleave.md)."""
    prefetch_workers: int = ranged(2, ge=1, le=256)
    """Threads that build batches (each holds its batches in memory)."""
    batch_queue_size: int = ranged(4, ge=1, le=1024)
    """Batches buffered ahead of the target stage."""
    feature_queue_size: int = ranged(2, ge=1, le=1024)
    """Target feature batches buffered ahead of the drafter."""
    num_threads: int | None = ranged(None, ge=1, le=1024, none="for the default")
    """torch intra-op threads; default half the cores on CPU (the target stage and the drafter
    loop run at the same time), torch's own choice on GPU."""
    target_threads: int | None = ranged(None, ge=1, le=1024, none="for pipeline.num_threads")
    """torch intra-op threads of the target stage's thread alone, for a CPU where the target's
    forward bounds the step (the drafter waits for features: ``perf/data_wait_frac``); see
    docs/performance.md."""
    # always/never, not on/off: YAML (and so a command-line override) reads on/off as booleans.
    round_shapes: Literal["auto", "always", "never"] = "auto"
    """Pad the drafter's context width and anchor count up to a fixed set of sizes (printed at
    start-up), so that compiled FlexAttention sees a bounded number of shapes; ``auto``: when
    the drafter attends with FlexAttention (CUDA). The loss is the same either way."""


@resume_rules(may_change=("every_steps", "every_s", "wandb", "wandb_project", "wandb_entity", "run_name",
                          "tags", "tensorboard", "console"))
@dataclass(kw_only=True)
class LoggingConfig:
    """Metrics and trackers."""

    every_steps: int = ranged(10, ge=1, le=COUNT_MAX)
    every_s: float | None = ranged(None, gt=0, le=DURATION_MAX_S, why="a year", none="to log by steps only")
    """Also log when this many seconds passed since the last log."""
    wandb: Literal["online", "offline", "disabled"] = "disabled"
    wandb_project: str = "dflash-trainer"
    wandb_entity: str | None = None
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)
    tensorboard: bool = True
    console: bool = True


@resume_rules(may_change=("every_steps", "every_minutes", "keep_last", "resume", "async_save"))
@dataclass(kw_only=True)
class CheckpointConfig:
    """Periodic asynchronous checkpoints and resume."""

    every_steps: int | None = ranged(None, ge=1, le=COUNT_MAX, none="for no step interval")
    every_minutes: float | None = ranged(None, gt=0, le=DURATION_MAX_S / 60, why="a year", none="for no time interval")
    keep_last: int = ranged(3, ge=1, le=COUNT_MAX)
    resume: str | None = None
    """``auto`` (latest in the run dir, if any) or a checkpoint path."""
    async_save: bool = True


@resume_rules(may_change=("prompts", "suite", "suite_prompts", "num_prompts", "max_new_tokens", "temperature",
                          "every_steps", "final", "in_training_prompts", "first_turn_only", "engine_threads",
                          "engine_startup_timeout_s", "llama_cpp_build", "llama_cpp_target", "vllm_venv"))
@dataclass(kw_only=True)
class EvalConfig:
    """Speculative-decoding evaluation."""

    prompts: str = "mtbench"
    """A prompt set (``mtbench``, ``humaneval``, ``math``, ``sharegpt-heldout``) or a JSONL file of prompts."""
    suite: list[str] = field(default_factory=lambda: ["mtbench", "humaneval", "math"])
    """The domains of ``eval --suite``: prompt sets or JSONL files, each reported on its own."""
    suite_prompts: int = ranged(10, ge=1, le=COUNT_MAX)
    """First turns per domain in ``eval --suite``, spread evenly over each set."""
    num_prompts: int | None = ranged(None, ge=1, le=COUNT_MAX, none="for every prompt")
    max_new_tokens: int = ranged(256, ge=1, le=TOKENS_MAX)
    temperature: float = ranged(0.0, ge=0, le=100)
    """0 is greedy decoding; above 100 every token is about equally likely."""
    every_steps: int | None = ranged(None, ge=1, le=COUNT_MAX, none="to evaluate only at the end")
    """In-training eval interval; None evaluates only at the end (``eval.final``)."""
    final: bool = True
    """``train`` evaluates the final drafter when it completes: the first turns of the first
    ``eval.in_training_prompts`` prompts of ``eval.prompts`` (``sharegpt-heldout``: the run's
    held-out data), greedy, ``eval.max_new_tokens`` each; tau, the lossless check and the
    speedup go to ``metrics.jsonl`` (``eval/*``), ``RUN_DIR/eval/final/`` and the report. A run
    from ``features.store`` loads the whole target for it at the end; where the trainer cannot
    hold it (``engine.kind=vllm``, ``distributed.target=fsdp``) it prints how to run
    ``dflash-trainer eval`` instead."""
    in_training_prompts: int = ranged(8, ge=1, le=COUNT_MAX)
    """Prompts of the in-training and the final evaluation."""
    first_turn_only: bool = False
    engine_threads: int | None = ranged(None, ge=1, le=4096, none="for every core")
    """Threads of each ``llama-server`` in ``eval --engine`` (one request runs at a time)."""
    engine_startup_timeout_s: float = ranged(1500.0, gt=0, le=DURATION_MAX_S, why="a year")
    """Seconds ``eval --engine`` waits for an engine's server to become ready."""
    llama_cpp_build: str | None = None
    """llama.cpp build folder of ``eval --engine``, built from the pinned PyPI sdist when missing;
    default ``$XDG_CACHE_HOME/dflash-trainer/llama-cpp``."""
    llama_cpp_target: Literal["q4_1", "f32"] = "q4_1"
    """The embedded target as llama.cpp serves it: ``q4_1`` the GGUF it ships, ``f32`` its HF
    folder converted (any other target is converted to f32)."""
    vllm_venv: str = ".venv-vllm"
    """The vLLM virtualenv of ``eval --engine vllm`` (``make serve-check`` builds it)."""


@resume_rules(recomputed=("drafter", "target"), may_change=("backend", "timeout_s"))
@dataclass(kw_only=True)
class DistributedConfig:
    """torch.distributed wrapping (launch with torchrun)."""

    drafter: Literal["ddp", "fsdp"] = "ddp"
    target: Literal["replicate", "fsdp"] = "replicate"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float = ranged(1800.0, gt=0, le=DURATION_MAX_S, why="a year")
    """How long a collective (and the wait while rank 0 tokenizes the data) may block before
    the rank fails with an error naming it, instead of waiting forever for a stuck rank."""


@resume_rules(may_change=("store", "dtype", "shard_mb"))
@dataclass(kw_only=True)
class FeaturesConfig:
    """The feature store: the target's features computed once (``dflash-trainer features``) and
    read by ``train`` instead of running the target (docs/features.md)."""

    store: str | None = None
    """Feature store folder: ``features`` writes it, ``train`` reads it instead of running the
    target (None: ``train`` runs the target)."""
    dtype: Literal["bfloat16", "float32", "float8_e4m3fn"] = "bfloat16"
    """How ``features`` stores hidden states (float8 halves the store again, with a per-token scale)."""
    shard_mb: float = ranged(1024.0, gt=0, le=1 << 20)
    """Target size of one shard file of ``features`` in MiB."""


@resume_rules(may_change=("kind", "url", "venv", "exchange_dir", "max_inflight", "request_timeout_s",
                          "startup_timeout_s", "enforce_eager", "extra_args"))
@dataclass(kw_only=True)
class EngineConfig:
    """Who runs the target's forward for ``train`` and ``features`` (docs/features.md, "The
    target served by vLLM")."""

    kind: Literal["transformers", "vllm"] = "transformers"
    """``transformers``: the trainer runs the target itself; ``vllm``: a vLLM server computes the
    hidden states (prefill-only requests through its ``extract_hidden_states`` method)."""
    url: str | None = None
    """A vLLM server to use instead of starting one (it must run the project's hidden-states
    connector: ``dflash-trainer features --print-engine-command`` prints its command line)."""
    venv: str = ".venv-vllm"
    """The vLLM virtualenv a started server runs in (``make serve-check`` builds it)."""
    exchange_dir: str | None = None
    """Folder the engine writes each request's hidden states to and the trainer reads and deletes
    them from (default: ``engine-exchange`` in the run folder or the store folder); a server
    given by ``url`` must see it at the same path."""
    max_inflight: int = ranged(8, ge=1, le=4096)
    """Requests sent to the engine and not yet read back: bounds the engine's queue and the files
    on disk, and pauses the requests when training falls behind."""
    request_timeout_s: float = ranged(300.0, gt=0, le=DURATION_MAX_S, why="a year")
    """Seconds one request may take before the engine counts as hung (training stops with a
    final checkpoint)."""
    startup_timeout_s: float = ranged(900.0, gt=0, le=DURATION_MAX_S, why="a year")
    """Seconds a started server may take to become ready."""
    enforce_eager: bool = True
    """Start vLLM without torch.compile and CUDA graphs (fast start; off for a GPU engine)."""
    extra_args: list[str] = field(default_factory=list)
    """More command-line arguments for a started server (``--tensor-parallel-size 4`` ...)."""


@resume_rules(may_change=("run_dir",))
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
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        validate(self)


def default_gamma(block_size: int) -> float:
    """Loss decay of the reference for a block size (7 for 16, 5 for 10, 4 for 8)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7.0 / 16.0))


@functools.cache
def option_ranges(cls: type = Config, prefix: str = "") -> dict[str, tuple[Any, Range | None]]:
    """Dotted key -> (annotation, declared :class:`Range` or None) of every leaf option (read-only)."""
    out: dict[str, tuple[Any, Range | None]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(option_ranges(tp, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = (tp, f.metadata.get("range"))
    return out


@functools.cache
def option_resume_rules(cls: type = Config, prefix: str = "") -> dict[str, str | None]:
    """Dotted key -> resume rule (see :func:`resume_rules`; None: none declared) of every leaf
    option, in the order of the config (read-only)."""
    out: dict[str, str | None] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(option_resume_rules(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = f.metadata.get("resume")
    return out


def _is_list(tp: Any) -> bool:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        return _is_list(args[0])
    return typing.get_origin(tp) in (list, tuple)


def _scalar_type(tp: Any) -> Any:
    """The element type of an option: ``int`` for ``list[int] | None``, ``float`` for
    ``tuple[float, float]``; the type itself for a scalar."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return _scalar_type(args[0]) if len(args) == 1 else tp
    if typing.get_origin(tp) in (list, tuple):
        assert len({a for a in args if a is not Ellipsis}) == 1, f"mixed element types in {tp!r}"
        return args[0]
    return tp


def is_numeric(tp: Any) -> bool:
    """Whether an option (or each of its elements) is an int or a float, and so needs a range."""
    return _scalar_type(tp) in (int, float)


def check_unique(key: str, values: list[Any] | tuple[Any, ...]) -> None:
    """Raise :class:`ConfigError` naming ``key`` when a list option names a member twice."""
    repeated = sorted({v for v in values if list(values).count(v) > 1})
    if repeated:
        raise ConfigError(f"{key}={list(values)} names {', '.join(map(str, repeated))} more than once; "
                          "name each once")


def check_ranges(cfg: Config) -> None:
    """Refuse any option outside its declared range, or an empty text, with a ConfigError
    naming the key (``training.betas[0]`` for an element of a list)."""
    for key, (tp, rng) in option_ranges().items():
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if value is None:
            continue
        items = ([(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, (list, tuple))
                 else [(key, value)])
        scalar = _scalar_type(tp)
        if scalar in (int, float):
            assert rng is not None, f"config option {key} declares no range: give it ranged(...)"
            if isinstance(value, (list, tuple)):
                if rng.unique:
                    check_unique(key, value)
                rng = dataclasses.replace(rng, none="", unique=False)  # both are of the whole list
            for name, item in items:
                rng.check(name, item)
        elif scalar is str:
            for name, item in items:
                check_text(name, item)


def is_http_url(url: str) -> bool:
    """Whether ``url`` is an ``http://`` or ``https://`` address with a host (and a valid port)."""
    try:
        parts = urllib.parse.urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def validate(cfg: Config) -> None:
    """Range checks of every option, then cross-field checks; raise ConfigError naming the field."""
    check_ranges(cfg)
    checks: list[tuple[bool, str]] = [
        (cfg.data.max_length > cfg.model.block_size,
         "data.max_length must be larger than model.block_size"),
        (cfg.training.min_lr <= cfg.training.lr, "training.min_lr must be <= training.lr"),
        (cfg.training.loss_slots is None or cfg.training.loss_slots < cfg.model.block_size,
         f"training.loss_slots must be between 1 and model.block_size - 1 ({cfg.model.block_size - 1}), "
         f"got {cfg.training.loss_slots}"),
        (cfg.features.store is None or cfg.eval.every_steps is None,
         "eval.every_steps needs the whole target, which training from features.store does not load; "
         "unset eval.every_steps and run dflash-trainer eval on the exported drafter"),
        (cfg.engine.kind == "transformers" or cfg.eval.every_steps is None,
         "eval.every_steps needs the whole target in the trainer, which engine.kind=vllm does not load; "
         "unset eval.every_steps and run dflash-trainer eval on the exported drafter"),
        (cfg.engine.kind == "vllm" or cfg.engine.url is None,
         f"engine.url={cfg.engine.url!r} is set but engine.kind is {cfg.engine.kind}; set engine.kind=vllm"),
        (cfg.engine.url is None or is_http_url(cfg.engine.url),
         f"engine.url={cfg.engine.url!r} is not an http(s) URL; give the vLLM server's address, e.g. "
         "engine.url=http://127.0.0.1:8000 (or unset it to start a server)"),
        (len(cfg.data.paths) > 0, "data.paths is empty; give data files or folders (data.paths or --data), "
         "or `sharegpt`"),
        (cfg.engine.kind == "transformers" or cfg.distributed.target == "replicate",
         "distributed.target=fsdp shards a target the trainer runs; with engine.kind=vllm the engine holds "
         "the target: use the engine's own parallelism (engine.extra_args) and distributed.target=replicate"),
        (cfg.pipeline.tokens_per_batch >= cfg.data.max_length,
         f"pipeline.tokens_per_batch ({cfg.pipeline.tokens_per_batch}) must be >= "
         f"data.max_length ({cfg.data.max_length}) so the longest sample fits a batch"),
    ]
    fields = cfg.data.fields
    fields.role_map()
    if fields.messages is None:
        unused = [f"data.fields.{k}" for k in ("role", "content") if getattr(fields, k) is not None]
        checks.append((not unused, f"{' and '.join(unused)} name message keys, but data.fields.messages (the "
                                   "record key holding the messages) is not set; set it too"))
    else:
        checks.append((cfg.data.format in ("auto", "hf"),
                       f"data.fields.messages={fields.messages!r} is the layout of every record, but "
                       f"data.format={cfg.data.format} requires another; set data.format=auto"))
    bounds = cfg.pipeline.bucket_boundaries
    if bounds is not None:
        checks.append((list(bounds) == sorted(set(bounds)) and len(bounds) > 0,
                       "pipeline.bucket_boundaries must be strictly increasing"))
    if cfg.model.variant != "dflash2":
        dflash2_only = [f"{section}.{name}" for section, name in (
            ("model", "selector_rank"), ("model", "selector_top_k"), ("model", "conv_group_size"),
            ("training", "selector_weight"), ("training", "selector_missing"))
            if getattr(getattr(cfg, section), name) is not None]
        are = "is a DFlash2 option" if len(dflash2_only) == 1 else "are DFlash2 options"
        checks.append((not dflash2_only,
                       f"{', '.join(dflash2_only)} {are}, but model.variant is {cfg.model.variant}; "
                       f"set model.variant=dflash2 or remove {'it' if len(dflash2_only) == 1 else 'them'}"))
    if cfg.model.variant != "dspark":
        dspark_only = [f"{section}.{name}" for section, name in (
            ("model", "markov_rank"), ("model", "enable_confidence_head"), ("training", "markov_weight"))
            if getattr(getattr(cfg, section), name) is not None]
        are = "is a DSpark option" if len(dspark_only) == 1 else "are DSpark options"
        checks.append((not dspark_only,
                       f"{', '.join(dspark_only)} {are}, but model.variant is {cfg.model.variant}; "
                       f"set model.variant=dspark or remove {'it' if len(dspark_only) == 1 else 'them'}"))
    if cfg.model.init_from is not None:
        checks.append((cfg.model.drafter_init == "random",
                       f"model.init_from and model.drafter_init={cfg.model.drafter_init} both set the drafter's "
                       "first weights; set only one"))
    ids = cfg.model.target_layer_ids
    if ids is not None:
        checks.append((len(ids) > 0, "model.target_layer_ids must be a non-empty list of layer indices >= 0"))
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "none"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        count = f"{len(args)} " if origin is tuple and Ellipsis not in typing.get_args(tp) else ""
        return f"list of {count}{_type_name(args[0])}"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted where lossless."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str)
                                                     and value.strip().lower() in ("none", "null"))):
            return None  # YAML reads only null and ~ as None; the messages say "none"
        members = [a for a in args if a is not type(None)]
        if (len(members) == 1 and isinstance(value, (list, tuple))
                and typing.get_origin(members[0]) in (list, tuple)):
            return _coerce(value, members[0], key)  # the element's own error names it: key[i]
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


class _DuplicateKey(yaml.MarkedYAMLError):
    """A mapping that gives one key twice."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, refusing a key given twice in one mapping: PyYAML keeps the last one,
    so a second ``training:`` section would drop the first without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # keys merged in with << are meant to be overridden
            key = self.construct_object(key_node, deep=True)
            if key in first:
                raise _DuplicateKey(problem=f"key {key!r} given twice (first at line "
                                            f"{first[key].start_mark.line + 1}); YAML would keep only the "
                                            "last: merge them into one", problem_mark=key_node.start_mark)
            first[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(path: Path, exc: yaml.MarkedYAMLError) -> str:
    """``FILE:LINE:COLUMN: not valid YAML: PROBLEM`` (one line) of a YAML error with a position."""
    mark = exc.problem_mark or exc.context_mark
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = " ".join(part for part in (exc.context, exc.problem) if part)
    kind = "" if isinstance(exc, _DuplicateKey) else "not valid YAML: "
    return f"{where}: {kind}{problem}"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a config from a YAML file (optional) and apply dotted overrides."""
    return _build(Config, _raw_config(path, overrides), "")


def explicit_keys(path: str | Path | None = None, overrides: list[str] | None = None) -> set[str]:
    """The dotted keys that the YAML file and the overrides set (the rest keep their defaults)."""
    def keys(node: dict[str, Any], prefix: str) -> set[str]:
        out: set[str] = set()
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            out |= keys(value, dotted + ".") if isinstance(value, dict) else {dotted}
        return out

    return keys(_raw_config(path, overrides), "")


def _raw_config(path: str | Path | None, overrides: list[str] | None) -> dict[str, Any]:
    """The YAML file's mapping (optional) with the dotted overrides applied, not yet checked."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"--config {str(p)!r} is a folder; give a YAML file (e.g. "
                              "configs/demo-cpu.yaml)")
        if not os.path.lexists(p):
            shipped = bundled_config(p)
            if shipped is None:
                raise ConfigError(f"config file {str(p)!r} does not exist; give a YAML file or one of the "
                                  f"shipped configs ({', '.join(bundled_names()) or 'none installed'})")
            p = shipped
        check_input(p, what="--config", kind="file", error=ConfigError)
        try:
            loaded = yaml.load(p.read_text(encoding="utf-8-sig"), Loader=_UniqueKeyLoader)  # a SafeLoader
        except yaml.MarkedYAMLError as exc:
            raise ConfigError(_yaml_problem(p, exc)) from exc
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
    _removed_keys(raw)
    return raw


def _removed_keys(raw: dict[str, Any]) -> None:
    """Refuse a key that was replaced, saying what to write instead.

    ``model.init_from_target`` became ``model.drafter_init: last_layers``. Its ``false``, which
    the ``config.yaml`` of every earlier run holds, changes nothing and is dropped, so that such
    a file still loads.
    """
    model = raw.get("model")
    if not isinstance(model, dict) or "init_from_target" not in model:
        return
    value = model.pop("init_from_target")
    if value not in (False, None, "false"):
        raise ConfigError(f"model.init_from_target={value!r} was replaced by model.drafter_init: "
                          "write model.drafter_init=last_layers (drafter_init: last_layers under "
                          "model: in a YAML file) instead")


def upgrade_saved_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A config dict saved by an earlier version (a checkpoint's), in today's keys:
    ``model.init_from_target: true`` is ``model.drafter_init: last_layers``; a config from
    before ``model.variant`` describes a DFlash drafter."""
    model = dict(saved.get("model") or {})
    if model.pop("init_from_target", False):
        model["drafter_init"] = "last_layers"
    model.setdefault("variant", "dflash")
    return {**saved, "model": model}


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


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal under a field) of a dataclass (parsed once: every
    command's parser shows them)."""
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
    """(dotted key, type and valid range, default, doc) of every option, for ``--help``."""
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
        rng = f.metadata.get("range")
        each = "each " if _is_list(tp) else ""
        if rng is not None:
            kind = f"{_type_name(tp)}; {each}{rng.explain()}"
        else:
            kind = _type_name(tp) + (f"; {each}not empty" if _scalar_type(tp) is str else "")
        rows.append((key, kind, repr(default), docs.get(f.name, "")))
    return rows
