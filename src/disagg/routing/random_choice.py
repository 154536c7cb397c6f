"""Uniform random choice among the available workers (avoided ones last), with in-flight
counts per worker. Seedable through the `random.Random` it is given; no other state."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from disagg.cluster import Pool, WorkerState
from disagg.routing import RouteRequest
from disagg.routing.candidates import candidates


class RandomChoice:
    def __init__(self, pool: Pool, rng: random.Random | None = None) -> None:
        self.pool = pool
        self._rng = rng or random.Random()

    @classmethod
    def from_args(cls, pool: Pool, args: Mapping[str, Any]) -> RandomChoice:
        return cls(pool)

    def pick(self, request: RouteRequest) -> WorkerState:
        worker = self._rng.choice(candidates(self.pool, request))
        worker.in_flight += 1
        return worker

    def finish(self, worker: WorkerState, request: RouteRequest, success: bool) -> None:
        worker.in_flight -= 1
