"""Placement quality of the routing policies, side by side: for each policy, 4 context and 4
generation reference workers with small KV caches (so no worker holds every prefix) and an
orchestrator routing both pools with it, fresh processes each time, serve the same seeded
shared-prefix chat workload (system prompts x short user turns, plus multi-turn chats whose
history grows), streamed. Reports the cache hit rate, TTFT and, for kv_cache_aware, how often
the predicted cache hit was right to within one block; prints a table, writes JSON.
A policy may name a schedule style after a colon (`kv_cache_aware:generation_first`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import string
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.chaos import HOST, PROBE, Process
from disagg.demo import free_port

POLICIES = (
    "round_robin",
    "load_balancing",
    "power_of_two",
    "kv_cache_aware",
    "kv_cache_aware:generation_first",
)
CONTEXT, GENERATION = 4, 4
BLOCK, NUM_BLOCKS = 16, 128  # 2k tokens a worker: ~4 of the 20 system prompts (~30 blocks each)
SYSTEMS, SYSTEM_CHARS, USER_CHARS, REPLY_CHARS = 20, (300, 600), (20, 80), (40, 120)
CHAT_SHARE, CHAT_GAP, CHAT_MAX_CHARS = 0.25, 8, 1200  # turns of one chat are >= 8 requests apart
MAX_TOKENS, REQUEST_S, READY_S = 8, 60.0, 30.0
BODY = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
BODY["stream_options"] = {"include_usage": True}  # usage: prompt and cached tokens
RESULTS = Path(__file__).parent / "results" / "placement.json"
# OpenBLAS threads spin while they wait: 9 processes, 2 threads each, on 2 cores made every
# request ~10x slower. One BLAS thread a worker keeps the figures about placement.
CHILD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Setup:  # what a run varies besides the policy
    concurrency: int = 6
    num_blocks: int = NUM_BLOCKS
    kv_events_interval: float = 0.1
    replicas: int = 1  # orchestrators over the same workers, requests spread round robin


@dataclass(frozen=True)
class Job:
    family: str  # "s<system>" for a single turn, "c<chat>" for a turn of a multi-turn chat
    messages: list[dict[str, str]]


@dataclass
class Record:
    family: str
    sent_s: float = 0.0  # since the load began
    ttft_s: float = 0.0
    done_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    route: dict[str, str] = field(default_factory=dict)
    error: str = ""


def _text(rng: random.Random, chars: tuple[int, int]) -> str:
    want, words = rng.randint(*chars), list[str]()
    while sum(len(w) + 1 for w in words) < want:
        words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))))
    return " ".join(words)[:want]


def workload(n: int, seed: int) -> list[Job]:
    """n requests: single turns on a random system prompt, and turns of chats (each on a
    system prompt too) whose history grows by the previous user turn and a fixed reply."""
    rng = random.Random(seed)
    systems = [_text(rng, SYSTEM_CHARS) for _ in range(SYSTEMS)]
    chats: dict[int, list[dict[str, str]]] = {}
    last: dict[int, int] = {}  # chat -> index of its latest turn
    jobs: list[Job] = []
    for i in range(n):
        system = {"role": "system", "content": rng.choice(systems)}
        if rng.random() >= CHAT_SHARE:
            user = {"role": "user", "content": _text(rng, USER_CHARS)}
            jobs.append(Job(f"s{systems.index(system['content'])}", [system, user]))
            continue
        ready = [c for c, at in last.items() if i - at >= CHAT_GAP]
        chat = rng.choice(ready) if ready and rng.random() < 0.75 else len(chats)
        history = chats.setdefault(chat, [system])
        history.append({"role": "user", "content": _text(rng, USER_CHARS)})
        jobs.append(Job(f"c{chat}", list(history)))
        history.append({"role": "assistant", "content": _text(rng, REPLY_CHARS)})
        last[chat] = i
        if sum(len(m["content"]) for m in history) > CHAT_MAX_CHARS:
            del last[chat]  # long enough: this chat ends
    return jobs


def parse_route(header: str) -> dict[str, str]:
    """`x-disagg-route`: `k=v` pairs separated by `; `."""
    pairs = (part.partition("=") for part in header.split("; ") if "=" in part)
    return {k.strip(): v.strip() for k, _, v in pairs}


async def _send(session: aiohttp.ClientSession, url: str, job: Job, began: float) -> Record:
    loop = asyncio.get_running_loop()
    rec = Record(job.family, sent_s=loop.time() - began)
    body = {**BODY, "messages": job.messages}
    try:
        async with (
            asyncio.timeout(REQUEST_S),
            session.post(url + "/v1/chat/completions", json=body) as resp,
        ):
            rec.route = parse_route(resp.headers.get("x-disagg-route", ""))
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}"
                return rec
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                rec.ttft_s = rec.ttft_s or loop.time() - began - rec.sent_s
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    rec.error = str(event["error"])[:120]
                if usage := event.get("usage"):
                    rec.prompt_tokens = int(usage["prompt_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = int(details.get("cached_tokens", 0))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        rec.error = rec.error or type(exc).__name__
    rec.done_s = loop.time() - began
    rec.error = rec.error or ("" if rec.prompt_tokens else "no usage chunk")
    return rec


async def _load(urls: list[str], jobs: list[Job], concurrency: int) -> list[Record]:
    """`concurrency` clients take the jobs in order; each sends its next when one finishes.
    Job i goes to orchestrator `urls[i % len(urls)]`, as a balancer in front of replicas
    would spread them (so a chat's turns land on different replicas)."""
    records: list[Record | None] = [None] * len(jobs)
    todo = iter(range(len(jobs)))
    began = asyncio.get_running_loop().time()

    async def client(session: aiohttp.ClientSession) -> None:
        for i in todo:
            records[i] = await _send(session, urls[i % len(urls)], jobs[i], began)

    connector = aiohttp.TCPConnector(limit=concurrency + 2)
    async with aiohttp.ClientSession(connector=connector) as session, asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(client(session))
    return [r for r in records if r is not None]


async def _all_ready(session: aiohttp.ClientSession, url: str) -> None:
    """Returns once the orchestrator says every worker of both pools is ready."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_S
    while loop.time() < deadline:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(url + "/cluster_info", timeout=PROBE) as resp:
                info: dict[str, Any] = await resp.json()
            pools = info["context_servers"] + info["generation_servers"]
            if len(pools) == CONTEXT + GENERATION and all(w["ready"] for w in pools):
                return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"not every worker ready at {url} after {READY_S:g} s")


def _config(policy: str, port: int, workers: list[Process], setup: Setup) -> dict[str, Any]:
    def urls(role: str) -> list[str]:
        return [f"{HOST}:{w.port}" for w in workers if w.name.startswith(role)]

    router, _, schedule = policy.partition(":")
    return {
        "hostname": HOST,
        "port": port,
        "router": {"type": router},
        "schedule_style": schedule or "context_first",
        "context_servers": {"urls": urls("context")},
        "generation_servers": {"urls": urls("generation")},
        "health_check_interval": 0.5,
        "kv_events_interval": setup.kv_events_interval,
        "request_timeout": REQUEST_S,
    }


async def _generation_hits(session: aiohttp.ClientSession, workers: list[Process]) -> float:
    """The generation workers' own cache hit rate: prompt tokens they already held, so the
    KV transfer skipped them (their /stats, summed)."""
    queried = hit = 0
    for w in workers:
        if w.name.startswith("generation"):
            async with session.get(w.url + "/stats", timeout=PROBE) as resp:
                kv = (await resp.json())["kv"]
            queried, hit = queried + kv["queried_tokens"], hit + kv["hit_tokens"]
    return round(hit / queried, 4) if queried else 0.0


async def run_policy(
    policy: str, jobs: list[Job], setup: Setup, workdir: Path
) -> tuple[list[Record], float]:
    """Fresh workers and an orchestrator for `policy`, loaded with `jobs`; the records and the
    generation workers' hit rate."""
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    blocks = ["--num-blocks", str(setup.num_blocks)]
    workers = [
        Process(
            f"{role}{i}", ["worker", "--role", role, "--port", str(port), *blocks], port, workdir
        )
        for role, count in (("context", CONTEXT), ("generation", GENERATION))
        for i, port in enumerate(free_port() for _ in range(count))
    ]
    orchestrators = []
    for i in range(setup.replicas):
        config, port = workdir / f"cluster{i}.yaml", free_port()
        config.write_text(yaml.safe_dump(_config(policy, port, workers, setup)))
        args = ["serve", "--config", str(config)]
        orchestrators.append(Process(f"orchestrator{i}", args, port, workdir))
    async with aiohttp.ClientSession() as probe:
        try:
            for w in workers:
                await w.start()
            for w in workers:
                await w.wait_healthy(probe)
            for o in orchestrators:
                await o.start()
            for o in orchestrators:
                await o.wait_healthy(probe)
                await _all_ready(probe, o.url)
            records = await _load([o.url for o in orchestrators], jobs, setup.concurrency)
            return records, await _generation_hits(probe, workers)
        finally:
            await asyncio.gather(*(p.stop() for p in (*orchestrators, *workers)))


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * q))] if xs else 0.0


