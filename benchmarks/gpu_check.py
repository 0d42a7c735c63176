"""Check and time everything that only runs on a GPU, in one short script.

    python -m benchmarks.gpu_check --out gpu_check.json          # one GPU, about 5 minutes
    python -m benchmarks.gpu_check --device cpu --tiny --out x.json   # same code paths, tiny

Sections, each on fresh random inputs (a failing section is reported, the others still run):

- env: torch / CUDA / device facts.
- matmul: the measured bf16 matmul ceiling (TFLOP/s), the denominator of every MFU here.
- flex_vs_sdpa: the drafter training forward (``DFlashObjective``: blocks, masks, drafter,
  chunked loss) with FlexAttention and a ``BlockMask`` vs SDPA and the dense mask, in the
  training precision (fp32 weights, bf16 autocast), both against an fp32 SDPA reference:
  drafter outputs, loss and every parameter gradient. On CPU: forward only, fp32 (FlexAttention
  has no CPU backward).
- train_step: full training steps (target features -> drafter -> chunked LM-head loss ->
  backward -> clip -> AdamW) at reference shapes, a Qwen3-8B-like geometry: hidden 4096,
  5 drafter layers, block 16, 512 anchors, length 3072, vocab 151936, with a random
  5-layer Qwen3 target; model TFLOP/s and MFU against the measured ceiling, step time with
  SDPA for comparison, peak memory, and the number of recompilations during timed steps.
- pipeline: the same steps pipelined (prefetch workers, target stage on its own CUDA stream,
  drafter step) vs sequential (one thread, one stream): overlap ratio, data_wait_frac.
- loss_memory: peak ``torch.cuda.max_memory_allocated`` of forward + backward of the LM-head
  loss at reference shapes, chunked (``loss.chunked_head_loss``) vs unchunked
  (``loss.reference_head_loss``), and whether their losses and gradients agree.
- nccl: a 1-process NCCL process group, an all_reduce with a known answer, its time (gloo on
  CPU, so the code path still runs).

The table printed last says ok / FAIL / warn / skipped / error per section; the JSON file
(``--out``) holds every number. Exit status 1 if a section failed or raised.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.pipeline import Parts, RunResult, run_pipelined, run_sequential
from dflash_trainer.components import build, peak_flops
from dflash_trainer.config import ModelConfig, load_config
from dflash_trainer.distributed import DistInfo
from dflash_trainer.flops import LayerDims, StepShape
from dflash_trainer.flops import step_flops as model_step_flops
from dflash_trainer.model.batch import Batch
from dflash_trainer.model.blocks import flex_block_mask, sample_anchors, slot_weights
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.model.loss import chunked_head_loss, reference_head_loss
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.target import TargetOutputs
from dflash_trainer.pipeline.pipeline import PipelineSettings

GAMMA = 7.0
LOSS_CHUNK = 1024
BF16_REL_TOL = 2e-2
"""Flex vs SDPA, both in bf16: relative L2 error allowed (bf16 has 8 mantissa bits)."""
FP32_REL_TOL = 1e-4
"""Flex vs SDPA, both in fp32 (CPU)."""
WAIT_GOAL = 0.02
"""data_wait_frac the pipeline should stay under when the target is not the bottleneck."""


@dataclass(frozen=True, kw_only=True)
class Geometry:
    """Model and batch shapes of one section."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    target_layers: int
    drafter_layers: int
    block_size: int
    num_anchors: int
    seq_len: int
    batch: int

    @property
    def layer_ids(self) -> list[int]:
        """Target layers feeding the drafter: one per drafter layer, ending just below the
        target's last layer (which the trainer refuses: servers read it after the final norm)."""
        return list(range(self.target_layers - 1 - self.drafter_layers, self.target_layers - 1))


REFERENCE = Geometry(hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128,
                     vocab=151936, target_layers=6, drafter_layers=5, block_size=16,
                     num_anchors=512, seq_len=3072, batch=1)
