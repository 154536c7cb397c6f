"""Admission over HTTP: beyond max_concurrent_requests a request queues; past the queue's
length or timeout it gets 429 with Retry-After and an OpenAI error body; queue wait and
rejections show on /metrics."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import BrokenWorker, Procs, assert_no_leaks, route_of, start_cluster

BODY = {"model": "tiny", "prompt": "overload", "max_tokens": 4}


@pytest.mark.parametrize("broken", ["partial_hang"], indirect=True)
def test_queue_full_and_queue_timeout_are_429(
    procs: Procs, tmp_path: Path, broken: BrokenWorker
) -> None:
    c = start_cluster(
        procs,
        tmp_path,
        1,
        1,
        extra_gen=[broken.url],  # first in its pool: the first request's stream hangs there
        max_concurrent_requests=1,
        max_queued_requests=1,
        queue_timeout=1.0,
    )
    with httpx.stream(
        "POST", c.url + "/v1/completions", json={**BODY, "stream": True}, timeout=30
    ) as held:
        lines = held.iter_lines()  # kept: a dropped iterator closes the stream
        assert next(lines).startswith("data: ")  # it holds the only slot
        queued: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: queued.append(httpx.post(c.url + "/v1/completions", json=BODY))
        )
        waiter.start()
        _wait_for_queue(c.url, 1)
        client = openai.OpenAI(base_url=c.url + "/v1", max_retries=0)
        with pytest.raises(openai.RateLimitError) as exc:
            client.completions.create(**BODY)  # the queue is full
        assert exc.value.status_code == 429
        assert exc.value.response.headers["Retry-After"] == "1"
        assert exc.value.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
        waiter.join(10)
        assert queued[0].status_code == 429
        assert "queue timeout" in queued[0].json()["error"]["message"]
    # The held stream is gone: its slot is free again.
    r = httpx.post(c.url + "/v1/completions", json=BODY, timeout=30)
    assert r.status_code == 200 and route_of(r)["generation"] == c.generation_urls[0]
    metrics = httpx.get(c.url + "/metrics").text
    assert 'disagg_rejected_requests_total{reason="queue_full"} 1.0' in metrics
    assert 'disagg_rejected_requests_total{reason="queue_timeout"} 1.0' in metrics
    assert "disagg_queue_wait_seconds_count 2.0" in metrics  # the held one and the last one
    info = httpx.get(c.url + "/cluster_info").json()
    assert info["admission"] == {"active": 0, "queued": 0}
    assert_no_leaks(c)


def _wait_for_queue(url: str, n: int) -> None:
    for _ in range(100):
        if httpx.get(url + "/cluster_info").json()["admission"]["queued"] == n:
            return
        threading.Event().wait(0.02)
    raise AssertionError(f"the queue never reached {n}")


def test_openai_client_backs_off_and_succeeds(procs: Procs, tmp_path: Path) -> None:
    # The official client honours Retry-After on 429; with room in the queue nobody waits.
    c = start_cluster(procs, tmp_path, 1, 1, max_concurrent_requests=4, max_queued_requests=64)
    client = openai.OpenAI(base_url=c.url + "/v1")
    results: list[str] = []

    def one(i: int) -> None:
        out = client.completions.create(**{**BODY, "prompt": f"p{i}"})
        results.append(out.choices[0].text)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 16
    metrics = httpx.get(c.url + "/metrics").text
    assert "disagg_queue_wait_seconds_count 16.0" in metrics
    assert httpx.get(c.url + "/cluster_info").json()["admission"] == {"active": 0, "queued": 0}
    assert_no_leaks(c)
