"""One request's journey: plan → context leg → generation leg → relay → finish.

The orchestrator owns the request: it asks the policies for workers, sends each leg through
upstream, and finishes every reservation exactly once on success, error and cancellation.
It never formats HTTP responses (the server does) and never picks workers itself.

With `schedule_style: generation_first` the generation worker is chosen first (by its cache)
and its leg sent at once; it allocates its blocks and waits while the context leg runs. The
context worker pushes the KV there (or, pulling, the orchestrator tells the waiting leg where
the KV is). Anything that fails before the waiting leg holds the KV falls back to the
context-first generation leg, the handoff that the rest of this module knows how to retry.

A stream's first token goes to the client as soon as the context leg answers
(`stream_first_token: context`, see `disagg.ahead`); its generation leg runs inside the
stream. A generation leg that fails there is retried by the same rules: nothing of it has
reached the client. When a retry needs a new context leg (`_Replan`), the new generation leg
continues from the token already sent, not the one that leg sampled (the prompt's KV does
not depend on it). With `stream_first_token: generation` the stream starts only once the
generation worker holds the KV, so a failure before that is an HTTP error status.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from disagg.ahead import Ahead
from disagg.clock_offsets import ClockOffsets
from disagg.cluster import WorkerState
from disagg.endpoints import ContextOutcome, Endpoint
from disagg.errors import (
    KV_TRANSFER_FAILED,
    DeadlineExceeded,
    DisaggError,
    GatewayTimeout,
    ServiceUnavailable,
    UpstreamError,
    WorkerUnavailable,
)
from disagg.formats import DONE, sse_data
from disagg.leg_timing import EVENT_PREFIX, split_event
from disagg.perf_records import LegRecord
from disagg.retry import RetryBudget, RetryPolicy, retryable
from disagg.routing import Policy, Reservation, RouteRequest
from disagg.tracing import Tracing
from disagg.upstream import StreamError, UpstreamStream, WorkerClient

if TYPE_CHECKING:
    from disagg.cache_aware import CacheAwareRouting

log = logging.getLogger(__name__)


@dataclass
class Route:
    """Where a request went; sent to the client as the `x-disagg-route` header."""

    context: str | None = None
    generation: str | None = None
    cached_tokens: int = 0
    predicted_cached_tokens: int = 0  # what the prefix index expected at the context worker
    retries: int = 0
    context_s: float = 0.0  # the context leg that answered: send to answer, in seconds
    # When the legs that served it were sent and answered (time.monotonic(); the last
    # attempt's): context_sent, context_done, generation_sent, generation_accepted.
    times: dict[str, float] = field(default_factory=dict)
    legs: dict[str, LegRecord] = field(default_factory=dict)  # "context", "generation"
    deadline: float = float("inf")  # loop time by which the whole request must be done
    # The context leg's worker: its breaker's verdict waits until its KV reached the
    # generation worker (an answer whose KV cannot be pulled is no success).
    context_worker: WorkerState | None = field(default=None, repr=False)
    # Time with a worker call (or a retry pause, or a client write) outstanding: the rest of
    # the request's time is the orchestrator's own.
    waited_s: float = 0.0
    _waits: int = field(default=0, repr=False)
    _wait_began: float = field(default=0.0, repr=False)

    def wait_begins(self) -> None:
        if self._waits == 0:
            self._wait_began = time.monotonic()
        self._waits += 1

    def wait_ends(self) -> None:
        self._waits -= 1
        if self._waits == 0:
            self.waited_s += time.monotonic() - self._wait_began

    def left(self, limit_s: float) -> float:
        """`limit_s`, cut to what is left of the request's deadline (never 0, which the
        client library would read as "no timeout")."""
        left = self.deadline - asyncio.get_running_loop().time()
        if left <= 0.001:
            raise DeadlineExceeded("the request deadline passed")
        return min(limit_s, left)

    def header(self) -> str:
        ctx = self.context or "-"
        gen = self.generation or "-"
        return (
            f"context={ctx}; generation={gen}; cached_tokens={self.cached_tokens};"
            f" predicted_cached_tokens={self.predicted_cached_tokens}; retries={self.retries}"
        )


@dataclass(frozen=True)
class Deadlines:
    """Per-leg and whole-request time limits, in seconds."""

    context_s: float = 180.0  # one context leg attempt
    first_token_s: float = 180.0  # a generation leg until the worker starts answering
    stream_idle_s: float = 60.0  # between two chunks of a stream
    request_s: float = 180.0  # the whole request, retries included


@dataclass(frozen=True)
class Job:
    """One client request as the orchestrator runs it."""

    endpoint: Endpoint
    body: dict[str, Any]  # validated, internal fields stripped, unknown fields kept
    model: str
    stream: bool
    include_usage: bool
    on_prefill_failure: str = "retry"  # retry | local (aggregated on a generation worker) | fail
    on_generation_failure: str = "retry"  # retry (a new pair) | fail
    prompt_ids: list[int] | None = None  # as the worker will tokenize it (cache-aware routing)
    conversation: str | None = None  # conversation affinity key (header or `user`)


@dataclass
class Result:
    """A whole answer (`body`) or a stream (`chunks`, which must be closed)."""

    route: Route
    body: dict[str, Any] | None = None
    chunks: AsyncGenerator[bytes, None] | None = None
    close: Callable[[], Awaitable[None]] = field(default=lambda: _nothing())


class Orchestrator:
    def __init__(
        self,
        context_policy: Policy,
        generation_policy: Policy,
        client: WorkerClient,
        retry: RetryPolicy | None = None,
        deadlines: Deadlines | None = None,
        cache: CacheAwareRouting | None = None,
        generation_first: str | None = None,
        tracing: Tracing | None = None,
        first_token: str = "context",
    ) -> None:
        """`generation_first`: None (context first), or how its KV moves: "push" or "pull";
        `tracing`: where each leg's span goes (its trace context travels with the leg);
        `first_token`: who sends a stream's first token, "context" (the orchestrator, from
        the context answer, at once) or "generation" (the generation worker)."""
        self.context_policy, self.generation_policy = context_policy, generation_policy
        self.client = client
        self.retry = retry or RetryPolicy()
        self.deadlines = deadlines or Deadlines()
        self.cache = cache
        self.generation_first = generation_first
        self.tracing = tracing or Tracing()
        self.first_token = first_token
        # Random high bits keep ids apart across restarts and replicas; the low 32 bits count.
        self._ids = itertools.count((secrets.randbits(31) << 32) + 1)

    def next_id(self) -> int:
        return next(self._ids)

    async def run(self, job: Job) -> Result:
        # The request keeps one id (its reservations are keyed by it); every attempt sends a
        # fresh disagg_request_id.
        request = RouteRequest(
            self.next_id(),
            job.model,
            tokens=job.endpoint.expected_tokens(job.body),
            block_hashes=self.cache.hashes("context", job.prompt_ids) if self.cache else (),
            conversation=job.conversation,
        )
        deadline = asyncio.get_running_loop().time() + self.deadlines.request_s
        # Each leg's timeout is cut to the deadline (Route.left); the outer timeout also
        # covers the awaits that carry no timeout of their own.
        try:
            async with asyncio.timeout_at(deadline):
                return await self._attempts(job, request, deadline)
        except (TimeoutError, DeadlineExceeded):
            raise DeadlineExceeded(
                f"the request did not finish within {self.deadlines.request_s:g} s"
            ) from None

    async def _attempts(self, job: Job, request: RouteRequest, deadline: float) -> Result:
        budget = self.retry.budget()
        while True:
            route = Route(deadline=deadline)
            try:
                result = await self._legs(job, request, route, budget)
            except _Replan as replan:
                # The generation leg failed after it may have paired with the KV transfer:
                # that handoff can't be replayed, so plan the request again from its context leg.
                request = await self._replanned(replan, request, route, budget)
                continue
            result.route.retries = budget.attempts - 1
            return result

    async def _legs(
        self, job: Job, request: RouteRequest, route: Route, budget: RetryBudget
    ) -> Result:
        local = self.cache.local_prefill(job.prompt_ids, job.model) if self.cache else None
        if local is not None:
            # Conditional disaggregation: a generation worker holds nearly all the prompt, so
            # it prefills the rest itself (the policy places it by those hashes).
            request = replace(request, block_hashes=local)
            return await self._generation_attempt(job, request, route, None)
        early = self._early_generation(job, request, route) if self.generation_first else None
        try:
            outcome = await self._context_phase(job, request, route, budget, early)
            if isinstance(outcome, Result):  # prefilled on a generation worker instead
                return outcome
            ctx_resp, ctx = outcome
            if ctx.finished:
                if job.stream:
                    chunks = job.endpoint.finished_stream(ctx_resp, ctx, job.include_usage)
                    return Result(route, chunks=_iterate(chunks))
                return Result(route, body=job.endpoint.clean(ctx_resp, None))
            handed, early = early, None  # the generation phase owns it from here
        finally:
            if early is not None:
                await early.cancel()
        if job.stream and self.first_token == "context" and job.endpoint.streams_ahead(job.body):
            stream = _AheadStream(self, job, request, route, budget, ctx_resp, ctx, handed)
            return Result(route, chunks=stream.chunks(), close=stream.close)
        return await self._generation_phase(job, request, route, ctx, budget, handed)

    async def _generation_phase(
        self,
        job: Job,
        request: RouteRequest,
        route: Route,
        ctx: ContextOutcome,
        budget: RetryBudget,
        early: _EarlyGeneration | None,
        placed: _Placed | None = None,
    ) -> Result:
        """After the context leg: the waiting generation_first leg joined to its KV, or
        (none, or it did not take) a generation leg; `placed`: its first attempt's worker."""
        try:
            if early is not None:
                joined = await self._join_early(job, route, ctx, early)
                if joined is not None:
                    early = None
                    return joined
                request, early = request.avoiding(early.url), None
        finally:
            if early is not None:
                await early.cancel()
        return await self._generation_leg(job, request, route, ctx, budget, placed)

    async def _after_first(
        self,
        job: Job,
        request: RouteRequest,
        route: Route,
        budget: RetryBudget,
        ahead: Ahead,
        early: _EarlyGeneration | None,
        placed: _Placed | None,
        ctx: ContextOutcome,
    ) -> Result:
        """The generation phase of a stream whose first token went ahead, with its replans:
        a new context leg, and the generation leg continued from the tokens sent."""
        while True:
            try:
                return await self._generation_phase(job, request, route, ctx, budget, early, placed)
            except _Replan as replan:
                early = placed = None
                request = await self._replanned(replan, request, route, budget)
                route.retries = budget.attempts - 1
            _, ctx = await self._context_leg(
                job.endpoint, job.body, request, route, _context_budget(job, budget)
            )
            if ctx.finished or not ahead.tokens:
                raise WorkerUnavailable(
                    "the generation leg failed and the new context leg cannot continue the"
                    " tokens already streamed"
                )
            ctx = replace(ctx, params={**ctx.params, "first_gen_tokens": ahead.tokens})

    async def _context_phase(
        self,
        job: Job,
        request: RouteRequest,
        route: Route,
        budget: RetryBudget,
        early: _EarlyGeneration | None,
    ) -> tuple[dict[str, Any], ContextOutcome] | Result:
        """The context leg with the request's prefill failure policy: its answer, or the
        whole request's Result when it fell back to prefilling on a generation worker."""
        push = early.target if early is not None and self.generation_first == "push" else None
        try:
            return await self._context_leg(
                job.endpoint, job.body, request, route, _context_budget(job, budget), push
            )
        except DisaggError as exc:
            if job.on_prefill_failure == "retry" or not _worker_fault(exc):
                raise
            if job.on_prefill_failure == "fail":
                raise ServiceUnavailable(
                    f"the context leg failed and this request does not fall back: {exc.message}"
                ) from None
            log.info("context leg failed (%s); prefilling on a generation worker", exc.message)
        if early is not None:
            await early.cancel()
        route.context, route.context_worker = None, None
        return await self._generation_attempt(job, request, route, None)

    async def _replanned(
        self, replan: _Replan, request: RouteRequest, route: Route, budget: RetryBudget
    ) -> RouteRequest:
        """A new plan after `replan`: spent from the budget (else its cause is raised), the
        pause between attempts waited, and `request` avoiding the worker at fault."""
        if not budget.spend(replan.cause):
            raise replan.cause from None
        await self._pause(replan.cause, route)
        return request.avoiding(replan.avoid)

    async def _pause(self, exc: DisaggError, route: Route) -> None:
        log.info("retrying after %s: %s", type(exc).__name__, exc.message)
        route.wait_begins()
        try:
            await asyncio.sleep(route.left(self.retry.interval_s))
        finally:
            route.wait_ends()

    async def _context_leg(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        request: RouteRequest,
        route: Route,
        budget: RetryBudget,
        push: tuple[str, int] | None = None,
    ) -> tuple[dict[str, Any], ContextOutcome]:
        while True:
            try:
                return await self._context_attempt(endpoint, body, request, route, push)
            except DisaggError as exc:
                if not budget.spend(exc):
                    raise
                request = request.avoiding(route.context)
                await self._pause(exc, route)

    async def _context_attempt(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        request: RouteRequest,
        route: Route,
        push: tuple[str, int] | None,
    ) -> tuple[dict[str, Any], ContextOutcome]:
        reservation = Reservation(self.context_policy, request)
        route.context = reservation.worker.url
        route.context_worker = reservation.worker
        if self.cache is not None:
            route.predicted_cached_tokens = self.cache.predicted_tokens(
                "context", route.context, request.block_hashes
            )
            self.cache.expect(route.context, request.block_hashes)
        try:
            payload = endpoint.context_request(body, self.next_id(), push)
            sent = route.times["context_sent"] = time.monotonic()
            leg = route.legs["context"] = LegRecord(reservation.worker.url, sent)
            route.wait_begins()
            try:
                with self.tracing.leg("context_leg", leg.url) as trace:
                    resp = await self.client.post(
                        leg.url,
                        endpoint.path,
                        payload,
                        route.left(self.deadlines.context_s),
                        leg,
                        trace,
                    )
            finally:
                route.wait_ends()
            route.times["context_done"] = done = time.monotonic()
            if leg.first_byte is not None:
                route.times["context_first_byte"] = leg.first_byte
            route.context_s = done - sent
            ctx = await self._context_outcome(endpoint, body, resp, route)
        except BaseException as exc:
            _judge(reservation, exc)
            reservation.finish(False)
            raise
        reservation.finish(True)
        if ctx.finished:
            reservation.judge(True)
        return resp, ctx

    async def _context_outcome(
        self, endpoint: Endpoint, body: dict[str, Any], resp: dict[str, Any], route: Route
    ) -> ContextOutcome:
        try:
            ctx = endpoint.outcome(resp, endpoint.budget(body))
            route.cached_tokens = int(
                (ctx.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            )
        except (AttributeError, TypeError, ValueError, KeyError, IndexError):
            raise WorkerUnavailable(
                f"context worker {route.context} sent a malformed answer"
            ) from None
        if not ctx.finished and not (
            ctx.prompt_token_ids
            and (ctx.params.get("encoded_opaque_state") or ctx.params.get("kv_pushed"))
        ):
            self._release_context_kv(route, ctx)
            raise WorkerUnavailable(
                "the context worker's answer lacks prompt_token_ids or disaggregated_params"
            )
        return ctx

    async def _generation_leg(
        self,
        job: Job,
        request: RouteRequest,
        route: Route,
        ctx: ContextOutcome,
        budget: RetryBudget,
        placed: _Placed | None = None,
    ) -> Result:
        request = placed.request if placed else self._for_generation(job, request, ctx)
        while True:
            try:
                reservation, placed = (placed.reservation if placed else None), None
                return await self._generation_attempt(job, request, route, ctx, reservation)
            except DisaggError as exc:
                if job.on_generation_failure == "fail" and _worker_fault(exc):
                    self._release_context_kv(route, ctx)
                    raise ServiceUnavailable(
                        "the generation leg failed and this request does not fall back:"
                        f" {exc.message}"
                    ) from None
                # Never connected: the KV is still pinned on the context worker, so the same
                # handoff can go to another generation worker.
                if isinstance(exc, WorkerUnavailable) and not exc.sent and budget.spend(exc):
                    request = request.avoiding(route.generation)
                    await self._pause(exc, route)
                    continue
                self._release_context_kv(route, ctx)
                if retryable(exc):
                    # A failed KV pull is the context worker's fault: the new pair avoids it.
                    avoid = route.context if _kv_transfer_failed(exc) else route.generation
                    raise _Replan(exc, avoid) from None
                raise
            except BaseException:
                self._release_context_kv(route, ctx)
                raise

    def _for_generation(self, job: Job, request: RouteRequest, ctx: ContextOutcome) -> RouteRequest:
        """`request` as the generation pool places it: the prompt's real tokens are known."""
        return replace(
            request,
            tokens=job.endpoint.expected_tokens(job.body, len(ctx.prompt_token_ids)),
            block_hashes=(
                self.cache.hashes("generation", ctx.prompt_token_ids) if self.cache else ()
            ),
        )

    def _place_first(
        self, job: Job, request: RouteRequest, route: Route, ctx: ContextOutcome
    ) -> _Placed:
        """Place a generation leg now (the route header names its worker) and send it later."""
        request = self._for_generation(job, request, ctx)
        return _Placed(request, self._place_generation(request, route))

    async def _generation_attempt(
        self,
        job: Job,
        request: RouteRequest,
        route: Route,
        ctx: ContextOutcome | None,
        reservation: Reservation | None = None,
    ) -> Result:
        """One generation-pool attempt: the generation leg of `ctx`, or without a context leg
        (None) the whole request, aggregated, on a generation worker; `reservation`: its
        worker, placed already."""
        if reservation is None:
            reservation = self._place_generation(request, route)
        payload = (
            job.body
            if ctx is None
            else job.endpoint.generation_request(job.body, ctx, self.next_id())
        )
        opened = await self._open_generation(
            job, payload, reservation, route, self.deadlines.first_token_s
        )
        return self._generation_result(job, route, reservation, opened, ctx)

    def _place_generation(self, request: RouteRequest, route: Route) -> Reservation:
        reservation = Reservation(self.generation_policy, request)
        route.generation = reservation.worker.url
        if self.cache is not None:
            self.cache.expect(route.generation, request.block_hashes)
        return reservation

    async def _open_generation(
        self,
        job: Job,
        payload: dict[str, Any],
        reservation: Reservation,
        route: Route,
        first_byte_s: float,
    ) -> dict[str, Any] | UpstreamStream:
        """Send a generation leg: its whole answer (the reservation is finished then), or
        its stream once the worker accepted it, which it does only once it holds the KV."""
        url, path = reservation.worker.url, job.endpoint.path
        opened: dict[str, Any] | UpstreamStream
        sent = route.times["generation_sent"] = time.monotonic()
        leg = route.legs["generation"] = LegRecord(url, sent)
        route.wait_begins()
        try:
            # A stream's span ends once its worker answers: it holds the KV then.
            with self.tracing.leg("generation_leg", url, {"disagg.stream": job.stream}) as trace:
                if job.stream:
                    opened = await self.client.open_stream(
                        url, path, payload, route.left(first_byte_s), leg, trace
                    )
                else:
                    opened = await self.client.post(
                        url, path, payload, route.left(self.deadlines.request_s), leg, trace
                    )
            if not job.stream:
                reservation.judge(True)
                reservation.finish(True)
        except BaseException as exc:
            if _kv_transfer_failed(exc):
                _judge_context(route, False)
            else:
                _judge(reservation, exc)
            reservation.finish(False)
            raise
        finally:
            route.wait_ends()
        route.times["generation_accepted"] = time.monotonic()
        _judge_context(route, True)
        return opened

    def _generation_result(
        self,
        job: Job,
        route: Route,
        reservation: Reservation,
        opened: dict[str, Any] | UpstreamStream,
        ctx: ContextOutcome | None,
    ) -> Result:
        if isinstance(opened, dict):
            return Result(route, body=job.endpoint.clean(opened, ctx))
        relay = _Relay(
            opened,
            reservation,
            lambda: self._release_context_kv(route, ctx),
            self.deadlines.stream_idle_s,
            route,
            self.client.offsets,
        )
        return Result(route, chunks=relay.chunks(), close=relay.close)

    # -- generation_first ------------------------------------------------------------------

    def _early_generation(self, job: Job, request: RouteRequest, route: Route) -> _EarlyGeneration:
        """Place the generation leg first, by the generation pool's view of the prompt, and
        send it now: it waits on its worker for the KV under a slot id of its own."""
        hashes = self.cache.hashes("generation", job.prompt_ids) if self.cache else ()
        reservation = self._place_generation(replace(request, block_hashes=hashes), route)
        slot = self.next_id()
        payload = job.endpoint.generation_first_request(job.body, slot)
        # it answers only once the context leg is done and the KV arrived
        limit = self.deadlines.context_s + self.deadlines.first_token_s
        opening = self._open_generation(job, payload, reservation, route, limit)
        return _EarlyGeneration(reservation, slot, asyncio.create_task(opening))

    async def _join_early(
        self, job: Job, route: Route, ctx: ContextOutcome, early: _EarlyGeneration
    ) -> Result | None:
        """The context leg is done: get its KV to the waiting leg (pushed already, or by
        naming where it is) and relay that leg. None when the handoff did not take: the
        waiting leg is cancelled and the KV is still pinned for a context-first handoff."""
        if not ctx.params.get("kv_pushed") and not await self._hand_off(route, ctx, early):
            await early.cancel()
            return None
        try:
            opened = await early.task
        except DisaggError as exc:
            # That worker holds the KV now and the context copy is gone: only a new context
            # leg can cure this.
            if job.on_generation_failure == "fail" and _worker_fault(exc):
                raise ServiceUnavailable(
                    f"the generation leg failed and this request does not fall back: {exc.message}"
                ) from None
            if retryable(exc):
                raise _Replan(exc, early.url) from None
            raise
        return self._generation_result(job, route, early.reservation, opened, ctx)

    async def _hand_off(self, route: Route, ctx: ContextOutcome, early: _EarlyGeneration) -> bool:
        """Pull variant: tell the waiting leg where its KV is; True once it stored it."""
        if early.task.done():  # the waiting leg failed already
            return False
        body = {
            "disagg_request_id": early.slot,
            "first_gen_tokens": ctx.params.get("first_gen_tokens"),
            "prompt_token_ids": ctx.prompt_token_ids,
            "encoded_opaque_state": ctx.params.get("encoded_opaque_state"),
            "ctx_usage": ctx.usage,
        }
        route.wait_begins()
        try:
            with self.tracing.leg("kv_handoff", early.url) as trace:
                await self.client.post(
                    early.url,
                    "/kv/handoff",
                    body,
                    route.left(self.deadlines.first_token_s),
                    trace=trace,
                )
        except DisaggError as exc:
            log.info("generation_first handoff to %s failed: %s", early.url, exc.message)
            return False
        finally:
            route.wait_ends()
        return True

    def _release_context_kv(self, route: Route, ctx: ContextOutcome | None) -> None:
        """The generation leg failed: free the context worker's pinned KV now, not at lease
        expiry (a no-op when the generation worker already fetched it)."""
        if ctx is None:
            return
        rid = ctx.params.get("ctx_request_id")
        if route.context is not None and isinstance(rid, int):
            self.client.release_kv_soon(route.context, rid)


def _context_budget(job: Job, budget: RetryBudget) -> RetryBudget:
    """The context leg's retries: the request's, or none when its prefill failure policy
    says `fail`."""
    return RetryPolicy.off().budget() if job.on_prefill_failure == "fail" else budget


def _judge(reservation: Reservation, exc: BaseException) -> None:
    """A leg failed: count it against the worker only when the worker is to blame (not for
    the client's 4xx, a cancellation or the request's own deadline)."""
    if isinstance(exc, DisaggError) and retryable(exc):
        reservation.judge(False)


def _judge_context(route: Route, ok: bool) -> None:
    """Whether the context worker's KV reached the generation worker."""
    if route.context_worker is not None:
        route.context_worker.breaker.record(ok, time.monotonic())


def _kv_transfer_failed(exc: BaseException) -> bool:
    return isinstance(exc, DisaggError) and exc.code == KV_TRANSFER_FAILED


def _worker_fault(exc: DisaggError) -> bool:
    """A failure of the pool (not of the client's request) that a fallback may cure."""
    return retryable(exc) or (
        isinstance(exc, ServiceUnavailable) and not isinstance(exc, UpstreamError)
    )


class _EarlyGeneration:
    """A generation_first leg sent before its context leg is done: the task that opens it."""

    def __init__(
        self,
        reservation: Reservation,
        slot: int,
        task: asyncio.Task[dict[str, Any] | UpstreamStream],
    ) -> None:
        self.reservation, self.slot, self.task = reservation, slot, task
        self.url = reservation.worker.url

    @property
    def target(self) -> tuple[str, int]:
        """Where the context worker pushes the KV: this worker, for this slot."""
        return self.url, self.slot

    async def cancel(self) -> None:
        """Stop waiting: the worker sees the leg's connection close and frees its blocks."""
        self.task.cancel()
        await asyncio.wait([self.task])
        if self.task.cancelled():
            return
        if self.task.exception() is None:  # it got through after all: nobody relays it
            opened = self.task.result()
            if isinstance(opened, UpstreamStream):
                opened.close()
            self.reservation.finish(False)


@dataclass(frozen=True)
class _Placed:
    """A generation leg's worker, chosen before the leg is sent."""

    request: RouteRequest
    reservation: Reservation


class _AheadStream:
    """A stream whose first token went ahead (`disagg.ahead`): that head, then the
    generation phase's stream without what the head sent. Until its generation phase runs,
    it owns what the request holds: the generation leg's reservation (placed now, so the
    route header names its worker) or waiting generation_first leg, and the context KV."""

    def __init__(
        self,
        orch: Orchestrator,
        job: Job,
        request: RouteRequest,
        route: Route,
        budget: RetryBudget,
        resp: dict[str, Any],
        ctx: ContextOutcome,
        early: _EarlyGeneration | None,
    ) -> None:
        self.orch, self.job, self.request, self.route, self.budget = (
            orch,
            job,
            request,
            route,
            budget,
        )
        self.ctx, self.early = ctx, early
        self.ahead = Ahead(job.endpoint, resp, ctx)
        self.placed: _Placed | None = None
        if early is None:
            # no worker to place it on now: the generation phase's own rules decide
            with contextlib.suppress(DisaggError):
                self.placed = orch._place_first(job, request, route, ctx)
        self.inner: Result | None = None
        self.started = False

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        yield self.ahead.head
        early, placed, self.early, self.placed = self.early, self.placed, None, None
        self.started = True
        error: DisaggError | None = None
        try:
            async with asyncio.timeout_at(self.route.deadline):
                self.inner = await self.orch._after_first(
                    self.job,
                    self.request,
                    self.route,
                    self.budget,
                    self.ahead,
                    early,
                    placed,
                    self.ctx,
                )
        except (TimeoutError, DeadlineExceeded):
            limit = self.orch.deadlines.request_s
            error = DeadlineExceeded(f"the request did not finish within {limit:g} s")
        except DisaggError as exc:
            error = exc
        if error is not None or self.inner is None or self.inner.chunks is None:
            log.info("generation phase after the first token failed: %s", error)
            yield sse_data((error or WorkerUnavailable("no generation stream")).body()) + DONE
            return
        async with contextlib.aclosing(self.inner.chunks) as chunks:
            async for chunk in chunks:
                out = self.ahead.strip(chunk)
                if out:
                    yield out

    async def close(self) -> None:
        """The stream is over, or never ran: free what its generation phase did not take."""
        if self.placed is not None:
            self.placed.reservation.finish(False)
            self.placed = None
        if self.early is not None:
            early, self.early = self.early, None
            await early.cancel()
        if not self.started:
            self.started = True
            self.orch._release_context_kv(self.route, self.ctx)
        if self.inner is not None:
            await self.inner.close()


class _Replan(Exception):
    """The generation leg failed in a way only a new context leg can cure."""

    def __init__(self, cause: DisaggError, avoid: str | None) -> None:
        super().__init__(cause.message)
        self.cause, self.avoid = cause, avoid  # the worker the new plan should not use


class _Relay:
    """Relays a worker's SSE bytes unchanged; finishes the reservation exactly once."""

    def __init__(
        self,
        upstream: UpstreamStream,
        reservation: Reservation,
        on_failure: Callable[[], None],
        idle_s: float,
        route: Route,
        offsets: ClockOffsets | None = None,
    ) -> None:
        """`offsets`: the worker ends the stream with its leg timing event, which is taken
        out into the route's generation `LegRecord`."""
        self.upstream, self.reservation = upstream, reservation
        self.on_failure = on_failure  # frees the context KV if the worker never fetched it
        self.idle_s, self.route, self.deadline = idle_s, route, route.deadline
        self.offsets = offsets
        self.ok = False
        self._released = False

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The worker's bytes, passed on whole SSE events at a time: were the stream to
        break mid-event, the client must not get half an event glued to the error event."""
        loop = asyncio.get_running_loop()
        pending = b""
        route = self.route
        try:
            while True:
                left = self.deadline - loop.time()
                route.wait_begins()
                try:
                    chunk = await self.upstream.next_chunk(max(0.0, min(self.idle_s, left)))
                finally:
                    route.wait_ends()
                if not chunk:
                    break
                pending += chunk
                end = _events_end(pending)
                if end:
                    out = self._untimed(pending[:end]) if self.offsets else pending[:end]
                    pending = pending[end:]
                    if out:
                        yield out
            if pending:
                yield self._untimed(pending) if self.offsets else pending
            self.ok = True
            self.reservation.judge(True)
        except (StreamError, TimeoutError) as exc:
            # Bytes may already be with the client: end the stream with an error event.
            log.warning("generation stream from %s broke: %r", self.reservation.worker.url, exc)
            if self.deadline > loop.time():  # not the request's own deadline
                self.reservation.judge(False)
            self._release()
            yield sse_data(_stream_error(exc, self.deadline - loop.time()).body())
            yield DONE

    def _untimed(self, events: bytes) -> bytes:
        """`events` without the worker's timing event, which goes to the leg's record."""
        if EVENT_PREFIX not in events:
            return events
        events, data = split_event(events)
        leg = self.route.legs.get("generation")
        if leg is not None and self.offsets is not None:
            leg.report(data, self.offsets)
        return events

    async def close(self) -> None:
        """The stream is over, relayed or not (the client may have left mid-way)."""
        self.upstream.close()
        self.reservation.finish(self.ok)
        if not self.ok:
            # Cheap when the worker fetched the KV already (the reference worker answers
            # 200 only then); frees it when a worker accepted the leg but never pulled it.
            self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.on_failure()


def _events_end(buf: bytes) -> int:
    """Where the last complete SSE event in `buf` ends (0: none is complete)."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _stream_error(exc: BaseException, left_s: float) -> DisaggError:
    if isinstance(exc, TimeoutError):
        what = "the request deadline passed" if left_s <= 0 else "the stream went idle"
        return GatewayTimeout(f"generation stream timed out: {what}")
    return WorkerUnavailable(f"generation worker stream failed: {type(exc).__name__}")


async def _nothing() -> None:
    return None


async def _iterate(chunks: list[bytes]) -> AsyncGenerator[bytes, None]:
    for chunk in chunks:
        yield chunk
