"""Placement: the `Policy` protocol, reservations, and the table from config names to policies.

Routing never does I/O: a policy looks at the pool's workers and their in-flight counts and
picks one; the reservation it returns is finished exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from types import MappingProxyType
from typing import Any, Protocol

from disagg.cluster import Pool, WorkerState
from disagg.routing.prefix_index import PrefixIndex


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may look at when placing one leg."""

    request_id: int
    model: str
    prompt_len: int = 0
    tokens: int = 0  # the leg's expected token work (prompt + expected output)
    avoid: frozenset[str] = frozenset()  # workers that failed this request already
    # Chained hashes (`disagg.engine.kv_cache.block_hashes`) of the prompt's full blocks, all
    # prompt tokens but the last (the worker always computes that one, like TensorRT-LLM).
    block_hashes: tuple[int, ...] = ()
    conversation: str | None = None  # for conversation affinity

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
        self.worker.selections += 1
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


def make_policy(
    name: str,
    pool: Pool,
    args: Mapping[str, Any] = MappingProxyType({}),
    index: PrefixIndex | None = None,
) -> Policy:
    """The policy config names `name`, built from its router `args` (`RouterConfig.args`).
    `kv_cache_aware` reads `index` (a `ValueError` without one); the others ignore it."""
    from disagg.routing.affinity import ConversationAffinity
    from disagg.routing.kv_cache_aware import KvCacheAware
    from disagg.routing.load_balancing import LoadBalancing
    from disagg.routing.power_of_two import PowerOfTwo
    from disagg.routing.random_choice import RandomChoice
    from disagg.routing.round_robin import RoundRobin

    table: dict[str, Callable[[Pool, Mapping[str, Any]], Policy]] = {
        "round_robin": RoundRobin.from_args,
        "load_balancing": LoadBalancing.from_args,
        "random": RandomChoice.from_args,
        "power_of_two": PowerOfTwo.from_args,
        "conversation": ConversationAffinity.from_args,
        "kv_cache_aware": partial(KvCacheAware.from_args, index=index),
    }
    build = table.get(name)
    if build is None:  # config validates names; this is for callers that skip it
        raise ValueError(f"unknown router type {name!r}; expected one of {', '.join(table)}")
    return build(pool, args)
