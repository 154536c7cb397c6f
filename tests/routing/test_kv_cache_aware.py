"""Cache-aware placement: the longest cached prefix wins at equal load, load outweighs a small
match exactly as `matched_blocks - load_weight * in_flight` says, unavailable workers never
win, ties spread, and the table builds it only with an index."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from disagg.cluster import Pool, WorkerState
from disagg.routing import Reservation, RouteRequest, make_policy
from disagg.routing.kv_cache_aware import KvCacheAware
from disagg.routing.prefix_index import PrefixIndex

CHAIN = tuple(range(100, 132))  # one prompt's 32 chained block hashes


def _setup(held: list[int], loads: list[int] | None = None) -> tuple[Pool, PrefixIndex]:
    """Worker i holds the first held[i] blocks of CHAIN and has loads[i] legs in flight."""
    loads = loads or [0] * len(held)
    pool = Pool(
        "context",
        [
            WorkerState(f"http://w{i}", "context", ready=True, in_flight=n)
            for i, n in enumerate(loads)
        ],
    )
    index = PrefixIndex()
    for w, n in zip(pool.workers, held, strict=True):
        index.apply(w.url, [{"type": "stored", "block_hashes": list(CHAIN[:n])}])
    return pool, index


def _request(i: int = 0, blocks: int = len(CHAIN)) -> RouteRequest:
    return RouteRequest(i, "tiny", block_hashes=CHAIN[:blocks])


def _picks(policy: KvCacheAware, n: int, blocks: int = len(CHAIN)) -> Counter[str]:
    counts: Counter[str] = Counter()
    for i in range(n):
        r = Reservation(policy, _request(i, blocks))
        counts[r.worker.url] += 1
        r.finish(True)
    return counts


def test_the_longest_cached_prefix_wins_at_equal_load() -> None:
    pool, index = _setup([4, 20, 0, 12])
    assert _picks(KvCacheAware(pool, index, rng=random.Random(1)), 50) == {"http://w1": 50}


def test_only_the_leading_blocks_count() -> None:
    pool, index = _setup([10, 10])
    index.apply("http://w0", [{"type": "removed", "block_hashes": [CHAIN[0]]}])
    assert _picks(KvCacheAware(pool, index), 10) == {"http://w1": 10}


@pytest.mark.parametrize(
    ("held", "loads", "weight", "winner"),
    [
        # 2 blocks - 0.25 * 10 legs = -0.5 < 0: the idle worker wins
        ([2, 0], [10, 0], 0.25, "http://w1"),
        # 3 - 2.5 = 0.5 > 0: the cache wins over 10 legs
        ([3, 0], [10, 0], 0.25, "http://w0"),
        # with weight 1 it takes 11 blocks to beat 10 legs
        ([10, 0], [10, 0], 1.0, "random"),
        ([11, 0], [10, 0], 1.0, "http://w0"),
        # weight 0: the cache alone decides
        ([1, 0], [1000, 0], 0.0, "http://w0"),
    ],
)
def test_load_outweighs_a_small_match_by_the_formula(
    held: list[int], loads: list[int], weight: float, winner: str
) -> None:
    pool, index = _setup(held, loads)
    counts = _picks(KvCacheAware(pool, index, weight, random.Random(2)), 40)
    if winner == "random":  # a tie
        assert set(counts) == {"http://w0", "http://w1"}
    else:
        assert counts == {winner: 40}


def test_unavailable_workers_never_win() -> None:
    pool, index = _setup([32, 32, 32, 1])
    pool.workers[0].ready = False
    pool.workers[1].draining = True
    pool.workers[2].models = ("other",)
    assert _picks(KvCacheAware(pool, index), 20) == {"http://w3": 20}


def test_a_retry_avoids_the_worker_that_failed_it() -> None:
    pool, index = _setup([32, 1])
    policy = KvCacheAware(pool, index)
    worker = policy.pick(_request().avoiding("http://w0"))
    assert worker.url == "http://w1"
    policy.finish(worker, _request(), False)


def test_without_block_hashes_it_is_least_loaded_and_ties_spread() -> None:
    pool, index = _setup([32, 32, 32], [3, 1, 1])
    counts = _picks(KvCacheAware(pool, index, rng=random.Random(7)), 400, blocks=0)
    assert set(counts) == {"http://w1", "http://w2"}
    assert min(counts.values()) > 150


def test_in_flight_counts_balance() -> None:
    pool, index = _setup([8, 8, 0])
    policy = KvCacheAware(pool, index, rng=random.Random(3))
    open_ = [Reservation(policy, _request(i)) for i in range(30)]
    # Each leg in flight costs 0.25: the two cached workers share, the idle one waits.
    assert [w.in_flight for w in pool.workers] == [15, 15, 0]
    for r in open_:
        r.finish(True)
        r.finish(False)
    assert [w.in_flight for w in pool.workers] == [0, 0, 0]


def test_predicted_blocks_is_the_chosen_workers_match() -> None:
    pool, index = _setup([5, 9])
    policy = KvCacheAware(pool, index)
    r = Reservation(policy, _request())
    assert r.worker.url == "http://w1"
    assert policy.predicted_blocks(r.worker, r.request) == 9
    assert policy.predicted_blocks(pool.workers[0], _request(blocks=3)) == 3
    assert policy.predicted_blocks(r.worker, _request(blocks=0)) == 0
    r.finish(True)


def test_make_policy_builds_it_with_an_index() -> None:
    pool, index = _setup([1])
    policy = make_policy("kv_cache_aware", pool, {"tokens_per_block": 16}, index=index)
    assert isinstance(policy, KvCacheAware) and policy.index is index
    assert policy.load_weight == 0.25
    heavy = make_policy("kv_cache_aware", pool, {"load_weight": 2}, index=index)
    assert isinstance(heavy, KvCacheAware) and heavy.load_weight == 2.0


def test_make_policy_refuses_it_without_an_index() -> None:
    with pytest.raises(ValueError, match="kv_cache_aware needs a PrefixIndex"):
        make_policy("kv_cache_aware", _setup([1])[0], {})


@pytest.mark.parametrize("weight", [-1, "high", True, float("nan"), float("inf")])
def test_a_bad_load_weight_is_refused(weight: object) -> None:
    pool, index = _setup([1])
    with pytest.raises(ValueError, match="load_weight must be"):
        make_policy("kv_cache_aware", pool, {"load_weight": weight}, index=index)


def test_an_unknown_router_type_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown router type 'sticky'; expected one of"):
        make_policy("sticky", _setup([1])[0])
