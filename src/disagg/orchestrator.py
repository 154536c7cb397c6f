"""One request's journey: plan → context leg → generation leg → relay → finish.

The orchestrator owns the request: it asks the policies for workers, sends each leg through
upstream, and finishes every reservation exactly once on success, error and cancellation.
It never formats HTTP responses (the server does) and never picks workers itself.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from disagg.endpoints import ContextOutcome, Endpoint
from disagg.errors import DisaggError, WorkerUnavailable
from disagg.formats import DONE, sse_data
from disagg.routing import Policy, Reservation, RouteRequest
from disagg.upstream import UpstreamStream, WorkerClient

log = logging.getLogger(__name__)


@dataclass
class Route:
    """Where a request went; sent to the client as the `x-disagg-route` header."""

    context: str | None = None
    generation: str | None = None
    cached_tokens: int = 0

    def header(self) -> str:
        ctx = self.context or "-"
        gen = self.generation or "-"
        return f"context={ctx}; generation={gen}; cached_tokens={self.cached_tokens}"


@dataclass
class Result:
    """A whole answer (`body`) or a stream (`chunks`, which must be closed)."""

    route: Route
    body: dict[str, Any] | None = None
    chunks: AsyncIterator[bytes] | None = None
    close: Callable[[], None] = field(default=lambda: None)


class Orchestrator:
    def __init__(
        self, context_policy: Policy, generation_policy: Policy, client: WorkerClient
    ) -> None:
        self.context_policy, self.generation_policy = context_policy, generation_policy
        self.client = client
        # Random high bits keep ids apart across restarts and replicas; the low 32 bits count.
        self._ids = itertools.count((secrets.randbits(31) << 32) + 1)

    def next_id(self) -> int:
        return next(self._ids)

    async def run(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        model: str,
        stream: bool,
        include_usage: bool,
    ) -> Result:
        request = RouteRequest(self.next_id(), model)
        route = Route()
        ctx_resp, ctx = await self._context_leg(endpoint, body, request, route)
        if ctx.finished:
            if stream:
                chunks = endpoint.finished_stream(ctx_resp, ctx, include_usage)
                return Result(route, chunks=_iterate(chunks))
            return Result(route, body=endpoint.clean(ctx_resp, None))
        return await self._generation_leg(endpoint, body, request, route, ctx, stream)

    async def _context_leg(
        self, endpoint: Endpoint, body: dict[str, Any], request: RouteRequest, route: Route
    ) -> tuple[dict[str, Any], ContextOutcome]:
        reservation = Reservation(self.context_policy, request)
        route.context = reservation.worker.url
        ok = False
        try:
            payload = endpoint.context_request(body, self.next_id())
            resp = await self.client.post(reservation.worker.url, endpoint.path, payload)
            try:
                ctx = endpoint.outcome(resp, endpoint.budget(body))
                route.cached_tokens = int(
                    (ctx.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                )
            except (AttributeError, TypeError, ValueError, KeyError, IndexError):
                raise WorkerUnavailable(
                    f"context worker {route.context} sent a malformed answer"
                ) from None
            ok = True
        finally:
            reservation.finish(ok)
        if not ctx.finished and not (
            ctx.prompt_token_ids and ctx.params.get("encoded_opaque_state")
        ):
            await self._release_context_kv(route, ctx)
            raise WorkerUnavailable(
                "the context worker's answer lacks prompt_token_ids or disaggregated_params"
            )
        return resp, ctx

    async def _generation_leg(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        request: RouteRequest,
        route: Route,
        ctx: ContextOutcome,
        stream: bool,
    ) -> Result:
        try:
            reservation = Reservation(self.generation_policy, request)
        except BaseException:
            await self._release_context_kv(route, ctx)
            raise
        url = route.generation = reservation.worker.url
        try:
            payload = endpoint.generation_request(body, ctx, self.next_id())
            if stream:
                upstream = await self.client.open_stream(url, endpoint.path, payload)
            else:
                resp = await self.client.post(url, endpoint.path, payload)
                reservation.finish(True)
                return Result(route, body=endpoint.clean(resp, ctx))
        except BaseException:
            reservation.finish(False)
            await self._release_context_kv(route, ctx)
            raise
        relay = _Relay(upstream, reservation)
        return Result(route, chunks=relay.chunks(), close=relay.close)

    async def _release_context_kv(self, route: Route, ctx: ContextOutcome) -> None:
        """The generation leg failed: free the context worker's pinned KV now, not at lease
        expiry (a no-op when the generation worker already fetched it)."""
        rid = ctx.params.get("ctx_request_id")
        if route.context is not None and isinstance(rid, int):
            await asyncio.shield(self.client.release_kv(route.context, rid))


class _Relay:
    """Relays a worker's SSE bytes unchanged; finishes the reservation exactly once."""

    def __init__(self, upstream: UpstreamStream, reservation: Reservation) -> None:
        self.upstream, self.reservation = upstream, reservation
        self.ok = False

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.upstream.chunks():
                yield chunk
            self.ok = True
        except (aiohttp.ClientError, TimeoutError) as exc:
            # Bytes may already be with the client: end the stream with an error event.
            log.warning("generation stream from %s broke: %r", self.reservation.worker.url, exc)
            err = DisaggError(f"generation worker stream failed: {type(exc).__name__}")
            err.status, err.type = 502, "upstream_error"
            yield sse_data(err.body())
            yield DONE

    def close(self) -> None:
        self.upstream.close()
        self.reservation.finish(self.ok)


async def _iterate(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk
