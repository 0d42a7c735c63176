"""The engine-served target's work as monitor metrics (``pipe/engine/*``).

The engine's requests run on the client's own worker threads under the target stage, which
reports them as its forward (``pipe/target/*``); this source adds what only the client knows.
A slow engine shows in the drafter step as ``perf/data_wait_frac``.
"""

from __future__ import annotations

from dflash_trainer.features.engine import VllmFeatureClient
from dflash_trainer.training.pipeline.metrics import Max, Metric, Ratio, Sum

__all__ = ["EngineMetrics"]


class EngineMetrics:
    """``get_metrics()`` over a :class:`VllmFeatureClient`'s windows: requests and tokens served,
    tokens per second and mean request time, requests in flight and the megabytes of
    hidden-states files waiting on disk at the end of the window."""

    def __init__(self, client: VllmFeatureClient, name: str = "engine") -> None:
        self.client = client
        self.name = name

    def get_metrics(self) -> dict[str, Metric]:
        """The window since the previous call."""
        w = self.client.take_window()
        return {f"pipe/{self.name}/requests": Sum(float(w.requests)),
                f"pipe/{self.name}/tokens": Sum(float(w.tokens)),
                f"pipe/{self.name}/tokens_per_s": Ratio(float(w.tokens), w.seconds),
                f"pipe/{self.name}/request_s": Ratio(w.request_s, float(w.requests)),
                f"pipe/{self.name}/inflight": Max(float(w.inflight)),
                f"pipe/{self.name}/exchange_mb": Max(w.exchange_bytes / 1e6)}
