"""The client to workers: pooled keep-alive connections (`http1`), msgpack request bodies,
JSON answers and streamed SSE bytes relayed as they arrive.

Upstream sends and receives; it never decides placement. Worker error statuses become
`UpstreamError`, broken connections `WorkerUnavailable`. With a `Signer`, every POST is
signed (see `internal_auth`), and legs naming their KV carry TensorRT-LLM's header too.
With `ClockOffsets`, every leg asks its worker for its timing (see `leg_timing`), which goes
into the leg's `LegRecord` with the time its answer's first byte came.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Any

import msgspec

from disagg import http1
from disagg.clock_offsets import ClockOffsets
from disagg.errors import (
    DisaggError,
    GatewayTimeout,
    InvalidRequest,
    UpstreamError,
    WorkerUnavailable,
)
from disagg.internal_auth import Signer
from disagg.leg_timing import REQUEST_HEADER as TIMING_REQUEST
from disagg.leg_timing import RESPONSE_HEADER as TIMING_HEADER
from disagg.perf_records import LegRecord
from disagg.protocol import encode_msgpack

log = logging.getLogger(__name__)

HEADERS = {"Content-Type": "application/json", "X-TRTLLM-Msgpack": "1"}
RELEASE_TIMEOUT_S = 10.0  # a busy worker's scheduler may take a while; nobody waits for it

# What `UpstreamStream.next_chunk` raises when the stream breaks (besides TimeoutError).
StreamError = http1.HTTPError


def worker_error(status: int, raw: bytes) -> DisaggError:
    """The worker's error status, message, `param` and `code`, as the client will see them.
    A 401 is the cluster's fault (keys that differ), not the client's: a worker failure."""
    message, param, code = "", None, None
    try:
        data = msgspec.json.decode(raw)
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict):
            message = str(err.get("message") or "")
            param = err.get("param") if isinstance(err.get("param"), str) else None
            code = err.get("code") if isinstance(err.get("code"), str) else None
        elif isinstance(err, str):
            message = err
    except msgspec.DecodeError:
        pass
    message = message or raw[:500].decode(errors="replace").strip()
    if status == 401:
        return WorkerUnavailable(
            "a worker refused the orchestrator's internal authentication (is"
            f" internal_auth_key the same on the orchestrator and the workers?): {message}",
            code="internal_auth_failed",
        )
    return UpstreamError(
        status, message or f"worker answered HTTP {status}", param=param, code=code
    )


def connection_error(url: str, exc: http1.HTTPError) -> WorkerUnavailable:
    """Classify a transport error: connecting failed (nothing sent), the connection dropped
    before the answer's head (transient: a retry usually cures it), or later, or garbage."""
    if isinstance(exc, http1.ConnectError):
        return WorkerUnavailable(f"cannot connect to worker {url}", sent=False)
    if isinstance(exc, http1.MalformedResponse):
        return WorkerUnavailable(f"worker {url} sent a malformed answer")
    transient = isinstance(exc, http1.ServerDisconnectedError)
    return WorkerUnavailable(f"worker {url} failed: {type(exc).__name__}", transient=transient)


class UpstreamStream:
    """An open streamed answer from a worker; read `next_chunk` until b"", then `close()`."""

    def __init__(self, resp: http1.Response) -> None:
        self._resp = resp

    async def next_chunk(self, timeout_s: float) -> bytes:
        """The next bytes as they arrive (b"" at the end); TimeoutError after `timeout_s`,
        `StreamError` when the stream breaks."""
        data = self._resp.read_nowait()
        if data is not None:
            return data
        async with asyncio.timeout(timeout_s):
            return await self._resp.read_any()

    def close(self) -> None:
        # An unfinished stream drops its connection, which tells the worker to abort the
        # sequence; a finished one goes back to the pool.
        self._resp.release()