def _neighbours(rec: Record, records: list[Record]) -> int:
    """Requests in flight on rec's context worker when rec was sent: the legs whose blocks
    change that cache between rec's routing and its admission there."""
    ctx = rec.route.get("context")
    return sum(o.route.get("context") == ctx and o.sent_s < rec.sent_s < o.done_s for o in records)


def summarize(policy: str, records: list[Record]) -> dict[str, Any]:
    ok = [r for r in records if not r.error]
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    ttft = [r.ttft_s for r in ok]
    out: dict[str, Any] = {
        "policy": policy,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_mean_ms": round(1000 * sum(ttft) / len(ttft), 1) if ttft else 0.0,
        "ttft_p50_ms": round(1000 * _pct(ttft, 0.5), 1),
        "ttft_p99_ms": round(1000 * _pct(ttft, 0.99), 1),
        # legs per context worker, busiest first: how evenly the policy spread the load
        "context_legs": sorted(Counter(r.route.get("context") for r in ok).values())[::-1],
    }
    if policy.startswith("kv_cache_aware") and ok:
        err = [int(r.route.get("predicted_cached_tokens", 0)) - r.cached_tokens for r in ok]
        out["prediction_accuracy"] = round(sum(abs(e) <= BLOCK for e in err) / len(ok), 4)
        out["under_predicted"] = sum(e < -BLOCK for e in err)  # hit more than the index knew
        out["over_predicted"] = sum(e > BLOCK for e in err)  # index held blocks already gone
        busy = [_neighbours(r, ok) for r in ok]
        wrong = [b for b, e in zip(busy, err, strict=True) if abs(e) > BLOCK]
        out["neighbours_mean_all"] = round(sum(busy) / len(ok), 2)
        out["neighbours_mean_mispredicted"] = round(sum(wrong) / len(wrong), 2) if wrong else 0.0
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'policy':<31} reqs err  hit rate  x rr  gen hit  TTFT mean   p50   p99 ms  x rr"
        "  pred acc"
    ]
    for r in rows:
        acc = r.get("prediction_accuracy")
        lines.append(
            f"{r['policy']:<31} {r['requests']:4d} {r['errors']:3d}  {r['hit_rate']:8.3f}"
            f"  {r.get('hit_rate_vs_round_robin', 0):4.2f}  {r['generation_hit_rate']:7.3f}"
            f"  {r['ttft_mean_ms']:9.1f}"
            f" {r['ttft_p50_ms']:5.0f} {r['ttft_p99_ms']:5.0f}"
            f"     {r.get('ttft_mean_vs_round_robin', 0):4.2f}"
            f"  {'-' if acc is None else f'{100 * acc:6.1f} %'}"
        )
    return "\n".join(lines)


