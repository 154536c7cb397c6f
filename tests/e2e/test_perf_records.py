"""GET /perf_metrics: the last perf_metrics_max_requests requests (a bounded buffer), each with
its id, workers, and its steps in order on the orchestrator's clock; off (empty) by default."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.conftest import Cluster, Procs, start_cluster

ORDER = [
    "context_sent_ms",
    "context_done_ms",
    "generation_sent_ms",
    "generation_accepted_ms",
    "first_token_ms",
    "last_token_ms",
]
# a stream's first token goes ahead of its generation leg
ORDER_AHEAD = [*ORDER[:2], "first_token_ms", *ORDER[2:4], "last_token_ms"]


def test_records_are_bounded_and_ordered(procs: Procs, tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, 1, 1, perf_metrics_max_requests=3)
    ids = []
    for i in range(5):
        body = {"model": "tiny", "prompt": f"time me {i}", "max_tokens": 5, "stream": i >= 3}
        r = httpx.post(c.url + "/v1/completions", json=body, headers={"x-request-id": f"r{i}"})
        assert r.status_code == 200
        ids.append(r.headers["x-request-id"])
    data = httpx.get(c.url + "/perf_metrics").json()
    assert data["enabled"] is True
    records = data["records"]
    assert [r["request_id"] for r in records] == ids[-3:]  # the buffer keeps the last 3
    for rec in records:
        assert rec["context"] == c.context_urls[0] and rec["generation"] == c.generation_urls[0]
        assert rec["status"] == 200 and rec["arrival_unix"] > 0
        order = ORDER_AHEAD if rec["request_id"] in ("r3", "r4") else ORDER  # streamed
        steps = [rec[k] for k in order if k in rec]
        assert steps == sorted(steps) and steps[0] >= 0
    streamed = records[-1]
    assert all(k in streamed for k in ORDER)
    # its first token went ahead: out as soon as the context leg answered
    assert (
        streamed["context_done_ms"] <= streamed["first_token_ms"] <= streamed["generation_sent_ms"]
    )


def test_off_by_default(cluster: Cluster) -> None:
    httpx.post(cluster.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert httpx.get(cluster.url + "/perf_metrics").json() == {"enabled": False, "records": []}
