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
import re
import signal
import socket
import string
import struct
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from disagg.demo import free_port

HOST = "127.0.0.1"
# Measured on 2 cores with 32 clients: a healthy request waits up to ~7 s for its answer to
# start (~11 s while a pool is down to one worker), chunks come < 1 s apart. The leg deadlines
# sit above that, so only a fault (or the orchestrator) ever trips them.
TUNING: dict[str, Any] = {
    "health_check_interval": 0.5,
    "health_fail_threshold": 2,
    "health_ok_threshold": 1,
    "request_timeout": 30,
    "connect_timeout": 1,
    "context_timeout": 15,
    "first_token_timeout": 15,
    "stream_idle_timeout": 5,
    "max_retries": 3,  # a fault every 2-3 s on 4 workers hits many requests twice
    "transient_retries": 5,
    "retry_interval": 0.1,
}
HUNG_AFTER_S = TUNING["request_timeout"] + 10
FAULT_EVERY_S = (2.0, 3.0)
FAULT_HOLD_S = 2.0
RESTART_AFTER_S = 1.0
RESET_AFTER_BYTES = (200, 600)  # past the HTTP headers, into the body or an SSE event
STARTUP_S, SETTLE_S, STOP_S = 60.0, 30.0, 10.0
PROBE = aiohttp.ClientTimeout(total=2)
ALPHABET = string.ascii_letters + string.digits + "     .,?"
RESULTS = Path(__file__).parent / "results" / "chaos.json"

