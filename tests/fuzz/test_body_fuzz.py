"""Hypothesis-made bodies for every endpoint: valid requests with fields replaced by junk
(wrong types, huge numbers, unicode, nested junk), fields missing, unknown fields, raw bytes
that are not JSON or not UTF-8. The orchestrator answers 2xx or 4xx with an OpenAI-style
error, never a 5xx, and stays up with nothing leaked."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import Cluster, Procs, assert_no_leaks, start_cluster

EXAMPLES = 150  # per endpoint and kind
SEEN: Counter[str] = Counter()
RESULTS = Path(__file__).parent / ".fuzz_counts_bodies.json"  # read for the notes

VALID: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": "tiny", "prompt": "hello", "max_tokens": 4},
    "/v1/chat/completions": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    },
    "/v1/responses": {"model": "tiny", "input": "hello", "max_output_tokens": 4},
}
FIELDS = [
    "model", "prompt", "messages", "input", "max_tokens", "max_completion_tokens",
    "max_output_tokens", "stream", "stream_options", "temperature", "top_p", "top_k", "n",
    "stop", "seed", "user", "logprobs", "disaggregated_params", "prompt_token_ids",
    "instructions", "ignore_eos",
]  # fmt: skip

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
    | st.sampled_from(["", "tiny", "\u0000", "\U0001f600" * 20, "x" * 5000])
)
junk = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)


@st.composite
def mutated(draw: st.DrawFn, path: str) -> dict[str, Any]:
    body = json.loads(json.dumps(VALID[path]))
    for key in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        if draw(st.booleans()):
            body[key] = draw(junk)
        else:
            body.pop(key, None)
    return body


@pytest.fixture(scope="module")
def fuzz_cluster(procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(
        procs, tmp_path_factory.mktemp("bodyfuzz"), 1, 1, max_tokens_limit=8, request_timeout=20
    )
    yield c
    assert httpx.get(c.url + "/health").status_code == 200
    assert_no_leaks(c)
    RESULTS.write_text(json.dumps(dict(SEEN)))


def _check(response: httpx.Response, sent: object) -> None:
    SEEN[f"{response.status_code // 100}xx"] += 1
    assert response.status_code < 500, (sent, response.text[:300])
    if response.status_code >= 400:
        err = response.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert "Traceback" not in response.text and "127.0.0.1" not in err["message"]


@pytest.mark.parametrize("path", list(VALID))
def test_mutated_bodies(fuzz_cluster: Cluster, path: str) -> None:
    with httpx.Client(base_url=fuzz_cluster.url, timeout=30) as client:

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=mutated(path))
        def check(body: dict[str, Any]) -> None:
            _check(client.post(path, json=body), body)

        check()


@pytest.mark.parametrize("path", list(VALID))
def test_raw_bytes(fuzz_cluster: Cluster, path: str) -> None:
    with httpx.Client(base_url=fuzz_cluster.url, timeout=30) as client:

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        @given(raw=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
        def check(raw: bytes) -> None:
            headers = {"Content-Type": "application/json"}
            _check(client.post(path, content=raw, headers=headers), raw)

        check()
