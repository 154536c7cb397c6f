"""Cache-aware routing's expectations: a routed prompt's blocks count as cached on its worker
until the worker's stored events confirm them or a TTL passes; for workers without KV events
(the feed notices the missing endpoint) that TTL is all there is (the approximate mode)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from disagg.cache_aware import CacheAwareRouting
from disagg.cluster import Cluster, StaticDiscovery
from disagg.config import static_config
from disagg.demo import free_port


@contextlib.asynccontextmanager
async def _routing(with_events: bool) -> AsyncIterator[tuple[str, CacheAwareRouting]]:
    """A fake generation worker (with /server_info; with an empty cache's /kv_cache_events
    or none) and cache-aware routing started against it."""

    async def server_info(_r: web.Request) -> web.Response:
        return web.json_response({"block_size": 16})

    async def events(_r: web.Request) -> web.Response:
        body = {"reset": False, "events": [], "last_event_id": 0, "block_size": 16}
        return web.json_response(body)

    app = web.Application()
    app.add_routes([web.get("/server_info", server_info)])
    if with_events:
        app.add_routes([web.post("/kv_cache_events", events)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    config = static_config(
        ["127.0.0.1:1"], [url], generation_servers={"router": {"type": "kv_cache_aware"}}
    )
    cache = CacheAwareRouting(config, Cluster(StaticDiscovery([], [url])))
    try:
        async with aiohttp.ClientSession() as session:
            await cache.start(session)
            yield url, cache
            await cache.stop()
    finally:
        await runner.cleanup()


def test_workers_without_events_learn_from_routing() -> None:
    async def main() -> None:
        async with _routing(with_events=False) as (url, cache):
            cache.routed_ttl_s = 0.2
            hashes = cache.hashes("generation", list(range(100)))
            assert len(hashes) == 6
            assert cache.index.match(hashes, [url]) == {url: 0}
            cache.expect(url, hashes)
            assert cache.index.match(hashes, [url]) == {url: 6}
            await asyncio.sleep(0.3)
            assert cache.index.match(hashes, [url]) == {url: 0}  # the TTL passed

    asyncio.run(main())


def test_routed_blocks_count_until_confirmed_or_expired() -> None:
    async def main() -> None:
        async with _routing(with_events=True) as (url, cache):
            cache.expect_ttl_s = 0.2
            first = cache.hashes("generation", list(range(100)))
            other = cache.hashes("generation", list(range(500, 600)))
            cache.expect(url, first)
            cache.expect(url, other)
            assert cache.index.match(first, [url]) == {url: 6}
            assert cache.index.stats()["expected"] == 12
            # the worker confirms the first prompt's first 4 blocks only
            cache.index.apply(url, [{"type": "stored", "block_hashes": list(first[:4])}])
            await asyncio.sleep(0.3)
            assert cache.index.match(first, [url]) == {url: 4}
            assert cache.index.match(other, [url]) == {url: 0}
            assert cache.index.stats()["expected"] == 0

    asyncio.run(main())
