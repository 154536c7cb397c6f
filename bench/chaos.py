"""Chaos run: 2 context + 2 generation reference workers and an orchestrator, each its own
process on loopback, under `concurrency` looping clients while a fault task, every 2-3 s,
kill -9s a worker and restarts it, SIGSTOPs one for 2 s, or makes a TCP proxy in front of one
generation worker reset inference connections mid-answer. Afterwards every worker runs again
and the run reports what users and operators notice: hung requests, the non-stream success
rate, streams that broke without an error event, and leaks (in-flight legs, pinned KV, blocks).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import socket
import string
import struct
import sys
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from disagg.demo import free_port

HOST = "127.0.0.1"
# Deadlines short enough that a stopped worker is noticed, long enough that a healthy leg under
# this load (2 CPU cores, 32 clients) never comes near one.
TUNING: dict[str, Any] = {
    "health_check_interval": 0.5,
    "health_fail_threshold": 2,
    "health_ok_threshold": 1,
    "request_timeout": 30,
    "connect_timeout": 1,
    "context_timeout": 10,
    "first_token_timeout": 10,
    "stream_idle_timeout": 5,
    "max_retries": 3,
    "transient_retries": 5,
    "retry_interval": 0.1,
}
HUNG_AFTER_S = TUNING["request_timeout"] + 10
FAULT_EVERY_S = (2.0, 3.0)
FAULT_HOLD_S = 2.0
RESTART_AFTER_S = 1.0
RESET_AFTER_BYTES = (200, 600)  # past the HTTP headers, into the body or first SSE chunk
STARTUP_S, SETTLE_S, STOP_S = 60.0, 30.0, 10.0
PROBE = aiohttp.ClientTimeout(total=2)
ALPHABET = string.ascii_letters + string.digits + "     .,?"
RESULTS = Path(__file__).parent / "results" / "chaos.json"


class Process:
    """One `disagg` child process serving on `port`; it can be killed, stopped and restarted."""

    def __init__(self, name: str, args: list[str], port: int, logdir: Path) -> None:
        self.name, self.args, self.port = name, args, port
        self.url = f"http://{HOST}:{port}"
        self.log = logdir / f"{name}.log"
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        cmd = [sys.executable, "-m", "disagg.cli", "--log-level", "warning", *self.args]
        with self.log.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log
            )

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.running:
            self.proc.send_signal(sig)

    async def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            await self.proc.wait()

    async def stop(self) -> None:
        """SIGTERM (after SIGCONT, in case it is stopped), then SIGKILL if it lingers."""
        if self.proc is None or not self.running:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(STOP_S):
                await self.proc.wait()
        except TimeoutError:
            await self.kill()

    async def wait_healthy(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if not self.running:
                raise RuntimeError(f"{self.name} exited; see {self.log}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(self.url + "/health", timeout=PROBE) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{self.name} not healthy after {timeout_s:g} s; see {self.log}")


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST instead of a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Connection:
    def __init__(self, client: asyncio.StreamWriter, worker: asyncio.StreamWriter) -> None:
        self.client, self.worker = client, worker
        self.cut: int | None = None  # answer bytes still forwarded before the reset

    def reset(self) -> None:
        _reset(self.client)
        _reset(self.worker)


class ResetProxy:
    """A TCP proxy on loopback in front of one worker. While `resetting` is on, a connection
    that carries an inference request (POST /v1/...) gets part of the answer, then a TCP RST on
    both sides; everything else (health checks) passes untouched."""

    def __init__(self, target_port: int, rng: random.Random) -> None:
        self.target_port, self.rng = target_port, rng
        self.port = free_port()
        self.resetting = False
        self.resets = 0
        self._server: asyncio.Server | None = None
        self._open: set[_Connection] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, HOST, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._open):
            conn.reset()
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(HOST, self.target_port)
        except OSError:
            _reset(writer)
            return
        conn = _Connection(writer, up_writer)
        self._open.add(conn)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._pump(conn, reader, up_writer, to_worker=True))
                tg.create_task(self._pump(conn, up_reader, writer, to_worker=False))
        finally:
            self._open.discard(conn)
            writer.close()
            up_writer.close()

    async def _pump(
        self,
        conn: _Connection,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        to_worker: bool,
    ) -> None:
        try:
            while data := await src.read(65536):
                if to_worker and self.resetting and data.startswith(b"POST /v1/"):
                    conn.cut = self.rng.randint(*RESET_AFTER_BYTES)
                if not to_worker and conn.cut is not None:
                    data = data[: conn.cut]
                    conn.cut -= len(data)
                dst.write(data)
                await dst.drain()
                if not to_worker and conn.cut == 0:
                    await asyncio.sleep(0.05)  # the client reads what it got before the RST
                    self.resets += 1
                    conn.reset()
                    return
            if dst.can_write_eof():
                dst.write_eof()
        except OSError:
            conn.reset()


Tally = dict[str, Counter[str]]  # "stream" / "non_stream" -> outcome -> count


def _random_request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    prompt = "".join(rng.choices(ALPHABET, k=rng.randint(5, 200)))
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": rng.randint(4, 32),
        "temperature": 0,
        "stream": rng.random() < 0.5,
    }
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": prompt}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}


def _whole_answer(status: int, raw: bytes) -> str:
    """ "ok" (200 with choices), "error" (an OpenAI error body) or "broken"."""
    try:
        data = json.loads(raw)
    except ValueError:
        return "broken"
    if not isinstance(data, dict):
        return "broken"
    if status == 200 and data.get("choices"):
        return "ok"
    return "error" if isinstance(data.get("error"), dict) else "broken"


async def _stream_answer(resp: aiohttp.ClientResponse) -> str:
    """ "ok", "error_event" (an error event, then [DONE]) or "no_error_event"."""
    done = finished = errored = False
    try:
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            event = json.loads(payload)
            errored = errored or "error" in event
            finished = finished or any(c.get("finish_reason") for c in event.get("choices") or [])
    except (aiohttp.ClientError, ValueError):
        return "no_error_event"
    if done and errored:
        return "error_event"
    return "ok" if done and finished else "no_error_event"


async def _client(
    session: aiohttp.ClientSession, url: str, rng: random.Random, end: float, tally: Tally
) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() < end:
        path, body = _random_request(rng)
        stream = body["stream"]
        try:
            async with asyncio.timeout(HUNG_AFTER_S), session.post(url + path, json=body) as resp:
                if stream and resp.status == 200:
                    outcome = await _stream_answer(resp)
                else:
                    outcome = _whole_answer(resp.status, await resp.read())
        except TimeoutError:
            outcome = "hung"
        except aiohttp.ClientError:
            outcome = "broken"
        if stream:
            outcome = {"error": "error_event", "broken": "no_error_event"}.get(outcome, outcome)
        tally["stream" if stream else "non_stream"][outcome] += 1


class Chaos:
    """One fault every 2-3 s until `end`; the kinds take turns in a shuffled order."""

    def __init__(
        self,
        workers: list[Process],
        proxy: ResetProxy,
        session: aiohttp.ClientSession,
        rng: random.Random,
    ) -> None:
        self.workers, self.proxy, self.session, self.rng = workers, proxy, session, rng
        self.counts: Counter[str] = Counter({"kill9": 0, "sigstop": 0, "reset": 0})
        self.faults: dict[str, Callable[[], Awaitable[None]]] = {
            "kill9": self.kill9,
            "sigstop": self.sigstop,
            "reset": self.reset,
        }

    async def run(self, end: float) -> None:
        loop = asyncio.get_running_loop()
        turn: list[str] = []
        while (pause := self.rng.uniform(*FAULT_EVERY_S)) < end - loop.time():
            await asyncio.sleep(pause)
            turn = turn or self.rng.sample(list(self.faults), len(self.faults))
            kind = turn.pop()
            await self.faults[kind]()
            self.counts[kind] += 1

    async def kill9(self) -> None:
        worker = self.rng.choice(self.workers)
        await worker.kill()
        await asyncio.sleep(RESTART_AFTER_S)
        await worker.start()
        await worker.wait_healthy(self.session, STARTUP_S)

    async def sigstop(self) -> None:
        worker = self.rng.choice(self.workers)
        worker.signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(FAULT_HOLD_S)
        finally:
            worker.signal(signal.SIGCONT)

    async def reset(self) -> None:
        self.proxy.resetting = True
        try:
            await asyncio.sleep(FAULT_HOLD_S)
        finally:
            self.proxy.resetting = False


async def _get(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, timeout=PROBE) as resp:
        resp.raise_for_status()
        return await resp.json()


async def _kv_stats(session: aiohttp.ClientSession, workers: list[Process]) -> list[Any]:
    return [(await _get(session, w.url + "/stats"))["kv"] for w in workers]


async def _snapshot(
    session: aiohttp.ClientSession, orchestrator: Process, workers: list[Process]
) -> dict[str, Any]:
    """Leak figures: in-flight legs (the orchestrator's view), then each worker's own stats."""
    info = await _get(session, orchestrator.url + "/cluster_info")
    pools = info["context_servers"] + info["generation_servers"]
    stats = [await _get(session, w.url + "/stats") for w in workers]
    kv = [s["kv"] for s in stats]
    return {
        "in_flight": sum(w["in_flight"] for w in pools),
        "pinned": sum(s["pinned"] for s in stats),
        "busy": sum(s["running"] + s["waiting"] for s in stats),
        "used": sum(k["used"] for k in kv),
        "free": [k["free"] + k["cached"] for k in kv],
        "full": all(k["free"] + k["cached"] == k["num_blocks"] for k in kv),
    }


async def _settle(
    session: aiohttp.ClientSession,
    orchestrator: Process,
    workers: list[Process],
    start_free: list[int],
) -> dict[str, Any]:
    """The first clean snapshot within SETTLE_S, else the last one taken."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_S
    last: dict[str, Any] | None = None
    while loop.time() < deadline:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            last = await _snapshot(session, orchestrator, workers)
            last["kv_blocks_restored"] = (
                last["used"] == 0 and last["full"] and last["free"] == start_free
            )
            quiet = not (last["in_flight"] or last["pinned"] or last["busy"])
            if quiet and last["kv_blocks_restored"]:
                return last
        await asyncio.sleep(0.25)
    if last is None:
        raise RuntimeError(f"no leak snapshot succeeded within {SETTLE_S:g} s")
    return last


def _config(port: int, proxy: ResetProxy, workers: list[Process]) -> dict[str, Any]:
    def urls(role: str) -> list[str]:
        return [
            f"{HOST}:{proxy.port if w.port == proxy.target_port else w.port}"
            for w in workers
            if w.name.startswith(role)
        ]

    return {
        "hostname": HOST,
        "port": port,
        "context_servers": {"urls": urls("context")},
        "generation_servers": {"urls": urls("generation")},
        **TUNING,
    }


async def _load(
    url: str, duration_s: float, concurrency: int, rng: random.Random, chaos: Chaos
) -> Tally:
    tally: Tally = {"non_stream": Counter(), "stream": Counter()}
    end = asyncio.get_running_loop().time() + duration_s
    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    async with aiohttp.ClientSession(connector=connector) as session, asyncio.TaskGroup() as tg:
        tg.create_task(chaos.run(end))
        for _ in range(concurrency):
            tg.create_task(_client(session, url, random.Random(rng.random()), end, tally))
    return tally


def _result(tally: Tally, snap: dict[str, Any], chaos: Chaos, elapsed_s: float) -> dict[str, Any]:
    ns, st = tally["non_stream"], tally["stream"]
    n_ns, n_st = sum(ns.values()), sum(st.values())
    return {
        "hung": ns["hung"] + st["hung"],
        "in_flight": snap["in_flight"],
        "pinned": snap["pinned"],
        "kv_blocks_restored": snap["kv_blocks_restored"],
        "non_stream_success_rate": round(ns["ok"] / n_ns, 4) if n_ns else 0.0,
        "stream_failed_without_error_event": st["no_error_event"],
        "requests": n_ns + n_st,
        "requests_per_s": round((n_ns + n_st) / elapsed_s, 1),
        "non_stream": {"total": n_ns, **ns},
        "stream": {"total": n_st, **st},
        "stream_failed_with_error_event": st["error_event"],
        "faults": dict(chaos.counts),
        "proxy_resets": chaos.proxy.resets,
        "worker_busy": snap["busy"],
        "kv_used": snap["used"],
    }


async def run_chaos(
    duration_s: float = 30, concurrency: int = 32, seed: int = 0, workdir: Path | None = None
) -> dict[str, Any]:
    """Start the cluster, load it under faults for `duration_s`, settle, report; logs and the
    cluster file go to `workdir` (a temporary directory if None)."""
    if workdir is not None:
        await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
        return await _run(duration_s, concurrency, random.Random(seed), workdir)
    with tempfile.TemporaryDirectory(prefix="disagg-chaos-") as tmp:
        return await _run(duration_s, concurrency, random.Random(seed), Path(tmp))


async def _run(
    duration_s: float, concurrency: int, rng: random.Random, workdir: Path
) -> dict[str, Any]:
    workers = [
        Process(f"{role}{i}", ["worker", "--role", role, "--port", str(port)], port, workdir)
        for role in ("context", "generation")
        for i, port in enumerate((free_port(), free_port()))
    ]
    config = workdir / "cluster.yaml"
    port = free_port()
    orchestrator = Process("orchestrator", ["serve", "--config", str(config)], port, workdir)
    proxy = ResetProxy(workers[2].port, random.Random(rng.random()))
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        try:
            await proxy.start()
            for w in workers:
                await w.start()
            for w in workers:
                await w.wait_healthy(session, STARTUP_S)
            start_free = [k["free"] + k["cached"] for k in await _kv_stats(session, workers)]
            config.write_text(yaml.safe_dump(_config(port, proxy, workers)))
            await orchestrator.start()
            await orchestrator.wait_healthy(session, STARTUP_S)

            chaos = Chaos(workers, proxy, session, random.Random(rng.random()))
            began = loop.time()
            tally = await _load(orchestrator.url, duration_s, concurrency, rng, chaos)
            elapsed = loop.time() - began
            for w in workers:
                w.signal(signal.SIGCONT)
                if not w.running:
                    await w.start()
                await w.wait_healthy(session, STARTUP_S)
            snap = await _settle(session, orchestrator, workers, start_free)
        finally:
            for p in (orchestrator, *workers):
                await p.stop()
            await proxy.close()
    return {
        **_result(tally, snap, chaos, elapsed),
        "duration_s": duration_s,
        "concurrency": concurrency,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=32, help="clients in a loop")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON line goes")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs here")
    args = parser.parse_args(argv)
    result = asyncio.run(run_chaos(args.duration, args.concurrency, args.seed, args.workdir))
    line = json.dumps(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