class WorkerClient:
    def __init__(
        self,
        connect_timeout_s: float = 5.0,
        signer: Signer | None = None,
        tls: ssl.SSLContext | bool = True,
        offsets: ClockOffsets | None = None,
    ) -> None:
        """`tls`: how https:// workers are verified (a context with the cluster's CA);
        `offsets`: ask workers for leg timing, and estimate their clocks with it."""
        self._http = http1.Client(tls, connect_timeout_s)
        self._signer = signer
        self.offsets = offsets
        self._releases: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        if self._releases:  # let the last KV releases land (bounded by their timeout)
            await asyncio.wait(set(self._releases), timeout=RELEASE_TIMEOUT_S)
        self._http.close()

    def _body(
        self, url: str, payload: dict[str, Any], trace: dict[str, str] | None = None
    ) -> tuple[bytes, dict[str, str]]:
        """A leg's msgpack body and its headers, signed when the cluster has a key. The body
        comes from the client: an integer past msgpack's 64 bits is the client's error."""
        try:
            body = encode_msgpack(payload)
        except OverflowError:
            raise InvalidRequest(
                "a number in the request is out of range (integers must fit in 64 bits)"
            ) from None
        headers = HEADERS if self.offsets is None else {**HEADERS, TIMING_REQUEST: "1"}
        if trace:
            headers = {**headers, **trace}
        if self._signer is None:
            return body, headers
        headers = {**headers, **self._signer.for_url("POST", url, body)}
        headers.update(self._signer.trtllm(payload.get("disaggregated_params")))
        return body, headers

    def _first_byte(self, resp: http1.Response, record: LegRecord | None) -> None:
        if record is not None:
            record.first_byte = time.monotonic()
            if self.offsets is not None and resp.status == 200:
                record.report(resp.header(TIMING_HEADER), self.offsets)

    async def post(
        self,
        url: str,
        path: str,
        payload: dict[str, Any],
        timeout_s: float,
        record: LegRecord | None = None,
        trace: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """POST a leg and return its JSON answer within `timeout_s`; `trace`: the headers
        that carry its trace context."""
        body, headers = self._body(url + path, payload, trace)
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self._http.request("POST", url + path, body, headers)
                try:
                    self._first_byte(resp, record)
                    raw = await resp.read()
                finally:
                    resp.release()
            if resp.status != 200:
                raise worker_error(resp.status, raw)
            data = msgspec.json.decode(raw)
        except DisaggError:
            raise
        except TimeoutError:
            raise GatewayTimeout(f"worker {url} did not answer in time") from None
        except http1.HTTPError as exc:
            raise connection_error(url, exc) from None
        except msgspec.DecodeError:
            raise WorkerUnavailable(f"worker {url} sent a malformed answer") from None
        if not isinstance(data, dict):
            raise WorkerUnavailable(f"worker {url} sent a malformed answer")
        return data

    async def open_stream(
        self,
        url: str,
        path: str,
        payload: dict[str, Any],
        first_byte_s: float,
        record: LegRecord | None = None,
        trace: dict[str, str] | None = None,
    ) -> UpstreamStream:
        """POST a streamed leg; returns once the worker accepted it (status 200), which must
        happen within `first_byte_s`. Chunk deadlines are the reader's business."""
        body, headers = self._body(url + path, payload, trace)
        try:
            async with asyncio.timeout(first_byte_s):
                resp = await self._http.request("POST", url + path, body, headers)
        except TimeoutError:
            raise GatewayTimeout(f"worker {url} did not answer in time") from None
        except http1.HTTPError as exc:
            raise connection_error(url, exc) from None
        if record is not None:
            record.first_byte = time.monotonic()
        if resp.status != 200:
            try:
                raw = await resp.read()
            except http1.HTTPError:
                raw = b""
            finally:
                resp.release()
            raise worker_error(resp.status, raw)
        return UpstreamStream(resp)

    def release_kv_soon(self, url: str, ctx_request_id: int) -> None:
        """Start `release_kv` in the background (the client owns the task and waits for it
        on close), so that no request waits for a busy context worker to answer."""
        task = asyncio.create_task(self.release_kv(url, ctx_request_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def release_kv(self, url: str, ctx_request_id: int) -> None:
        """Best effort: ask a context worker to drop pinned KV (workers without the endpoint
        free it at lease expiry)."""
        body = msgspec.json.encode({"ctx_request_id": ctx_request_id})
        headers = {"Content-Type": "application/json"}
        if self._signer is not None:
            headers.update(self._signer.for_url("POST", url + "/kv/release", body))
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                resp = await self._http.request("POST", url + "/kv/release", body, headers)
                try:
                    await resp.read()
                finally:
                    resp.release()
        except (http1.HTTPError, TimeoutError) as exc:
            log.warning("could not release KV %d on %s: %r", ctx_request_id, url, exc)
