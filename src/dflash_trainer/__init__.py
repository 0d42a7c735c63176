"""dflash-trainer: train DFlash block-diffusion drafters for a frozen target LLM.

The package's parts, each importing only those above it in this list (tests/test_layering.py;
docs/architecture.md, "Layout"):

- ``core``: errors and exit codes, files written atomically, input checks, embedded assets,
  processes, locks and process groups.
- ``config``: the run config, one section per part.
- ``data``: chat data to token stores, length buckets, regeneration. ``model``: the drafters, the
  target's hidden states, masks and losses. ``engines``: llama.cpp and vLLM built and served.
- ``features``: the feature store (the target's hidden states computed once).
- ``training``: the runtime: pipeline stages joined by bounded channels, the drafter step,
  checkpoints, exports.
- ``evaluation``: speculative decoding, acceptance and speed-up, engines compared, generation.
- ``reporting``: the run's HTML report.
- ``cli``: the ``dflash-trainer`` commands and the demo.
"""

from dflash_trainer.core.version import __version__

__all__ = ["__version__"]
