"""Distributed training on CPU with 2 gloo ranks.

- Module level (2 processes from torch.multiprocessing): at one optimizer step of the real
  DFlashObjective + wrap_drafter (DDP and FSDP2) + DrafterStep, with each rank holding
  one batch (or two accumulated micro-batches), the optimizer sees the gradients of one
  process holding both ranks' batches; FSDP2 full state round-trips; an FSDP2-sharded target
  gives the same features.
- Trainer level (``torchrun ... -m dflash_trainer train``): a 2-rank run matches a 1-rank
  run whose every step is the union of the two ranks' batches; a 2-rank resume reproduces
  the uninterrupted run; drafter=fsdp + target=fsdp trains like DDP; with target=fsdp, one
  rank stopping before the other (SIGTERM, max_time_s, max_steps, leftover micro-batches)
  still ends both without waiting for a collective's timeout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_trainer.training import components
from dflash_trainer.model.batch import Batch, StepInput
from dflash_trainer.training.pipeline import pipeline as pipeline_module
from dflash_trainer.training.trainer import Trainer, any_rank
from dflash_trainer.config import (DistributedConfig, ModelConfig, PipelineConfig, TrainingConfig,
                                   load_config)
from dflash_trainer.data.buckets import Plan, Step, build_plan
from dflash_trainer.training.checkpoint import (
    load_drafter_weights, load_train_state, local_part, read_state, save_train_state, snapshot)
from dflash_trainer.core.distributed import (
    DistInfo, all_reduce_sum, apply_training_state, check_distributed_options, close_distributed,
    gather_objects, init_distributed, training_state, wrap_drafter, wrap_target)
from dflash_trainer.model.blocks import sample_anchors
from dflash_trainer.model.drafter import build_drafter, set_draft_vocab
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.target import FeatureExtractor, TargetOutputs
from dflash_trainer.training.optim import LRSchedule, build_optimizer
from dflash_trainer.training.pipeline.metrics import combine
from dflash_trainer.training.pipeline.prefetch import BatchPrefetcher
from dflash_trainer.training.pipeline.drafter_step import DrafterStep
from helpers_e2e import make_chat_jsonl, make_tiny_target

WORLD = 2
BLOCK = 8
CPU = torch.device("cpu")

# fp32 on CPU: the only differences are summation order (gloo's sum of two halves, DDP's
# average vs one backward over the union), so gradients agree to a few ulps.
GRAD_RTOL = 1e-5
# Logged loss and grad norm of whole runs compared across layouts (8 AdamW steps).
TRAIN_RTOL = 1e-5
# A launch of 2 ranks takes ~15 s alone; the limit allows for a loaded machine.
LAUNCH_TIMEOUT_S = 300
# A rank left waiting in a collective fails with an error naming it well before that.
COLLECTIVE_TIMEOUT_S = 120


def test_option_errors_are_clear(monkeypatch):
    two = DistInfo(rank=0, world_size=2, local_rank=0, device=CPU)
    with pytest.raises(ValueError, match="eval.every_steps"):
        check_distributed_options(DistributedConfig(target="fsdp"), two, in_training_eval=True)
    check_distributed_options(DistributedConfig(), two, in_training_eval=True)
    with pytest.raises(ValueError, match=r"distributed.timeout_s must be in \(0, "):
        load_config(None, ["distributed.timeout_s=0"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="nccl needs CUDA"):
        init_distributed(PipelineConfig(device="cpu"), DistributedConfig(backend="nccl"))


# -- module level: one step, 2 ranks vs 1 process ------------------------------------------------


def tiny_target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def make_batches(target: LlamaForCausalLM, layer_ids: list[int]) -> list[StepInput]:
    """Four micro-batches of one width (as in one bucket) with different row counts and
    supervised lengths, so the ranks' loss weights differ; features from the real target."""
    gen = torch.Generator().manual_seed(1)
    extractor = FeatureExtractor(target, layer_ids)
    items = []
    for step, rows in enumerate((2, 3, 1, 2)):
        width = 48
        seq_lens = torch.randint(30, width + 1, (rows,), generator=gen)
        seq_lens[0] = width
        ids = torch.randint(3, 250, (rows, width), generator=gen)
        attention = torch.arange(width)[None, :] < seq_lens[:, None]
        ids = ids.masked_fill(~attention, 0)
        prompt = torch.randint(4, 16, (rows, 1), generator=gen)
        loss_mask = attention & (torch.arange(width)[None, :] >= prompt)
        anchors, keep = sample_anchors(loss_mask, 4, BLOCK, gen, seq_lens=seq_lens)
        batch = Batch(input_ids=ids, loss_mask=loss_mask, attention_mask=attention,
                      seq_lens=seq_lens, anchors=anchors, keep=keep,
                      sample_ids=np.arange(rows), bucket=0, epoch=0, step=step,
                      stream_index=step, num_tokens=int(seq_lens.sum()))
        items.append(StepInput(batch=batch, target=extractor(ids, attention)))
    extractor.close()
    return items


