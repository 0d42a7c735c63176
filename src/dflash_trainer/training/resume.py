"""The resume of a run, decided before anything is built for it.

:func:`check_run_folder` refuses at once what the folder alone decides (a fresh run over an
earlier one, ``--overwrite`` with a resume). :func:`decide` then takes ``checkpoint.resume``
against the loaded target and data: rank 0 alone chooses and validates the checkpoint
(manifest, sizes, checksums), checks its config, target, data content and world size against
this run, and broadcasts one verdict, so the other ranks neither hash the files nor report the
same refusal again. From the verdict every rank computes the same :class:`Resume`: the epoch
plans (the interrupted epoch dealt to this world size when it changed), the run's total steps
and the LR schedule's state. ``components.build`` builds with them; nothing built is changed
afterwards, and the trainer only loads the checkpoint's state into what was built.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.config import (EQUAL, RECOMPUTED, Config, TrainingConfig, config_to_dict, option_resume_rules,
                                   upgrade_saved_config)
from dflash_trainer.core.distributed import DistInfo
from dflash_trainer.core.errors import ConfigError, UserError
from dflash_trainer.core.fsutil import step_of
from dflash_trainer.data.buckets import Plan, build_plan
from dflash_trainer.data.resize import Resize, ResizedPlans
from dflash_trainer.training.checkpoint import ResumeError, checkpoint_names, read_state, resolve_resume
from dflash_trainer.training.components import EpochPlans, run_progress, run_steps
from dflash_trainer.training.export import check_fits_target, read_drafter_config
from dflash_trainer.training.optim import rescaled, schedule_end, schedule_lr

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True, kw_only=True)
class Resume:
    """What a run starts from, the same on every rank: a checkpoint (``folder``) or nothing."""

    folder: Path | None
    """The validated checkpoint folder; None: a fresh run."""
    run: dict[str, Any]
    """The checkpoint's run record (``training.state``'s ``run``: step, epoch, config, world
    size, resizes, data identity, best checkpoint, tracker run id); empty for a fresh run."""
    cursor: dict[str, Any] | None
    """The data cursor: rank 0's prefetcher position, for this run's world size (None: fresh)."""
    plans: EpochPlans | ResizedPlans
    """Every epoch's plan for this run."""
    total_steps: int
    """Optimizer steps of the run over ``plans`` (:func:`~components.run_steps`)."""
    schedule: dict[str, Any] | None
    """The LR schedule's state to build with (None: a fresh schedule)."""
    resizes: list[Resize]
    """World size changes in the epoch of the data cursor, this resume's included."""
    resized: bool = False
    """This resume changes the world size: the data cursor is the global one and every rank's
    RNG streams are reseeded (a new rank has none saved)."""

    @property
    def step(self) -> int:
        """Optimizer steps done (0 for a fresh run)."""
        return int(self.run.get("step", 0))


def earlier_run(run_dir: Path) -> list[str]:
    """What an earlier run left in ``run_dir`` that a fresh run would overwrite or mix with:
    its checkpoints (complete or not), its metrics and its exported drafter."""
    found = []
    names = checkpoint_names(run_dir / "checkpoints")
    if names:
        found.append(f"checkpoints {', '.join(names)}")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        found.append("metrics.jsonl")
    if (run_dir / "drafter").exists():
        found.append("drafter/")
    return found


def check_run_folder(cfg: Config, *, overwrite: bool) -> None:
    """Refuse a fresh run into a folder that holds an earlier run (its checkpoints, metrics or
    exported drafter), unless ``overwrite``; refuse ``overwrite`` with a resume."""
    run_dir, resume = Path(cfg.run_dir), cfg.checkpoint.resume
    if overwrite and resume:
        raise ConfigError(f"--overwrite starts the run in {run_dir} over; it cannot be "
                          f"combined with checkpoint.resume={resume} (drop one of them)")
    earlier = earlier_run(run_dir)
    if resume or overwrite or not earlier:
        return
    raise ResumeError(
        f"run folder {run_dir} holds an earlier run ({'; '.join(earlier)}); continue it "
        f"with --resume auto (checkpoint.resume=auto), start over with --overwrite (deletes "
        f"them), or choose another run_dir")


def data_identity(data: Any) -> dict[str, Any] | None:
    """What the resume check compares: a token store's content hash, its folder and size (None
    for data passed in without a hash). A store older than the hash is hashed here, once."""
    digest = getattr(data, "content_hash", None)
    if digest is None:
        return None
    return {"sha256": digest, "store": str(getattr(data, "path", "")), "samples": len(data)}


def check_same_data(saved: dict[str, Any] | None, current: dict[str, Any] | None, *,
                    folder: Path) -> None:
    """Refuse a resume whose token store content differs from the checkpoint's (a data file
    edited in place keeps its path, so the config alone cannot tell)."""
    if saved is None or current is None or saved["sha256"] == current["sha256"]:
        return
    raise ResumeError(
        f"cannot resume from {folder}: the training data changed since the checkpoint: its token "
        f"store held {saved['samples']} samples with content sha256 {saved['sha256'][:16]} "
        f"({saved['store']}), the data now gives {current['samples']} samples with "
        f"{current['sha256'][:16]} ({current['store']}); a file in data.paths was changed in "
        f"place. Restore the data the run was started with to resume it, or start over with "
        f"--overwrite (or another run_dir)")


