"""request_perf_metrics: each worker reports its timing of the leg (a response header, or a
last SSE event that the client never sees); the orchestrator estimates each worker's clock
offset and puts both legs' steps on its own clock in GET /perf_metrics."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from disagg.leg_timing import EVENT, RESPONSE_HEADER
from tests.conftest import Procs, Proxy, start_cluster, start_workers

CTX_SHIFT_MS, GEN_SHIFT_MS = 5000.0, -3000.0


@pytest.fixture(scope="module")
def shifted(procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A cluster whose context worker's clock is 5 s ahead and generation worker's 3 s
    behind the orchestrator's."""
    c = start_cluster(
        procs,
        tmp_path_factory.mktemp("leg_timing"),
        1,
        1,
        ctx_args=("--clock-offset", str(CTX_SHIFT_MS / 1000)),
        gen_args=("--clock-offset", str(GEN_SHIFT_MS / 1000)),
        request_perf_metrics=True,
        perf_metrics_max_requests=8,
    )
    yield c


def _records(url: str) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = httpx.get(url + "/perf_metrics").json()["records"]
    return records


def test_offsets_are_estimated_and_steps_mapped(shifted: Any) -> None:
    for i in range(4):
        body = {"model": "tiny", "prompt": f"clock {i} " * 12, "max_tokens": 6}
        r = httpx.post(shifted.url + "/v1/completions", json={**body, "stream": i % 2 == 1})
        assert r.status_code == 200
    records = _records(shifted.url)
    assert len(records) == 4
    for rec in records:
        clock = rec["clock_offset_ms"]
        # Loopback round trips take a millisecond or so: the estimate is that close.
        assert abs(clock["context"] - CTX_SHIFT_MS) <= max(20.0, clock["context_error"])
        assert abs(clock["generation"] - GEN_SHIFT_MS) <= max(20.0, clock["generation_error"])
        slack = 20.0
        # Each worker's steps, on the orchestrator's clock, fall inside the exchange that
        # the orchestrator timed around them.
        ctx = [
            rec["context_sent_ms"],
            rec["context_worker_received_ms"],
            rec["context_worker_scheduled_ms"],
            rec["context_worker_first_token_ms"],
            rec["context_worker_responded_ms"],
            rec["context_done_ms"],
        ]
        assert all(b >= a - slack for a, b in itertools.pairwise(ctx)), ctx
        gen = [
            rec["generation_sent_ms"],
            rec["generation_worker_received_ms"],
            rec["generation_worker_kv_transfer_start_ms"],
            rec["generation_worker_kv_transfer_end_ms"],
            rec["generation_worker_first_token_ms"],
            rec["generation_worker_last_token_ms"],
            rec["last_token_ms"],
        ]
        assert all(b >= a - slack for a, b in itertools.pairwise(gen)), gen
        assert rec["kv_transfer_ms"] > 0 and rec["kv_transfer_bytes"] > 0
        assert rec["context_sent_ms"] <= rec["context_first_byte_ms"] <= rec["context_done_ms"]


def test_timing_never_reaches_the_client(shifted: Any) -> None:
    body = {"model": "tiny", "prompt": "stream me", "max_tokens": 8, "stream": True}
    with httpx.stream("POST", shifted.url + "/v1/completions", json=body) as r:
        raw = b"".join(r.iter_bytes())
    assert r.status_code == 200
    assert EVENT.encode() not in raw and b"event:" not in raw
    assert raw.endswith(b"data: [DONE]\n\n")
    whole = httpx.post(shifted.url + "/v1/completions", json={**body, "stream": False})
    assert RESPONSE_HEADER not in whole.headers

    client = openai.OpenAI(base_url=shifted.url + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text  # the answer arrived whole, the timing event taken out
    assert "generation_worker_last_token_ms" in _records(shifted.url)[-1]


def _garble(headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
    """Spoil a worker's leg timing: the header, and the data of the stream's timing event."""
    if RESPONSE_HEADER in headers:
        headers[RESPONSE_HEADER] = '{"received": "soon", "responded": -1}'
    marker = f"event: {EVENT}\ndata: ".encode()
    if marker in body:
        head, _, tail = body.partition(marker)
        body = head + marker + b"{not json" + tail[tail.index(b"\n") :]
    return headers, body


def test_malformed_timing_is_ignored(procs: Procs, tmp_path: Path) -> None:
    urls = start_workers(procs, "context", "generation")
    with Proxy(urls[0], _garble) as ctx, Proxy(urls[1], _garble) as gen:
        c = start_cluster(
            procs,
            tmp_path,
            0,
            0,
            extra_ctx=[ctx],
            extra_gen=[gen],
            request_perf_metrics=True,
            perf_metrics_max_requests=4,
        )
        for stream in (False, True):
            body = {"model": "tiny", "prompt": "garbled", "max_tokens": 5, "stream": stream}
            r = httpx.post(c.url + "/v1/completions", json=body)
            assert r.status_code == 200
            assert b"event:" not in r.content and b"not json" not in r.content
        records = _records(c.url)
        assert len(records) == 2
        for rec in records:  # the orchestrator's own steps, and nothing from the workers
            assert rec["status"] == 200 and "last_token_ms" in rec
            assert not any("worker" in k for k in rec) and "clock_offset_ms" not in rec
