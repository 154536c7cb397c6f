"""Cache-aware routing's moving parts for the pools whose router is `kv_cache_aware`: the
prefix index, the prompt hasher, the KV event feeds that keep the index current, the
start-up check that the router hashes blocks of the workers' size, and the conditional
disaggregation test (prefill locally when a generation worker holds nearly all the prompt).

It hashes prompts and predicts cache hits when asked; placement itself stays in the policy.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

import aiohttp

from disagg.cluster import Cluster, WorkerState
from disagg.config import ClusterConfig, PoolConfig
from disagg.internal_auth import signer_for
from disagg.kv_events import KVEventFeed
from disagg.routing import Policy, make_policy
from disagg.routing.prefix_index import PrefixIndex
from disagg.routing.prompt_tokens import PromptHasher

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16  # the reference worker's; used only when no worker answers
_RECENT = 256  # prompts whose hashes are remembered
# How long a routed prompt's blocks count as cached on its worker before the worker's own
# stored event confirms them: long enough for the leg's prefill and the next event poll. A
# worker without KV events never confirms: there the routed prefixes are all the index has.
EXPECT_TTL_S = 10.0
ROUTED_TTL_S = 120.0


class StartupError(Exception):
    """The orchestrator must not serve with this cluster (the message says why)."""


class CacheAwareRouting:
    def __init__(self, config: ClusterConfig, cluster: Cluster) -> None:
        self.config, self.cluster = config, cluster
        self.pools = {
            p.role: p
            for p in (config.context, config.generation)
            if p.router.type == "kv_cache_aware"
        }
        self.index = PrefixIndex()
        self.hashers = {
            role: PromptHasher.named(
                str(p.router.args.get("tokenizer", "tiny")),
                _tokens_per_block(p) or DEFAULT_BLOCK_SIZE,
            )
            for role, p in self.pools.items()
        }
        self._feeds: list[KVEventFeed] = []
        self.signer = signer_for(config)  # the event polls are signed like the legs
        self.expect_ttl_s, self.routed_ttl_s = EXPECT_TTL_S, ROUTED_TTL_S
        self._expiry: dict[tuple[str, tuple[int, ...]], asyncio.TimerHandle] = {}
        self._recent: OrderedDict[tuple[int, tuple[int, ...]], tuple[int, ...]] = OrderedDict()
        cluster.subscribe(self._on_change)

    def _on_change(self, change: str, w: WorkerState) -> None:
        """A worker that left takes its cached prefixes with it (unless it is still in the
        other pool, as a mixed worker is)."""
        if change == "removed" and not any(x.url == w.url for x in self.cluster.workers()):
            self.index.forget(w.url)
            for feed in self._feeds:
                feed.forget(w.url)

    def policy(self, pool: PoolConfig) -> Policy:
        return make_policy(
            pool.router.type, self.cluster.pool(pool.role), pool.router.args, self.index
        )

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Learn (or check) each pool's block size, then follow the workers' KV events."""
        for role, pool in self.pools.items():
            size = await self._block_size(session, pool)
            self.hashers[role].block_size = size
            feed = KVEventFeed(
                self.index,
                self.cluster.pool(role).workers,
                session,
                size,
                self.config.kv_events_interval,
                self.signer,
            )
            await feed.poll_all()
            feed.start()
            self._feeds.append(feed)

    async def stop(self) -> None:
        for feed in self._feeds:
            await feed.stop()
        for timer in self._expiry.values():
            timer.cancel()
        self._expiry.clear()

    async def _block_size(self, session: aiohttp.ClientSession, pool: PoolConfig) -> int:
        sizes: dict[str, int] = {}
        for url in [w.url for w in self.cluster.pool(pool.role).workers]:
            try:
                async with session.get(
                    url + "/server_info", timeout=aiohttp.ClientTimeout(total=5)
                ) as resp:
                    data = await resp.json(content_type=None)
                sizes[url] = int(data["block_size"])
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
                continue  # not up yet: the event feed checks it when it is
        configured = _tokens_per_block(pool)
        expected = configured or next(iter(sizes.values()), DEFAULT_BLOCK_SIZE)
        wrong = {url: size for url, size in sizes.items() if size != expected}
        if wrong:
            where = (
                f"the router's tokens_per_block {expected}"
                if configured
                else f"the pool's first worker's block size {expected}"
            )
            raise StartupError(
                f"{pool.role} pool: "
                + ", ".join(f"worker {url} has KV block size {s}" for url, s in wrong.items())
                + f", but kv_cache_aware routing hashes prompts in blocks of {where}."
                " Set tokens_per_block to the workers' block size (or start the workers"
                " with the same --block-size)."
            )
        return expected

    def prompt_ids(self, request: Any) -> list[int] | None:
        """The prompt's token ids, when some pool routes by cache (else None: no work)."""
        if not self.hashers:
            return None
        return next(iter(self.hashers.values())).ids(request)

    def hashes(self, role: str, ids: list[int] | None) -> tuple[int, ...]:
        """The prompt's block hashes for `role`'s pool. Remembered for the last prompts: a
        request's two legs (and its retries) hash the same ids, which costs ~1 ms at 8k."""
        hasher = self.hashers.get(role)
        if hasher is None or not ids:
            return ()
        key = (hasher.block_size, tuple(ids))
        found = self._recent.get(key)
        if found is None:
            found = self._recent[key] = hasher.hashes(ids)
            if len(self._recent) > _RECENT:
                self._recent.popitem(last=False)
        return found

    def predicted_tokens(self, role: str, url: str, hashes: tuple[int, ...]) -> int:
        """The cached prompt tokens the index expects `url` to find."""
        hasher = self.hashers.get(role)
        if hasher is None or not hashes:
            return 0
        return self.index.match(hashes, (url,))[url] * hasher.block_size

    def expect(self, url: str, hashes: tuple[int, ...]) -> None:
        """A leg with these prompt hashes was just placed on `url`, which will hold their
        blocks once it has prefilled: the index counts them there now, so the next request
        with the prefix is placed (and its hit predicted) as if the events had arrived. A
        worker's stored events confirm them; unconfirmed, they go after `expect_ttl_s`, or
        `routed_ttl_s` on a worker without events (the approximate mode)."""
        if not hashes:
            return
        self.index.expect(url, hashes)
        key = (url, hashes)
        if (old := self._expiry.pop(key, None)) is not None:
            old.cancel()  # routed again: the wait starts over
        eventless = any(url in f.without_events for f in self._feeds)
        self._expiry[key] = asyncio.get_running_loop().call_later(
            self.routed_ttl_s if eventless else self.expect_ttl_s, self._expire, key
        )

    def _expire(self, key: tuple[str, tuple[int, ...]]) -> None:
        del self._expiry[key]
        self.index.expire(*key)

    def local_prefill(self, ids: list[int] | None, model: str) -> tuple[int, ...] | None:
        """With `conditional_disagg_config`, the prompt's generation-pool hashes when the
        context leg should be skipped: some available generation worker holds a cached
        prefix and at most `max_local_prefill_length` prompt tokens are left to compute
        (TensorRT-LLM's rule: never when nothing is cached). Else None."""
        cond = self.config.conditional_disagg
        if cond is None or "generation" not in self.hashers or not ids:
            return None
        hashes = self.hashes("generation", ids)
        urls = [w.url for w in self.cluster.generation.available(model)]
        if not hashes or not urls:
            return None
        best = max(self.index.match(hashes, urls).values())
        cached = best * self.hashers["generation"].block_size
        if best == 0 or len(ids) - cached > cond.max_local_prefill_length:
            return None
        return hashes

    def stats(self) -> dict[str, Any]:
        return self.index.stats()


def _tokens_per_block(pool: PoolConfig) -> int | None:
    value = pool.router.args.get("tokens_per_block")
    return int(value) if isinstance(value, int) else None
