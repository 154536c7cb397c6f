"""Decision cost of cache-aware routing: p50/p99 of `KvCacheAware.pick()` + `finish()` for
prompts of 128, 2k and 8k tokens over 4, 16 and 64 workers, against a warm `PrefixIndex` of
100k blocks (16 tokens each); and, apart, the cost of hashing the prompt's blocks
(`disagg.engine.kv_cache.block_hashes`), which the orchestrator pays before it routes.

The warm index is shaped like a shared cluster: prefix families (system prompts, documents,
conversations) of 8 to 512 blocks, a few popular ones on many workers and most on one or two,
each copy followed by a suffix of its own. Queries pick a family by popularity (one in ten is
new text), so some match nothing, some a short prefix and some the whole prompt, the longest
walk. Family chains are real block hashes; the private suffixes are random 64-bit ints, which
cost the index the same. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg.cluster import Pool, WorkerState
from disagg.engine.kv_cache import block_hashes
from disagg.routing import RouteRequest
from disagg.routing.kv_cache_aware import KvCacheAware
from disagg.routing.load_balancing import LoadBalancing
from disagg.routing.prefix_index import PrefixIndex

BLOCK = 16
PROMPT_TOKENS = (128, 2048, 8192)
WORKERS = (4, 16, 64)
WARM_BLOCKS = 100_000
FAMILY_BLOCKS = (8, 32, 128, 512)  # 128 tokens to 8k: a system prompt to a long document
FAMILY_WEIGHTS = (4, 3, 2, 1)
RESULTS = Path(__file__).parent / "results" / "routing_decision.json"


@dataclass(frozen=True)
class Family:
    chain: list[int]  # real chained hashes of its tokens
    holders: int  # how many workers cached it


def _families(rng: random.Random) -> list[Family]:
    """Enough prefix families to hold WARM_BLOCKS on any worker count; popularity Zipf-like."""
    out: list[Family] = []
    for rank in range(1, 400):
        blocks = rng.choices(FAMILY_BLOCKS, FAMILY_WEIGHTS)[0]
        tokens = [rng.randrange(32_000) for _ in range(blocks * BLOCK)]
        out.append(Family(block_hashes(tokens, BLOCK), max(1, 24 // rank)))
    return out


def warm_index(rng: random.Random, urls: Sequence[str], families: list[Family]) -> PrefixIndex:
    """Families on random workers, each copy with its own suffix, until WARM_BLOCKS entries."""
    index = PrefixIndex()
    while index.stats()["entries"] < WARM_BLOCKS:
        for family in families:
            for url in rng.sample(list(urls), min(family.holders, len(urls))):
                suffix = [rng.getrandbits(64) for _ in range(rng.randrange(0, 64))]
                index.apply(url, [{"type": "stored", "block_hashes": [*family.chain, *suffix]}])
            if index.stats()["entries"] >= WARM_BLOCKS:
                break
    return index


def _query(rng: random.Random, families: list[Family], blocks: int) -> tuple[int, ...]:
    """A prompt of `blocks` full blocks: a popular family's prefix, then new text."""
    if rng.random() < 0.1:
        chain: list[int] = []
    else:
        chain = rng.choices(families, [f.holders for f in families])[0].chain[:blocks]
    return (*chain, *(rng.getrandbits(64) for _ in range(blocks - len(chain))))


