"""Request limits: each bound from config gives a 400 naming the parameter before any leg
runs; a client that stalls mid-body gets a 408; an error that a worker's address appears in
reaches the client without the address."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import NO_BREAKER, BrokenWorker, Cluster, Procs, assert_no_leaks, start_cluster

LIMITS = {
    "max_prompt_tokens": 64,
    "max_messages": 3,
    "max_stop_sequences": 2,
    "max_stop_length": 8,
    "max_tokens_limit": 32,
    "body_read_timeout": 0.5,
}


@pytest.fixture(scope="module")
def limited(procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    return start_cluster(procs, tmp_path_factory.mktemp("limits"), 1, 1, **LIMITS)


def _msgs(n: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": "hi"}] * n


BAD = [
    ("/v1/completions", {"prompt": "x" * 100}, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": list(range(65))}, "prompt", "context_length_exceeded"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "y" * 90}]},
        "messages",
        "context_length_exceeded",
    ),
    ("/v1/chat/completions", {"messages": _msgs(4)}, "messages", None),
    ("/v1/responses", {"input": _msgs(4)}, "input", None),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c"]}, "stop", None),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 9}, "stop", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 33}, "max_tokens", None),
    (
        "/v1/chat/completions",
        {"messages": _msgs(1), "max_completion_tokens": 33},
        "max_completion_tokens",
        None,
    ),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n", None),
]


@pytest.mark.parametrize(("path", "body", "param", "code"), BAD)
def test_each_limit_names_its_parameter(
    limited: Cluster, path: str, body: dict[str, object], param: str, code: str | None
) -> None:
    r = httpx.post(limited.url + path, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    if code:
        assert err["code"] == code


def test_within_the_limits_it_serves(limited: Cluster) -> None:
    ok = {"model": "tiny", "prompt": "x" * 40, "stop": ["zz", "yy"], "max_tokens": 32}
    assert httpx.post(limited.url + "/v1/completions", json=ok, timeout=60).status_code == 200
    chat = {"model": "tiny", "messages": _msgs(3), "max_tokens": 4}
    assert httpx.post(limited.url + "/v1/chat/completions", json=chat).status_code == 200
    assert_no_leaks(limited)


def test_a_stalled_body_gets_408(limited: Cluster) -> None:
    host, port = limited.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": "tiny",'
        )
        started = time.monotonic()
        answer = sock.recv(65536).decode()
        assert time.monotonic() - started < 5
    assert answer.startswith("HTTP/1.1 408")
    assert '"invalid_request_error"' in answer and "did not arrive" in answer
    assert_no_leaks(limited)


def test_worker_addresses_stay_out_of_errors(procs: Procs, tmp_path: Path) -> None:
    """A generation worker that drops every connection: the client learns that it failed,
    not where (the orchestrator's log keeps the address, with the request id)."""
    broken = BrokenWorker("reset")
    with broken as url:
        c = start_cluster(
            procs, tmp_path, 1, 0, extra_gen=[url], disable_retries=True, **NO_BREAKER
        )
        r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert r.status_code >= 500, r.text
        assert broken.hits >= 1
        message = r.json()["error"]["message"]
        assert message and broken.url not in r.text and "127.0.0.1" not in r.text
        assert r.headers["x-request-id"]
