"""A torchrun rank of ``dflash-trainer train`` whose ranks stop at different moments.

    torchrun --standalone --nproc-per-node 2 tests/helpers_dist_stop.py MOMENT OVERRIDES...

The frozen target's forward is slowed (``TARGET_DELAY_S``), so the features channel has room
and each rank's target stage is always about to start its next forward; rank 1 leaves its
pipeline ``PEER_DELAY_S`` after its training loop ended, so rank 0's stages stop first while
rank 1's still run. Without one agreed order of the target's collectives, rank 1's stage would
start a forward of the sharded target that rank 0's never joins. MOMENT ``sigterm`` sends
SIGTERM to rank 0 alone after its second micro-batch; the other moments come from the
overrides (``training.max_time_s``, ``training.max_steps``, ``training.grad_accum``). Each rank
prints ``rank R closed N.N s after its pipeline began to stop``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

TARGET_DELAY_S = 0.3
PEER_DELAY_S = 2.0


def main() -> int:
    from dflash_trainer.cli.main import main as cli_main
    from dflash_trainer.model.target import FeatureExtractor
    from dflash_trainer.training.pipeline.drafter_step import DrafterStep
    from dflash_trainer.training.pipeline.pipeline import TrainingPipeline

    moment, overrides = sys.argv[1], sys.argv[2:]
    rank = int(os.environ["RANK"])
    began: list[float] = []

    forward = FeatureExtractor.__call__

    def slow_forward(self, input_ids, attention_mask=None):
        time.sleep(TARGET_DELAY_S)
        return forward(self, input_ids, attention_mask)

    exit_pipeline = TrainingPipeline.__exit__

    def late_exit(self, *args):
        began.append(time.monotonic())
        if rank == 1:
            time.sleep(PEER_DELAY_S)
        return exit_pipeline(self, *args)

    train_micro_batch = DrafterStep.train_micro_batch

    def signalled_step(self, item):
        stepped = train_micro_batch(self, item)
        if moment == "sigterm" and rank == 0 and self.micro_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return stepped

    FeatureExtractor.__call__ = slow_forward
    TrainingPipeline.__exit__ = late_exit
    DrafterStep.train_micro_batch = signalled_step
    code = cli_main(["train", *overrides])
    print(f"rank {rank} closed {time.monotonic() - began[0]:.1f} s after its pipeline began "
          f"to stop", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