def union(items: list[StepInput]) -> StepInput:
    """One micro-batch holding the rows of ``items`` (same width and anchor count)."""
    batches = [item.batch for item in items]
    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(b, name) for b in batches])

    batch = dataclasses.replace(
        batches[0], **{name: cat(name) for name in Batch.TENSORS},
        sample_ids=np.concatenate([b.sample_ids for b in batches]),
        num_tokens=sum(b.num_tokens for b in batches))
    features = torch.cat([i.target.features for i in items])
    return StepInput(batch=batch, target=TargetOutputs(features=features))


def one_step(target: LlamaForCausalLM, micro_batches: list[StepInput], info: DistInfo,
             wrap: str, grad_accum: int, draft_vocab: bool = False) -> dict:
    """Gradients seen by the optimizer (fused AdamW) at the first step, plus the logged
    loss and grad norm; ``draft_vocab``: with a pruned draft vocabulary (every other token)."""
    torch.manual_seed(0)
    drafter = build_drafter(ModelConfig(num_layers=2, block_size=BLOCK, target_layer_ids=[1, 2],
                                        draft_vocab_size=128 if draft_vocab else None),
                            target.config, mask_token_id=255)
    if draft_vocab:
        set_draft_vocab(drafter, range(0, 256, 2), target.lm_head.weight)
    with torch.no_grad():
        for p in drafter.parameters():  # fresh init has a tiny final norm: make grads sizeable
            p.add_(torch.randn_like(p) * 0.1)
    objective = DFlashObjective(drafter, target.model.embed_tokens.weight, target.lm_head.weight,
                                gamma=4.0, loss_chunk_size=64)
    objective = wrap_drafter(objective, info, DistributedConfig(drafter=wrap))
    params = [p for p in objective.parameters() if p.requires_grad]
    names = {id(p): n.removeprefix("module.") for n, p in objective.named_parameters()}
    cfg = TrainingConfig(lr=1e-3, warmup_ratio=0.0, grad_clip=1e9, grad_accum=grad_accum)
    optimizer = build_optimizer(params, cfg)
    grads: dict[str, torch.Tensor] = {}

    def capture(*_: object) -> None:
        for p in params:
            grads[names[id(p)]] = replicated_full(p.grad).clone()

    optimizer.register_step_pre_hook(capture)
    loop = DrafterStep(objective=objective, parameters=params, optimizer=optimizer,
                            schedule=LRSchedule(optimizer, total_steps=10, cfg=cfg), cfg=cfg,
                            dist_info=info, block_size=BLOCK, autocast_dtype=None)
    for item in micro_batches:
        loop.train_micro_batch(item)
    assert loop.optimizer_step == 1
    metrics = combine(gather_objects(loop.get_metrics(), info))  # the monitor's reduction
    return {"grad": grads, "loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"]}


