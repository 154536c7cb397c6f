"""Load against one target: a closed loop (N clients, each sending its next request when its
previous one ends) or an open loop (Poisson arrivals), for a number of requests or a duration,
after a warm-up, over one aiohttp session. Run it in its own process, on cores the servers do
not use: a busy client delays its own reads and inflates every latency it reports (each
result says how busy it was, `loadgen_cpu_share`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

import aiohttp
import msgspec
from yarl import URL

from disagg.loadgen.client import Sample, send
from disagg.loadgen.progress import Progress
from disagg.loadgen.stats import label, summarize
from disagg.loadgen.workloads import PATHS, Endpoint, Fixed, Request, Workload

_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class ClosedLoop:
    """`concurrency` clients, each sending its next request when its previous one ends."""

    concurrency: int = 8

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")

    def describe(self) -> dict[str, Any]:
        return {"loop": "closed", "concurrency": self.concurrency}

    async def drive(self, run: Run, seed: int) -> dict[str, Any]:
        async def client() -> None:
            while (request := run.next()) is not None:
                await run.one(request)

        async with asyncio.TaskGroup() as tasks:
            for _ in range(self.concurrency):
                tasks.create_task(client())
        return {}


@dataclass(frozen=True)
class OpenLoop:
    """Requests arrive `rate` a second, Poisson, whether earlier ones have finished or not;
    an arrival while `max_in_flight` are running waits for one to end (`cap_waits` counts
    them: with many, the target could not keep up and the loop was partly closed)."""

    rate: float
    max_in_flight: int = 1024

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be above 0, got {self.rate}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {self.max_in_flight}")

    def describe(self) -> dict[str, Any]:
        return {"loop": "open", "rate": self.rate, "max_in_flight": self.max_in_flight}

    async def drive(self, run: Run, seed: int) -> dict[str, Any]:
        rng, loop = random.Random(seed), asyncio.get_running_loop()
        slots = asyncio.Semaphore(self.max_in_flight)
        waits, at = 0, loop.time()

        async def one(request: Outgoing) -> None:
            try:
                await run.one(request)
            finally:
                slots.release()

        async with asyncio.TaskGroup() as tasks:
            while True:
                at += rng.expovariate(self.rate)
                await asyncio.sleep(max(0.0, at - loop.time()))
                request = run.next()
                if request is None:
                    break
                waits += slots.locked()
                await slots.acquire()
                tasks.create_task(one(request))
        return {"cap_waits": waits}


class Arrivals(Protocol):
    """When requests are sent."""

    def describe(self) -> dict[str, Any]: ...

    async def drive(self, run: Run, seed: int) -> dict[str, Any]:
        """Send `run`'s requests until it has none left; return what to add to the result."""
        ...


@dataclass(frozen=True)
class LoadSpec:
    """One load run. It stops after `requests` or after `duration_s` (of the measured part),
    whichever comes first of those given; `warmup` requests go first and are not counted."""

    workload: Workload = field(default_factory=Fixed)
    endpoint: Endpoint = "completions"
    stream: bool = True
    arrivals: Arrivals = field(default_factory=ClosedLoop)
    requests: int | None = 200
    duration_s: float | None = None
    warmup: int = 10
    model: str = "tiny"
    api_key: str | None = field(default=None, repr=False)
    timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.endpoint not in PATHS:
            raise ValueError(f"endpoint must be one of {', '.join(PATHS)}, got {self.endpoint!r}")
        if self.requests is None and self.duration_s is None:
            raise ValueError("give a number of requests or a duration")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be at least 1, got {self.requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be above 0, got {self.duration_s}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be 0 or more, got {self.warmup}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout must be above 0, got {self.timeout_s}")

    def describe(self, target: str) -> dict[str, Any]:
        """The config echoed in the result (never the API key)."""
        return {
            "target": target,
            "endpoint": self.endpoint,
            "stream": self.stream,
            "workload": self.workload.spec,
            "model": self.model,
            **self.arrivals.describe(),
            "requests": self.requests,
            "duration_s": self.duration_s,
            "warmup": self.warmup,
            "timeout_s": self.timeout_s,
            "seed": self.seed,
        }


def parse_concurrency(text: str) -> list[int]:
    """`8` or a sweep `1,8,64`."""
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"concurrency must be a positive integer or a list like 1,8,64: {text!r}")
    return levels


def concurrency_sweep(spec: LoadSpec, levels: Sequence[int]) -> list[LoadSpec]:
    """`spec` as a closed loop at each concurrency in turn."""
    return [dataclasses.replace(spec, arrivals=ClosedLoop(c)) for c in levels]


