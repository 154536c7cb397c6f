"""Power of two choices: sample two distinct available workers, the one with fewer legs in
flight wins (a tie goes to either, at random). Near least-loaded balance without scanning
the pool, and without herding every leg onto one idle worker. Seedable; no other state."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from disagg.cluster import Pool, WorkerState
from disagg.routing import RouteRequest
from disagg.routing.candidates import candidates


class PowerOfTwo:
    def __init__(self, pool: Pool, rng: random.Random | None = None) -> None:
        self.pool = pool
        self._rng = rng or random.Random()

    @classmethod
    def from_args(cls, pool: Pool, args: Mapping[str, Any]) -> PowerOfTwo:
        return cls(pool)

    def pick(self, request: RouteRequest) -> WorkerState:
        ready = candidates(self.pool, request)
        if len(ready) == 1:
            worker = ready[0]
        else:
            # `sample` orders the pair at random, so keeping `a` on a tie is a fair coin.
            a, b = self._rng.sample(ready, 2)
            worker = b if b.in_flight < a.in_flight else a
        worker.in_flight += 1
        return worker

    def finish(self, worker: WorkerState, request: RouteRequest, success: bool) -> None:
        worker.in_flight -= 1
