"""Which workers one leg may go to: the pool's available workers for the model, preferring
those the request has not failed on yet. Shared by the policies; it never picks one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from disagg.cluster import Pool, WorkerState
from disagg.errors import ServiceUnavailable

if TYPE_CHECKING:
    from disagg.routing import RouteRequest


def candidates(pool: Pool, request: RouteRequest) -> list[WorkerState]:
    """Never empty: raises `ServiceUnavailable` when no worker may take the leg."""
    ready = pool.available(request.model)
    if not ready:
        raise ServiceUnavailable(
            f"no {pool.role} worker can take model `{request.model}` now"
            " (none ready, or all draining or with an open circuit breaker)"
        )
    if not request.avoid:
        return ready
    # A retry goes elsewhere when the pool has another ready worker.
    return [w for w in ready if w.url not in request.avoid] or ready
