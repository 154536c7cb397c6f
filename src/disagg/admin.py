"""The operator's admin endpoints on the orchestrator: list the workers, add one, drain
(cordon) one, resume it, remove it, all at run time and on this replica only.

Every endpoint needs the admin key when one is configured; the mutations are refused (403)
when none is, so an open cluster cannot be reconfigured by anyone (the list stays readable,
like `/cluster_info`). A drain outlasts the worker leaving and rejoining (an etcd lease
that expired while etcd was out of reach) until it is resumed or removed. A worker registered in
etcd is never removed here (it leaves with its lease): it can only be drained. Membership
itself lives in `disagg.cluster`; this module checks, parses and calls it, nothing more.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, TypeVar

import msgspec
from aiohttp import web

from disagg.client_auth import ClientAuth
from disagg.cluster import Cluster, WorkerState
from disagg.config import ConfigError, normalize_url
from disagg.errors import Conflict, Forbidden, InvalidRequest, NotFound
from disagg.http import json_response
from disagg.protocol import decode_body, validate

log = logging.getLogger(__name__)

Role = Literal["context", "generation"]
ROLES: tuple[Role, ...] = ("context", "generation")
T = TypeVar("T")


class AddWorker(msgspec.Struct, forbid_unknown_fields=True):
    role: Role
    url: str


class WorkerRef(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    role: Role | None = None  # None: whichever pools have the URL


class AdminRoutes:
    def __init__(self, cluster: Cluster, auth: ClientAuth) -> None:
        self.cluster, self.auth = cluster, auth

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/admin/workers", self.list_workers),
            web.post("/admin/workers/add", self.add),
            web.post("/admin/workers/drain", self.drain),
            web.post("/admin/workers/resume", self.resume),
            web.post("/admin/workers/remove", self.remove),
        ]

    async def list_workers(self, request: web.Request) -> web.Response:
        self.auth.check_admin(request.headers)
        return json_response(
            {
                "context_servers": [w.describe() for w in self.cluster.context.workers],
                "generation_servers": [w.describe() for w in self.cluster.generation.workers],
            }
        )

    async def add(self, request: web.Request) -> web.Response:
        body = await self._body(request, AddWorker)
        url = _url(body.url)
        try:
            w = self.cluster.add(body.role, url, source="admin")
        except ValueError:
            raise Conflict(f"the {body.role} pool has this worker already", param="url") from None
        _log_change(request, "added", w)
        return json_response(w.describe(), status=201)

    async def drain(self, request: web.Request) -> web.Response:
        return await self._cordon(request, True)

    async def resume(self, request: web.Request) -> web.Response:
        return await self._cordon(request, False)

    async def _cordon(self, request: web.Request, cordoned: bool) -> web.Response:
        workers = self._find(await self._body(request, WorkerRef))
        for w in workers:
            if w.cordoned != cordoned:
                self.cluster.cordon(w, cordoned)
                _log_change(request, "drained" if cordoned else "resumed", w)
        return json_response({"workers": [w.describe() for w in workers]})

    async def remove(self, request: web.Request) -> web.Response:
        workers = self._find(await self._body(request, WorkerRef))
        if any(w.source == "etcd" for w in workers):  # all or none: check before removing
            raise Conflict(
                "this worker is registered in etcd and leaves when its lease ends or it "
                "deregisters; drain it instead (POST /admin/workers/drain)",
                param="url",
            )
        for w in workers:
            self.cluster.remove(w.role, w.url)
            self.cluster.cordon(w, False)  # the admin's word ends with the worker
            _log_change(request, "removed", w)
        return json_response({"workers": [w.describe() for w in workers]})

    async def _body(self, request: web.Request, kind: type[T]) -> T:
        """A mutation's body, once the caller has proved to hold the admin key."""
        if not self.auth.admin_needs_key:
            raise Forbidden(
                "Changing the cluster needs an admin key, and this orchestrator has none: "
                "set admin_key_file or DISAGG_ADMIN_KEY to use the admin endpoints.",
                code="admin_key_not_configured",
            )
        self.auth.check_admin(request.headers)
        return validate(decode_body(await request.read()), kind)

    def _find(self, ref: WorkerRef) -> list[WorkerState]:
        url = _url(ref.url)
        roles = ROLES if ref.role is None else (ref.role,)
        found = [w for role in roles if (w := self.cluster.find(role, url)) is not None]
        if not found:
            pools = "either pool" if ref.role is None else f"the {ref.role} pool"
            raise NotFound(f"no worker in {pools} has this URL", param="url")
        return found


def _url(value: Any) -> str:
    try:
        return normalize_url(value, "url")
    except ConfigError as exc:
        raise InvalidRequest(f"url: {exc.message}", param="url") from None


def _log_change(request: web.Request, change: str, w: WorkerState) -> None:
    log.info("request %s: admin %s %s worker %s", request.get("request_id"), change, w.role, w.url)
