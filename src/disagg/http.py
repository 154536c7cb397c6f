"""HTTP pieces shared by the orchestrator and the reference worker: error middleware, JSON
responses, serving an aiohttp app until stopped.

Every exception becomes an OpenAI-style error body here, in one place; nothing else formats
error responses. No request logic lives here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

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
    return json_response(exc.body(), status=exc.status)


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


async def serve(
    app: web.Application, host: str, port: int, ready: Callable[[], None] | None = None
) -> None:
    """Serve `app` until SIGINT/SIGTERM or cancellation, then clean up."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, backlog=4096)
    await site.start()
    if ready is not None:
        ready()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run a coroutine on uvloop when available."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported OS
        asyncio.run(main)
        return
    uvloop.run(main)
