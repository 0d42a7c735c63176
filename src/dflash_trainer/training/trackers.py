"""Metric trackers: W&B, TensorBoard, JSONL and the console, behind one tiny interface.

``build_trackers`` returns a ``Trackers`` fan-out. Rank 0 gets the configured backends; every
other rank gets an empty fan-out, so callers log unconditionally. ``metrics.jsonl`` is always
written: it is the run's own record, read back by ``dflash-trainer report``.

Values are floats or lists of numbers. A list whose key ends in ``_hist`` holds counts
(``eval/acceptance_hist``: counts for acceptance lengths 1..B): a list in JSONL, a histogram in
TensorBoard and W&B. Any other list (``data/step_buckets``: the bucket of each micro-batch
since the previous log, see :class:`StepValues`) is kept in JSONL only. The console shows
neither.
"""

from __future__ import annotations

import datetime
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import yaml

from dflash_trainer.config import LoggingConfig
from dflash_trainer.core.appendlog import AppendLog

MetricValue = float | Sequence[float]

# (metric, console label, format); the console shows these, in this order, when present.
_CONSOLE_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("train/loss", "loss", "{:.4f}"),
    ("train/acc", "acc", "{:.3f}"),
    ("train/tau_sim", "tau", "{:.2f}"),
    ("train/grad_norm", "gnorm", "{:.3g}"),
    ("train/lr", "lr", "{:.2e}"),
    ("perf/tokens_per_s", "tok/s", "{:,.0f}"),
    ("eval/tau", "eval_tau", "{:.2f}"),
)


