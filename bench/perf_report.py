"""Draws docs/perf_report.png from a real run: 2 context + 2 generation reference workers,
`request_perf_metrics` on, 48 requests (a third streamed, prompts of 10-400 tokens, 4 at a
time); saves the /perf_metrics answer to bench/results/perf_metrics.json and charts it.

    python -m bench.perf_report
"""

from __future__ import annotations

import json
import random
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from disagg.demo import Processes
from disagg.report import draw, medians
from tests.conftest import start_cluster

OUT = Path(__file__).parent / "results" / "perf_metrics.json"
PNG = Path(__file__).parent.parent / "docs" / "perf_report.png"


def main() -> None:
    rng = random.Random(7)
    procs = Processes()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            c = start_cluster(
                procs, Path(tmp), 2, 2, request_perf_metrics=True, perf_metrics_max_requests=48
            )
            bodies = [
                {
                    "model": "tiny",
                    "prompt": " ".join(
                        f"w{rng.randrange(500)}" for _ in range(rng.randrange(5, 200))
                    ),
                    "max_tokens": rng.randrange(8, 48),
                    "stream": i % 3 == 0,
                }
                for i in range(48)
            ]
            with httpx.Client(timeout=60) as client, ThreadPoolExecutor(4) as pool:
                codes = list(
                    pool.map(
                        lambda b: client.post(c.url + "/v1/completions", json=b).status_code, bodies
                    )
                )
                assert codes == [200] * len(bodies), codes
                data = client.get(c.url + "/perf_metrics").json()
    finally:
        procs.stop()
    OUT.write_text(json.dumps(data, indent=1))
    records = data["records"]
    draw(records, PNG, title="disagg: 2 context + 2 generation reference workers")
    print(f"{PNG}: {len(records)} requests; median ms per span:")
    for label, ms in medians(records):
        print(f"  {label:<24}{ms:10.2f}")


if __name__ == "__main__":
    main()
