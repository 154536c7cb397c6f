"""`disagg bench compare`: the same load against several targets in one run, in alternating
order, over the same simulated workers (1 context + 1 generation, and 1 mixed for `direct`):
straight to a worker, through disagg, and through the peers that are installed
(sglang-router and vllm-router in their PD modes, a FastAPI + httpx proxy of vLLM's toy
design). Per target and load level it keeps the median of the rounds and prints ratios to
disagg. It starts and stops every process it needs; the load runs in this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from disagg.demo import free_port
from disagg.loadgen import peers
from disagg.loadgen.runner import ClosedLoop, LoadSpec, run_sweep

TARGETS = ("direct", "disagg", peers.SGLANG_ROUTER, peers.VLLM_ROUTER, peers.VLLM_TOY_PROXY)
_METRICS = ("requests_per_s", "output_tokens_per_s")
_LATENCIES = ("ttft_ms", "itl_ms", "e2e_ms")


@dataclass(frozen=True)
class CompareSpec:
    targets: tuple[str, ...] = TARGETS
    concurrency: tuple[int, ...] = (64, 256)
    rounds: int = 3
    load: LoadSpec = dataclasses.field(default_factory=LoadSpec)
    simulate: str = "zero"  # the workers' --simulate preset
    peers_python: str | None = None
    disagg_config: dict[str, Any] = dataclasses.field(default_factory=dict)


class _Processes:
    """Every process started for the comparison; all stopped on exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: Sequence[str]) -> None:
        self.procs.append(
            subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        )

    def disagg(self, *args: str) -> None:
        self.start([sys.executable, "-m", "disagg.cli", "--log-level", "warning", *args])

    def wait_ready(self, url: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args!r} exited with {p.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f} s")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# Simulated KV blocks are a few bytes each: room for every sequence of the highest level.
_BLOCKS = "65536"


def _worker(procs: _Processes, role: str, simulate: str) -> str:
    port = free_port()
    procs.disagg(
        "worker",
        "--role",
        role,
        "--port",
        str(port),
        "--simulate",
        simulate,
        "--num-blocks",
        _BLOCKS,
    )
    url = f"http://127.0.0.1:{port}"
    procs.wait_ready(url + "/health")
    return url


def _disagg(procs: _Processes, ctx: str, gen: str, tmp: Path, extra: dict[str, Any]) -> str:
    port = free_port()
    config = {
        "hostname": "127.0.0.1",
        "port": port,
        "context_servers": {"urls": [ctx]},
        "generation_servers": {"urls": [gen]},
        "max_queued_requests": 100_000,
        **extra,
    }
    path = tmp / "disagg.yaml"
    path.write_text(yaml.safe_dump(config))
    procs.disagg("serve", "--config", str(path))
    url = f"http://127.0.0.1:{port}"
    procs.wait_ready(url + "/health")
    return url


_PEERS: dict[str, Callable[..., peers.PeerCommand | None]] = {
    peers.SGLANG_ROUTER: peers.sglang_router,
    peers.VLLM_ROUTER: peers.vllm_router,
    peers.VLLM_TOY_PROXY: peers.vllm_toy_proxy,
}


@contextlib.contextmanager
def launched(spec: CompareSpec, say: Callable[[str], None]) -> Iterator[dict[str, str]]:
    """The targets that could be started, by name -> base URL."""
    procs = _Processes()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            urls: dict[str, str] = {}
            ctx = _worker(procs, "context", spec.simulate)
            gen = _worker(procs, "generation", spec.simulate)
            if "direct" in spec.targets:
                urls["direct"] = _worker(procs, "mixed", spec.simulate)
            if "disagg" in spec.targets:
                urls["disagg"] = _disagg(procs, ctx, gen, Path(tmp), spec.disagg_config)
            python = peers.find_python(spec.peers_python)
            for name in (t for t in spec.targets if t in _PEERS):
                command = _PEERS[name]([ctx], [gen], free_port(), python) if python else None
                if command is None:
                    say(f"{name}: not installed for {python or 'any python found'}; skipped")
                    continue
                procs.start(command.argv)
                procs.wait_ready(command.url + command.ready_path)
                urls[name] = command.url
            yield urls
    finally:
        procs.stop()


