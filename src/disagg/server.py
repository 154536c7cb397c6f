"""The orchestrator's HTTP frontend: OpenAI routes, client and admin keys, request limits,
admission, drain, SSE responses, cluster views and metrics.

It checks who calls, reads the client's body (bounded in size and time), validates and
bounds it, admits it, hands it to the orchestrator, and writes what comes back. Errors
become OpenAI-style bodies in `disagg.http`; no placement happens here. `x-disagg-route`
names internal workers, so where clients need keys only the admin key's holder gets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from disagg.admin import AdminRoutes
from disagg.admission import Admission
from disagg.cache_aware import CacheAwareRouting, StartupError
from disagg.client_auth import ClientAuth
from disagg.clock_offsets import ClockOffsets
from disagg.cluster import BreakerSettings, Cluster, HealthMonitor, StaticDiscovery, Thresholds
from disagg.config import GENERATION_FAILURE_POLICIES, PREFILL_FAILURE_POLICIES, ClusterConfig
from disagg.endpoints import ENDPOINTS, Endpoint
from disagg.errors import (
    DisaggError,
    InvalidRequest,
    ModelNotFound,
    RequestTimeout,
    ServiceUnavailable,
    TooManyRequests,
)
from disagg.formats import DONE, sse_data
from disagg.http import Handler, client_tls, error_middleware, error_response, json_response
from disagg.internal_auth import signer_for
from disagg.limits import Limits
from disagg.openapi import document
from disagg.orchestrator import Deadlines, Job, Orchestrator, Route
from disagg.perf_records import PerfRecords
from disagg.protocol import decode_body, validate
from disagg.retry import RetryPolicy
from disagg.routing.prompt_tokens import PromptHasher
from disagg.telemetry import CONTENT_TYPE, Metrics
from disagg.tracing import RequestSpan, Tracing
from disagg.upstream import WorkerClient

if TYPE_CHECKING:
    from disagg.etcd_discovery import EtcdDiscovery

log = logging.getLogger(__name__)
access = logging.getLogger("disagg.access")  # one line a client request, at info

# Fields only the orchestrator may set on a leg; a client can never drive the handoff.
INTERNAL_FIELDS = ("disaggregated_params", "prompt_token_ids")
PREFILL_FAILURE_HEADER = "x-disagg-on-prefill-failure"
GENERATION_FAILURE_HEADER = "x-disagg-on-generation-failure"
CONVERSATION_HEADER = "x-disagg-conversation-id"
REQUEST_ID_HEADER = "x-request-id"
_URL = re.compile(r"\bhttps?://[^\s,;)'\"]+")


@web.middleware
async def public_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every answer carries `x-request-id` (the client's, else a new one); an error's message
    loses the internal addresses it names (the log keeps them, with the request id), except
    on the admin endpoints, whose callers hold the admin key."""
    rid = request.headers.get(REQUEST_ID_HEADER, "")[:128] or uuid.uuid4().hex
    request["request_id"] = rid
    try:
        resp = await handler(request)
    except DisaggError as exc:
        if exc.status >= 500 or _URL.search(exc.message):
            log.warning(
                "request %s: %s %s -> %d: %s",
                rid,
                request.method,
                request.path,
                exc.status,
                exc.message,
            )
        if not request.path.startswith("/admin/"):  # the admin key's holder knows them
            exc.message = _URL.sub("<worker>", exc.message)
        resp = error_response(exc)
    if not resp.prepared:  # a stream sent its headers already (see `_serve`)
        resp.headers[REQUEST_ID_HEADER] = rid
    return resp


def _conversation(request: web.Request, body: dict[str, Any]) -> str | None:
    """The conversation-affinity key: the header, else the OpenAI `user` field."""
    key = request.headers.get(CONVERSATION_HEADER) or body.get("user")
    return key if isinstance(key, str) and key else None


def _trace_route(span: RequestSpan, route: Route | None, status: int) -> None:
    span.status(status)
    if route is not None:
        span.set("disagg.context_worker", route.context)
        span.set("disagg.generation_worker", route.generation)
        span.set("disagg.cached_tokens", route.cached_tokens)
        span.set("disagg.retries", route.retries)


def retry_policy(config: ClusterConfig) -> RetryPolicy:
    if config.disable_retries:
        return RetryPolicy.off()
    return RetryPolicy(config.max_retries, config.transient_retries, config.retry_interval)