def _pick(cfg: dict[str, Any], dotted: str) -> Any:
    """The value of ``dotted`` in a config dict (None where a saved config lacks it)."""
    node: Any = cfg
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _leaves(cfg: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys of the leaves of a config dict."""
    return [leaf for key, value in cfg.items()
            for leaf in (_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"])]


# The resume itself: every resumed run sets it, so its change says nothing.
_NOT_REPORTED = frozenset({"checkpoint.resume"})


def check_resume_compatible(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Refuse a resume whose config differs from the checkpoint's in an option that must stay
    :data:`~dflash_trainer.config.EQUAL` (the data order, the model, the meaning of the saved
    state), naming the first. Each option declares its rule in ``config.py``; another world
    size is resumed (see :mod:`dflash_trainer.data.resize`).

    Returns one line per option that may change and did (``MAY_CHANGE``, ``RECOMPUTED``) with
    the checkpoint's value and this run's, for the resume to print: a changed lr or logging
    interval takes effect at once, and the user sees that it does."""
    known = option_resume_rules()
    # An option this version does not know (not mapped by upgrade_saved_config): whether it
    # mattered cannot be told, so it counts as one that must stay equal.
    rules = {**known, **{key: EQUAL for key in _leaves(saved) if key not in known}}
    changed = []
    for key, rule in rules.items():
        old, new = _pick(saved, key), _pick(current, key)
        if old == new or key in _NOT_REPORTED:
            continue
        if rule == EQUAL:
            now = f"is {new!r} now" if key in known else "is no option of this version"
            raise ResumeError(f"cannot resume: {key} was {old!r} in the checkpoint and {now}; "
                              f"resume with the checkpoint's config.yaml")
        then = "what depends on it is recomputed" if rule == RECOMPUTED else "applies from the first resumed step"
        changed.append(f"resume: {key} changed from {old!r} (checkpoint) to {new!r}; {then}")
    return changed


def _plans(cfg: Config, lengths: Any, world_size: int, run: dict[str, Any],
           cursor: dict[str, Any] | None) -> tuple[Any, list[Resize], bool]:
    """The run's plans from the checkpoint's run record and data cursor: (plans, the resizes of
    the cursor's epoch, whether this resume changes the world size). Raises ValueError when the
    samples left in that epoch cannot feed every rank."""
    plans = EpochPlans(lengths, cfg, world_size)
    if cursor is None:
        return plans, [], False
    resizes = [Resize(**r) for r in run["resizes"] if r["epoch"] == cursor["epoch"]]
    resized = run["world_size"] != world_size
    if resized:
        resizes.append(Resize(epoch=cursor["epoch"], step=cursor["step"], old=run["world_size"],
                              new=world_size))
    if not resizes:
        return plans, [], False

    def build(epoch: int, size: int) -> Plan:
        return build_plan(lengths, cfg.pipeline, seed=cfg.training.seed, epoch=epoch, world_size=size)

    resized_plans = ResizedPlans(plans, resizes, build)
    resized_plans(cursor["epoch"])  # the resize itself, which may be refused
    return resized_plans, resizes, resized


def _refuse_old_layout(folder: Path) -> None:
    """A checkpoint of an earlier layout (``state.pt`` beside or instead of ``train/``) does not
    resume: one line with the way to continue from its weights."""
    if not (folder / "state.pt").exists():
        return
    raise ResumeError(
        f"cannot resume from {folder}: it is a checkpoint in an earlier layout (state.pt), which "
        f"this version does not resume; start a new run (another run_dir, or --overwrite) from its "
        f"weights with model.init_from={folder / 'drafter'} (the optimizer state and data position "
        f"start over)")


def _choose(cfg: Config, dist: DistInfo, *, target_config: Any, tokenizer: Any,
            data: Any) -> tuple[Path | None, dict[str, Any]]:
    """Rank 0: the validated checkpoint folder to resume from and what the verdict needs of its
    state (None, {}: a fresh start), checked against this run's config, target, data and world
    size."""
    ckpt_dir = Path(cfg.run_dir) / "checkpoints"
    folder = resolve_resume(cfg.checkpoint.resume, ckpt_dir)
    if folder is None:
        return None, {}
    _refuse_old_layout(folder)
    saved = read_state(folder, ("run", "schedule", "data"))
    run, cursor = saved["run"], saved["data"][0]
    changed = check_resume_compatible(upgrade_saved_config(run["config"]), config_to_dict(cfg))
    check_fits_target(read_drafter_config(folder / "drafter"), target_config, tokenizer,
                      drafter=f"checkpoint.resume={folder}", target=cfg.model.target,
                      fix="resume with the target it was trained on", error=ResumeError)
    check_same_data(run["data"], data_identity(data), folder=folder)
    step = int(run["step"])
    if run["world_size"] != dist.world_size:
        try:
            _plans(cfg, data.lengths, dist.world_size, run, cursor)
        except ValueError as exc:
            raise ResumeError(f"cannot resume {folder} with {dist.world_size} rank(s): {exc}; "
                              f"resume with fewer ranks, or from another checkpoint") from exc
        print(f"resuming a checkpoint of {run['world_size']} rank(s) with {dist.world_size}: "
              f"the batches left in epoch {cursor['epoch']} from step {cursor['step']} on are "
              f"dealt to the {dist.world_size} rank(s); later epochs are planned for them", flush=True)
    newer = sorted(p.name for p in ckpt_dir.glob("step-*") if p.is_dir() and (step_of(p) or 0) > step)
    if newer:
        log.warning("resuming from step %d: newer checkpoints %s belong to the abandoned "
                    "continuation and will be replaced as this run reaches their steps",
                    step, ", ".join(newer))
    print(f"resumed from {folder} at step {step}", flush=True)
    for line in changed:
        print(line, flush=True)
    return folder, {"run": run, "schedule": saved["schedule"], "cursor": cursor}


def _verdict(cfg: Config, dist: DistInfo, *, target_config: Any, tokenizer: Any,
             data: Any) -> tuple[Path | None, dict[str, Any]]:
    """Rank 0's choice (:func:`_choose`), the same on every rank: one broadcast of the folder
    and what it read, or of the refusal, which every rank raises (printed by rank 0 alone)."""
    chosen: tuple[Path | None, dict[str, Any]] = (None, {})
    refusal: UserError | None = None
    if dist.is_main:
        try:
            chosen = _choose(cfg, dist, target_config=target_config, tokenizer=tokenizer, data=data)
        except UserError as exc:
            refusal = exc
    if dist.enabled:
        box: list[Any] = [(chosen, None if refusal is None else (type(refusal), str(refusal)))]
        torch.distributed.broadcast_object_list(box, src=0)
        chosen, refused = box[0]
        if refused is not None and refusal is None:
            refusal = refused[0](refused[1])
            refusal.reported_by_rank0 = True  # type: ignore[attr-defined]
    if refusal is not None:
        raise refusal
    return chosen


def describe_schedule(schedule: dict[str, Any], cfg: TrainingConfig, *, step: int, end: int,
                      replanned: str | None) -> str:
    """The one line a resume prints about its LR schedule: the lr of the first and the last
    step still to train (1-based, as the logs count them), and why the curve was re-planned
    (``replanned``; None: the checkpoint's curve goes on)."""
    if step >= end:
        return (f"LR schedule: nothing left to train, the checkpoint is at step {step} and the run "
                f"ends there; raise training.max_steps or training.epochs to extend it")
    first, last = schedule_lr(schedule, step, cfg=cfg), schedule_lr(schedule, end - 1, cfg=cfg)
    how = ("the checkpoint's curve goes on" if replanned is None else
           f"re-planned {replanned}: the rest follows the curve of an uninterrupted run from "
           f"this run's progress and ends at step {end}")
    return f"LR schedule: {how}; lr {first:.3g} at step {step + 1}, {last:.3g} at step {end}"


def decide(cfg: Config, dist: DistInfo, *, target_config: Any, tokenizer: Any, data: Any) -> Resume:
    """The run's :class:`Resume` for ``checkpoint.resume`` (every rank, collectively): refused
    with a :class:`ResumeError` on every rank, or the plans, total steps and LR schedule state
    that ``components.build`` builds with."""
    folder, saved = _verdict(cfg, dist, target_config=target_config, tokenizer=tokenizer, data=data)
    run, cursor = saved.get("run", {}), saved.get("cursor")
    plans, resizes, resized = _plans(cfg, data.lengths, dist.world_size, run, cursor)
    total = run_steps(plans, cfg.training)
    if folder is None:
        return Resume(folder=None, run={}, cursor=None, plans=plans, total_steps=total, schedule=None,
                      resizes=[])
    assert cursor is not None
    step, schedule = int(run["step"]), saved["schedule"]
    ended = schedule_end(schedule)
    if resized or ended != total:
        uninterrupted = plans.plans if isinstance(plans, ResizedPlans) else plans
        schedule = rescaled(step=step, total_steps=run_steps(uninterrupted, cfg.training), end_step=total,
                            progress=run_progress(plans, cfg.training, epoch=cursor["epoch"], step=cursor["step"]))
    if resized:
        cursor = {**cursor, "world_size": dist.world_size}
    if dist.is_main:
        why = [f"for {dist.world_size} rank(s)"] if resized else []
        if ended != total:
            why.append(f"for the new end (the checkpoint's curve ended at step {ended})")
        print(describe_schedule(schedule, cfg.training, step=step, end=total,
                                replanned=" and ".join(why) or None), flush=True)
    log.info("resuming from %s at optimizer step %d", folder, step)
    return Resume(folder=folder, run=run, cursor=cursor, plans=plans, total_steps=total, schedule=schedule,
                  resizes=resizes, resized=resized)
