"""The orchestrator's view of the workers registered in etcd (`cluster: {backend: etcd}`).

One task follows the cluster's prefix (`disagg.registry`) into `Cluster.add` / `remove`:
- sync: read the whole prefix, make the etcd-sourced members equal to it (add the new,
  remove the gone, update draining), then watch from the revision after that read;
- watch: a PUT adds or updates a worker, a DELETE (deregistered, or its lease expired)
  removes it. A new worker is health-checked at once by the monitor, so it takes legs
  within a round trip of registering;
- etcd unreachable (at start or later): the last view stays and the orchestrator keeps
  serving on it; health checks still take dead workers out of rotation. A warning is
  logged once, `disagg_discovery_up{backend="etcd"}` reads 0, and the task tries again
  every second, on the next endpoint; when etcd answers it syncs afresh (a resync), which
  catches every change it missed;
- etcd reachable but unable to serve (a member cut off from its quorum keeps a watch open
  and silent): a read that needs the quorum every `PROBE_S` seconds fails, which counts as
  unreachable;
- anything else that goes wrong (a bug, a record that breaks the decoder) is logged with
  its traceback and handled like an outage: resync, never a silently dead task.

Workers from the config's static lists or added by an admin are never touched here. Every
orchestrator replica runs its own copy and reaches the same membership; none of them
writes to etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import aetcd

from disagg import registry
from disagg.cluster import Cluster, WorkerState
from disagg.config import ConfigError, normalize_url
from disagg.registry import Endpoints, WorkerRecord

if TYPE_CHECKING:
    from disagg.telemetry import Metrics

log = logging.getLogger(__name__)

RETRY_S = 1.0
PROBE_S = 5.0  # between the reads that prove the watched member still has its quorum


class EtcdDiscovery:
    def __init__(
        self,
        cluster: Cluster,
        endpoints: Endpoints,
        name: str,
        metrics: Metrics | None = None,
    ) -> None:
        self.cluster, self.endpoints, self.name = cluster, endpoints, name
        self.prefix = registry.prefix(name)
        self.metrics = metrics
        self.up = False
        self.synced = asyncio.Event()  # the first full read is in
        self.resyncs = 0
        self._task: asyncio.Task[None] | None = None
        self._client: aetcd.Client | None = None
        self._down_since_sync = False
        self._set_up(False)

    async def start(self, wait_s: float = 5.0) -> None:
        """Follow etcd from now on; wait (bounded) for the first full read, so that the
        orchestrator's start-up check sees the registered workers."""
        self._task = asyncio.create_task(self._run(), name="etcd-discovery")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.synced.wait(), wait_s)
        if not self.synced.is_set():
            log.warning(
                "etcd (%s) did not answer within %g s; serving the static workers only until"
                " it does",
                ", ".join(self.endpoints.endpoints),
                wait_s,
            )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task  # `_run` lets nothing else out
        await self._drop_client()

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "etcd",
            "endpoints": list(self.endpoints.endpoints),
            "prefix": self.prefix,
            "up": self.up,
            "resyncs": self.resyncs,
        }

    # -- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await self._follow()
            except Exception as exc:
                if not isinstance(exc, aetcd.ClientError | ConnectionError):
                    log.exception("etcd discovery failed; resyncing in %g s", RETRY_S)
                elif self.up or not self._down_since_sync:
                    log.warning(
                        "etcd unreachable (%s); serving on the last view of %d worker(s),"
                        " retrying every %g s",
                        registry.reason(exc),
                        len(self.cluster.workers()),
                        RETRY_S,
                    )
                self._down_since_sync = True
                self._set_up(False)
                await self._drop_client()
                await asyncio.sleep(RETRY_S)

    async def _follow(self) -> None:
        if self._client is None:
            self._client = await self.endpoints.connect()
        client = self._client
        found = await client.get_prefix(self.prefix.encode())
        records = dict(self._records(found))
        self._sync(records)
        if self.synced.is_set():
            self.resyncs += 1
            if self.metrics is not None:
                self.metrics.discovery_resyncs.labels("etcd").inc()
            log.info("etcd is back: membership resynced (%d registered)", len(records))
        self.synced.set()
        self._down_since_sync = False
        watch = await client.watch_prefix(
            self.prefix.encode(), start_revision=found.header.revision + 1
        )
        self._set_up(True)
        probe = asyncio.create_task(self._probe(client), name="etcd-discovery-probe")
        follow = asyncio.create_task(self._watch(watch), name="etcd-discovery-watch")
        try:
            done, _ = await asyncio.wait((probe, follow), return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # its error is the reason
        finally:
            for task in (probe, follow):
                task.cancel()
            await asyncio.wait((probe, follow))
            with contextlib.suppress(Exception):
                await watch.cancel()
        raise ConnectionError("the etcd watch ended")

    async def _watch(self, watch: Any) -> None:
        async for event in watch:
            self._apply(event)

    async def _probe(self, client: aetcd.Client) -> None:
        """Every PROBE_S, a read that only a member with a quorum answers (etcd reads are
        linearizable unless asked otherwise): a watch on a member cut off from its quorum
        stays open and says nothing."""
        key = (self.prefix + "\x00probe").encode()
        while True:
            await asyncio.sleep(PROBE_S)
            await client.get(key)

    # -- applying what etcd says ------------------------------------------------------------

    def _records(self, found: Any) -> list[tuple[str, WorkerRecord]]:
        out = []
        for kv in found:
            record = self._decode(kv.key, kv.value)
            if record is not None:
                out.append((kv.key.decode(errors="replace"), record))
        return out

    def _decode(self, key: bytes, value: bytes) -> WorkerRecord | None:
        try:
            return registry.decode(value)
        except Exception as exc:  # not a record; or one that breaks the decoder (too deep)
            text = exc if isinstance(exc, ValueError) else f"undecodable ({type(exc).__name__})"
            log.warning("etcd key %s ignored: %s", key.decode(errors="replace"), text)
            return None

    def _sync(self, records: dict[str, WorkerRecord]) -> None:
        """Make the etcd-sourced members exactly those of `records`."""
        wanted = {(role, r.url): r for r in records.values() for role in r.roles()}
        for w in self.cluster.workers():
            if w.source == "etcd" and (w.role, w.url) not in wanted:
                self._remove(w)
        for (role, url), record in wanted.items():
            self._upsert(role, url, record)

    def _apply(self, event: Any) -> None:
        key = event.kv.key
        if event.kind == "DELETE":
            url = unquote(key.decode(errors="replace")[len(self.prefix) :])
            with contextlib.suppress(ConfigError):
                url = normalize_url(url, "url")
            for w in self.cluster.workers():
                if w.source == "etcd" and w.url == url:
                    self._remove(w)
            return
        record = self._decode(key, event.kv.value)
        if record is None:
            return
        roles = record.roles()
        for w in self.cluster.workers():  # a worker restarted in another role
            if w.source == "etcd" and w.url == record.url and w.role not in roles:
                self._remove(w)
        for role in roles:
            self._upsert(role, record.url, record)

    def _upsert(self, role: str, url: str, record: WorkerRecord) -> None:
        w = self.cluster.find(role, url)
        if w is None:
            w = self.cluster.add(role, url, source="etcd", models=record.models)
            self._count("added")
        elif w.source != "etcd":
            return  # listed statically or added by an admin: theirs to manage
        if record.draining and not w.draining:
            log.info("worker %s (%s) is draining (its etcd record says so)", url, role)
        w.draining = record.draining
        if record.models:
            w.models = tuple(record.models)

    def _remove(self, w: WorkerState) -> None:
        self.cluster.remove(w.role, w.url)
        self._count("removed")

    # -- small ------------------------------------------------------------------------------

    def _count(self, change: str) -> None:
        if self.metrics is not None:
            self.metrics.discovery_changes.labels(change).inc()

    def _set_up(self, up: bool) -> None:
        self.up = up
        if self.metrics is not None:
            self.metrics.discovery_up.labels("etcd").set(float(up))

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()