def replicated_full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (sharded) DTensor gradient; a collective under FSDP."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _join_store(rank: int, port: int) -> None:
    """torchrun's environment for ``rank``: the store is the parent's (see spawn_ranks), as
    torchrun's agent hosts it, so every rank is its client."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)


def _module_worker(rank: int, port: int, out: str) -> None:
    _join_store(rank, port)
    info = init_distributed(PipelineConfig(device="cpu"),
                            DistributedConfig(timeout_s=COLLECTIVE_TIMEOUT_S))
    target = tiny_target()
    items = make_batches(target, [1, 2])
    mine = [items[rank], items[2 + rank]]
    results: dict = {}
    for name, wrap, micro in (("ddp", "ddp", mine[:1]), ("ddp_accum", "ddp", mine),
                              ("fsdp", "fsdp", mine[:1]), ("fsdp_accum", "fsdp", mine),
                              ("ddp_vocab", "ddp", mine[:1]), ("fsdp_vocab", "fsdp", mine[:1])):
        res = one_step(target, micro, info, wrap, grad_accum=len(micro), draft_vocab=name.endswith("_vocab"))
        results[name] = res
        if name == "fsdp":
            results["fsdp_roundtrip"] = fsdp_roundtrip(target, mine[0], info,
                                                       Path(out).parent / "dcp")
    results["target_fsdp_max_diff"] = sharded_target_diff(target, items[rank].batch, info)
    # The trainer's step decisions: rank 1 alone saw a stop, rank 0 alone is due a checkpoint.
    results["any_rank"] = any_rank([rank == 1, rank == 0, False], info)
    # Beside the default group, the one wrap_target makes for the sharded target.
    world = torch.distributed.group.WORLD
    groups = [weakref.ref(pg) for pg in distributed_c10d._world.pg_names if pg is not world]
    close_distributed()
    results["groups_created"] = len(groups)
    results["groups_alive_after_close"] = sum(ref() is not None for ref in groups)
    if rank == 0:
        torch.save(results, out)


def fsdp_roundtrip(target: LlamaForCausalLM, item: StepInput, info: DistInfo, folder: Path) -> bool:
    """After an AdamW step, the weights and AdamW state of a sharded drafter, saved as DCP
    shards (each rank its own part of a CPU snapshot), load into a fresh sharded one and read
    back unchanged (the checkpoint and resume path of drafter=fsdp)."""
    def build(seed: int) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        drafter = build_drafter(ModelConfig(num_layers=2, block_size=BLOCK, target_layer_ids=[1, 2]), target.config,
                                mask_token_id=255)
        objective = wrap_drafter(DFlashObjective(drafter, target.model.embed_tokens.weight,
                                                 target.lm_head.weight, gamma=4.0,
                                                 loss_chunk_size=64),
                                 info, DistributedConfig(drafter="fsdp"))
        # The trained parameters, as the trainer's optimizer holds them.
        params = [p for p in objective.parameters() if p.requires_grad]
        return drafter, objective, torch.optim.AdamW(params, lr=1e-3)

    def full(state: dict) -> dict[str, torch.Tensor]:
        flat = {f"drafter.{k}": v for k, v in state["drafter"].items()}
        flat.update({f"{n}.{k}": v for n, entry in state["optimizer"]["state"].items()
                     for k, v in entry.items()})
        return {k: replicated_full(torch.as_tensor(v)).clone() for k, v in flat.items()}

    drafter, objective, optimizer = build(0)
    objective(item.batch, item.target, 0).mean_loss().backward()
    optimizer.step()
    state = training_state(drafter, optimizer)
    mine = local_part(state, info.rank, info.world_size)
    sharded = all(isinstance(v, DTensor) for v in mine["drafter"].values())
    group = torch.distributed.group.WORLD
    save_train_state(snapshot(mine), folder, group=group)
    drafter2, objective2, optimizer2 = build(1)
    template = training_state(drafter2, optimizer2)
    load_train_state(template, folder, group=group)
    apply_training_state(drafter2, optimizer2, template)
    before, after = full(state), full(training_state(drafter2, optimizer2))
    if not info.is_main:
        return True
    return (sharded and any(k.endswith("exp_avg_sq") for k in before) and before.keys() == after.keys()
            and all(torch.equal(before[k], after[k]) for k in before))


def sharded_target_diff(target: LlamaForCausalLM, batch: Batch, info: DistInfo) -> float:
    """Max |features| difference between the replicated and the FSDP2-sharded target."""
    layer_ids = [1, 2]
    replicated = FeatureExtractor(target, layer_ids)(batch.input_ids, batch.attention_mask)
    sharded_model = wrap_target(tiny_target(), info, DistributedConfig(target="fsdp"))
    assert all(type(p).__name__ == "DTensor" for p in sharded_model.model.layers.parameters())
    sharded = FeatureExtractor(sharded_model, layer_ids)(batch.input_ids, batch.attention_mask)
    return float((replicated.features - sharded.features).abs().max())


@pytest.fixture(scope="module")
def module_results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("module") / "rank0.pt"
    spawn_ranks(_module_worker, str(out), timeout_s=LAUNCH_TIMEOUT_S)
    return torch.load(out, weights_only=False)


def spawn_ranks(worker: Callable[..., None], *args: object, timeout_s: float) -> None:
    """Run ``worker(rank, store_port, *args)`` in WORLD processes; fail the test (killing
    them) if they have not all finished in ``timeout_s``.

    The ranks' TCPStore is served from here, as torchrun's agent serves it, on a port the OS
    picks and that stays bound: no port is released and re-bound, so another launch cannot
    take it in between.
    """
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.spawn(worker, args=(store.port, *args), nprocs=WORLD, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
                process.join()
            pytest.fail(f"the {WORLD} ranks of {worker.__name__} did not finish in {timeout_s} s")


def _stuck_peer_worker(rank: int, port: int, out: str) -> None:
    _join_store(rank, port)
    init_distributed(PipelineConfig(device="cpu"), DistributedConfig(timeout_s=2.0))
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False)
    if rank == 1:
        # Alive but never entering the collective (exiting would fail rank 0 at once).
        store.wait(["rank0_done"], timedelta(seconds=60))
        close_distributed()
        return
    begin = time.monotonic()
    try:
        all_reduce_sum(torch.ones(1))
        outcome = "returned"
    except RuntimeError as exc:
        outcome = f"raised after {time.monotonic() - begin:.1f} s: {exc}"
    Path(out).write_text(outcome)
    store.set("rank0_done", "1")
    # gloo's worker still holds the abandoned all-reduce until rank 1's exit ends it; the
    # group's destructor waits for that here, not during this interpreter's finalization.
    close_distributed()


@pytest.mark.slow
def test_stuck_peer_fails_the_collective_after_the_timeout(tmp_path):
    """distributed.timeout_s bounds a collective that another rank never enters."""
    out = tmp_path / "outcome.txt"
    spawn_ranks(_stuck_peer_worker, str(out), timeout_s=LAUNCH_TIMEOUT_S)
    outcome = out.read_text()
    assert outcome.startswith("raised after"), outcome
    assert 1.5 <= float(outcome.split()[2]) < 30, outcome


def single_process(micro_batches: list[StepInput], grad_accum: int = 1, draft_vocab: bool = False) -> dict:
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=CPU)
    return one_step(tiny_target(), micro_batches, info, "ddp", grad_accum, draft_vocab)


def assert_same_gradients(got: dict, want: dict) -> None:
    assert set(got["grad"]) == set(want["grad"])
    for name, ref in want["grad"].items():
        scale = float(ref.abs().max())
        torch.testing.assert_close(got["grad"][name], ref, rtol=GRAD_RTOL,
                                   atol=GRAD_RTOL * scale, msg=lambda m, name=name: f"{name}: {m}")
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=GRAD_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_two_ranks_step_like_one_process_on_the_union(module_results, wrap):
    items = make_batches(tiny_target(), [1, 2])
    want = single_process([union(items[:2])])
    assert_same_gradients(module_results[wrap], want)
    # The check can fail: averaging the two ranks' own means (no global normalisation)
    # weights the smaller batch's tokens more, and moves the parameters differently.
    a, b = single_process(items[:1]), single_process(items[1:2])
    naive = {k: (a["grad"][k] + b["grad"][k]) / 2 for k in a["grad"]}
    diff = max(float((naive[k] - want["grad"][k]).abs().max() / want["grad"][k].abs().max())
               for k in naive)
    assert diff > 100 * GRAD_RTOL


@pytest.mark.slow
@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_a_pruned_draft_vocabulary_steps_like_one_process(module_results, wrap):
    """The draft vocabulary's head is a buffer: whole on every rank under FSDP, never reduced."""
    items = make_batches(tiny_target(), [1, 2])
    want = single_process([union(items[:2])], draft_vocab=True)
    assert_same_gradients(module_results[f"{wrap}_vocab"], want)
    assert want["loss"] != pytest.approx(single_process([union(items[:2])])["loss"], rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_gradient_accumulation_across_ranks(module_results, wrap):
    """grad_accum=2: gradients are reduced once, after the second micro-batch."""
    items = make_batches(tiny_target(), [1, 2])
    want = single_process([union(items[0:2]), union(items[2:4])], grad_accum=2)
    assert_same_gradients(module_results[f"{wrap}_accum"], want)


@pytest.mark.slow
def test_one_all_reduce_agrees_on_what_any_rank_decided(module_results):
    assert module_results["any_rank"] == [True, True, False]


@pytest.mark.slow
def test_fsdp_state_round_trip_and_sharded_target(module_results):
    assert module_results["fsdp_roundtrip"]
    assert module_results["target_fsdp_max_diff"] == 0.0


@pytest.mark.slow
def test_close_distributed_frees_every_process_group(module_results):
    """A group that outlives close_distributed is destroyed in the interpreter's final
    collection, where gloo's threads releasing Python-owned tensors abort the rank
    (SIGABRT after a successful run: 4 of 91 launches of this module's workers)."""
    assert module_results["groups_created"] >= 1
    assert module_results["groups_alive_after_close"] == 0


# -- trainer level: torchrun runs -----------------------------------------------------------------


@pytest.fixture(scope="module")
def assets_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dist_e2e")
    make_tiny_target(root / "target", layers=3)
    make_chat_jsonl(root / "chat.jsonl", num=16)
    return root


def overrides(root: Path, run_dir: Path, *extra: str) -> list[str]:
    """16 samples in 2 buckets: 4 steps of one batch per rank, 2 epochs."""
    return [f"model.target={root / 'target'}", f"data.paths=[{root / 'chat.jsonl'}]",
            f"run_dir={run_dir}", f"data.cache_dir={root / 'cache'}", "data.max_length=128",
            "data.heldout_samples=0", "pipeline.tokens_per_batch=256", "pipeline.num_buckets=2",
            "pipeline.num_threads=1", "pipeline.prefetch_workers=1", "model.block_size=8",
            "model.dtype=float32",  # the layouts are compared to float32 rounding
            "model.num_layers=1",  # given: the command line (torchrun) and Trainer(cfg) build the same drafter
            "training.num_anchors=8", "training.epochs=2", "training.lr=3e-3",
            "logging.every_steps=1", "logging.console=false", "logging.tensorboard=false",
            "checkpoint.every_steps=3", "checkpoint.keep_last=10", "eval.final=false", *extra]


def torchrun(root: Path, run_dir: Path, *extra: str, expect: int = 0) -> Path:
    """``torchrun --standalone --nproc-per-node 2``: the launcher binds its rendezvous store to
    a port the OS picks, under a fresh rendezvous id, so no two launches can meet on one port.
    Its output is in ``RUN_DIR.log`` beside the run folder; it must exit with ``expect``."""
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone",
           "--nproc-per-node", str(WORLD), "-m", "dflash_trainer", "train",
           *overrides(root, run_dir, f"distributed.timeout_s={COLLECTIVE_TIMEOUT_S}", *extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    log = run_dir.parent / f"{run_dir.name}.log"
    code = run_with_deadline(cmd, env, log, timeout_s=LAUNCH_TIMEOUT_S)
    tail = log.read_text(errors="replace")[-6000:]
    assert code is not None, (f"torchrun did not finish in {LAUNCH_TIMEOUT_S} s; every process "
                              f"was killed after dumping its Python stacks; {log} ends:\n{tail}")
    assert code == expect, f"torchrun exited with code {code}, not {expect}; {log} ends:\n{tail}"
    return run_dir


def run_with_deadline(cmd: list[str], env: dict[str, str], log: Path, *,
                      timeout_s: float) -> int | None:
    """Run ``cmd`` (torchrun) with stdout and stderr to ``log``; its exit code, None on timeout.

    torchrun starts each rank in a session of its own, so killing torchrun (or its process
    group) leaves the ranks running. On timeout, or if this process is interrupted, torchrun
    and every process under it first write their threads' Python stacks to the log (SIGABRT
    under ``PYTHONFAULTHANDLER``), then each is killed with its process group. The output goes
    to a file, not a pipe, so a rank that outlives torchrun cannot keep the test waiting.
    """
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env={**env, "PYTHONFAULTHANDLER": "1"}, cwd=log.parent,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if proc.poll() is None:
                kill_tree(proc, grace_s=10.0)


def kill_tree(proc: subprocess.Popen, *, grace_s: float) -> None:
    """Abort ``proc`` and its descendants (stack dumps), then kill each one's process group."""
    pids = [proc.pid, *descendants(proc.pid)]  # while proc lives: orphans lose their parent
    for pid in pids:
        signal_quietly(os.kill, pid, signal.SIGABRT)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        proc.poll()  # reap torchrun; the ranks are reaped by their new parent
        time.sleep(0.1)
    for pid in pids:
        signal_quietly(os.killpg, pid, signal.SIGKILL)  # torchrun and each rank lead a group
    proc.wait()


def descendants(pid: int) -> list[int]:
    """The live descendants of ``pid``, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and ")"
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found.extend(kids)
        todo.extend(kids)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def signal_quietly(send: Callable[[int, int], None], pid: int, sig: signal.Signals) -> None:
    """``send(pid, sig)``, ignoring a process (group) that is already gone."""
    try:
        send(pid, sig)
    except ProcessLookupError:
        pass


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def per_step(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records(run_dir) if key in r}


@pytest.fixture(scope="module")
def ddp_run(assets_dir) -> Path:
    return torchrun(assets_dir, assets_dir / "ddp")


@pytest.mark.slow
def test_torchrun_two_ranks(ddp_run):
    rows = records(ddp_run)
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, 9)), "rank 0 alone logs, once per step"
    last = rows[-1]
    for key in ("perf/step_time_spread_s", "perf/allreduce_wait_s", "perf/step_time_s"):
        assert all(r[key] >= 0 for r in rows), key
    # Step-aligned: each rank trained one batch per step (counts averaged over ranks).
    trained = sum(v for k, v in last.items() if k.startswith("data/bucket/") and k.endswith("/trained"))
    assert trained == 8
    losses = [r["train/loss"] for r in rows]
    assert losses[-1] < losses[0]
    ckpt = ddp_run / "checkpoints"
    assert {p.name for p in ckpt.iterdir() if p.is_dir()} == {"step-3", "step-6", "step-8"}
    # One DCP state: each rank's data position and RNG streams under its own key, no pickles.
    assert {p.name for p in (ckpt / "step-3").iterdir()} == {"train", "drafter", "config.yaml", "manifest.json"}
    state = read_state(ckpt / "step-3")
    assert set(state["data"]) == set(state["rng"]) == {0, 1} and state["run"]["world_size"] == 2
    # DDP replicas: each rank wrote about half of the (replicated) weights and AdamW state.
    sizes = [p.stat().st_size for p in sorted((ckpt / "step-3" / "train").glob("*.distcp"))]
    assert len(sizes) == 2 and min(sizes) > 0.3 * sum(sizes)
    assert (ddp_run / "drafter" / "model.safetensors").is_file()


class UnionPrefetcher(BatchPrefetcher):
    """Each step's batch is rank 0's batch of the 2-rank plan stacked on rank 1's, each
    collated exactly as that rank would (same rows, same anchor generator)."""

    def __init__(self, dataset, plans, options, **kwargs) -> None:
        super().__init__(dataset, plans, options, **kwargs)
        self._ranks = [BatchPrefetcher(dataset, plans, dataclasses.replace(options, rank=r), **kwargs)
                       for r in range(WORLD)]
        self._two_rank: dict[int, Plan] = {}

    def collate(self, plan: Plan, step_index: int, index: int) -> Batch:
        if plan.epoch not in self._two_rank:
            self._two_rank[plan.epoch] = UnionTrainer.two_rank_plan(self.dataset.lengths,
                                                                    plan.epoch)
        two = self._two_rank[plan.epoch]
        return stack_batches([p.collate(two, step_index, index) for p in self._ranks])


def stack_batches(batches: list[Batch]) -> Batch:
    """Rows of ``batches`` in one batch, right-padded to the widest (padding as collate does)."""
    width = max(b.shape[1] for b in batches)
    num = max(b.anchors.shape[1] for b in batches)
    def pad(t: torch.Tensor, n: int) -> torch.Tensor:
        return F.pad(t, (0, n - t.shape[1]))

    tensors = {name: torch.cat([pad(getattr(b, name), width) for b in batches])
               for name in ("input_ids", "loss_mask", "attention_mask")}
    tensors.update(anchors=torch.cat([pad(b.anchors, num) for b in batches]),
                   keep=torch.cat([pad(b.keep, num) for b in batches]),
                   seq_lens=torch.cat([b.seq_lens for b in batches]))
    return dataclasses.replace(batches[0], **tensors,
                               sample_ids=np.concatenate([b.sample_ids for b in batches]),
                               num_tokens=sum(b.num_tokens for b in batches))


class UnionTrainer:
    """One process whose plan is the 2-rank plan with each step's two batches joined."""

    pipeline: PipelineConfig
    seed: int

    @classmethod
    def two_rank_plan(cls, lengths: np.ndarray, epoch: int) -> Plan:
        return build_plan(lengths, cls.pipeline, seed=cls.seed, epoch=epoch, world_size=WORLD)

    @staticmethod
    def union_plan(plans: components.EpochPlans, epoch: int) -> Plan:
        plan = UnionTrainer.two_rank_plan(plans.lengths, epoch)
        steps = [Step(s.bucket, (np.concatenate(s.batches),)) for s in plan.steps]
        return dataclasses.replace(plan, steps=steps, world_size=1)


@pytest.mark.slow
def test_two_ranks_match_one_rank_on_the_union(ddp_run, assets_dir, monkeypatch):
    """The 1-rank run trains, at every step, on exactly the rows and anchors the two ranks
    had (stacked into one batch) with the same weights init and schedule. Compared: the
    logged train/loss and train/grad_norm of every step (relative 1e-5; fp32 summation
    order differs, observed ~2e-7 after 8 AdamW steps), and the tokens counted (exact)."""
    cfg = load_config(None, overrides(assets_dir, assets_dir / "union"))
    UnionTrainer.pipeline, UnionTrainer.seed = cfg.pipeline, cfg.training.seed
    monkeypatch.setattr(pipeline_module, "BatchPrefetcher", UnionPrefetcher)
    monkeypatch.setattr(components.EpochPlans, "build", UnionTrainer.union_plan)
    threads = torch.get_num_threads()
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
        torch.set_num_threads(threads)
    union_run = assets_dir / "union"
    for key in ("train/loss", "train/grad_norm"):
        got, want = per_step(ddp_run, key), per_step(union_run, key)
        assert list(got) == list(range(1, 9)) and list(want) == list(got)
        assert got == pytest.approx(want, rel=TRAIN_RTOL), key
    # Token counters are summed over ranks: whole-job throughput.
    total = "train/tokens_total"
    assert records(ddp_run)[-1][total] == records(union_run)[-1][total] > 0


@pytest.mark.slow
def test_resume_with_two_ranks_reproduces_the_run(ddp_run, assets_dir):
    # Rank 0's clock makes every step due a checkpoint: the ranks agree on it (or the
    # snapshot's collectives would hang), and checkpoints change nothing the run computes.
    resumed = torchrun(assets_dir, assets_dir / "resumed",
                       f"checkpoint.resume={ddp_run / 'checkpoints' / 'step-3'}",
                       "checkpoint.every_minutes=1e-9")
    want = {s: v for s, v in per_step(ddp_run, "train/loss").items() if s > 3}
    got = per_step(resumed, "train/loss")
    assert list(got) == list(want) == [4, 5, 6, 7, 8]
    assert got == want, "bitwise: same data, anchors, RNG and optimizer state"
    saved = {p.name for p in (resumed / "checkpoints").iterdir() if p.is_dir()}
    assert {f"step-{s}" for s in range(4, 9)} <= saved


@pytest.mark.slow
def test_two_ranks_extend_a_finished_run_with_a_replanned_schedule(ddp_run, assets_dir, tmp_path: Path):
    """A finished 2-epoch run resumed with training.epochs=3 on 2 ranks trains 4 more steps, each
    above lr 0 and decreasing, on the re-planned curve; rank 0 alone prints the changes."""
    run_dir = tmp_path / "extended"
    shutil.copytree(ddp_run, run_dir)
    torchrun(assets_dir, run_dir, "checkpoint.resume=auto", "training.epochs=3", "training.lr=2e-3")
    lrs = per_step(run_dir, "train/lr")
    new = [lrs[s] for s in range(9, 13)]
    assert list(lrs)[-1] == 12 and all(lr > 0 for lr in new), lrs
    assert all(a > b for a, b in zip(new, new[1:])), new
    log = (tmp_path / "extended.log").read_text()
    lines = [line for line in log.splitlines() if line.startswith(("resume: ", "LR schedule: "))]
    assert lines[0] == f"resume: run_dir changed from {str(ddp_run)!r} (checkpoint) to {str(run_dir)!r}; " \
                       "applies from the first resumed step"
    assert lines[1:3] == [
        "resume: training.epochs changed from 2 (checkpoint) to 3; what depends on it is recomputed",
        "resume: training.lr changed from 0.003 (checkpoint) to 0.002; applies from the first resumed step"]
    assert len(lines) == 4 and "re-planned for the new end (the checkpoint's curve ended at step 8)" in lines[3]
    assert lines[3].endswith(f"lr {new[0]:.3g} at step 9, {new[-1]:.3g} at step 12")


@pytest.mark.slow
def test_a_corrupt_shard_is_reported_once_by_rank_0(ddp_run, assets_dir, tmp_path: Path):
    """Rank 0 alone validates the checkpoint and broadcasts the verdict: one line in all."""
    run_dir = tmp_path / "corrupt"
    shutil.copytree(ddp_run, run_dir)
    shard = run_dir / "checkpoints" / "step-8" / "train" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-8:] = b"\x7f" * 8
    shard.write_bytes(bytes(data))
    # Each rank exits 2; torchrun reports a failed launch as 1.
    torchrun(assets_dir, run_dir, f"checkpoint.resume={shard.parent.parent}", expect=1)
    lines = [line for line in (tmp_path / "corrupt.log").read_text().splitlines()
             if "dflash-trainer train:" in line]
    assert len(lines) == 1, lines
    assert "train/__1_0.distcp does not match its checksum" in lines[0]
    assert "exitcode: 2" in (tmp_path / "corrupt.log").read_text()


@pytest.mark.slow
def test_fsdp_drafter_and_sharded_target_train_like_ddp(ddp_run, assets_dir):
    run = torchrun(assets_dir, assets_dir / "fsdp", "distributed.drafter=fsdp",
                   "distributed.target=fsdp", "eval.final=true")
    for key in ("train/loss", "train/grad_norm"):
        assert per_step(run, key) == pytest.approx(per_step(ddp_run, key), rel=TRAIN_RTOL), key
    # Each rank wrote its own shards; read back whole, they are the DDP run's weights.
    saved = load_drafter_weights(run / "checkpoints" / "step-6")
    reference = load_drafter_weights(ddp_run / "checkpoints" / "step-6")
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in reference.items()}
    assert all(torch.allclose(saved[k], reference[k], rtol=TRAIN_RTOL, atol=1e-6) for k in saved)
    shards = sorted(p.name for p in (run / "checkpoints" / "step-6" / "train").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    assert (run / "drafter" / "model.safetensors").is_file()
    # Rank 0 cannot decode with a sharded target: the final evaluation says what to run instead.
    log = (run.parent / f"{run.name}.log").read_text()
    assert log.count("final evaluation skipped: distributed.target=fsdp shards the target") == 1
    assert f"dflash-trainer eval --config {run / 'config.yaml'} --drafter {run / 'drafter'}" in log


# -- a sharded target's stop: every rank runs the same target forwards ----------------------------

STOP_TIMEOUT_S = 40
"""distributed.timeout_s of the early-stop runs: a rank left in a target collective would
fail only after this long; each rank must close well before."""


@pytest.mark.slow
@pytest.mark.parametrize("moment, extra", [
    ("sigterm", ()), ("max_time_s", ("training.max_time_s=0.001",)),
    ("max_steps", ("training.max_steps=2", "pipeline.round_shapes=always")),
    ("leftover", ("training.grad_accum=3",))])
def test_sharded_target_stops_early_on_one_rank_without_waiting_for_a_timeout(
        assets_dir, tmp_path, moment, extra):
    """distributed.target=fsdp, a slow target and rank 1 leaving its pipeline 2 s after rank 0
    (tests/helpers_dist_stop.py): rank 0's target stage stops first, at each moment a stop
    comes from; without the stages' agreement rank 1's would start a forward whose
    all-gathers rank 0 never joins, and wait there for distributed.timeout_s."""
    run_dir = tmp_path / "run"
    script = Path(__file__).resolve().parent / "helpers_dist_stop.py"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node",
           str(WORLD), str(script), moment,
           *overrides(assets_dir, run_dir, "distributed.target=fsdp",
                      f"distributed.timeout_s={STOP_TIMEOUT_S}", *extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    log = tmp_path / "torchrun.log"
    code = run_with_deadline(cmd, env, log, timeout_s=LAUNCH_TIMEOUT_S)
    text = log.read_text(errors="replace")
    assert code == 0, text[-6000:]
    assert "still running after close" not in text, text[-6000:]
    closed = [float(s) for s in re.findall(r"closed ([\d.]+) s after its pipeline", text)]
    assert len(closed) == WORLD and max(closed) < STOP_TIMEOUT_S / 2, closed
    steps = [r["step"] for r in records(run_dir)]
    stopped = {"sigterm": "stopped by signal SIGTERM", "max_time_s": "training max_time_s after",
               "max_steps": "training completed after 2 steps",
               "leftover": "training completed after 2 steps"}[moment]
    assert stopped in text, text[-6000:]
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] < 8, steps
    # Padded shapes (as on CUDA) train too, and their set is printed at start-up.
    printed = "drafter attention shapes (pipeline.round_shapes): context widths [128]"
    assert (printed in text) == ("pipeline.round_shapes=always" in extra), text[-6000:]
