"""Prometheus metrics of the orchestrator, on one registry per frontend, served at /metrics.

Modules report what happened (a queue wait, a rejected request); nothing here decides or
changes how a request is served.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.queue_wait = Histogram(
            "disagg_queue_wait_seconds",
            "Time a request waited for an admission slot",
            buckets=_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.rejected = Counter(
            "disagg_rejected_requests",
            "Requests turned away before any leg ran",
            ["reason"],  # queue_full | queue_timeout | draining
            registry=self.registry,
        )
        self.active = Gauge(
            "disagg_active_requests", "Requests holding an admission slot", registry=self.registry
        )
        self.queued = Gauge(
            "disagg_queued_requests", "Requests waiting for a slot", registry=self.registry
        )

        self.prediction_error = Histogram(
            "disagg_cache_prediction_error_tokens",
            "|predicted - actual| cached prompt tokens at the context worker",
            buckets=(0, 16, 64, 256, 1024, 4096),
            registry=self.registry,
        )
        self.mispredictions = Counter(
            "disagg_cache_mispredictions",
            "Context legs whose cached tokens were off the prediction by more than a block",
            registry=self.registry,
        )

    def observe_prediction(self, predicted: int, actual: int, block_size: int) -> None:
        error = abs(predicted - actual)
        self.prediction_error.observe(error)
        if error > block_size:
            self.mispredictions.inc()

    def track(self, active: Callable[[], float], queued: Callable[[], float]) -> None:
        """Read the gauges from the admission controller when scraped."""
        self.active.set_function(active)
        self.queued.set_function(queued)

    def render(self) -> bytes:
        return generate_latest(self.registry)
