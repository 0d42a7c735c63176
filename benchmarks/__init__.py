"""Benchmarks built from the trainer's own parts (``components.build``, the ``DrafterStep``, the
``TrainingPipeline`` and the prefetcher's ``collate``), so that a change to the trainer is a
change to what they measure. Run each from the repository root as a module, e.g.
``python -m benchmarks.pipeline --help``.
"""