def _etcd_discovery(config: ClusterConfig, cluster: Cluster, metrics: Metrics) -> EtcdDiscovery:
    try:
        from disagg.etcd_discovery import EtcdDiscovery
        from disagg.registry import Endpoints
    except ImportError as exc:
        raise StartupError(
            f"cluster.backend etcd needs the etcd client ({exc}): pip install 'disagg[etcd]'"
        ) from None
    endpoints = Endpoints(config.cluster.endpoints)
    return EtcdDiscovery(cluster, endpoints, config.cluster.name, metrics)


class Frontend:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.cluster = Cluster(
            StaticDiscovery(config.context.urls, config.generation.urls),
            BreakerSettings(config.breaker_failures, config.breaker_cooldown),
        )
        self.tls = client_tls(config.worker_ca_bundle)
        self.offsets = ClockOffsets() if config.request_perf_metrics else None
        self.client = WorkerClient(
            config.connect_timeout, signer_for(config), self.tls, self.offsets
        )
        self.cache = CacheAwareRouting(config, self.cluster)
        self.tracing = Tracing.create(config.otlp_traces_endpoint)
        self.auth = ClientAuth(config.secrets.api_keys, config.secrets.admin_key)
        self.limits = Limits(config)
        # Counts prompt tokens for the limit where no cache-aware pool tokenizes already.
        tokenizer = config.context.router.args.get("tokenizer", "tiny")
        self.counter = PromptHasher.named(str(tokenizer), 16)
        self.orchestrator = Orchestrator(
            self.cache.policy(config.context),
            self.cache.policy(config.generation),
            self.client,
            retry_policy(config),
            Deadlines(
                config.context_timeout,
                config.first_token_timeout,
                config.stream_idle_timeout,
                config.request_timeout,
            ),
            self.cache if self.cache.pools else None,
            config.generation_first_transfer
            if config.schedule_style == "generation_first"
            else None,
            self.tracing,
            config.stream_first_token,
        )
        self.admission = Admission(
            config.max_concurrent_requests, config.max_queued_requests, config.queue_timeout
        )
        self.metrics = Metrics()
        self.perf = PerfRecords(config.perf_metrics_max_requests)
        self.metrics.track(lambda: self.admission.active, lambda: self.admission.queued)
        self.metrics.watch(
            self.cluster,
            {"context": config.context.router.type, "generation": config.generation.router.type},
        )
        self.draining = False
        self.keeps_listening = False  # drain: new connections go to other replicas at once
        self._streams: set[asyncio.Task[Any]] = set()  # handlers relaying a stream
        self._cut = False
        self._health_session: aiohttp.ClientSession | None = None
        self.monitor: HealthMonitor | None = None
        self.discovery: EtcdDiscovery | None = None

    def begin_drain(self) -> None:
        self.draining = True

    async def drained(self) -> None:
        await self.admission.idle()

    def cut(self) -> None:
        """The drain deadline passed: end every open stream with an error event."""
        self._cut = True
        for task in self._streams:
            task.cancel()

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[error_middleware, public_errors],
            client_max_size=self.config.max_request_body_bytes,
        )
        app.add_routes(
            [
                web.post("/v1/completions", self._endpoint("completions")),
                web.post("/v1/chat/completions", self._endpoint("chat")),
                web.post("/v1/responses", self._endpoint("responses")),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/cluster_info", self.cluster_info),
                web.get("/metrics", self.metrics_page),
                web.get("/openapi.json", self.openapi),
                web.get("/perf_metrics", self.perf_metrics),
            ]
        )
        app.add_routes(AdminRoutes(self.cluster, self.auth).routes())
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        if self.config.cluster.backend == "etcd":  # a missing client stops start-up here
            self.discovery = _etcd_discovery(self.config, self.cluster, self.metrics)
        self._health_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.tls))
        self.monitor = HealthMonitor(
            self.cluster,
            self._health_session,
            self.config.health_check_interval,
            thresholds=Thresholds(
                self.config.health_fail_threshold, self.config.health_ok_threshold
            ),
        )
        if self.discovery is not None:  # after the monitor: it checks each worker found
            await self.discovery.start()
        timeout = self.config.worker_startup_timeout
        if timeout > 0 and not await self.monitor.wait_ready(timeout):
            log.warning(
                "not every pool has a ready worker after %.0f s; serving anyway and polling",
                timeout,
            )
        if self.cache.pools:
            try:  # the block-size check first: a cluster it rejects starts nothing
                await self.cache.start(self._health_session)
            except StartupError:
                await self._health_session.close()
                raise
        self.monitor.start()

    async def _stop(self, _app: web.Application) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await self.cache.stop()
        if self.monitor is not None:
            await self.monitor.stop()
        if self._health_session is not None:
            await self._health_session.close()
        await self.client.close()
        await asyncio.to_thread(self.tracing.shutdown)

    async def health(self, _request: web.Request) -> web.Response:
        if self.draining:
            return json_response({"status": "draining"}, status=503)
        if self.cluster.is_ready():
            return json_response({"status": "ok"})
        return json_response(
            {"status": "unavailable", "message": "needs a ready context and generation worker"},
            status=503,
        )

    async def cluster_info(self, request: web.Request) -> web.Response:
        self.auth.check_admin(request.headers)
        info = {
            **self.cluster.describe(),
            "admission": {"active": self.admission.active, "queued": self.admission.queued},
        }
        if self.discovery is not None:
            info["discovery"] = self.discovery.describe()
        if self.cache.pools:
            info["prefix_index"] = self.cache.stats()
        return json_response(info)

    async def metrics_page(self, request: web.Request) -> web.Response:
        self.auth.check_admin(request.headers)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def perf_metrics(self, request: web.Request) -> web.Response:
        self.auth.check_admin(request.headers)
        return json_response({"enabled": self.perf.enabled, "records": self.perf.last()})

    async def openapi(self, _request: web.Request) -> web.Response:
        return json_response(document())

    async def models(self, request: web.Request) -> web.Response:
        self.auth.check_client(request.headers)
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "disagg"}
            for m in self.cluster.models()
        ]
        return json_response({"object": "list", "data": data})

    def _endpoint(self, kind: str) -> Any:
        endpoint = ENDPOINTS[kind]

        async def handler(request: web.Request) -> web.StreamResponse:
            metrics, started, status = self.metrics, time.monotonic(), 500
            request["started"], request["endpoint"] = started, kind
            metrics.in_flight.inc()
            attributes = {"disagg.endpoint": kind, "disagg.request_id": request["request_id"]}
            span = self.tracing.request(f"POST {request.path}", request.headers, attributes)
            try:
                with span as traced:
                    resp = await self._handle(request, endpoint)
                    status = resp.status
                    _trace_route(traced, request.get("route"), status)
                return resp
            except DisaggError as exc:
                status = exc.status
                raise
            finally:
                took = time.monotonic() - started
                metrics.in_flight.dec()
                metrics.requests.labels(kind, f"{status // 100}xx").inc()
                metrics.duration.labels(kind).observe(took)
                route = request.get("route")
                if route is not None:
                    metrics.observe_route(route, kind, took, request.get("stream", False))
                self._log_request(request, kind, status, took)
                self._record(request, kind, status)

        return handler

    def _record(self, request: web.Request, kind: str, status: int) -> None:
        route = request.get("route")
        if route is None or not self.perf.enabled:
            return
        times = dict(route.times)
        for key in ("first_token", "last_token"):
            if key in request:
                times[key] = request[key]
        info = {
            "request_id": request.get("request_id"),
            "endpoint": kind,
            "status": status,
            "context": route.context,
            "generation": route.generation,
            "cached_tokens": route.cached_tokens,
            "retries": route.retries,
        }
        self.perf.add(request["started"], times, info, route.legs, self.offsets)

    def _log_request(self, request: web.Request, kind: str, status: int, took: float) -> None:
        if not access.isEnabledFor(logging.INFO):
            return
        fields: dict[str, Any] = {
            "request_id": request.get("request_id"),
            "endpoint": kind,
            "status": status,
            "duration_ms": round(1000 * took, 2),
        }
        route = request.get("route")
        if route is not None:
            fields |= {
                "context": route.context,
                "generation": route.generation,
                "cached_tokens": route.cached_tokens,
                "retries": route.retries,
            }
        access.info("request", extra={"fields": fields})

    async def _read(self, request: web.Request) -> bytes:
        """The body, within `max_request_body_bytes` (413) and `body_read_timeout` (408)."""
        try:
            async with asyncio.timeout(self.config.body_read_timeout):
                return await request.read()
        except TimeoutError:
            raise RequestTimeout(
                f"the request body did not arrive within {self.config.body_read_timeout:g} s"
            ) from None

    def _parse(
        self, raw: bytes, endpoint: Endpoint
    ) -> tuple[dict[str, Any], Any, list[int] | None]:
        """The body without internal fields, its typed request, and its prompt token ids."""
        body = decode_body(raw)
        for key in INTERNAL_FIELDS:
            body.pop(key, None)
        typed: Any = validate(body, endpoint.request_type)
        ids = self.cache.prompt_ids(typed)
        if ids is None:
            ids = self.counter.ids(typed)
        self.limits.check(body, endpoint, None if ids is None else len(ids))
        if not self.cluster.serves(typed.model):
            if typed.model in self.cluster.models() or not self.cluster.models():
                raise ServiceUnavailable(
                    f"no ready context and generation worker for model `{typed.model}`"
                )
            raise ModelNotFound(typed.model)
        return body, typed, ids

    def _failure_policy(
        self, request: web.Request, header: str, allowed: tuple[str, ...], default: str
    ) -> str:
        value = request.headers.get(header)
        if value is None or not self.config.failure_policy_header:
            return default
        if value not in allowed:
            raise InvalidRequest(
                f"header {header} must be one of {', '.join(allowed)}, got {value!r}",
                param=header,
            )
        return value

    async def _handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        if self.draining:
            self.metrics.rejected.labels("draining").inc()
            raise ServiceUnavailable("the orchestrator is shutting down; retry elsewhere")
        self.auth.check_client(request.headers)
        body, typed, ids = self._parse(await self._read(request), endpoint)
        request["stream"] = bool(typed.stream)
        opts = getattr(typed, "stream_options", None)
        include_usage = bool(opts and opts.include_usage) or endpoint.path == "/v1/responses"
        job = Job(
            endpoint,
            body,
            typed.model,
            typed.stream,
            include_usage,
            self._failure_policy(
                request,
                PREFILL_FAILURE_HEADER,
                PREFILL_FAILURE_POLICIES,
                self.config.on_prefill_failure,
            ),
            self._failure_policy(
                request,
                GENERATION_FAILURE_HEADER,
                GENERATION_FAILURE_POLICIES,
                self.config.on_generation_failure,
            ),
            ids,
            _conversation(request, body),
        )
        try:
            async with self.admission.slot() as waited:
                self.metrics.queue_wait.observe(waited)
                return await self._serve(request, job)
        except TooManyRequests as exc:
            self.metrics.rejected.labels(exc.reason).inc()
            raise

    async def _relay(
        self, request: web.Request, resp: web.StreamResponse, chunks: AsyncIterator[bytes]
    ) -> None:
        """Write the stream's chunks, timing the first (from the request's start) and the
        gaps between the others."""
        metrics, last, route = self.metrics, request["started"], request["route"]
        first = True
        async for chunk in chunks:
            route.wait_begins()  # a slow client is not the orchestrator's time
            try:
                await resp.write(chunk)
            finally:
                route.wait_ends()
            now = time.monotonic()
            if first:
                metrics.ttft.labels(request["endpoint"]).observe(now - last)
                request["first_token"], first = now, False
            else:
                metrics.itl.observe(now - last)
            last = now
        request["last_token"] = last

    async def _serve(self, request: web.Request, job: Job) -> web.StreamResponse:
        result = await self.orchestrator.run(job)
        if "context" in self.cache.pools and result.route.context is not None:
            self.metrics.observe_prediction(
                result.route.predicted_cached_tokens,
                result.route.cached_tokens,
                self.cache.hashers["context"].block_size,
            )
        request["route"] = result.route
        headers = {REQUEST_ID_HEADER: request.get("request_id", "")}
        if not self.auth.clients_need_keys or self.auth.is_admin(request.headers):
            headers["x-disagg-route"] = result.route.header()
        if result.body is not None:
            request["last_token"] = time.monotonic()
            return json_response(result.body, headers=headers)
        assert result.chunks is not None
        task = asyncio.current_task()
        assert task is not None
        try:
            resp = web.StreamResponse(
                headers={
                    **headers,
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                }
            )
            await resp.prepare(request)
            self._streams.add(task)
            try:
                async with contextlib.aclosing(result.chunks) as chunks:
                    await self._relay(request, resp, chunks)
            except asyncio.CancelledError:
                if not self._cut:
                    raise
                # The drain deadline passed (see `cut`): end the stream with a reason.
                task.uncancel()
                gone = ServiceUnavailable("the server shut down before the answer ended")
                await resp.write(sse_data(gone.body()) + DONE)
            except ConnectionError:
                log.info("the client left mid-stream")  # its legs are aborted by close()
                return resp
            except Exception:
                # The response has started: end it with an error event, never a second answer.
                log.exception("relaying the stream failed")
                await resp.write(sse_data(DisaggError("stream relay failed").body()) + DONE)
            await resp.write_eof()
            return resp
        finally:
            self._streams.discard(task)
            await result.close()