class Tracker:
    """One metrics backend. The base class is the no-op tracker."""

    run_id: str | None = None
    """Backend run id to store in checkpoints and pass back on resume (W&B only)."""

    def log(self, metrics: Mapping[str, MetricValue], step: int) -> None:
        """Record ``metrics`` at optimizer step ``step``."""

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the resolved run configuration."""

    def training_started(self) -> None:
        """Training proper begins now (after model loading and any untrained evaluation)."""

    def close(self) -> None:
        """Flush and release the backend; called once."""


def _is_sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str)


def _is_counts(key: str, value: Any) -> bool:
    """A list of counts, shown as a histogram by TensorBoard and W&B."""
    return _is_sequence(value) and key.endswith("_hist")


class JsonlTracker(Tracker):
    """``metrics.jsonl``: one ``{"step", "time", **metrics}`` object per line.

    Appended to, so a resumed run continues the same file; the report reader resolves steps
    that a resume re-runs. Each line is written as it is logged, so the file is readable while
    training runs and survives a crash up to the last log, and it is never torn: a write that
    fails (a full disk) is rolled back, and a line cut by a kill is repaired on resume
    (:class:`~dflash_trainer.core.appendlog.AppendLog`). Non-finite floats are written as
    ``NaN``/``Infinity`` (Python's JSON reading accepts them).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._log = AppendLog(self.path)

    def log(self, metrics: Mapping[str, MetricValue], step: int) -> None:
        record: dict[str, Any] = {"step": int(step), "time": time.time()}
        for key, value in metrics.items():
            record[key] = [float(v) for v in value] if _is_sequence(value) else float(value)
        self._log.append(record)

    def close(self) -> None:
        self._log.close()


class TensorBoardTracker(Tracker):
    """TensorBoard event files under ``log_dir`` (scalars; histograms for count lists)."""

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: Mapping[str, MetricValue], step: int) -> None:
        for key, value in metrics.items():
            if _is_counts(key, value):
                self._log_counts(key, [float(v) for v in value], step)
            elif not _is_sequence(value):
                self._writer.add_scalar(key, float(value), global_step=step)
        # Logs are seconds apart at most: flush so a live TensorBoard sees every point.
        self._writer.flush()

    def _log_counts(self, key: str, counts: list[float], step: int) -> None:
        """Counts for the values 1..len(counts), as a histogram with one bin per value."""
        total = sum(counts)
        if total <= 0:
            return
        values = [k for k, c in enumerate(counts, start=1) if c > 0]
        self._writer.add_histogram_raw(
            key, min=min(values), max=max(values), num=total,
            sum=sum(k * c for k, c in enumerate(counts, start=1)),
            sum_squares=sum(k * k * c for k, c in enumerate(counts, start=1)),
            bucket_limits=[k + 0.5 for k in range(1, len(counts) + 1)],
            bucket_counts=counts, global_step=step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        text = yaml.safe_dump(dict(config), sort_keys=False)
        # TensorBoard renders text as markdown: indent to keep it a code block.
        self._writer.add_text("config", "\n".join("    " + line for line in text.splitlines()))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run (``online`` or ``offline``), its files under ``run_dir/wandb``.

    ``resume_run_id`` continues that run (``resume="allow"``); ``run_id`` is the id to store in
    checkpoints. W&B ignores, with a warning, steps lower than the last one it has for the run,
    so after a resume the steps re-run since the checkpoint appear only in ``metrics.jsonl``.
    """

    def __init__(self, *, mode: str, project: str, entity: str | None, name: str,
                 tags: Sequence[str], config: Mapping[str, Any], run_dir: str | Path,
                 resume_run_id: str | None = None) -> None:
        import wandb

        self._wandb = wandb
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            mode=mode, project=project, entity=entity, name=name, tags=list(tags),
            config=dict(config), dir=str(run_dir), id=resume_run_id,
            resume="allow" if resume_run_id else None)
        self.run_id = self._run.id

    def log(self, metrics: Mapping[str, MetricValue], step: int) -> None:
        data: dict[str, Any] = {}
        for key, value in metrics.items():
            if _is_counts(key, value):
                counts = [float(v) for v in value]
                if sum(counts) > 0:
                    edges = [k + 0.5 for k in range(len(counts) + 1)]
                    data[key] = self._wandb.Histogram(np_histogram=(counts, edges))
            elif not _is_sequence(value):
                data[key] = float(value)
        self._run.log(data, step=step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def close(self) -> None:
        self._run.finish()


def _format_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    return str(datetime.timedelta(seconds=int(max(0.0, seconds))))


class ConsoleTracker(Tracker):
    """A rich progress bar on a terminal; one plain line per log elsewhere (CI, files, pipes).

    ``plain`` forces the mode; by default rich decides from the stream (a TTY, or FORCE_COLOR).
    The clock starts at :meth:`training_started` (or, if nobody calls it, at the first log),
    so model loading and an untrained evaluation before training do not count.

    A run is *time-bounded* when ``max_time_s`` is set and its deadline comes before the
    planned steps would finish at the measured step rate: it shows ``step N  elapsed/limit``
    and the ETA is the time left, which is zero when training stops. Otherwise the run is
    step-bounded: ``step N/total``, the ETA from the step rate measured since the first log
    (so a resumed run's rate is not diluted by the steps it skipped). ``clock`` is for tests.
    """

    def __init__(self, total_steps: int | None = None, *, stream: IO[str] | None = None,
                 plain: bool | None = None, max_time_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from rich.console import Console

        self.total_steps = total_steps
        self.max_time_s = max_time_s
        self._clock = clock
        self._started: float | None = None
        self._stream = stream if stream is not None else sys.stdout
        console = Console(file=self._stream, force_terminal=None if plain is None else not plain)
        self.plain = not console.is_terminal
        self._first: tuple[int, float] | None = None
        self._progress = None
        if not self.plain:
            from rich.progress import BarColumn, Progress, TextColumn

            # auto_refresh=False: no render thread; the bar redraws at each log.
            self._progress = Progress(
                TextColumn("[bold]{task.fields[where]}"), BarColumn(),
                TextColumn("{task.fields[stats]}"), TextColumn("eta {task.fields[eta]}"),
                console=console, auto_refresh=False)
            self._task = self._progress.add_task("train", total=total_steps, stats="", eta="-",
                                                 where="step 0")
            self._progress.start()

    def training_started(self) -> None:
        self._started = self._clock()
        self._first = None  # a log before training (an untrained eval) says nothing of the step rate

    def progress(self, step: int) -> tuple[str, float | None, float, float | None]:
        """(position text, ETA in seconds or None, bar completed, bar total) at ``step``."""
        now = self._clock()
        if self._started is None:
            self._started = now
        if self._first is None:
            self._first = (step, now)
        first_step, first_time = self._first
        step_eta = None
        if self.total_steps is not None and step > first_step:
            step_eta = max(0, self.total_steps - step) * (now - first_time) / (step - first_step)
        if self.max_time_s is not None:
            elapsed = now - self._started
            time_left = max(0.0, self.max_time_s - elapsed)
            if self.total_steps is None or step_eta is None or step_eta > time_left:
                where = (f"step {step}  {_format_duration(min(elapsed, self.max_time_s))}"
                         f"/{_format_duration(self.max_time_s)}")
                return where, time_left, min(elapsed, self.max_time_s), self.max_time_s
        total = "?" if self.total_steps is None else str(self.total_steps)
        return f"step {step}/{total}", step_eta, float(step), (
            None if self.total_steps is None else float(self.total_steps))

    def log(self, metrics: Mapping[str, MetricValue], step: int) -> None:
        stats = "  ".join(f"{label} {fmt.format(float(metrics[key]))}"
                          for key, label, fmt in _CONSOLE_FIELDS if key in metrics)
        where, eta, completed, total = self.progress(step)
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, total=total, where=where,
                                  stats=stats, eta=_format_duration(eta), refresh=True)
            return
        print(f"{where}  {stats}  eta {_format_duration(eta)}", file=self._stream, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class StepValues(Tracker):
    """Adds values recorded between logs to the next logged dict, as one list under ``key``.

    The train loop calls :meth:`record` once per micro-batch (a host-side int, no device
    sync); the monitor logs through this wrapper, so ``metrics.jsonl`` holds the value of
    every micro-batch although metrics are logged every few steps.
    """

    def __init__(self, inner: Tracker, key: str) -> None:
        self.inner = inner
        self.key = key
        self._values: list[float] = []

    @property
    def run_id(self) -> str | None:  # type: ignore[override]
        return self.inner.run_id

    def record(self, value: float) -> None:
        """Note the value of the current micro-batch."""
        self._values.append(float(value))

    def log(self, metrics: Mapping[str, MetricValue], step: int) -> None:
        if self._values:
            metrics = {**metrics, self.key: self._values}
            self._values = []
        self.inner.log(metrics, step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.inner.log_config(config)

    def training_started(self) -> None:
        self.inner.training_started()


class Trackers(Tracker):
    """Fan-out to several trackers; empty (a no-op) on non-logging ranks."""

    def __init__(self, trackers: Sequence[Tracker] = ()) -> None:
        self.trackers = list(trackers)
        self._closed = False

    @property
    def run_id(self) -> str | None:  # type: ignore[override]
        return next((t.run_id for t in self.trackers if t.run_id is not None), None)

    def log(self, metrics: Mapping[str, MetricValue], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log_config(config)

    def training_started(self) -> None:
        for tracker in self.trackers:
            tracker.training_started()

    def close(self) -> None:
        """Close every tracker (idempotent); the first failure is re-raised after all closed."""
        if self._closed:
            return
        self._closed = True
        first_error: BaseException | None = None
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 - the others must still be closed
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def build_trackers(logging_cfg: LoggingConfig, run_dir: str | Path, *,
                   config_dict: Mapping[str, Any], is_rank0: bool,
                   resume_run_id: str | None = None,
                   total_steps: int | None = None, max_time_s: float | None = None) -> Trackers:
    """The trackers ``logging_cfg`` asks for, writing under ``run_dir``.

    On rank 0: ``metrics.jsonl`` always, ``tensorboard/`` and the console when enabled, and a
    W&B run unless ``logging.wandb`` is ``disabled`` (``resume_run_id`` continues that run).
    The config is logged to each. Other ranks get an empty ``Trackers``.
    """
    if not is_rank0:
        return Trackers()
    run_dir = Path(run_dir)
    trackers: list[Tracker] = [JsonlTracker(run_dir / "metrics.jsonl")]
    try:
        if logging_cfg.tensorboard:
            trackers.append(TensorBoardTracker(run_dir / "tensorboard"))
        if logging_cfg.wandb != "disabled":
            trackers.append(WandbTracker(
                mode=logging_cfg.wandb, project=logging_cfg.wandb_project,
                entity=logging_cfg.wandb_entity,
                name=logging_cfg.run_name or run_dir.resolve().name,
                tags=logging_cfg.tags, config=config_dict, run_dir=run_dir,
                resume_run_id=resume_run_id))
        if logging_cfg.console:
            trackers.append(ConsoleTracker(total_steps, max_time_s=max_time_s))
    except BaseException:
        Trackers(trackers).close()
        raise
    fan_out = Trackers(trackers)
    for tracker in fan_out.trackers:
        # W&B received the config in init(); logging it again would only repeat it.
        if not isinstance(tracker, WandbTracker):
            tracker.log_config(config_dict)
    return fan_out
