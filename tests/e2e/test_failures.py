"""Failures and disconnects leak nothing: in-flight counts return to 0 and the context
worker's pinned KV is freed."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import (
    NO_BREAKER,
    BrokenWorker,
    Cluster,
    Procs,
    assert_no_leaks,
    error_of,
    route_of,
    start_cluster,
)


@pytest.fixture(scope="module")
def broken_gen_cluster(procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with BrokenWorker() as url:
        c = start_cluster(
            procs, tmp_path_factory.mktemp("brokengen"), 1, 0, extra_gen=[url], **NO_BREAKER
        )
        c.generation_urls = []  # the broken worker has no /stats to check
        yield c


@pytest.mark.parametrize("stream", [False, True])
def test_generation_failure_releases_context_kv(broken_gen_cluster: Cluster, stream: bool) -> None:
    r = httpx.post(
        broken_gen_cluster.url + "/v1/completions",
        timeout=60,
        json={
            "model": "tiny",
            "prompt": "the context leg pins this prompt's KV",
            "max_tokens": 8,
            "stream": stream,
        },
    )
    # a stream has its first token already (from the context leg): the error event ends it
    assert r.status_code == (200 if stream else 502)
    assert error_of(r)["message"] == "engine exploded" and error_of(r)["code"] == 502
    # Released right away, well before the 30 s lease would have expired.
    assert_no_leaks(broken_gen_cluster, timeout_s=2.0)


def test_client_disconnect_mid_stream(cluster: Cluster) -> None:
    body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for _ in zip(range(3), r.iter_lines(), strict=False):
            pass
    start = time.monotonic()
    assert_no_leaks(cluster, timeout_s=5.0)
    assert time.monotonic() - start < 5.0


def test_client_disconnect_during_context_leg(cluster: Cluster) -> None:
    prompt = "x" * 3000  # long enough that the context leg is still running at the timeout
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            cluster.url + "/v1/completions",
            timeout=0.05,
            json={"model": "tiny", "prompt": prompt, "max_tokens": 500},
        )
    assert_no_leaks(cluster, timeout_s=10.0)


def test_killed_worker_leaves_and_restarted_worker_rejoins(
    procs: Procs, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import signal

    from tests.conftest import wait_healthy

    c = start_cluster(
        procs,
        tmp_path_factory.mktemp("kill"),
        2,
        1,
        health_check_interval=0.2,
        health_fail_threshold=2,
    )
    victim = procs.procs[-3]  # the second context worker (then generation, orchestrator)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    procs.procs.remove(victim)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        info = httpx.get(c.url + "/cluster_info").json()
        if [w["ready"] for w in info["context_servers"]] == [True, False]:
            break
        time.sleep(0.1)
    assert [w["ready"] for w in info["context_servers"]] == [True, False]
    for i in range(4):  # nothing is routed to the dead worker
        r = httpx.post(
            c.url + "/v1/completions",
            timeout=60,
            json={"model": "tiny", "prompt": f"k{i}", "max_tokens": 3},
        )
        assert r.status_code == 200
        assert route_of(r)["context"] == c.context_urls[0]
    port = c.context_urls[1].rsplit(":", 1)[1]
    procs.start("worker", "--role", "context", "--port", port)
    wait_healthy(c.context_urls[1], procs)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(
        w["ready"] for w in httpx.get(c.url + "/cluster_info").json()["context_servers"]
    ):
        time.sleep(0.1)
    seen = {
        route_of(
            httpx.post(
                c.url + "/v1/completions",
                timeout=60,
                json={"model": "tiny", "prompt": f"r{i}", "max_tokens": 3},
            )
        )["context"]
        for i in range(4)
    }
    assert seen == set(c.context_urls)
    assert_no_leaks(c)
