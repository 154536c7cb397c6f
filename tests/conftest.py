"""Fixtures that start real disagg processes on loopback and stop them afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import yaml
from aiohttp import web

from disagg.demo import Processes, free_port

Procs = Processes

# For clusters whose broken worker must take every attempt (tests that count attempts or
# check one worker's error): its circuit breaker would otherwise open. Breakers have tests
# of their own.
NO_BREAKER: dict[str, Any] = {"breaker_failures": 1000}


def wait_healthy(url: str, procs: Procs, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs.procs:
            assert p.poll() is None, f"{p.args!r} exited with {p.returncode}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


@dataclass
class Cluster:
    url: str
    context_urls: list[str]
    generation_urls: list[str]

    @property
    def worker_urls(self) -> list[str]:
        return self.context_urls + self.generation_urls


def start_cluster(
    procs: Procs,
    tmp: Path,
    n_ctx: int,
    n_gen: int,
    *,
    extra_ctx: Sequence[str] = (),
    extra_gen: Sequence[str] = (),
    worker_args: Sequence[str] = (),
    ctx_args: Sequence[str] = (),
    gen_args: Sequence[str] = (),
    **extra: object,
) -> Cluster:
    """Reference workers (plus the `extra_*` URLs, first in their pool) behind an
    orchestrator; `worker_args` go to every worker's command line (`ctx_args`, `gen_args`
    to one pool's); `extra` adds or overrides top-level config keys."""
    ctx = [free_port() for _ in range(n_ctx)]
    gen = [free_port() for _ in range(n_gen)]
    port = free_port()
    for p in ctx:
        procs.start("worker", "--role", "context", "--port", str(p), *worker_args, *ctx_args)
    for p in gen:
        procs.start("worker", "--role", "generation", "--port", str(p), *worker_args, *gen_args)
    config = {
        "hostname": "127.0.0.1",
        "port": port,
        "context_servers": {"urls": [*extra_ctx, *(f"127.0.0.1:{p}" for p in ctx)]},
        "generation_servers": {"urls": [*extra_gen, *(f"127.0.0.1:{p}" for p in gen)]},
        **extra,
    }
    for p in ctx + gen:  # all ready before the orchestrator's first health round
        wait_healthy(f"http://127.0.0.1:{p}", procs)
    path = tmp / f"cluster-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    procs.start("serve", "--config", str(path))
    cluster = Cluster(
        f"http://127.0.0.1:{port}",
        [f"http://127.0.0.1:{p}" for p in ctx],
        [f"http://127.0.0.1:{p}" for p in gen],
    )
    wait_healthy(cluster.url, procs)
    return cluster


@pytest.fixture(scope="session")
def procs() -> Iterator[Procs]:
    with Procs() as p:
        yield p


