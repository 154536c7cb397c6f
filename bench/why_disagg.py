"""Why disaggregate: the same long/short prompt mix at the same Poisson rate against
(a) aggregated serving, 2 mixed workers (the load spread over both, round robin), and
(b) disaggregated serving, 1 context + 1 generation worker behind disagg. Workers simulate
a GPU (`--simulate gpu`: prefill 20k tokens/s, decode step 8 ms + 0.06 ms a sequence,
chunked prefill of 256 tokens a step), so one laptop stands for the cluster. Long prompts
prefilling in an aggregated worker's batch slow every token decoding beside them; apart,
decode runs undisturbed. Writes bench/results/why_disagg.json and docs/why_disagg.png.

    python -m bench.why_disagg [--rate 6 --requests 300]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from disagg.demo import Processes, free_port
from disagg.loadgen.runner import LoadSpec, OpenLoop, run_sweep
from disagg.loadgen.workloads import parse_workload
from tests.conftest import start_cluster, wait_healthy

OUT = Path(__file__).parent / "results" / "why_disagg.json"
PNG = Path(__file__).parent.parent / "docs" / "why_disagg.png"
WORKLOAD = "mix:long=4096,short=128,long_share=0.2,out=64"
WORKER = ("--simulate", "gpu", "--num-blocks", "32768")  # room for every prompt in flight


def _aggregated(procs: Processes) -> list[str]:
    urls = []
    for _ in range(2):
        port = free_port()
        procs.start("worker", "--role", "mixed", "--port", str(port), *WORKER)
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        wait_healthy(url, procs)
    return urls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=6.0, help="requests/s (Poisson)")
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    spec = LoadSpec(
        workload=parse_workload(WORKLOAD),
        endpoint="completions",
        arrivals=OpenLoop(args.rate),
        requests=args.requests,
        warmup=10,
        timeout_s=120,
    )
    results: dict[str, dict[str, Any]] = {}
    procs = Processes()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results["aggregated (2 mixed)"] = run_sweep(_aggregated(procs), [spec])[0]
            c = start_cluster(procs, Path(tmp), 1, 1, worker_args=WORKER)
            results["disaggregated (1 ctx + 1 gen)"] = run_sweep(c.url, [spec])[0]
    finally:
        procs.stop()
    OUT.write_text(json.dumps({"workload": WORKLOAD, "rate": args.rate, **results}, indent=1))
    rows = [["setup", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "e2e p99", "errors"]]
    for name, r in results.items():
        rows.append([name, *(f"{r[m][q]:.1f}" for m, q in _CELLS), str(r["requests"] - r["ok"])])
    for row in rows:
        print(f"{row[0]:<30}" + "".join(f"{cell:>10}" for cell in row[1:]))
    _draw(results)


_CELLS = (
    ("ttft_ms", "p50"),
    ("ttft_ms", "p99"),
    ("itl_ms", "p50"),
    ("itl_ms", "p99"),
    ("e2e_ms", "p99"),
)


def _draw(results: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, title in (
        (axes[0], "ttft_ms", "Time to first token"),
        (axes[1], "itl_ms", "Inter-token latency"),
    ):
        for name, r in results.items():
            ax.plot(r["cdf"][metric], [p / 100 for p in r["cdf"]["percent"]], label=name)
        ax.set(xscale="log", xlabel="ms (log scale)", ylabel="share", title=title, ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{WORKLOAD}, simulated GPU workers")
    fig.tight_layout()
    fig.savefig(PNG, dpi=110)
    plt.close(fig)
    print(f"wrote {PNG}")


if __name__ == "__main__":
    main()
