"""The first hour on a real GPU: everything that only runs there, checked in one script.

    python -m benchmarks.gpu_check --out gpu_check.json        # one GPU: under 10 minutes
    python -m benchmarks.gpu_check --device cpu --tiny --out x.json   # dry run, tiny shapes

Sections, in order (a failing section is reported, the others still run):

- env: torch / CUDA / device facts.
- matmul: the measured bf16 matmul ceiling, the denominator of the MFU below.
- flex_vs_sdpa: the drafter training forward (``DFlashObjective``) with FlexAttention and a
  ``BlockMask`` vs SDPA and the dense mask, in bf16 autocast, both against an fp32 SDPA
  reference: drafter outputs, loss and every parameter gradient (CPU: forward only, fp32).
- sanitizer: ~20 pipelined training steps in a child process under ``TORCH_CUDA_SANITIZER=1``
  (PyTorch's stream sanitizer fails the step that reads a tensor another stream may still
  write), with a delay put in front of every drafter step.
- losses: the per-step losses of pipelined steps (target stage on its own stream and thread,
  the same delay in front of every drafter step) equal those of the same steps run one after
  the other in one thread: a batch overwritten across streams would change them.
- recompiles: ~40 steps over data of 6 length buckets with ``TORCH_LOGS=recompiles``: the
  compiled FlexAttention's graph count levels off and dynamo never hits its recompile limit
  (which would fall back to the unfused kernel); the padded shape set is printed.
- memory: training steps with the full Qwen3-8B target (36 layers, random weights) and its
  5-layer drafter at 3072 tokens, 512 anchors: peak memory, step time, MFU.
- kill_resume: ``dflash-trainer train`` on the device, SIGKILL after its second checkpoint,
  ``--resume auto`` continues from it, then SIGTERM: a final checkpoint and exit 0.
- two_gpu: with 2 GPUs, torchrun with NCCL and ``distributed.target=fsdp``: ranks stop early
  without waiting for a collective, and rank 1 holds no CUDA context on GPU 0 (on CPU: the
  same run with 2 gloo ranks; skipped on a single GPU).

It prints one table last (ok / FAIL / warn / skipped / error per section) and writes every
number to one JSON file (``--out``). Exit status 1 if a section failed or raised.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import gpu_check_runs
from benchmarks.gpu_parts import (
    BUCKETED, CHECK, GAMMA, LOSS_CHUNK, QWEN3_8B, TINY, TINY_BUCKETED, Geometry,
    build_train_parts, drafter_delay, make_drafter, make_target, pipelined_steps,
    sequential_steps)
from dflash_trainer.training.components import peak_flops
from dflash_trainer.training.flops import LayerDims, StepShape
from dflash_trainer.training.flops import step_flops as model_step_flops
from dflash_trainer.model.batch import Batch
from dflash_trainer.model.blocks import sample_anchors
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.shapes import FLEX_BLOCK, ShapeSizes
from dflash_trainer.model.target import TargetOutputs

BF16_REL_TOL = 2e-2
"""Flex vs SDPA, both in bf16: relative L2 error allowed (bf16 has 8 mantissa bits)."""
FP32_REL_TOL = 1e-4
"""Flex vs SDPA, both in fp32 (CPU)."""
CUDA_LOSS_RTOL = 1e-4
"""Pipelined vs sequential per-step loss on CUDA (CPU: bitwise). The same kernels run in both,
but not every CUDA kernel is bitwise reproducible; a batch overwritten across streams changes
the loss by far more."""
DELAY_S = 0.05
"""The delay put in front of each drafter step of the sanitizer and losses sections."""


@dataclass(kw_only=True)
class Settings:
    """What this invocation runs with."""

    device: torch.device
    tiny: bool
    dtype: torch.dtype
    """Training compute dtype: bf16 on CUDA, fp32 on CPU (as the trainer)."""
    budget_s: float
    started: float


@dataclass
class Section:
    """One row of the final table."""

    name: str
    status: str = "ok"
    summary: str = ""
    note: str = ""
    data: dict[str, Any] | None = None
    seconds: float = 0.0


# -- helpers ---------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in fp64 (0 when both are zero)."""
    x, ref = x.detach().double(), ref.detach().double()
    denom = ref.norm().item()
    diff = (x - ref).norm().item()
    return diff / denom if denom > 0 else diff


