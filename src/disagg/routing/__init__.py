"""Placement: the `Policy` protocol, reservations, and the table from config names to policies.

Routing never does I/O: a policy looks at the pool's workers and their in-flight counts and
picks one; the reservation it returns is finished exactly once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Protocol

from disagg.cluster import Pool, WorkerState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may look at when placing one leg."""

    request_id: int
    model: str
    prompt_len: int = 0
    avoid: frozenset[str] = frozenset()  # workers that failed this request already

    def avoiding(self, url: str | None) -> RouteRequest:
        return replace(self, avoid=self.avoid | {url}) if url else self


class Policy(Protocol):
    pool: Pool

    def pick(self, request: RouteRequest) -> WorkerState:
        """Choose a ready worker and count the request in flight on it."""
        ...

    def finish(self, worker: WorkerState, request: RouteRequest, success: bool) -> None:
        """The leg placed on `worker` is over."""
        ...


class Reservation:
    """One placed leg; `finish` is idempotent so every exit path may call it.

    The worker's circuit breaker hears of the placement here; its verdict (whose fault a
    failure was) is the orchestrator's to give, through `judge`."""

    __slots__ = ("_done", "policy", "request", "worker")

    def __init__(self, policy: Policy, request: RouteRequest) -> None:
        self.policy, self.request = policy, request
        self.worker = policy.pick(request)
        self.worker.breaker.on_pick(time.monotonic())
        self._done = False

    def judge(self, ok: bool) -> None:
        """The leg worked (True) or failed by this worker's fault (False)."""
        self.worker.breaker.record(ok, time.monotonic())

    def finish(self, success: bool) -> None:
        if self._done:
            return
        self._done = True
        self.worker.breaker.settle()
        self.policy.finish(self.worker, self.request, success)


def make_policy(name: str, pool: Pool) -> Policy:
    from disagg.routing.round_robin import RoundRobin

    table: dict[str, type[RoundRobin]] = {"round_robin": RoundRobin}
    if name not in table:
        # Config validation accepts TRT-LLM's other router names; they arrive with issue 4.
        log.warning("router type %r is not implemented yet; using round_robin", name)
    return table.get(name, RoundRobin)(pool)
