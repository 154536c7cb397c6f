"""`disagg demo`: one orchestrator and one context and one generation reference worker on
free loopback ports, one streamed chat request through them, then serve until Ctrl-C.

It owns the processes it starts and stops every one of them on every exit path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Processes:
    """Child processes started by the demo; `stop` ends them all."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def start(self, *args: str) -> None:
        cmd = [sys.executable, "-m", "disagg.cli", "--log-level", "warning", *args]
        self.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))

    def stop(self) -> None:
        """SIGTERM every process, then SIGKILL what is left after 10 s. A second Ctrl-C
        while stopping (the terminal sends it to the children too) is ignored here."""
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            for p in self.procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            for p in self.procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def check_alive(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args!r} exited with {p.returncode}")


async def _wait_healthy(url: str, procs: Processes, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            procs.check_alive()
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} did not become healthy within {timeout_s:.0f} s")


async def _chat(url: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    text: list[str] = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/chat/completions", json=body) as resp,
    ):
        if resp.status != 200:
            raise RuntimeError(f"request failed: {resp.status} {await resp.text()}")
        route = resp.headers.get("x-disagg-route", "")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or ""
                text.append(piece)
                print(piece, end="", flush=True)
    print()
    return "".join(text), route


def run_demo(*, once: bool, prompt: str, max_tokens: int) -> int:
    ctx_port, gen_port, port = free_port(), free_port(), free_port()
    procs = Processes()
    with tempfile.TemporaryDirectory(prefix="disagg-demo-") as tmp:
        config = Path(tmp) / "cluster.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "hostname": "127.0.0.1",
                    "port": port,
                    "context_servers": {"num_instances": 1, "urls": [f"127.0.0.1:{ctx_port}"]},
                    "generation_servers": {"num_instances": 1, "urls": [f"127.0.0.1:{gen_port}"]},
                }
            )
        )
        try:
            procs.start("worker", "--role", "context", "--port", str(ctx_port))
            procs.start("worker", "--role", "generation", "--port", str(gen_port))
            procs.start("serve", "--config", str(config))
            url = f"http://127.0.0.1:{port}"
            return asyncio.run(_session(url, procs, once, prompt, max_tokens))
        except KeyboardInterrupt:
            print("\nstopping")
            return 0
        except (RuntimeError, TimeoutError, aiohttp.ClientError) as exc:
            print(f"disagg demo: {exc}", file=sys.stderr)
            return 1
        finally:
            procs.stop()


async def _session(url: str, procs: Processes, once: bool, prompt: str, max_tokens: int) -> int:
    t0 = time.monotonic()
    await _wait_healthy(url, procs)
    print(f"orchestrator ready at {url} ({time.monotonic() - t0:.1f} s)")
    print(f"> {prompt}")
    _text, route = await _chat(url, prompt, max_tokens)
    print(f"route: {route}")
    if once:
        return 0
    print(
        f"\nServing on {url} (Ctrl-C stops every process). Try:\n"
        f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        '    -d \'{"model": "tiny", "messages": [{"role": "user", "content":'
        ' "Hello"}], "max_tokens": 32}\''
    )
    while True:
        await asyncio.sleep(1)
        procs.check_alive()


if os.name != "posix":  # pragma: no cover
    raise ImportError("disagg demo needs a POSIX system")
