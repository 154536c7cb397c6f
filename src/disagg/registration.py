"""A worker's registration in etcd (`disagg worker --register etcd://... --cluster NAME`).

One task owns it from start-up to shutdown:
- register: grant a lease of `ttl_s`, put the worker's record (`disagg.registry`) under it;
- keep alive: refresh the lease every `ttl_s / 3`; a lease etcd no longer knows (it expired
  while this worker could not reach etcd) is granted anew and the record put again;
- etcd unreachable: the worker keeps serving (orchestrators keep their last view of it),
  warns once, and tries again every second, on the next endpoint (any other failure is
  logged with its traceback and retried the same way: the task never dies silently);
- drain (SIGTERM): the record is put again with `draining: true`, so orchestrators stop
  placing legs here before their next health check;
- stop: the lease is revoked, which deletes the record at once (a worker killed -9 leaves
  when the lease expires instead).

Every etcd call is bounded by the client's timeout; nothing here blocks a leg.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aetcd

from disagg import registry
from disagg.registry import Endpoints, WorkerRecord

log = logging.getLogger(__name__)

RETRY_S = 1.0


class Registration:
    def __init__(
        self,
        endpoints: Endpoints,
        cluster: str,
        record: WorkerRecord,
        ttl_s: float = 10.0,
    ) -> None:
        if ttl_s < 2:
            raise ValueError("the registration lease needs a TTL of at least 2 s")
        self.endpoints, self.cluster, self.record = endpoints, cluster, record
        self.ttl_s = ttl_s
        self.key = registry.key(cluster, record.url)
        self.registered = asyncio.Event()  # set while the record is in etcd
        self._client: aetcd.Client | None = None
        self._lease: Any = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # the record changed: put it now
        self._down = False  # said once per outage

    def start(self) -> None:
        """Register and keep the lease alive from now on (call it once the worker listens:
        orchestrators health-check a worker the moment its record appears). A worker whose
        etcd is not up yet serves anyway and registers when it is."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="etcd-registration")

    def mark_draining(self) -> None:
        """The worker began draining: say so in its record."""
        if not self.record.draining:
            self.record.draining = True
            self._wake.set()

    async def stop(self) -> None:
        """Stop keeping the lease alive and revoke it (the record goes with it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        client, lease = self._client, self._lease
        self._client = self._lease = None
        if client is None:
            return
        try:
            if lease is not None:
                await lease.revoke()
                log.info("deregistered from etcd (%s)", self.key)
        except aetcd.ClientError as exc:
            log.warning("could not revoke the etcd lease (%s); it expires", registry.reason(exc))
        finally:
            await client.close()

    async def _run(self) -> None:
        while True:
            try:
                await self._keep_alive()
            except Exception as exc:
                self.registered.clear()
                if not isinstance(exc, aetcd.ClientError | ConnectionError):
                    log.exception("etcd registration failed; registering again in %g s", RETRY_S)
                    self._down = True
                elif not self._down:
                    log.warning(
                        "etcd registration lost (%s); serving on, retrying every %g s",
                        registry.reason(exc),
                        RETRY_S,
                    )
                    self._down = True
                await self._drop_client()
                await asyncio.sleep(RETRY_S)

    async def _keep_alive(self) -> None:
        if self._client is None:
            self._client = await self.endpoints.connect()
        await self._register()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.ttl_s / 3)
            if self._wake.is_set():
                self._wake.clear()
                await self._put()
                continue
            reply = await self._lease.refresh()
            if reply is None or reply.TTL <= 0:  # expired while etcd was out of reach
                log.warning("etcd lease %x expired; registering again", self._lease.id)
                await self._register()

    async def _register(self) -> None:
        assert self._client is not None
        self._lease = await self._client.lease(max(2, round(self.ttl_s)))
        await self._put()
        if self._down:
            log.info("etcd registration restored (%s)", self.key)
        else:
            log.info("registered in etcd as %s (lease TTL %g s)", self.key, self.ttl_s)
        self._down = False
        self.registered.set()

    async def _put(self) -> None:
        assert self._client is not None
        await self._client.put(self.key.encode(), registry.encode(self.record), lease=self._lease)

    async def _drop_client(self) -> None:
        client, self._client, self._lease = self._client, None, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()
