"""`disagg worker --simulate`: the real worker (HTTP API, scheduler, KV blocks, KV transfer)
with a timing model in place of the model math, behind a real orchestrator. Outputs run to
max_tokens; the gpu preset takes at least its simulated prefill time, at little CPU."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import httpx
import pytest

from tests.conftest import Cluster, Procs, assert_no_leaks, start_cluster


@pytest.fixture(scope="module")
def zero(procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    tmp = tmp_path_factory.mktemp("sim-zero")
    return start_cluster(procs, tmp, 1, 1, worker_args=("--simulate", "zero"))


@pytest.fixture(scope="module")
def gpu(procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    tmp = tmp_path_factory.mktemp("sim-gpu")
    return start_cluster(procs, tmp, 1, 1, worker_args=("--simulate", "gpu"))


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + path, json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True}, **body}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_completion_runs_to_max_tokens(zero: Cluster) -> None:
    out = _post(zero.url, "/v1/completions", {"prompt": "simulated " * 20, "max_tokens": 40})
    assert out["usage"]["completion_tokens"] == 40
    assert out["choices"][0]["finish_reason"] == "length"
    assert len(out["choices"][0]["text"]) == 40  # one byte a token, all printable
    assert_no_leaks(zero)


def test_stream_runs_to_max_tokens(zero: Cluster) -> None:
    events = _stream(zero.url, {"prompt": "stream me", "max_tokens": 32, "temperature": 1.0})
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert len(text) == 32 and len(set(text)) > 5
    assert events[-1]["usage"]["completion_tokens"] == 32
    assert_no_leaks(zero)


def test_chat_and_kv_moves_between_workers(zero: Cluster) -> None:
    messages = [{"role": "user", "content": "Tell me about simulated workers."}]
    out = _post(zero.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 24})
    assert out["usage"]["completion_tokens"] == 24
    assert len(out["choices"][0]["message"]["content"]) == 24
    ctx = httpx.get(zero.context_urls[0] + "/stats").json()
    assert ctx["transfers"]["fetch_served"] >= 1  # the real KV fetch, of the tiny arrays
    assert_no_leaks(zero)


def test_same_request_same_text(zero: Cluster) -> None:
    body = {"prompt": "deterministic", "max_tokens": 16, "temperature": 1.0}
    first = _post(zero.url, "/v1/completions", body)["choices"][0]["text"]
    assert _post(zero.url, "/v1/completions", body)["choices"][0]["text"] == first


def test_gpu_prefill_takes_its_simulated_time(gpu: Cluster) -> None:
    prompt = "x" * 2000  # 2001 tokens with BOS: 0.1 s of prefill at 20000 tokens/s
    started = time.perf_counter()
    out = _post(gpu.url, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
    elapsed = time.perf_counter() - started
    assert out["usage"]["prompt_tokens"] == 2001
    assert out["usage"]["completion_tokens"] == 4
    assert elapsed >= 2000 / 20_000
    assert_no_leaks(gpu)


def _cpu_s(procs: Procs, url: str) -> float:
    port = url.rsplit(":", 1)[1]
    proc = next(p for p in procs.procs if f"'--port', '{port}'" in repr(p.args))
    with open(f"/proc/{proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_gpu_decode_uses_little_cpu(gpu: Cluster, procs: Procs) -> None:
    worker = gpu.generation_urls[0]
    before, started = _cpu_s(procs, worker), time.perf_counter()
    events = _stream(gpu.url, {"prompt": "decode for a while", "max_tokens": 250})
    wall = time.perf_counter() - started  # >= 250 simulated steps of 8 ms
    assert events[-1]["usage"]["completion_tokens"] == 250
    # The real model would keep a core busy; the simulated one mostly sleeps.
    assert _cpu_s(procs, worker) - before < 0.5 * wall
