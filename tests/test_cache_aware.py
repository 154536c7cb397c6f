"""Cache-aware routing's expectations: a routed prompt's blocks count as cached on its worker
until the worker's stored events confirm them or a TTL passes; for workers without KV events
(the feed notices the missing endpoint) that TTL is all there is (the approximate mode)."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from disagg.cache_aware import CacheAwareRouting
from disagg.cluster import Cluster, StaticDiscovery
from disagg.config import static_config
from disagg.demo import free_port


def test_workers_without_events_learn_from_routing() -> None:
    async def main() -> None:
        port = free_port()

        async def server_info(_r: web.Request) -> web.Response:
            return web.json_response({"block_size": 16})

        app = web.Application()  # a worker with /server_info but no /kv_cache_events
        app.add_routes([web.get("/server_info", server_info)])
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        config = static_config(
            ["127.0.0.1:1"], [url], generation_servers={"router": {"type": "kv_cache_aware"}}
        )
        cache = CacheAwareRouting(config, Cluster(StaticDiscovery([], [url])))
        cache.routed_ttl_s = 0.2
        try:
            async with aiohttp.ClientSession() as session:
                await cache.start(session)
                hashes = cache.hashes("generation", list(range(100)))
                assert len(hashes) == 6
                assert cache.index.match(hashes, [url]) == {url: 0}
                cache.expect(url, hashes)
                assert cache.index.match(hashes, [url]) == {url: 6}
                await asyncio.sleep(0.3)
                assert cache.index.match(hashes, [url]) == {url: 0}  # the TTL passed
                await cache.stop()
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_routed_blocks_count_until_confirmed_or_expired() -> None:
    async def main() -> None:
        port = free_port()

        async def server_info(_r: web.Request) -> web.Response:
            return web.json_response({"block_size": 16})

        async def events(_r: web.Request) -> web.Response:  # a worker whose cache is empty
            body = {"reset": False, "events": [], "last_event_id": 0, "block_size": 16}
            return web.json_response(body)

        app = web.Application()
        app.add_routes([web.get("/server_info", server_info), web.post("/kv_cache_events", events)])
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        config = static_config(
            ["127.0.0.1:1"], [url], generation_servers={"router": {"type": "kv_cache_aware"}}
        )
        cache = CacheAwareRouting(config, Cluster(StaticDiscovery([], [url])))
        cache.expect_ttl_s = 0.2
        try:
            async with aiohttp.ClientSession() as session:
                await cache.start(session)
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
                await cache.stop()
        finally:
            await runner.cleanup()

    asyncio.run(main())
