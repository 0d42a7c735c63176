"""Checkpoint save and resume at scale: the earlier single-file format vs DCP shards.

    python -m benchmarks.checkpoint_dcp [--layers 1] [--ranks 2] [--reps 2] [--out FILE]

Spawns ``--ranks`` gloo processes on the CPU. Each holds a DFlash drafter of the recipe's
shape (the Qwen3-8B drafter: hidden 4096, intermediate 12288, 32 query / 8 KV heads, fc over
5 target layers) at ``--layers`` decoder layers, with its AdamW state after one step,
replicated on every rank as under DDP. The two formats alternate (old, dcp, old, dcp, ...),
each writing into a fresh folder that is deleted afterwards:

- ``old``: the save path before DCP, kept here for the comparison: every rank takes the whole
  state, rank 0 copies it to CPU (the snapshot) and writes one ``state.pt`` with
  ``torch.save`` and an fsync. Resume: every rank reads ``state.pt`` (memory-mapped) and loads
  the model and optimizer state from it (the moments copied out of the mapped file, which
  the first optimizer step would otherwise do).
- ``dcp``: the trainer's path: each rank copies its part (``checkpoint.local_part``: about
  1/ranks of the replicated tensors) and writes it with ``dcp.save`` over a gloo group of its
  own (``checkpoint.save_train_state``, fsync included). Resume: ``dcp.load`` into the live
  tensors and ``set_state_dict`` (``Trainer.load_state_dict``).

Per format, rank and repetition: the snapshot time (what the training thread spends per
save), the write time (until rank 0's files are durable; under DCP, every rank's), the peak
RSS growth of the process during the save (sampled every 5 ms from /proc/self/statm, over its
RSS just before), the resume time and its peak RSS growth, and the load average. The
checksums and the drafter export that every checkpoint also writes are not included. The
files are read back while still in the page cache, as after a save; a resume after a restart
reads them from disk.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_trainer.training.checkpoint import load_train_state, local_part, save_train_state, snapshot
from dflash_trainer.core.distributed import apply_training_state, training_state

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    """This process's resident set size in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """The peak RSS growth over the RSS at entry, sampled every 5 ms on a thread."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss())

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def growth(self) -> int:
        return self.peak - self.base


def build(layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The recipe's drafter (Qwen3-8B shape) at ``layers`` layers, with AdamW after one step
    (moments allocated), the same on every rank."""
    from transformers import Qwen3Config

    from dflash_trainer.config import ModelConfig
    from dflash_trainer.model.drafter import build_drafter

    target = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, num_hidden_layers=36,
                         vocab_size=1024)
    torch.manual_seed(0)
    drafter = build_drafter(ModelConfig(num_layers=layers), target, mask_token_id=1)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return drafter, optimizer


def save_old(drafter: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path,
             rank: int) -> dict[str, float]:
    """The single-file save: rank 0 snapshots the whole state and torch.saves it."""
    with PeakRSS() as peak:
        start = time.perf_counter()
        full = {"drafter": drafter.state_dict(), "optimizer": optimizer.state_dict()}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {"rng": torch.get_rng_state()})  # rank-R.pt
        state = snapshot(full) if rank == 0 else None
        snap = time.perf_counter() - start
        if rank == 0:
            with open(folder / "state.pt", "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        write = time.perf_counter() - start - snap
        del state, full
        gc.collect()
    return {"snapshot_s": snap, "write_s": write, "save_peak_rss_gb": peak.growth / 2**30}


def save_dcp(drafter: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path,
             rank: int, group: Any) -> dict[str, float]:
    """The trainer's save: each rank snapshots its part and dcp.saves it."""
    with PeakRSS() as peak:
        start = time.perf_counter()
        shards = snapshot(local_part(training_state(drafter, optimizer), rank,
                                     dist.get_world_size()))
        snap = time.perf_counter() - start
        save_train_state(shards, folder / "train", group=group)
        write = time.perf_counter() - start - snap
        del shards
        gc.collect()
    return {"snapshot_s": snap, "write_s": write, "save_peak_rss_gb": peak.growth / 2**30}


def load_old(drafter: torch.nn.Module, optimizer: torch.optim.Optimizer,
             folder: Path) -> dict[str, float]:
    with PeakRSS() as peak:
        start = time.perf_counter()
        state = torch.load(folder / "state.pt", map_location="cpu", weights_only=False, mmap=True)
        drafter.load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        # Optimizer.load_state_dict keeps tensors of the right dtype and device as they are:
        # the moments stay views of the memory-mapped file, read (and copied on write) at the
        # first step. Copied here, so that the resume pays for reading them, as DCP's does.
        for entry in optimizer.state.values():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    entry[key] = value.clone()
        del state
        gc.collect()
        seconds = time.perf_counter() - start
    return {"resume_s": seconds, "resume_peak_rss_gb": peak.growth / 2**30}


def load_dcp(drafter: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path,
             group: Any) -> dict[str, float]:
    with PeakRSS() as peak:
        start = time.perf_counter()
        template = training_state(drafter, optimizer)
        load_train_state(template, folder / "train", group=group)
        apply_training_state(drafter, optimizer, template)
        del template
        gc.collect()
        seconds = time.perf_counter() - start
    return {"resume_s": seconds, "resume_peak_rss_gb": peak.growth / 2**30}


def worker(rank: int, world: int, port: int, args: argparse.Namespace, root: str,
           out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=1800))
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=1800))
    drafter, optimizer = build(args.layers)
    params = sum(p.numel() for p in drafter.parameters())
    rows = []
    for rep in range(args.reps):
        for arm in ("old", "dcp"):
            folder = Path(root) / f"{arm}-{rep}"
            if rank == 0:
                folder.mkdir()
            dist.barrier()
            load = os.getloadavg()[0]
            if arm == "old":
                row = save_old(drafter, optimizer, folder, rank)
            else:
                row = save_dcp(drafter, optimizer, folder, rank, group)
            dist.barrier()  # every rank's files are written: the checkpoint is complete
            row["saved_s"] = row["snapshot_s"] + row["write_s"]
            row.update(load_old(drafter, optimizer, folder) if arm == "old"
                       else load_dcp(drafter, optimizer, folder, group))
            dist.barrier()
            row["bytes"] = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            if rank == 0:
                for path in sorted(folder.rglob("*"), reverse=True):
                    path.unlink() if path.is_file() else path.rmdir()
                folder.rmdir()
            rows.append({"arm": arm, "rep": rep, "rank": rank, "load_1min": load, **row})
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(out).write_text(json.dumps({"params": params, "rows": [r for g in gathered for r in g]}))
    dist.destroy_process_group()


