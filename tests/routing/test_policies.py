"""Properties every policy keeps over random pools and pick/finish sequences: it only picks an
available worker, honours `avoid`, and its in-flight counts (and token ledger) balance; plus
what each policy promises about load (and cache hits). And the table from config names to
policies."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg.cluster import Breaker, BreakerSettings, Pool, WorkerState
from disagg.config import parse_config
from disagg.errors import ServiceUnavailable
from disagg.routing import Policy, Reservation, RouteRequest, make_policy
from disagg.routing.affinity import ConversationAffinity
from disagg.routing.kv_cache_aware import KvCacheAware
from disagg.routing.load_balancing import InFlightRequests, InFlightTokens, LoadBalancing
from disagg.routing.power_of_two import PowerOfTwo
from disagg.routing.prefix_index import PrefixIndex
from disagg.routing.random_choice import RandomChoice
from disagg.routing.round_robin import RoundRobin

KINDS = ("ready", "unready", "draining", "open", "probing", "other_model")
OPEN = BreakerSettings(failures=1, cooldown_s=1e9)
PROBE = BreakerSettings(failures=1, cooldown_s=0.0)  # half-open at once; one probe passes


def _worker(i: int, kind: str) -> WorkerState:
    w = WorkerState(f"http://w{i}", "context", ready=kind != "unready")
    w.draining = kind == "draining"
    w.models = ("other",) if kind == "other_model" else ()
    if kind in ("open", "probing"):
        w.breaker = Breaker(OPEN if kind == "open" else PROBE)
        w.breaker.record(False, 0.0)
    if kind == "probing":
        w.breaker.on_pick(0.0)  # its one probe is out: no new leg may go there
    return w


def _pool(kinds: list[str]) -> Pool:
    return Pool("context", [_worker(i, k) for i, k in enumerate(kinds)])


CHAIN = tuple(range(1, 9))  # the block hashes of the prompts: request i uses a prefix of it


def _cached(pool: Pool) -> PrefixIndex:
    """Worker i holds the first 2 * i blocks of CHAIN (the unavailable ones included)."""
    index = PrefixIndex()
    for i, w in enumerate(pool.workers):
        index.apply(w.url, [{"type": "stored", "block_hashes": list(CHAIN[: 2 * i])}])
    return index


POLICIES: dict[str, Callable[[Pool, random.Random], Policy]] = {
    "round_robin": lambda pool, rng: RoundRobin(pool),
    "random": RandomChoice,
    "power_of_two": PowerOfTwo,
    "load_balancing": lambda pool, rng: LoadBalancing(pool),
    "load_balancing_tokens": lambda pool, rng: LoadBalancing(pool, InFlightTokens()),
    "kv_cache_aware": lambda pool, rng: KvCacheAware(pool, _cached(pool), rng=rng),
    "conversation": lambda pool, rng: ConversationAffinity(pool, max_imbalance=1),
}


@dataclass(frozen=True)
class Pick:
    avoid: frozenset[int]
    tokens: int


@dataclass(frozen=True)
class Finish:
    index: int
    success: bool


@dataclass(frozen=True)
class Toggle:  # the worker leaves its pool (health) or comes back
    index: int


OPS = st.one_of(
    st.builds(Pick, st.frozensets(st.integers(0, 5)), st.integers(0, 10_000)),
    st.builds(Finish, st.integers(0, 100), st.booleans()),
    st.builds(Toggle, st.integers(0, 5)),
)


def _load(policy: Policy, w: WorkerState) -> int:
    return policy.load.of(w) if isinstance(policy, LoadBalancing) else w.in_flight


def _check_pick(
    policy: Policy,
    available: list[WorkerState],
    request: RouteRequest,
    worker: WorkerState,
    before: dict[str, int],
) -> None:
    """`available`, and `before` (each candidate's load), as they were just before the pick."""
    avoid = request.avoid
    assert any(worker is w for w in available), "picked an unavailable worker"
    preferred = [w for w in available if w.url not in avoid]
    assert worker.url not in avoid or not preferred, "ignored avoid"
    others = [load for url, load in before.items() if url != worker.url]
    if isinstance(policy, LoadBalancing):
        assert before[worker.url] == min(before.values()), "not a least-loaded worker"
    if isinstance(policy, PowerOfTwo) and others:
        # It beat the other sampled candidate, so it is never the one strictly busiest.
        assert before[worker.url] <= max(others)
    if isinstance(policy, KvCacheAware):
        # No other candidate scores higher: its cached leading blocks minus 0.25 per leg.
        blocks = len(request.block_hashes)
        scores = {
            u: min(2 * int(u.removeprefix("http://w")), blocks) - 0.25 * load
            for u, load in before.items()
        }
        assert scores[worker.url] == max(scores.values()), "not the best cache/load score"


def _check_balance(policy: Policy, pool: Pool, open_: list[Reservation]) -> None:
    for w in pool.workers:
        mine = [r for r in open_ if r.worker is w]
        assert w.in_flight == len(mine)
        if isinstance(policy, LoadBalancing) and isinstance(policy.load, InFlightTokens):
            assert policy.load.of(w) == sum(r.request.tokens for r in mine)


@pytest.mark.parametrize("name", POLICIES)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=6),
    ops=st.lists(OPS, max_size=60),
    rng=st.randoms(use_true_random=False),
)
def test_policy_invariants(
    name: str, kinds: list[str], ops: list[object], rng: random.Random
) -> None:
    pool = _pool(kinds)
    policy = POLICIES[name](pool, rng)
    open_: list[Reservation] = []
    for i, op in enumerate(ops):
        if isinstance(op, Pick):
            avoid = frozenset(f"http://w{j}" for j in op.avoid)
            hashes = CHAIN[: op.tokens % (len(CHAIN) + 1)]
            request = RouteRequest(
                i,
                "tiny",
                tokens=op.tokens,
                avoid=avoid,
                block_hashes=hashes,
                conversation=f"c{op.tokens % 3}",
            )
            available = pool.available("tiny")
            if not available:
                with pytest.raises(ServiceUnavailable, match="no context worker can take model"):
                    Reservation(policy, request)
                continue
            candidates = [w for w in available if w.url not in avoid] or available
            before = {w.url: _load(policy, w) for w in candidates}
            r = Reservation(policy, request)
            _check_pick(policy, available, request, r.worker, before)
            open_.append(r)
        elif isinstance(op, Finish) and open_:
            r = open_.pop(op.index % len(open_))
            r.finish(op.success)
            r.finish(not op.success)  # idempotent: counted once
        elif isinstance(op, Toggle) and op.index < len(pool.workers):
            pool.workers[op.index].ready = not pool.workers[op.index].ready
        _check_balance(policy, pool, open_)
    for r in open_:
        r.finish(False)
    assert all(w.in_flight == 0 and _load(policy, w) == 0 for w in pool.workers)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("round_robin", RoundRobin),
        ("random", RandomChoice),
        ("power_of_two", PowerOfTwo),
        ("load_balancing", LoadBalancing),
    ],
)
def test_make_policy_table(name: str, cls: type) -> None:
    assert type(make_policy(name, _pool(["ready"]), {"max_batch_size": 8})) is cls


