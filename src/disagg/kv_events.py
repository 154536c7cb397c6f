"""Follows every worker's KV cache events into the prefix index that cache-aware routing reads.

One poll loop for all workers: `POST /kv_cache_events {since, instance}` with each worker's
cursor. A `reset` answer (first contact, a restarted worker, a cursor older than what the
worker kept) is a snapshot: the worker's entries are forgotten and rebuilt. A worker whose
block size differs from the router's is kept out of the index. Workers that have no such
endpoint are listed in `without_events` (their entries come from where legs were routed,
see `CacheAwareRouting.expect`). Polls are signed when the cluster has an internal key.
It never routes.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from disagg.cluster import Periodic, WorkerState
from disagg.internal_auth import Signer
from disagg.routing.prefix_index import PrefixIndex

log = logging.getLogger(__name__)


@dataclass
class _Cursor:
    since: int = 0
    instance: str | None = None
    block_size_ok: bool = True
    auth_ok: bool = True  # said once when a worker refuses the polls' signature


class KVEventFeed:
    def __init__(
        self,
        index: PrefixIndex,
        workers: list[WorkerState],
        session: aiohttp.ClientSession,
        block_size: int,
        interval_s: float = 0.1,
        signer: Signer | None = None,
    ) -> None:
        self.index, self.workers, self.session = index, workers, session
        self.signer = signer
        self.block_size, self.interval_s = block_size, interval_s
        self.timeout = aiohttp.ClientTimeout(total=2.0)
        self._cursors: dict[str, _Cursor] = {}
        self.without_events: set[str] = set()
        self._periodic = Periodic("kv-event-feed", self.poll_all, interval_s)

    async def poll_all(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in self.workers))

    async def _poll(self, w: WorkerState) -> None:
        cur = self._cursors.setdefault(w.url, _Cursor())
        url = w.url + "/kv_cache_events"
        body = msgspec.json.encode({"since": cur.since, "instance": cur.instance})
        headers = {"Content-Type": "application/json"}
        if self.signer is not None:
            headers.update(self.signer.for_url("POST", url, body))
        try:
            async with self.session.post(
                url, data=body, headers=headers, timeout=self.timeout
            ) as resp:
                if resp.status in (404, 405):
                    self.without_events.add(w.url)
                    return
                if resp.status == 401 and cur.auth_ok:
                    log.error(
                        "worker %s refuses the KV event polls' internal authentication (%s);"
                        " is internal_auth_key the same on the orchestrator and the workers?",
                        w.url,
                        (await resp.read())[:200].decode(errors="replace"),
                    )
                cur.auth_ok = resp.status != 401
                if resp.status != 200:
                    return  # failing now: the health monitor says so; the index waits
                self.without_events.discard(w.url)
                data: dict[str, Any] = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return  # the health monitor reports it; the index keeps its last view
        if self._cursors.get(w.url) is not cur:
            return  # the worker left while this poll was out: the index forgot it
        if data.get("block_size") != self.block_size:
            if cur.block_size_ok:
                log.error(
                    "worker %s has KV block size %s but the router hashes blocks of %d;"
                    " it gets no cache-aware placement",
                    w.url,
                    data.get("block_size"),
                    self.block_size,
                )
            cur.block_size_ok = False
            self.index.forget(w.url)
            return
        cur.block_size_ok = True
        if data.get("reset"):
            self.index.forget(w.url)
        self.index.apply(w.url, data.get("events") or [])
        cur.since = int(data.get("last_event_id") or 0)
        cur.instance = data.get("instance")

    def forget(self, url: str) -> None:
        """`url` left the cluster: its cursor goes (were it back, it starts afresh)."""
        self._cursors.pop(url, None)
        self.without_events.discard(url)

    def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
