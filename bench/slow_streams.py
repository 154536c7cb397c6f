"""Many slow streams held by one orchestrator: 1 context worker that prefills at once and 1
generation worker that decodes one token a second (`disagg worker --simulate zero` and
`--simulate slow`), N streamed completions opened by a
client in its own process, all held open at once. Reports errors and the orchestrator's
resident memory: before, with every stream open, and the growth per stream.

    python -m bench.slow_streams [--streams 9000 --tokens 40]

Each stream takes two sockets in the orchestrator (client and worker side), so N is bound
by the open-files limit: the bench raises it (for itself and the processes it starts) to
what N needs, past the hard limit where it may (as root), and otherwise runs what fits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from disagg.demo import Processes
from tests.conftest import start_cluster

OUT = Path(__file__).parent / "results" / "slow_streams.json"


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


async def _client(url: str, streams: int, tokens: int, ramp_s: float) -> dict[str, Any]:
    """Open `streams` streams over `ramp_s` seconds; say when all have their first token;
    read each to its end."""
    body = {"model": "tiny", "prompt": "slow", "max_tokens": tokens, "stream": True}
    first = asyncio.Event()
    started, errors, done = 0, 0, 0
    kinds: dict[str, int] = {}

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal started, errors, done
        try:
            async with session.post(url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"http_{resp.status}")
                got_first = False
                async for chunk in resp.content.iter_any():
                    if not got_first and b"data:" in chunk:
                        got_first = True
                        started += 1
                        if started == streams:
                            first.set()
                    if b"[DONE]" in chunk:
                        done += 1
        except Exception as exc:  # counted, never raised: the run goes on
            errors += 1
            kind = str(exc) if isinstance(exc, RuntimeError) else type(exc).__name__
            kinds[kind] = kinds.get(kind, 0) + 1
            if started + errors >= streams:
                first.set()

    timeout = aiohttp.ClientTimeout(total=tokens * 3 + ramp_s + 120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        for i in range(streams):
            tasks.append(asyncio.create_task(one(session)))
            if i % 100 == 99:
                await asyncio.sleep(ramp_s / (streams / 100))
        t0 = time.monotonic()
        await asyncio.wait_for(first.wait(), timeout=tokens + ramp_s + 120)
        print(json.dumps({"all_open": True, "started": started, "errors": errors}), flush=True)
        await asyncio.gather(*tasks)
        return {
            "started": started,
            "done": done,
            "errors": errors,
            "error_kinds": kinds,
            "held_s": round(time.monotonic() - t0, 1),
        }


def open_files_for(streams: int) -> int:
    """Raise this process's open-files limit (its children inherit it) to what `streams`
    need; returns the limit it got."""
    need = 2 * streams + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, need))
            return need
        except (ValueError, OSError):  # not privileged: the hard limit stands
            pass
    soft = hard if hard == resource.RLIM_INFINITY else min(hard, max(soft, need))
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=9000)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--ramp", type=float, default=10.0, help="s to open them all")
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:  # the load, in its own process
        result = asyncio.run(_client(args.client, args.streams, args.tokens, args.ramp))
        print(json.dumps(result), flush=True)
        return
    limit = open_files_for(args.streams)
    if limit < 2 * args.streams + 1024:
        print(f"open-files limit {limit}: {args.streams} streams may not fit", file=sys.stderr)
    procs = Processes()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            c = start_cluster(
                procs,
                Path(tmp),
                1,
                1,
                # prefill at once; decode one token a second
                worker_args=("--num-blocks", str(4 * args.streams + 64)),
                ctx_args=("--simulate", "zero"),
                gen_args=("--simulate", "slow"),
                request_timeout=args.tokens * 3 + args.ramp + 120,
            )
            orch = procs.procs[-1].pid
            time.sleep(1.0)
            before = rss_kb(orch)
            client = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.slow_streams",
                    "--client",
                    c.url,
                    "--streams",
                    str(args.streams),
                    "--tokens",
                    str(args.tokens),
                    "--ramp",
                    str(args.ramp),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert client.stdout is not None
            opened = json.loads(client.stdout.readline())
            held = fds = 0
            for _ in range(5):  # the peak while every stream is open
                held = max(held, rss_kb(orch))
                fds = max(fds, len(os.listdir(f"/proc/{orch}/fd")))
                time.sleep(0.2)
            result = json.loads(client.stdout.readline())
            client.wait(60)
    finally:
        procs.stop()
    report = {
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "open_files_limit": limit,
        "all_open": opened,
        **result,
        "orchestrator_rss_kb": {"before": before, "all_open": held},
        "orchestrator_open_files": fds,
        "rss_growth_kb_per_stream": round((held - before) / args.streams, 2),
    }
    OUT.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
