"""A worker leaves its pool after N failed health checks in a row and rejoins after M
passes; a single blip does not flap it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from disagg.cluster import Thresholds, WorkerState


def test_leaves_after_n_fails_and_rejoins_after_m_passes() -> None:
    w = WorkerState("http://w", "context", ready=True)
    t = Thresholds(fail=3, ok=2)
    assert [w.record(False, t), w.ready] == [False, True]
    assert [w.record(True, t), w.ready] == [False, True]  # a blip resets the count
    for _ in range(2):
        w.record(False, t)
    assert w.ready
    assert w.record(False, t) and not w.ready  # third failure in a row
    assert not w.record(True, t) and not w.ready
    assert w.record(True, t) and w.ready


@given(st.lists(st.booleans(), max_size=50), st.integers(1, 4), st.integers(1, 4))
def test_ready_follows_the_last_run_of_checks(checks: list[bool], fail: int, ok: int) -> None:
    w = WorkerState("http://w", "generation")
    t = Thresholds(fail, ok)
    for c in checks:
        w.record(c, t)
    run = 0
    for c in reversed(checks):
        if c != (checks[-1] if checks else True):
            break
        run += 1
    if checks and checks[-1] and run >= ok:
        assert w.ready
    if checks and not checks[-1] and run >= fail:
        assert not w.ready
