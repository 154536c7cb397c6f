"""Cache-aware placement with several orchestrator replicas: the same shared-prefix workload
(`bench.placement`'s: system prompts x user turns plus multi-turn chats, 4 context + 4
generation workers with small KV caches) through 1 orchestrator, then through 3 behind a
round-robin balancer (request i to replica i mod 3, so a chat's turns land on different
replicas). Each replica follows every worker's KV events itself; nothing is shared between
replicas. Reports each run's cache hit rate and the 3-replica run's as a share of the
1-replica one; round robin placement is the floor. Writes bench/results/replicas.json.

    python -m bench.replicas [--requests 400] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import placement
from bench.placement import CHILD_ENV, Setup

RESULTS = Path(__file__).parent / "results" / "replicas.json"
RUNS = (("kv_cache_aware", 1), ("kv_cache_aware", 3), ("round_robin", 1))


async def run(n: int, seed: int, concurrency: int, workdir: Path) -> dict[str, Any]:
    rows = []
    for policy, replicas in RUNS:
        setup = Setup(concurrency=concurrency, replicas=replicas)
        result = await placement.run([policy], n, seed, setup, workdir / f"{policy}-{replicas}")
        row = result["policies"][0]
        rows.append({"replicas": replicas, **row})
    one = rows[0]["hit_rate"]
    for row in rows:
        row["hit_rate_vs_1_replica"] = round(row["hit_rate"] / one, 3) if one else 0.0
    return {"workload": {"requests": n, "seed": seed, "concurrency": concurrency}, "runs": rows}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["policy          replicas  reqs err  hit rate  vs 1 replica  pred acc  TTFT p50 ms"]
    for r in rows:
        acc = r.get("prediction_accuracy")
        lines.append(
            f"{r['policy']:<15} {r['replicas']:8d}  {r['requests']:4d} {r['errors']:3d}"
            f"  {r['hit_rate']:8.3f}  {r['hit_rate_vs_1_replica']:12.3f}"
            f"  {'-' if acc is None else f'{100 * acc:6.1f} %':>8}  {r['ttft_p50_ms']:11.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__)
    parser.add_argument("--requests", type=int, default=400, help="requests per run")
    parser.add_argument("--concurrency", type=int, default=Setup.concurrency)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    for key, value in CHILD_ENV.items():
        os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory(prefix="disagg-replicas-") as tmp:
        try:
            result = asyncio.run(run(args.requests, args.seed, args.concurrency, Path(tmp)))
        except (KeyboardInterrupt, asyncio.CancelledError):
            print("interrupted; every process it started is stopped", file=sys.stderr)
            return 130
    print(table(result["runs"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
