"""Cache-aware routing end to end: requests sharing a long prefix land on the workers that
cached it (and their usage shows the cached tokens); the index follows worker restarts; an
orchestrator whose block size differs from its workers' refuses to start."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from disagg.demo import free_port
from tests.conftest import Cluster, Procs, assert_no_leaks, route_of, start_cluster

SYSTEM = "You are a careful assistant for a disaggregated serving cluster. " * 8  # ~520 bytes
KV_AWARE = {"router": {"type": "kv_cache_aware"}, "kv_events_interval": 0.05}


def _ask(c: Cluster, suffix: str) -> httpx.Response:
    r = httpx.post(
        c.url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": SYSTEM + suffix, "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r


def _index_has(c: Cluster, url: str) -> bool:
    info = httpx.get(c.url + "/cluster_info").json()
    return info["prefix_index"]["workers"].get(url, 0) > 0


def _wait(cond: object, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_shared_prefix_lands_where_it_is_cached(procs: Procs, tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, 2, 2, **KV_AWARE)
    first = _ask(c, "Question zero?")
    ctx, gen = route_of(first)["context"], route_of(first)["generation"]
    _wait(lambda: _index_has(c, ctx) and _index_has(c, gen), "the index never saw the blocks")
    for i in range(1, 5):
        r = _ask(c, f"Question {i}?")
        route = route_of(r)
        assert (route["context"], route["generation"]) == (ctx, gen)
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 512  # the shared prefix's full blocks (of 16 tokens)
        assert int(route["predicted_cached_tokens"]) == cached  # the index predicted it
    # A different prompt goes by load: the other workers are idle and as good.
    other = route_of(_ask(c, "x" * 40))
    assert other["context"] in c.context_urls
    assert_no_leaks(c)


def test_index_forgets_a_restarted_worker(procs: Procs, tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, 1, 1, **KV_AWARE)
    _ask(c, "remember me")
    ctx = c.context_urls[0]
    _wait(lambda: _index_has(c, ctx), "the index never saw the blocks")
    proc = next(p for p in procs.procs if ctx.rsplit(":", 1)[1] in " ".join(map(str, p.args)))
    proc.kill()
    proc.wait()
    procs.procs.remove(proc)
    procs.start("worker", "--role", "context", "--port", ctx.rsplit(":", 1)[1])
    _wait(lambda: not _index_has(c, ctx), "the restarted worker's old blocks stayed", 30)
    r = _ask(c, "remember me")  # served, and the prediction matches the empty cache
    assert route_of(r)["predicted_cached_tokens"] == "0"
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_block_size_mismatch_refuses_to_start(procs: Procs, tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, 1, 1)
    port = free_port()
    config = {
        "hostname": "127.0.0.1",
        "port": port,
        "context_servers": {
            "urls": c.context_urls,
            "router": {"type": "kv_cache_aware", "tokens_per_block": 32},
        },
        "generation_servers": {"urls": c.generation_urls},
    }
    path = tmp_path / "mismatch.yaml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run(
        [sys.executable, "-m", "disagg.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "block size 16" in out.stderr and "tokens_per_block 32" in out.stderr
    assert c.context_urls[0] in out.stderr
    assert "Traceback" not in out.stderr


def test_conditional_disaggregation_prefills_locally(
    procs: Procs, tmp_path: Path, mixed_worker: str
) -> None:
    c = start_cluster(
        procs,
        tmp_path,
        1,
        1,
        **KV_AWARE,
        conditional_disagg_config={"max_local_prefill_length": 64},
    )
    gen = c.generation_urls[0]
    first = _ask(c, "Question zero?")
    assert route_of(first)["context"] == c.context_urls[0]  # nothing cached: disaggregated
    _wait(lambda: _index_has(c, gen), "the index never saw the generation worker's blocks")
    r = _ask(c, "Question one?")
    route = route_of(r)
    assert (route["context"], route["generation"]) == ("-", gen)  # no context leg
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 512
    # Same answer as one aggregated worker gives.
    ref = httpx.post(
        mixed_worker + "/v1/completions",
        timeout=60,
        json={
            "model": "tiny",
            "prompt": SYSTEM + "Question one?",
            "max_tokens": 4,
            "temperature": 0,
        },
    ).json()
    assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
    # More than 64 uncached prompt tokens: the context leg runs again.
    far = _ask(c, "z" * 300)
    assert route_of(far)["context"] == c.context_urls[0]
    assert_no_leaks(c)
