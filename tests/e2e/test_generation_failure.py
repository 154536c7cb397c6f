"""The generation-pool failure policy: `retry` (default) plans a new pair, `fail` ends the
request with a clear 503 after one attempt; a header may choose per request."""

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
    failing_pool,
    start_cluster,
)

HEADER = "x-disagg-on-generation-failure"


@pytest.fixture(scope="module")
def failing_gen(
    procs: Procs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Cluster, BrokenWorker]]:
    with failing_pool(procs, tmp_path_factory.mktemp("gf"), "generation") as cluster_and_worker:
        yield cluster_and_worker


def _post(c: Cluster, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        c.url + "/v1/completions",
        timeout=60,
        headers=headers,
        json={"model": "tiny", "prompt": "gen policy", "max_tokens": 4},
    )


def test_retry_is_the_default(failing_gen: tuple[Cluster, BrokenWorker]) -> None:
    c, worker = failing_gen
    before = worker.hits
    r = _post(c)
    assert r.status_code == 502 and r.json()["error"]["message"] == "engine exploded"
    assert worker.hits - before == 2  # a new pair was planned once (max_retries 1)
    assert_no_leaks(c, timeout_s=2.0)


def test_fail_is_a_clear_503_after_one_attempt(failing_gen: tuple[Cluster, BrokenWorker]) -> None:
    c, worker = failing_gen
    before = worker.hits
    r = _post(c, {HEADER: "fail"})
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["type"] == "service_unavailable"
    assert "generation leg failed" in error["message"] and "engine exploded" in error["message"]
    assert worker.hits - before == 1
    assert_no_leaks(c, timeout_s=2.0)  # the context worker's KV was released at once


def test_bad_header_value(failing_gen: tuple[Cluster, BrokenWorker]) -> None:
    c, worker = failing_gen
    before = worker.hits
    r = _post(c, {HEADER: "local"})
    assert r.status_code == 400 and r.json()["error"]["param"] == HEADER
    assert worker.hits == before


def test_config_sets_the_default(procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> None:
    with BrokenWorker("500") as url:
        c = start_cluster(
            procs,
            tmp_path_factory.mktemp("gf2"),
            1,
            0,
            extra_gen=[url],
            on_generation_failure="fail",
            **NO_BREAKER,
        )
        assert _post(c).status_code == 503
        assert _post(c, {HEADER: "retry"}).status_code == 502