Tally = dict[str, Counter[str]]  # "stream" / "non_stream" / "notes" -> what -> count


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

    async def wait_healthy(self, session: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTUP_S
        while loop.time() < deadline:
            if not self.running:
                raise RuntimeError(f"{self.name} exited; see {self.log}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(self.url + "/health", timeout=PROBE) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{self.name} not healthy after {STARTUP_S:g} s; see {self.log}")


class _Connection:
    """Both sides of one proxied connection."""

    def __init__(self, client: asyncio.StreamWriter, worker: asyncio.StreamWriter) -> None:
        self.sides = (client, worker)
        self.cut: int | None = None  # answer bytes still forwarded before the reset

    def reset(self) -> None:
        """Close both sides with a TCP RST instead of a FIN."""
        for writer in self.sides:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()


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
            writer.transport.abort()
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
                if to_worker and data.startswith((b"GET ", b"POST ")):  # a new request
                    doomed = self.resetting and data.startswith(b"POST /v1/")
                    conn.cut = self.rng.randint(*RESET_AFTER_BYTES) if doomed else None
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


def _note(error: Any) -> str:
    """An error object as one short line, numbers (ports, ids) masked so that like counts like."""
    if not isinstance(error, dict):
        return f"error: {error!r}"[:120]
    return re.sub(r"\d+", "N", f"{error.get('type')}: {error.get('message')}")[:120]


def _whole_answer(status: int, raw: bytes) -> tuple[str, str]:
    """'ok' (200 with choices), 'error' (an OpenAI error body, any status) or 'broken', and
    what the error said."""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if isinstance(data, dict) and status == 200 and data.get("choices"):
        return "ok", ""
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return "error", f"HTTP {status} {_note(data['error'])}"
    return "broken", f"HTTP {status} without an error object"


async def _stream_answer(resp: aiohttp.ClientResponse) -> tuple[str, str]:
    """'ok', 'error_event' (an error event, then [DONE]), 'torn' (a line that is not a `data:`
    field, or an event that is not a JSON object) or 'dropped' (it ended without [DONE], or
    without an error or a finish_reason)."""
    done = finished = False
    error = ""
    try:
        async for line in resp.content:
            if not line.startswith(b"data: "):
                if line.strip() and not line.startswith(b":"):
                    return "torn", "line " + re.sub(r"\d+", "N", repr(line[:60]))
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            try:
                event = json.loads(payload)
            except ValueError:
                event = None
            if not isinstance(event, dict):
                return "torn", "event ending " + re.sub(r"\d+", "N", repr(payload[-60:]))
            if "error" in event:
                error = error or _note(event["error"])
            finished = finished or any(c.get("finish_reason") for c in event.get("choices") or [])
    except aiohttp.ClientError as exc:
        return "dropped", type(exc).__name__
    if done and error:
        return "error_event", error
    return ("ok", "") if done and finished else ("dropped", f"done={done} finished={finished}")


async def _client(
    session: aiohttp.ClientSession, url: str, rng: random.Random, end: float, tally: Tally
) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() < end:
        path, body = _random_request(rng)
        kind = "stream" if body["stream"] else "non_stream"
        try:
            async with asyncio.timeout(HUNG_AFTER_S), session.post(url + path, json=body) as resp:
                if body["stream"] and resp.status == 200:
                    outcome, note = await _stream_answer(resp)
                else:
                    outcome, note = _whole_answer(resp.status, await resp.read())
        except TimeoutError:
            outcome, note = "hung", f"no answer within {HUNG_AFTER_S} s"
        except aiohttp.ClientError as exc:
            outcome, note = "broken", type(exc).__name__
        if kind == "stream":
            outcome = {"error": "error_event", "broken": "dropped"}.get(outcome, outcome)
        tally[kind][outcome] += 1
        if note:
            tally["notes"][f"{kind} {outcome}: {note}"] += 1


class Chaos:
    """A fault 2-3 s after the previous one began (or when it ends, if later) until `end`;
    the kinds take turns in a shuffled order."""

    KINDS = ("kill9", "sigstop", "reset")

    def __init__(
        self, workers: list[Process], proxy: ResetProxy, probe: aiohttp.ClientSession, seed: float
    ) -> None:
        self.workers, self.proxy, self.probe = workers, proxy, probe
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter(dict.fromkeys(self.KINDS, 0))
        self.timeline: list[str] = []  # "<s since the load began> <fault> <target>"

    async def run(self, end: float) -> None:
        loop = asyncio.get_running_loop()
        turn: list[str] = []
        began = at = loop.time()
        while (at := at + self.rng.uniform(*FAULT_EVERY_S)) < end:
            await asyncio.sleep(max(0.0, at - loop.time()))
            at = loop.time()
            turn = turn or self.rng.sample(self.KINDS, len(self.KINDS))
            kind = turn.pop()
            worker = self.rng.choice(self.workers)
            target = "proxy" if kind == "reset" else worker.name
            self.timeline.append(f"{at - began:.1f} {kind} {target}")
            if kind == "kill9":
                await self.kill9(worker)
            elif kind == "sigstop":
                await self.sigstop(worker)
            else:
                await self.reset()
            self.counts[kind] += 1

    async def kill9(self, worker: Process) -> None:
        await worker.kill()
        await asyncio.sleep(RESTART_AFTER_S)
        await worker.start()
        await worker.wait_healthy(self.probe)

    async def sigstop(self, worker: Process) -> None:
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


async def _kv(session: aiohttp.ClientSession, workers: list[Process]) -> list[dict[str, Any]]:
    """Each worker's /stats, asked on its own port (never through the proxy)."""
    return [await _get(session, w.url + "/stats") for w in workers]


async def _settle(
    session: aiohttp.ClientSession, orchestrator: Process, workers: list[Process], free0: list[int]
) -> dict[str, Any]:
    """Leak figures: the first clean snapshot within SETTLE_S, else the last one taken."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_S
    snap: dict[str, Any] | None = None
    while loop.time() < deadline:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            info = await _get(session, orchestrator.url + "/cluster_info")
            stats = await _kv(session, workers)
            kv = [s["kv"] for s in stats]
            snap = {
                "in_flight": sum(
                    w["in_flight"] for w in info["context_servers"] + info["generation_servers"]
                ),
                "pinned": sum(s["pinned"] for s in stats),
                "worker_busy": sum(s["running"] + s["waiting"] for s in stats),
                "kv_blocks_restored": all(k["used"] == 0 for k in kv)
                and [k["free"] + k["cached"] for k in kv] == free0
                and all(k["free"] + k["cached"] == k["num_blocks"] for k in kv),
            }
            if snap["kv_blocks_restored"] and not (
                snap["in_flight"] or snap["pinned"] or snap["worker_busy"]
            ):
                return snap
        await asyncio.sleep(0.25)
    if snap is None:
        raise RuntimeError(f"no leak snapshot succeeded within {SETTLE_S:g} s")
    return snap


def _config(port: int, proxy: ResetProxy, workers: list[Process]) -> dict[str, Any]:
    def urls(role: str) -> list[str]:
        ports = [w.port for w in workers if w.name.startswith(role)]
        return [f"{HOST}:{proxy.port if p == proxy.target_port else p}" for p in ports]

    return {
        "hostname": HOST,
        "port": port,
        "context_servers": {"urls": urls("context")},
        "generation_servers": {"urls": urls("generation")},
        **TUNING,
    }


async def _load(url: str, duration_s: float, concurrency: int, seed: float, chaos: Chaos) -> Tally:
    tally: Tally = {"non_stream": Counter(), "stream": Counter(), "notes": Counter()}
    rng = random.Random(seed)
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
        "stream_failed_without_error_event": st["torn"] + st["dropped"],
        "requests": n_ns + n_st,
        "requests_per_s": round((n_ns + n_st) / elapsed_s, 1),
        "non_stream": {"total": n_ns, **ns},
        "stream": {"total": n_st, **st},
        "stream_failed_with_error_event": st["error_event"],
        "faults": dict(chaos.counts),
        "proxy_resets": chaos.proxy.resets,
        "worker_busy": snap["worker_busy"],
        "failures": dict(tally["notes"].most_common()),
        "fault_timeline": chaos.timeline,
    }


async def run_chaos(
    duration_s: float = 30, concurrency: int = 32, seed: int = 0, workdir: Path | None = None
) -> dict[str, Any]:
    """Start the cluster, load it under faults for `duration_s`, settle, report; logs and the
    cluster file go to `workdir` (a temporary directory if None)."""
    rng = random.Random(seed)
    if workdir is not None:
        await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
        result = await _run(duration_s, concurrency, rng, workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="disagg-chaos-") as tmp:
            result = await _run(duration_s, concurrency, rng, Path(tmp))
    return {**result, "duration_s": duration_s, "concurrency": concurrency, "seed": seed}


async def _run(
    duration_s: float, concurrency: int, rng: random.Random, workdir: Path
) -> dict[str, Any]:
    workers = [
        Process(f"{role}{i}", ["worker", "--role", role, "--port", str(port)], port, workdir)
        for role in ("context", "generation")
        for i, port in enumerate((free_port(), free_port()))
    ]
    config, port = workdir / "cluster.yaml", free_port()
    orchestrator = Process("orchestrator", ["serve", "--config", str(config)], port, workdir)
    proxy = ResetProxy(workers[2].port, random.Random(rng.random()))
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as probe:
        try:
            await proxy.start()
            for w in workers:
                await w.start()
            for w in workers:
                await w.wait_healthy(probe)
            free0 = [s["kv"]["free"] + s["kv"]["cached"] for s in await _kv(probe, workers)]
            config.write_text(yaml.safe_dump(_config(port, proxy, workers)))
            await orchestrator.start()
            await orchestrator.wait_healthy(probe)

            chaos = Chaos(workers, proxy, probe, rng.random())
            began = loop.time()
            tally = await _load(orchestrator.url, duration_s, concurrency, rng.random(), chaos)
            elapsed = loop.time() - began
            for w in workers:
                w.signal(signal.SIGCONT)
                if not w.running:
                    await w.start()
                await w.wait_healthy(probe)
            snap = await _settle(probe, orchestrator, workers, free0)
        finally:
            for p in (orchestrator, *workers):
                await p.stop()
            await proxy.close()
    return _result(tally, snap, chaos, elapsed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=32, help="clients, each in a loop")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON line goes")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and config here")
    args = parser.parse_args(argv)
    result = asyncio.run(run_chaos(args.duration, args.concurrency, args.seed, args.workdir))
    line = json.dumps(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
