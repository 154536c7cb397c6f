"""What happens when the context pool fails: the configured policy, or the request header
`x-disagg-on-prefill-failure: fail|local|retry` where the config allows it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import (
    NO_BREAKER,
    BrokenWorker,
    Cluster,
    Procs,
    assert_no_leaks,
    failing_pool,
    route_of,
    start_cluster,
)

HEADER = "x-disagg-on-prefill-failure"


@pytest.fixture(scope="module")
def failing_ctx(
    procs: Procs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Cluster, BrokenWorker]]:
    with failing_pool(procs, tmp_path_factory.mktemp("pf"), "context") as cluster_and_worker:
        yield cluster_and_worker


def _post(c: Cluster, policy: str | None, **extra: object) -> httpx.Response:
    headers = {HEADER: policy} if policy else {}
    return httpx.post(
        c.url + "/v1/completions",
        timeout=60,
        headers=headers,
        json={"model": "tiny", "prompt": "fallback", "max_tokens": 6, "temperature": 0, **extra},
    )


def test_local_prefills_on_the_generation_worker(
    failing_ctx: tuple[Cluster, BrokenWorker],
) -> None:
    c, _ = failing_ctx
    r = _post(c, "local")
    assert r.status_code == 200
    route = route_of(r)
    assert route["context"] == "-" and route["generation"] == c.generation_urls[0]
    assert r.json()["usage"]["completion_tokens"] == 6
    stream = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
    chunks = list(
        stream.completions.create(
            model="tiny",
            prompt="fallback",
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_headers={HEADER: "local"},
        )
    )
    assert (
        "".join(ch.choices[0].text for ch in chunks if ch.choices)
        == (r.json()["choices"][0]["text"])
    )
    assert_no_leaks(c)


def test_fail_is_a_clear_503_without_retries(failing_ctx: tuple[Cluster, BrokenWorker]) -> None:
    c, worker = failing_ctx
    before = worker.hits
    r = _post(c, "fail")
    assert r.status_code == 503
    assert "context leg failed" in r.json()["error"]["message"]
    assert worker.hits == before + 1


def test_retry_is_the_default(failing_ctx: tuple[Cluster, BrokenWorker]) -> None:
    c, worker = failing_ctx
    before = worker.hits
    r = _post(c, None)
    assert r.status_code == 502
    assert worker.hits == before + 2  # the attempt and max_retries=1 retry
    assert _post(c, "retry").status_code == 502


def test_bad_header_value(failing_ctx: tuple[Cluster, BrokenWorker]) -> None:
    c, _ = failing_ctx
    r = _post(c, "sometimes")
    assert r.status_code == 400 and r.json()["error"]["param"] == HEADER


def test_config_policy_and_header_switch(procs: Procs, tmp_path: Path) -> None:
    with BrokenWorker("500") as url:
        c = start_cluster(
            procs,
            tmp_path,
            0,
            1,
            extra_ctx=[url],
            **NO_BREAKER,
            on_prefill_failure="local",
            failure_policy_header=False,
        )
        assert _post(c, None).status_code == 200  # the config's "local"
        assert _post(c, "fail").status_code == 200  # the header is not honoured here
