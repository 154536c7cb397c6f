"""Graceful drain on SIGTERM: the orchestrator stops listening and finishes its streams (up
to drain_timeout, then ends them with an error event); a draining worker gets no new legs
and finishes the ones it has."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Cluster, Procs, route_of, start_cluster

LONG = {
    "model": "tiny",
    "prompt": "drain",
    "max_tokens": 1200,  # a few seconds of decoding on the reference worker
    "temperature": 0,
    "stream": True,
    "stream_options": {"include_usage": True},
}


@pytest.fixture
def own() -> Iterator[Procs]:
    """Processes of this test alone, so that it may signal them."""
    with Procs() as p:
        yield p


def _process(procs: Procs, url: str) -> subprocess.Popen[bytes]:
    port = url.rsplit(":", 1)[1]
    return next(p for p in procs.procs if port in " ".join(map(str, p.args)))


def _events(lines: Iterator[str]) -> list[dict[str, object]]:
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
        elif line == "data: [DONE]":
            out.append({"done": True})
    return out


def _no_worker_leaks(c: Cluster) -> None:
    deadline = time.monotonic() + 5
    while True:
        stats = [httpx.get(u + "/stats").json() for u in c.worker_urls]
        if all(s["pinned"] == s["running"] == s["kv"]["used"] == 0 for s in stats):
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_orchestrator_finishes_streams_then_exits(own: Procs, tmp_path: Path) -> None:
    c = start_cluster(own, tmp_path, 1, 1, drain_timeout=30)
    orchestrator = _process(own, c.url)
    with httpx.stream("POST", c.url + "/v1/completions", json=LONG, timeout=60) as r:
        lines = r.iter_lines()
        first = next(lines)
        assert first.startswith("data: ")
        orchestrator.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # it stopped listening at once
            httpx.get(c.url + "/health", timeout=2)
        assert orchestrator.poll() is None  # ...but still serves the open stream
        events = _events(lines)
    assert events[-1] == {"done": True}
    assert not any("error" in e for e in events)
    assert events[-2]["usage"]["completion_tokens"] == 1200  # type: ignore[index]
    assert orchestrator.wait(10) == 0
    _no_worker_leaks(c)


def test_drain_deadline_ends_streams_with_an_error_event(own: Procs, tmp_path: Path) -> None:
    c = start_cluster(own, tmp_path, 1, 1, drain_timeout=0.5)
    orchestrator = _process(own, c.url)
    t0 = time.monotonic()
    with httpx.stream("POST", c.url + "/v1/completions", json=LONG, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        orchestrator.send_signal(signal.SIGTERM)
        events = _events(lines)
    assert time.monotonic() - t0 < 3.0
    assert "shut down" in events[-2]["error"]["message"]  # type: ignore[index]
    assert events[-1] == {"done": True}
    assert orchestrator.wait(10) == 0
    _no_worker_leaks(c)  # the cut generation leg was aborted on its worker


def test_draining_worker_gets_no_new_legs(own: Procs, tmp_path: Path) -> None:
    c = start_cluster(own, tmp_path, 1, 2, health_check_interval=0.2)
    with httpx.stream("POST", c.url + "/v1/completions", json=LONG, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        busy = route_of(r)["generation"]
        other = next(u for u in c.generation_urls if u != busy)
        worker = _process(own, busy)
        worker.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not _draining(c, busy):
            assert time.monotonic() < deadline, "the orchestrator never saw the drain"
            time.sleep(0.05)
        for i in range(4):
            resp = httpx.post(
                c.url + "/v1/completions",
                json={"model": "tiny", "prompt": f"n{i}", "max_tokens": 4},
                timeout=30,
            )
            assert resp.status_code == 200 and route_of(resp)["generation"] == other
        assert worker.poll() is None  # still finishing its leg
        events = _events(lines)
    assert events[-1] == {"done": True} and not any("error" in e for e in events)
    assert events[-2]["usage"]["completion_tokens"] == 1200  # type: ignore[index]
    assert worker.wait(10) == 0  # and gone once it had nothing left
    c.generation_urls.remove(busy)
    _no_worker_leaks(c)


def _draining(c: Cluster, url: str) -> bool:
    info = httpx.get(c.url + "/cluster_info").json()
    return any(w["url"] == url and w["draining"] for w in info["generation_servers"])
