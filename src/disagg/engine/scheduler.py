"""Continuous batching for the reference worker: one thread owns the model and the KV cache.

Each step batches one decode token for every running sequence plus prefill chunks within a
token budget, so a long prompt never stalls decodes for its whole length. Admission keeps the
cached-token count a router predicted: a waiting prompt holds its cached prefix from arrival,
waits for a prefix block a running prefill is about to commit instead of recomputing it, and
is admitted only while every running sequence keeps room to reach its max_tokens. All KV-cache
access happens on this thread (`call` runs a function there); results go back to asyncio
through per-sequence sinks. It must not do I/O or know about HTTP.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from disagg.engine.kv_cache import BlockManager, OutOfBlocks, PrefixHold, SeqBlocks
from disagg.engine.model import ForwardItem, Model, sample
from disagg.engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass
class Event:
    """What a sequence produced in one step; `finish_reason` set on its last event."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    detok: IncrementalDetokenizer
    context_only: bool = False
    blocks: SeqBlocks | None = None  # given when the prompt's KV already arrived (generation_only)
    hold: PrefixHold | None = None  # its cached prefix, held from arrival until admission
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0
    text: str = ""
    sent: int = 0  # characters of `text` already emitted
    aborted: bool = False
    error: str | None = None  # set with `aborted` when the engine, not the client, ended it
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    # When its leg's timing is asked for: steps by name, on the worker's reporting clock.
    times: dict[str, float] | None = None
    # Run on the scheduler thread as it arrives, before it can be admitted: a generation_only
    # leg stores its transferred KV here, saving a round trip to this thread.
    on_arrival: Callable[[], None] | None = None


class StopCheck:
    """Stop strings: text is held back while it could still be the start of a stop string."""

    @staticmethod
    def find(seq: Sequence) -> int | None:
        hits = [seq.text.find(s) for s in seq.params.stop if s]
        hits = [h for h in hits if h >= 0]
        return min(hits) if hits else None

    @staticmethod
    def safe_len(seq: Sequence) -> int:
        longest = max((len(s) for s in seq.params.stop), default=0)
        return max(seq.sent, len(seq.text) - max(longest - 1, 0))


