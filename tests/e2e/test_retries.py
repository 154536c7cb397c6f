"""The retry rules: what is retried, how often, where, and what never is."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import BrokenWorker, Cluster, Procs, assert_no_leaks, route_of, start_cluster

FAST = {"retry_interval": 0.01}


def _send(c: Cluster, n: int, **extra: object) -> list[httpx.Response]:
    return [
        httpx.post(
            c.url + "/v1/completions",
            timeout=60,
            json={"model": "tiny", "prompt": f"retry {i}", "max_tokens": 4, **extra},
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("broken", ["500"], indirect=True)
def test_worker_error_retried_on_another_worker(
    procs: Procs, tmp_path: Path, broken: BrokenWorker
) -> None:
    c = start_cluster(procs, tmp_path, 1, 1, extra_ctx=[broken.url], max_retries=1, **FAST)
    out = _send(c, 6)
    assert [r.status_code for r in out] == [200] * 6, out[0].text
    assert broken.hits >= 2  # round robin did place legs on it; each was retried elsewhere
    retried = [r for r in out if route_of(r)["retries"] == "1"]
    assert len(retried) == broken.hits
    assert all(route_of(r)["context"] != broken.url for r in out)
    assert_no_leaks(c)


@pytest.mark.parametrize("broken", ["500"], indirect=True)
def test_no_retry_switch(
    procs: Procs, tmp_path: Path, broken: BrokenWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISAGG_NO_RETRY", "1")
    c = start_cluster(procs, tmp_path, 1, 1, extra_ctx=[broken.url], max_retries=3, **FAST)
    codes = [r.status_code for r in _send(c, 6)]
    assert codes.count(502) == broken.hits >= 2
    assert codes.count(200) == 6 - broken.hits


@pytest.mark.parametrize("broken", ["reset"], indirect=True)
def test_connection_resets_get_the_transient_budget(
    procs: Procs, tmp_path: Path, broken: BrokenWorker
) -> None:
    # max_retries 0: only the extended budget for TCP resets lets these succeed.
    c = start_cluster(
        procs,
        tmp_path,
        0,
        1,
        extra_ctx=[broken.url, broken.url.replace("127.0.0.1", "localhost")],
        max_retries=0,
        transient_retries=5,
        **FAST,
    )
    r = _send(c, 1)[0]
    assert r.status_code == 502
    assert broken.hits == 6  # the first attempt + 5 transient retries, then a clean 502
    assert "ServerDisconnectedError" in r.json()["error"]["message"]


@pytest.mark.parametrize("broken", ["400"], indirect=True)
def test_client_errors_fail_fast(procs: Procs, tmp_path: Path, broken: BrokenWorker) -> None:
    c = start_cluster(procs, tmp_path, 0, 1, extra_ctx=[broken.url], max_retries=3, **FAST)
    r = _send(c, 1)[0]
    assert r.status_code == 400 and r.json()["error"]["param"] == "x"
    assert broken.hits == 1


@pytest.mark.parametrize("broken", ["500"], indirect=True)
@pytest.mark.parametrize("stream", [False, True])
def test_generation_failure_replans_from_context(
    procs: Procs, tmp_path: Path, broken: BrokenWorker, stream: bool
) -> None:
    c = start_cluster(procs, tmp_path, 1, 1, extra_gen=[broken.url], max_retries=1, **FAST)
    out = _send(c, 4, stream=stream)
    assert [r.status_code for r in out] == [200] * 4
    assert broken.hits >= 1
    if stream:
        # The first token went ahead, with the route header naming the worker first placed;
        # the retried generation leg finished the answer.
        assert all('"error"' not in r.text and r.text.endswith("data: [DONE]\n\n") for r in out)
        assert sum(route_of(r)["generation"] == broken.url for r in out) == broken.hits
    else:
        assert all(route_of(r)["generation"] != broken.url for r in out)
    assert_no_leaks(c, timeout_s=2.0)  # the failed handoffs' KV was released, not leased


@pytest.mark.parametrize("broken", ["partial", "torn"], indirect=True)
def test_never_retried_once_bytes_reached_the_client(
    procs: Procs, tmp_path: Path, broken: BrokenWorker
) -> None:
    c = start_cluster(procs, tmp_path, 1, 0, extra_gen=[broken.url], max_retries=3, **FAST)
    c.generation_urls = []
    with httpx.stream(
        "POST",
        c.url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "x", "max_tokens": 8, "stream": True},
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.status_code == 200
    # The context leg's token, then the worker's: whole events only (a half event from the
    # worker never reaches the client).
    assert len(lines) == 4, lines
    assert json.loads(lines[1][6:])["choices"][0]["text"] == "A"
    assert "error" in json.loads(lines[2][6:])
    assert lines[3] == "data: [DONE]"
    assert broken.hits == 1
    assert_no_leaks(c, timeout_s=2.0)


@pytest.mark.parametrize("broken", ["500"], indirect=True)
def test_client_cancels_while_a_retry_sleeps(
    procs: Procs, tmp_path: Path, broken: BrokenWorker
) -> None:
    c = start_cluster(
        procs, tmp_path, 0, 1, extra_ctx=[broken.url], max_retries=1, retry_interval=3.0
    )
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            c.url + "/v1/completions",
            timeout=0.5,
            json={"model": "tiny", "prompt": "x", "max_tokens": 4},
        )
    assert broken.hits == 1  # the retry was still sleeping when the client left
    info = httpx.get(c.url + "/cluster_info").json()
    assert all(w["in_flight"] == 0 for w in info["context_servers"] + info["generation_servers"])
    assert_no_leaks(c)