def summarise(rows: list[dict], world: int) -> dict[str, Any]:
    """Median over repetitions, per format: rank 0, and the largest of the other ranks."""
    summary: dict[str, Any] = {}
    keys = ("snapshot_s", "write_s", "saved_s", "save_peak_rss_gb", "resume_s",
            "resume_peak_rss_gb")
    for arm in ("old", "dcp"):
        mine = [r for r in rows if r["arm"] == arm]
        entry: dict[str, Any] = {"bytes": mine[0]["bytes"]}
        for key in keys:
            entry[f"rank0_{key}"] = statistics.median(r[key] for r in mine if r["rank"] == 0)
            if world > 1:
                reps = sorted({r["rep"] for r in mine})
                entry[f"others_max_{key}"] = statistics.median(
                    max(r[key] for r in mine if r["rep"] == rep and r["rank"] > 0) for rep in reps)
        summary[arm] = entry
    old, new = summary["old"], summary["dcp"]
    summary["ratios_dcp_over_old"] = {
        "rank0_save_peak_rss": new["rank0_save_peak_rss_gb"] / old["rank0_save_peak_rss_gb"],
        "rank0_snapshot": new["rank0_snapshot_s"] / old["rank0_snapshot_s"],
        "rank0_save_total": new["rank0_saved_s"] / old["rank0_saved_s"],
        "rank0_resume": new["rank0_resume_s"] / old["rank0_resume_s"],
    }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1, help="drafter decoder layers")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2, help="repetitions of each format")
    parser.add_argument("--out", type=Path, help="write the result JSON here")
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        out = Path(root) / "rows.json"
        mp.spawn(worker, args=(args.ranks, port, args, root, str(out)), nprocs=args.ranks)
        raw = json.loads(out.read_text())
    summary = summarise(raw["rows"], args.ranks)
    result = {
        "benchmark": "checkpoint_dcp",
        "command": f"python -m benchmarks.checkpoint_dcp --layers {args.layers} --ranks "
                   f"{args.ranks} --reps {args.reps}",
        "drafter": {"shape": "Qwen3-8B drafter: hidden 4096, intermediate 12288, 32/8 heads, "
                             "fc over 5 target layers", "layers": args.layers,
                    "parameters": raw["params"]},
        "ranks": args.ranks, "backend": "gloo (CPU), DDP-style replicated state",
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "summary": summary, "rows": raw["rows"],
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps({"parameters": raw["params"], **summary}, indent=1))


if __name__ == "__main__":
    main()
