"""Tests for the paged KV cache block manager."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from disagg.engine.kv_cache import (
    BlockManager,
    OutOfBlocks,
    PrefixHold,
    SeqBlocks,
    block_hashes,
    hash_block,
)

B = 4


def make(num_blocks: int = 8, block_size: int = B, dtype: str = "float32") -> BlockManager:
    return BlockManager((2, 2, num_blocks, block_size, 1, 3), dtype, event_capacity=100)


def snapshot(m: BlockManager) -> Any:
    return (
        m.stats(),
        list(m._refcount),
        list(m._block_hash),
        dict(m._hash_to_block),
        list(m._free),
        list(m._evictable),
        m.events_since(0),
    )


def test_round_trip_returns_all_blocks() -> None:
    m = make()
    seq = m.allocate(list(range(10)))
    assert len(seq.block_table) == 3
    assert (seq.num_tokens, seq.num_cached_tokens) == (10, 0)
    assert m.stats()["used"] == 3
    m.commit(seq, 10)
    m.append(seq, 99)
    m.free(seq)
    s = m.stats()
    assert s["used"] == 0
    assert s["free"] + s["cached"] == s["num_blocks"] == 8
    assert s["cached"] == 2  # the two full blocks
    m.check_invariants()


def test_prefix_reuse_shares_blocks_and_counts_hits() -> None:
    m = make()
    a = m.allocate(list(range(10)))
    m.commit(a, 10)
    b = m.allocate([*range(8), 50, 51, 52])
    assert b.num_cached_tokens == 2 * B
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert m.refcount(a.block_table[0]) == 2
    s = m.stats()
    assert (s["queried_tokens"], s["hit_tokens"]) == (21, 8)
    m.free(a)
    assert m.refcount(b.block_table[0]) == 1
    m.free(b)
    m.check_invariants()


def test_uncommitted_blocks_are_not_matched() -> None:
    m = make()
    m.allocate(list(range(9)))
    assert m.allocate(list(range(9))).num_cached_tokens == 0


def test_match_cap_leaves_last_token() -> None:
    m = make()
    a = m.allocate(list(range(3 * B)))
    m.commit(a, 3 * B)
    m.free(a)
    b = m.allocate(list(range(3 * B)))
    assert b.num_cached_tokens == 2 * B
    c = m.allocate(list(range(3 * B + 1)))
    assert c.num_cached_tokens == 3 * B
    m.free(b)
    m.free(c)
    one = m.allocate(list(range(B)))
    assert one.num_cached_tokens == 0
    m.check_invariants()


def test_resurrect_from_lru() -> None:
    m = make()
    a = m.allocate(list(range(9)))
    m.commit(a, 9)
    table = list(a.block_table)
    m.free(a)
    assert m.stats()["cached"] == 2
    b = m.allocate(list(range(9)))
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == table[:2]
    assert m.stats()["cached"] == 0
    assert m.stats()["used"] == 3
    m.check_invariants()


def test_lru_eviction_order_and_removed_event() -> None:
    m = make(num_blocks=4)
    a = m.allocate([1] * B + [2] * B + [0])  # blocks 0, 1, 2
    m.commit(a, 2 * B)
    a_hashes = block_hashes(a.token_ids, B)
    m.free(a)  # free: [3, 2]; evictable (LRU first): a's block 1 (tail first), then block 0
    b = m.allocate([7] * B + [0])  # takes the two free blocks
    m.commit(b, B)
    m.free(b)  # free: [b's tail]; evictable: a1, a0, b0
    m.check_invariants()
    last = m.events_since(0)[-1]["event_id"]
    c = m.allocate([9] * (2 * B) + [0])  # 1 free + evicts the two least recently used
    assert c.num_cached_tokens == 0
    ev = m.events_since(last)
    assert [e["type"] for e in ev] == ["removed"]
    assert ev[0]["block_hashes"] == [a_hashes[1], a_hashes[0]]
    assert ev[0]["event_id"] == last + 1
    assert m.stats()["cached"] == 1  # b0 survives and is still matchable
    m.free(c)
    assert m.allocate([7] * B + [5]).num_cached_tokens == B
    assert m.allocate([1] * B + [0]).num_cached_tokens == 0  # a0 was evicted
    m.check_invariants()


def test_first_eviction_removes_tail_block() -> None:
    m = make(num_blocks=3)
    a = m.allocate(list(range(2 * B + 1)))
    m.commit(a, 2 * B)
    h = block_hashes(a.token_ids, B)
    m.free(a)
    other = m.allocate([100] * (B + 1))  # takes the free block and evicts one cached block
    removed = [e for e in m.events_since(0) if e["type"] == "removed"]
    assert removed[0]["block_hashes"] == [h[1]]
    m.free(other)
    # first block still cached and matchable
    assert m.allocate(list(range(B + 1))).num_cached_tokens == B


def test_out_of_blocks_leaves_state_unchanged() -> None:
    m = make(num_blocks=4)
    a = m.allocate(list(range(9)))
    m.commit(a, 8)
    m.free(a)
    keep = m.allocate(list(range(5)))  # reuses a0 via prefix hit, plus one block
    before = snapshot(m)
    with pytest.raises(OutOfBlocks):
        m.allocate(list(range(100, 100 + 4 * B)))
    assert snapshot(m) == before
    assert not m.can_allocate(4 * B)
    # fill up, then append must fail atomically too
    full = m.allocate(list(range(200, 200 + 2 * B)))
    before = snapshot(m)
    seq_before = (list(full.block_table), full.num_tokens, list(full.token_ids))
    with pytest.raises(OutOfBlocks):
        m.append(full, 1)
    assert snapshot(m) == before
    assert (full.block_table, full.num_tokens, full.token_ids) == seq_before
    m.free(keep)
    m.free(full)
    m.check_invariants()


def _cache(m: BlockManager, prompt: list[int]) -> None:
    """Compute `prompt` and free it: its full blocks stay cached (evictable)."""
    seq = m.allocate(prompt)
    m.commit(seq, len(prompt))
    m.free(seq)


def test_hold_keeps_the_cached_prefix_through_eviction_pressure() -> None:
    m = make(num_blocks=8)
    _cache(m, list(range(9)))  # two cached blocks, six free
    prompt = [*range(8), 50, 51]
    hold = m.hold_prefix(prompt)
    assert len(hold.block_table) == 2 and hold.next_hash is None
    held = list(hold.block_table)
    assert m.stats() | {"queried_tokens": 0, "hit_tokens": 0} == {
        "num_blocks": 8,
        "block_size": B,
        "free": 6,
        "used": 2,  # held: out of the evictable LRU
        "cached": 0,
        "queried_tokens": 0,
        "hit_tokens": 0,
    }
    before = snapshot(m)
    with pytest.raises(OutOfBlocks):  # would have to evict a held block
        m.allocate(list(range(100, 100 + 7 * B)))
    assert snapshot(m) == before
    other = m.allocate(list(range(100, 100 + 5 * B)))  # five of the six free blocks
    seq = m.allocate(prompt, held=hold)
    assert seq.num_cached_tokens == 2 * B
    assert seq.block_table[:2] == held
    assert hold.block_table == []  # the references passed to `seq`
    assert not [e for e in m.events_since(0) if e["type"] == "removed"]
    m.release(hold)  # consumed: nothing left to drop
    m.free(seq)
    m.free(other)
    s = m.stats()
    assert (s["used"], s["free"] + s["cached"]) == (0, 8)
    m.check_invariants()


def test_release_gives_held_blocks_back_and_is_idempotent() -> None:
    m = make(num_blocks=8)
    _cache(m, list(range(9)))
    hold = m.hold_prefix([*range(8), 7])
    m.release(hold)
    m.release(hold)
    assert (m.stats()["used"], m.stats()["cached"]) == (0, 2)
    assert m.hold_prefix([9, 9, 9, 9, 9]).block_table == []  # nothing cached: an empty hold
    # A released hold holds nothing, but can be taken up again while the blocks are cached.
    assert m.extend_hold(hold) == 2
    m.release(hold)
    m.check_invariants()
    assert m.stats()["used"] == 0


def test_hold_never_matches_the_last_prompt_token() -> None:
    m = make()
    _cache(m, list(range(3 * B)))
    exact = m.hold_prefix(list(range(2 * B)))  # both blocks cached, only the first may match
    assert len(exact.block_table) == 1 and exact.next_hash is None
    seq = m.allocate(list(range(2 * B)), held=exact)
    assert seq.num_cached_tokens == B
    m.free(seq)
    assert m.stats()["used"] == 0


def test_allocate_extends_the_hold_with_blocks_cached_since() -> None:
    m = make(num_blocks=10)
    prompt = list(range(3 * B + 1))
    hashes = block_hashes(prompt, B)
    first = m.allocate(prompt)
    assert first.pending_hashes == hashes
    m.commit(first, B + 2)
    assert first.pending_hashes == hashes[1:]
    hold = m.hold_prefix(prompt)
    assert len(hold.block_table) == 1 and hold.next_hash == hashes[1]
    m.commit(first, 2 * B)
    assert m.extend_hold(hold) == 2
    m.commit(first, 3 * B)
    assert first.pending_hashes == []
    second = m.allocate(prompt, held=hold)  # the third block was committed after the hold
    assert second.num_cached_tokens == 3 * B
    assert second.block_table[:3] == first.block_table[:3]
    assert second.pending_hashes == []
    s = m.stats()
    assert (s["queried_tokens"], s["hit_tokens"]) == (2 * len(prompt), 3 * B)
    with pytest.raises(ValueError, match="different prompt"):
        m.allocate(prompt[:5], held=m.hold_prefix(prompt))
    m.free(first)
    m.free(second)


def test_allocate_keeps_the_reserve() -> None:
    m = make(num_blocks=8)
    a = m.allocate(list(range(9)), reserve=5)  # 3 blocks, 5 left
    before = snapshot(m)
    with pytest.raises(OutOfBlocks, match="reserve"):
        m.allocate(list(range(100, 105)), reserve=4)  # 2 blocks would leave 3
    assert snapshot(m) == before
    b = m.allocate(list(range(100, 105)), reserve=3)
    m.free(a)
    m.free(b)
    m.check_invariants()


def test_stored_events_and_duplicate_commit() -> None:
    m = make()
    toks = list(range(2 * B + 1))
    a = m.allocate(toks)
    b = m.allocate(toks)  # nothing cached yet: separate blocks with identical content
    m.commit(a, 2 * B + 1)
    h = block_hashes(toks, B)
    ev = m.events_since(0)
    assert len(ev) == 1
    assert ev[0]["type"] == "stored"
    assert ev[0]["block_hashes"] == h
    assert ev[0]["parent_hash"] is None
    assert ev[0]["token_ids"] == toks[: 2 * B]
    m.commit(b, 2 * B + 1)  # identical hashes already mapped: no event, mapping kept
    assert len(m.events_since(0)) == 1
    assert m._hash_to_block[h[0]] == a.block_table[0]
    m.commit(a, B)  # no-op
    m.append(a, 5)
    m.append(a, 6)
    m.append(a, 7)
    m.commit(a, 3 * B)
    ev = m.events_since(1)
    assert len(ev) == 1
    assert ev[0]["parent_hash"] == h[1]
    assert ev[0]["block_hashes"] == [hash_block(h[1], [8, 5, 6, 7])]
    m.free(a)
    m.free(b)
    m.check_invariants()
    assert m.stats()["cached"] == 3
    m.clear()
    assert m.events_since(0)[-1]["type"] == "cleared"
    assert m.stats() | {"queried_tokens": 0, "hit_tokens": 0} == {
        "num_blocks": 8,
        "block_size": B,
        "free": 8,
        "used": 0,
        "cached": 0,
        "queried_tokens": 0,
        "hit_tokens": 0,
    }
    assert m.allocate(toks).num_cached_tokens == 0
    m.check_invariants()


def test_event_capacity_bounded() -> None:
    m = BlockManager((1, 2, 4, 2, 1, 1), "float32", event_capacity=3)
    for _ in range(10):
        m.clear()
    ev = m.events_since(0)
    assert [e["event_id"] for e in ev] == [8, 9, 10]
    assert m.events_since(9) == [ev[-1]]


def test_free_is_idempotent() -> None:
    m = make()
    a = m.allocate(list(range(6)))
    b = m.allocate(list(range(6)))
    m.free(a)
    m.free(a)
    assert m.stats()["used"] == 2
    m.free(b)
    assert m.stats()["used"] == 0
    m.check_invariants()


def test_write_blocks_validation() -> None:
    m = make()
    good = np.ones((2, 2, 2, B, 1, 3), dtype=np.float32)
    m.write_blocks([1, 3], good)
    assert np.array_equal(m.read_blocks([1, 3]), good)
    assert m.read_blocks([3, 1]).shape == (2, 2, 2, B, 1, 3)
    with pytest.raises(ValueError, match="shape"):
        m.write_blocks([1], good)
    with pytest.raises(ValueError, match="dtype"):
        m.write_blocks([1, 3], good.astype(np.float16))
    with pytest.raises(ValueError, match="out of range"):
        m.write_blocks([1, 8], good)
    with pytest.raises(ValueError, match="duplicate"):
        m.write_blocks([1, 1], good)
    r = m.read_blocks([1])
    r[...] = 5
    assert m.kv[0, 0, 1, 0, 0, 0] == 1  # read returns a copy


def test_transfer_flow_between_managers() -> None:
    rng = np.random.default_rng(0)
    shape = (2, 2, 16, B, 2, 3)
    a, b = BlockManager(shape, "float32"), BlockManager(shape, "float32")
    shared = list(range(2 * B))
    prompt = [*shared, *range(100, 100 + B + 2)]
    prefix_kv = rng.standard_normal((2, 2, 2, B, 2, 3)).astype(np.float32)
    # generation worker B has the shared prefix cached from an earlier request
    old = b.allocate([*shared, 1])
    b.write_blocks(old.block_table[:2], prefix_kv)
    b.commit(old, 2 * B)
    b.free(old)
    # context worker A prefills the whole prompt (same prefix -> same KV)
    sa = a.allocate(prompt)
    assert sa.num_cached_tokens == 0
    a.write_blocks(sa.block_table, rng.standard_normal((2, 2, 4, B, 2, 3)).astype(np.float32))
    a.write_blocks(sa.block_table[:2], prefix_kv)
    a.commit(sa, len(prompt))
    # B: only the non-cached blocks travel
    sb = b.allocate(prompt)
    k = sb.num_cached_tokens // b.block_size
    assert k == 2
    b.write_blocks(sb.block_table[k:], a.read_blocks(sa.block_table[k:]))
    b.commit(sb, len(prompt))
    assert np.array_equal(b.read_blocks(sb.block_table), a.read_blocks(sa.block_table))
    assert block_hashes(prompt, B) == sb.hashes == sa.hashes
    # the transferred full block is now matchable on B
    assert b.allocate([*prompt[: 3 * B], 0]).num_cached_tokens == 3 * B
    b.check_invariants()


@given(
    st.lists(st.integers(0, 2**40), max_size=40),
    st.lists(st.integers(0, 2**40), max_size=20),
    st.integers(1, 6),
)
def test_block_hashes_prefix_stable(toks: list[int], more: list[int], bs: int) -> None:
    full = block_hashes(toks + more, bs)
    assert full[: len(toks) // bs] == block_hashes(toks, bs)
    assert len(full) == len(toks + more) // bs


@given(st.lists(st.integers(0, 1000), min_size=2, max_size=40), st.data())
def test_block_hashes_differ_on_earlier_change(toks: list[int], data: st.DataObject) -> None:
    bs = data.draw(st.integers(1, len(toks)))
    i = data.draw(st.integers(0, len(toks) - 1))
    changed = list(toks)
    changed[i] += 1
    h1, h2 = block_hashes(toks, bs), block_hashes(changed, bs)
    first = i // bs
    assert h1[:first] == h2[:first]
    assert all(x != y for x, y in zip(h1[first:], h2[first:], strict=True))


@given(st.lists(st.integers(0, 2**40), max_size=60), st.integers(1, 8))
def test_block_hashes_chain_hash_block(toks: list[int], bs: int) -> None:
    # block_hashes converts the tokens once; it must stay hash_block, block by block
    chain: list[int] = []
    for i in range(len(toks) // bs):
        chain.append(hash_block(chain[-1] if chain else None, toks[i * bs : (i + 1) * bs]))
    assert block_hashes(toks, bs) == chain


def test_block_hashes_known_value() -> None:
    # pins the cross-process hash definition (router recomputes it)
    assert block_hashes([], 4) == []
    assert block_hashes([1, 2, 3], 4) == []
    assert block_hashes([1, 2, 3, 4], 4) == [hash_block(None, [1, 2, 3, 4])]
    assert all(0 <= h < 2**64 for h in block_hashes(list(range(20)), 4))


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = BlockManager((1, 2, 10, 3, 1, 1), "float32", event_capacity=50)
        self.live: list[SeqBlocks] = []
        self.holds: list[tuple[list[int], PrefixHold]] = []  # (prompt, hold) of waiting prompts

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def hold(self, prompt: list[int]) -> None:
        hold = self.m.hold_prefix(prompt)
        assert len(hold.block_table) <= (len(prompt) - 1) // 3
        self.holds.append((prompt, hold))

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def extend_hold(self, data: st.DataObject) -> None:
        _, hold = data.draw(st.sampled_from(self.holds))
        n = len(hold.block_table)
        assert self.m.extend_hold(hold) >= n

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        _, hold = data.draw(st.sampled_from(self.holds))
        self._forget(hold)
        self.m.release(hold)
        self.m.release(hold)

    @precondition(lambda self: self.holds)
    @rule(data=st.data(), reserve=st.integers(0, 3))
    def allocate_held(self, data: st.DataObject, reserve: int) -> None:
        prompt, hold = data.draw(st.sampled_from(self.holds))
        held = len(hold.block_table)
        before = snapshot(self.m)
        try:
            seq = self.m.allocate(prompt, held=hold, reserve=reserve)
        except OutOfBlocks:
            assert snapshot(self.m) == before and len(hold.block_table) == held
            return
        assert seq.num_cached_tokens >= held * 3  # a hold never shrinks
        assert hold.block_table == []
        self._forget(hold)
        self.live.append(seq)

    def _forget(self, hold: PrefixHold) -> None:
        self.holds = [e for e in self.holds if e[1] is not hold]

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def allocate(self, prompt: list[int]) -> None:
        before = snapshot(self.m)
        try:
            seq = self.m.allocate(prompt)
        except OutOfBlocks:
            assert snapshot(self.m) == before
            return
        assert seq.num_tokens == len(prompt)
        assert seq.num_cached_tokens % 3 == 0
        assert seq.num_cached_tokens < len(prompt)
        assert len(seq.block_table) == -(-len(prompt) // 3)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tok=st.integers(0, 2))
    def append(self, data: st.DataObject, tok: int) -> None:
        seq = data.draw(st.sampled_from(self.live))
        n = seq.num_tokens
        try:
            self.m.append(seq, tok)
        except OutOfBlocks:
            assert seq.num_tokens == n
            return
        assert seq.num_tokens == n + 1 == len(seq.token_ids)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.m.commit(seq, data.draw(st.integers(0, seq.num_tokens)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.m.free(seq)
        self.m.free(seq)

    @rule()
    def clear(self) -> None:
        self.m.clear()

    @invariant()
    def consistent(self) -> None:
        self.m.check_invariants()
        expected = [0] * self.m.num_blocks
        for seq in self.live:
            assert len(seq.block_table) * 3 >= seq.num_tokens
            for b in seq.block_table:
                expected[b] += 1
        for _, hold in self.holds:
            for b in hold.block_table:
                expected[b] += 1
        assert [self.m.refcount(b) for b in range(self.m.num_blocks)] == expected
        s = self.m.stats()
        assert s["free"] + s["cached"] + s["used"] == s["num_blocks"]
        assert s["used"] == sum(1 for c in expected if c > 0)

    def teardown(self) -> None:
        for seq in self.live:
            self.m.free(seq)
        for _, hold in self.holds:
            self.m.release(hold)
        s = self.m.stats()
        assert s["used"] == 0
        assert s["free"] + s["cached"] == s["num_blocks"]
        self.m.check_invariants()


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_event_window_and_cached_hashes() -> None:
    bm = BlockManager((2, 2, 4, 2, 1, 3), "float32", event_capacity=2)
    assert bm.last_event_id == 0 and bm.has_events_since(0) and not bm.has_events_since(1)
    for i in range(3):  # three sequences of one full block each: three stored events
        seq = bm.allocate([i, i, 9])
        bm.commit(seq, 3)
        bm.free(seq)
    assert bm.last_event_id == 3
    assert bm.has_events_since(1) and bm.has_events_since(3)  # events 2 and 3 are kept
    assert not bm.has_events_since(0)  # event 1 was dropped: the caller must resync
    assert sorted(bm.cached_hashes()) == sorted(
        h for i in range(3) for h in block_hashes([i, i], 2)
    )


def test_read_events_from_another_thread_while_the_cache_changes() -> None:
    """A router's poll reads the event log while the scheduler thread stores and evicts:
    every read is a consistent prefix of the final log, ids without gaps; a cursor older
    than the retained events reads None (the poller needs a snapshot)."""
    m = BlockManager((1, 2, 6, 2, 1, 1), "float32", event_capacity=10_000)
    stop = threading.Event()
    seen: list[tuple[list[dict[str, Any]], int]] = []

    def poll() -> None:
        cursor = 0
        while not stop.is_set():
            read = m.read_events(cursor)
            assert read is not None
            events, last = read
            ids = [e["event_id"] for e in events]
            assert ids == list(range(cursor + 1, last + 1))
            seen.append(read)
            cursor = last

    reader = threading.Thread(target=poll)
    reader.start()
    for i in range(300):  # distinct prompts: every allocation stores, then evicts
        seq = m.allocate([i, i + 1, i + 2, i + 3, i + 4])
        m.commit(seq, 5)
        m.free(seq)
    stop.set()
    reader.join(10)
    got = [e for events, _ in seen for e in events]
    assert got == m.events_since(0)[: len(got)]
    small = BlockManager((1, 2, 4, 2, 1, 1), "float32", event_capacity=2)
    for i in range(4):
        seq = small.allocate([10 * i, 10 * i + 1, 10 * i + 2])
        small.commit(seq, 3)
        small.free(seq)
    assert small.read_events(0) is None  # the first events are gone
    last = small.last_event_id
    assert small.read_events(last) == ([], last)
