"""Continuous batching for the reference worker: one thread owns the model and the KV cache.

Each step batches one decode token for every running sequence plus prefill chunks within a
token budget, so a long prompt never stalls decodes for its whole length. All KV-cache access
happens on this thread (`call` runs a function there); results go back to asyncio through
per-sequence sinks. It must not do I/O or know about HTTP.
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

from disagg.engine.kv_cache import BlockManager, OutOfBlocks, SeqBlocks
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
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0
    text: str = ""
    sent: int = 0  # characters of `text` already emitted
    aborted: bool = False
    error: str | None = None  # set with `aborted` when the engine, not the client, ended it
    rng: np.random.Generator = field(default_factory=np.random.default_rng)


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
    ) -> None:
        self.model, self.tokenizer, self.bm = model, tokenizer, blocks
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
        with self._cond:
            self.waiting.append(seq)
            self._cond.notify()

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
        return await fut

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
                calls = list(self._calls)
                self._calls.clear()
            try:
                for run in calls:
                    run()
                self._sweep_leases()
                if self._step() and not self.running:
                    with self._cond:  # admission waits for blocks to be freed or released
                        self._cond.wait(timeout=0.05)
            except Exception:
                log.exception("scheduler step failed; failing the running sequences")
                self._fail_all()

    def _fail_all(self) -> None:
        seqs = [*self.running, *self.waiting]
        self.running.clear()
        self.waiting.clear()
        for seq in seqs:
            try:
                self._finish(seq, "error", error="internal engine error")
            except Exception:
                log.exception("could not fail sequence %d", seq.seq_id)

    def _step(self) -> bool:
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
            logits = self.model.forward(items, self.bm.kv)
            self.steps += 1
            for seq, item, row in zip(batch, items, logits, strict=True):
                self._advance(seq, item, row)
        return blocked

    def _drop_aborted(self) -> None:
        for queue in (self.running, self.waiting):
            for seq in [s for s in queue if s.aborted]:
                queue.remove(seq)
                self._finish(seq, "error" if seq.error else "abort", error=seq.error)

    def _admit(self) -> bool:
        """Move waiting sequences to running while blocks last; True when blocked."""
        while self.waiting:
            seq = self.waiting[0]
            if seq.blocks is None:
                try:
                    seq.blocks = self.bm.allocate(seq.prompt_ids)
                except OutOfBlocks:
                    if not self.running and not self.pinned:
                        # Nothing will free blocks: the prompt can't fit the cache at all.
                        self.waiting.popleft()
                        self._finish(seq, "error", error="prompt does not fit in the KV cache")
                        continue
                    return True
                seq.num_cached_tokens = seq.blocks.num_cached_tokens
                seq.num_computed = seq.num_cached_tokens
            self.waiting.popleft()
            self.running.append(seq)
            if seq.output_ids:  # generation_only: the first tokens came from the context leg
                self._emit_tokens(seq, seq.output_ids)
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
        try:
            self.bm.append(seq.blocks, last)
        except OutOfBlocks:
            seq.aborted, seq.error = True, "the KV cache is full; the sequence cannot grow"
            return None
        pos = seq.blocks.num_tokens - 1
        return ForwardItem(np.asarray([last], dtype=np.int64), pos, seq.blocks.block_table)

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
        KeyError when unknown, already fetched or past its lease (even if not yet swept)."""
        blocks, deadline = self.pinned.pop(ctx_request_id)
        try:
            if deadline <= time.monotonic():
                raise KeyError(ctx_request_id)
            data = self.bm.read_blocks(blocks.block_table[start_block:])
            return data, len(blocks.token_ids)
        finally:
            self.bm.free(blocks)

    def release_pinned(self, ctx_request_id: int) -> bool:
        entry = self.pinned.pop(ctx_request_id, None)
        if entry is not None:
            self.bm.free(entry[0])
        return entry is not None

    def _sweep_leases(self) -> None:
        now = time.monotonic()
        for rid in [r for r, (_, deadline) in self.pinned.items() if deadline <= now]:
            log.warning("pinned KV of request %d not fetched within its lease; freed", rid)
            self.release_pinned(rid)

    def stats(self) -> dict[str, Any]:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "pinned": len(self.pinned),
            "steps": self.steps,
            "kv": self.bm.stats(),
        }


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
