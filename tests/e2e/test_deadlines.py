"""Deadlines: a hung worker never hangs the client; the leg is aborted and nothing leaks."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import BrokenWorker, Procs, assert_no_leaks, error_of, start_cluster

NO_RETRY = {"disable_retries": True}


def _timed_post(url: str, **body: object) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    r = httpx.post(
        url + "/v1/completions",
        timeout=30,
        json={"model": "tiny", "prompt": "x", "max_tokens": 8, **body},
    )
    return r, time.monotonic() - start


@pytest.mark.parametrize("broken", ["hang"], indirect=True)
def test_context_leg_deadline(procs: Procs, tmp_path: Path, broken: BrokenWorker) -> None:
    c = start_cluster(
        procs, tmp_path, 0, 1, extra_ctx=[broken.url], context_timeout=0.5, **NO_RETRY
    )
    r, took = _timed_post(c.url)
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
    assert 0.4 < took < 3.0


@pytest.mark.parametrize("broken", ["hang"], indirect=True)
@pytest.mark.parametrize("stream", [False, True])
def test_first_token_deadline_releases_context_kv(
    procs: Procs, tmp_path: Path, broken: BrokenWorker, stream: bool
) -> None:
    c = start_cluster(
        procs,
        tmp_path,
        1,
        0,
        extra_gen=[broken.url],
        first_token_timeout=0.5,
        request_timeout=1.0,
        **NO_RETRY,
    )
    r, took = _timed_post(c.url, stream=stream)
    # a stream has its first token already (from the context leg): the timeout ends it
    assert r.status_code == (200 if stream else 504)
    assert error_of(r)["type"] == "timeout" and error_of(r)["code"] == 504
    assert took < 3.0
    assert_no_leaks(c, timeout_s=2.0)


@pytest.mark.parametrize("broken", ["partial_hang"], indirect=True)
def test_stream_idle_deadline(procs: Procs, tmp_path: Path, broken: BrokenWorker) -> None:
    c = start_cluster(
        procs, tmp_path, 1, 0, extra_gen=[broken.url], stream_idle_timeout=0.5, **NO_RETRY
    )
    start = time.monotonic()
    with httpx.stream(
        "POST",
        c.url + "/v1/completions",
        timeout=30,
        json={"model": "tiny", "prompt": "x", "max_tokens": 8, "stream": True},
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert time.monotonic() - start < 3.0
    err = json.loads(lines[-2][6:])["error"]
    assert err["type"] == "timeout" and "idle" in err["message"]
    assert lines[-1] == "data: [DONE]"
    assert_no_leaks(c, timeout_s=2.0)


def test_whole_request_deadline(procs: Procs, tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, 1, 1, request_timeout=0.3)
    r, took = _timed_post(c.url, max_tokens=3000, prompt="y" * 1000, ignore_eos=True)
    assert r.status_code == 504, r.text
    assert took < 2.0
    assert_no_leaks(c)  # the generation leg was aborted on its worker
