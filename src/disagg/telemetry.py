"""Prometheus metrics of the orchestrator, on one registry per frontend, served at /metrics.

Modules report what happened (a queue wait, a finished request, a stream's chunk); the
per-worker figures are read from the cluster when scraped. Labels stay low-cardinality:
endpoint, status class, pool, worker URL. Nothing here decides how a request is served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from disagg.cluster import Cluster
    from disagg.orchestrator import Route

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 180)
_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
BREAKER_STATES = ("closed", "open", "half_open")


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
        self.cached_tokens = Counter(
            "disagg_cached_prompt_tokens",
            "Prompt tokens of context legs found cached: predicted by the prefix index, or"
            " actual as the worker reported",
            ["source"],  # predicted | actual
            registry=self.registry,
        )
        self.discovery_up = Gauge(
            "disagg_discovery_up",
            "1 while the service discovery backend answers (etcd); 0: serving on the last view",
            ["backend"],
            registry=self.registry,
        )
        self.discovery_resyncs = Counter(
            "disagg_discovery_resyncs",
            "Full reloads of the membership after the discovery backend was unreachable",
            ["backend"],
            registry=self.registry,
        )
        self.discovery_changes = Counter(
            "disagg_discovery_changes",
            "Workers added to or removed from the pools by service discovery",
            ["change"],  # added | removed
            registry=self.registry,
        )

        self._requests(self.registry)

    def _requests(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "disagg_requests",
            "Client requests answered, by endpoint and status class (2xx, 4xx, 5xx)",
            ["endpoint", "status"],
            registry=registry,
        )
        self.retries = Counter(
            "disagg_retries", "Leg attempts beyond the first, over all requests", registry=registry
        )
        self.in_flight = Gauge(
            "disagg_in_flight_requests", "Client requests being served now", registry=registry
        )
        self.duration = Histogram(
            "disagg_request_duration_seconds",
            "End to end: body read to last byte sent",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "disagg_time_to_first_token_seconds",
            "Streams: body read to the first chunk sent",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "disagg_inter_token_latency_seconds",
            "Streams: time between chunks sent to the client",
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self.context_leg = Histogram(
            "disagg_context_leg_seconds",
            "The context leg that answered: sent to answered",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.generation_wait = Histogram(
            "disagg_generation_leg_wait_seconds",
            "Streamed generation legs: sent until the worker holds the KV and starts"
            " answering (its queue and the KV transfer)",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.kv_transfer = Histogram(
            "disagg_kv_transfer_seconds",
            "KV transfer as the generation worker reported it (request_perf_metrics)",
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
        self.overhead = Histogram(
            "disagg_orchestrator_overhead_seconds",
            "Time of a request spent in disagg itself: its duration less the time a worker"
            " call, a retry pause or a client write was outstanding",
            ["endpoint"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=registry,
        )

    def watch(self, cluster: Cluster, policies: dict[str, str]) -> None:
        """Per-worker figures, read from `cluster` at each scrape; `policies`: pool ->
        router type, for the routing-decision counts."""
        self.registry.register(_WorkerCollector(cluster, policies))

    def observe_route(self, route: Route, endpoint: str, took: float, streamed: bool) -> None:
        """A request that got a route is done (`took`: its whole duration)."""
        self.retries.inc(route.retries)
        if route.context_s:
            self.context_leg.observe(route.context_s)
        times = route.times
        if streamed and "generation_accepted" in times:
            self.generation_wait.observe(times["generation_accepted"] - times["generation_sent"])
        gen = route.legs.get("generation")
        if gen is not None and gen.timing is not None:
            t = gen.timing
            if t.kv_transfer_start is not None and t.kv_transfer_end is not None:
                self.kv_transfer.observe(t.kv_transfer_end - t.kv_transfer_start)
        self.overhead.labels(endpoint).observe(max(0.0, took - route.waited_s))

    def observe_prediction(self, predicted: int, actual: int, block_size: int) -> None:
        self.cached_tokens.labels("predicted").inc(predicted)
        self.cached_tokens.labels("actual").inc(actual)
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


class _WorkerCollector(Collector):
    def __init__(self, cluster: Cluster, policies: dict[str, str]) -> None:
        self.cluster, self.policies = cluster, policies

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["pool", "worker"]
        in_flight = GaugeMetricFamily(
            "disagg_worker_in_flight", "Legs on the worker now", labels=labels
        )
        ready = GaugeMetricFamily("disagg_worker_ready", "1 when health checks pass", labels=labels)
        draining = GaugeMetricFamily("disagg_worker_draining", "1 while it drains", labels=labels)
        breaker = GaugeMetricFamily(
            "disagg_worker_breaker_state",
            "1 for the circuit breaker's current state",
            labels=[*labels, "state"],
        )
        picks = CounterMetricFamily(
            "disagg_routing_decisions",
            "Legs placed, by pool, policy and worker (retries included)",
            labels=["pool", "policy", "worker"],
        )
        for pool in (self.cluster.context, self.cluster.generation):
            policy = self.policies.get(pool.role, "")
            for w in pool.workers:
                key = [pool.role, w.url]
                in_flight.add_metric(key, w.in_flight)
                ready.add_metric(key, float(w.ready))
                draining.add_metric(key, float(w.draining))
                for state in BREAKER_STATES:
                    breaker.add_metric([*key, state], float(w.breaker.state == state))
                picks.add_metric([pool.role, policy, w.url], w.selections)
        yield from (in_flight, ready, draining, breaker, picks)
