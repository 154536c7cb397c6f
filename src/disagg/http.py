"""HTTP pieces shared by the orchestrator and the reference worker: error middleware, JSON
responses, serving an aiohttp app until stopped, with a graceful drain on SIGTERM.

Every exception becomes an OpenAI-style error body here, in one place; nothing else formats
error responses. No request logic lives here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

import msgspec
from aiohttp import web

from disagg.errors import DisaggError, NotFound, PayloadTooLarge

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(
    obj: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=_json.encode(obj), status=status, headers=headers, content_type="application/json"
    )


def error_response(exc: DisaggError) -> web.Response:
    return json_response(exc.body(), status=exc.status, headers=exc.headers() or None)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except DisaggError as exc:
        if exc.status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.path, exc.status, exc.message)
        return error_response(exc)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(PayloadTooLarge(f"Request body too large: {exc.text}"))
    except web.HTTPNotFound:
        return error_response(NotFound(f"No route for {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed:
        err = DisaggError(f"Method {request.method} not allowed for {request.path}")
        err.status, err.type = 405, "invalid_request_error"
        return error_response(err)
    except web.HTTPException:
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(DisaggError("Internal server error"))


class Drainable(Protocol):
    """A server that can finish its work before it closes."""

    # Whether it keeps its socket open while draining: a worker must, to hand pinned KV to
    # generation workers; the orchestrator stops taking connections at once.
    keeps_listening: bool

    def begin_drain(self) -> None:
        """Take no new work from now on (and say so on /health)."""
        ...

    async def drained(self) -> None:
        """Return once no work is in flight."""
        ...

    def cut(self) -> None:
        """The drain deadline passed: end what still runs, with a reason where it can."""
        ...


async def serve(
    app: web.Application,
    host: str,
    port: int,
    ready: Callable[[], None] | None = None,
    drain: Drainable | None = None,
    drain_s: float = 30.0,
    ssl_context: ssl.SSLContext | None = None,
) -> None:
    """Serve `app` until SIGINT/SIGTERM or cancellation, then clean up. With `drain`, the
    first signal drains for up to `drain_s` (a second one cuts that short); what is still
    running afterwards is cancelled. With `ssl_context`, over TLS."""
    # After the drain, what still runs gets 1 s to end on its own, then 1 s once cancelled.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(
        runner, host, port, reuse_address=True, backlog=4096, ssl_context=ssl_context
    )
    await site.start()
    if ready is not None:
        ready()
    stop, force = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal)
    try:
        await stop.wait()
        if drain is not None:
            await _drain(drain, site, drain_s, force)
    finally:
        await runner.cleanup()


async def _drain(drain: Drainable, site: web.TCPSite, drain_s: float, force: asyncio.Event) -> None:
    drain.begin_drain()
    if not drain.keeps_listening:
        await site.stop()
    log.info("draining: finishing in-flight work for up to %g s", drain_s)
    done = asyncio.ensure_future(drain.drained())
    forced = asyncio.ensure_future(force.wait())
    try:
        await asyncio.wait([done, forced], timeout=drain_s, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            log.warning("drain ended with work still in flight; it is cut now")
            drain.cut()
            await asyncio.wait([done], timeout=1.0)
    finally:
        for task in (done, forced):
            task.cancel()


def server_tls(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    """A TLS context for serving with this certificate chain and key (None: plain HTTP)."""
    if certfile is None or keyfile is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    return context


def client_tls(cafile: str | None) -> ssl.SSLContext | bool:
    """How to verify https:// peers: against `cafile`'s CAs, else the system's (True)."""
    return ssl.create_default_context(cafile=cafile) if cafile else True


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run a coroutine on uvloop when available."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported OS
        asyncio.run(main)
        return
    uvloop.run(main)
