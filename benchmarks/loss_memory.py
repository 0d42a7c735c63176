"""Peak memory of the LM-head loss: naive (full logits under autograd) vs chunked.

    python -m benchmarks.loss_memory [--slots 1920] [--hidden 576] [--vocab 49152] [--chunk 256]

Defaults are one SmolLM2-size micro-batch: 128 anchors x 15 supervised slots, hidden 576,
vocab 49152. Each variant runs forward + backward once in its own subprocess; the extra peak
resident memory over the inputs (``ru_maxrss`` minus the RSS after building the inputs) is
compared in this one run, and the two losses and gradients are checked to agree.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from dflash_trainer.model.loss import chunked_head_loss, reference_head_loss


def _current_rss_kb() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() // 1024


def child(args: argparse.Namespace) -> None:
    """Run one variant and print its peak memory as JSON."""
    torch.manual_seed(0)
    hidden = torch.randn(args.slots, args.hidden, requires_grad=True)
    head = torch.randn(args.vocab, args.hidden) * 0.1
    labels = torch.randint(0, args.vocab, (args.slots,))
    weights = torch.rand(args.slots)
    base = _current_rss_kb()
    start = time.perf_counter()
    if args.mode == "naive":
        total, _ = reference_head_loss(hidden, head, labels, weights)
    else:
        total, _ = chunked_head_loss(hidden, head, labels, weights, args.chunk)
    total.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"extra_mb": (peak - base) / 1024, "seconds": seconds, "loss": total.item(),
                      "grad_norm": hidden.grad.norm().item()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=128 * 15)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--mode", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        child(args)
        return
    results = {}
    for mode in ("naive", "chunked"):
        cmd = [sys.executable, __file__, "--mode", mode, "--slots", str(args.slots), "--hidden",
               str(args.hidden), "--vocab", str(args.vocab), "--chunk", str(args.chunk)]
        results[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    naive, chunked = results["naive"], results["chunked"]
    logits_mb = args.slots * args.vocab * 4 / 2 ** 20
    print(f"slots {args.slots}, hidden {args.hidden}, vocab {args.vocab}, chunk {args.chunk} "
          f"(one fp32 [slots, vocab] logits tensor = {logits_mb:.0f} MB)")
    for mode, r in results.items():
        print(f"  {mode:8s} extra peak {r['extra_mb']:8.1f} MB   fwd+bwd {r['seconds']:.2f} s   "
              f"loss {r['loss']:.4f}   grad norm {r['grad_norm']:.6f}")
    agree = (abs(naive["loss"] - chunked["loss"]) <= 1e-4 * abs(naive["loss"])
             and abs(naive["grad_norm"] - chunked["grad_norm"]) <= 1e-4 * naive["grad_norm"])
    print(f"peak memory ratio naive / chunked: {naive['extra_mb'] / max(chunked['extra_mb'], 1e-3):.1f}x; "
          f"loss and gradient {'agree' if agree else 'DIFFER'}")


if __name__ == "__main__":
    main()