def _percentiles(ns: list[int]) -> dict[str, float]:
    ns = sorted(ns)
    return {
        "p50_us": ns[len(ns) // 2] / 1000,
        "p99_us": ns[int(len(ns) * 0.99)] / 1000,
        "max_us": ns[-1] / 1000,
    }


def time_picks(policy: KvCacheAware, queries: list[tuple[int, ...]], rounds: int) -> dict[str, Any]:
    """Percentiles of pick + finish and of the index's `match` alone, and the mean predicted
    blocks of the chosen workers."""
    picks: list[int] = []
    matches: list[int] = []
    predicted = 0
    clock = time.perf_counter_ns
    urls = [w.url for w in policy.pool.workers]
    for r in range(rounds):
        for i, hashes in enumerate(queries):
            request = RouteRequest(r * len(queries) + i, "m", block_hashes=hashes)
            start = clock()
            worker = policy.pick(request)
            policy.finish(worker, request, True)
            picks.append(clock() - start)
            start = clock()
            policy.index.match(hashes, urls)
            matches.append(clock() - start)
            if r == 0:
                predicted += policy.predicted_blocks(worker, request)
    return {
        "pick": _percentiles(picks),
        "match": _percentiles(matches),
        "mean_predicted_blocks": round(predicted / len(queries), 1),
    }


def time_baseline(pool: Pool, n: int) -> dict[str, float]:
    """pick + finish of `load_balancing` on the same pool: the cost of looking at the workers."""
    policy, samples = LoadBalancing(pool), []
    for i in range(n):
        request = RouteRequest(i, "m")
        start = time.perf_counter_ns()
        policy.finish(policy.pick(request), request, True)
        samples.append(time.perf_counter_ns() - start)
    return _percentiles(samples)


def time_hashing(rng: random.Random, tokens: int, n: int) -> dict[str, float]:
    samples: list[int] = []
    for _ in range(n):
        ids = [rng.randrange(32_000) for _ in range(tokens)]
        start = time.perf_counter_ns()
        block_hashes(ids[:-1], BLOCK)
        samples.append(time.perf_counter_ns() - start)
    return _percentiles(samples)


def measured_bytes(rng: random.Random, urls: Sequence[str], families: list[Family]) -> int:
    """What the warm index really allocates (tracemalloc), to check `approx_bytes`."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = warm_index(rng, urls, families)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del index
    return used


def run(queries: int, rounds: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    families = _families(rng)
    rows: list[dict[str, Any]] = []
    for workers in WORKERS:
        urls = [f"http://w{i}:8000" for i in range(workers)]
        index = warm_index(rng, urls, families)
        stats = index.stats()
        pool = Pool("context", [WorkerState(u, "context", ready=True) for u in urls])
        for w in pool.workers:  # a loaded cluster: some legs everywhere
            w.in_flight = rng.randrange(0, 8)
        policy = KvCacheAware(pool, index, rng=random.Random(seed))
        for tokens in PROMPT_TOKENS:
            blocks = (tokens - 1) // BLOCK  # all prompt tokens but the last
            batch = [_query(rng, families, blocks) for _ in range(queries)]
            gc.collect()
            row: dict[str, Any] = {"workers": workers, "prompt_tokens": tokens, "blocks": blocks}
            row |= time_picks(policy, batch, rounds)
            row["load_balancing_pick"] = time_baseline(pool, queries * rounds)
            row["index"] = {k: stats[k] for k in ("entries", "hashes", "approx_bytes")}
            rows.append(row)
    hashing = [{"prompt_tokens": t, **time_hashing(rng, t, 200)} for t in PROMPT_TOKENS]
    warm64 = measured_bytes(rng, [f"http://w{i}:8000" for i in range(64)], families)
    return {
        "python": sys.version.split()[0],
        "block_size": BLOCK,
        "warm_blocks": WARM_BLOCKS,
        "queries": queries * rounds,
        "pick_and_finish": rows,
        "block_hashes": hashing,
        "index_bytes_measured_64_workers": warm64,
    }


def _table(result: dict[str, Any]) -> str:
    lines = [
        "                         pick+finish us     match us     hit   load_balancing us",
        "workers  prompt  blocks   p50   p99   max   p50   p99  blocks   p50   p99",
    ]
    for r in result["pick_and_finish"]:
        p, m, lb = r["pick"], r["match"], r["load_balancing_pick"]
        lines.append(
            f"{r['workers']:7d}  {r['prompt_tokens']:6d}  {r['blocks']:6d}"
            f"  {p['p50_us']:4.1f} {p['p99_us']:5.1f} {p['max_us']:5.0f}"
            f" {m['p50_us']:5.1f} {m['p99_us']:5.1f}  {r['mean_predicted_blocks']:6.1f}"
            f"  {lb['p50_us']:4.1f} {lb['p99_us']:5.1f}"
        )
    lines.append("block_hashes: prompt  p50 us  p99 us")
    for h in result["block_hashes"]:
        lines.append(
            f"              {h['prompt_tokens']:6d}  {h['p50_us']:6.0f}  {h['p99_us']:6.0f}"
        )
    approx = result["pick_and_finish"][-1]["index"]["approx_bytes"]
    measured = result["index_bytes_measured_64_workers"]
    lines.append(f"index, 64 workers: approx_bytes {approx:,}, measured {measured:,}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__)
    parser.add_argument("--queries", type=int, default=1000, help="distinct prompts per cell")
    parser.add_argument("--rounds", type=int, default=5, help="times each prompt is routed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args(argv)
    result = run(args.queries, args.rounds, args.seed)
    print(_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