def compare(spec: CompareSpec, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every load level against every target `spec.rounds` times, rotating the order
    each round; the result holds every run and, per level, each target's medians."""
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {}
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per readiness poll
    with launched(spec, say) as urls:
        names = list(urls)
        for level in spec.concurrency:
            load = dataclasses.replace(spec.load, arrivals=ClosedLoop(level))
            runs[level] = {name: [] for name in names}
            for r in range(spec.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    result = run_sweep(urls[name], [load])[0]
                    runs[level][name].append(result)
                    say(f"c={level} round {r + 1} {name}: {_line(result)}")
    summary = {str(level): _medians(by_target) for level, by_target in runs.items()}
    return {
        "config": {
            "targets": list(spec.targets),
            "concurrency": list(spec.concurrency),
            "rounds": spec.rounds,
            "simulate": spec.simulate,
            **spec.load.describe("<each target>"),
        },
        "summary": summary,
        "ratios_to_disagg": _ratios(summary),
        "runs": {str(k): v for k, v in runs.items()},
    }


def _line(result: dict[str, Any]) -> str:
    errors = result["requests"] - result["ok"]
    return (
        f"{result['requests_per_s']:.0f} req/s, TTFT p50 {result['ttft_ms']['p50']} ms,"
        f" p99 {result['ttft_ms']['p99']} ms, errors {errors}"
    )


def _medians(by_target: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, results in by_target.items():
        row: dict[str, Any] = {
            m: round(statistics.median(r[m] for r in results), 2) for m in _METRICS
        }
        for lat in _LATENCIES:
            for q in ("p50", "p99"):
                values = [r[lat][q] for r in results if r[lat][q] is not None]
                row[f"{lat[:-3]}_{q}_ms"] = round(statistics.median(values), 3) if values else None
        row["errors"] = sum(r["requests"] - r["ok"] for r in results)
        out[name] = row
    return out


def _ratios(summary: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per level: disagg's throughput over each other target's, and disagg's added TTFT
    over `direct` (ms, p50)."""
    out: dict[str, dict[str, Any]] = {}
    for level, rows in summary.items():
        mine = rows.get("disagg")
        if mine is None:
            continue
        ratios: dict[str, Any] = {}
        for name, row in rows.items():
            if name != "disagg" and row["requests_per_s"]:
                ratios[f"throughput_vs_{name}"] = round(
                    mine["requests_per_s"] / row["requests_per_s"], 2
                )
        direct = rows.get("direct")
        if direct and direct["ttft_p50_ms"] is not None and mine["ttft_p50_ms"] is not None:
            ratios["added_ttft_p50_ms"] = round(mine["ttft_p50_ms"] - direct["ttft_p50_ms"], 3)
        out[level] = ratios
    return out


def table(result: dict[str, Any]) -> str:
    """The medians, one line a level and target, then the ratios."""
    head = f"{'level':>6} {'target':>16} {'req/s':>8} {'tok/s':>9} {'ttft p50':>9}"
    head += f" {'ttft p99':>9} {'itl p99':>8} {'errors':>6}"
    lines = [head]
    for level, rows in result["summary"].items():
        for name, row in rows.items():
            cells = (
                f"{'c=' + level:>6} {name:>16} {row['requests_per_s']:>8.0f}"
                f" {row['output_tokens_per_s']:>9.0f} {_ms(row['ttft_p50_ms']):>9}"
                f" {_ms(row['ttft_p99_ms']):>9} {_ms(row['itl_p99_ms']):>8} {row['errors']:>6}"
            )
            lines.append(cells)
    for level, ratios in result["ratios_to_disagg"].items():
        parts = ", ".join(f"{k} {v}" for k, v in ratios.items())
        lines.append(f"c={level}: {parts}")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