@pytest.fixture(scope="session")
def cluster(procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    """1 context + 1 generation worker behind an orchestrator (the demo topology)."""
    return start_cluster(procs, tmp_path_factory.mktemp("c1"), 1, 1)


@pytest.fixture(scope="session")
def cluster2(procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    """2 context + 2 generation workers."""
    return start_cluster(procs, tmp_path_factory.mktemp("c2"), 2, 2)


@pytest.fixture(scope="session")
def mixed_worker(procs: Procs) -> str:
    """An aggregated (mixed) worker: the reference for disagg == aggregated."""
    port = free_port()
    procs.start("worker", "--role", "mixed", "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, procs)
    return url


def assert_no_leaks(cluster: Cluster, timeout_s: float = 5.0) -> None:
    """In-flight counts back to 0 and no worker holds pinned or used KV blocks."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = httpx.get(cluster.url + "/cluster_info").json()
        workers = info["context_servers"] + info["generation_servers"]
        stats = [httpx.get(u + "/stats").json() for u in cluster.worker_urls]
        in_flight = [w["in_flight"] for w in workers]
        pinned = [s["pinned"] for s in stats]
        used = [s["kv"]["used"] for s in stats]
        running = [s["running"] + s["waiting"] + s["handoffs"] for s in stats]
        if not any(in_flight + pinned + used + running):
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"leak: in_flight={in_flight} pinned={pinned} used={used} running={running}"
            )
        time.sleep(0.05)


def start_workers(procs: Procs, *roles: str) -> list[str]:
    """Reference workers of these roles on free ports, healthy; their URLs."""
    ports = [free_port() for _ in roles]
    for role, port in zip(roles, ports, strict=True):
        procs.start("worker", "--role", role, "--port", str(port))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    for url in urls:
        wait_healthy(url, procs)
    return urls


class ThreadServer:
    """An aiohttp app served on loopback from a thread and event loop of its own, so that
    synchronous tests can use it: `with server as url:`. Subclasses build `app()`."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def app(self) -> web.Application:
        raise NotImplementedError

    def stopping(self) -> None:
        """Called on the server's loop as it stops (to end handlers that wait)."""

    def __enter__(self) -> str:  # the base URL
        self.runner = web.AppRunner(self.app())
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        self.loop.run_until_complete(site.start())
        self.thread.start()
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stopping)
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class BrokenWorker(ThreadServer):
    """A real HTTP server on loopback that looks healthy but fails every inference request,
    run on its own thread; `with BrokenWorker(mode) as url:`. Modes: "500", "400", "reset"
    (drops the connection without answering), "partial" (streams one chunk, then drops),
    "torn" (streams one event and half of the next, then drops),
    "hang" (never answers), "partial_hang" (streams one chunk, then nothing).
    `hits` counts the inference requests it received."""

    def __init__(self, mode: str = "500") -> None:
        super().__init__()
        self.mode = mode
        self.hits = 0
        self._released = asyncio.Event()  # ends the hanging handlers at exit

    def stopping(self) -> None:
        self._released.set()

    async def _fail(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        if self.mode == "400":
            return web.json_response({"error": {"message": "bad", "param": "x"}}, status=400)
        if self.mode == "reset":
            assert request.transport is not None
            request.transport.close()
            raise asyncio.CancelledError
        if self.mode == "hang":
            await self._released.wait()
        if self.mode in ("partial", "partial_hang", "torn"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices": [{"index": 0, "text": "A"}]}\n\n')
            if self.mode == "torn":
                await resp.write(b'data: {"choices": [{"ind')
            if self.mode == "partial_hang":
                await self._released.wait()
            assert request.transport is not None
            request.transport.close()
            return resp
        return web.json_response({"error": {"message": "engine exploded"}}, status=500)

    def app(self) -> web.Application:
        async def health(_r: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        async def models(_r: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

        app = web.Application()
        app.add_routes([web.get("/health", health), web.get("/v1/models", models)])
        app.add_routes(
            [
                web.post(p, self._fail)
                for p in ("/v1/completions", "/v1/chat/completions", "/v1/responses")
            ]
        )
        return app


class Proxy(ThreadServer):
    """A proxy on loopback in front of a worker, on its own thread: `with Proxy(url) as url`.
    It keeps each request's headers in `seen` (path, headers), and passes each answer (whole,
    not streamed) through `rewrite(headers, body)` when given."""

    def __init__(
        self,
        target: str,
        rewrite: Callable[[dict[str, str], bytes], tuple[dict[str, str], bytes]] | None = None,
    ) -> None:
        super().__init__()
        self.target, self.rewrite = target, rewrite
        self.seen: list[tuple[str, dict[str, str]]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._forward)
        return app

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        self.seen.append((request.path, headers))
        async with (
            aiohttp.ClientSession(auto_decompress=False) as session,
            session.request(
                request.method,
                self.target + request.path_qs,
                data=await request.read(),
                headers=headers,
            ) as up,
        ):
            body = await up.read()
            out = {k: v for k, v in up.headers.items() if k.lower().startswith(("x-", "content-t"))}
            if self.rewrite is not None:
                out, body = self.rewrite(out, body)
            return web.Response(body=body, status=up.status, headers=out)


@contextlib.contextmanager
def failing_pool(procs: Procs, tmp: Path, role: str) -> Iterator[tuple[Cluster, BrokenWorker]]:
    """A cluster whose `role` pool is one BrokenWorker answering 500 (the other pool one
    reference worker): one retry 10 ms apart, breaker kept closed, so tests count attempts."""
    worker = BrokenWorker("500")
    with worker:
        broken_pool = {"extra_ctx" if role == "context" else "extra_gen": [worker.url]}
        n_ctx, n_gen = (0, 1) if role == "context" else (1, 0)
        c = start_cluster(
            procs,
            tmp,
            n_ctx,
            n_gen,
            **broken_pool,
            max_retries=1,
            retry_interval=0.01,
            **NO_BREAKER,
        )
        yield c, worker


@pytest.fixture
def broken(request: pytest.FixtureRequest) -> Iterator[BrokenWorker]:
    """A BrokenWorker in the mode given by indirect parametrization."""
    worker = BrokenWorker(request.param)
    with worker:
        yield worker


def error_of(r: httpx.Response) -> dict[str, Any]:
    """The error a request got: its error body, or (a stream that had begun) the error event
    that ends it, just before `[DONE]`."""
    if not r.headers.get("content-type", "").startswith("text/event-stream"):
        error: dict[str, Any] = r.json()["error"]
        return error
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    return error


def route_of(response: Any) -> dict[str, str]:
    """The `x-disagg-route` header of an httpx or openai raw response, as a dict."""
    header: str = response.headers["x-disagg-route"]
    return dict(part.split("=", 1) for part in header.split("; "))


os.environ.setdefault("OPENAI_API_KEY", "unused")
