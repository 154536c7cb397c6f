"""Paged KV cache block manager for the reference worker: block ids, refcounts, prefix cache.

Owns the ``kv`` storage array and the bookkeeping of which physical block belongs to whom, plus KV
events for a router. A waiting prompt can hold its cached prefix (``hold_prefix``) so the blocks
leave the evictable LRU until ``allocate`` starts from them or ``release`` gives them back.
It does no I/O, starts no threads and computes no model math; it is called from one scheduler
thread only (not thread-safe), except its event log, which a router's poll reads from any
thread without waiting for the scheduler's step to end.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "ROOT_HASH",
    "BlockManager",
    "OutOfBlocks",
    "PrefixHold",
    "SeqBlocks",
    "block_hashes",
    "hash_block",
]


def _blake64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


#: Parent hash of the first block of every sequence.
ROOT_HASH: int = _blake64(b"disagg.kv_cache.root")


def hash_block(parent_hash: int | None, tokens: Sequence[int]) -> int:
    """Chained hash of one block: ``blake2b(digest_size=8)`` over ``parent`` + ``tokens``.

    ``parent`` is the parent hash as 8 little-endian unsigned bytes (``ROOT_HASH`` when ``None``),
    ``tokens`` the token ids as little-endian int64. The result is the digest read as a
    little-endian unsigned 64-bit Python int; it is identical across processes and platforms.
    """
    parent = ROOT_HASH if parent_hash is None else parent_hash
    payload = parent.to_bytes(8, "little") + np.asarray(tokens, dtype="<i8").tobytes()
    return _blake64(payload)


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block is ignored);
    the same as ``hash_block`` block by block, with the tokens converted once."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n = len(token_ids) // block_size
    if n == 0:
        return []
    data = memoryview(np.asarray(token_ids[: n * block_size], dtype="<i8").tobytes())
    step = 8 * block_size
    parent = ROOT_HASH.to_bytes(8, "little")
    out: list[int] = []
    for i in range(n):
        h = hashlib.blake2b(parent, digest_size=8)
        h.update(data[i * step : (i + 1) * step])
        parent = h.digest()
        out.append(int.from_bytes(parent, "little"))
    return out


class OutOfBlocks(Exception):
    """Not enough free or evictable blocks; the manager's state was left unchanged."""


@dataclass
class SeqBlocks:
    """One sequence's view of the cache."""

    block_table: list[int]  # physical block ids, in order
    num_tokens: int  # tokens whose KV is (or will be, this step) in the cache
    num_cached_tokens: int  # prompt tokens found in the prefix cache at allocation time
    token_ids: list[int]  # all tokens so far (needed to hash blocks as they fill)
    # Chained hashes of the leading full blocks already committed (or matched); internal.
    hashes: list[int] = field(default_factory=list, repr=False)
    # Chained hashes of every full block of the prompt, committed or not; internal.
    prompt_hashes: list[int] = field(default_factory=list, repr=False)
    freed: bool = field(default=False, repr=False)

    @property
    def pending_hashes(self) -> list[int]:
        """Hashes of the full prompt blocks allocated here whose KV is not committed yet."""
        return self.prompt_hashes[len(self.hashes) :]


@dataclass
class PrefixHold:
    """References on the leading cached blocks of a prompt that waits to be allocated.

    Held blocks are out of the evictable LRU, so the prefix found at arrival survives the wait.
    An empty hold (released, consumed by ``allocate``, or nothing cached) holds nothing and may
    be extended again.
    """

    prompt_hashes: list[int]  # chained hashes of the prompt's full blocks
    matchable: int  # leading blocks that may be matched: >= 1 prompt token is left to compute
    block_table: list[int] = field(default_factory=list)  # held blocks: prompt blocks [0, n)

    @property
    def next_hash(self) -> int | None:
        """Hash of the first block past the held prefix, None when no further block may match."""
        n = len(self.block_table)
        return self.prompt_hashes[n] if n < self.matchable else None


