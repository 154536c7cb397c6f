"""Bad input gets an OpenAI-style error with the right 4xx status and leaks nothing."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import (
    NO_BREAKER,
    BrokenWorker,
    Cluster,
    Procs,
    assert_no_leaks,
    start_cluster,
)

BAD = [
    # (path, raw body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"prompt": "x"}', 400, "model"),
    ("/v1/completions", b'{"model": "tiny"}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": 5}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": []}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": "9"}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": 1e30}', 400, "max_tokens"),
    (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "x", "max_tokens": 99999999999}',
        400,
        "max_tokens",
    ),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": -1}', 400, "temperature"),
    ("/v1/completions", b'{"model": "nope", "prompt": "x"}', 404, "model"),
    # past 64 bits: the legs are msgpack-encoded
    (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "x", "seed": 1180591620717411303424}',
        400,
        None,
    ),
    (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "x", "junk": [-1180591620717411303424]}',
        400,
        None,
    ),
    ("/v1/chat/completions", b'{"model": "tiny"}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"content": "x"}]}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": "hi"}', 400, "messages"),
    ("/v1/responses", b'{"model": "tiny"}', 400, "input"),
    (
        "/v1/responses",
        b'{"model": "tiny", "input": "x", "max_output_tokens": -5}',
        400,
        "max_output_tokens",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_request(
    cluster: Cluster, path: str, body: bytes, status: int, param: str | None
) -> None:
    r = httpx.post(cluster.url + path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param
    assert_no_leaks(cluster)


def test_body_too_large(cluster: Cluster) -> None:
    big = b'{"model": "tiny", "prompt": "' + b"x" * (11 * 1024 * 1024) + b'"}'
    r = httpx.post(
        cluster.url + "/v1/completions",
        content=big,
        timeout=60,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_route_and_method(cluster: Cluster) -> None:
    r = httpx.get(cluster.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(cluster.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


@pytest.mark.parametrize("stream", [False, True])
def test_worker_4xx_reaches_client(cluster: Cluster, stream: bool) -> None:
    # n=2 and over-long prompts are refused by the worker itself; status and message kept.
    r = httpx.post(
        cluster.url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "x", "n": 2, "stream": stream},
    )
    assert r.status_code == 400
    assert "n=1" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "n"
    r = httpx.post(
        cluster.url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "x" * 5000, "max_tokens": 4, "stream": stream},
    )
    assert r.status_code == 400
    assert "limit" in r.json()["error"]["message"]
    assert_no_leaks(cluster)


def test_client_disaggregated_params_are_stripped(cluster: Cluster) -> None:
    r = httpx.post(
        cluster.url + "/v1/completions",
        timeout=60,
        json={
            "model": "tiny",
            "prompt": "x",
            "max_tokens": 3,
            "disaggregated_params": {
                "request_type": "generation_only",
                "ctx_request_id": 1,
                "encoded_opaque_state": "AAAA",
                "first_gen_tokens": [65],
            },
        },
    )
    assert r.status_code == 200
    assert "disaggregated_params" not in r.json()["choices"][0]
    assert_no_leaks(cluster)


# -- a worker that fails with 5xx -------------------------------------------------------------


@pytest.fixture(scope="module")
def broken_ctx_cluster(procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with BrokenWorker() as url:
        yield start_cluster(
            procs, tmp_path_factory.mktemp("broken"), 0, 1, extra_ctx=[url], **NO_BREAKER
        )


def test_worker_5xx_becomes_502(broken_ctx_cluster: Cluster) -> None:
    for stream in (False, True):
        r = httpx.post(
            broken_ctx_cluster.url + "/v1/chat/completions",
            timeout=60,
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "stream": stream,
            },
        )
        assert r.status_code == 502
        assert r.json()["error"]["message"] == "engine exploded"
    info = httpx.get(broken_ctx_cluster.url + "/cluster_info").json()
    assert all(w["in_flight"] == 0 for w in info["context_servers"] + info["generation_servers"])
