"""A worker's circuit breaker: closed → open after N faults in a row → one probe after the
cooldown → closed on its success, open again on its fault; settle frees the probe slot."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from disagg.cluster import Breaker, BreakerSettings, Pool, WorkerState
from disagg.routing import Reservation, RouteRequest
from disagg.routing.round_robin import RoundRobin


def test_opens_after_n_faults_in_a_row_and_probes_once() -> None:
    b = Breaker(BreakerSettings(failures=3, cooldown_s=5.0))
    b.record(False, 0.0)
    b.record(False, 0.0)
    b.record(True, 0.0)  # a success in between resets the count
    b.record(False, 1.0)
    b.record(False, 1.0)
    assert b.state == "closed" and b.allows(1.0)
    b.record(False, 1.0)
    assert b.state == "open"
    assert not b.allows(5.9)
    assert b.allows(6.0)  # past the cooldown: one probe may pass
    b.on_pick(6.0)
    assert b.state == "half_open" and not b.allows(6.0)  # only one probe at a time
    b.record(False, 7.0)  # the probe failed: open again, for another cooldown
    assert b.state == "open" and not b.allows(11.9) and b.allows(12.0)
    b.on_pick(12.0)
    b.record(True, 12.5)
    assert b.state == "closed" and b.allows(12.5)


def test_a_probe_without_verdict_frees_the_slot() -> None:
    b = Breaker(BreakerSettings(failures=1, cooldown_s=1.0))
    b.record(False, 0.0)
    b.on_pick(1.0)
    assert not b.allows(1.0)
    b.settle()  # e.g. the client cancelled, or the client's own 4xx
    assert b.state == "half_open" and b.allows(1.0)


@given(st.lists(st.booleans(), max_size=40), st.integers(1, 5))
def test_open_exactly_when_the_last_run_of_faults_reaches_n(verdicts: list[bool], n: int) -> None:
    # Without cooldowns passing, the breaker is open iff some run of n faults happened after
    # the last success.
    b = Breaker(BreakerSettings(failures=n, cooldown_s=1e9))
    for ok in verdicts:
        b.record(ok, 0.0)
    run = 0
    for ok in verdicts:
        run = 0 if ok else run + 1
    last_success = max((i for i, ok in enumerate(verdicts) if ok), default=-1)
    assert (b.state == "open") == (len(verdicts) - 1 - last_success >= n)
    assert b.allows(0.0) == (b.state == "closed")


def test_routing_skips_open_and_draining_workers() -> None:
    settings = BreakerSettings(failures=1, cooldown_s=1e9)
    workers = [
        WorkerState(f"http://w{i}", "generation", ready=True, breaker=Breaker(settings))
        for i in range(3)
    ]
    policy = RoundRobin(Pool("generation", workers))
    workers[0].breaker.record(False, 0.0)
    workers[1].draining = True
    for i in range(6):
        r = Reservation(policy, RouteRequest(i, "tiny"))
        assert r.worker is workers[2]
        r.finish(True)
    assert [w.in_flight for w in workers] == [0, 0, 0]


def test_pool_fails_open_when_every_breaker_is_open() -> None:
    settings = BreakerSettings(failures=1, cooldown_s=1e9)
    workers = [
        WorkerState(f"http://w{i}", "context", ready=True, breaker=Breaker(settings))
        for i in range(3)
    ]
    pool = Pool("context", workers)
    workers[0].breaker.record(False, 0.0)
    assert pool.available("tiny") == workers[1:]
    workers[1].breaker.record(False, 0.0)
    workers[2].breaker.record(False, 0.0)
    assert pool.available("tiny") == workers  # all open: a breaker never empties the pool
    workers[2].ready = False
    assert pool.available("tiny") == workers[:2]  # but unready workers stay out


def test_rejoining_after_a_restart_closes_the_breaker() -> None:
    b = Breaker(BreakerSettings(failures=1, cooldown_s=1e9))
    b.record(False, 0.0)
    b.reset()
    assert b.state == "closed" and b.allows(0.0)
