"""The reference worker's HTTP API: OpenAI endpoints, context_only / generation_only legs,
the KV endpoints (fetch, release; and for generation_first the push and the pull handoff),
health and stats, and a drain that finishes its legs on SIGTERM. With an internal auth key,
every POST must be signed (see `internal_auth`) and opaque states sealed; GETs stay open.

Handlers parse and answer; the scheduler thread does all model and KV-cache work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from disagg import __version__, http1
from disagg.engine.handoff import Handoff, Handoffs
from disagg.engine.kv_cache import BlockManager, OutOfBlocks, SeqBlocks
from disagg.engine.metrics import CONTENT_TYPE as METRICS_TYPE
from disagg.engine.metrics import EngineMetrics
from disagg.engine.model import Model
from disagg.engine.peer_protocols import kv_transfer_answer, prefill_only
from disagg.engine.requests import Job, build_job
from disagg.engine.scheduler import Event, Scheduler, Sequence
from disagg.engine.simulated import Timing
from disagg.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from disagg.engine.transfer import KVPayload, OpaqueState, StateExpired, TransferError
from disagg.errors import (
    KV_TRANSFER_FAILED,
    DisaggError,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    ServiceUnavailable,
    WorkerUnavailable,
)
from disagg.formats import DONE
from disagg.http import client_tls, error_middleware, json_response
from disagg.internal_auth import Signer, Verifier
from disagg.leg_timing import REQUEST_HEADER as TIMING_REQUEST
from disagg.leg_timing import RESPONSE_HEADER as TIMING_HEADER
from disagg.leg_timing import LegTiming, encode_event, encode_header
from disagg.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
    decode_body,
    usage,
    validate,
)

log = logging.getLogger(__name__)

ROLES = ("context", "generation", "mixed")
# What this worker can do beyond the legs, as its etcd record tells (`disagg.registry`).
CAPABILITIES = ("kv_cache_events", "kv_fetch", "kv_push", "kv_handoff", "perf_metrics")
_KINDS: dict[str, type[Any]] = {
    "completions": CompletionRequest,
    "chat": ChatCompletionRequest,
    "responses": ResponsesRequest,
}


@dataclass(frozen=True)
class WorkerSettings:
    role: str = "mixed"
    model_name: str = "tiny"
    advertise_url: str = "http://127.0.0.1:8001"
    num_blocks: int = 1024
    block_size: int = 16
    kv_lease_s: float = 30.0
    kv_fetch_timeout_s: float = 10.0
    max_batched_tokens: int = 256
    max_body_bytes: int = 10 * 1024 * 1024
    # With a key, every POST must be signed with it, and this worker signs its own calls.
    internal_auth_key: bytes | None = field(default=None, repr=False)
    auth_replay_window_s: float = 60.0
    ssl_ca_file: str | None = None  # CA of the other workers' https URLs (KV fetch, push)
    clock_offset_s: float = 0.0  # tests: shifts the times this worker reports for its legs
    timing: Timing | None = None  # simulated (`--simulate`): received KV takes its transfer time


class Worker:
    def __init__(self, model: Model, tokenizer: Tokenizer, settings: WorkerSettings) -> None:
        if settings.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {settings.role!r}")
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        kv_shape = model.kv_shape(settings.num_blocks, settings.block_size)
        self.blocks = BlockManager(kv_shape, model.config.dtype)
        self.engine_metrics = EngineMetrics(settings.role)
        self.scheduler = Scheduler(
            model,
            tokenizer,
            self.blocks,
            max_batched_tokens=settings.max_batched_tokens,
            lease_s=settings.kv_lease_s,
            clock=self.clock,
            on_step=self.engine_metrics.step,
        )
        self._http: http1.Client | None = None  # KV fetches and pushes to other workers
        key = settings.internal_auth_key
        self.signer = Signer(key) if key else None
        self.verifier = Verifier(key, settings.auth_replay_window_s) if key else None
        self.handoffs = Handoffs()  # generation_first legs waiting for their KV
        # KV moves by kind: fetches served, pushes sent and refused, handoffs taken
        self.transfers = dict.fromkeys(
            ("fetch_served", "pushed", "push_refused", "push_received", "handoff_received"), 0
        )
        self.instance = uuid.uuid4().hex  # tells a restarted worker from the one before
        self.draining = False
        self.drain_listeners: list[Callable[[], None]] = []  # e.g. the etcd registration
        self.keeps_listening = True  # while draining, generation workers still pull KV
        self._legs = 0  # inference requests being handled

    def clock(self) -> float:
        """The wall clock this worker reports its legs' times in."""
        return time.time() + self.settings.clock_offset_s

    # -- drain ------------------------------------------------------------------------------

    def begin_drain(self) -> None:
        """Refuse new legs (503) and say `draining` on /health; KV fetches still work."""
        self.draining = True
        for listener in self.drain_listeners:
            listener()

    def cut(self) -> None:
        """Nothing to do: the legs still running end when the server closes their
        connections, which aborts their sequences."""

    async def drained(self) -> None:
        """Return once no leg runs and no pinned KV waits for its generation worker."""
        while True:
            if self._legs == 0:
                stats = await self.scheduler.call(self.scheduler.stats)
                if stats["pinned"] == 0:
                    return
            await asyncio.sleep(0.05)

    # -- app --------------------------------------------------------------------------------

    def app(self) -> web.Application:
        middlewares = [error_middleware]
        if self.verifier is not None:
            middlewares.append(auth_middleware(self.verifier))
        app = web.Application(middlewares=middlewares, client_max_size=self.settings.max_body_bytes)
        app.add_routes(
            [
                web.post("/v1/completions", self._endpoint("completions")),
                web.post("/v1/chat/completions", self._endpoint("chat")),
                web.post("/v1/responses", self._endpoint("responses")),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/server_info", self.server_info),
                web.get("/stats", self.stats),
                web.get("/metrics", self.metrics),
                web.post("/kv/fetch", self.kv_fetch),
                web.post("/kv/release", self.kv_release),
                web.post("/kv/push", self.kv_push),
                web.post("/kv/handoff", self.kv_handoff),
                web.post("/kv_cache_events", self.kv_cache_events),
            ]
        )
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        self.scheduler.start()
        self._http = http1.Client(client_tls(self.settings.ssl_ca_file))

    async def _stop(self, _app: web.Application) -> None:
        if self._http is not None:
            self._http.close()
        await asyncio.get_running_loop().run_in_executor(None, self.scheduler.stop)

    # -- small endpoints --------------------------------------------------------------------

    async def health(self, _request: web.Request) -> web.Response:
        if self.draining:
            return json_response({"status": "draining", "role": self.settings.role}, status=503)
        return json_response({"status": "ok", "role": self.settings.role})

    async def models(self, _request: web.Request) -> web.Response:
        card = {
            "id": self.settings.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "disagg",
        }
        return json_response({"object": "list", "data": [card]})

    async def server_info(self, _request: web.Request) -> web.Response:
        cfg = self.model.config
        return json_response(
            {
                "role": self.settings.role,
                "model": self.settings.model_name,
                "served_model_name": self.settings.model_name,
                "block_size": self.blocks.block_size,
                "num_blocks": self.blocks.num_blocks,
                "dtype": cfg.dtype,
                "max_position": cfg.max_position,
                "version": __version__,
            }
        )

    async def _stats(self) -> dict[str, Any]:
        stats = await self.scheduler.call(self.scheduler.stats)
        refused = self.verifier.refused if self.verifier is not None else 0
        return {
            "role": self.settings.role,
            **stats,
            "transfers": dict(self.transfers),
            "handoffs": len(self.handoffs),
            "auth_refused": refused,  # requests refused for their internal auth
        }

    async def stats(self, _request: web.Request) -> web.Response:
        return json_response(await self._stats())

    async def metrics(self, _request: web.Request) -> web.Response:
        body = self.engine_metrics.render(await self._stats())
        return web.Response(body=body, headers={"Content-Type": METRICS_TYPE})

    async def kv_fetch(self, request: web.Request) -> web.Response:
        data = decode_body(await request.read())
        rid, start = _int_field(data, "ctx_request_id"), _int_field(data, "start_block", 0)
        try:
            arr, num_tokens = self.scheduler.take_pinned(rid, start)
        except KeyError:
            raise NotFound(
                f"no pinned KV for ctx_request_id {rid} (unknown, fetched or expired)"
            ) from None
        self.transfers["fetch_served"] += 1
        self.engine_metrics.moved_out(arr.nbytes)
        return web.Response(
            body=KVPayload(arr, num_tokens).to_bytes(), content_type="application/octet-stream"
        )

    async def kv_release(self, request: web.Request) -> web.Response:
        rid = _int_field(decode_body(await request.read()), "ctx_request_id")
        released = await self.scheduler.call(lambda: self.scheduler.release_pinned(rid))
        return json_response({"released": released})

    async def kv_cache_events(self, request: web.Request) -> web.Response:
        """KV events after the caller's cursor `since` (polled, like TensorRT-LLM's endpoint).
        On first contact (no `instance`), for another instance, or with a cursor older than
        the retained events, the answer is a snapshot instead: `reset: true`, a `cleared`,
        then one `stored` of every cached block hash, so the caller's index starts over."""
        raw = await request.read()
        data = decode_body(raw) if raw else {}
        since = _int_field(data, "since", 0)
        same = data.get("instance") == self.instance

        def snapshot() -> dict[str, Any]:  # on the scheduler thread: the cache holds still
            bm = self.blocks
            events = [{"type": "cleared"}, {"type": "stored", "block_hashes": bm.cached_hashes()}]
            return {"reset": True, "events": events, "last_event_id": bm.last_event_id}

        # A cursor's events are read at once, not after the scheduler's running step.
        read = self.blocks.read_events(since) if same else None
        if read is not None:
            body = {"reset": False, "events": read[0], "last_event_id": read[1]}
        else:
            body = await self.scheduler.call(snapshot)
        return json_response(
            {"instance": self.instance, "block_size": self.blocks.block_size, **body}
        )

    # -- OpenAI endpoints -------------------------------------------------------------------

    def _endpoint(self, kind: str) -> Any:
        async def handler(request: web.Request) -> web.StreamResponse:
            if self.draining:
                raise ServiceUnavailable("this worker is draining; send the leg elsewhere")
            self._legs += 1
            try:
                return await self._leg(request, kind)
            finally:
                self._legs -= 1

        return handler

    async def _leg(self, request: web.Request, kind: str) -> web.StreamResponse:
        times = {"received": self.clock()} if request.headers.get(TIMING_REQUEST) == "1" else None
        msgpack = request.headers.get("X-TRTLLM-Msgpack") == "1"
        body = decode_body(await request.read(), msgpack=msgpack)
        prefill_only(body, self.settings.role)
        req: Any = validate(body, _KINDS[kind])
        if req.model != self.settings.model_name:
            raise ModelNotFound(req.model)
        job = build_job(
            kind, req, self.tokenizer, self.settings.model_name, self.model.config.max_position
        )
        extra = kv_transfer_answer(body, self.instance, self.settings.advertise_url)
        return await self._run(request, job, times, extra)

    def _check_role(self, request_type: str) -> None:
        role = self.settings.role
        if (request_type == "context_only" and role == "generation") or (
            request_type == "generation_only" and role == "context"
        ):
            raise InvalidRequest(
                f"a {role} worker does not take {request_type} requests",
                param="disaggregated_params",
            )

    async def _run(
        self,
        request: web.Request,
        job: Job,
        times: dict[str, float] | None,
        extra: dict[str, Any] | None = None,
    ) -> web.StreamResponse:
        """`extra`: top-level fields added to a whole answer (see `peer_protocols`)."""
        rtype = job.disagg.request_type
        self._check_role(rtype)
        self._check_capacity(job)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        seq = Sequence(
            seq_id=self.scheduler.next_id(),
            prompt_ids=job.prompt_ids,
            params=job.params,
            sink=lambda ev: _deliver(loop, queue, ev),
            detok=IncrementalDetokenizer(self.tokenizer),
            context_only=rtype == "context_only",
            times=times,
        )
        if job.params.seed is not None:
            # OpenAI seeds are any integer; numpy wants a non-negative one.
            seq.rng = np.random.default_rng(job.params.seed % 2**64)
        if rtype == "generation_only":
            job = await self._generation_start(job, seq)
        finished = False
        self.scheduler.submit(seq)
        try:
            if job.stream and not seq.context_only:
                return await self._stream(request, job, seq, queue)
            text, reason = await self._collect(queue)
            finished = True
            pushed = seq.context_only and reason == "not_finished" and await self._push(job, seq)
            headers = {} if times is None else {TIMING_HEADER: encode_header(self._timing(seq))}
            answer = self._answer(job, seq, text, reason, pushed)
            return json_response({**answer, **extra} if extra else answer, headers=headers)
        finally:
            if not finished:
                self.scheduler.abort(seq)

    async def _generation_start(self, job: Job, seq: Sequence) -> Job:
        """Get a generation_only leg's KV and first tokens into `seq`: pulled from the context
        worker its params name, or (generation_first) from the handoff it waits for."""
        if job.disagg.schedule_style == "generation_first" and not job.disagg.encoded_opaque_state:
            seq.blocks, handoff = await self._await_handoff(job, seq.times)
            first = handoff.first_gen_tokens
            disagg = msgspec.structs.replace(job.disagg, ctx_usage=handoff.ctx_usage)
            job = dataclasses.replace(job, disagg=disagg)
        else:
            first = self._first_tokens(job.disagg.first_gen_tokens)
            seq.blocks, seq.on_arrival = await self._receive_kv(job, seq.times)
        seq.output_ids = list(first)
        seq.num_computed = seq.num_cached_tokens = len(job.prompt_ids)
        return job

    def _first_tokens(self, first: Any) -> list[int]:
        vocab = self.model.config.vocab_size
        if (
            not isinstance(first, list)
            or not first
            or any(not isinstance(t, int) or not 0 <= t < vocab for t in first)
        ):
            raise InvalidRequest(
                "generation_only needs valid first_gen_tokens", param="disaggregated_params"
            )
        return first

    def _check_capacity(self, job: Job) -> None:
        size = self.blocks.block_size
        need = -(-(len(job.prompt_ids) + job.params.max_tokens) // size)
        if need > self.blocks.num_blocks:
            raise InvalidRequest(
                f"the prompt ({len(job.prompt_ids)} tokens) plus max_tokens"
                f" ({job.params.max_tokens}) needs {need} KV blocks; this worker has"
                f" {self.blocks.num_blocks}",
                param="max_tokens",
            )

    async def _collect(self, queue: asyncio.Queue[Event]) -> tuple[str, str]:
        parts: list[str] = []
        while True:
            ev = await queue.get()
            parts.append(ev.text)
            if ev.finish_reason is not None:
                if ev.error:
                    raise ServiceUnavailable(f"engine error: {ev.error}")
                return "".join(parts), ev.finish_reason

    def _usage(self, job: Job, seq: Sequence) -> dict[str, Any]:
        ctx = job.disagg.ctx_usage
        if ctx and job.disagg.request_type == "generation_only":
            details = ctx.get("prompt_tokens_details") or {}
            return usage(
                int(ctx.get("prompt_tokens", len(job.prompt_ids))),
                len(seq.output_ids),
                int(details.get("cached_tokens", 0)),
            )
        return usage(len(job.prompt_ids), len(seq.output_ids), seq.num_cached_tokens)

    def _timing(self, seq: Sequence) -> LegTiming:
        """The leg's report; `responded` is now (just before its answer goes out) unless a
        stream noted when its headers went out."""
        times = dict(seq.times or {})
        return LegTiming(
            received=times.pop("received"),
            responded=times.pop("responded", 0.0) or self.clock(),
            kv_transfer_bytes=int(times.pop("kv_transfer_bytes", 0)),
            prompt_tokens=len(seq.prompt_ids),
            cached_tokens=seq.num_cached_tokens,
            **times,
        )

    def _answer(
        self, job: Job, seq: Sequence, text: str, reason: str, pushed: bool = False
    ) -> dict[str, Any]:
        body = job.shape.response(text, reason, self._usage(job, seq))
        if not seq.context_only:
            return body
        params: dict[str, Any] = {
            "request_type": "context_only",
            "first_gen_tokens": seq.output_ids,
            "draft_tokens": None,
            "disagg_request_id": job.disagg.disagg_request_id,
        }
        if pushed:
            params["kv_pushed"] = True  # the generation worker holds the KV; nothing is pinned
        elif reason == "not_finished":
            params["ctx_request_id"] = seq.seq_id
            key = self.settings.internal_auth_key
            params["encoded_opaque_state"] = self._opaque_state(seq).encode(key)
        if "choices" in body:
            body["choices"][0]["disaggregated_params"] = params
        else:
            body["disaggregated_params"] = params
        body["prompt_token_ids"] = job.prompt_ids
        return body

    def _opaque_state(self, seq: Sequence) -> OpaqueState:
        # The scheduler pinned the KV just now, for the lease from then on.
        expires = time.time() + self.settings.kv_lease_s
        return self._layout_state(seq.seq_id, len(seq.prompt_ids), expires)

    def _layout_state(
        self, ctx_request_id: int, num_tokens: int, expires_at: float = 0.0
    ) -> OpaqueState:
        cfg = self.model.config
        return OpaqueState(
            self.settings.advertise_url,
            ctx_request_id,
            num_tokens,
            self.blocks.block_size,
            cfg.dtype,
            (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim),
            expires_at,
        )

    def _decode_state(self, encoded: str, param: str) -> OpaqueState:
        """An opaque state checked before anything connects where it says: sealed with this
        cluster's key (when it has one; else `Unauthorized`), well formed, not expired."""
        try:
            return OpaqueState.decode(encoded, self.settings.internal_auth_key)
        except StateExpired as exc:
            # As if the KV were fetched after the lease: the orchestrator starts over.
            raise WorkerUnavailable(str(exc), code=KV_TRANSFER_FAILED) from None
        except TransferError as exc:
            raise InvalidRequest(str(exc), param=param) from None

    async def _post(self, url: str, body: bytes, content_type: str) -> tuple[int, bytes]:
        """POST to another worker (signed when this cluster has a key) within the KV fetch
        timeout: the status and the whole body. http1.HTTPError or TimeoutError when the
        exchange fails."""
        assert self._http is not None
        headers = self._signed(url, body, content_type)
        async with asyncio.timeout(self.settings.kv_fetch_timeout_s):
            resp = await self._http.request("POST", url, body, headers)
            try:
                return resp.status, await resp.read()
            finally:
                resp.release()

    def _signed(self, url: str, body: bytes, content_type: str) -> dict[str, str]:
        """Headers for a call to another worker, signed when this cluster has a key."""
        headers = {"Content-Type": content_type}
        if self.signer is not None:
            headers.update(self.signer.for_url("POST", url, body))
        return headers

    async def _stream(
        self, request: web.Request, job: Job, seq: Sequence, queue: asyncio.Queue[Event]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        if seq.times is not None:  # the exchange the orchestrator times ends with the headers
            seq.times["responded"] = self.clock()
        await resp.prepare(request)
        try:
            await self._relay_events(resp, job, seq, queue)
        except ConnectionResetError:  # the caller left; the leg's sequence is aborted
            log.info("the caller of sequence %d left mid-stream", seq.seq_id)
        return resp

    async def _relay_events(
        self,
        resp: web.StreamResponse,
        job: Job,
        seq: Sequence,
        queue: asyncio.Queue[Event],
    ) -> None:
        shape = job.shape
        for chunk in shape.stream_start():
            await resp.write(chunk)
        text: list[str] = []
        while True:
            ev = await queue.get()
            text.append(ev.text)
            if ev.text:
                await resp.write(shape.stream_delta(ev.text))
            if ev.finish_reason is None:
                continue
            if ev.error:
                await resp.write(b"data: " + _error_json(ev.error) + b"\n\n")
            else:
                use = (
                    self._usage(job, seq)
                    if job.include_usage or job.kind == "responses"
                    else (None)
                )
                for chunk in shape.stream_end("".join(text), ev.finish_reason, use):
                    await resp.write(chunk)
            if seq.times is not None:
                await resp.write(encode_event(self._timing(seq)))
            await resp.write(DONE)
            await resp.write_eof()
            return

    # -- KV transfer ------------------------------------------------------------------------

    async def _receive_kv(
        self, job: Job, times: dict[str, float] | None
    ) -> tuple[SeqBlocks, Callable[[], None]]:
        """Allocate a generation_only leg's blocks and pull their KV; returns the blocks and
        what stores the KV in them, for the sequence to run as it reaches the scheduler (the
        blocks are the sequence's from then on, freed when it ends)."""
        state = self._check_state(job)
        blocks = await self._allocate(job)
        try:
            start = blocks.num_cached_tokens // self.blocks.block_size
            began = self._transfer_began(times)
            payload = await self._fetch(state, start)
            store = await self._storer(job, blocks, start, payload)

            def arrive() -> None:
                store()
                self._transfer_ended(times, began, payload)

            return blocks, arrive
        except BaseException:
            await asyncio.shield(self.scheduler.call(lambda: self.blocks.free(blocks)))
            raise

    async def _allocate(self, job: Job) -> SeqBlocks:
        """Blocks for a generation leg's prompt; its cached prefix needs no transfer. When
        the cache is full the leg waits for running sequences to free blocks (it holds
        none meanwhile), up to the KV fetch timeout; then 503."""
        deadline = time.monotonic() + self.settings.kv_fetch_timeout_s
        pause = 0.005
        while True:
            try:
                return await self.scheduler.call(
                    lambda: self.blocks.allocate(job.prompt_ids), undo=self.blocks.free
                )
            except OutOfBlocks:
                if time.monotonic() + pause > deadline:
                    raise ServiceUnavailable("generation worker is out of KV blocks") from None
            await asyncio.sleep(pause)
            pause = min(2 * pause, 0.1)

    def _transfer_began(self, times: dict[str, float] | None) -> float:
        if times is not None:
            times["kv_transfer_start"] = self.clock()
        return time.perf_counter()

    def _transfer_ended(
        self, times: dict[str, float] | None, began: float, payload: KVPayload
    ) -> None:
        """The KV is stored: count it, and note it in the leg's timing when asked."""
        nbytes = payload.data.nbytes
        self.engine_metrics.moved_in(nbytes, time.perf_counter() - began)
        if times is not None:
            times["kv_transfer_end"] = self.clock()
            times["kv_transfer_bytes"] = nbytes

    async def _storer(
        self, job: Job, blocks: SeqBlocks, start: int, payload: KVPayload
    ) -> Callable[[], None]:
        """Check the transferred KV of the blocks from `start` on (the rest was cached) and
        return what stores it, to run on the scheduler thread; it cannot fail on the data."""
        table = blocks.block_table[start:]
        kv = self.blocks.kv
        want = (*kv.shape[:2], len(table), *kv.shape[3:])
        if (
            tuple(payload.data.shape) != want
            or payload.data.dtype != kv.dtype
            or payload.num_tokens != len(job.prompt_ids)
        ):
            raise WorkerUnavailable(
                "KV transfer returned the wrong number of blocks/tokens", code=KV_TRANSFER_FAILED
            )

        def store() -> None:
            self.blocks.write_blocks(table, payload.data)
            self.blocks.commit(blocks, len(job.prompt_ids))

        timing = self.settings.timing
        moved = len(job.prompt_ids) - start * self.blocks.block_size
        if timing is not None and (delay := timing.transfer_s(moved)) > 0:
            await asyncio.sleep(delay)  # the real model's KV would take that long to arrive
        return store

    def _check_state(self, job: Job) -> OpaqueState:
        if not job.disagg.encoded_opaque_state:
            raise InvalidRequest(
                "generation_only needs encoded_opaque_state", param="disaggregated_params"
            )
        state = self._decode_state(job.disagg.encoded_opaque_state, "disaggregated_params")
        return self._check_layout(state, job)

    def _check_layout(self, state: OpaqueState, job: Job) -> OpaqueState:
        mine = self._layout_state(0, 0)
        if (state.block_size, state.dtype, tuple(state.layout)) != (
            mine.block_size,
            mine.dtype,
            mine.layout,
        ):
            raise InvalidRequest(
                "the context worker's KV layout does not match this worker's",
                param="disaggregated_params",
            )
        if state.num_tokens != len(job.prompt_ids):
            raise InvalidRequest("prompt_token_ids do not match the transferred KV", param="prompt")
        return state

    async def _fetch(self, state: OpaqueState, start_block: int) -> KVPayload:
        url = state.endpoint.rstrip("/") + "/kv/fetch"
        body = msgspec.json.encode(
            {"ctx_request_id": state.ctx_request_id, "start_block": start_block}
        )
        try:
            status, raw = await self._post(url, body, "application/json")
        except (http1.HTTPError, TimeoutError) as exc:
            raise WorkerUnavailable(
                f"KV fetch from the context worker failed: {exc!r}", code=KV_TRANSFER_FAILED
            ) from None
        if status != 200:
            raise WorkerUnavailable(
                f"KV fetch from the context worker failed ({status}): "
                + raw[:300].decode(errors="replace"),
                code=KV_TRANSFER_FAILED,
            )
        try:
            return KVPayload.from_bytes(raw, state)
        except TransferError as exc:
            raise WorkerUnavailable(
                f"bad KV payload from the context worker: {exc}", code=KV_TRANSFER_FAILED
            ) from None

    # -- generation_first --------------------------------------------------------------------

    async def _await_handoff(
        self, job: Job, times: dict[str, float] | None
    ) -> tuple[SeqBlocks, Handoff]:
        """A generation_first leg: allocate its blocks now (its cached prefix is then safe),
        wait up to the KV lease for its handoff, and store the KV it brings or names."""
        rid = job.disagg.disagg_request_id
        if not isinstance(rid, int):
            raise InvalidRequest(
                "a generation_first leg needs an integer disagg_request_id",
                param="disaggregated_params",
            )
        waiting = self.handoffs.open(rid)
        try:
            blocks = await self._allocate(job)
            try:
                try:
                    async with asyncio.timeout(self.settings.kv_lease_s):
                        handoff = await waiting
                except TimeoutError:
                    raise ServiceUnavailable(
                        f"no context leg handed its KV over within {self.settings.kv_lease_s:g} s"
                    ) from None
                await self._store_handoff(job, blocks, handoff, times)
                return blocks, handoff
            except BaseException:
                await asyncio.shield(self.scheduler.call(lambda: self.blocks.free(blocks)))
                raise
        finally:
            self.handoffs.close(rid)

    async def _store_handoff(
        self, job: Job, blocks: SeqBlocks, handoff: Handoff, times: dict[str, float] | None
    ) -> None:
        """Store the handoff's KV past this worker's cached prefix (pushed: from the payload;
        else pulled from where its state says); tell the one who handed off how it went."""
        try:
            if handoff.prompt_token_ids != job.prompt_ids:
                raise InvalidRequest(
                    "the context leg computed another prompt than this generation leg's",
                    param="prompt",
                )
            start = blocks.num_cached_tokens // self.blocks.block_size
            # pushed: the transfer began when the push arrived
            began = handoff.arrived if handoff.payload is not None else time.perf_counter()
            if times is not None:
                times["kv_transfer_start"] = self.clock() - (time.perf_counter() - began)
            if handoff.payload is not None:
                pushed = handoff.payload
                payload = KVPayload(pushed.data[:, :, start:], pushed.num_tokens)
            else:
                assert handoff.state is not None
                payload = await self._fetch(self._check_layout(handoff.state, job), start)
            await self.scheduler.call(await self._storer(job, blocks, start, payload))
            self._transfer_ended(times, began, payload)
        except BaseException as exc:
            if not handoff.stored.done():
                handoff.stored.set_exception(
                    exc
                    if isinstance(exc, Exception)
                    else ServiceUnavailable("the generation leg ended before it stored the KV")
                )
                handoff.stored.exception()  # retrieved: its deliverer may have stopped waiting
            raise
        handoff.stored.set_result(None)

    async def _push(self, job: Job, seq: Sequence) -> bool:
        """generation_first, push variant: send the pinned KV (and the first tokens) to the
        generation worker whose leg waits for it, and free it once that worker stored it.
        False, with the KV still pinned for a pull, when there is no target or it refused."""
        target, rid = job.disagg.gen_info_endpoint, job.disagg.gen_request_id
        if not target or rid is None:
            return False
        sid = seq.seq_id

        def read() -> KVPayload | None:
            entry = self.scheduler.pinned.get(sid)
            if entry is None:
                return None
            blocks = entry[0]
            return KVPayload(self.blocks.read_blocks(blocks.block_table), len(blocks.token_ids))

        try:
            kv = await self.scheduler.call(read)
            if kv is None:
                return False
            meta = {
                "disagg_request_id": rid,
                "first_gen_tokens": seq.output_ids,
                "prompt_token_ids": job.prompt_ids,
                "ctx_usage": self._usage(job, seq),
            }
            body = KVPayload(kv.data, kv.num_tokens, meta).to_bytes()
            self.engine_metrics.moved_out(kv.data.nbytes)
            url = target.rstrip("/") + "/kv/push"
            status, raw = await self._post(url, body, "application/octet-stream")
            if status != 200:
                why = raw[:200].decode(errors="replace")
                log.info("KV push of sequence %d refused (%d): %s", sid, status, why)
                self.transfers["push_refused"] += 1
                return False
        except (http1.HTTPError, TimeoutError) as exc:
            log.info("KV push of sequence %d failed (%r); it stays pinned for a pull", sid, exc)
            self.transfers["push_refused"] += 1
            return False
        except BaseException:  # cancelled: nobody will learn where the KV is
            await asyncio.shield(self.scheduler.call(lambda: self.scheduler.release_pinned(sid)))
            raise
        await self.scheduler.call(lambda: self.scheduler.release_pinned(sid))
        self.transfers["pushed"] += 1
        return True

    async def kv_push(self, request: web.Request) -> web.Response:
        """A context worker pushes a generation_first leg's KV: the body is a KV payload
        whose header's `meta` carries the handoff (see `_push`)."""
        arrived = time.perf_counter()
        try:
            payload = KVPayload.from_bytes(await request.read(), self._layout_state(0, 0))
        except TransferError as exc:
            raise InvalidRequest(str(exc), param="body") from None
        handoff = self._handoff(payload.meta, payload=payload, arrived=arrived)
        await self._hand_over(payload.meta, handoff)
        self.transfers["push_received"] += 1
        return json_response({"stored": True})

    async def kv_handoff(self, request: web.Request) -> web.Response:
        """The orchestrator names where a generation_first leg's KV is (pull variant):
        `{disagg_request_id, first_gen_tokens, prompt_token_ids, encoded_opaque_state,
        ctx_usage}`. Answered once the leg pulled and stored it."""
        msgpack = request.headers.get("X-TRTLLM-Msgpack") == "1"
        data = decode_body(await request.read(), msgpack=msgpack)
        encoded = data.get("encoded_opaque_state")
        if not isinstance(encoded, str):
            raise InvalidRequest("encoded_opaque_state must be a string", param="body")
        state = self._decode_state(encoded, "encoded_opaque_state")
        await self._hand_over(data, self._handoff(data, state=state))
        self.transfers["handoff_received"] += 1
        return json_response({"stored": True})

    def _handoff(self, data: dict[str, Any], **kv: Any) -> Handoff:
        prompt, usage_ = data.get("prompt_token_ids"), data.get("ctx_usage")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise InvalidRequest("prompt_token_ids must be a list of integers", param="body")
        if usage_ is not None and not isinstance(usage_, dict):
            raise InvalidRequest("ctx_usage must be an object", param="body")
        first = self._first_tokens(data.get("first_gen_tokens"))
        return Handoff(list(first), list(prompt), usage_, **kv)

    async def _hand_over(self, data: dict[str, Any], handoff: Handoff) -> None:
        rid = _int_field(data, "disagg_request_id")
        try:
            stored = await self.handoffs.deliver(rid, handoff, self.settings.kv_fetch_timeout_s)
        except TimeoutError:
            raise WorkerUnavailable(
                f"the leg waiting for {rid} did not store its KV in time", code=KV_TRANSFER_FAILED
            ) from None
        if not stored:
            raise NotFound(f"no generation_first leg waits for disagg_request_id {rid}")


_OPEN_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def auth_middleware(verifier: Verifier) -> Any:
    """Refuse (401) any request but a GET that is not signed with the cluster's key: every
    leg, KV move and event poll. Checked over the raw body before anything parses it."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method not in _OPEN_METHODS:
            body = await request.read()  # kept by aiohttp for the handler
            verifier.check(request.method, request.raw_path, request.headers, body)
        response: web.StreamResponse = await handler(request)
        return response

    return check


def _int_field(data: dict[str, Any], name: str, default: int | None = None) -> int:
    value = data.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequest(f"`{name}` must be a non-negative integer", param=name)
    return value


def _error_json(message: str) -> bytes:
    import msgspec

    return msgspec.json.encode(DisaggError(message).body())


def _deliver(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Event], ev: Event) -> None:
    """Called on the scheduler thread: hand an event to the request's coroutine."""
    loop.call_soon_threadsafe(queue.put_nowait, ev)