async def run(
    policies: list[str], n: int, seed: int, setup: Setup, workdir: Path
) -> dict[str, Any]:
    main = asyncio.current_task()
    assert main is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)  # like Ctrl-C
    jobs = workload(n, seed)
    rows: list[dict[str, Any]] = []
    for policy in policies:
        where = workdir / policy.replace(":", "-")
        records, generation_hits = await run_policy(policy, jobs, setup, where)
        dump = json.dumps([asdict(r) for r in records])
        await asyncio.to_thread((where / "records.json").write_text, dump)
        rows.append(summarize(policy, records) | {"generation_hit_rate": generation_hits})
    base = next((r for r in rows if r["policy"] == "round_robin" and r["hit_rate"]), None)
    for r in rows:
        if base is not None:
            r["hit_rate_vs_round_robin"] = round(r["hit_rate"] / base["hit_rate"], 2)
            r["ttft_mean_vs_round_robin"] = round(r["ttft_mean_ms"] / base["ttft_mean_ms"], 2)
    topology = {"context": CONTEXT, "generation": GENERATION, "block_size": BLOCK}
    workload_ = {"requests": n, "seed": seed, "systems": SYSTEMS, "chat_share": CHAT_SHARE}
    return {"setup": asdict(setup) | topology, "workload": workload_, "policies": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.placement", description=__doc__)
    parser.add_argument("--requests", type=int, default=400, help="requests per policy")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 40 requests")
    parser.add_argument("--concurrency", type=int, default=Setup.concurrency)
    parser.add_argument("--num-blocks", type=int, default=NUM_BLOCKS, help="KV blocks a worker")
    parser.add_argument("--events-interval", type=float, default=Setup.kv_events_interval)
    parser.add_argument("--replicas", type=int, default=1, help="orchestrators, round robin")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and records here")
    args = parser.parse_args(argv)
    n = 40 if args.quick else args.requests
    policies = [p for p in args.policies.split(",") if p]
    for key, value in CHILD_ENV.items():  # the workers inherit it
        os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory(prefix="disagg-placement-") as tmp:
        workdir = args.workdir or Path(tmp)
        setup = Setup(args.concurrency, args.num_blocks, args.events_interval, args.replicas)
        try:
            result = asyncio.run(run(policies, n, args.seed, setup, workdir))
        except (KeyboardInterrupt, asyncio.CancelledError):
            print("interrupted; every process it started is stopped", file=sys.stderr)
            return 130
    print(table(result["policies"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
