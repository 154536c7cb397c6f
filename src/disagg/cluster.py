"""Cluster membership as the orchestrator sees it: workers per pool, their readiness, the
models they serve, the health monitor that keeps this current, and a circuit breaker per
worker fed by request outcomes.

Membership starts from a `Discovery` (the config's static lists) and changes at run time:
`Cluster.add` / `Cluster.remove` are called by the etcd watcher (`disagg.etcd_discovery`)
and the admin endpoints (`disagg.admin`), and every change is told to the cluster's
listeners (the health monitor checks a new worker at once; cache-aware routing forgets a
removed one). A removed worker's legs in flight finish: their reservations hold its state.

The monitor only observes and marks workers; it never routes and never touches requests. A
worker takes new legs when it is ready (health), neither draining (its own word, on /health
or in its etcd record) nor cordoned (the admin's word), and its breaker lets a request
through (or every ready worker's breaker is open: then the pool fails open).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Thresholds:
    fail: int = 2  # consecutive failed checks before a worker leaves its pool
    ok: int = 1  # consecutive passed checks before it (re)joins


@dataclass(frozen=True)
class BreakerSettings:
    failures: int = 3  # request-level faults in a row that open the breaker
    cooldown_s: float = 5.0  # open → half-open after this long


class Breaker:
    """Closed → open after `failures` faults in a row → half-open after `cooldown_s`, when
    exactly one probe request may pass → closed on its success, open again on its fault.

    Only faults the orchestrator blames on this worker count: a client's 4xx, a cancelled
    request or the peer worker's fault call nothing, or `settle` for a probe.
    """

    __slots__ = ("_faults", "_probing", "_retry_at", "settings", "state")

    def __init__(self, settings: BreakerSettings | None = None) -> None:
        self.settings = settings or BreakerSettings()
        self.state = "closed"
        self._faults = 0
        self._retry_at = 0.0
        self._probing = False

    def allows(self, now: float) -> bool:
        if self.state == "closed":
            return True
        if self.state == "open":
            return now >= self._retry_at
        return not self._probing

    def on_pick(self, now: float) -> None:
        """A request was placed here; past the cooldown it is the half-open probe."""
        if self.state == "open" and now >= self._retry_at:
            self.state = "half_open"
        if self.state == "half_open":
            self._probing = True

    def record(self, ok: bool, now: float) -> None:
        self._probing = False
        if ok:
            self.state, self._faults = "closed", 0
            return
        self._faults += 1
        if self.state == "half_open" or self._faults >= self.settings.failures:
            if self.state != "open":
                log.warning("circuit breaker opened after %d fault(s)", self._faults)
            self.state = "open"
            self._retry_at = now + self.settings.cooldown_s

    def reset(self) -> None:
        """Closed, with no faults counted (a worker that rejoined after leaving its pool)."""
        self.state, self._faults, self._probing = "closed", 0, False

    def settle(self) -> None:
        """A placed request ended without a verdict; a half-open breaker may probe again."""
        self._probing = False


@dataclass(eq=False)
class WorkerState:
    url: str
    role: str  # "context" or "generation"
    ready: bool = False
    draining: bool = False  # the worker said so (/health or its etcd record): no new legs
    cordoned: bool = False  # an admin drained it: no new legs until it is removed
    source: str = "static"  # where it came from: "static" (config), "etcd" or "admin"
    in_flight: int = 0
    models: tuple[str, ...] = ()
    last_error: str | None = None
    fails: int = 0  # consecutive failed health checks
    passes: int = 0  # consecutive passed health checks
    breaker: Breaker = field(default_factory=Breaker)
    selections: int = 0  # legs placed here since start (retries included)

    def record(self, ok: bool, thresholds: Thresholds) -> bool:
        """Count one health check; returns whether readiness changed. A ready worker leaves
        after `fail` failures in a row, an unready one joins after `ok` passes in a row."""
        self.fails, self.passes = (0, self.passes + 1) if ok else (self.fails + 1, 0)
        if self.ready and self.fails >= thresholds.fail:
            self.ready = False
            return True
        if not self.ready and self.passes >= thresholds.ok:
            self.ready = True
            return True
        return False

    def takes_legs(self) -> bool:
        return self.ready and not self.draining and not self.cordoned

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "role": self.role,
            "ready": self.ready,
            "draining": self.draining,
            "cordoned": self.cordoned,
            "source": self.source,
            "breaker": self.breaker.state,
            "in_flight": self.in_flight,
            "models": list(self.models),
            "last_error": self.last_error,
        }


@dataclass(eq=False)
class Pool:
    role: str
    workers: list[WorkerState] = field(default_factory=list)

    def ready(self, model: str | None = None) -> list[WorkerState]:
        return [w for w in self.workers if w.ready and _serves(w, model)]

    def available(self, model: str) -> list[WorkerState]:
        """The workers a new leg for `model` may go to now. When every ready worker's breaker
        is open, all of them are (fail open): a breaker steers load, it never empties a pool
        that health checks say can serve."""
        now = time.monotonic()
        ready = [w for w in self.workers if w.takes_legs() and _serves(w, model)]
        return [w for w in ready if w.breaker.allows(now)] or ready


def _serves(w: WorkerState, model: str | None) -> bool:
    return model is None or not w.models or model in w.models


class Discovery(Protocol):
    """Where the list of workers comes from."""

    def members(self) -> Sequence[tuple[str, str]]:
        """(role, url) for every known worker."""
        ...


@dataclass(frozen=True)
class StaticDiscovery:
    context_urls: Sequence[str]
    generation_urls: Sequence[str]

    def members(self) -> Sequence[tuple[str, str]]:
        return [("context", u) for u in self.context_urls] + [
            ("generation", u) for u in self.generation_urls
        ]


Listener = Callable[[str, WorkerState], None]  # ("added" | "removed", the worker)


class Cluster:
    def __init__(self, discovery: Discovery, breaker: BreakerSettings | None = None) -> None:
        self.context = Pool("context")
        self.generation = Pool("generation")
        self.breaker = breaker
        self._listeners: list[Listener] = []
        # (role, url) an admin drained: kept across the worker leaving and coming back (an
        # etcd lease that expired while etcd was out of reach), until resumed or removed
        self._cordoned: set[tuple[str, str]] = set()
        for role, url in discovery.members():
            self.pool(role).workers.append(WorkerState(url, role, breaker=Breaker(breaker)))

    def pool(self, role: str) -> Pool:
        return self.context if role == "context" else self.generation

    def subscribe(self, listener: Listener) -> None:
        """Call `listener` after each worker joins or leaves."""
        self._listeners.append(listener)

    def find(self, role: str, url: str) -> WorkerState | None:
        return next((w for w in self.pool(role).workers if w.url == url), None)

    def add(
        self, role: str, url: str, *, source: str = "static", models: Sequence[str] = ()
    ) -> WorkerState:
        """A new worker in `role`'s pool, unready until its first health check passes.
        ValueError if the pool has that URL already."""
        if self.find(role, url) is not None:
            raise ValueError(f"the {role} pool has {url} already")
        w = WorkerState(url, role, source=source, models=tuple(models))
        w.cordoned = (role, url) in self._cordoned
        w.breaker = Breaker(self.breaker)
        self.pool(role).workers.append(w)  # in place: the event feeds hold this list
        log.info("worker %s (%s) joined the cluster (%s)", url, role, source)
        self._tell("added", w)
        return w

    def cordon(self, w: WorkerState, cordoned: bool) -> None:
        """An admin drained (or resumed) `w`: no new legs for it, also were it to leave its
        pool and join again."""
        w.cordoned = cordoned
        if cordoned:
            self._cordoned.add((w.role, w.url))
        else:
            self._cordoned.discard((w.role, w.url))

    def remove(self, role: str, url: str) -> WorkerState | None:
        """Take the worker out of its pool (its legs in flight finish); None if absent."""
        w = self.find(role, url)
        if w is None:
            return None
        self.pool(role).workers.remove(w)
        log.info("worker %s (%s) left the cluster (%s)", url, role, w.source)
        self._tell("removed", w)
        return w

    def _tell(self, change: str, w: WorkerState) -> None:
        for listener in self._listeners:
            try:
                listener(change, w)
            except Exception:  # one listener's bug must not stop membership
                log.exception("cluster listener failed on %s %s", change, w.url)

    def workers(self) -> list[WorkerState]:
        return [*self.context.workers, *self.generation.workers]

    def is_ready(self) -> bool:
        return bool(self.context.ready() and self.generation.ready())

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for w in self.workers():
            if w.ready:
                seen.update(dict.fromkeys(w.models))
        return list(seen)

    def serves(self, model: str) -> bool:
        return bool(self.context.ready(model) and self.generation.ready(model))

    def describe(self) -> dict[str, Any]:
        return {
            "ready": self.is_ready(),
            "context_servers": [w.describe() for w in self.context.workers],
            "generation_servers": [w.describe() for w in self.generation.workers],
        }


async def _says_draining(resp: aiohttp.ClientResponse) -> bool:
    """A worker that is shutting down answers /health with `{"status": "draining"}`."""
    if resp.content_type != "application/json":
        return False
    try:
        data = await resp.json()
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("status") == "draining"


class Periodic:
    """Runs `run_round()` every `interval_s` in one task it owns, from `start` until `stop`; a
    round that fails is logged and the next one runs."""

    def __init__(
        self, name: str, run_round: Callable[[], Awaitable[None]], interval_s: float
    ) -> None:
        self.name, self.run_round, self.interval_s = name, run_round, interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.run_round()
            except Exception:
                log.exception("%s round failed", self.name)


class HealthMonitor:
    """Polls each worker's /health (and /v1/models when it turns ready)."""

    def __init__(
        self,
        cluster: Cluster,
        session: aiohttp.ClientSession,
        interval_s: float,
        timeout_s: float = 2.0,
        thresholds: Thresholds | None = None,
    ) -> None:
        self.cluster, self.session = cluster, session
        self.thresholds = thresholds or Thresholds()
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._periodic = Periodic("health-monitor", self.check_all, interval_s)
        self._joining: set[asyncio.Task[None]] = set()
        cluster.subscribe(self._on_change)

    def _on_change(self, change: str, w: WorkerState) -> None:
        """A worker that joined is checked now, not at the next round: it takes legs within
        one health check's time of registering."""
        if change != "added":
            return
        task = asyncio.get_running_loop().create_task(self.check(w), name=f"check {w.url}")
        self._joining.add(task)
        task.add_done_callback(self._joining.discard)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.cluster.workers()))

    async def check(self, w: WorkerState) -> None:
        """One health check of `w` (also run at once for a worker that just joined)."""
        try:
            async with self.session.get(w.url + "/health", timeout=self.timeout) as resp:
                ok = resp.status == 200
                error = None if ok else f"/health answered {resp.status}"
                draining = await _says_draining(resp)
            if draining != w.draining:
                state = "is draining" if draining else "takes new legs"
                log.info("worker %s (%s) %s", w.url, w.role, state)
                w.draining = draining
            if ok and not w.models:
                w.models = await self._models(w)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}".rstrip(": ")
        w.last_error = error
        if w.record(ok, self.thresholds):
            log.info("worker %s (%s) is now %s", w.url, w.role, "ready" if ok else "unready")
            if ok:  # back after leaving (e.g. restarted): judge it afresh
                w.breaker.reset()

    async def _models(self, w: WorkerState) -> tuple[str, ...]:
        async with self.session.get(w.url + "/v1/models", timeout=self.timeout) as resp:
            data = await resp.json(content_type=None)
        return tuple(str(m["id"]) for m in data.get("data", []) if isinstance(m, dict))

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait (bounded) until both pools have a ready worker."""
        deadline = time.monotonic() + timeout_s
        while True:
            await self.check_all()
            if self.cluster.is_ready() or time.monotonic() >= deadline:
                return self.cluster.is_ready()
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
        for task in list(self._joining):
            task.cancel()
        await asyncio.gather(*self._joining, return_exceptions=True)
