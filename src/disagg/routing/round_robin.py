"""Round robin over the pool's available workers (ready, not draining, breaker closed or
probing), with in-flight counts per worker."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disagg.cluster import Pool, WorkerState
from disagg.routing import RouteRequest
from disagg.routing.candidates import candidates


class RoundRobin:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self._next = 0

    @classmethod
    def from_args(cls, pool: Pool, args: Mapping[str, Any]) -> RoundRobin:
        return cls(pool)

    def pick(self, request: RouteRequest) -> WorkerState:
        ready = candidates(self.pool, request)
        worker = ready[self._next % len(ready)]
        self._next += 1
        worker.in_flight += 1
        return worker

    def finish(self, worker: WorkerState, request: RouteRequest, success: bool) -> None:
        worker.in_flight -= 1
