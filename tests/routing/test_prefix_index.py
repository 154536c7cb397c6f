"""The prefix index agrees with a naive model (per worker a set of hashes, one LRU over all
entries) under random event streams with holes, restarts and tight bounds; it counts leading
hashes only; and fed a real BlockManager's events it predicts that worker's cache hit exactly.

Hashes are content addresses, so the streams draw from one tree of them: a stored event is a
piece of a path in it (each hash the child of the one before), a prompt is a path from a root
with unknown hashes after it. Removals, evictions and restarts may leave any holes."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.engine.kv_cache import BlockManager, OutOfBlocks, block_hashes
from disagg.routing.prefix_index import PrefixIndex

URLS = [f"http://w{i}" for i in range(4)]
# The tree's hashes: small, negative and past 64 bits too. NEW are in no event.
VALUES = [0, 1, 2, 3, 5, 8, 13, -1, -(2**63), 2**64 - 1, 2**64, 2**70 + 3, 77, 99]
NEW = [10**9 + i for i in range(4)]


class Tree:
    """Node i's parent is a node before it, or none (a prompt's first block)."""

    def __init__(self, parents: list[int | None]) -> None:
        self.parents = parents

    def path(self, node: int) -> list[int]:
        out: list[int] = []
        at: int | None = node
        while at is not None:
            out.append(VALUES[at])
            at = self.parents[at]
        return out[::-1]

    def parent_of(self) -> dict[int, int | None]:
        return {VALUES[i]: None if p is None else VALUES[p] for i, p in enumerate(self.parents)}


class Model:
    """The spec, plainly: entries (url, hash) in store order, oldest evicted first."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.entries: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.expected: set[tuple[str, int]] = set()  # entries no stored event confirmed
        self.evicted = self.unknown = 0

    def _add(self, key: tuple[str, int]) -> None:
        self.entries[key] = None
        self.entries.move_to_end(key)

    def _bound(self) -> None:  # after each chain, as the index does
        while len(self.entries) > self.max_blocks:
            old, _ = self.entries.popitem(last=False)
            self.expected.discard(old)
            self.evicted += 1

    def _drop(self, key: tuple[str, int]) -> None:
        self.entries.pop(key, None)
        self.expected.discard(key)

    def expect(self, url: str, hashes: list[int]) -> None:
        for h in hashes:
            if (url, h) not in self.entries:
                self.expected.add((url, h))
            self._add((url, h))
        self._bound()

    def expire(self, url: str, hashes: list[int]) -> None:
        for h in hashes:
            if (url, h) in self.expected:
                self._drop((url, h))

    def apply(self, url: str, events: list[dict[str, Any]]) -> None:
        for e in events:
            if e["type"] == "stored":
                for h in e["block_hashes"]:
                    self.expected.discard((url, h))
                    self._add((url, h))
                self._bound()
            elif e["type"] == "removed":
                for h in e["block_hashes"]:
                    self._drop((url, h))
            elif e["type"] == "cleared":
                self.forget(url)
            else:
                self.unknown += 1

    def forget(self, url: str) -> None:
        for key in [k for k in self.entries if k[0] == url]:
            self._drop(key)

    def held(self, url: str) -> set[int]:
        return {h for u, h in self.entries if u == url}

    def orphans(self, tree: Tree) -> int:
        """Entries whose parent block that worker lacks."""
        up = tree.parent_of()
        return sum(
            1 for u, h in self.entries if up[h] is not None and (u, up[h]) not in self.entries
        )

    def match(self, hashes: Sequence[int], urls: list[str]) -> dict[str, int]:
        out = {}
        for url in urls:
            held, n = self.held(url), 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            out[url] = n
        return out


def _tree(draw: st.DrawFn) -> Tree:
    n = draw(st.integers(1, len(VALUES)))
    parents = [None, *(draw(st.none() | st.integers(0, i - 1)) for i in range(1, n))]
    return Tree(parents)


