"""Training online (the target runs every epoch) vs from a feature store, in one run.

    python -m benchmarks.feature_store [--config configs/demo-cpu.yaml] [--samples 100] [--epochs 3]
                                       [--lrs 1e-3 3e-3] [--store-threads 1 2] [--run-root runs/feature-store]
                                       [--out feature-store.json] [--set key=value ...]

Every arm is the real command in its own process, one after the other: ``features --out
STORE`` (the build: one target pass over the samples), ``train`` online at the first lr, then
``train features.store=STORE`` at every lr of ``--lrs`` (a sweep that reuses one store) and with
each ``pipeline.num_threads`` of ``--store-threads`` (the drafter alone may use every core
once no target runs beside it). Each arm records its wall time, its peak RSS (``wait4``), the
load average before and after, and from its ``metrics.jsonl`` the optimizer steps per second
after the first epoch's first 10 steps and the wall time of each epoch.

Totals for 1, 3 and 6 epochs are computed from the measured parts: online = start-up +
E x epoch time; store = build + start-up + E x epoch time (the epochs of a run are alike: the
same samples in another order). Bytes per token and GB come from the store's manifest, and
for the Qwen3-8B recipe's shapes (5 tapped layers x 4096, bf16) from the same formula.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_trainer.features.manifest import Manifest

DEFAULTS = ("training.max_steps=null", "logging.every_steps=1", "logging.console=false",
            "logging.tensorboard=false", "checkpoint.async_save=false", "eval.final=false")
"""Every arm's settings: epochs decide the run's length; every step logged for its timing; no
final evaluation (the store arms cannot run one, so it would lengthen the online arm alone)."""

QWEN3_8B = {"layers": 5, "hidden": 4096, "bytes": 2}
"""The recipe's feature shapes (configs/qwen3-8b.yaml: 5 tapped layers of 4096, bf16)."""


def run_arm(name: str, cmd: list[str], log: Path, *, ok: Sequence[int] = (0,)) -> dict[str, Any]:
    """Run one command to completion; its exit status, wall time, CPU time, peak RSS and the load
    around it. An exit status outside ``ok`` ends the benchmark, naming the log."""
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code not in ok:
        raise SystemExit(f"{name}: exit {code}; see {log}")
    return {"arm": name, "exit": code, "wall_s": round(wall, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}


def run_timing(run_dir: Path, wall_s: float) -> dict[str, Any]:
    """Steps per second and per-epoch wall time from a run's ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [(r["step"], r["time"]) for r in rows if "train/loss" in r]
    starts = [r["time"] for r in rows if "plan/epoch" in r]
    timed = steps[10:]
    rate = (timed[-1][0] - timed[0][0]) / (timed[-1][1] - timed[0][1])
    epochs = [b - a for a, b in zip(starts, [*starts[1:], steps[-1][1]], strict=True)]
    # Start-up: the process's wall time not spent in the epochs (load, build, export).
    return {"steps": steps[-1][0], "steps_per_s": round(rate, 3),
            "epoch_s": [round(e, 2) for e in epochs],
            "startup_s": round(wall_s - sum(epochs), 2)}


def totals(online: dict[str, Any], store: dict[str, Any], build_s: float) -> dict[str, Any]:
    """Wall time of 1, 3 and 6 epochs, online and from the store, from the measured parts."""
    def total(arm: dict[str, Any], extra: float, epochs: int) -> float:
        per = sum(arm["epoch_s"]) / len(arm["epoch_s"])
        return round(extra + arm["startup_s"] + epochs * per, 1)
    return {str(e): {"online_s": total(online, 0.0, e), "store_s": total(store, build_s, e)}
            for e in (1, 3, 6)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo-cpu.yaml")
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3])
    parser.add_argument("--store-threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--run-root", default="runs/feature-store")
    parser.add_argument("--out", default="feature-store.json")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    root = Path(args.run_root)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    store = root / "store"
    cli = [sys.executable, "-m", "dflash_trainer"]
    common = ["--config", args.config, *DEFAULTS, f"data.max_samples={args.samples}",
              f"training.epochs={args.epochs}", *args.overrides]
    arms: list[dict[str, Any]] = []
    build = run_arm("build", [*cli, "features", f"--out={store}", *common], root / "build.log")
    arms.append(build)

    def train(name: str, *extra: str) -> dict[str, Any]:
        run_dir = root / name
        arm = run_arm(name, [*cli, "train", *common, f"run_dir={run_dir}", *extra], root / f"{name}.log")
        arm.update(run_timing(run_dir, arm["wall_s"]), settings=list(extra))
        arms.append(arm)
        print(json.dumps(arm), flush=True)
        return arm

    lr0 = args.lrs[0]
    online = train("online", f"training.lr={lr0}")
    by_threads = {t: train(f"store-t{t}", f"training.lr={lr0}", f"features.store={store}",
                           f"pipeline.num_threads={t}") for t in args.store_threads}
    best_threads = max(by_threads, key=lambda t: by_threads[t]["steps_per_s"])
    sweep = [by_threads[best_threads]]
    for lr in args.lrs[1:]:
        sweep.append(train(f"store-lr{lr:g}", f"training.lr={lr}", f"features.store={store}",
                           f"pipeline.num_threads={best_threads}"))
    manifest = Manifest.read(store)
    qwen_bpt = QWEN3_8B["layers"] * QWEN3_8B["hidden"] * QWEN3_8B["bytes"] + 4
    result = {
        "config": args.config, "samples": args.samples, "epochs": args.epochs, "cpu": _cpu(),
        "arms": arms,
        "store": {"bytes_per_token": manifest.bytes_per_token, "tokens": manifest.num_tokens,
                  "gb": round(manifest.bytes_per_token * manifest.num_tokens / 1e9, 4),
                  "storage_dtype": manifest.storage_dtype, "shards": manifest.num_shards,
                  "gb_per_million_tokens": round(manifest.bytes_per_token * 1e6 / 1e9, 3)},
        "qwen3_8b": {"bytes_per_token": qwen_bpt, "gb_per_million_tokens": round(qwen_bpt * 1e6 / 1e9, 2)},
        "steps_per_s_ratio": {f"store-t{t}": round(a["steps_per_s"] / online["steps_per_s"], 2)
                              for t, a in by_threads.items()},
        "peak_rss_ratio": {f"store-t{t}": round(a["peak_rss_mib"] / online["peak_rss_mib"], 2)
                           for t, a in by_threads.items()},
        "wall_for_epochs": totals(online, by_threads[best_threads], build["wall_s"]),
        "sweep": {"lrs": args.lrs, "store_total_s": round(build["wall_s"] + sum(a["wall_s"] for a in sweep), 1),
                  "online_runs_s_estimate": round(online["wall_s"] * len(args.lrs), 1),
                  "runs_s": [a["wall_s"] for a in sweep]},
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("steps_per_s_ratio", "peak_rss_ratio", "wall_for_epochs",
                                               "sweep", "store")}, indent=1))
    return 0


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
