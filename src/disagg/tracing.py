"""Optional OpenTelemetry traces: one SERVER span per client request and one CLIENT child span
per leg, with the W3C trace context read from the client and forwarded to the workers.

Without an endpoint, or without the `otel` extra, every call is a cheap no-op; opentelemetry
is imported only when tracing is switched on. What to trace is decided by the callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, SpanKind, Tracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

AttrValue = str | int | float | bool
_NO_ATTRS: Mapping[str, AttrValue] = MappingProxyType({})
_TRACE_HEADERS = ("traceparent", "tracestate")
_EXPORT_TIMEOUT_S = 2.0  # one POST to the collector
_SHUTDOWN_S = 3.0  # flushing at exit; a dead collector must not hold up the process


class RequestSpan:
    """The span of one client request, as its handler sees it; inert when tracing is off."""

    def __init__(self, span: Span | None = None) -> None:
        self._span = span

    def set(self, key: str, value: AttrValue | None) -> None:
        if self._span is not None and value is not None:
            self._span.set_attribute(key, value)

    def status(self, http_status: int) -> None:
        if self._span is None:
            return
        self._span.set_attribute("http.response.status_code", http_status)
        if http_status >= 500:
            _mark_error(self._span, f"HTTP {http_status}")


class _Otel:
    """The live half: a private provider (the global one is left alone), its batch exporter and
    the W3C propagator. Building it imports opentelemetry, which is what may fail."""

    def __init__(self, endpoint: str, service_name: str, sample_ratio: float) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": service_name}),
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
            shutdown_on_exit=False,  # Tracing.shutdown is the bounded way out
        )
        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=_EXPORT_TIMEOUT_S)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer: Tracer = self.provider.get_tracer("disagg")
        self.propagator: TraceContextTextMapPropagator = TraceContextTextMapPropagator()
        self.server: SpanKind = SpanKind.SERVER
        self.client: SpanKind = SpanKind.CLIENT

    @contextlib.contextmanager
    def request(
        self, name: str, headers: Mapping[str, str], attributes: Mapping[str, AttrValue]
    ) -> Iterator[RequestSpan]:
        carrier = {k.lower(): v for k, v in headers.items() if k.lower() in _TRACE_HEADERS}
        with self._span(name, self.server, attributes, self.propagator.extract(carrier)) as span:
            yield RequestSpan(span)

    @contextlib.contextmanager
    def leg(
        self, name: str, url: str, attributes: Mapping[str, AttrValue]
    ) -> Iterator[dict[str, str]]:
        with self._span(name, self.client, {**_server_attributes(url), **attributes}):
            carrier: dict[str, str] = {}
            self.propagator.inject(carrier)
            yield carrier

    @contextlib.contextmanager
    def _span(
        self,
        name: str,
        kind: SpanKind,
        attributes: Mapping[str, AttrValue],
        parent: Context | None = None,
    ) -> Iterator[Span]:
        """The current span for the block. Errors are handled here rather than by the SDK, whose
        treatment of BaseException differs between versions: a cancelled leg is no error."""
        with self.tracer.start_as_current_span(
            name,
            context=parent,
            kind=kind,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield span
            except asyncio.CancelledError:
                span.set_attribute("disagg.cancelled", True)
                raise
            except Exception as exc:
                status = getattr(exc, "status", None)  # an HTTP error's status (DisaggError)
                if isinstance(status, int):
                    span.set_attribute("http.response.status_code", status)
                    if status < 500:  # the client's mistake, not a failure of this span
                        raise
                span.record_exception(exc)
                span.set_attribute("error.type", type(exc).__qualname__)
                _mark_error(span, f"{type(exc).__name__}: {exc}")
                raise


class Tracing:
    """Spans of requests and legs, or nothing at all; one instance per frontend."""

    def __init__(self, otel: _Otel | None = None) -> None:
        self._otel = otel

    @classmethod
    def create(
        cls, endpoint: str | None, service_name: str = "disagg", sample_ratio: float = 1.0
    ) -> Tracing:
        """A no-op instance when `endpoint` is None or opentelemetry is not installed."""
        if endpoint is None:
            return cls()
        try:
            otel = _Otel(endpoint, service_name, sample_ratio)
        except ImportError as exc:
            log.warning("tracing to %s is off: %s (install 'disagg[otel]')", endpoint, exc)
            return cls()
        return cls(otel)

    @property
    def enabled(self) -> bool:
        return self._otel is not None

    def request(
        self, name: str, headers: Mapping[str, str], attributes: Mapping[str, AttrValue]
    ) -> contextlib.AbstractContextManager[RequestSpan]:
        """The SERVER span of one client request, a child of the client's trace context if it
        sent one, and the current span inside the block (and in tasks created there)."""
        if self._otel is None:
            return contextlib.nullcontext(_INERT)
        return self._otel.request(name, headers, attributes)

    def leg(
        self, name: str, url: str, attributes: Mapping[str, AttrValue] = _NO_ATTRS
    ) -> contextlib.AbstractContextManager[dict[str, str]]:
        """A CLIENT child span of the current span for one leg sent to worker `url`; yields the
        headers that carry its trace context to the worker ({} when tracing is off)."""
        if self._otel is None:
            return contextlib.nullcontext({})
        return self._otel.leg(name, url, attributes)

    def shutdown(self) -> None:
        """Export what is buffered and stop; blocks for at most a few seconds, so call it at exit
        or off the event loop. Later spans are not recorded."""
        otel, self._otel = self._otel, None
        if otel is None:
            return
        stopper = threading.Thread(target=otel.provider.shutdown, name="otel-shutdown", daemon=True)
        stopper.start()
        stopper.join(_SHUTDOWN_S)
        if stopper.is_alive():
            log.warning("tracing: spans not exported within %.0f s at shutdown", _SHUTDOWN_S)


_INERT = RequestSpan()


def _server_attributes(url: str) -> dict[str, AttrValue]:
    parts = urlsplit(url)
    attrs: dict[str, AttrValue] = {"url.full": url}
    if parts.hostname:
        attrs["server.address"] = parts.hostname
    with contextlib.suppress(ValueError):  # a malformed port is only a missing attribute
        if parts.port is not None:
            attrs["server.port"] = parts.port
    return attrs


def _mark_error(span: Span, description: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, description))