def time_it(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Mean seconds per call of ``fn`` (synchronised around the timed loop)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters



def rate_text(flops_per_s: float) -> str:
    """``12.3 TFLOP/s`` or, below 1 TFLOP/s, ``45.6 GFLOP/s``."""
    if flops_per_s >= 1e12:
        return f"{flops_per_s / 1e12:.1f} TFLOP/s"
    return f"{flops_per_s / 1e9:.1f} GFLOP/s"


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """bf16 autocast as ``DrafterStep`` uses it; nothing for fp32."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def step_flops(geom: Geometry, *, mean_anchor: float) -> dict[str, float]:
    """Model FLOPs of one training step of ``geom`` (see :mod:`dflash_trainer.training.flops`)."""
    g = geom
    dims = LayerDims(hidden=g.hidden, intermediate=g.intermediate, heads=g.heads,
                     kv_heads=g.kv_heads, head_dim=g.head_dim)
    flops = model_step_flops(
        target=dims, target_layers_run=max(g.layer_ids) + 1, target_head=False, drafter=dims,
        drafter_layers=g.drafter_layers, num_features=len(g.layer_ids), vocab=g.vocab,
        shape=StepShape(rows=g.batch, seq_len=g.seq_len, num_anchors=g.num_anchors,
                        block_size=g.block_size, mean_anchor=mean_anchor))
    del flops["target_head"]
    return flops


def compile_count() -> int:
    """Graphs torch.compile has compiled so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# -- sections ---------------------------------------------------------------------------------


def section_env(st: Settings) -> Section:
    """Versions and device facts."""
    data: dict[str, Any] = {
        "torch": torch.__version__, "python": platform.python_version(),
        "device": str(st.device), "cpu_count": os.cpu_count(), "tiny": st.tiny,
        "dtype": str(st.dtype).replace("torch.", ""),
        "cuda": torch.version.cuda, "gpu_count": torch.cuda.device_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import transformers

        data["transformers"] = transformers.__version__
    except ImportError:
        data["transformers"] = None
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        data["flex_attention"] = True
    except ImportError:
        data["flex_attention"] = False
    summary = f"torch {data['torch']}"
    if st.device.type == "cuda":
        props = torch.cuda.get_device_properties(st.device)
        data.update(name=props.name, memory_gib=props.total_memory / 2**30,
                    capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count)
        summary += f", {props.name} ({data['memory_gib']:.0f} GiB), CUDA {data['cuda']}"
    else:
        summary += f", CPU x{data['cpu_count']}, {data['torch_threads']} torch threads"
    return Section("env", summary=summary, data=data)


def section_matmul(st: Settings) -> Section:
    """The measured matmul ceiling in the training dtype: max over a few square sizes."""
    sizes = [128, 256] if st.tiny else [4096, 8192, 12288]
    dtype = torch.bfloat16 if st.device.type == "cuda" else torch.float32
    results = {}
    for n in sizes:
        a = torch.randn(n, n, device=st.device, dtype=dtype)
        b = torch.randn(n, n, device=st.device, dtype=dtype)
        iters = 20 if st.tiny else max(10, int(2e14 // (2 * n ** 3)))
        seconds = time_it(lambda a=a, b=b: a @ b, st.device, iters)
        results[n] = 2 * n ** 3 / seconds / 1e12
        del a, b
    best = max(results, key=results.get)
    data = {"dtype": str(dtype).replace("torch.", ""), "tflops_by_size": results,
            "ceiling_tflops": results[best], "best_size": best}
    return Section("matmul", summary=f"{rate_text(results[best] * 1e12)} {data['dtype']} "
                   f"(n={best})", data=data)


def _check_inputs(geom: Geometry, device: torch.device, dtype: torch.dtype,
                  generator: torch.Generator) -> tuple[Batch, TargetOutputs]:
    """A batch for the objective: row 0 long and mostly supervised, row 1 padded and with
    fewer valid anchors than ``num_anchors`` (dropped blocks), plus random target features."""
    s = geom.seq_len
    input_ids = torch.randint(0, geom.vocab - 1, (geom.batch, s), generator=generator)
    seq_lens = torch.full((geom.batch,), s, dtype=torch.long)
    loss_mask = torch.zeros(geom.batch, s, dtype=torch.bool)
    loss_mask[0, s // 10:] = True
    if geom.batch > 1:
        short = s * 3 // 5
        seq_lens[1:] = short
        input_ids[1:, short:] = 0
        span = geom.num_anchors // 2
        loss_mask[1:, short - span:short] = True  # span - 1 valid anchors (a and a + 1 supervised)
    anchors, keep = sample_anchors(loss_mask, geom.num_anchors, geom.block_size, generator,
                                   seq_lens=seq_lens)
    batch = Batch.of_rows(input_ids, loss_mask, anchors=anchors, keep=keep, seq_lens=seq_lens)
    features = torch.randn(geom.batch, s, len(geom.layer_ids) * geom.hidden, generator=generator)
    return batch.to(device), TargetOutputs(features=features.to(device=device, dtype=dtype))


def _objective_pass(objective: DFlashObjective, batch: Batch,
                    target: TargetOutputs, attention: str, amp_dtype: torch.dtype,
                    backward: bool) -> dict[str, Any]:
    """One forward (and backward) of the objective; drafter output, loss and gradients."""
    captured: dict[str, torch.Tensor] = {}
    hook = objective.drafter.register_forward_hook(
        lambda module, args, output: captured.__setitem__("hidden", output.detach().float()))
    objective.attention = attention
    objective.drafter.zero_grad(set_to_none=True)
    device = target.features.device
    try:
        with torch.set_grad_enabled(backward), autocast(device, amp_dtype):
            loss = objective(batch, target, step=0).mean_loss()
        if backward:
            loss.backward()
    finally:
        hook.remove()
    grads = {name: p.grad.detach().float().clone()
             for name, p in objective.drafter.named_parameters() if p.grad is not None}
    return {"hidden": captured["hidden"], "loss": loss.detach().float(), "grads": grads}


def _compare(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    # A padded run (pipeline.round_shapes) has the padding blocks' rows after the real ones.
    hidden = run["hidden"][:, :ref["hidden"].shape[1]]
    out = {"hidden": rel_err(hidden, ref["hidden"]),
           "loss": rel_err(run["loss"], ref["loss"])}
    if ref["grads"]:
        names = sorted(ref["grads"])
        flat = torch.cat([run["grads"][n].flatten() for n in names])
        flat_ref = torch.cat([ref["grads"][n].flatten() for n in names])
        per_param = {n: rel_err(run["grads"][n], ref["grads"][n]) for n in names}
        worst = max(per_param, key=per_param.get)
        out.update(grads=rel_err(flat, flat_ref), worst_param=worst,
                   worst_param_err=per_param[worst])
    return out


@contextlib.contextmanager
def _padded(objective: DFlashObjective, geom: Geometry) -> Iterator[None]:
    """The objective padding its shapes as the trainer's does on CUDA (pipeline.round_shapes),
    to sizes just above the batch's: both its width and its anchor count get padding."""
    def above(n: int, unit: int) -> int:
        return (n // unit + 1) * unit

    objective.shape_sizes = ShapeSizes(widths=(above(geom.seq_len, FLEX_BLOCK),),
                                       anchors=(above(geom.num_anchors, 8),))
    objective.round_shapes = "always"
    try:
        yield
    finally:
        objective.shape_sizes, objective.round_shapes = None, "auto"


def section_flex_vs_sdpa(st: Settings) -> Section:
    """FlexAttention + BlockMask (as it is and with padded shapes) vs SDPA + dense mask in the
    drafter training forward."""
    geom = TINY if st.tiny else CHECK
    device = st.device
    cuda = device.type == "cuda"
    generator = torch.Generator().manual_seed(1234)
    target_dtype = torch.bfloat16 if cuda else torch.float32
    target = make_target(geom, device, target_dtype)
    drafter = make_drafter(geom, target.config, device)
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    objective = DFlashObjective(drafter, embed, head, gamma=GAMMA, loss_chunk_size=LOSS_CHUNK)
    batch, features = _check_inputs(geom, device, target_dtype, generator)
    dropped = int((~batch.keep).sum())
    data: dict[str, Any] = {"geometry": asdict(geom), "dropped_blocks": dropped}
    if cuda:
        ref = _objective_pass(objective, batch, features, "sdpa", torch.float32, backward=True)
        sdpa = _objective_pass(objective, batch, features, "sdpa", st.dtype, backward=True)
        flex = _objective_pass(objective, batch, features, "flex", st.dtype, backward=True)
        with _padded(objective, geom):
            padded = _objective_pass(objective, batch, features, "flex", st.dtype,
                                     backward=True)
        data["flex_vs_sdpa"] = _compare(flex, sdpa)
        data["padded_flex_vs_sdpa"] = _compare(padded, sdpa)
        data["flex_vs_fp32"] = _compare(flex, ref)
        data["sdpa_vs_fp32"] = _compare(sdpa, ref)
        tol = BF16_REL_TOL
        keys = ("hidden", "loss", "grads")
        # Flex must agree with SDPA in bf16 and be no less accurate than SDPA against fp32.
        ok = all(data[f"{run}_vs_sdpa"][k] <= tol for k in keys for run in ("flex", "padded_flex")) and all(
            data["flex_vs_fp32"][k] <= 2 * data["sdpa_vs_fp32"][k] + 1e-3 for k in keys)
        fwd_bwd = {}
        for name in ("sdpa", "flex"):
            fwd_bwd[name] = time_it(lambda n=name: _objective_pass(
                objective, batch, features, n, st.dtype, backward=True), device, iters=3,
                warmup=1)
        data["fwd_bwd_s"] = fwd_bwd
        d = data["flex_vs_sdpa"]
        summary = (f"rel err flex vs sdpa (bf16): out {d['hidden']:.1e} loss {d['loss']:.1e} "
                   f"grads {d['grads']:.1e}; vs fp32 flex {data['flex_vs_fp32']['grads']:.1e} "
                   f"sdpa {data['sdpa_vs_fp32']['grads']:.1e}; padded flex vs sdpa grads "
                   f"{data['padded_flex_vs_sdpa']['grads']:.1e}")
        note = f"{dropped} dropped blocks in the batch"
    else:
        sdpa = _objective_pass(objective, batch, features, "sdpa", torch.float32, backward=False)
        with warnings.catch_warnings():
            # The unfused CPU path is the only one there is; its warning is expected.
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch")
            flex = _objective_pass(objective, batch, features, "flex", torch.float32,
                                   backward=False)
            with _padded(objective, geom):
                padded = _objective_pass(objective, batch, features, "flex", torch.float32,
                                         backward=False)
        data["flex_vs_sdpa"] = _compare(flex, sdpa)
        data["padded_flex_vs_sdpa"] = _compare(padded, sdpa)
        tol = FP32_REL_TOL
        ok = all(data[f"{run}_vs_sdpa"][k] <= tol for k in ("hidden", "loss")
                 for run in ("flex", "padded_flex"))
        d = data["flex_vs_sdpa"]
        summary = (f"rel err flex vs sdpa (fp32, forward): out {d['hidden']:.1e} loss "
                   f"{d['loss']:.1e}; padded flex out "
                   f"{data['padded_flex_vs_sdpa']['hidden']:.1e}")
        note = ("gradients skipped: FlexAttention has no CPU backward; "
                f"{dropped} dropped blocks in the batch")
    data["tolerance"] = tol
    return Section("flex_vs_sdpa", status="ok" if ok else "FAIL", summary=summary, note=note,
                   data=data)



def section_losses(st: Settings) -> Section:
    """Per-step losses of pipelined steps (a delay before each drafter step) vs sequential."""
    geom = TINY if st.tiny else CHECK
    steps = 6 if st.tiny else 12
    runs = {}
    for mode in ("sequential", "pipelined"):
        # Built afresh for each run: the same seed gives the same drafter and optimizer.
        parts = build_train_parts(geom, st.device, st.dtype, samples=4 * steps)
        if mode == "sequential":
            runs[mode] = sequential_steps(parts, steps)
        else:
            runs[mode] = pipelined_steps(parts, steps, delay=drafter_delay(st.device, DELAY_S))
        del parts
        _free(st.device)
    seq, pipe = runs["sequential"].losses, runs["pipelined"].losses
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(pipe, seq)]
    equal = sum(a == b for a, b in zip(pipe, seq))
    tol = CUDA_LOSS_RTOL if st.device.type == "cuda" else 0.0
    ok = runs["sequential"].tokens == runs["pipelined"].tokens and max(diffs) <= tol
    data = {"geometry": asdict(geom), "steps": steps, "delay_s": DELAY_S,
            "sequential": seq, "pipelined": pipe, "max_rel_diff": max(diffs),
            "bitwise_equal_steps": equal, "tolerance": tol}
    return Section("losses", status="ok" if ok else "FAIL",
                   summary=f"{equal}/{steps} steps bitwise equal, max rel diff {max(diffs):.1e} "
                           f"(allowed {tol:.0e}), {DELAY_S * 1e3:.0f} ms drafter delay",
                   data=data)


class _DynamoLog(logging.Handler):
    """Collects dynamo's recompile reasons and recompile-limit warnings."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.recompiles: list[str] = []
        self.limit_hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "recompile_limit" in text or "cache_size_limit" in text:
            self.limit_hits.append(text[:500])
        elif "Recompiling" in text:
            self.recompiles.append(text[:500])


def section_recompiles(st: Settings) -> Section:
    """~40 steps over bucketed data: compiles level off, no recompile-limit hit."""
    geom = TINY_BUCKETED if st.tiny else BUCKETED
    steps = 10 if st.tiny else 40
    parts = build_train_parts(geom, st.device, st.dtype, samples=8 * steps)
    objective: DFlashObjective = parts.info["objective"]
    rounding = objective.rounds_shapes(st.device)
    handler = _DynamoLog()
    torch_logger = logging.getLogger("torch")
    torch_logger.addHandler(handler)
    torch._logging.set_logs(recompiles=True)  # what TORCH_LOGS=recompiles turns on
    try:
        before = compile_count()
        log = pipelined_steps(parts, steps, after_step=lambda: compile_count() - before)
    finally:
        torch._logging.set_logs()
        torch_logger.removeHandler(handler)
    counts = log.after_step
    settle = steps * 3 // 4
    last_compile = max((i + 1 for i in range(steps) if counts[i] > (counts[i - 1] if i else 0)),
                       default=0)
    sizes = objective.shape_sizes if rounding else None
    data = {"geometry": asdict(geom), "steps": steps, "compiles_per_step": counts,
            "batch_shapes": len(set(log.shapes)), "shapes": log.shapes,
            "round_shapes": rounding, "shape_sizes": asdict(sizes) if sizes else None,
            "recompile_reasons": handler.recompiles, "recompile_limit_hits": handler.limit_hits,
            "step_s": log.seconds}
    status = "ok"
    notes = [sizes.describe() if sizes else "shapes not rounded (no FlexAttention here)"]
    if handler.limit_hits:
        status = "FAIL"
        notes.append("dynamo hit its recompile limit: FlexAttention fell back to the unfused "
                     "kernel")
    elif counts[-1] != counts[settle - 1]:
        status = "warn"
        notes.append(f"compiled again after step {settle}")
    summary = (f"{counts[-1]} graphs compiled over {steps} steps (last at step {last_compile}), "
               f"{data['batch_shapes']} distinct batch shapes, "
               f"{len(handler.recompiles)} recompiles logged")
    return Section("recompiles", status=status, summary=summary, note="; ".join(notes),
                   data=data)


def section_memory(st: Settings, ceiling_tflops: float | None) -> Section:
    """Training steps at the full Qwen3-8B target shapes: peak memory, step time, MFU."""
    geom = TINY if st.tiny else QWEN3_8B
    steps = 2 if st.tiny else 4
    cuda = st.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(st.device)
    parts = build_train_parts(geom, st.device, st.dtype, samples=4 * (steps + 1))
    built_gib = torch.cuda.memory_allocated(st.device) / 2**30 if cuda else None
    log = pipelined_steps(parts, steps + 1)  # the first step compiles
    peak_gib = torch.cuda.max_memory_allocated(st.device) / 2**30 if cuda else None
    step_s = sum(log.seconds[1:]) / steps
    flops = step_flops(geom, mean_anchor=geom.seq_len / 2)
    tflops = flops["total"] / step_s / 1e12
    data: dict[str, Any] = {
        "geometry": asdict(geom), "target_params": parts.info["target_params"],
        "drafter_params": parts.info["drafter_params"], "after_build_gib": built_gib,
        "peak_gib": peak_gib, "step_s": step_s, "tflops": tflops,
        "tokens_per_s": sum(log.tokens[1:]) / sum(log.seconds[1:]), "losses": log.losses}
    if ceiling_tflops:
        data["mfu_vs_measured"] = tflops / ceiling_tflops
    spec = peak_flops(st.device)
    if spec:
        data["mfu_vs_spec"] = tflops * 1e12 / spec
    del parts
    summary = f"{step_s * 1e3:.0f} ms/step, {rate_text(tflops * 1e12)}"
    if "mfu_vs_measured" in data:
        summary += f", MFU {data['mfu_vs_measured']:.1%} of measured"
    status = "ok"
    note = (f"{data['target_params'] / 1e6:.1f}M target, {data['drafter_params'] / 1e6:.1f}M "
            f"drafter parameters")
    if cuda:
        total = torch.cuda.get_device_properties(st.device).total_memory / 2**30
        data["device_gib"] = total
        summary = f"peak {peak_gib:.1f} of {total:.0f} GiB (weights etc. {built_gib:.1f}); " + summary
        if peak_gib > 0.9 * total:
            status = "warn"
            note += "; peak above 90% of the device"
    else:
        note += "; peak memory needs CUDA"
    if not all(math.isfinite(v) for v in log.losses):
        status = "FAIL"
        note += "; non-finite loss"
    return Section("memory", status=status, summary=summary, note=note, data=data)


def sanitized_steps(device: torch.device, tiny: bool, steps: int) -> int:
    """The child process of the sanitizer section: pipelined steps with SDPA (the sanitizer
    follows eager kernels; compiled ones are opaque to it), a delay before each drafter step;
    prints the losses; a race the sanitizer sees raises, and the exit status is 1."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    geom = TINY if tiny else CHECK
    parts = build_train_parts(geom, device, dtype, samples=2 * steps,
                              overrides=("model.attention=sdpa",))
    log = pipelined_steps(parts, steps, delay=drafter_delay(device, DELAY_S))
    print(json.dumps({"sanitized_steps": len(log.losses), "losses": log.losses}), flush=True)
    return 0


# -- driver -----------------------------------------------------------------------------------


def run_section(st: Settings, name: str, fn: Callable[[], Section]) -> Section:
    """Run one section within the time budget; an exception becomes an ``error`` row."""
    used = time.perf_counter() - st.started
    if used > st.budget_s:
        return Section(name, status="skipped", note=f"time budget: {used:.0f} s used of "
                       f"{st.budget_s:.0f} s")
    start = time.perf_counter()
    try:
        section = fn()
    except Exception as exc:  # reported in the table and the JSON; the other sections run
        section = Section(name, status="error", summary=f"{type(exc).__name__}: {exc}"[:300],
                          data={"traceback": traceback.format_exc()})
        print(section.data["traceback"], file=sys.stderr, flush=True)
    section.seconds = time.perf_counter() - start
    _free(st.device)
    print(f"[{section.seconds:6.1f} s] {name}: {section.status} {section.summary}", flush=True)
    return section


def format_table(sections: list[Section]) -> str:
    """The final table: one row per section."""
    width = max(len(s.name) for s in sections)
    lines = [f"{'section':<{width}}  {'status':<7} {'s':>6}  result", "-" * 100]
    for s in sections:
        text = s.summary + (f"  [{s.note}]" if s.note else "")
        lines.append(f"{s.name:<{width}}  {s.status:<7} {s.seconds:>6.1f}  {text}")
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)



SECTIONS = ("env", "matmul", "flex_vs_sdpa", "losses", "sanitizer", "recompiles", "memory",
            "kill_resume", "two_gpu")


def main(argv: list[str] | None = None) -> int:
    """Run every section, print the table last, write the JSON; 1 if a check failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU dry run)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=None,
                        help="run these sections alone")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="sections that would start after this many seconds are skipped")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--out", default=None, help="write every number here as JSON")
    parser.add_argument("--sanitized-steps", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch build sees no CUDA device")
    if device.type == "cpu" and not args.tiny:
        parser.error("reference shapes need a GPU; on CPU run with --tiny")
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    if args.sanitized_steps is not None:
        return sanitized_steps(device, args.tiny, args.sanitized_steps)
    st = Settings(device=device, tiny=args.tiny,
                  dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                  budget_s=args.budget_s, started=started)
    ceiling: dict[str, float | None] = {"tflops": None}

    def matmul() -> Section:
        section = section_matmul(st)
        ceiling["tflops"] = (section.data or {}).get("ceiling_tflops")
        return section

    runs = {"env": lambda: section_env(st), "matmul": matmul,
            "flex_vs_sdpa": lambda: section_flex_vs_sdpa(st),
            "losses": lambda: section_losses(st),
            "sanitizer": lambda: gpu_check_runs.section_sanitizer(st),
            "recompiles": lambda: section_recompiles(st),
            "memory": lambda: section_memory(st, ceiling["tflops"]),
            "kill_resume": lambda: gpu_check_runs.section_kill_resume(st),
            "two_gpu": lambda: gpu_check_runs.section_two_gpu(st)}
    sections = [run_section(st, name, runs[name]) for name in (args.only or SECTIONS)]
    total = time.perf_counter() - started
    failed = [s.name for s in sections if s.status in ("FAIL", "error")]
    print()
    print(format_table(sections))
    print(f"total {total:.0f} s; " + (f"FAILED: {', '.join(failed)}" if failed
                                      else "no check failed"))
    if args.out:
        payload = {"total_s": total, "failed": failed,
                   "sections": {s.name: {"status": s.status, "summary": s.summary,
                                         "note": s.note, "seconds": s.seconds,
                                         **(s.data or {})} for s in sections}}
        Path(args.out).write_text(json.dumps(_jsonable(payload), indent=2) + "\n")
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
