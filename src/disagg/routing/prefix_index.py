"""Which worker holds which KV block hashes, as their KV events say; and for a prompt's chained
block hashes, how many leading blocks each worker holds. Bounded: past `max_blocks` entries the
least recently stored go. Pure and single-threaded (the event loop's): it does no I/O, never
routes, and trusts the hashes it is given (it never hashes tokens itself).

Besides what the events say, it holds what the router expects: the blocks of a prompt just
routed to a worker (`expect`), which that worker is about to compute, until the worker's own
stored event confirms them or the router lets them `expire`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["PrefixIndex"]

# A (hash, worker) pair packs into one int, the hash shifted left past the worker's id: less
# memory than a tuple, and exact for any int hash.
_ID_BITS = 16
_ID_MASK = (1 << _ID_BITS) - 1
# Workers with holes are matched by walking; with at most this many left, each finishes alone
# on its own set, a C-level `issuperset` per run of hashes.
_FEW = 4
_FIRST_RUN, _MAX_RUN = 8, 256
# Measured with tracemalloc on CPython 3.11 (bench/routing.py): per (hash, worker) entry
# and per distinct hash.
_BYTES_PER_ENTRY, _BYTES_PER_HASH = 260, 170


class PrefixIndex:
    """Worker url -> the block hashes it holds, fed by `apply` with the worker's KV events.

    Events: `{"type": "stored", "block_hashes": [...], "parent_hash": p}` adds a chain (each
    hash the child of the one before, the first of `p`; no `p`: the chain starts the prompt),
    and a second store refreshes a hash (and confirms an expected one).
    `{"type": "removed", "block_hashes": [...]}` drops
    hashes, `{"type": "cleared"}` all of the worker's. Other types are counted and skipped;
    `event_id` and `token_ids` are not read (the feed keeps the cursor). A worker that
    restarted or must be resynced is `forget`-ten, then fed its snapshot, in any order.
    About 260 bytes an entry on CPython: the default bound is some 300 MB.

    Matching is exact, and fast where it can be: a KV cache drops a block's children before the
    block, so a worker's hashes are usually whole chains. The index counts, per worker, the
    hashes it holds without their parent ("orphans"); where there are none, presence along a
    chain is monotone and a few bisection probes find each worker's count, else it walks.
    """

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        self._holders: dict[int, int] = {}  # hash -> bitmask of the worker ids holding it
        self._parent: dict[int, int | None] = {}  # held hash -> its parent (None: first block)
        self._kids: dict[int, int] = {}  # packed (hash, worker) -> its held children there
        self._lru: OrderedDict[int, None] = OrderedDict()  # packed entries, oldest first
        self._held: dict[str, set[int]] = {}  # url -> its hashes; only workers holding some
        self._bits: dict[str, int] = {}  # url -> 1 << its worker id, for those in `_held`
        self._urls: list[str] = []  # worker id -> url; "" where free
        self._orphans: list[int] = []  # worker id -> its hashes held without their parent
        self._holed = 0  # bitmask of the workers with orphans
        self._expected: set[int] = set()  # packed entries no stored event has confirmed yet
        self._evicted = 0
        self._unknown = 0

    # ---------------------------------------------------------------------- feeding

    def apply(self, url: str, events: Iterable[Mapping[str, Any]]) -> None:
        """Apply `url`'s events in order. A stored or removed event without a list of
        `block_hashes` raises `ValueError`; the events before it stay applied."""
        for event in events:
            kind = event.get("type")
            if kind == "stored":
                self._store(url, _hashes_of(event), event.get("parent_hash"), confirm=True)
            elif kind == "removed":
                self._remove(url, _hashes_of(event))
            elif kind == "cleared":
                self.forget(url)
            else:
                self._unknown += 1

    def expect(self, url: str, hashes: Sequence[int]) -> None:
        """A prompt with these chained hashes was just routed to `url`: count its blocks
        there from now (it will store them), refreshing those it holds, until a stored event
        confirms them or `expire` drops them."""
        self._store(url, hashes, None, confirm=False)

    def expire(self, url: str, hashes: Sequence[int]) -> None:
        """Drop those of `hashes` on `url` that are still only expected."""
        bit = self._bits.get(url)
        if bit is None or not self._expected:
            return
        wid = bit.bit_length() - 1
        for h in hashes:
            key = (h << _ID_BITS) | wid
            if key in self._expected:
                del self._lru[key]
                self._drop(h, wid, key)

    def forget(self, url: str) -> None:
        """Drop everything `url` holds (it restarted, or is about to be resynced)."""
        held = self._held.get(url)
        if held is None:
            return
        wid = self._bits[url].bit_length() - 1
        keep, lru, kids = ~(1 << wid), self._lru, self._kids
        holders, parents = self._holders, self._parent
        for h in held:
            key = (h << _ID_BITS) | wid
            del lru[key]
            self._expected.discard(key)
            kids.pop(key, None)
            parent = parents[h]
            if parent is not None:
                kids.pop((parent << _ID_BITS) | wid, None)
            mask = holders[h] & keep
            if mask:
                holders[h] = mask
            else:
                del holders[h], parents[h]
        self._release(url, wid)

    def _store(self, url: str, hashes: Sequence[int], parent: int | None, confirm: bool) -> None:
        if not hashes:
            return
        bit = self._bits.get(url)
        wid = self._new_id(url) if bit is None else bit.bit_length() - 1
        held, lru, holders, mine = self._held[url], self._lru, self._holders, 1 << wid
        expected = self._expected
        for h in hashes:
            key = (h << _ID_BITS) | wid
            if key in lru:
                lru.move_to_end(key)
                if confirm:
                    expected.discard(key)
            else:
                lru[key] = None
                if not confirm:
                    expected.add(key)
                held.add(h)
                holders[h] = holders.get(h, 0) | mine
                self._link(h, parent, wid, key)
            parent = h
        while len(lru) > self.max_blocks:
            self._evict()

    def _link(self, h: int, parent: int | None, wid: int, key: int) -> None:
        """Count the new entry `key` (hash `h` on worker `wid`) into the orphan bookkeeping."""
        parent = self._parent.setdefault(h, None if parent == h else parent)
        if parent is not None:
            up = (parent << _ID_BITS) | wid
            self._kids[up] = self._kids.get(up, 0) + 1
            if up not in self._lru:
                self._orphaned(wid, 1)
        waiting = self._kids.get(key, 0)  # children stored before it are whole again
        if waiting:
            self._orphaned(wid, -waiting)

    def _remove(self, url: str, hashes: Sequence[int]) -> None:
        bit = self._bits.get(url)
        if bit is None:
            return
        wid = bit.bit_length() - 1
        for h in hashes:
            key = (h << _ID_BITS) | wid
            if key in self._lru:
                del self._lru[key]
                self._drop(h, wid, key)

    def _evict(self) -> None:
        key, _ = self._lru.popitem(last=False)
        self._evicted += 1
        self._drop(key >> _ID_BITS, key & _ID_MASK, key)

    def _drop(self, h: int, wid: int, key: int) -> None:
        """Take hash `h` from worker `wid`; its LRU entry `key` is already gone."""
        self._expected.discard(key)
        url = self._urls[wid]
        held = self._held[url]
        held.discard(h)
        mask = self._holders[h] & ~(1 << wid)
        if mask:
            self._holders[h] = mask
            parent = self._parent[h]
        else:
            del self._holders[h]
            parent = self._parent.pop(h)
        if parent is not None:
            up = (parent << _ID_BITS) | wid
            left = self._kids[up] - 1
            if left:
                self._kids[up] = left
            else:
                del self._kids[up]
            if up not in self._lru:  # it was an orphan itself
                self._orphaned(wid, -1)
        waiting = self._kids.get(key, 0)  # its children there lose their parent
        if waiting:
            self._orphaned(wid, waiting)
        if not held:  # a worker holding nothing gives its id back
            self._release(url, wid)

    def _orphaned(self, wid: int, delta: int) -> None:
        left = self._orphans[wid] + delta
        self._orphans[wid] = left
        if left:
            self._holed |= 1 << wid
        else:
            self._holed &= ~(1 << wid)

    def _new_id(self, url: str) -> int:
        if not url:
            raise ValueError("a worker url must not be empty")
        try:
            wid = self._urls.index("")
        except ValueError:
            wid = len(self._urls)
            if wid > _ID_MASK:
                raise ValueError(f"more than {_ID_MASK + 1} workers in one index") from None
            self._urls.append("")
            self._orphans.append(0)
        self._urls[wid], self._bits[url], self._held[url] = url, 1 << wid, set()
        return wid

    def _release(self, url: str, wid: int) -> None:
        del self._held[url], self._bits[url]
        self._urls[wid], self._orphans[wid] = "", 0
        self._holed &= ~(1 << wid)

    # ---------------------------------------------------------------------- matching

    def match(self, hashes: Sequence[int], urls: Iterable[str]) -> dict[str, int]:
        """For each of `urls`: how many leading hashes of `hashes` it holds, stopping at its
        first miss. `hashes` is a chain (each the child of the one before), as
        `disagg.engine.kv_cache.block_hashes` gives; unknown hashes may follow it."""
        out = dict.fromkeys(urls, 0)
        alive, bits = 0, self._bits.get
        for url in out:
            alive |= bits(url, 0)
        if not alive or not hashes:
            return out
        whole = alive & ~self._holed
        if whole:
            self._bisect(hashes, whole, out)
        if alive != whole:
            self._scan(hashes, alive ^ whole, out)
        return out

    def _bisect(self, hashes: Sequence[int], workers: int, out: dict[str, int]) -> None:
        """Counts of `workers`, none with orphans: each holds hashes[j] iff its count > j, so
        one probe splits a group of workers by which side of j their counts lie."""
        get, urls = self._holders.get, self._urls
        first = get(hashes[0], 0) & workers  # most workers share nothing: done at once
        todo = [(1, len(hashes), first)] if first else []
        while todo:
            lo, hi, group = todo.pop()  # every count in `group` lies in [lo, hi]
            if lo == hi:
                while group:
                    bit = group & -group
                    group ^= bit
                    out[urls[bit.bit_length() - 1]] = lo
                continue
            mid = (lo + hi) // 2
            above = get(hashes[mid], 0) & group
            if above:
                todo.append((mid + 1, hi, above))
            if above != group:
                todo.append((lo, mid, group ^ above))

    def _scan(self, hashes: Sequence[int], workers: int, out: dict[str, int]) -> None:
        """Counts of `workers` with holes, hash by hash: one walk for all while more than a
        few hold everything so far, then each on its own set."""
        start, urls = 0, self._urls
        if workers.bit_count() > _FEW:
            start, workers = self._walk(hashes, workers, out)
        while workers:
            bit = workers & -workers
            workers ^= bit
            url = urls[bit.bit_length() - 1]
            out[url] = start + _run(self._held[url], hashes, start)

    def _walk(self, hashes: Sequence[int], alive: int, out: dict[str, int]) -> tuple[int, int]:
        """Walk while more than `_FEW` workers hold all so far, writing the count of each that
        drops out into `out`. Returns (position, workers left)."""
        get, urls = self._holders.get, self._urls
        for i, h in enumerate(hashes):
            mask = get(h, 0) & alive
            if mask != alive:
                lost, alive = alive ^ mask, mask
                while i and lost:  # those lost at the first hash keep their 0
                    bit = lost & -lost
                    lost ^= bit
                    out[urls[bit.bit_length() - 1]] = i
                if mask.bit_count() <= _FEW:
                    return i + 1, alive
        return len(hashes), alive

    # ---------------------------------------------------------------------- reporting

    def stats(self) -> dict[str, Any]:
        """`entries` ((hash, worker) pairs), `workers` (url -> entries, for those holding
        any), `hashes` (distinct), `orphans` (entries whose parent that worker lacks),
        `expected` (entries no stored event confirmed yet), `evicted`, `unknown_events`,
        `approx_bytes`."""
        return {
            "entries": len(self._lru),
            "workers": {url: len(held) for url, held in self._held.items()},
            "hashes": len(self._holders),
            "orphans": sum(self._orphans),
            "expected": len(self._expected),
            "max_blocks": self.max_blocks,
            "evicted": self._evicted,
            "unknown_events": self._unknown,
            "approx_bytes": len(self._lru) * _BYTES_PER_ENTRY
            + len(self._holders) * _BYTES_PER_HASH,
        }


def _hashes_of(event: Mapping[str, Any]) -> Sequence[int]:
    hashes = event.get("block_hashes")
    if not isinstance(hashes, list | tuple):
        raise ValueError(f"a {event.get('type')} KV event without a block_hashes list: {event!r}")
    return hashes


def _run(held: set[int], hashes: Sequence[int], start: int) -> int:
    """How many of `hashes[start:]` in a row `held` holds: growing runs checked in C, then
    the run that misses walked to its first miss."""
    i, n, size = start, len(hashes), _FIRST_RUN
    while i < n:
        run = hashes[i : i + size]
        if held.issuperset(run):
            i += len(run)
            size = min(size * 2, _MAX_RUN)
            continue
        for h in run:
            if h not in held:
                break
            i += 1
        break
    return i - start