"""Qwen3-8B-DFlash-b16 drafter shapes; the target is Qwen3-8B cut to 6 layers, of which the
feature forward runs 5 (it stops after the deepest feature layer)."""
CHECK = Geometry(hidden=1024, intermediate=3072, heads=8, kv_heads=2, head_dim=128, vocab=32000,
                 target_layers=3, drafter_layers=2, block_size=16, num_anchors=64,
                 seq_len=1024, batch=2)
"""The flex-vs-SDPA comparison: small enough for an fp32 reference, with GQA and 2 rows."""
TINY = Geometry(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=512,
                target_layers=3, drafter_layers=2, block_size=16, num_anchors=16, seq_len=128,
                batch=2)


@dataclass(kw_only=True)
class Settings:
    """What this invocation runs with."""

    device: torch.device
    tiny: bool
    dtype: torch.dtype
    """Training compute dtype: bf16 autocast on CUDA, fp32 on CPU (as the trainer)."""
    steps: int
    warmup: int
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


def make_target(geom: Geometry, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random frozen Qwen3 causal LM with the geometry's width and ``target_layers`` layers."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=geom.vocab, hidden_size=geom.hidden,
                         intermediate_size=geom.intermediate,
                         num_hidden_layers=geom.target_layers,
                         num_attention_heads=geom.heads, num_key_value_heads=geom.kv_heads,
                         head_dim=geom.head_dim, max_position_embeddings=max(4096, geom.seq_len),
                         tie_word_embeddings=False, rope_theta=1e6)
    with torch.device(device):  # initialise where it will live: no host copy of the weights
        model = Qwen3ForCausalLM(config)
    return model.to(dtype).eval().requires_grad_(False)


def make_drafter(geom: Geometry, target_config: Any, device: torch.device) -> torch.nn.Module:
    """The trainer's drafter for ``target_config`` (fp32 weights, as the trainer keeps them)."""
    model_cfg = ModelConfig(num_layers=geom.drafter_layers, block_size=geom.block_size,
                            target_layer_ids=geom.layer_ids)
    with torch.device(device):
        drafter = build_drafter(model_cfg, target_config, mask_token_id=geom.vocab - 1)
    return drafter.to(device)


