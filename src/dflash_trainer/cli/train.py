"""``dflash-trainer train``: build the Trainer with the in-training and final evaluation, train,
and write the run's report; here, not in :mod:`dflash_trainer.training`, because training never
imports evaluation or reporting."""

from __future__ import annotations

import argparse
import logging

from dflash_trainer.config import Config
from dflash_trainer.core.distributed import close_distributed
from dflash_trainer.core.errors import UserError
from dflash_trainer.evaluation.evaluate import InTrainingEval
from dflash_trainer.reporting.report import write_report
from dflash_trainer.training.memory import peak_line
from dflash_trainer.training.trainer import Trainer, close_after_failure

__all__ = ["main"]


def main(cfg: Config, args: argparse.Namespace | None = None) -> int:
    """``dflash-trainer train``: exit 0 on completion or on a graceful SIGTERM/SIGINT stop.

    A stop requested by a signal exits 0 (schedulers send SIGTERM to ask for exactly that)
    after the final checkpoint, without the final eval and report. ``--overwrite`` starts over
    in a folder that holds an earlier run. The run folder's lock is held until the report is
    written. User errors (a refused resume, a locked run folder among them) propagate to
    ``cli.main``, which prints them as one line with their exit code; any other failure
    propagates with its traceback.
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        trainer = Trainer(cfg, overwrite=bool(getattr(args, "overwrite", False)),
                          evaluator=InTrainingEval.from_config)
    except UserError as exc:
        close_distributed()  # every rank refuses the same config; a bug keeps the group for its traceback
        if getattr(exc, "reported_by_rank0", False):
            raise SystemExit(exc.exit_code) from None  # rank 0 prints it; the others exit quietly
        raise
    try:
        trainer.train()
    except BaseException as exc:
        close_after_failure(trainer)
        if getattr(exc, "reported_by_rank0", False):  # a divergence: every rank knows, rank 0 says
            raise SystemExit(exc.exit_code) from None  # type: ignore[attr-defined]
        raise
    if trainer.dist.is_main:
        print(peak_line(trainer.memory_estimate, trainer.peak_memory), flush=True)
    run_lock = trainer.run_lock
    try:
        trainer.close(keep_run_lock=True)  # the report below still writes into the run folder
    except BaseException:
        trainer.release_run_lock()
        raise
    is_main, run_dir, stopped_by = trainer.dist.is_main, trainer.run_dir, trainer.stopped_by
    del trainer  # the process groups are joined once nothing holds the wrapped models
    try:
        close_distributed()
        stopped_by_signal = (stopped_by or "").startswith("signal")
        if is_main and not stopped_by_signal:
            print(f"report: {write_report(run_dir)}", flush=True)
        elif is_main:
            print(f"stopped by {stopped_by}: resume with --resume auto; write the report "
                  f"with `dflash-trainer report {run_dir}`", flush=True)
    finally:
        if run_lock is not None:
            run_lock.release()
    return 0
