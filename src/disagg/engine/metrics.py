"""The reference worker's Prometheus exposition (`GET /metrics`): one snapshot of its figures
(the scheduler's stats, KV transfers, waiting handoffs: sequences running and waiting, KV
blocks free / used / cached / pinned, prefix-cache tokens, transfers by kind), and the
histograms it is told of as they happen (forward step times, KV transfer sizes and times).
Names prefixed `disagg_engine_`. It records and formats; it reads nothing itself.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Snapshot(Collector):
    def __init__(self, role: str, stats: dict[str, Any]) -> None:
        self.role, self.stats = role, stats

    def collect(self) -> Any:
        s, kv, role = self.stats, self.stats["kv"], [self.role]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"disagg_engine_{name}", doc, labels=["role"])
            g.add_metric(role, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"disagg_engine_{name}", doc, labels=["role"])
            c.add_metric(role, value)
            return c

        yield gauge("running_sequences", "Sequences in the running batch", s["running"])
        yield gauge("waiting_sequences", "Sequences waiting for admission", s["waiting"])
        yield gauge("pinned_transfers", "Context KV pinned for a generation leg", s["pinned"])
        yield gauge("waiting_handoffs", "generation_first legs waiting for KV", s["handoffs"])
        blocks = GaugeMetricFamily(
            "disagg_engine_kv_blocks", "KV blocks by state", labels=["role", "state"]
        )
        for state in ("free", "used", "cached"):
            blocks.add_metric([self.role, state], kv[state])
        yield blocks
        yield counter(
            "prompt_tokens", "Prompt tokens looked up in the prefix cache", kv["queried_tokens"]
        )
        yield counter(
            "prefix_hit_tokens", "Prompt tokens found in the prefix cache", kv["hit_tokens"]
        )
        yield counter("steps", "Model forward steps", s["steps"])
        transfers = CounterMetricFamily(
            "disagg_engine_kv_transfers", "KV moves by kind", labels=["role", "kind"]
        )
        for kind, n in s["transfers"].items():
            transfers.add_metric([self.role, kind], n)
        yield transfers
        yield counter("auth_refused", "Requests refused for their internal auth", s["auth_refused"])


_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)


class EngineMetrics:
    """What happens between scrapes. Thread-safe: the scheduler thread reports its steps."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        self.steps = Histogram(
            "disagg_engine_step_seconds",
            "Model forward steps, by kind (prefill, decode, or mixed)",
            ["role", "kind"],
            buckets=_STEP_BUCKETS,
            registry=self.registry,
        )
        self.transfer_s = Histogram(
            "disagg_engine_kv_transfer_seconds",
            "KV moved into this worker (fetched or pushed in): start to stored",
            ["role"],
            buckets=_TRANSFER_BUCKETS,
            registry=self.registry,
        )
        self.transfer_bytes = Counter(
            "disagg_engine_kv_transfer_bytes",
            "KV bytes moved, by direction (in: received, out: served or pushed)",
            ["role", "direction"],
            registry=self.registry,
        )

    def step(self, kind: str, seconds: float) -> None:
        self.steps.labels(self.role, kind).observe(seconds)

    def moved_in(self, nbytes: int, seconds: float) -> None:
        self.transfer_bytes.labels(self.role, "in").inc(nbytes)
        self.transfer_s.labels(self.role).observe(seconds)

    def moved_out(self, nbytes: int) -> None:
        self.transfer_bytes.labels(self.role, "out").inc(nbytes)

    def render(self, stats: dict[str, Any]) -> bytes:
        snapshot = CollectorRegistry()
        snapshot.register(_Snapshot(self.role, stats))
        return generate_latest(snapshot) + generate_latest(self.registry)
