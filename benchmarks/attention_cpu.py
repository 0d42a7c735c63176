"""Drafter training step on CPU: blockwise attention vs SDPA with a dense block mask.

    python -m benchmarks.attention_cpu [--anchors 64 192] [--seq-len 512] [--threads 1] [--repeats 4]

One SmolLM2-size drafter step (1 layer, hidden 576, vocab 49152, block 16, KL labels, loss on
the first 3 slots, bf16 autocast): forward + backward of the objective on one sequence, for
each anchor count and each ``model.attention`` mode, interleaved in one run so both see the
same machine load. Prints the best-of-``repeats`` step time per mode and the ratio
blockwise / sdpa, and checks that both modes give the same loss.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig

from dflash_trainer.config import ModelConfig
from dflash_trainer.model.batch import Batch
from dflash_trainer.model.blocks import sample_anchors
from dflash_trainer.model.drafter import build_drafter
from dflash_trainer.model.objective import DFlashObjective
from dflash_trainer.model.target import TargetOutputs

# SmolLM2-135M-Instruct's shapes; the weights do not matter for timing.
SMOLLM2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152)


def step_time(objective: DFlashObjective, batch: Batch, target: TargetOutputs) -> tuple[float, float]:
    """Seconds of one forward + backward, and the loss."""
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = objective(batch, target, 0).mean_loss()
    loss.backward()
    objective.drafter.zero_grad(set_to_none=True)
    return time.perf_counter() - start, float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--anchors", type=int, nargs="+", default=[64, 192])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    drafter = build_drafter(ModelConfig(num_layers=1, block_size=16), SMOLLM2, mask_token_id=0)
    head = (torch.randn(SMOLLM2.vocab_size, SMOLLM2.hidden_size) * 0.02).to(torch.bfloat16)
    seq = args.seq_len
    ids = torch.randint(0, SMOLLM2.vocab_size, (1, seq))
    loss_mask = torch.ones(1, seq, dtype=torch.bool)
    features = torch.randn(1, seq, SMOLLM2.hidden_size, dtype=torch.bfloat16)
    final_hidden = torch.randn(1, seq, SMOLLM2.hidden_size, dtype=torch.bfloat16)
    modes = ("sdpa", "blockwise")
    objectives = {m: DFlashObjective(drafter, head, head, gamma=7.0, loss_chunk_size=1024, labels="kl",
                                     attention=m, loss_slots=3) for m in modes}
    print(f"{'anchors':>7} {'sdpa s':>8} {'blockwise s':>11} {'ratio':>6}")
    for num in args.anchors:
        anchors, keep = sample_anchors(loss_mask, num, 16, torch.Generator().manual_seed(0))
        batch = Batch.of_rows(ids, loss_mask, anchors=anchors, keep=keep)
        target = TargetOutputs(features=features, final_hidden=final_hidden)
        times: dict[str, list[float]] = {m: [] for m in modes}
        losses: dict[str, float] = {}
        for _ in range(args.repeats + 1):  # the first round warms up allocators and kernels
            for mode in modes:
                seconds, losses[mode] = step_time(objectives[mode], batch, target)
                times[mode].append(seconds)
        best = {m: min(t[1:]) for m, t in times.items()}
        if abs(losses["sdpa"] - losses["blockwise"]) > 1e-2 * abs(losses["sdpa"]):
            raise SystemExit(f"losses differ: {losses}")
        print(f"{num:>7} {best['sdpa']:>8.3f} {best['blockwise']:>11.3f} {best['blockwise'] / best['sdpa']:>6.2f}")


if __name__ == "__main__":
    main()
