"""Conversation affinity: a conversation stays on its worker while that worker is available
and within `max_imbalance` of the least loaded; then it moves, and stays on the new one."""

from __future__ import annotations

from disagg.cluster import Breaker, BreakerSettings, Pool, WorkerState
from disagg.routing import Reservation, RouteRequest
from disagg.routing.affinity import ConversationAffinity


def _pool(n: int) -> Pool:
    settings = BreakerSettings(failures=1, cooldown_s=1e9)
    return Pool(
        "generation",
        [
            WorkerState(f"http://w{i}", "generation", ready=True, breaker=Breaker(settings))
            for i in range(n)
        ],
    )


def _pick(policy: ConversationAffinity, i: int, conversation: str | None) -> Reservation:
    return Reservation(policy, RouteRequest(i, "tiny", conversation=conversation))


def test_conversation_sticks_then_moves_when_overloaded_or_gone() -> None:
    pool = _pool(3)
    policy = ConversationAffinity(pool, max_imbalance=2)
    home = _pick(policy, 0, "chat-a").worker
    for i in range(1, 4):  # finished turns: always back home
        r = _pick(policy, i, "chat-a")
        assert r.worker is home
        r.finish(True)
    held = [_pick(policy, 10 + i, "chat-a") for i in range(2)]  # home now has 3 in flight
    assert all(r.worker is home for r in held)
    moved = _pick(policy, 20, "chat-a")  # 3 in flight vs 0 elsewhere: beyond the imbalance
    assert moved.worker is not home
    new_home = moved.worker
    for r in [*held, moved]:
        r.finish(True)
    assert _pick(policy, 21, "chat-a").worker is new_home  # the conversation moved with it
    new_home.ready = False
    assert _pick(policy, 22, "chat-a").worker not in (new_home,)


def test_requests_without_conversation_spread_and_memory_is_bounded() -> None:
    pool = _pool(2)
    policy = ConversationAffinity(pool, max_conversations=3)
    first, second = _pick(policy, 0, None), _pick(policy, 1, None)
    assert first.worker is not second.worker  # least loaded
    for r in (first, second):
        r.finish(True)
    for i in range(10):
        _pick(policy, 100 + i, f"chat-{i}").finish(True)
    assert len(policy._home) == 3  # only the most recent conversations are remembered
    assert all(w.in_flight == 0 for w in pool.workers)
