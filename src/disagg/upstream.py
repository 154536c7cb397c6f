"""The client to workers: one pooled aiohttp session, msgpack request bodies, JSON answers
and streamed SSE bytes relayed as they arrive.

Upstream sends and receives; it never decides placement. Worker error statuses become
`UpstreamError`, broken connections `WorkerUnavailable`. With a `Signer`, every POST is
signed (see `internal_auth`), and legs naming their KV carry TensorRT-LLM's header too.
With `ClockOffsets`, every leg asks its worker for its timing (see `leg_timing`), which goes
into the leg's `LegRecord` with the time its answer's first byte came.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import ssl
import time
from typing import Any

import aiohttp
import msgspec

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


_TRANSIENT_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED})


def connection_error(url: str, exc: aiohttp.ClientError) -> WorkerUnavailable:
    """Classify a client library error; resets may arrive wrapped in other error types."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return WorkerUnavailable(f"cannot connect to worker {url}", sent=False)
    transient = isinstance(exc, aiohttp.ServerDisconnectedError | ConnectionResetError)
    cause: BaseException | None = exc
    while cause is not None and not transient:
        transient = isinstance(cause, ConnectionResetError | BrokenPipeError) or (
            isinstance(cause, OSError) and cause.errno in _TRANSIENT_ERRNOS
        )
        cause = cause.__cause__ or cause.__context__
    return WorkerUnavailable(f"worker {url} failed: {type(exc).__name__}", transient=transient)


class UpstreamStream:
    """An open streamed answer from a worker; iterate `chunks()`, then `close()`."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp

    async def next_chunk(self, timeout_s: float) -> bytes:
        """The next bytes as they arrive (b"" at the end); TimeoutError after `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            return await self._resp.content.readany()

    def close(self) -> None:
        # close() (not release()) so an unfinished stream drops the connection, which tells
        # the worker to abort the sequence.
        if not self._resp.content.at_eof():
            self._resp.close()
        else:
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
        self._connect_s, self._tls = connect_timeout_s, tls
        self._signer = signer
        self.offsets = offsets
        # A busy worker's scheduler may take a while to answer; nobody waits for it.
        self._release_timeout = aiohttp.ClientTimeout(total=10.0, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._releases: set[asyncio.Task[None]] = set()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0, keepalive_timeout=30, enable_cleanup_closed=True, ssl=self._tls
            )
            # No cookies between the orchestrator and its workers: skip the jar's work on
            # every answer.
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def close(self) -> None:
        if self._releases:  # let the last KV releases land (bounded by their timeout)
            await asyncio.wait(set(self._releases), timeout=10.0)
        if self._session is not None:
            await self._session.close()
            self._session = None

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
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._connect_s)
        body, headers = self._body(url + path, payload, trace)
        try:
            async with self.session.post(
                url + path, data=body, headers=headers, timeout=timeout
            ) as resp:
                if record is not None:
                    record.first_byte = time.monotonic()
                    if self.offsets is not None and resp.status == 200:
                        record.report(resp.headers.get(TIMING_HEADER), self.offsets)
                raw = await resp.read()
                if resp.status != 200:
                    raise worker_error(resp.status, raw)
            data = msgspec.json.decode(raw)
        except DisaggError:
            raise
        except TimeoutError:
            raise GatewayTimeout(f"worker {url} did not answer in time") from None
        except aiohttp.ClientError as exc:
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
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_s)
        body, headers = self._body(url + path, payload, trace)
        try:
            async with asyncio.timeout(first_byte_s):
                resp = await self.session.post(
                    url + path, data=body, headers=headers, timeout=timeout
                )
        except TimeoutError:
            raise GatewayTimeout(f"worker {url} did not answer in time") from None
        except aiohttp.ClientError as exc:
            raise connection_error(url, exc) from None
        if record is not None:
            record.first_byte = time.monotonic()
        if resp.status != 200:
            try:
                raw = await resp.read()
            except aiohttp.ClientError:
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
            async with self.session.post(
                url + "/kv/release", data=body, headers=headers, timeout=self._release_timeout
            ) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("could not release KV %d on %s: %r", ctx_request_id, url, exc)
