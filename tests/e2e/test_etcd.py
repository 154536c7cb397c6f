"""Service discovery on a real etcd: workers register under a lease (`disagg worker
--register`), orchestrators follow the prefix (`cluster: {backend: etcd}`).

Each test has its own etcd (free loopback ports, temporary data dir), its own cluster name
and its own processes, so killing one never disturbs another test.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aetcd
import httpx
import openai
import pytest
import yaml

from disagg import registry
from disagg.demo import free_port
from tests.conftest import Procs, route_of, wait_healthy
from tests.etcd_server import EtcdServer

TTL = 2  # s: the registration lease; a killed worker leaves within this (plus a watch hop)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def procs() -> Iterator[Procs]:
    with Procs() as p:
        yield p


def register(procs: Procs, etcd: EtcdServer, role: str, *args: str) -> tuple[str, Any]:
    """A reference worker of `role` registered in cluster `t`; its URL and process."""
    port = free_port()
    procs.start(
        "worker",
        "--role",
        role,
        "--port",
        str(port),
        "--register",
        etcd.url,
        "--cluster",
        "t",
        "--register-ttl",
        str(TTL),
        *args,
    )
    url = f"http://127.0.0.1:{port}"
    return url, procs.procs[-1]


def orchestrator(procs: Procs, tmp: Path, etcd: EtcdServer, **extra: Any) -> str:
    port = free_port()
    config = {
        "hostname": "127.0.0.1",
        "port": port,
        "cluster": {"backend": "etcd", "endpoints": [etcd.url], "name": "t"},
        "health_check_interval": 0.5,
        **extra,
    }
    path = tmp / f"cluster-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    procs.start("serve", "--config", str(path))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, procs)
    return url


def forget(procs: Procs, proc: Any) -> None:
    """A process the test ended on purpose (so `check_alive` does not mind it)."""
    procs.procs.remove(proc)


def kill(procs: Procs, proc: Any, sig: int = signal.SIGKILL) -> None:
    proc.send_signal(sig)
    proc.wait(timeout=30)
    forget(procs, proc)


def members(url: str, ready_only: bool = False) -> set[tuple[str, str]]:
    info = httpx.get(url + "/cluster_info", timeout=5).json()
    return {
        (w["role"], w["url"])
        for key in ("context_servers", "generation_servers")
        for w in info[key]
        if w["ready"] or not ready_only
    }


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll `check` every 50 ms until true; the seconds it took (AssertionError after
    `timeout_s`)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if check():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def records(etcd: EtcdServer) -> dict[str, registry.WorkerRecord]:
    async def read() -> dict[str, registry.WorkerRecord]:
        host, port = etcd.endpoint.split(":")
        async with aetcd.Client(host, int(port), timeout=2) as client:
            found = await client.get_prefix(registry.prefix("t").encode())
            return {r.url: r for r in (registry.decode(kv.value) for kv in found)}

    return asyncio.run(read())


def write(etcd: EtcdServer, key: str, value: bytes | None) -> None:
    """Put `value` at `key` (no lease), or delete the key when None."""

    async def run() -> None:
        host, port = etcd.endpoint.split(":")
        async with aetcd.Client(host, int(port), timeout=2) as client:
            if value is None:
                await client.delete(key.encode())
            else:
                await client.put(key.encode(), value)

    asyncio.run(run())


def routes(url: str, n: int) -> list[dict[str, str]]:
    out = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for i in range(n):
            r = client.post(
                "/v1/completions", json={"model": "tiny", "prompt": f"p{i}", "max_tokens": 2}
            )
            assert r.status_code == 200, r.text
            out.append(route_of(r))
    return out


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith(name))
    return float(line.rsplit(" ", 1)[1])


def test_workers_register_and_the_orchestrator_finds_them(
    procs: Procs, etcd: EtcdServer, tmp_path: Path
) -> None:
    ctx, _ = register(procs, etcd, "context")
    gen, _ = register(procs, etcd, "generation")
    for url in (ctx, gen):
        wait_healthy(url, procs)
    wait_for(lambda: len(records(etcd)) == 2, 5, "both records in etcd")
    record = records(etcd)[gen]
    assert (record.role, record.models, record.block_size) == ("generation", ["tiny"], 16)
    assert "kv_cache_events" in record.capabilities and not record.draining

    url = orchestrator(procs, tmp_path, etcd)
    assert members(url, ready_only=True) == {("context", ctx), ("generation", gen)}
    info = httpx.get(url + "/cluster_info", timeout=5).json()
    assert info["discovery"]["up"] is True
    assert {w["source"] for w in info["generation_servers"]} == {"etcd"}

    client = openai.OpenAI(base_url=url + "/v1", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert raw.parse().choices[0].message.content
    assert route_of(raw)["context"] == ctx and route_of(raw)["generation"] == gen
    assert metric(url, 'disagg_discovery_up{backend="etcd"}') == 1.0


def test_a_killed_worker_leaves_within_the_lease_and_gets_no_legs(
    procs: Procs, etcd: EtcdServer, tmp_path: Path
) -> None:
    ctx, _ = register(procs, etcd, "context")
    gen_a, _ = register(procs, etcd, "generation")
    gen_b, proc_b = register(procs, etcd, "generation")
    for u in (ctx, gen_a, gen_b):
        wait_healthy(u, procs)
    wait_for(lambda: len(records(etcd)) == 3, 5, "three records")
    # health checks far apart: leaving must come from the lease, not from /health
    url = orchestrator(procs, tmp_path, etcd, health_check_interval=30)
    assert {r["generation"] for r in routes(url, 4)} == {gen_a, gen_b}

    kill(procs, proc_b)
    took = wait_for(
        lambda: ("generation", gen_b) not in members(url), TTL + 3, "the dead worker leaves"
    )
    assert took <= TTL + 2
    assert {r["generation"] for r in routes(url, 6)} == {gen_a}


def test_a_new_worker_takes_traffic_within_a_second_of_registering(
    procs: Procs, etcd: EtcdServer, tmp_path: Path
) -> None:
    _ctx, _ = register(procs, etcd, "context")
    _gen_a, _ = register(procs, etcd, "generation")
    url = orchestrator(procs, tmp_path, etcd, health_check_interval=30)
    wait_for(lambda: len(members(url, ready_only=True)) == 2, 10, "first two ready")

    gen_b, _ = register(procs, etcd, "generation")
    wait_for(lambda: gen_b in records(etcd), 30, "the new worker registered")
    took = wait_for(
        lambda: ("generation", gen_b) in members(url, ready_only=True), 5, "it is ready"
    )
    assert took < 1.0, f"{took:.2f} s from its etcd record to taking legs"
    assert gen_b in {r["generation"] for r in routes(url, 4)}


def test_a_draining_worker_says_so_then_leaves(
    procs: Procs, etcd: EtcdServer, tmp_path: Path
) -> None:
    _ctx, _ = register(procs, etcd, "context")
    gen_a, _ = register(procs, etcd, "generation")
    gen_b, proc_b = register(procs, etcd, "generation", "--drain-timeout", "5")
    url = orchestrator(procs, tmp_path, etcd, health_check_interval=30)
    wait_for(lambda: len(members(url, ready_only=True)) == 3, 10, "all three ready")

    kill(procs, proc_b, signal.SIGTERM)  # drains (nothing in flight), deregisters, exits
    wait_for(lambda: gen_b not in records(etcd), 2, "its record goes at once")
    wait_for(lambda: ("generation", gen_b) not in members(url), 2, "the orchestrator drops it")
    assert {r["generation"] for r in routes(url, 4)} == {gen_a}


def test_etcd_down_keeps_the_last_view_then_resyncs(
    procs: Procs, etcd: EtcdServer, tmp_path: Path
) -> None:
    ctx, _ = register(procs, etcd, "context")
    gen_a, _ = register(procs, etcd, "generation")
    gen_b, proc_b = register(procs, etcd, "generation")
    url = orchestrator(procs, tmp_path, etcd)
    wait_for(lambda: len(members(url, ready_only=True)) == 3, 10, "all three ready")

    etcd.stop()
    wait_for(lambda: metric(url, 'disagg_discovery_up{backend="etcd"}') == 0.0, 5, "down")
    assert {r["generation"] for r in routes(url, 4)} == {gen_a, gen_b}  # the last view
    kill(procs, proc_b)  # while etcd is away: its record outlives it
    wait_for(lambda: ("generation", gen_b) not in members(url, ready_only=True), 5, "health check")
    assert {r["generation"] for r in routes(url, 4)} == {gen_a}
    assert members(url) == {("context", ctx), ("generation", gen_a), ("generation", gen_b)}

    etcd.start()  # same data: gen_b's lease is back, with a fresh TTL it will not renew
    gen_c, _ = register(procs, etcd, "generation")
    wait_for(lambda: metric(url, 'disagg_discovery_up{backend="etcd"}') == 1.0, 10, "up")
    assert metric(url, 'disagg_discovery_resyncs_total{backend="etcd"}') >= 1
    wait_for(
        lambda: members(url) == {("context", ctx), ("generation", gen_a), ("generation", gen_c)},
        TTL + 30,
        "resynced: the dead worker gone, the new one in",
    )
    assert gen_c in {r["generation"] for r in routes(url, 6)}


def test_two_replicas_see_the_same_membership(
    procs: Procs, etcd: EtcdServer, tmp_path: Path
) -> None:
    ctx, _ = register(procs, etcd, "context")
    gen_a, _ = register(procs, etcd, "generation")
    first = orchestrator(procs, tmp_path, etcd)
    second = orchestrator(procs, tmp_path, etcd)
    both = {("context", ctx), ("generation", gen_a)}
    for url in (first, second):
        wait_for(lambda u=url: members(u, ready_only=True) == both, 10, f"{url} sees both")

    gen_b, proc_b = register(procs, etcd, "generation")
    three = both | {("generation", gen_b)}
    for url in (first, second):
        wait_for(lambda u=url: members(u, ready_only=True) == three, 30, f"{url} sees three")
    kill(procs, proc_b)
    for url in (first, second):
        wait_for(lambda u=url: members(u) == both, TTL + 3, f"{url} drops the dead one")


def test_a_worker_started_before_etcd_registers_when_it_comes(procs: Procs, tmp_path: Path) -> None:
    etcd = EtcdServer(tmp_path / "etcd")
    try:
        gen, _ = register(procs, etcd, "generation")
        wait_healthy(gen, procs)  # serves without etcd
        etcd.start()
        wait_for(lambda: gen in records(etcd), 10, "registered once etcd is up")
    finally:
        etcd.stop()


def test_bad_register_flags_exit_2_with_a_message(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "disagg.cli", "worker", "--port", str(free_port())]
    for args, says in (
        (["--register", "https://x:1"], "etcd://host:port"),
        (["--register", "etcd://x:1", "--cluster", "a/b"], "--cluster"),
        (["--register", "etcd://x:1", "--register-ttl", "0.5"], "TTL"),
    ):
        done = subprocess.run([*base, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and says in done.stderr, (args, done.stderr)


def test_records_that_break_the_decoder_do_not_stop_discovery(
    procs: Procs, etcd: EtcdServer, tmp_path: Path
) -> None:
    ctx, _ = register(procs, etcd, "context")
    gen_a, _ = register(procs, etcd, "generation")
    url = orchestrator(procs, tmp_path, etcd)
    wait_for(lambda: len(members(url, ready_only=True)) == 2, 10, "both ready")
    prefix = registry.prefix("t")
    # gen_a again, spelled with a trailing slash: the same worker
    again = records(etcd)[gen_a]
    again.url = gen_a + "/"
    write(etcd, prefix + "again", registry.encode(again))
    write(etcd, prefix + "deep", b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    write(etcd, prefix + "junk", b"not json")
    gen_b, _ = register(procs, etcd, "generation")
    wait_for(lambda: ("generation", gen_b) in members(url, ready_only=True), 10, "still followed")
    assert metric(url, 'disagg_discovery_up{backend="etcd"}') == 1.0
    info = httpx.get(url + "/cluster_info", timeout=5).json()
    assert sorted(w["url"] for w in info["generation_servers"]) == sorted([gen_a, gen_b])
    assert [w["url"] for w in info["context_servers"]] == [ctx]


def test_a_drain_outlasts_the_worker_leaving_and_rejoining(
    procs: Procs, etcd: EtcdServer, tmp_path: Path
) -> None:
    """An admin drained a worker; its record goes (as when its lease expires while etcd was
    out of its reach) and comes back: it is still drained, until resumed."""
    register(procs, etcd, "context")
    gen, _ = register(procs, etcd, "generation")
    admin = tmp_path / "admin.txt"
    admin.write_text("the-admin-key\n")
    url = orchestrator(procs, tmp_path, etcd, admin_key_file=str(admin))
    headers = {"Authorization": "Bearer the-admin-key"}

    def drained() -> bool | None:
        info = httpx.get(url + "/admin/workers", headers=headers, timeout=5).json()
        found = [w["cordoned"] for w in info["generation_servers"] if w["url"] == gen]
        return found[0] if found else None

    wait_for(lambda: drained() is False, 10, "the worker found")
    r = httpx.post(url + "/admin/workers/drain", json={"url": gen}, headers=headers, timeout=5)
    assert r.status_code == 200 and drained() is True
    key = registry.key("t", gen)
    record = registry.encode(records(etcd)[gen])
    write(etcd, key, None)
    wait_for(lambda: drained() is None, 5, "the worker left")
    write(etcd, key, record)
    wait_for(lambda: drained() is not None, 5, "the worker is back")
    assert drained() is True
    r = httpx.post(url + "/admin/workers/resume", json={"url": gen}, headers=headers, timeout=5)
    assert r.status_code == 200 and drained() is False
