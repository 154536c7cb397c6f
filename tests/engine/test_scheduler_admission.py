"""Admission in the reference worker's scheduler: a waiting prompt keeps the cached prefix it
found on arrival, waits for a prefix block a running prefill is about to commit instead of
recomputing it, and is admitted only while every running sequence keeps room to finish.

The tiny model with 4-token blocks; the scheduler is driven step by step on the test's thread
(never started), except in the last test, which runs its thread. Every test ends with the leak
check: nothing waiting or running, all blocks free or evictable.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np
import pytest

from disagg.engine.kv_cache import BlockManager
from disagg.engine.model import Model
from disagg.engine.scheduler import Event, SamplingParams, Scheduler, Sequence
from disagg.engine.tokenizer import ByteTokenizer, IncrementalDetokenizer

B = 4


@pytest.fixture(scope="module")
def tiny() -> Model:
    return Model.tiny()


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, size=n)]


class Worker:
    """A scheduler and its block manager; records every sequence's events, in order."""

    def __init__(self, model: Model, num_blocks: int, max_batched_tokens: int = 256) -> None:
        self.bm = BlockManager(model.kv_shape(num_blocks, B), model.config.dtype)
        self.tokenizer = ByteTokenizer()
        self.sched = Scheduler(
            model, self.tokenizer, self.bm, max_batched_tokens=max_batched_tokens
        )
        self.log: list[tuple[int, Event]] = []  # (seq_id, event) as delivered

    def submit(self, prompt: Seq[int], max_tokens: int, *, context_only: bool = False) -> Sequence:
        seq_id = self.sched.next_id()
        seq = Sequence(
            seq_id=seq_id,
            prompt_ids=list(prompt),
            params=SamplingParams(max_tokens, temperature=0.0, ignore_eos=True),
            sink=lambda ev: self.log.append((seq_id, ev)),
            detok=IncrementalDetokenizer(self.tokenizer),
            context_only=context_only,
        )
        self.sched.submit(seq)
        return seq

    def finish(self, seq: Sequence) -> Event | None:
        return next((ev for i, ev in self.log if i == seq.seq_id and ev.finish_reason), None)

    def first_event(self, seq: Sequence) -> int:
        return next(n for n, (i, _) in enumerate(self.log) if i == seq.seq_id)

    def last_event(self, seq: Sequence) -> int:
        return max(n for n, (i, _) in enumerate(self.log) if i == seq.seq_id)

    def run(self, *seqs: Sequence, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if all(self.finish(s) for s in seqs):
                return
            self.sched.step()
        raise AssertionError("sequences did not finish")

    def assert_ok(self, seq: Sequence, reason: str = "length") -> None:
        ev = self.finish(seq)
        assert ev is not None and (ev.finish_reason, ev.error) == (reason, None)

    def assert_drained(self) -> None:
        """The leak check: nothing waits or runs, and every block is free or evictable."""
        stats = self.sched.stats()
        assert (stats["running"], stats["waiting"], stats["pinned"]) == (0, 0, 0)
        kv = stats["kv"]
        assert kv["used"] == 0 and kv["free"] + kv["cached"] == kv["num_blocks"]
        self.bm.check_invariants()


def solo(model: Model, prompt: Seq[int], max_tokens: int) -> list[int]:
    """Greedy output of `prompt` alone on a roomy worker: what batching must not change."""
    w = Worker(model, 64)
    seq = w.submit(prompt, max_tokens)
    w.run(seq)
    return seq.output_ids


def cache(w: Worker, prompt: Seq[int]) -> None:
    """Serve `prompt` for one token, leaving its full blocks cached (evictable)."""
    seq = w.submit(prompt, 1)
    w.run(seq)


# -- 1. the cached prefix is held from arrival ---------------------------------------------


def test_waiting_prompt_keeps_the_prefix_cached_at_arrival(tiny: Model) -> None:
    w = Worker(tiny, 16)
    a, b = tokens(1, 9), tokens(2, 9)
    cache(w, a)
    cache(w, b)  # LRU: a's two blocks, then b's
    # r grows to 14 of the 16 blocks: it takes the free ones, then evicts the cached ones.
    r = w.submit(tokens(3, 8), 49)
    w.sched.step()
    late = [*a[:8], *tokens(4, 3)]
    waiter = w.submit(late, 2)  # finds a's prefix cached; must wait for r's room to grow
    w.run(r, waiter)
    w.assert_ok(r)
    w.assert_ok(waiter)
    assert w.first_event(waiter) > w.last_event(r)  # it waited while r grew, then started
    assert waiter.num_cached_tokens == 2 * B  # what was cached when it arrived
    probe = w.submit([*b[:8], 0], 1)  # b's blocks were evicted in its place
    w.run(probe)
    assert probe.num_cached_tokens == 0
    assert r.output_ids == solo(tiny, r.prompt_ids, 49)
    assert waiter.output_ids == solo(tiny, late, 2)
    w.assert_drained()


def test_aborted_waiting_prompt_drops_its_hold(tiny: Model) -> None:
    w = Worker(tiny, 16)
    a = tokens(1, 9)
    cache(w, a)
    r = w.submit(tokens(3, 8), 51)  # leaves no room for anything else to start
    w.sched.step()
    waiter = w.submit([*a[:8], 5, 6, 7], 2)
    w.sched.step()
    assert w.sched.stats()["waiting"] == 1
    assert w.sched.stats()["kv"]["cached"] == 0  # a's blocks are held
    w.sched.abort(waiter)
    w.sched.step()
    ev = w.finish(waiter)
    assert ev is not None and ev.finish_reason == "abort"
    assert w.sched.stats()["kv"]["cached"] >= 1  # back in the LRU (r may evict them now)
    w.run(r)
    w.assert_ok(r)
    w.assert_drained()


class _Broken:
    def forward(self, items: Any, kv: Any) -> Any:
        raise RuntimeError("the accelerator fell off")


def test_failed_step_drops_the_holds_of_waiting_prompts(tiny: Model) -> None:
    w = Worker(tiny, 16)
    a = tokens(1, 9)
    cache(w, a)
    r = w.submit(tokens(3, 8), 51)
    w.sched.step()
    waiter = w.submit([*a[:8], 5, 6, 7], 2)
    w.sched.step()
    assert w.sched.stats()["waiting"] == 1 and w.sched.stats()["kv"]["cached"] == 0
    w.sched.model = _Broken()  # type: ignore[assignment]
    w.sched.step()
    for seq in (r, waiter):
        ev = w.finish(seq)
        assert ev is not None and ev.error == "internal engine error"
    w.assert_drained()


def test_holds_give_way_to_the_head_of_the_queue(tiny: Model) -> None:
    w = Worker(tiny, 8)
    a = tokens(1, 9)
    cache(w, a)
    head = w.submit(tokens(2, 8 * B), 1)  # needs all 8 blocks, a's two held ones included
    waiter = w.submit([*a[:8], 9], 1)
    too_big = w.submit(tokens(3, 8 * B + 1), 1)  # 9 blocks: can never fit
    w.run(head, waiter, too_big)
    w.assert_ok(head)
    w.assert_ok(waiter)
    ev = w.finish(too_big)
    assert ev is not None and ev.error == "prompt does not fit in the KV cache"
    assert waiter.num_cached_tokens == 0  # its prefix was evicted for the head
    assert waiter.output_ids == solo(tiny, waiter.prompt_ids, 1)
    w.assert_drained()


def test_holds_give_way_to_a_running_sequence_that_must_grow(tiny: Model) -> None:
    w = Worker(tiny, 16)
    a = tokens(1, 9)
    cache(w, a)
    # r was admitted counting a's evictable blocks in its room to grow (15 of 16 blocks).
    r = w.submit(tokens(3, 8), 53)
    w.sched.step()
    waiter = w.submit([*a[:8], 5, 6, 7], 2)  # holding a's blocks takes that room away
    w.run(r, waiter)
    w.assert_ok(r)
    w.assert_ok(waiter)
    assert len(r.output_ids) == 53
    assert waiter.num_cached_tokens < 2 * B  # r evicted part of the released prefix
    assert waiter.output_ids == solo(tiny, waiter.prompt_ids, 2)
    w.assert_drained()


# -- 2. a prefix block being prefilled is waited for, not recomputed -----------------------


def test_same_prefix_waits_for_the_running_prefill(tiny: Model) -> None:
    w = Worker(tiny, 64, max_batched_tokens=8)  # a 20-token prompt takes three steps
    shared = tokens(1, 4 * B)
    first = w.submit([*shared, *tokens(2, 4)], 3)
    second = w.submit([*shared, *tokens(3, 4)], 3)
    unrelated = w.submit(tokens(4, 4), 3)
    w.sched.step()
    assert w.sched.stats()["running"] == 2  # first and unrelated: the queue does not stall
    w.run(first, second, unrelated)
    for seq in (first, second, unrelated):
        w.assert_ok(seq)
        assert seq.output_ids == solo(tiny, seq.prompt_ids, 3)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 4 * B  # every shared block reused, none recomputed
    w.assert_drained()


def test_prefix_wait_ends_when_the_producer_leaves(tiny: Model) -> None:
    w = Worker(tiny, 64, max_batched_tokens=8)
    shared = tokens(1, 4 * B)
    first = w.submit([*shared, *tokens(2, 4)], 3)
    second = w.submit([*shared, *tokens(3, 4)], 3)
    w.sched.step()  # first computed its first 8 tokens; second waits for the next block
    w.sched.abort(first)
    w.sched.step()
    ev = w.finish(first)
    assert ev is not None and ev.finish_reason == "abort"
    assert w.sched.stats()["running"] == 1  # second is not left waiting
    w.run(second)
    w.assert_ok(second)
    assert second.num_cached_tokens == 2 * B  # what first had committed before it left
    assert second.output_ids == solo(tiny, second.prompt_ids, 3)
    w.assert_drained()


# -- 3. admission keeps room for every running sequence to finish --------------------------


def test_admission_reserves_room_to_reach_max_tokens(tiny: Model) -> None:
    w = Worker(tiny, 8)
    long = w.submit(tokens(1, 4), 20)  # grows to 6 blocks
    other = w.submit(tokens(2, 4), 12)  # grows to 4: both at once would run out mid-decode
    w.run(long, other)
    w.assert_ok(long)
    w.assert_ok(other)
    assert w.first_event(other) > w.last_event(long)
    assert long.output_ids == solo(tiny, long.prompt_ids, 20)
    assert other.output_ids == solo(tiny, other.prompt_ids, 12)
    w.assert_drained()


def test_context_only_reserves_room_for_its_prompt_only(tiny: Model) -> None:
    w = Worker(tiny, 8)
    long = w.submit(tokens(1, 4), 20)  # keeps 5 blocks in reserve
    ctx = w.submit(tokens(2, 2 * B), 20, context_only=True)  # 2 blocks; stops after one token
    w.sched.step()
    w.assert_ok(ctx, "not_finished")
    assert w.sched.release_pinned(ctx.seq_id)
    w.run(long)
    w.assert_ok(long)
    w.assert_drained()


def test_a_lone_sequence_is_not_starved_by_its_reserve(tiny: Model) -> None:
    w = Worker(tiny, 8)  # the server refuses this; here the last-resort abort still holds
    seq = w.submit(tokens(1, 4), 40)
    w.run(seq)
    ev = w.finish(seq)
    assert ev is not None and ev.error == "the KV cache is full; the sequence cannot grow"
    assert len(seq.output_ids) == 8 * B - 4 + 1
    w.assert_drained()


# -- the scheduler thread ------------------------------------------------------------------


def test_submissions_from_another_thread_balance(tiny: Model) -> None:
    """Shared prefixes under block pressure, submitted and aborted while the thread runs."""
    w = Worker(tiny, 24, max_batched_tokens=16)
    done = threading.Semaphore(0)
    w.log = _Notifying(done)
    systems = [tokens(s, 3 * B) for s in range(3)]
    prompts = [[*systems[i % 3], *tokens(100 + i, 1 + i % 5)] for i in range(12)]
    w.sched.start()
    try:
        seqs = [w.submit(p, 4 + i % 6) for i, p in enumerate(prompts)]
        w.sched.abort(seqs[5])
        w.sched.abort(seqs[9])
        for _ in seqs:
            assert done.acquire(timeout=30)
    finally:
        w.sched.stop()
    for i, seq in enumerate(seqs):
        ev = w.finish(seq)
        assert ev is not None and ev.error is None
        if ev.finish_reason == "length":
            assert seq.output_ids == solo(tiny, prompts[i], 4 + i % 6)
        else:
            assert i in (5, 9) and ev.finish_reason == "abort"
    w.assert_drained()


class _Notifying(list[tuple[int, Event]]):
    """An event log that signals each sequence's last event."""

    def __init__(self, done: threading.Semaphore) -> None:
        super().__init__()
        self.done = done

    def append(self, item: tuple[int, Event]) -> None:
        super().append(item)
        if item[1].finish_reason is not None:
            self.done.release()


@pytest.mark.parametrize("when", ["before_result", "after_result"])
def test_a_cancelled_call_undoes_its_result(tiny: Model, when: str) -> None:
    """`Scheduler.call(fn, undo)`: a caller cancelled before `fn`'s result arrives, or after
    it arrived but before the caller resumed, never gets it, so `undo` gets it instead
    (generation legs allocate their KV blocks this way)."""
    w = Worker(tiny, num_blocks=8)
    undone: list[int] = []

    async def scenario() -> None:
        task = asyncio.create_task(w.sched.call(lambda: 42, undo=undone.append))
        await asyncio.sleep(0)  # the call is posted
        if when == "before_result":
            task.cancel()
            await asyncio.sleep(0)
        w.sched.step()  # runs it; the result is handed to the loop
        await asyncio.sleep(0)  # the result lands in the future; the task is not resumed yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)

    asyncio.run(scenario())
    w.sched.step()  # runs the posted undo
    assert undone == [42]


def test_pinned_kv_is_taken_once_from_another_thread(tiny: Model) -> None:
    """`take_pinned` runs on the event loop thread while the scheduler steps: exactly one
    taker (fetch, release or lease sweep) gets a pinned sequence's KV, the copy matches the
    blocks, and the blocks are freed on the scheduler thread."""
    w = Worker(tiny, num_blocks=16)
    ctx = w.submit(tokens(3, 3 * B), 20, context_only=True)
    w.run(ctx)
    done = w.finish(ctx)
    assert done is not None and done.finish_reason == "not_finished"
    blocks = w.sched.pinned[ctx.seq_id][0]
    expect = w.bm.read_blocks(blocks.block_table[1:])
    got: list[tuple[np.ndarray, int]] = []
    taker = threading.Thread(target=lambda: got.append(w.sched.take_pinned(ctx.seq_id, 1)))
    taker.start()
    taker.join(timeout=10)
    assert len(got) == 1 and got[0][1] == 3 * B  # the prompt's tokens
    np.testing.assert_array_equal(got[0][0], expect)
    assert not w.sched.release_pinned(ctx.seq_id)  # gone: nobody else gets it
    with pytest.raises(KeyError):
        w.sched.take_pinned(ctx.seq_id, 0)
    w.sched.step()  # the posted free
    w.assert_drained()


def test_a_failed_arrival_ends_only_its_sequence(tiny: Model) -> None:
    """A sequence whose `on_arrival` (a generation leg storing its KV) raises ends with an
    engine error and gives its blocks back; the others run on."""
    w = Worker(tiny, num_blocks=16)
    ok = w.submit(tokens(4, 2 * B), 3)
    bad = Sequence(
        seq_id=w.sched.next_id(),
        prompt_ids=tokens(5, 2 * B),
        params=SamplingParams(3, temperature=0.0, ignore_eos=True),
        sink=lambda ev: w.log.append((bad.seq_id, ev)),
        detok=IncrementalDetokenizer(w.tokenizer),
    )
    bad.blocks = w.bm.allocate(bad.prompt_ids)

    def fail() -> None:
        raise ValueError("store failed")

    bad.on_arrival = fail
    w.sched.submit(bad)
    w.run(ok, bad)
    w.assert_ok(ok)
    ev = w.finish(bad)
    assert ev is not None and (ev.finish_reason, ev.error) == ("error", "internal engine error")
    w.assert_drained()
