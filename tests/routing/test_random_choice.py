"""Random choice spreads legs evenly, replays under a seed, and retries elsewhere."""

from __future__ import annotations

import random
from collections import Counter

from disagg.cluster import Pool, WorkerState
from disagg.routing import RouteRequest
from disagg.routing.random_choice import RandomChoice


def _pool(n: int) -> Pool:
    return Pool("context", [WorkerState(f"http://w{i}", "context", ready=True) for i in range(n)])


def _picks(policy: RandomChoice, n: int, avoid: frozenset[str] = frozenset()) -> list[str]:
    return [policy.pick(RouteRequest(i, "tiny", avoid=avoid)).url for i in range(n)]


def test_uniform_over_available_workers() -> None:
    pool = _pool(4)
    pool.workers[3].draining = True
    counts = Counter(_picks(RandomChoice(pool, random.Random(7)), 3000))
    assert set(counts) == {"http://w0", "http://w1", "http://w2"}
    assert all(850 < c < 1150 for c in counts.values())


def test_a_seed_replays_the_same_choices() -> None:
    first = _picks(RandomChoice(_pool(5), random.Random(42)), 50)
    assert first == _picks(RandomChoice(_pool(5), random.Random(42)), 50)
    assert len(set(first)) > 1


def test_avoid_prefers_other_workers_and_falls_back() -> None:
    pool = _pool(2)
    policy = RandomChoice(pool, random.Random(1))
    assert set(_picks(policy, 20, frozenset({"http://w0"}))) == {"http://w1"}
    assert set(_picks(policy, 20, frozenset({"http://w0", "http://w1"}))) == {
        "http://w0",
        "http://w1",
    }
