"""Power of two choices: the less busy of two candidates wins, and idle equals share."""

from __future__ import annotations

import random
from collections import Counter

from disagg.cluster import Pool, WorkerState
from disagg.routing import RouteRequest
from disagg.routing.power_of_two import PowerOfTwo


def _pool(loads: list[int]) -> Pool:
    return Pool(
        "context",
        [
            WorkerState(f"http://w{i}", "context", ready=True, in_flight=n)
            for i, n in enumerate(loads)
        ],
    )


def _pick_and_finish(policy: PowerOfTwo, n: int) -> Counter[str]:
    counts: Counter[str] = Counter()
    for i in range(n):
        request = RouteRequest(i, "tiny")
        worker = policy.pick(request)
        counts[worker.url] += 1
        policy.finish(worker, request, True)
    return counts


def test_the_busier_of_two_never_wins() -> None:
    counts = _pick_and_finish(PowerOfTwo(_pool([3, 0]), random.Random(3)), 100)
    assert counts == {"http://w1": 100}


def test_the_busiest_of_three_never_wins() -> None:
    counts = _pick_and_finish(PowerOfTwo(_pool([0, 5, 1]), random.Random(3)), 300)
    assert "http://w1" not in counts and counts["http://w0"] > counts["http://w2"] > 0


def test_equal_workers_share() -> None:
    counts = _pick_and_finish(PowerOfTwo(_pool([0, 0, 0]), random.Random(5)), 600)
    assert all(150 < counts[f"http://w{i}"] < 250 for i in range(3))


def test_a_single_candidate_takes_the_leg() -> None:
    pool = _pool([4, 0])
    policy = PowerOfTwo(pool, random.Random(0))
    worker = policy.pick(RouteRequest(0, "tiny", avoid=frozenset({"http://w1"})))
    assert worker is pool.workers[0] and worker.in_flight == 5
