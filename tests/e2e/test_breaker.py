"""Circuit breakers over real requests: a failing worker stops getting legs after N faults,
gets one probe per cooldown, and a context worker's fault is never blamed on the
generation worker that reported it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from disagg.demo import free_port
from tests.conftest import (
    BrokenWorker,
    Cluster,
    Procs,
    assert_no_leaks,
    route_of,
    start_cluster,
    wait_healthy,
)

FAST = {"retry_interval": 0.01, "max_retries": 1}


def _send(c: Cluster, n: int) -> list[httpx.Response]:
    return [
        httpx.post(
            c.url + "/v1/completions",
            timeout=60,
            json={"model": "tiny", "prompt": f"breaker {i}", "max_tokens": 4},
        )
        for i in range(n)
    ]


def _breakers(c: Cluster) -> dict[str, Any]:
    info = httpx.get(c.url + "/cluster_info").json()
    return {w["url"]: w["breaker"] for w in info["context_servers"] + info["generation_servers"]}


@pytest.mark.parametrize("broken", ["500"], indirect=True)
def test_breaker_opens_and_probes_once_per_cooldown(
    procs: Procs, tmp_path: Path, broken: BrokenWorker
) -> None:
    c = start_cluster(
        procs,
        tmp_path,
        1,
        1,
        extra_ctx=[broken.url],
        breaker_failures=2,
        breaker_cooldown=2.0,
        **FAST,
    )
    t0 = time.monotonic()
    out = _send(c, 8)
    assert [r.status_code for r in out] == [200] * 8
    assert time.monotonic() - t0 < 2.0, "too slow to test within one cooldown"
    assert broken.hits == 2  # then the breaker opened: no more legs for it
    assert _breakers(c)[broken.url] == "open"
    time.sleep(2.1)
    out = _send(c, 6)
    assert [r.status_code for r in out] == [200] * 6
    assert broken.hits == 3  # exactly one probe, which failed: open again
    assert _breakers(c)[broken.url] == "open"
    assert _breakers(c)[c.context_urls[0]] == "closed"
    assert_no_leaks(c)


def test_lost_kv_is_blamed_on_the_context_worker(procs: Procs, tmp_path: Path) -> None:
    # A context worker whose pinned KV expires at once: every generation worker's pull from
    # it fails, which the generation worker reports as kv_transfer_failed.
    port = free_port()
    procs.start("worker", "--role", "context", "--port", str(port), "--kv-lease", "0.000001")
    lossy = f"http://127.0.0.1:{port}"
    wait_healthy(lossy, procs)
    c = start_cluster(
        procs,
        tmp_path,
        1,
        1,
        extra_ctx=[lossy],
        breaker_failures=2,
        breaker_cooldown=60.0,
        **FAST,
    )
    out = _send(c, 8)
    assert [r.status_code for r in out] == [200] * 8, out[0].text
    assert all(route_of(r)["context"] == c.context_urls[0] for r in out)
    assert sum(route_of(r)["retries"] == "1" for r in out) == 2  # then the breaker opened
    breakers = _breakers(c)
    assert breakers[lossy] == "open"
    assert breakers[c.generation_urls[0]] == "closed"  # it only reported the fault
    c.context_urls.append(lossy)
    assert_no_leaks(c)
