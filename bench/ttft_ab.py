"""Time to first token at concurrency 1, two source trees side by side: each tree runs its
own 1 context + 1 generation zero-delay simulated workers and orchestrator, and one client
alternates requests between them (the order flipping each round), so both see the same
machine noise. For changes to the request path too small for `disagg bench compare`'s
round-to-round noise. Writes bench/results/ttft_ab.json.

    git worktree add /tmp/before HEAD~1
    python -m bench.ttft_ab --a /tmp/before/src --b src [--requests 600]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from disagg.demo import Processes
from tests.conftest import start_cluster

RESULTS = Path(__file__).parent / "results" / "ttft_ab.json"
BODY = {"model": "tiny", "prompt": "hello " * 128, "max_tokens": 32, "stream": True}
WARMUP = 50


def _ttft_ms(client: httpx.Client, url: str) -> float:
    began = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=BODY) as resp:
        resp.raise_for_status()
        chunks = resp.iter_bytes()
        next(chunks)
        first = time.perf_counter()
        for _ in chunks:
            pass
    return (first - began) * 1000


def run(trees: dict[str, str], n: int) -> dict[str, Any]:
    procs = Processes()
    urls: dict[str, str] = {}
    saved = os.environ.get("PYTHONPATH")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, src in trees.items():
                os.environ["PYTHONPATH"] = str(Path(src).resolve())  # the processes' disagg
                c = start_cluster(procs, Path(tmp), 1, 1, worker_args=["--simulate", "zero"])
                urls[name] = c.url
            ttft: dict[str, list[float]] = {name: [] for name in urls}
            order = list(urls.items())
            with httpx.Client(timeout=30) as client:
                for i in range(WARMUP + n):
                    for name, url in order if i % 2 else order[::-1]:
                        ms = _ttft_ms(client, url)
                        if i >= WARMUP:
                            ttft[name].append(ms)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
        procs.stop()
    out: dict[str, Any] = {"requests": n, "trees": trees, "ttft_ms": {}}
    for name, xs in ttft.items():
        xs.sort()
        out["ttft_ms"][name] = {
            "p50": round(statistics.median(xs), 3),
            "p90": round(xs[int(0.9 * len(xs))], 3),
        }
    a, b = (out["ttft_ms"][k]["p50"] for k in ("a", "b"))
    out["b_minus_a_p50_ms"] = round(b - a, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ttft_ab", description=__doc__)
    parser.add_argument("--a", required=True, help="a source tree (its src/ directory)")
    parser.add_argument("--b", required=True, help="the other")
    parser.add_argument("--requests", type=int, default=600, help="per tree")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    for src in (args.a, args.b):
        if not (Path(src) / "disagg" / "__init__.py").is_file():
            parser.error(f"{src} is not a source tree holding disagg/")
    result = run({"a": args.a, "b": args.b}, args.requests)
    for name, t in result["ttft_ms"].items():
        print(f"{name} ({result['trees'][name]}): TTFT p50 {t['p50']:.2f} ms, p90 {t['p90']:.2f}")
    print(f"b - a, p50: {result['b_minus_a_p50_ms']:+.2f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
