"""Cache-aware placement: the available worker whose KV cache holds the longest prefix of the
prompt wins, unless its load outweighs that (TensorRT-LLM's `kv_cache_aware` score). It reads a
`PrefixIndex` that others feed; it never changes the index and does no I/O."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

from disagg.cluster import Pool, WorkerState
from disagg.routing import RouteRequest
from disagg.routing.candidates import candidates
from disagg.routing.prefix_index import PrefixIndex

DEFAULT_LOAD_WEIGHT = 0.25  # TensorRT-LLM's `load_weight`


class KvCacheAware:
    """score(worker) = matched_blocks - load_weight * in_flight, highest wins, a tie at random.

    `matched_blocks`: how many leading blocks of `RouteRequest.block_hashes` the index says the
    worker holds; `in_flight`: legs on it now. With the default weight of 0.25 one more block
    cached outweighs a quarter of a leg in flight: 4 cached blocks (64 tokens at 16 a block)
    balance one extra leg. A request without block hashes goes to a least-loaded worker.
    """

    def __init__(
        self,
        pool: Pool,
        index: PrefixIndex,
        load_weight: float = DEFAULT_LOAD_WEIGHT,
        rng: random.Random | None = None,
    ) -> None:
        if not (math.isfinite(load_weight) and load_weight >= 0):
            raise ValueError(f"load_weight must be a finite number >= 0, got {load_weight!r}")
        self.pool, self.index, self.load_weight = pool, index, float(load_weight)
        self._rng = rng or random.Random()

    @classmethod
    def from_args(
        cls, pool: Pool, args: Mapping[str, Any], index: PrefixIndex | None = None
    ) -> KvCacheAware:
        if index is None:
            raise ValueError(
                "router type kv_cache_aware needs a PrefixIndex fed by the workers' KV events:"
                " pass make_policy(..., index=PrefixIndex())"
            )
        weight = args.get("load_weight", DEFAULT_LOAD_WEIGHT)
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ValueError(f"router argument load_weight must be a number, got {weight!r}")
        return cls(pool, index, float(weight))

    def predicted_blocks(self, worker: WorkerState, request: RouteRequest) -> int:
        """Leading blocks of the request's prompt `worker` holds: called right after `pick`
        (before any await lets events in), the cache hit to expect there; times the block
        size, the cached prompt tokens."""
        if not request.block_hashes:
            return 0
        return self.index.match(request.block_hashes, (worker.url,))[worker.url]

    def pick(self, request: RouteRequest) -> WorkerState:
        ready = candidates(self.pool, request)
        matched = (
            self.index.match(request.block_hashes, [w.url for w in ready])
            if request.block_hashes
            else {}
        )
        weight, best = self.load_weight, -math.inf
        tied: list[WorkerState] = []
        for w in ready:
            score = matched.get(w.url, 0) - weight * w.in_flight
            if score > best:
                best, tied = score, [w]
            elif score == best:
                tied.append(w)
        worker = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        worker.in_flight += 1
        return worker

    def finish(self, worker: WorkerState, request: RouteRequest, success: bool) -> None:
        worker.in_flight -= 1
