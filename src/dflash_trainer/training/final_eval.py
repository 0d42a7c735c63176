"""The evaluation a Trainer runs: the factory the command line hands in (training never imports
evaluation), whether the final evaluation of ``eval.final`` can run on this trainer, and the
final evaluation itself (logged, written where the report reads it, summed up in one line)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from dflash_trainer.config import Config
from dflash_trainer.core.assets import resolve_target
from dflash_trainer.core.distributed import DistInfo
from dflash_trainer.model.target import load_target
from dflash_trainer.training.components import Components
from dflash_trainer.training.trackers import Tracker

FINAL_DIR = Path("eval") / "final"
"""Where the final evaluation's results go in the run folder (the report shows it as ``eval/final``)."""


class Evaluator(Protocol):
    """Speculative decoding of the drafter on fixed prompts, on rank 0."""

    def __call__(self, drafter: torch.nn.Module) -> dict[str, Any]:
        """The ``eval/*`` metrics of ``drafter`` (``eval/tau`` among them)."""
        ...

    def write_last(self, out_dir: Path, **fields: Any) -> tuple[Path, str]:
        """Write the latest call's results into ``out_dir``; the results file and a summary line."""
        ...


class EvaluatorFactory(Protocol):
    """Builds the evaluation (``eval.every_steps``, ``eval.final``) from the run's config, target
    and tokenizer; passed in by the command line, so that training never imports evaluation."""

    def __call__(self, cfg: Config, *, target: torch.nn.Module, tokenizer: Any) -> Evaluator: ...


def eval_command(cfg: Config) -> str:
    """What evaluates the run's exported drafter instead."""
    return (f"evaluate the exported drafter with `dflash-trainer eval --config {Path(cfg.run_dir) / 'config.yaml'} "
            f"--drafter {Path(cfg.run_dir) / 'drafter'}`")


def final_eval_obstacle(cfg: Config, dist: DistInfo, parts: Components) -> str | None:
    """Why this trainer cannot evaluate its final drafter, with what to do instead; None when it
    can. The evaluation runs on rank 0 alone with the whole target and its chat template (a
    store run loads the whole target at the end: :func:`load_whole_target`)."""
    instead = eval_command(cfg)
    if parts.engine is not None:
        why = f"the engine (engine.kind={cfg.engine.kind}) holds the target, not the trainer"
    elif dist.enabled and cfg.distributed.target == "fsdp":
        # A sharded drafter is gathered for the export, and that whole copy is evaluated.
        why = "distributed.target=fsdp shards the target over the ranks and the evaluation runs on rank 0 alone"
    elif not getattr(parts.tokenizer, "chat_template", None):
        return ("the target's tokenizer has no chat template to render the evaluation prompts with; "
                "evaluate with a target folder whose tokenizer has one")
    else:
        return None
    return f"{why}; {instead}"


def holds_part_of_target(parts: Components) -> bool:
    """Whether the trainer holds only the target's embedding, final norm and LM head (a run from
    ``features.store``): the final evaluation loads the whole target then."""
    return parts.store is not None


def load_whole_target(cfg: Config, parts: Components) -> torch.nn.Module | str:
    """The whole target on the trainer's device and dtype, for the final evaluation of a store
    run; where it does not fit beside the training state, why, with what to do instead."""
    try:
        target, _ = load_target(str(resolve_target(cfg.model.target)), device=parts.device,
                                dtype=parts.compute_dtype)
    except torch.OutOfMemoryError:
        return (f"the whole target {cfg.model.target} does not fit in {parts.device}'s memory beside the "
                f"training state; {eval_command(cfg)}")
    return target


def evaluate_final(evaluator: Evaluator, drafter: torch.nn.Module, *, cfg: Config, step: int,
                   evaluated: bool, trackers: Tracker) -> str:
    """Evaluate the final ``drafter`` at optimizer ``step`` (unless the in-training evaluation
    has just ``evaluated`` it), log its metrics, write its results into ``RUN_DIR/eval/final``;
    the line that sums it up."""
    if not evaluated:
        trackers.log(evaluator(drafter), step)
    path, summary = evaluator.write_last(Path(cfg.run_dir) / FINAL_DIR, step=step, prompts_source=cfg.eval.prompts)
    return f"final evaluation (step {step}): {summary}; {path}"
