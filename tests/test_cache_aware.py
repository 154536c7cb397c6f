"""Cache-aware routing for workers without KV events: the feed notices the missing endpoint,
and the prefixes routed there count as cached for a while (the approximate mode)."""

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
                cache.routed("generation", url, hashes)
                assert cache.index.match(hashes, [url]) == {url: 6}
                await asyncio.sleep(0.3)
                assert cache.index.match(hashes, [url]) == {url: 0}  # the TTL passed
                await cache.stop()
        finally:
            await runner.cleanup()

    asyncio.run(main())
