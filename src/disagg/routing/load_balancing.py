"""Least-loaded placement under a `Load` measure: legs in flight (TensorRT-LLM's default) or
tokens in flight (its `use_tokens: true`). Equal workers take turns. The token measure keeps
its own per-url ledger, added at pick and taken back at finish, so it balances even when a
worker leaves the pool and returns; it must not read anything but the request and worker."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from disagg.cluster import Pool, WorkerState
from disagg.routing import RouteRequest
from disagg.routing.candidates import candidates


class Load(Protocol):
    def of(self, worker: WorkerState) -> int:
        """How busy `worker` is now; lower is better."""
        ...

    def add(self, worker: WorkerState, request: RouteRequest) -> None: ...

    def remove(self, worker: WorkerState, request: RouteRequest) -> None: ...


class InFlightRequests:
    """Legs in flight, as counted on the worker itself."""

    def of(self, worker: WorkerState) -> int:
        return worker.in_flight

    def add(self, worker: WorkerState, request: RouteRequest) -> None:
        pass

    def remove(self, worker: WorkerState, request: RouteRequest) -> None:
        pass


class InFlightTokens:
    """Expected tokens (`RouteRequest.tokens`) of the legs in flight, per worker url."""

    def __init__(self) -> None:
        self._tokens: dict[str, int] = {}

    def of(self, worker: WorkerState) -> int:
        return self._tokens.get(worker.url, 0)

    def add(self, worker: WorkerState, request: RouteRequest) -> None:
        self._tokens[worker.url] = self.of(worker) + request.tokens

    def remove(self, worker: WorkerState, request: RouteRequest) -> None:
        left = self.of(worker) - request.tokens
        if left:
            self._tokens[worker.url] = left
        else:  # idle workers hold no entry, so the ledger stays as small as the busy set
            self._tokens.pop(worker.url, None)


class LoadBalancing:
    def __init__(self, pool: Pool, load: Load | None = None) -> None:
        self.pool = pool
        self.load: Load = load or InFlightRequests()
        self._next = 0

    @classmethod
    def from_args(cls, pool: Pool, args: Mapping[str, Any]) -> LoadBalancing:
        return cls(pool, InFlightTokens() if args.get("use_tokens") else InFlightRequests())

    def pick(self, request: RouteRequest) -> WorkerState:
        ready = candidates(self.pool, request)
        loads = [self.load.of(w) for w in ready]
        low = min(loads)
        least = [w for w, load in zip(ready, loads, strict=True) if load == low]
        worker = least[self._next % len(least)]
        self._next += 1
        worker.in_flight += 1
        self.load.add(worker, request)
        return worker

    def finish(self, worker: WorkerState, request: RouteRequest, success: bool) -> None:
        worker.in_flight -= 1
        self.load.remove(worker, request)
