"""Round robin never picks an unready worker; reservations balance and finish once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg.cluster import Pool, WorkerState
from disagg.errors import ServiceUnavailable
from disagg.routing import Reservation, RouteRequest, make_policy


def _pool(ready: list[bool]) -> Pool:
    return Pool(
        "context", [WorkerState(f"http://w{i}", "context", ready=r) for i, r in enumerate(ready)]
    )


@given(
    ready=st.lists(st.booleans(), min_size=1, max_size=6),
    ops=st.lists(st.sampled_from(["pick", "finish", "finish_twice"]), max_size=60),
)
def test_picks_only_ready_and_balances(ready: list[bool], ops: list[str]) -> None:
    pool = _pool(ready)
    policy = make_policy("round_robin", pool)
    open_: list[Reservation] = []
    for i, op in enumerate(ops):
        if op == "pick":
            if not any(ready):
                with pytest.raises(ServiceUnavailable):
                    Reservation(policy, RouteRequest(i, "tiny"))
                continue
            r = Reservation(policy, RouteRequest(i, "tiny"))
            assert r.worker.ready
            open_.append(r)
        elif open_:
            r = open_.pop(0)
            r.finish(success=op == "finish")
            if op == "finish_twice":
                r.finish(success=True)  # idempotent: counted once
        assert sum(w.in_flight for w in pool.workers) == len(open_)
        assert all(w.in_flight >= 0 for w in pool.workers)
    for r in open_:
        r.finish(success=False)
    assert all(w.in_flight == 0 for w in pool.workers)


def test_rotates_over_ready_workers() -> None:
    pool = _pool([True, False, True, True])
    policy = make_policy("round_robin", pool)
    picked = [policy.pick(RouteRequest(i, "tiny")).url for i in range(6)]
    assert picked == ["http://w0", "http://w2", "http://w3"] * 2


def test_model_filter() -> None:
    pool = _pool([True, True])
    pool.workers[0].models = ("other",)
    pool.workers[1].models = ("tiny",)
    policy = make_policy("round_robin", pool)
    assert {policy.pick(RouteRequest(i, "tiny")).url for i in range(4)} == {"http://w1"}