class SyntheticTokens:
    """Random token samples of one length; the first 10% of each is an unsupervised prompt."""

    def __init__(self, num: int, length: int, vocab: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        # The last id is the mask token; keep it out of the data.
        self._ids = rng.integers(0, vocab - 1, size=(num, length), dtype=np.int32)
        self._mask = np.ones((num, length), dtype=np.uint8)
        self._mask[:, : max(1, length // 10)] = 0
        self.lengths = np.full(num, length, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self._ids[index], self._mask[index]

    def token_ids(self) -> np.ndarray:
        """The distinct token ids of the samples."""
        return np.unique(self._ids)


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """bf16 autocast as ``DrafterStep`` uses it; nothing for fp32."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def step_flops(geom: Geometry, *, mean_anchor: float) -> dict[str, float]:
    """Model FLOPs of one training step of ``geom`` (see :mod:`dflash_trainer.flops`)."""
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


def rate_text(flops_per_s: float) -> str:
    """``12.3 TFLOP/s`` or, below 1 TFLOP/s, ``45.6 GFLOP/s``."""
    if flops_per_s >= 1e12:
        return f"{flops_per_s / 1e12:.1f} TFLOP/s"
    return f"{flops_per_s / 1e9:.1f} GFLOP/s"


def _compile_count() -> int | None:
    """Graphs torch.compile has compiled so far in this process (None if unknown)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
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
    out = {"hidden": rel_err(run["hidden"], ref["hidden"]),
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


def section_flex_vs_sdpa(st: Settings) -> Section:
    """FlexAttention + BlockMask vs SDPA + dense mask in the drafter training forward."""
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
        data["flex_vs_sdpa"] = _compare(flex, sdpa)
        data["flex_vs_fp32"] = _compare(flex, ref)
        data["sdpa_vs_fp32"] = _compare(sdpa, ref)
        tol = BF16_REL_TOL
        keys = ("hidden", "loss", "grads")
        # Flex must agree with SDPA in bf16 and be no less accurate than SDPA against fp32.
        ok = all(data["flex_vs_sdpa"][k] <= tol for k in keys) and all(
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
                   f"sdpa {data['sdpa_vs_fp32']['grads']:.1e}")
        note = f"{dropped} dropped blocks in the batch"
    else:
        sdpa = _objective_pass(objective, batch, features, "sdpa", torch.float32, backward=False)
        with warnings.catch_warnings():
            # The unfused CPU path is the only one there is; its warning is expected.
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch")
            flex = _objective_pass(objective, batch, features, "flex", torch.float32,
                                   backward=False)
        data["flex_vs_sdpa"] = _compare(flex, sdpa)
        tol = FP32_REL_TOL
        ok = all(data["flex_vs_sdpa"][k] <= tol for k in ("hidden", "loss"))
        d = data["flex_vs_sdpa"]
        summary = f"rel err flex vs sdpa (fp32, forward): out {d['hidden']:.1e} loss {d['loss']:.1e}"
        note = ("gradients skipped: FlexAttention has no CPU backward; "
                f"{dropped} dropped blocks in the batch")
    data["tolerance"] = tol
    return Section("flex_vs_sdpa", status="ok" if ok else "FAIL", summary=summary, note=note,
                   data=data)


def build_train_parts(st: Settings, geom: Geometry) -> Parts:
    """The trainer's components (``components.build``) on a random target and synthetic data
    at ``geom``."""
    target = make_target(geom, st.device, st.dtype)
    dataset = SyntheticTokens(16 * geom.batch, geom.seq_len, geom.vocab, seed=0)
    cfg = load_config(None, [
        f"model.num_layers={geom.drafter_layers}", f"model.block_size={geom.block_size}",
        f"model.target_layer_ids={geom.layer_ids}", f"model.mask_token_id={geom.vocab - 1}",
        f"training.gamma={GAMMA}", f"training.loss_chunk_size={LOSS_CHUNK}",
        f"training.num_anchors={geom.num_anchors}", "training.seed=0",
        f"data.max_length={geom.seq_len}",
        "pipeline.num_buckets=1", f"pipeline.tokens_per_batch={geom.batch * geom.seq_len}",
        f"pipeline.max_batch_size={geom.batch}", f"pipeline.device={st.device.type}"])
    c = build(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=st.device),
              target=target, data=dataset)
    return Parts(components=c, settings=PipelineSettings.from_config(cfg,
                                                                     block_size=geom.block_size),
                 info={"drafter_params": sum(p.numel() for p in c.drafter.parameters()),
                       "target_params": sum(p.numel() for p in target.parameters()),
                       "objective": c.objective})


def section_train_step(st: Settings, ceiling_tflops: float | None,
                       keep: dict[str, Any]) -> Section:
    """Timed full training steps at reference shapes (sequential, one stream)."""
    geom = TINY if st.tiny else REFERENCE
    device = st.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    parts = build_train_parts(st, geom)
    keep["parts"] = parts
    objective: DFlashObjective = parts.info["objective"]
    # Compile warm-up (flex kernels, block-mask construction) outside every timed window.
    warm_start = time.perf_counter()
    run_sequential(parts, steps=1, warmup=max(1, st.warmup - 1))
    warm_s = time.perf_counter() - warm_start
    compiles_before = _compile_count()
    seq = run_sequential(parts, steps=st.steps, warmup=1)
    compiles_after = _compile_count()
    recompiles = (None if compiles_before is None or compiles_after is None
                  else compiles_after - compiles_before)
    peak_gib = (torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda"
                else None)
    step_s = seq.seconds / seq.steps
    mean_anchor = float(np.mean([geom.seq_len // 10, geom.seq_len - geom.block_size]))
    flops = step_flops(geom, mean_anchor=mean_anchor)
    tflops = flops["total"] / step_s / 1e12
    data: dict[str, Any] = {
        # model.attention=auto: flex on CUDA, SDPA with the dense mask elsewhere.
        "geometry": asdict(geom), "attention": "flex" if device.type == "cuda" else "sdpa",
        "drafter_params": parts.info["drafter_params"],
        "target_params": parts.info["target_params"], "warmup_s": warm_s,
        "step_s": step_s, "stage_s_per_step": {k: v / seq.steps for k, v in seq.stage_s.items()},
        "flops_per_step": flops, "tflops": tflops, "tokens_per_s": seq.tokens_per_s,
        "recompiles_during_timed_steps": recompiles, "peak_memory_gib": peak_gib,
        "sequential": asdict(seq),
    }
    if ceiling_tflops:
        data["mfu_vs_measured"] = tflops / ceiling_tflops
    spec = peak_flops(device)
    if spec:
        data["mfu_vs_spec"] = tflops * 1e12 / spec
    if device.type == "cuda":
        if data["attention"] == "flex":
            data["block_mask_s"] = _time_block_mask(geom, device)
            # The same steps with SDPA and the dense mask, to show what flex buys.
            objective.attention = "sdpa"
            try:
                sdpa = run_sequential(parts, steps=max(2, st.steps // 2), warmup=1)
                data["sdpa_step_s"] = sdpa.seconds / sdpa.steps
            except torch.cuda.OutOfMemoryError:
                # SDPA with a dense mask and GQA can fall back to the math kernel, which holds
                # [heads, Q, S + Q] scores per layer: a finding, not a failure of this check.
                data["sdpa_step_s"] = "out of memory"
            finally:
                objective.attention = "auto"
                parts.drafter_step.optimizer.zero_grad(set_to_none=True)
                _free(device)
    keep["seq"] = seq
    mfu = data.get("mfu_vs_measured")
    summary = (f"{step_s * 1e3:.0f} ms/step ({data['attention']}), {rate_text(tflops * 1e12)}"
               + (f", MFU {mfu:.1%} of measured" if mfu is not None else ""))
    if isinstance(data.get("sdpa_step_s"), float):
        summary += f"; sdpa {data['sdpa_step_s'] * 1e3:.0f} ms/step"
    elif "sdpa_step_s" in data:
        summary += f"; sdpa {data['sdpa_step_s']}"
    if peak_gib is not None:
        summary += f"; peak {peak_gib:.1f} GiB"
    status, notes = "ok", [f"{data['drafter_params'] / 1e6:.2f}M drafter params, "
                           f"warm-up {warm_s:.0f} s"]
    if recompiles:
        status = "warn"
        notes.append(f"{recompiles} recompilations during timed steps")
    return Section("train_step", status=status, summary=summary, note="; ".join(notes),
                   data=data)


def _time_block_mask(geom: Geometry, device: torch.device) -> float:
    """Seconds to build one FlexAttention BlockMask at ``geom`` (after its compilation)."""
    generator = torch.Generator().manual_seed(3)
    loss_mask = torch.ones(geom.batch, geom.seq_len, dtype=torch.bool)
    anchors, keep = sample_anchors(loss_mask, geom.num_anchors, geom.block_size, generator)
    anchors, keep = anchors.to(device), keep.to(device)
    return time_it(lambda: flex_block_mask(anchors, keep, geom.seq_len, geom.block_size), device,
                   iters=5, warmup=1)


def section_pipeline(st: Settings, keep: dict[str, Any]) -> Section:
    """The pipelined run of the train-step setup vs its sequential run."""
    parts: Parts | None = keep.get("parts")
    seq: RunResult | None = keep.get("seq")
    if parts is None or seq is None:
        return Section("pipeline", status="skipped", note="needs the train_step section")
    pipe = run_pipelined(parts, steps=st.steps, warmup=st.warmup)
    ratio = pipe.tokens_per_s / seq.tokens_per_s
    stages = seq.stage_s
    bound = sum(stages.values()) / max(stages.values()) if stages else math.nan
    data = {"pipelined": asdict(pipe), "sequential": asdict(seq),
            "overlap_ratio": ratio, "ideal_overlap_bound": bound,
            "data_wait_frac": pipe.data_wait_frac}
    summary = (f"pipelined/sequential {ratio:.2f}x (ideal {bound:.2f}x), data_wait_frac "
               f"{pipe.data_wait_frac:.3f}, busy target {pipe.busy['target']:.2f} drafter "
               f"{pipe.busy['drafter']:.2f}")
    notes, status = [], "ok"
    if ratio < 0.97:
        status = "warn"
        notes.append("pipelined slower than sequential")
    if pipe.data_wait_frac is not None and pipe.data_wait_frac > WAIT_GOAL:
        target_share = stages.get("target", 0.0) / max(sum(stages.values()), 1e-9)
        notes.append(f"data_wait_frac above {WAIT_GOAL} (target is {target_share:.0%} of a "
                     f"sequential step)")
        if stages.get("target", 0.0) < stages.get("drafter", 0.0):
            status = "warn"
    if st.device.type == "cpu":
        notes.append("CPU: both threads share the same cores")
    return Section("pipeline", status=status, summary=summary, note="; ".join(notes), data=data)


def section_loss_memory(st: Settings) -> Section:
    """Peak memory and agreement of the chunked vs unchunked LM-head loss."""
    geom = TINY if st.tiny else REFERENCE
    device = st.device
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    slots = geom.batch * geom.num_anchors * (geom.block_size - 1)
    generator = torch.Generator().manual_seed(7)
    head = (torch.randn(geom.vocab, geom.hidden, generator=generator) * 0.02).to(device, dtype)
    hidden0 = torch.randn(slots, geom.hidden, generator=generator).to(device, dtype)
    labels = torch.randint(0, geom.vocab, (slots,), generator=generator).to(device)
    weights = slot_weights(geom.block_size, GAMMA).repeat(slots // (geom.block_size - 1)).to(device)
    results: dict[str, dict[str, Any]] = {}
    for name in ("reference", "chunked"):
        hidden = hidden0.clone().requires_grad_(True)
        _sync(device)
        _free(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        if name == "reference":
            total, _ = reference_head_loss(hidden, head, labels, weights)
        else:
            total, _ = chunked_head_loss(hidden, head, labels, weights, LOSS_CHUNK)
        total.backward()
        _sync(device)
        entry: dict[str, Any] = {"seconds": time.perf_counter() - start,
                                 "loss": total.item(), "grad": hidden.grad.float()}
        if cuda:
            entry["peak_extra_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
        results[name] = entry
        del total, hidden
    grad_err = rel_err(results["chunked"]["grad"], results["reference"]["grad"])
    loss_err = abs(results["chunked"]["loss"] - results["reference"]["loss"]) / abs(
        results["reference"]["loss"])
    for entry in results.values():
        del entry["grad"]
    tol = BF16_REL_TOL if dtype == torch.bfloat16 else FP32_REL_TOL
    ok = grad_err <= tol and loss_err <= tol
    data = {"slots": slots, "hidden": geom.hidden, "vocab": geom.vocab, "chunk": LOSS_CHUNK,
            "dtype": str(dtype).replace("torch.", ""), "loss_rel_err": loss_err,
            "grad_rel_err": grad_err, **results}
    summary = f"loss rel err {loss_err:.1e}, grad rel err {grad_err:.1e}"
    note = ""
    if cuda:
        ref_gib = results["reference"]["peak_extra_gib"]
        chunk_gib = results["chunked"]["peak_extra_gib"]
        data["memory_ratio"] = ref_gib / max(chunk_gib, 1e-9)
        summary = (f"peak +{ref_gib:.2f} GiB unchunked vs +{chunk_gib:.2f} GiB chunked "
                   f"({data['memory_ratio']:.1f}x); " + summary)
    else:
        note = "peak memory skipped: torch.cuda allocator stats need CUDA"
    return Section("loss_memory", status="ok" if ok else "FAIL", summary=summary, note=note,
                   data=data)


def section_nccl(st: Settings) -> Section:
    """A 1-process group (NCCL on CUDA, gloo on CPU): init, all_reduce, timing."""
    import torch.distributed as dist

    cuda = st.device.type == "cuda"
    backend = "nccl" if cuda else "gloo"
    if cuda and not dist.is_nccl_available():
        return Section("nccl", status="FAIL", note="this torch build has no NCCL")
    if dist.is_initialized():
        return Section("nccl", status="skipped", note="a process group already exists")
    kwargs = {"device_id": st.device} if cuda else {}
    start = time.perf_counter()
    # The store listens on a port the OS picks and keeps: nothing else can take it meanwhile.
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True,
                          timeout=timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=60), **kwargs)
    try:
        init_s = time.perf_counter() - start
        numel = (1 << 14) if st.tiny else (1 << 27)  # 256 MiB of bf16 on the GPU
        dtype = torch.bfloat16 if cuda else torch.float32
        tensor = torch.full((numel,), 3.0, device=st.device, dtype=dtype)
        dist.all_reduce(tensor)
        ok = bool((tensor == 3.0).all())
        seconds = time_it(lambda: dist.all_reduce(tensor), st.device, iters=5, warmup=1)
        gib = numel * tensor.element_size() / 2**30
        data = {"backend": backend, "world_size": 1, "init_s": init_s, "all_reduce_s": seconds,
                "size_gib": gib, "correct": ok}
        if cuda:
            data["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    finally:
        dist.destroy_process_group()
    summary = (f"{backend} 1-process init {init_s:.2f} s, all_reduce {gib * 1024:.1f} MiB "
               f"{seconds * 1e3:.2f} ms, result {'correct' if ok else 'WRONG'}")
    note = "" if cuda else "NCCL skipped (no CUDA): gloo runs the same code path"
    if cuda and torch.cuda.device_count() > 1:
        note = (f"{torch.cuda.device_count()} GPUs: multi-rank bandwidth is not measured here "
                f"(use torchrun)")
    return Section("nccl", status="ok" if ok else "FAIL", summary=summary, note=note, data=data)


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


def main(argv: list[str] | None = None) -> int:
    """Run every section, print the table last, write the JSON; 1 if a check failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU self-test)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per run (default 10, tiny 3)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps per run (default 3, tiny 1)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="sections that would start after this many seconds are skipped")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--out", default=None, help="write every number here as JSON")
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
    st = Settings(device=device, tiny=args.tiny,
                  dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                  steps=args.steps or (3 if args.tiny else 10),
                  warmup=args.warmup if args.warmup is not None else (1 if args.tiny else 3),
                  budget_s=args.budget_s, started=started)
    keep: dict[str, Any] = {}
    sections = [run_section(st, "env", lambda: section_env(st))]
    sections.append(run_section(st, "matmul", lambda: section_matmul(st)))
    ceiling = (sections[-1].data or {}).get("ceiling_tflops")
    sections.append(run_section(st, "nccl", lambda: section_nccl(st)))
    sections.append(run_section(st, "loss_memory", lambda: section_loss_memory(st)))
    sections.append(run_section(st, "flex_vs_sdpa", lambda: section_flex_vs_sdpa(st)))
    sections.append(run_section(st, "train_step", lambda: section_train_step(st, ceiling, keep)))
    sections.append(run_section(st, "pipeline", lambda: section_pipeline(st, keep)))
    keep.clear()
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
