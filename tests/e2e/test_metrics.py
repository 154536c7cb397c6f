"""/metrics after known requests: the request counters by endpoint and status class, the
latency histograms (end to end, time to first token and between tokens for streams, the
context leg, the generation leg's wait, the orchestrator's own overhead), retries, the
cache prediction, and the per-worker figures (ready, breaker state, legs placed by policy)
move exactly as the requests say; so do a reference worker's (steps, KV moved)."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Procs, assert_no_leaks, start_cluster


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _sum(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def test_metrics_follow_known_requests(procs: Procs, tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, 1, 2, router={"type": "round_robin"})
    for i in range(3):
        body = {"model": "tiny", "prompt": f"count {i}", "max_tokens": 4}
        assert httpx.post(c.url + "/v1/completions", json=body).status_code == 200
    for i in range(2):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"stream {i}"}],
            "max_tokens": 6,
            "stream": True,
        }
        assert httpx.post(c.url + "/v1/chat/completions", json=body).status_code == 200
    bad = {"model": "tiny", "prompt": "x", "max_tokens": -1}
    assert httpx.post(c.url + "/v1/completions", json=bad).status_code == 400
    assert_no_leaks(c)
    m = _samples(c.url)
    assert _get(m, "disagg_requests_total", endpoint="completions", status="2xx") == 3
    assert _get(m, "disagg_requests_total", endpoint="completions", status="4xx") == 1
    assert _get(m, "disagg_requests_total", endpoint="chat", status="2xx") == 2
    assert _get(m, "disagg_request_duration_seconds_count", endpoint="completions") == 4
    assert _get(m, "disagg_time_to_first_token_seconds_count", endpoint="chat") == 2
    assert _get(m, "disagg_time_to_first_token_seconds_count", endpoint="completions") == 0
    assert _get(m, "disagg_inter_token_latency_seconds_count") >= 2
    assert _get(m, "disagg_context_leg_seconds_count") == 5
    assert _get(m, "disagg_generation_leg_wait_seconds_count") == 2  # the streamed legs
    assert _get(m, "disagg_orchestrator_overhead_seconds_count", endpoint="completions") == 3
    assert _get(m, "disagg_orchestrator_overhead_seconds_count", endpoint="chat") == 2
    # Its own time is a small part of a request's (loopback workers, a tiny model).
    overhead = _sum(m, "disagg_orchestrator_overhead_seconds_sum")
    assert 0 < overhead < _sum(m, "disagg_request_duration_seconds_sum") / 2
    assert _get(m, "disagg_retries_total") == 0
    assert _get(m, "disagg_in_flight_requests") == 0
    picks = "disagg_routing_decisions_total"
    assert _sum(m, picks, pool="context", policy="round_robin") == 5
    assert _sum(m, picks, pool="generation", policy="round_robin") == 5
    per_gen = [
        _get(m, picks, pool="generation", policy="round_robin", worker=u) for u in c.generation_urls
    ]
    assert sorted(per_gen) == [2, 3]  # round robin over two
    for url in c.worker_urls:
        pool = "context" if url in c.context_urls else "generation"
        assert _get(m, "disagg_worker_ready", pool=pool, worker=url) == 1
        assert _get(m, "disagg_worker_breaker_state", pool=pool, worker=url, state="closed") == 1
        assert _get(m, "disagg_worker_in_flight", pool=pool, worker=url) == 0


def test_worker_metrics(procs: Procs, tmp_path: Path) -> None:
    """A reference worker's /metrics: sequences, KV blocks by state, prefix-cache tokens and
    KV transfers by kind, after one disaggregated request."""
    c = start_cluster(procs, tmp_path, 1, 1)
    body = {"model": "tiny", "prompt": "metrics on the worker side " * 4, "max_tokens": 4}
    assert httpx.post(c.url + "/v1/completions", json=body).status_code == 200
    assert_no_leaks(c)
    ctx, gen = _samples(c.context_urls[0]), _samples(c.generation_urls[0])
    fetches = "disagg_engine_kv_transfers_total"
    assert _get(ctx, fetches, role="context", kind="fetch_served") == 1
    assert _get(gen, fetches, role="generation", kind="fetch_served") == 0
    assert _get(ctx, "disagg_engine_prompt_tokens_total", role="context") > 100
    assert _get(ctx, "disagg_engine_running_sequences", role="context") == 0
    assert _get(ctx, "disagg_engine_pinned_transfers", role="context") == 0
    for m, role in ((ctx, "context"), (gen, "generation")):
        assert _get(m, "disagg_engine_kv_blocks", role=role, state="used") == 0
        assert _get(m, "disagg_engine_kv_blocks", role=role, state="free") > 0
    # The context worker prefilled; of the 4 tokens the first came with the KV, and each of
    # the other 3 took the generation worker one decode step.
    assert _get(ctx, "disagg_engine_step_seconds_count", role="context", kind="prefill") >= 1
    assert _sum(ctx, "disagg_engine_step_seconds_count", kind="decode") == 0
    assert _get(gen, "disagg_engine_step_seconds_count", role="generation", kind="decode") == 3
    assert _sum(gen, "disagg_engine_step_seconds_count", kind="prefill") == 0
    moved = "disagg_engine_kv_transfer_bytes_total"
    sent = _get(ctx, moved, role="context", direction="out")
    assert sent > 0 and _get(gen, moved, role="generation", direction="in") == sent
    assert _get(gen, "disagg_engine_kv_transfer_seconds_count", role="generation") == 1
