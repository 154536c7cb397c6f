"""Least-loaded placement by legs or by tokens in flight; equal workers take turns, and the
token ledger balances even when a worker's state is replaced under the same url."""

from __future__ import annotations

from disagg.cluster import Pool, WorkerState
from disagg.routing import RouteRequest
from disagg.routing.load_balancing import InFlightTokens, LoadBalancing


def _pool(n: int) -> Pool:
    return Pool("context", [WorkerState(f"http://w{i}", "context", ready=True) for i in range(n)])


def test_equal_workers_take_turns() -> None:
    policy = LoadBalancing(_pool(3))
    picked = []
    for i in range(6):
        request = RouteRequest(i, "tiny")
        worker = policy.pick(request)
        picked.append(worker.url)
        policy.finish(worker, request, True)
    assert picked == ["http://w0", "http://w1", "http://w2"] * 2


def test_fewest_legs_in_flight_wins() -> None:
    policy = LoadBalancing(_pool(3))
    urls = [policy.pick(RouteRequest(i, "tiny", tokens=1000 if i else 1)).url for i in range(6)]
    assert sorted(urls) == [
        "http://w0",
        "http://w0",
        "http://w1",
        "http://w1",
        "http://w2",
        "http://w2",
    ]


def test_use_tokens_weighs_a_long_leg() -> None:
    pool = _pool(2)
    policy = LoadBalancing(pool, InFlightTokens())
    big = RouteRequest(0, "tiny", tokens=1000)
    assert policy.pick(big) is pool.workers[0]
    urls = [policy.pick(RouteRequest(i, "tiny", tokens=10)).url for i in range(1, 4)]
    assert urls == ["http://w1"] * 3  # one leg on w0 outweighs three on w1
    policy.finish(pool.workers[0], big, True)
    assert policy.pick(RouteRequest(9, "tiny", tokens=10)) is pool.workers[0]


def test_tokens_balance_when_a_worker_leaves_and_returns_as_a_new_state() -> None:
    pool = _pool(2)
    load = InFlightTokens()
    policy = LoadBalancing(pool, load)
    request = RouteRequest(0, "tiny", tokens=500)
    old = policy.pick(request)
    pool.workers[0] = WorkerState(old.url, "context", ready=True)  # left, then rejoined
    assert load.of(pool.workers[0]) == 500  # its leg is still running there
    policy.finish(old, request, False)
    assert load.of(pool.workers[0]) == 0 and old.in_flight == 0
