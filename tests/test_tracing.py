"""Tracing: spans exported over real OTLP/HTTP to a loopback receiver, W3C context in and out,
errors, and the no-op paths (no endpoint, opentelemetry missing)."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from disagg.tracing import Tracing
from tests.otlp_receiver import OtlpReceiver

CTX_URL = "http://127.0.0.1:8101"
GEN_URL = "http://127.0.0.1:8102"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = "b7ad6b7169203331"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture
def tracing(receiver: OtlpReceiver) -> Iterator[Tracing]:
    t = Tracing.create(receiver.url, service_name="disagg-test")
    assert t.enabled
    yield t
    t.shutdown()


def by_name(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in spans}


def test_request_with_two_legs_is_one_trace(receiver: OtlpReceiver, tracing: Tracing) -> None:
    with tracing.request("POST /v1/completions", {}, {"disagg.request_id": "r1"}) as req:
        with tracing.leg("context_leg", CTX_URL):
            pass
        with tracing.leg("generation_leg", GEN_URL, {"disagg.retry": 0}):
            pass
        req.set("disagg.cached_tokens", 32)
        req.set("disagg.ignored", None)
        req.status(200)
    tracing.shutdown()
    spans = by_name(receiver.wait_for(3))
    root, ctx, gen = (spans[n] for n in ("POST /v1/completions", "context_leg", "generation_leg"))
    assert root["kind"] == "server" and root["parent_span_id"] == ""
    assert root["service"] == "disagg-test"
    assert root["attributes"] == {
        "disagg.request_id": "r1",
        "disagg.cached_tokens": 32,
        "http.response.status_code": 200,
    }
    assert root["status_code"] == "unset"
    for leg in (ctx, gen):
        assert leg["kind"] == "client"
        assert leg["trace_id"] == root["trace_id"]
        assert leg["parent_span_id"] == root["span_id"]
        assert leg["status_code"] == "unset"
    assert ctx["attributes"] == {
        "url.full": CTX_URL,
        "server.address": "127.0.0.1",
        "server.port": 8101,
    }
    assert gen["attributes"]["disagg.retry"] == 0


def test_client_traceparent_is_the_parent(receiver: OtlpReceiver, tracing: Tracing) -> None:
    headers = {"Traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01", "Tracestate": "acme=7"}
    with tracing.request("POST /v1/chat/completions", headers, {}), tracing.leg("c", CTX_URL) as h:
        assert h["tracestate"] == "acme=7"
    tracing.shutdown()
    root = by_name(receiver.wait_for(2))["POST /v1/chat/completions"]
    assert root["trace_id"] == CLIENT_TRACE
    assert root["parent_span_id"] == CLIENT_PARENT


def test_leg_headers_carry_the_leg_span(receiver: OtlpReceiver, tracing: Tracing) -> None:
    with tracing.request("req", {}, {}), tracing.leg("context_leg", CTX_URL) as headers:
        sent = dict(headers)
    tracing.shutdown()
    spans = by_name(receiver.wait_for(2))
    version, trace_id, parent_id, flags = sent["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled
    assert trace_id == spans["req"]["trace_id"]
    assert parent_id == spans["context_leg"]["span_id"]
    assert "tracestate" not in sent


def test_legs_in_tasks_are_children(receiver: OtlpReceiver, tracing: Tracing) -> None:
    async def leg(name: str) -> None:
        with tracing.leg(name, GEN_URL):
            await asyncio.sleep(0)

    async def serve() -> None:
        with tracing.request("req", {}, {}):
            async with asyncio.TaskGroup() as tg:
                tg.create_task(leg("context_leg"))
                tg.create_task(leg("generation_leg"))

    asyncio.run(asyncio.wait_for(serve(), 10))
    tracing.shutdown()
    spans = by_name(receiver.wait_for(3))
    for name in ("context_leg", "generation_leg"):
        assert spans[name]["parent_span_id"] == spans["req"]["span_id"]


def test_exception_in_leg_marks_error(receiver: OtlpReceiver, tracing: Tracing) -> None:
    with (
        pytest.raises(ConnectionResetError, match="worker gone"),
        tracing.request("req", {}, {}),
        tracing.leg("generation_leg", GEN_URL),
    ):
        raise ConnectionResetError("worker gone")
    tracing.shutdown()
    leg = by_name(receiver.wait_for(2))["generation_leg"]
    assert leg["status_code"] == "error"
    assert "worker gone" in leg["status_message"]
    assert leg["attributes"]["error.type"] == "ConnectionResetError"
    (event,) = leg["events"]
    assert event["name"] == "exception"
    assert event["attributes"]["exception.type"] == "ConnectionResetError"
    assert event["attributes"]["exception.message"] == "worker gone"


def test_cancelled_leg_is_no_error(receiver: OtlpReceiver, tracing: Tracing) -> None:
    async def waiting_leg() -> None:
        with tracing.leg("generation_leg", GEN_URL):
            await asyncio.sleep(60)

    async def serve() -> None:
        with tracing.request("req", {}, {}):
            task = asyncio.create_task(waiting_leg())
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(asyncio.wait_for(serve(), 10))
    tracing.shutdown()
    leg = by_name(receiver.wait_for(2))["generation_leg"]
    assert leg["status_code"] == "unset"
    assert leg["attributes"]["disagg.cancelled"] is True


def test_status_5xx_marks_error(receiver: OtlpReceiver, tracing: Tracing) -> None:
    with tracing.request("req", {}, {}) as req:
        req.status(503)
    tracing.shutdown()
    (root,) = receiver.wait_for(1)
    assert root["status_code"] == "error"
    assert root["attributes"]["http.response.status_code"] == 503


def test_unsampled_trace_exports_nothing_but_propagates(receiver: OtlpReceiver) -> None:
    tracing = Tracing.create(receiver.url, sample_ratio=0.0)
    with tracing.request("req", {}, {}), tracing.leg("context_leg", CTX_URL) as headers:
        assert not int(headers["traceparent"].split("-")[3], 16) & 1  # not sampled
    tracing.shutdown()
    assert receiver.spans() == []


def test_disabled_tracing_does_nothing() -> None:
    tracing = Tracing.create(None)
    assert not tracing.enabled
    with tracing.request("req", {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"}, {}) as r:
        r.set("k", "v")
        r.status(503)
        with tracing.leg("context_leg", CTX_URL) as headers:
            assert headers == {}
    with pytest.raises(ValueError), tracing.leg("context_leg", CTX_URL):
        raise ValueError("passes through")
    tracing.shutdown()


def test_disabled_tracing_imports_no_opentelemetry() -> None:
    code = (
        "import sys, disagg, disagg.tracing\n"
        "t = disagg.tracing.Tracing.create(None)\n"
        "with t.request('r', {}, {}), t.leg('l', 'http://w') as h: assert h == {}\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_missing_opentelemetry_disables_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in [m for m in sys.modules if m == "opentelemetry" or m.startswith("opentelemetry.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    with caplog.at_level(logging.WARNING, logger="disagg.tracing"):
        assert not Tracing.create(None).enabled
        assert caplog.records == []
        tracing = Tracing.create("http://127.0.0.1:4318/v1/traces")
    assert not tracing.enabled
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "disagg[otel]" in record.getMessage()
    with tracing.request("req", {}, {}), tracing.leg("context_leg", CTX_URL) as headers:
        assert headers == {}


def test_shutdown_is_bounded_when_the_collector_hangs() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        tracing = Tracing.create(f"http://127.0.0.1:{silent.getsockname()[1]}/v1/traces")
        with tracing.request("req", {}, {}):
            pass
        started = time.monotonic()
        tracing.shutdown()
        assert time.monotonic() - started < 5
