"""`disagg bench run` against a real 1 + 1 cluster: the result JSON counts every request and
its tokens, the charts are PNGs, non-streamed, open-loop and sweep runs work, a target where
nothing listens gives connect errors (exit 0, quickly), bad arguments exit 2; and `run_load`
names each kind of failure of a server that misbehaves."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from disagg.demo import free_port
from disagg.loadgen import ClosedLoop, LoadSpec, parse_workload, run_load
from tests.conftest import BrokenWorker, Cluster, Procs, assert_no_leaks, start_cluster

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def bench_cluster(procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    return start_cluster(procs, tmp_path_factory.mktemp("bench"), 1, 1)


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "disagg.cli", "bench", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_json(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "result.json"
    proc = bench(*args, "--output", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_streamed_run(bench_cluster: Cluster, tmp_path: Path) -> None:
    out, plots = tmp_path / "r.json", tmp_path / "plots"
    proc = bench(
        "--target", bench_cluster.url, "--requests", "20", "--concurrency", "4",
        "--workload", "fixed:in=32,out=8", "--output", str(out), "--plot", str(plots), "--quiet",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""  # --quiet
    r = json.loads(out.read_text())
    assert r["requests"] == 20 and r["ok"] == 20 and sum(r["errors"].values()) == 0
    assert r["output_tokens_per_request"] == {"min": 8, "mean": 8.0, "max": 8}
    assert r["output_tokens"] == 160 and r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0
    assert r["ttft_ms"]["p50"] > 0 and r["itl_ms"]["p50"] > 0
    assert r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"]
    assert r["config"]["concurrency"] == 4 and r["config"]["workload"] == "fixed:in=32,out=8"
    assert r["config"]["endpoint"] == "completions" and r["config"]["stream"] is True
    png = plots / "latency-cdf.png"
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 10_000
    assert not (plots / "throughput.png").exists()  # one concurrency: no sweep chart
    assert_no_leaks(bench_cluster)


def test_non_streamed_chat(bench_cluster: Cluster, tmp_path: Path) -> None:
    r = run_json(
        tmp_path, "--target", bench_cluster.url + "/v1", "--endpoint", "chat", "--no-stream",
        "--requests", "10", "--concurrency", "2", "--warmup", "2",
        "--workload", "fixed:in=32,out=8",
    )  # fmt: skip
    assert r["ok"] == 10 and r["output_tokens"] == 80
    assert r["ttft_ms"] == r["e2e_ms"]  # a whole answer's first token is its end
    assert r["itl_ms"]["p50"] is None
    assert r["config"]["target"] == bench_cluster.url  # the /v1 is the paths'


def test_open_loop(bench_cluster: Cluster, tmp_path: Path) -> None:
    r = run_json(
        tmp_path, "--target", bench_cluster.url, "--rate", "20", "--requests", "20",
        "--warmup", "0", "--workload", "fixed:in=32,out=8",
    )  # fmt: skip
    assert r["ok"] == 20 and r["output_tokens"] == 160
    assert r["config"]["loop"] == "open" and r["config"]["rate"] == 20.0
    assert r["duration_s"] > 0.3  # 20 Poisson arrivals at 20/s take about a second
    assert r["cap_waits"] == 0


def test_sweep_and_progress(bench_cluster: Cluster, tmp_path: Path) -> None:
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    proc = bench(
        "--target", bench_cluster.url, "--endpoint", "responses", "--concurrency", "1,3",
        "--requests", "6", "--warmup", "1", "--workload", "shared-prefix:systems=2,turns=2,"
        "system_len=64,user_len=16,out=4", "--output", str(out), "--plot", str(plots),
        "--progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [r["config"]["concurrency"] for r in runs] == [1, 3]
    assert all(r["ok"] == 6 for r in runs)
    assert all(0 < r["output_tokens"] <= 24 for r in runs)  # responses may stop at EOS
    lines = proc.stdout.splitlines()
    assert lines[1].split()[:3] == ["c=1", "6", "6"] and lines[2].split()[0] == "c=3"
    assert "throughput.png" in lines[-1]
    assert "c=3  0/6 requests" in proc.stderr
    assert proc.stderr.endswith("\x1b[K")  # the line is cleared (text mode reads \r as \n)
    for name in ("latency-cdf.png", "throughput.png"):
        assert (plots / name).read_bytes()[:8] == PNG


def test_nothing_listening_gives_connect_errors(tmp_path: Path) -> None:
    began = time.monotonic()
    r = run_json(tmp_path, "--target", f"http://127.0.0.1:{free_port()}", "--requests", "5")
    assert time.monotonic() - began < 20
    assert r["requests"] == 5 and r["ok"] == 0 and r["errors"]["connect"] == 5
    assert "connect" in r["error_examples"]["connect"].lower()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--concurrency", "0"], "concurrency must be"),
        (["--concurrency", "4,x"], "concurrency must be"),
        (["--concurrency", "4", "--rate", "2"], "not allowed with argument"),
        (["--rate", "0"], "rate must be above 0"),
        (["--requests", "0"], "requests must be at least 1"),
        (["--requests", "5", "--duration", "3"], "not allowed with argument"),
        (["--workload", "steady"], "unknown workload 'steady'"),
        (["--workload", "fixed:in=0"], "in must be at least 1"),
        (["--workload", "jsonl:/nonexistent.jsonl"], "cannot read"),
        (["--endpoint", "embeddings"], "invalid choice"),
        (["--target", "ftp://example.com"], "http:// or https://"),
        (["--output", "/nonexistent/dir/r.json"], "is not a directory"),
    ],
)
def test_bad_arguments_exit_2(args: list[str], says: str) -> None:
    target = [] if "--target" in args else ["--target", "http://127.0.0.1:1"]
    proc = bench(*target, *args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr


def load(url: str, stream: bool = True, timeout_s: float = 10.0) -> dict[str, Any]:
    spec = LoadSpec(
        workload=parse_workload("fixed:in=8,out=4"),
        stream=stream,
        arrivals=ClosedLoop(2),
        requests=4,
        warmup=0,
        timeout_s=timeout_s,
    )
    return asyncio.run(run_load(url, spec))


@pytest.mark.parametrize(
    ("mode", "stream", "kind"),
    [
        ("500", True, "http_5xx"),
        ("400", False, "http_4xx"),
        ("partial", True, "truncated"),  # one chunk, then the connection drops
        ("torn", True, "truncated"),
        ("partial", False, "truncated"),
        ("reset", True, "truncated"),  # dropped before answering
        ("hang", True, "timeout"),
        ("partial_hang", True, "timeout"),
    ],
)
def test_failure_kinds(mode: str, stream: bool, kind: str) -> None:
    with BrokenWorker(mode) as url:
        r = load(url, stream, timeout_s=0.5)
    assert r["ok"] == 0 and r["errors"][kind] == 4, r["errors"]


async def _sse(request: web.Request) -> web.StreamResponse:
    """Streams in the shape the test named in the path, then [DONE]."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    chunk = b'data: {"choices": [{"index": 0, "text": "A"}]}\n\n'
    mode = request.match_info["mode"]
    if mode == "error_event":
        await resp.write(chunk + b'data: {"error": {"message": "worker died"}}\n\n')
    elif mode == "no_usage":
        for _ in range(3):
            await resp.write(chunk)
            await asyncio.sleep(0.01)
    elif mode == "no_done":
        await resp.write(chunk)
        await resp.write_eof()
        return resp
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.fixture
def sse_server() -> Iterator[str]:
    """A server on loopback, on its own thread, answering POST /{mode}/v1/completions."""
    app = web.Application()
    app.router.add_post("/{mode}/v1/completions", _sse)
    runner, port = web.AppRunner(app), free_port()
    loop = asyncio.new_event_loop()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_stream_error_event_and_token_counting(sse_server: str) -> None:
    r = load(sse_server + "/error_event")
    assert r["errors"]["stream_error"] == 4 and "worker died" in r["error_examples"]["stream_error"]
    r = load(sse_server + "/no_done")
    assert r["errors"]["truncated"] == 4 and "[DONE]" in r["error_examples"]["truncated"]
    r = load(sse_server + "/no_usage")
    assert r["ok"] == 4 and r["output_tokens_per_request"]["max"] == 3  # counted chunks
    assert r["itl_ms"]["p50"] > 5  # the gaps between chunks, 10 ms apart