class Scheduler:
    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        blocks: BlockManager,
        *,
        max_batched_tokens: int = 256,
        lease_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        on_step: Callable[[str, float], None] | None = None,
    ) -> None:
        """`clock`: the time sequences' steps are reported in; `on_step(kind, seconds)`: told
        each forward step's duration, kind "prefill", "decode" or "mixed"."""
        self.model, self.tokenizer, self.bm = model, tokenizer, blocks
        self.clock, self.on_step = clock, on_step
        self.max_batched_tokens = max_batched_tokens
        self.lease_s = lease_s
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pinned: dict[int, tuple[SeqBlocks, float]] = {}
        self._calls: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self.steps = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def next_id(self) -> int:
        return next(self._ids)

    def submit(self, seq: Sequence) -> None:
        """Queue `seq`; it joins `waiting` on the scheduler thread, which alone touches it."""
        self.post(lambda: self._arrive(seq))

    def abort(self, seq: Sequence) -> None:
        """The client is gone: stop the sequence, and drop its KV if it was pinned already."""

        def now() -> None:
            seq.aborted = True
            self.release_pinned(seq.seq_id)

        self.post(now)

    async def call(self, fn: Callable[[], T], undo: Callable[[T], None] | None = None) -> T:
        """Run `fn` on the scheduler thread between steps and await its result.

        When the awaiting coroutine is cancelled before the result arrives, `undo(result)`
        runs on the scheduler thread instead, so nothing `fn` acquired is lost.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def deliver(result: T) -> None:
            if fut.cancelled():
                if undo is not None:
                    self.post(lambda: undo(result))
            else:
                fut.set_result(result)

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting coroutine
                loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                loop.call_soon_threadsafe(deliver, result)

        self.post(run)
        try:
            return await fut
        except asyncio.CancelledError:
            # Cancelled after the result arrived but before this coroutine resumed: the
            # result never reaches the caller, so it is undone here.
            if undo is not None and fut.done() and not fut.cancelled() and not fut.exception():
                result = fut.result()
                self.post(lambda: undo(result))
            raise

    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the scheduler thread between steps, without waiting for it."""
        with self._cond:
            self._calls.append(fn)
            self._cond.notify()

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._calls or self.waiting or self.running):
                    self._cond.wait(timeout=0.5 if self.pinned else None)
                    if self.pinned:
                        break
                if self._stop:
                    return
            if self.step() and not self.running:
                with self._cond:  # admission waits for blocks to be freed or released
                    self._cond.wait(timeout=0.05)
            # Let the event loop thread run now (it sends what this step produced): otherwise
            # a thread stepping back to back keeps the GIL for a whole switch interval (5 ms).
            time.sleep(0)

    def step(self) -> bool:
        """Run the posted calls, then one batch; returns whether admission is blocked on KV
        blocks. Only the scheduler thread calls it (or a test, on a scheduler never started)."""
        with self._cond:
            calls = list(self._calls)
            self._calls.clear()
        try:
            for run in calls:
                run()
            self._sweep_leases()
            return self._batch()
        except Exception:
            log.exception("scheduler step failed; failing the running sequences")
            self._fail_all()
            return False

    def _fail_all(self) -> None:
        seqs = [*self.running, *self.waiting]
        self.running.clear()
        self.waiting.clear()
        for seq in seqs:
            try:
                self._finish(seq, "error", error="internal engine error")
            except Exception:
                log.exception("could not fail sequence %d", seq.seq_id)

    def _batch(self) -> bool:
        """One batch; returns whether admission is blocked on KV blocks."""
        self._drop_aborted()
        blocked = self._admit()
        if not self.running:
            return blocked
        items: list[ForwardItem] = []
        batch: list[Sequence] = []
        budget = self.max_batched_tokens
        for seq in self.running:
            item = self._next_item(seq, budget)
            if item is not None:
                items.append(item)
                batch.append(seq)
                budget -= len(item.token_ids)
        if items:
            kind = _step_kind(batch, items)
            started = time.perf_counter()
            logits = self.model.forward(items, self.bm.kv)
            self.steps += 1
            if self.on_step is not None:
                self.on_step(kind, time.perf_counter() - started)
            for seq, item, row in zip(batch, items, logits, strict=True):
                self._advance(seq, item, row)
        return blocked

    def _drop_aborted(self) -> None:
        for queue in (self.running, self.waiting):
            for seq in [s for s in queue if s.aborted]:
                queue.remove(seq)
                self._finish(seq, "error" if seq.error else "abort", error=seq.error)

    # -- admission --------------------------------------------------------------------------
    #
    # Fairness: waiting sequences are admitted in arrival order, and the first one that does
    # not fit stops admission, so a long prompt is never overtaken for good. The one exception
    # is a sequence waiting for a prefix block that a running prefill is about to commit: it
    # keeps its place while the sequences behind it go ahead. That wait is bounded by the
    # producer's prefill, whose blocks are allocated already; it ends as soon as the block is
    # committed or the producer leaves `running`.

    def _arrive(self, seq: Sequence) -> None:
        if seq.on_arrival is not None:
            try:
                seq.on_arrival()
            except Exception:
                log.exception("sequence %d could not be set up on arrival", seq.seq_id)
                self._finish(seq, "error", error="internal engine error")
                return
        # Hold the cached prefix on arrival, closest to what the router predicted from KV events.
        if seq.blocks is None:  # generation_only sequences come with their KV allocated
            seq.hold = self.bm.hold_prefix(seq.prompt_ids)
        self.waiting.append(seq)

    def _admit(self) -> bool:
        """Move waiting sequences to running in arrival order; True when blocked on blocks."""
        self._extend_holds()
        producing = {h for seq in self.running if seq.blocks for h in seq.blocks.pending_hashes}
        reserved = sum(self._growth(seq) for seq in self.running)
        for seq in list(self.waiting):
            if seq.blocks is None:
                assert seq.hold is not None
                if seq.hold.next_hash in producing:
                    continue  # reuse that block once committed rather than compute it twice
                try:
                    if not self._allocate(seq, reserved):
                        return True
                except OutOfBlocks:
                    self.waiting.remove(seq)
                    self._finish(seq, "error", error="prompt does not fit in the KV cache")
                    continue
                assert seq.blocks is not None
                producing.update(seq.blocks.pending_hashes)
            reserved += self._growth(seq)
            self.waiting.remove(seq)
            self.running.append(seq)
            if seq.times is not None:
                seq.times["scheduled"] = self.clock()
            if seq.output_ids:  # generation_only: the first tokens came from the context leg
                self._emit_tokens(seq, seq.output_ids)
        return False

    def _extend_holds(self) -> None:
        """Also hold the prefix blocks cached since each prompt arrived (or taken up again
        after a release under pressure): the count never shrinks while blocks allow."""
        for seq in self.waiting:
            if seq.hold is not None:
                self.bm.extend_hold(seq.hold)

    def _allocate(self, seq: Sequence, reserved: int) -> bool:
        """Allocate `seq`'s blocks from its hold, keeping `reserved` blocks (and the room `seq`
        itself may grow into) free or evictable; False when it must wait for blocks. Raises
        `OutOfBlocks` when the prompt cannot fit even with every hold released."""
        assert seq.hold is not None
        size = self.bm.block_size
        reserve = reserved + self._growth(seq, -(-len(seq.prompt_ids) // size))
        while True:
            try:
                seq.blocks = self.bm.allocate(seq.prompt_ids, held=seq.hold, reserve=reserve)
                break
            except OutOfBlocks:
                if self.running or self.pinned:
                    return False  # they will free blocks
                if self._release_newest_hold(spare=seq):
                    continue
                if reserve == 0:
                    raise
                # Alone, it may start without its reserve: the server refuses a prompt plus
                # max_tokens that cannot fit, and `_append` still catches an overrun.
                reserve = 0
        seq.num_cached_tokens = seq.num_computed = seq.blocks.num_cached_tokens
        return True

    def _growth(self, seq: Sequence, have: int | None = None) -> int:
        """Blocks `seq` may still take beyond `have` (its blocks now) to reach its last token.
        The last sampled token is never fed back, and context_only stops after the first."""
        if have is None:
            assert seq.blocks is not None
            have = len(seq.blocks.block_table)
        steps = 1 if seq.context_only else max(seq.params.max_tokens, 1)
        need = -(-(len(seq.prompt_ids) + steps - 1) // self.bm.block_size)
        return max(0, need - have)

    def _release_newest_hold(self, spare: Sequence | None = None) -> bool:
        """Under block pressure, drop the prefix hold of the newest waiting sequence (but
        `spare`) that holds any block; False when none does."""
        for seq in reversed(self.waiting):
            if seq is not spare and seq.hold is not None and seq.hold.block_table:
                log.debug("KV blocks are short: sequence %d's prefix is no longer held", seq.seq_id)
                self.bm.release(seq.hold)
                return True
        return False

    def _next_item(self, seq: Sequence, budget: int) -> ForwardItem | None:
        assert seq.blocks is not None
        prompt_len = len(seq.prompt_ids)
        if seq.num_computed < prompt_len:
            if budget <= 0:
                return None
            end = min(prompt_len, seq.num_computed + budget)
            ids = np.asarray(seq.prompt_ids[seq.num_computed : end], dtype=np.int64)
            return ForwardItem(ids, seq.num_computed, seq.blocks.block_table)
        last = seq.output_ids[-1]
        if not self._append(seq.blocks, last):
            # Last resort: admission reserves room for every running sequence to finish.
            seq.aborted, seq.error = True, "the KV cache is full; the sequence cannot grow"
            return None
        pos = seq.blocks.num_tokens - 1
        return ForwardItem(np.asarray([last], dtype=np.int64), pos, seq.blocks.block_table)

    def _append(self, blocks: SeqBlocks, token: int) -> bool:
        """Room for one more token; waiting sequences' prefix holds give way first."""
        while True:
            try:
                self.bm.append(blocks, token)
                return True
            except OutOfBlocks:
                if not self._release_newest_hold():
                    return False

    def _advance(self, seq: Sequence, item: ForwardItem, logits: np.ndarray) -> None:
        assert seq.blocks is not None
        seq.num_computed = item.start_pos + len(item.token_ids)
        self.bm.commit(seq.blocks, seq.num_computed)
        if seq.num_computed < len(seq.prompt_ids):
            return  # more prefill chunks to go
        p = seq.params
        token, _logprob = sample(logits, p.temperature, p.top_p, p.top_k, seq.rng)
        seq.output_ids.append(token)
        self._emit_tokens(seq, [token])

    def _emit_tokens(self, seq: Sequence, tokens: list[int]) -> None:
        if seq.times is not None:
            now = seq.times["last_token"] = self.clock()
            seq.times.setdefault("first_token", now)
        reason: str | None = None
        for token in tokens:
            if token == self.tokenizer.eos_id and not seq.params.ignore_eos:
                reason = "stop"
                break
            seq.text += seq.detok.feed(token)
        if reason is None and (cut := StopCheck.find(seq)) is not None:
            seq.text, reason = seq.text[:cut], "stop"
        if reason is None and len(seq.output_ids) >= seq.params.max_tokens:
            reason = "length"
        if reason is None and seq.context_only:
            reason = "not_finished"
        if reason is None:
            end = StopCheck.safe_len(seq)
            seq.sink(Event(seq.text[seq.sent : end], tokens))
            seq.sent = end
            return
        if reason != "stop" or not seq.params.stop:
            seq.text += seq.detok.flush()
        self.running.remove(seq)
        self._finish(seq, reason, tokens=tokens)

    def _finish(
        self,
        seq: Sequence,
        reason: str,
        *,
        tokens: list[int] | None = None,
        error: str | None = None,
    ) -> None:
        if seq.hold is not None:
            self.bm.release(seq.hold)  # empty unless it ends while waiting
        if seq.blocks is not None:
            if reason == "not_finished":
                self.pinned[seq.seq_id] = (seq.blocks, time.monotonic() + self.lease_s)
            else:
                self.bm.free(seq.blocks)
        seq.sink(Event(seq.text[seq.sent :], tokens or [], reason, error))
        seq.sent = len(seq.text)

    # -- pinned KV for the generation worker ------------------------------------------------

    def take_pinned(self, ctx_request_id: int, start_block: int) -> tuple[np.ndarray, int]:
        """Hand out a pinned sequence's KV blocks (from `start_block`) and release them.
        KeyError when unknown, already fetched or past its lease (even if not yet swept).

        Safe on the event loop thread, sparing the fetch a turn of this one: the entry is
        popped in one step, so exactly one of this, `release_pinned` and the lease sweep gets
        it; nothing writes a pinned sequence's blocks; they are freed on this thread."""
        blocks, deadline = self.pinned.pop(ctx_request_id)
        try:
            if deadline <= time.monotonic():
                raise KeyError(ctx_request_id)
            data = self.bm.read_blocks(blocks.block_table[start_block:])
            return data, len(blocks.token_ids)
        finally:
            self.post(lambda: self.bm.free(blocks))

    def release_pinned(self, ctx_request_id: int) -> bool:
        entry = self.pinned.pop(ctx_request_id, None)
        if entry is not None:
            self.bm.free(entry[0])
        return entry is not None

    def _sweep_leases(self) -> None:
        now = time.monotonic()
        for rid, (_, deadline) in list(self.pinned.items()):  # one step: see take_pinned
            if deadline <= now and self.release_pinned(rid):
                log.warning("pinned KV of request %d not fetched within its lease; freed", rid)

    def stats(self) -> dict[str, Any]:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "pinned": len(self.pinned),
            "steps": self.steps,
            "kv": self.bm.stats(),
        }


def _step_kind(batch: list[Sequence], items: list[ForwardItem]) -> str:
    """Whether a step prefills, decodes, or both."""
    decoding = [it.start_pos >= len(seq.prompt_ids) for seq, it in zip(batch, items, strict=True)]
    return "decode" if all(decoding) else "prefill" if not any(decoding) else "mixed"


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