def _event(draw: st.DrawFn, tree: Tree) -> dict[str, Any]:
    nodes = st.integers(0, len(tree.parents) - 1)
    kind = draw(st.sampled_from(["stored", "stored", "removed", "cleared", "updated"]))
    if kind == "stored":  # a piece of one path: its parent is the hash before the piece
        path = tree.path(draw(nodes))
        cut = draw(st.integers(0, len(path) - 1))
        event: dict[str, Any] = {"type": kind, "block_hashes": path[cut:]}
        if cut or draw(st.booleans()):
            event["parent_hash"] = path[cut - 1] if cut else None
        return event
    if kind == "removed":
        return {"type": kind, "block_hashes": [VALUES[i] for i in draw(st.lists(nodes))]}
    return {"type": kind, "block_hashes": [VALUES[0]]}  # "updated": a type it does not know


def _prompt(draw: st.DrawFn, tree: Tree) -> list[int]:
    path = tree.path(draw(st.integers(0, len(tree.parents) - 1)))
    return path[: draw(st.integers(0, len(path)))] + NEW[: draw(st.integers(0, len(NEW)))]


@settings(max_examples=400)
@given(max_blocks=st.integers(1, 30), data=st.data())
def test_agrees_with_the_naive_model(max_blocks: int, data: st.DataObject) -> None:
    tree = data.draw(st.composite(_tree)())
    index, model = PrefixIndex(max_blocks), Model(max_blocks)
    for _ in range(data.draw(st.integers(0, 40))):
        url = data.draw(st.sampled_from(URLS))
        op = data.draw(st.sampled_from(["events", "events", "forget", "match", "expect", "expire"]))
        if op == "events":
            events = data.draw(st.lists(st.composite(_event)(tree), max_size=4))
            index.apply(url, events)
            model.apply(url, events)
        elif op in ("expect", "expire"):  # a routed prompt, or one whose wait is over
            prompt = tree.path(data.draw(st.integers(0, len(tree.parents) - 1)))
            getattr(index, op)(url, prompt)
            getattr(model, op)(url, prompt)
        elif op == "forget":
            index.forget(url)
            model.forget(url)
        else:
            prompt = data.draw(st.composite(_prompt)(tree))
            urls = data.draw(st.lists(st.sampled_from([*URLS, "http://unknown"])))
            assert index.match(prompt, urls) == model.match(prompt, urls)
        stats = index.stats()
        assert stats["entries"] == len(model.entries) <= max_blocks
        held = {url: len(model.held(url)) for url in URLS if model.held(url)}
        assert stats["workers"] == held
        assert stats["evicted"] == model.evicted
        assert stats["expected"] == len(model.expected)
        assert stats["unknown_events"] == model.unknown
        assert stats["orphans"] == model.orphans(tree)  # no more walking than holes need
    for node in range(len(tree.parents)):  # every prompt the tree has, on every worker
        prompt = tree.path(node)
        assert index.match(prompt, URLS) == model.match(prompt, URLS)


@settings(max_examples=100)
@given(
    workers=st.integers(1, 70),
    data=st.data(),
)
def test_many_workers_on_one_chain(workers: int, data: st.DataObject) -> None:
    """Each worker holds a prefix of one chain, some with holes: the walk that serves all of
    them and the per-worker finish agree with the model for any number of workers."""
    chain = list(range(1000, 1040))
    index, model = PrefixIndex(), Model(10**6)
    urls = [f"http://w{i}" for i in range(workers)]
    for url in urls:
        n = data.draw(st.integers(0, len(chain)))
        holes = data.draw(st.lists(st.sampled_from(chain), max_size=2))
        for m in (index, model):
            m.apply(url, [{"type": "stored", "block_hashes": chain[:n]}])
            m.apply(url, [{"type": "removed", "block_hashes": holes}])
    query = chain[: data.draw(st.integers(0, len(chain)))]
    assert index.match(query, urls) == model.match(query, urls)


