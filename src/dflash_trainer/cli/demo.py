"""``dflash-trainer demo``: the main job end to end, with a before/after acceptance length.

prepare (statistics) -> evaluate the untrained drafter -> train (bounded by the config) ->
evaluate the trained drafter on the same prompts -> export -> report -> summary of where
everything is. Both evaluations are real speculative decoding against the target's greedy
output, so the two tau values are directly comparable. Each speedup comes from target-only and
speculative decodes timed side by side in that evaluation (:mod:`dflash_trainer.evaluation.speedup`), on
the cores free at its start, and is shown as unreliable when the machine was busy or the
per-prompt timings scattered.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.core.assets import resolve_target
from dflash_trainer.config import Config
from dflash_trainer.cli import duration
from dflash_trainer.data import prepare
from dflash_trainer.model.dtypes import config_probe_seconds
from dflash_trainer.evaluation.evaluate import InTrainingEval
from dflash_trainer.evaluation.prompt_sets import load_prompts
from dflash_trainer.core.interrupts import Interrupted
from dflash_trainer.model.target import load_target
from dflash_trainer.reporting.report import write_report
from dflash_trainer.evaluation.speedup import SpeedupMeasurement, pay_off_line
from dflash_trainer.training.trainer import Trainer, close_after_failure


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.3f}"
    return str(value)


def _results_table(untrained: dict[str, Any], trained: dict[str, Any],
                   speedups: tuple[SpeedupMeasurement, SpeedupMeasurement]) -> str:
    """The before/after table of the two evaluations' metrics.

    The speedups come only from their measurements (target-only and speculative decodes timed
    side by side in that evaluation); an unreliable one is marked in its cell and its reasons
    follow the table.
    """
    rows = [("acceptance length tau", _fmt(untrained["eval/tau"]), _fmt(trained["eval/tau"])),
            ("decode speedup (CPU)", *(m.label(".3f", short=True) for m in speedups)),
            ("lossless", _fmt(bool(untrained["eval/lossless"])), _fmt(bool(trained["eval/lossless"])))]
    widths = [max(10, *(len(row[k]) for row in rows)) for k in (1, 2)]
    lines = [f"  {'':24s} {'untrained':>{widths[0]}s} {'trained':>{widths[1]}s}"]
    lines += [f"  {name:24s} {before:>{widths[0]}s} {after:>{widths[1]}s}" for name, before, after in rows]
    lines += [f"  {name} speedup unreliable: {'; '.join(m.reasons)}"
              for name, m in zip(("untrained", "trained"), speedups) if m.reliable is False]
    pays = pay_off_line(speedups[1].speedup, speedups[1].step_cost, trained["eval/tau"])
    if pays is not None:
        lines.append(f"  {pays}")
    return "\n".join(lines)


@contextlib.contextmanager
def _console_info(logger_name: str) -> Iterator[None]:
    """Print one module's INFO messages on the console, prefixed ``demo:``.

    The demo keeps the trainer's INFO log off the console; the CPU dtype choice (which of
    float32 and bf16 ``model.dtype: auto`` measured faster on this machine, and by how much) is
    the one set-up decision a newcomer needs to see to read the step rate.
    """
    logger = logging.getLogger(logger_name)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("demo: %(message)s"))
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # a root handler (``train`` configures one) would print it twice
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def main(cfg: Config, args: argparse.Namespace | None = None) -> int:
    """Run the demo; exit 1 if speculative decoding was not lossless."""
    started = time.monotonic()
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and any(run_dir.iterdir()):
        # A demo is a fresh run; never resume or overwrite an earlier one.
        cfg = dataclasses.replace(cfg, run_dir=f"{cfg.run_dir}-{time.strftime('%Y%m%d-%H%M%S')}")
        print(f"demo: {run_dir} is not empty; this run goes to {cfg.run_dir}", flush=True)
    prepare.main(cfg, None)
    with _console_info("dflash_trainer.model.dtypes"):
        trainer = Trainer(cfg)
    dtype = str(trainer.compute_dtype).removeprefix("torch.")
    try:
        expected = _expected_duration(cfg, trainer)
        if expected is not None:
            print(expected[0].describe(), flush=True)
        expected_from = time.monotonic()
        num_prompts = len(load_prompts(cfg, limit=cfg.eval.in_training_prompts, first_turn_only=True))
        print(f"demo: evaluating the untrained drafter on {num_prompts} {cfg.eval.prompts} prompts "
              f"(max_new_tokens {cfg.eval.max_new_tokens})", flush=True)
        eval_target = trainer.target
        if trainer.compute_dtype != torch.float32:
            # Exact token-for-token losslessness is a float32 property: in bf16 the batched
            # verify forward and the one-token decode round differently and flip near-ties.
            eval_target, _ = load_target(str(resolve_target(cfg.model.target)),
                                         device=trainer.device, dtype=torch.float32)
        # Each call picks its threads from the cores free at its start (training splits them
        # between the target stage and the drafter loop; an evaluation is one thread of work).
        evaluator = InTrainingEval.from_config(cfg, target=eval_target, tokenizer=trainer.tokenizer)
        eval_started = time.monotonic()
        untrained = evaluator(trainer.drafter)
        eval_s = [time.monotonic() - eval_started]
        untrained_speedup = evaluator.last_speedup
        trainer.trackers.log(untrained, 0)
        train_started = time.monotonic()
        trainer.train()
        if trainer.stop_signal is not None:  # a stop signal ends the demo, not only its training
            raise Interrupted(trainer.stop_signal)
        train_s = time.monotonic() - train_started
        eval_started = time.monotonic()
        trained = evaluator(trainer.drafter)
        eval_s.append(time.monotonic() - eval_started)
        trained_speedup = evaluator.last_speedup
        actual_s = time.monotonic() - expected_from
        trainer.trackers.log(trained, trainer.drafter_step.optimizer_step)
    except BaseException:
        close_after_failure(trainer)
        raise
    try:
        # The results and the report below still write into the run folder: like `train`, the
        # demo keeps its lock until they are written, so no other writer starts there first.
        trainer.close(keep_run_lock=True)
        run_dir = Path(cfg.run_dir)
        eval_dir = run_dir / "eval"
        eval_dir.mkdir(parents=True, exist_ok=True)
        assert untrained_speedup is not None and trained_speedup is not None
        steps = trainer.drafter_step.optimizer_step
        timing: dict[str, Any] = {}
        if expected is not None:
            estimate, key = expected
            ratios = duration.measured_ratios(probe_s=estimate.probe_s, train_s=train_s, steps=steps,
                                              eval_s=eval_s)
            if steps == trainer.total_steps:  # a run cut short by a time limit measures less
                duration.record(key, ratios)
            timing = {"probe_step_s": estimate.probe_s, "expected_s": round(estimate.total_s, 1),
                      "actual_s": round(actual_s, 1), "duration_ratios": ratios,
                      "expected_with": estimate.ratios.source}
        results = {
            "tau": trained["eval/tau"], "acceptance_hist": trained["eval/acceptance_hist"],
            "lossless": bool(trained["eval/lossless"]),
            # speedup, speedup_reliable, speedup_unreliable_reasons, speedup_measurement
            **trained_speedup.summary_fields(),
            "untrained_tau": untrained["eval/tau"], "untrained_lossless": bool(untrained["eval/lossless"]),
            **{f"untrained_{k}": v for k, v in untrained_speedup.summary_fields().items()},
            "prompts": cfg.eval.prompts, "num_prompts": num_prompts,
            "max_new_tokens": cfg.eval.max_new_tokens, "steps": trainer.drafter_step.optimizer_step,
            "dtype": dtype,
            # Wall times make a result file comparable across machines: the step rate varies ~3x.
            "wall_s": round(time.monotonic() - started, 1), "train_s": round(train_s, 1),
            "eval_s": [round(x, 1) for x in eval_s], **timing,
            # The trained drafter's answers with their acceptance traces: the report highlights them.
            "per_prompt": [r.to_json() for r in evaluator.last_requests],
        }
        (eval_dir / "results.json").write_text(json.dumps(results, indent=1))
        report = write_report(run_dir)
        expected_note = f", expected {timing['expected_s']:.0f} s" if timing else ""
        print(f"\ndemo finished in {time.monotonic() - started:.0f} s "
              f"({steps} training steps in {dtype}; evaluation in float32{expected_note})")
        print(_results_table(untrained, trained, (untrained_speedup, trained_speedup)))
        print(f"  run folder        {run_dir}\n"
              f"  resolved config   {run_dir / 'config.yaml'}\n"
              f"  metrics           {run_dir / 'metrics.jsonl'} (TensorBoard: {run_dir / 'tensorboard'})\n"
              f"  checkpoints       {run_dir / 'checkpoints'}\n"
              f"  exported drafter  {run_dir / 'drafter'} (z-lab format)\n"
              f"  evaluation        {eval_dir / 'results.json'}\n"
              f"  report            {report}\n"
              f"  full MT-Bench eval: dflash-trainer eval --config {run_dir / 'config.yaml'} "
              f"--drafter {run_dir / 'drafter'}", flush=True)
        return 0 if trained["eval/lossless"] and untrained["eval/lossless"] else 1
    finally:
        trainer.release_run_lock()


def _expected_duration(cfg: Config, trainer: Trainer) -> tuple[duration.DurationEstimate, str] | None:
    """The demo's expected duration on this CPU and its cache key (None off the CPU, where no
    probe runs)."""
    if trainer.device.type != "cpu":
        return None
    probe_s, probe_key = config_probe_seconds(cfg.model, trainer.compute_dtype)
    settings = {"model": [cfg.model.variant, cfg.model.num_layers, cfg.model.block_size,
                          cfg.model.drafter_init],
                "training": [cfg.training.num_anchors, cfg.training.loss_slots,
                             cfg.training.labels],
                "pipeline": [cfg.pipeline.tokens_per_batch, cfg.pipeline.num_threads],
                "data": [cfg.data.max_length],
                "eval": [cfg.eval.in_training_prompts, cfg.eval.max_new_tokens,
                         cfg.eval.every_steps]}
    key = duration.settings_key(probe_key=probe_key, settings=settings)
    return duration.estimate(key, steps=trainer.total_steps, probe_s=probe_s), key