class BlockManager:
    """Manages ``num_blocks`` blocks of ``block_size`` tokens in ``kv``.

    ``kv`` has shape ``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)``.
    A block is in exactly one of three states: free (no hash, refcount 0), cached/evictable
    (hash, refcount 0, in the LRU) or used (refcount > 0, with or without a hash).
    Events get ids 1, 2, 3, ...; ``events_since(0)`` returns every event still retained.
    """

    def __init__(
        self, kv_shape: tuple[int, ...], dtype: str | np.dtype[Any], event_capacity: int = 10000
    ) -> None:
        if len(kv_shape) != 6 or any(int(d) <= 0 for d in kv_shape) or int(kv_shape[1]) != 2:
            raise ValueError(
                "kv_shape must be (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)"
                f" with positive dims, got {kv_shape}"
            )
        if event_capacity <= 0:
            raise ValueError(f"event_capacity must be positive, got {event_capacity}")
        self.kv: np.ndarray[Any, np.dtype[Any]] = np.zeros(
            tuple(int(d) for d in kv_shape), dtype=dtype
        )
        self.num_blocks: int = int(kv_shape[2])
        self.block_size: int = int(kv_shape[3])
        self._refcount: list[int] = [0] * self.num_blocks
        self._block_hash: list[int | None] = [None] * self.num_blocks
        self._hash_to_block: dict[int, int] = {}
        self._free: deque[int] = deque(range(self.num_blocks))
        # Evictable cached blocks, least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._events: deque[dict[str, Any]] = deque(maxlen=event_capacity)
        self._next_event_id = 1
        # Guards the two above: a poll reads them between a step's evictions, not after the
        # step (a step of a busy worker takes long enough for the router to act on old news).
        self._events_lock = threading.Lock()
        self._queried_tokens = 0
        self._hit_tokens = 0

    # ------------------------------------------------------------------ helpers

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _emit(self, event: dict[str, Any]) -> None:
        with self._events_lock:
            event["event_id"] = self._next_event_id
            self._next_event_id += 1
            self._events.append(event)

    def _take_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks (free list first, then LRU eviction); caller checked availability."""
        taken: list[int] = []
        removed: list[int] = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                h = self._block_hash[block]
                assert h is not None
                del self._hash_to_block[h]
                self._block_hash[block] = None
                removed.append(h)
            self._refcount[block] = 1
            taken.append(block)
        if removed:
            self._emit({"type": "removed", "block_hashes": removed})
        return taken

    def _empty_hold(self, prompt_ids: Sequence[int]) -> PrefixHold:
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids must not be empty")
        # The last prompt token is always computed: its logits give the first output token.
        matchable = (len(prompt_ids) - 1) // self.block_size
        return PrefixHold(block_hashes(prompt_ids, self.block_size), matchable)

    def _match_past(self, hold: PrefixHold) -> list[int]:
        """Cached blocks that continue the held prefix, up to the first miss (not referenced)."""
        blocks: list[int] = []
        for h in hold.prompt_hashes[len(hold.block_table) : hold.matchable]:
            block = self._hash_to_block.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _ref(self, block: int) -> None:
        if self._refcount[block] == 0:
            del self._evictable[block]
        self._refcount[block] += 1

    def _unref(self, blocks: list[int]) -> None:
        """Drop one reference on each block; the last one listed becomes evictable first."""
        for block in reversed(blocks):
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                if self._block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # ------------------------------------------------------------------ sequence API

    def hold_prefix(self, prompt_ids: Sequence[int]) -> PrefixHold:
        """Reference the cached prefix of ``prompt_ids`` (as ``allocate`` would match it) so it
        cannot be evicted; end it with ``allocate(prompt_ids, held=...)`` or ``release``."""
        hold = self._empty_hold(prompt_ids)
        self.extend_hold(hold)
        return hold

    def extend_hold(self, hold: PrefixHold) -> int:
        """Also hold the blocks past the held prefix that are cached by now; returns the number
        of blocks held (it never shrinks here). Allocates nothing, so it never evicts."""
        for block in self._match_past(hold):
            self._ref(block)
            hold.block_table.append(block)
        return len(hold.block_table)

    def release(self, hold: PrefixHold) -> None:
        """Drop the hold's references (its blocks become evictable again); idempotent."""
        self._unref(hold.block_table)
        hold.block_table = []

    def allocate(
        self, prompt_ids: Sequence[int], *, held: PrefixHold | None = None, reserve: int = 0
    ) -> SeqBlocks:
        """Allocate blocks for ``prompt_ids``: the blocks ``held`` for it (``hold_prefix`` of the
        same prompt), then every further cached block of its prefix, then new blocks.

        Raises ``OutOfBlocks`` (state unchanged) unless the blocks can be provided with at least
        ``reserve`` free or evictable blocks left over. On success the hold's references pass to
        the returned blocks and ``held`` is left empty. Newly full prompt blocks are registered
        only by a later ``commit``.
        """
        hold = self._empty_hold(prompt_ids) if held is None else held
        if len(hold.prompt_hashes) != len(prompt_ids) // self.block_size:
            raise ValueError("the hold was taken for a different prompt")
        extra = self._match_past(hold)
        matched = len(hold.block_table) + len(extra)
        needed = self._blocks_for(len(prompt_ids)) - matched
        resurrected = sum(1 for b in extra if self._refcount[b] == 0)
        available = len(self._free) + len(self._evictable) - resurrected
        if needed + reserve > available:
            raise OutOfBlocks(
                f"need {needed} blocks for a {len(prompt_ids)}-token prompt and {reserve} in"
                f" reserve, {available} available"
            )
        for block in extra:
            self._ref(block)
        table = hold.block_table + extra + self._take_blocks(needed)
        hold.block_table = []
        num_cached = matched * self.block_size
        self._queried_tokens += len(prompt_ids)
        self._hit_tokens += num_cached
        return SeqBlocks(
            block_table=table,
            num_tokens=len(prompt_ids),
            num_cached_tokens=num_cached,
            token_ids=list(prompt_ids),
            hashes=hold.prompt_hashes[:matched],
            prompt_hashes=list(hold.prompt_hashes),
        )

    def commit(self, seq: SeqBlocks, num_computed: int) -> None:
        """Mark KV of tokens ``[0, num_computed)`` valid; register the full blocks within it."""
        if seq.freed:
            raise ValueError("commit on a freed sequence")
        if not 0 <= num_computed <= seq.num_tokens:
            raise ValueError(f"num_computed={num_computed} outside [0, {seq.num_tokens}]")
        bs = self.block_size
        run: list[int] = []  # hashes newly stored in the current contiguous run
        run_parent: int | None = None
        run_tokens: list[int] = []
        known = seq.prompt_hashes  # the prompt's blocks were hashed at allocation
        for i in range(len(seq.hashes), num_computed // bs):
            parent = seq.hashes[-1] if seq.hashes else None
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            h = known[i] if i < len(known) else hash_block(parent, tokens)
            seq.hashes.append(h)
            block = seq.block_table[i]
            if h in self._hash_to_block:  # duplicate content: keep the existing mapping
                self._flush_stored(run, run_parent, run_tokens)
                run, run_tokens = [], []
                continue
            self._hash_to_block[h] = block
            self._block_hash[block] = h
            if not run:
                run_parent = parent
            run.append(h)
            run_tokens.extend(tokens)
        self._flush_stored(run, run_parent, run_tokens)

    def _flush_stored(self, hashes: list[int], parent: int | None, tokens: list[int]) -> None:
        if hashes:
            self._emit(
                {
                    "type": "stored",
                    "block_hashes": list(hashes),
                    "parent_hash": parent,
                    "token_ids": list(tokens),
                }
            )

    def append(self, seq: SeqBlocks, token_id: int) -> None:
        """Reserve space for one more token; raises ``OutOfBlocks`` (state unchanged) if full."""
        if seq.freed:
            raise ValueError("append on a freed sequence")
        if seq.num_tokens >= len(seq.block_table) * self.block_size:
            if not self._free and not self._evictable:
                raise OutOfBlocks("no free or evictable block to extend the sequence")
            seq.block_table.extend(self._take_blocks(1))
        seq.token_ids.append(int(token_id))
        seq.num_tokens += 1

    def free(self, seq: SeqBlocks) -> None:
        """Drop the sequence's references; idempotent. Tail blocks become evictable first."""
        if seq.freed:
            return
        seq.freed = True
        self._unref(seq.block_table)
        seq.block_table = []

    def can_allocate(self, num_tokens: int) -> bool:
        """Conservative: enough free + evictable blocks for ``num_tokens`` without prefix hits."""
        return self._blocks_for(num_tokens) <= len(self._free) + len(self._evictable)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def stats(self) -> dict[str, int]:
        free, cached = len(self._free), len(self._evictable)
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "free": free,
            "used": self.num_blocks - free - cached,
            "cached": cached,
            "queried_tokens": self._queried_tokens,
            "hit_tokens": self._hit_tokens,
        }

    def events_since(self, event_id: int) -> list[dict[str, Any]]:
        """Retained events with id > ``event_id``, oldest first."""
        with self._events_lock:
            return [dict(e) for e in self._events if e["event_id"] > event_id]

    @property
    def last_event_id(self) -> int:
        return self._next_event_id - 1

    def has_events_since(self, event_id: int) -> bool:
        """Whether every event after ``event_id`` is still retained (none was dropped)."""
        with self._events_lock:
            return self._retained(event_id)

    def _retained(self, event_id: int) -> bool:  # under _events_lock
        oldest = self._events[0]["event_id"] if self._events else self._next_event_id
        return oldest - 1 <= event_id <= self._next_event_id - 1

    def read_events(self, event_id: int) -> tuple[list[dict[str, Any]], int] | None:
        """The events after ``event_id`` and the id of the last one, read at once; safe from
        any thread. None when some were dropped already (the reader needs a snapshot)."""
        with self._events_lock:
            if not self._retained(event_id):
                return None
            events = [dict(e) for e in self._events if e["event_id"] > event_id]
            return events, self._next_event_id - 1

    def cached_hashes(self) -> list[int]:
        """The hash of every block the cache holds now (used or evictable)."""
        return list(self._hash_to_block)

    def clear(self) -> None:
        """Drop every evictable cached block (in-use blocks keep their hashes); emit "cleared"."""
        for block in self._evictable:
            h = self._block_hash[block]
            assert h is not None
            del self._hash_to_block[h]
            self._block_hash[block] = None
            self._free.append(block)
        self._evictable.clear()
        self._emit({"type": "cleared"})

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if internal bookkeeping is inconsistent (for tests)."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "duplicate in free list"
        assert not free & evictable, "block both free and evictable"
        for b in range(self.num_blocks):
            rc, h = self._refcount[b], self._block_hash[b]
            assert rc >= 0, f"negative refcount on block {b}"
            assert (rc == 0) == (b in free or b in evictable), f"block {b} state mismatch"
            assert b not in free or h is None, f"free block {b} has a hash"
            assert b not in evictable or h is not None, f"evictable block {b} lacks a hash"
            assert h is None or self._hash_to_block.get(h) == b, f"block {b} hash not mapped"
        assert all(self._block_hash[b] == h for h, b in self._hash_to_block.items())

    # ------------------------------------------------------------------ KV transfer

    def _check_ids(self, block_ids: Sequence[int]) -> list[int]:
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids out of range [0, {self.num_blocks}): {bad}")
        return ids

    def read_blocks(self, block_ids: Sequence[int]) -> np.ndarray[Any, np.dtype[Any]]:
        """Copy of ``kv[:, :, block_ids]``, shape ``(L, 2, n, B, kvh, hd)``."""
        ids = self._check_ids(block_ids)
        return self.kv[:, :, ids].copy()

    def write_blocks(self, block_ids: Sequence[int], data: np.ndarray[Any, np.dtype[Any]]) -> None:
        """Write ``data`` (shape ``(L, 2, n, B, kvh, hd)``, same dtype as ``kv``) into blocks."""
        ids = self._check_ids(block_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate block ids in write_blocks: {ids}")
        L, two, _, bs, kvh, hd = self.kv.shape
        expected = (L, two, len(ids), bs, kvh, hd)
        if tuple(data.shape) != expected:
            raise ValueError(f"write_blocks: data shape {tuple(data.shape)} != expected {expected}")
        if data.dtype != self.kv.dtype:
            raise ValueError(f"write_blocks: data dtype {data.dtype} != kv dtype {self.kv.dtype}")
        self.kv[:, :, ids] = data
