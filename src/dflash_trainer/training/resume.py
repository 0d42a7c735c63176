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

from dflash_trainer.config import Config, config_to_dict, upgrade_saved_config
from dflash_trainer.core.distributed import DistInfo
from dflash_trainer.core.errors import ConfigError, UserError
from dflash_trainer.core.fsutil import step_of
from dflash_trainer.data.buckets import Plan, build_plan
from dflash_trainer.data.resize import Resize, ResizedPlans
from dflash_trainer.training.checkpoint import ResumeError, checkpoint_names, load_state, resolve_resume
from dflash_trainer.training.components import EpochPlans, run_progress, run_steps
from dflash_trainer.training.export import check_fits_target, read_drafter_config
from dflash_trainer.training.optim import rescaled

log = logging.getLogger(__name__)

# Settings a resumed run must share with its checkpoint: they decide the data order, the
# model shape and the meaning of the saved optimizer state.
RESUME_KEYS = ("data", "model", "pipeline.num_buckets", "pipeline.bucket_boundaries",
               "pipeline.tokens_per_batch", "pipeline.max_batch_size", "pipeline.max_run", "pipeline.order",
               "training.seed", "training.num_anchors", "training.grad_accum")
# Inside RESUME_KEYS but free to change: where things are stored, not what they are.
RESUME_FREE = frozenset({"data.cache_dir"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resume:
    """What a run starts from, the same on every rank: a checkpoint (``folder``) or nothing."""

    folder: Path | None
    """The validated checkpoint folder; None: a fresh run."""
    saved: dict[str, Any]
    """The checkpoint's state (``state.pt``, rank 0's; empty for a fresh run)."""
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
        return int(self.saved.get("step", 0))

    @property
    def cursor(self) -> dict[str, Any] | None:
        """The data cursor (rank 0's prefetcher state), for this run's world size."""
        return self.saved.get("prefetch")


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
    node: Any = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def _differences(old: Any, new: Any, key: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, old, new) of every leaf that differs between two config subtrees."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [diff for k in sorted(set(old) | set(new))
                for diff in _differences(old.get(k), new.get(k), f"{key}.{k}")]
    return [] if old == new else [(key, old, new)]


def check_resume_compatible(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse a resume whose data order or model differ from the checkpoint (another world size
    is resumed, see :mod:`dflash_trainer.data.resize`)."""
    for key in RESUME_KEYS:
        for leaf, old, new in _differences(_pick(saved, key), _pick(current, key), key):
            if leaf not in RESUME_FREE:
                raise ResumeError(f"cannot resume: {leaf} was {old!r} in the checkpoint and is "
                                  f"{new!r} now; resume with the checkpoint's config.yaml")


def _plans(cfg: Config, lengths: Any, world_size: int, saved: dict[str, Any]) -> tuple[Any, list[Resize], bool]:
    """The run's plans from the checkpoint's ``saved`` state: (plans, the resizes of the data
    cursor's epoch, whether this resume changes the world size). Raises ValueError when the
    samples left in that epoch cannot feed every rank."""
    plans = EpochPlans(lengths, cfg, world_size)
    if not saved:
        return plans, [], False
    cursor = saved["prefetch"]
    resizes = [Resize(**r) for r in saved.get("resizes", []) if r["epoch"] == cursor["epoch"]]
    resized = saved["world_size"] != world_size
    if resized:
        resizes.append(Resize(epoch=cursor["epoch"], step=cursor["step"], old=saved["world_size"],
                              new=world_size))
    if not resizes:
        return plans, [], False

    def build(epoch: int, size: int) -> Plan:
        return build_plan(lengths, cfg.pipeline, seed=cfg.training.seed, epoch=epoch, world_size=size)

    resized_plans = ResizedPlans(plans, resizes, build)
    resized_plans(cursor["epoch"])  # the resize itself, which may be refused
    return resized_plans, resizes, resized


def _choose(cfg: Config, dist: DistInfo, *, target_config: Any, tokenizer: Any,
            data: Any) -> tuple[Path | None, dict[str, Any]]:
    """Rank 0: the validated checkpoint folder to resume from and its state (None, {}: a fresh
    start), checked against this run's config, target, data and world size."""
    ckpt_dir = Path(cfg.run_dir) / "checkpoints"
    folder = resolve_resume(cfg.checkpoint.resume, ckpt_dir)
    if folder is None:
        return None, {}
    state = load_state(folder)
    if "drafter" in state:  # the weights inside state.pt: the layout before DCP shards
        raise ResumeError(
            f"cannot resume from {folder}: it is a checkpoint in the earlier single-file "
            f"layout (state.pt with the weights), which this version does not resume; start "
            f"a new run (another run_dir, or --overwrite) from its weights with "
            f"model.init_from={folder / 'drafter'} (the optimizer state and data position "
            f"start over)")
    check_resume_compatible(upgrade_saved_config(state["config"]), config_to_dict(cfg))
    check_fits_target(read_drafter_config(folder / "drafter"), target_config, tokenizer,
                      drafter=f"checkpoint.resume={folder}", target=cfg.model.target,
                      fix="resume with the target it was trained on", error=ResumeError)
    check_same_data(state.get("data"), data_identity(data), folder=folder)
    step = int(state["step"])
    if state["world_size"] != dist.world_size:
        try:
            _plans(cfg, data.lengths, dist.world_size, state)
        except ValueError as exc:
            raise ResumeError(f"cannot resume {folder} with {dist.world_size} rank(s): {exc}; "
                              f"resume with fewer ranks, or from another checkpoint") from exc
        cursor = state["prefetch"]
        print(f"resuming a checkpoint of {state['world_size']} rank(s) with {dist.world_size}: "
              f"the batches left in epoch {cursor['epoch']} from step {cursor['step']} on are "
              f"dealt to the {dist.world_size} rank(s); later epochs are planned for them", flush=True)
    newer = sorted(p.name for p in ckpt_dir.glob("step-*") if p.is_dir() and (step_of(p) or 0) > step)
    if newer:
        log.warning("resuming from step %d: newer checkpoints %s belong to the abandoned "
                    "continuation and will be replaced as this run reaches their steps",
                    step, ", ".join(newer))
    print(f"resumed from {folder} at step {step}", flush=True)
    # The other ranks read their own streams; this verdict is broadcast.
    return folder, {key: value for key, value in state.items() if key != "rng"}


def _verdict(cfg: Config, dist: DistInfo, *, target_config: Any, tokenizer: Any,
             data: Any) -> tuple[Path | None, dict[str, Any]]:
    """Rank 0's choice (:func:`_choose`), the same on every rank: one broadcast of the folder
    and its state, or of the refusal, which every rank raises (printed by rank 0 alone)."""
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


def decide(cfg: Config, dist: DistInfo, *, target_config: Any, tokenizer: Any, data: Any) -> Resume:
    """The run's :class:`Resume` for ``checkpoint.resume`` (every rank, collectively): refused
    with a :class:`ResumeError` on every rank, or the plans, total steps and LR schedule state
    that ``components.build`` builds with."""
    folder, saved = _verdict(cfg, dist, target_config=target_config, tokenizer=tokenizer, data=data)
    plans, resizes, resized = _plans(cfg, data.lengths, dist.world_size, saved)
    total = run_steps(plans, cfg.training)
    if folder is None:
        return Resume(folder=None, saved={}, plans=plans, total_steps=total, schedule=None, resizes=[])
    schedule = saved["loop"]["schedule"]
    if resized:
        cursor = saved["prefetch"]
        schedule = rescaled(step=int(saved["step"]), total_steps=run_steps(plans.plans, cfg.training),
                            end_step=total, progress=run_progress(plans, cfg.training, epoch=cursor["epoch"],
                                                                  step=cursor["step"]))
        saved = {**saved, "prefetch": {**cursor, "world_size": dist.world_size}}
    log.info("resuming from %s at optimizer step %d", folder, int(saved["step"]))
    return Resume(folder=folder, saved=saved, plans=plans, total_steps=total, schedule=schedule,
                  resizes=resizes, resized=resized)
