"""Round robin over the pool's available workers (ready, not draining, breaker closed or
probing), with in-flight counts per worker."""

from __future__ import annotations

from disagg.cluster import Pool, WorkerState
from disagg.errors import ServiceUnavailable
from disagg.routing import RouteRequest


class RoundRobin:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self._next = 0

    def pick(self, request: RouteRequest) -> WorkerState:
        ready = self.pool.available(request.model)
        if not ready:
            raise ServiceUnavailable(
                f"no {self.pool.role} worker can take model `{request.model}` now"
                " (none ready, or all draining or with an open circuit breaker)"
            )
        # A retry goes elsewhere when the pool has another ready worker.
        ready = [w for w in ready if w.url not in request.avoid] or ready
        worker = ready[self._next % len(ready)]
        self._next += 1
        worker.in_flight += 1
        return worker

    def finish(self, worker: WorkerState, request: RouteRequest, success: bool) -> None:
        worker.in_flight -= 1
