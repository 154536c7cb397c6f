"""A request that can never fit the worker's KV cache is a clear 400, not a 500."""

from __future__ import annotations

import httpx

from tests.conftest import Procs, free_port, wait_healthy


def test_request_larger_than_kv_cache(procs: Procs) -> None:
    port = free_port()
    procs.start("worker", "--role", "mixed", "--port", str(port), "--num-blocks", "8")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, procs)
    r = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "x" * 100, "max_tokens": 100},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    assert "KV blocks" in r.json()["error"]["message"]
    ok = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "x" * 100, "max_tokens": 20},
    )
    assert ok.status_code == 200
    stats = httpx.get(url + "/stats").json()
    assert stats["kv"]["used"] == 0 and stats["pinned"] == 0