def base_url(target: str) -> str:
    """The target's base URL, without a trailing `/` or `/v1` (the paths add it)."""
    url = URL(target.strip())
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"target must be an http:// or https:// URL, got {target!r}")
    return str(url).rstrip("/").removesuffix("/v1")


@dataclass(frozen=True)
class Outgoing:
    """A request ready to send: its URL and encoded body."""

    url: URL
    body: bytes


class Run:
    """One phase of a run (the warm-up or the measured part): hands out its requests, ready
    to send, until its limit or deadline, and keeps the samples of those that ended."""

    def __init__(
        self,
        send: Callable[[Outgoing], Awaitable[Sample]],
        requests: Iterator[Outgoing],
        limit: int | None,
    ) -> None:
        self._send, self._requests, self.limit = send, requests, limit
        self.deadline: float | None = None  # on time.perf_counter
        self.issued = 0
        self.samples: list[Sample] = []
        self.on_done: Callable[[Sample], None] | None = None

    def next(self) -> Outgoing | None:
        if self.limit is not None and self.issued >= self.limit:
            return None
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return None
        self.issued += 1
        return next(self._requests)

    async def one(self, request: Outgoing) -> None:
        sample = await self._send(request)
        self.samples.append(sample)
        if self.on_done is not None:
            self.on_done(sample)


def _prepared(bases: Sequence[str], spec: LoadSpec) -> Iterator[Outgoing]:
    """The workload's requests, ready to send; several targets take turns (round robin)."""
    urls = [{path: URL(base + path) for path in PATHS.values()} for base in bases]
    for i, request in enumerate(spec.workload.requests(spec.endpoint, spec.model, spec.seed)):
        body = _json.encode(_streamed(request, spec.stream))
        yield Outgoing(urls[i % len(urls)][request.path], body)


def _streamed(request: Request, stream: bool) -> dict[str, Any]:
    body = {**request.body, "stream": stream}
    options = body.pop("stream_options", None)
    if stream and request.path != PATHS["responses"]:  # responses streams always end in usage
        body["stream_options"] = {**(options or {}), "include_usage": True}
    return body


def _session() -> aiohttp.ClientSession:
    # Deadlines are each request's own (asyncio.timeout in send), not the session's.
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


async def run_load(
    target: str | Sequence[str], spec: LoadSpec, *, progress: TextIO | None = None
) -> dict[str, Any]:
    """Run `spec` against `target` (a base URL, or several that take turns: client-side
    round robin) and return its result (see stats.summarize), drawing a progress line on
    `progress` when given."""
    bases = [base_url(target)] if isinstance(target, str) else [base_url(t) for t in target]
    config = spec.describe(",".join(bases))
    headers = {"Content-Type": "application/json"}
    if spec.api_key:
        headers["Authorization"] = f"Bearer {spec.api_key}"
    requests = _prepared(bases, spec)
    async with _session() as session:

        def post(request: Outgoing) -> Awaitable[Sample]:
            return send(session, request.url, request.body, headers, spec.stream, spec.timeout_s)

        if spec.warmup:
            await spec.arrivals.drive(Run(post, requests, spec.warmup), spec.seed + 1)
        run = Run(post, requests, spec.requests)
        async with contextlib.AsyncExitStack() as stack:
            if progress is not None:
                meter = Progress(progress, label(config), spec.requests, spec.duration_s)
                shown = await stack.enter_async_context(meter)
                run.on_done = lambda sample: shown.record(sample.ok)
            cpu, start = time.process_time(), time.perf_counter()
            if spec.duration_s is not None:
                run.deadline = start + spec.duration_s
            notes = await spec.arrivals.drive(run, spec.seed)
            duration, cpu = time.perf_counter() - start, time.process_time() - cpu
    busy = round(cpu / duration, 3) if duration > 0 else 0.0
    return summarize(run.samples, duration, config, **notes, loadgen_cpu_share=busy)


def run_sweep(
    target: str | Sequence[str], specs: Sequence[LoadSpec], *, progress: TextIO | None = None
) -> list[dict[str, Any]]:
    """Run each spec against `target` in turn, in one event loop (uvloop when installed), and
    return their results in order."""

    async def each() -> list[dict[str, Any]]:
        return [await run_load(target, spec, progress=progress) for spec in specs]

    return _run(each())


def _run(main: Coroutine[Any, Any, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported OS
        return asyncio.run(main)
    result: list[dict[str, Any]] = uvloop.run(main)
    return result