def test_counts_leading_hashes_only() -> None:
    index = PrefixIndex()
    index.apply("a", [{"type": "stored", "block_hashes": [1, 2, 3, 4], "event_id": 1}])
    index.apply("b", [{"type": "stored", "block_hashes": [1, 2, 9], "event_id": 1}])
    index.apply("a", [{"type": "removed", "block_hashes": [2], "event_id": 2}])
    assert index.match([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 1, "b": 2, "c": 0}
    assert index.match([5, 1, 2], ["b"]) == {"b": 0}  # it holds 1 and 2, not the lead
    assert index.match([], ["a"]) == {"a": 0}


def test_eviction_takes_the_least_recently_stored() -> None:
    index = PrefixIndex(max_blocks=3)
    index.apply("a", [{"type": "stored", "block_hashes": [1, 2]}])
    index.apply("b", [{"type": "stored", "block_hashes": [1]}])
    index.apply("a", [{"type": "stored", "block_hashes": [1]}])  # refreshed: a/2 is oldest now
    index.apply("b", [{"type": "stored", "block_hashes": [2]}])
    assert index.match([1, 2], ["a", "b"]) == {"a": 1, "b": 2}
    stats = index.stats()
    assert (stats["entries"], stats["evicted"], stats["workers"]) == (3, 1, {"a": 1, "b": 2})


def test_a_forgotten_worker_holds_nothing_and_its_id_is_reused() -> None:
    index = PrefixIndex()
    for url in ("a", "b", "c"):
        index.apply(url, [{"type": "stored", "block_hashes": [7, 8]}])
    index.forget("b")
    index.apply("d", [{"type": "stored", "block_hashes": [7]}])
    assert index.match([7, 8], ["a", "b", "c", "d"]) == {"a": 2, "b": 0, "c": 2, "d": 1}
    index.apply("a", [{"type": "cleared", "event_id": 9}])
    assert index.match([7, 8], ["a", "c"]) == {"a": 0, "c": 2}
    assert index.stats()["workers"] == {"c": 2, "d": 1}


def test_malformed_events_raise_after_the_earlier_ones_apply() -> None:
    index = PrefixIndex()
    with pytest.raises(ValueError, match="stored KV event without a block_hashes list"):
        index.apply("a", [{"type": "stored", "block_hashes": [1]}, {"type": "stored"}])
    assert index.match([1], ["a"]) == {"a": 1}
    with pytest.raises(ValueError, match="max_blocks must be positive"):
        PrefixIndex(0)


def test_stats_report_size() -> None:
    index = PrefixIndex()
    index.apply("a", [{"type": "stored", "block_hashes": list(range(100))}])
    index.apply("b", [{"type": "stored", "block_hashes": list(range(50))}])
    stats = index.stats()
    assert (stats["entries"], stats["hashes"]) == (150, 100)
    assert 0 < stats["approx_bytes"] < 1000 * 150


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_predicts_a_block_managers_cache_hit(seed: int) -> None:
    """Requests with shared prefixes come and go on a small real BlockManager (so it evicts);
    before each new one, the index fed its events predicts the manager's hit exactly."""
    rng = random.Random(seed)
    bs = 4
    manager = BlockManager((1, 2, 24, bs, 1, 1), "float32")
    index, seen, running = PrefixIndex(), 0, []
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(0, 30))] for _ in range(4)]
    for _ in range(40):
        prompt = [*rng.choice(prefixes), *(rng.randrange(50) for _ in range(rng.randrange(1, 9)))]
        events = manager.events_since(seen)
        seen = events[-1]["event_id"] if events else seen
        index.apply("w", events)
        predicted = index.match(block_hashes(prompt[:-1], bs), ["w"])["w"]
        try:
            seq = manager.allocate(prompt)
        except OutOfBlocks:
            continue
        assert predicted * bs == seq.num_cached_tokens
        manager.commit(seq, len(prompt))
        running.append(seq)
        if len(running) > 2 or rng.random() < 0.5:
            manager.free(running.pop(rng.randrange(len(running))))
