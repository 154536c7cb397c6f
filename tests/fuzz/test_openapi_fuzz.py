"""Schemathesis against the orchestrator's own /openapi.json: for every operation, bodies
generated from the schema (valid ones and, in negative mode, ones that break it) get a 2xx
or 4xx, never a 5xx, and the server stays up. Bounded in examples; workers answer fast
because the cluster caps max_tokens."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.conftest import Cluster, Procs, assert_no_leaks, start_cluster

EXAMPLES = 100  # per operation and mode
SEEN: Counter[str] = Counter()  # status class -> answers, over the whole module
RESULTS = Path(__file__).parent / ".fuzz_counts.json"  # read for the notes, not committed


@pytest.fixture(scope="module")
def fuzz_cluster(procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(
        procs, tmp_path_factory.mktemp("fuzz"), 1, 1, max_tokens_limit=8, request_timeout=20
    )
    yield c
    assert httpx.get(c.url + "/health").status_code == 200  # still up
    assert_no_leaks(c)
    RESULTS.write_text(json.dumps(dict(SEEN)))


def _operations(url: str) -> list[schemathesis.APIOperation]:
    document = httpx.get(url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(document)
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_makes_a_server_error(fuzz_cluster: Cluster, mode: GenerationMode) -> None:
    """Cases drawn from each operation's schema strategy (schemathesis's generators, run by
    hypothesis here: its pytest plugin does not load on this pytest)."""
    with httpx.Client(base_url=fuzz_cluster.url, timeout=30) as client:
        for operation in _operations(fuzz_cluster.url):
            if mode is GenerationMode.NEGATIVE and operation.method.upper() != "POST":
                continue  # a GET without parameters has nothing to get wrong

            @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case: schemathesis.Case) -> None:
                kwargs = case.as_transport_kwargs(base_url=fuzz_cluster.url)
                response = client.request(
                    kwargs["method"],
                    kwargs["url"],
                    headers=kwargs.get("headers"),
                    params=kwargs.get("params"),
                    json=kwargs.get("json"),
                    content=kwargs.get("data"),
                )
                SEEN[f"{response.status_code // 100}xx"] += 1
                assert response.status_code < 500, (case.path, case.body, response.text[:300])
                if response.status_code >= 400 and case.path != "/health":
                    err = response.json()["error"]
                    assert err["message"] and "Traceback" not in err["message"]

            check()


def test_the_document_lists_every_endpoint(fuzz_cluster: Cluster) -> None:
    paths = httpx.get(fuzz_cluster.url + "/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models"} <= set(paths)