@pytest.mark.parametrize(
    ("args", "measure"),
    [
        ({}, InFlightRequests),
        ({"use_tokens": False}, InFlightRequests),
        ({"use_tokens": True}, InFlightTokens),
    ],
)
def test_use_tokens_picks_the_token_measure(args: dict[str, bool], measure: type) -> None:
    policy = make_policy("load_balancing", _pool(["ready"]), args)
    assert isinstance(policy, LoadBalancing) and type(policy.load) is measure


def test_use_tokens_from_the_cluster_file() -> None:
    cfg = parse_config(
        {
            "context_servers": {
                "urls": ["h:1"],
                "router": {"type": "load_balancing", "use_tokens": True},
            },
            "generation_servers": {"urls": ["h:2"], "router": {"type": "power_of_two"}},
        }
    )
    ctx = make_policy(cfg.context.router.type, _pool(["ready"]), cfg.context.router.args)
    gen = make_policy(cfg.generation.router.type, _pool(["ready"]), cfg.generation.router.args)
    assert isinstance(ctx, LoadBalancing) and isinstance(ctx.load, InFlightTokens)
    assert isinstance(gen, PowerOfTwo)


def test_kv_cache_aware_is_in_the_table() -> None:
    pool = _pool(["ready"])
    policy = make_policy("kv_cache_aware", pool, {"tokens_per_block": 64}, index=PrefixIndex())
    assert type(policy) is KvCacheAware
