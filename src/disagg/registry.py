"""The worker registry in etcd, as both sides read it: the key layout, the record a worker
stores, and connecting to the first etcd endpoint that answers.

Layout: one key per worker, `/disagg/<cluster>/workers/<url, percent-quoted>`, holding a
`WorkerRecord` as JSON and attached to a lease the worker keeps alive
(`disagg.registration`). The key is the worker's URL, so a worker restarted at the same
address overwrites its record (the old lease then holds nothing) and a worker that dies
leaves when its lease expires. The orchestrator watches the prefix
(`disagg.etcd_discovery`). Only the URL and role route; the rest is for operators and for
the checks an orchestrator runs (block size, models).

The etcd client is `aetcd` (asyncio, gRPC, maintained), in the `disagg[etcd]` extra; nothing
here speaks etcd's protocol by hand.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from urllib.parse import quote

import aetcd
import msgspec

from disagg.config import ConfigError, normalize_url, parse_etcd_endpoint

log = logging.getLogger(__name__)

ROOT = "/disagg"


class WorkerRecord(msgspec.Struct, kw_only=True):
    role: str  # context | generation | mixed
    url: str  # where orchestrators and other workers reach it
    models: list[str]
    block_size: int
    capabilities: list[str] = []  # e.g. kv_cache_events, kv_push, perf_metrics
    draining: bool = False  # shutting down: no new legs
    instance: str = ""  # changes when the worker restarts
    version: str = ""

    def roles(self) -> tuple[str, ...]:
        """The pools it belongs in (a mixed worker serves both legs)."""
        return ("context", "generation") if self.role == "mixed" else (self.role,)


def prefix(cluster: str) -> str:
    return f"{ROOT}/{cluster}/workers/"


def key(cluster: str, url: str) -> str:
    return prefix(cluster) + quote(url, safe="")


def encode(record: WorkerRecord) -> bytes:
    return msgspec.json.encode(record)


def decode(value: bytes) -> WorkerRecord:
    """The record, or ValueError for one that is not a worker record."""
    try:
        record = msgspec.json.decode(value, type=WorkerRecord)
    except msgspec.ValidationError as exc:
        raise ValueError(f"not a worker record: {exc}") from None
    except msgspec.DecodeError:
        raise ValueError("not a worker record: not JSON") from None
    if record.role not in ("context", "generation", "mixed"):
        raise ValueError(f"not a worker record: role {record.role!r}")
    if not record.url.startswith(("http://", "https://")):
        raise ValueError(f"not a worker record: url {record.url!r}")
    try:  # the spelling the cluster compares (a trailing slash or upper-case host is the same)
        record.url = normalize_url(record.url, "url")
    except ConfigError as exc:
        raise ValueError(f"not a worker record: {exc.message}") from None
    return record


def parse_endpoints(value: str) -> tuple[str, ...]:
    """`host:port` each from a comma-separated `etcd://host:port,...` (the --register flag);
    ValueError naming the bad one."""
    items = [item.strip() for item in value.split(",") if item.strip()]
    if not items:
        raise ValueError("expected etcd://host:port[,etcd://host:port...]")
    try:
        return tuple(parse_etcd_endpoint(item, "--register") for item in items)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


# gRPC pings on idle streams, so a watch on an etcd that vanished (host down, network cut,
# process frozen) fails within ~15 s instead of hanging; etcd refuses pings more often than
# every 5 s. grpcio waits `ping_timeout_ms` for the answer (60 s unless set), not
# `keepalive_timeout_ms`.
_KEEPALIVE = {
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.http2.ping_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 1,
}


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


class Endpoints:
    """The etcd endpoints of one cluster, tried in turn: `connect` returns a client to the
    first that answers, starting after the one that failed last."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints, self.timeout_s = tuple(endpoints), timeout_s
        self._next = 0

    async def connect(self) -> aetcd.Client:
        """A connected client, or ConnectionError naming every endpoint tried."""
        errors = []
        for _ in self.endpoints:
            endpoint = self.endpoints[self._next]
            self._next = (self._next + 1) % len(self.endpoints)
            host, port = _host_port(endpoint)
            client = aetcd.Client(host, port, timeout=self.timeout_s, options=_KEEPALIVE)
            try:
                await client.status()
            except aetcd.ClientError as exc:
                await client.close()
                errors.append(f"{endpoint}: {reason(exc)}")
                continue
            except BaseException:  # cancelled (stopping) or a bug: the channel closes anyway
                await client.close()
                raise
            self._next = (self._next - 1) % len(self.endpoints)  # stay on the one that works
            return client
        raise ConnectionError("etcd unreachable (" + "; ".join(errors) + ")")


def reason(exc: BaseException) -> str:
    """One short line for a log: what went wrong talking to etcd."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:200]
