"""A request that can never fit the worker's KV cache is a clear 400, not a 500; one that
fits but finds the cache full waits for blocks."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.conftest import Procs, assert_no_leaks, free_port, start_cluster, wait_healthy


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


def test_pinned_kv_delays_admission_until_lease_expiry(procs: Procs) -> None:
    port = free_port()
    procs.start(
        "worker",
        "--role",
        "context",
        "--port",
        str(port),
        "--num-blocks",
        "64",
        "--kv-lease",
        "3.0",
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, procs)
    for i in range(3):  # three context legs nobody fetches: ~57 of 64 blocks pinned
        r = httpx.post(
            url + "/v1/completions",
            timeout=60,
            json={
                "model": "tiny",
                "prompt": f"{i}" * 300,
                "max_tokens": 4,
                "disaggregated_params": {"request_type": "context_only"},
            },
        )
        assert r.status_code == 200
        assert r.json()["choices"][0]["finish_reason"] == "not_finished"
    assert httpx.get(url + "/stats").json()["pinned"] == 3
    # Needs more blocks than are free now: it waits for the leases, it is not refused.
    r = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "y" * 300, "max_tokens": 4},
    )
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 5
    while (stats := httpx.get(url + "/stats").json())["pinned"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stats["pinned"] == 0 and stats["kv"]["used"] == 0


def test_odd_but_valid_sampling_and_bad_content(procs: Procs) -> None:
    port = free_port()
    procs.start("worker", "--role", "mixed", "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, procs)
    r = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "x", "max_tokens": 3, "seed": -7},
    )
    assert r.status_code == 200
    r = httpx.post(
        url + "/v1/responses",
        timeout=60,
        json={"model": "tiny", "input": [{"role": "user", "content": 5}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={
            "model": "tiny",
            "prompt": [1, 2],
            "max_tokens": 3,
            "disaggregated_params": {"request_type": "generation_only", "first_gen_tokens": []},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "disaggregated_params"


def test_generation_legs_wait_for_blocks(procs: Procs, tmp_path: Path) -> None:
    """A generation worker whose KV cache is full makes the next leg wait for blocks to be
    freed (it holds none meanwhile) instead of failing it."""
    c = start_cluster(procs, tmp_path, 1, 1, gen_args=("--num-blocks", "16"))
    body = {"model": "tiny", "prompt": "w" * 150, "max_tokens": 24, "ignore_eos": True}

    def one(i: int) -> httpx.Response:
        return httpx.post(
            c.url + "/v1/completions",
            json={**body, "seed": i, "prompt": f"{i}" + "w" * 150},
            timeout=60,
        )

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(one, range(3)))  # each needs 10+ of the 16 blocks
    assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in answers)
    assert_no_leaks(c)
