"""An OTLP/HTTP trace receiver on loopback for tests: an aiohttp server on a thread and event
loop of its own, so synchronous tests can use it, that decodes each `POST /v1/traces` and keeps
its spans as plain dicts. Use it as a context manager, or call `close()`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import TracebackType
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

_START_S = 10.0


class OtlpReceiver:
    def __init__(self) -> None:
        self._spans: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="otlp", daemon=True)
        self._thread.start()
        try:
            self._runner = self._call(self._start())
        except BaseException:
            self._stop_loop()
            raise
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}/v1/traces"

    def spans(self) -> list[dict[str, Any]]:
        """Every span received so far, in arrival order: name, trace_id, span_id,
        parent_span_id ("" for a root), kind ("server", "client", ...), attributes,
        status_code ("unset", "ok", "error"), status_message, events, service."""
        with self._changed:
            return list(self._spans)

    def wait_for(self, n: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        """The spans once at least `n` arrived; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self._spans) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self._spans)} of {n} spans after {timeout} s")
                self._changed.wait(left)
            return list(self._spans)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._call(self._runner.cleanup())
        finally:
            self._stop_loop()

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_START_S)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_START_S)
        self._loop.close()

    async def _start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/v1/traces", self._receive)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    async def _receive(self, request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        received = [
            _span_dict(span, _service(rs.resource.attributes))
            for rs in export.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]
        with self._changed:
            self._spans.extend(received)
            self._changed.notify_all()
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")


def _span_dict(span: Span, service: str) -> dict[str, Any]:
    return {
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex(),
        "kind": Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_").lower(),
        "attributes": _attributes(span.attributes),
        "status_code": Status.StatusCode.Name(span.status.code)
        .removeprefix("STATUS_CODE_")
        .lower(),
        "status_message": span.status.message,
        "events": [{"name": e.name, "attributes": _attributes(e.attributes)} for e in span.events],
        "service": service,
    }


def _service(resource_attributes: Any) -> str:
    return str(_attributes(resource_attributes).get("service.name", ""))


def _attributes(pairs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in pairs:
        assert isinstance(kv, KeyValue)
        out[kv.key] = _value(kv.value)
    return out


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind) if kind else None
