"""The admin endpoints on a real orchestrator: list the workers, add one at run time and see
it take legs, drain one (no new legs) and resume it, remove one; errors in OpenAI's shape
for unknown workers, duplicates and bad bodies; the admin key for everything, and no
changes at all on an orchestrator that has no admin key."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from disagg.admin import AdminRoutes
from disagg.client_auth import ClientAuth
from disagg.cluster import Cluster as Membership
from disagg.cluster import StaticDiscovery
from disagg.http import error_middleware
from tests.conftest import (
    Cluster,
    Procs,
    ThreadServer,
    route_of,
    start_cluster,
    start_workers,
)

ADMIN, CLIENT = "sk-admin-for-admin-tests", "sk-not-the-admin"
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def module_procs() -> Iterator[Procs]:
    """This module's own processes, stopped when its tests are done."""
    with Procs() as procs:
        yield procs


@pytest.fixture(scope="module")
def keyed(module_procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    """1 context + 2 generation workers behind an orchestrator with an admin key."""
    tmp = tmp_path_factory.mktemp("admin")
    key = tmp / "admin.txt"
    key.write_text(ADMIN + "\n")
    return start_cluster(module_procs, tmp, 1, 2, admin_key_file=str(key))


@pytest.fixture(scope="module")
def spare(module_procs: Procs) -> str:
    """A generation worker no orchestrator knows yet."""
    return start_workers(module_procs, "generation")[0]


def _post(c: Cluster, action: str, body: Any, headers: dict[str, str] = AUTH) -> httpx.Response:
    return httpx.post(f"{c.url}/admin/workers/{action}", json=body, headers=headers)


def _workers(c: Cluster) -> dict[str, Any]:
    r = httpx.get(c.url + "/admin/workers", headers=AUTH)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def _generation_urls(c: Cluster) -> list[str]:
    return [w["url"] for w in _workers(c)["generation_servers"]]


def _generation_legs(c: Cluster, n: int) -> list[str]:
    """Where the generation legs of `n` requests went."""
    out = []
    for _ in range(n):
        r = httpx.post(c.url + "/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 200, r.text
        out.append(route_of(r)["generation"])
    return out


def _wait_ready(c: Cluster, url: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(w["url"] == url and w["ready"] for w in _workers(c)["generation_servers"]):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready in the orchestrator after {timeout_s} s")


def _assert_idle(c: Cluster, timeout_s: float = 5.0) -> None:
    """The orchestrator holds no leg on any worker (the leak check, with the admin key)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = _workers(c)
        in_flight = [w["in_flight"] for w in info["context_servers"] + info["generation_servers"]]
        if not any(in_flight):
            return
        assert time.monotonic() < deadline, f"in flight after the requests: {in_flight}"
        time.sleep(0.05)


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert {"message", "type", "param", "code"} <= err.keys()
    return err


def test_list_shows_each_pool(keyed: Cluster) -> None:
    info = _workers(keyed)
    assert [w["url"] for w in info["context_servers"]] == keyed.context_urls
    assert _generation_urls(keyed) == keyed.generation_urls
    for w in info["context_servers"] + info["generation_servers"]:
        assert (w["ready"], w["cordoned"], w["source"]) == (True, False, "static")


def test_drain_stops_new_legs_and_resume_brings_them_back(keyed: Cluster) -> None:
    drained, other = keyed.generation_urls
    r = _post(keyed, "drain", {"url": drained.removeprefix("http://")})  # host:port is fine
    assert r.status_code == 200, r.text
    [w] = r.json()["workers"]
    assert (w["url"], w["role"], w["cordoned"]) == (drained, "generation", True)
    try:
        assert set(_generation_legs(keyed, 6)) == {other}
        info = {w["url"]: w for w in _workers(keyed)["generation_servers"]}
        assert info[drained]["cordoned"] and info[drained]["ready"]
    finally:
        r = _post(keyed, "resume", {"url": drained, "role": "generation"})
    assert r.status_code == 200 and not r.json()["workers"][0]["cordoned"]
    assert set(_generation_legs(keyed, 6)) == {drained, other}
    _assert_idle(keyed)


def test_add_a_worker_then_remove_it(keyed: Cluster, spare: str) -> None:
    r = _post(keyed, "add", {"role": "generation", "url": spare + "/"})
    assert r.status_code == 201, r.text
    assert (r.json()["url"], r.json()["source"]) == (spare, "admin")
    try:
        _wait_ready(keyed, spare)
        assert spare in _generation_legs(keyed, 9)  # round robin over three
        err = _error(_post(keyed, "add", {"role": "generation", "url": spare}), 409)
        assert err["type"] == "conflict_error"
    finally:
        r = _post(keyed, "remove", {"url": spare})
    assert r.status_code == 200, r.text
    assert [w["url"] for w in r.json()["workers"]] == [spare]
    assert spare not in _generation_urls(keyed)
    assert spare not in _generation_legs(keyed, 6)
    _assert_idle(keyed)
    _error(_post(keyed, "remove", {"url": spare}), 404)


@pytest.mark.parametrize("action", ["drain", "resume", "remove"])
def test_unknown_worker_is_404(keyed: Cluster, action: str) -> None:
    err = _error(_post(keyed, action, {"url": "http://127.0.0.1:1"}), 404)
    assert (err["type"], err["param"]) == ("not_found_error", "url")
    # The URL is known, but not in that pool.
    ctx = keyed.context_urls[0]
    _error(_post(keyed, action, {"url": ctx, "role": "generation"}), 404)


@pytest.mark.parametrize(
    ("action", "body", "param"),
    [
        ("add", {"role": "mixed", "url": "http://127.0.0.1:9"}, "role"),
        ("add", {"url": "http://127.0.0.1:9"}, "role"),
        ("add", {"role": "generation"}, "url"),
        ("add", {"role": "generation", "url": "no-port-here"}, "url"),
        ("add", {"role": "generation", "url": "ftp://127.0.0.1:9"}, "url"),
        ("add", {"role": "generation", "url": "http://127.0.0.1:9/v1"}, "url"),
        ("add", {"role": "generation", "url": "http://127.0.0.1:0"}, "url"),
        ("add", {"role": "generation", "url": 8001}, "url"),
        ("add", {"role": "generation", "url": "http://127.0.0.1:9", "models": []}, None),
        ("add", [], None),
        ("add", "http://127.0.0.1:9", None),
        ("drain", {"url": "http://127.0.0.1:9", "role": "both"}, "role"),
        ("drain", {}, "url"),
        ("resume", {"url": ""}, "url"),
        ("remove", {"url": None}, "url"),
        ("remove", {"url": "http://127.0.0.1:9", "force": True}, None),
    ],
)
def test_bad_bodies_are_400(keyed: Cluster, action: str, body: Any, param: str | None) -> None:
    err = _error(_post(keyed, action, body), 400)
    assert (err["type"], err["param"]) == ("invalid_request_error", param)
    assert _generation_urls(keyed) == keyed.generation_urls  # nothing changed


def test_a_body_that_is_not_json_is_400(keyed: Cluster) -> None:
    r = httpx.post(keyed.url + "/admin/workers/add", content=b"{role", headers=AUTH)
    _error(r, 400)


def _every_change(url: str) -> list[tuple[str, dict[str, str]]]:
    """One request of each admin change, on worker `url` (add: a new one)."""
    return [
        ("add", {"role": "generation", "url": "http://127.0.0.1:9"}),
        ("drain", {"url": url}),
        ("resume", {"url": url}),
        ("remove", {"url": url}),
    ]


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Bearer {CLIENT}"}]
)
def test_without_the_admin_key_is_401(keyed: Cluster, headers: dict[str, str]) -> None:
    assert _error(httpx.get(keyed.url + "/admin/workers", headers=headers), 401)
    url = keyed.generation_urls[0]
    for action, body in _every_change(url):
        err = _error(_post(keyed, action, body, headers), 401)
        assert err["type"] == "authentication_error" and ADMIN not in str(err)
    info = _workers(keyed)["generation_servers"]
    assert [(w["url"], w["cordoned"]) for w in info] == [(u, False) for u in keyed.generation_urls]


def test_no_admin_key_configured_refuses_every_change(
    keyed: Cluster, module_procs: Procs, tmp_path: Path
) -> None:
    with pytest.MonkeyPatch.context() as env:
        env.delenv("DISAGG_ADMIN_KEY", raising=False)
        open_ = start_cluster(
            module_procs,
            tmp_path,
            0,
            0,
            extra_ctx=keyed.context_urls,
            extra_gen=keyed.generation_urls,
        )
    r = httpx.get(open_.url + "/admin/workers")  # the view is open, as /cluster_info is
    assert r.status_code == 200 and len(r.json()["generation_servers"]) == 2
    url = keyed.generation_urls[0]
    for action, body in _every_change(url):
        for headers in ({}, AUTH):
            err = _error(_post(open_, action, body, headers), 403)
            assert err["type"] == "permission_error" and "admin key" in err["message"]
    info = httpx.get(open_.url + "/admin/workers").json()["generation_servers"]
    assert [(w["url"], w["cordoned"]) for w in info] == [(u, False) for u in keyed.generation_urls]


class AdminOnly(ThreadServer):
    """The admin routes alone over a membership that the test sets up (no health checks):
    for workers no static cluster has, such as one registered in etcd."""

    def __init__(self, membership: Membership) -> None:
        super().__init__()
        self.membership = membership

    def app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware])
        app.add_routes(AdminRoutes(self.membership, ClientAuth(admin_key=ADMIN)).routes())
        return app


def test_an_etcd_worker_is_drained_not_removed_and_role_defaults_to_both() -> None:
    both, etcd = "http://127.0.0.1:7001", "http://127.0.0.1:7002"
    membership = Membership(StaticDiscovery([both], [both]))
    membership.add("generation", etcd, source="etcd")
    with AdminOnly(membership) as url:
        r = httpx.post(url + "/admin/workers/drain", json={"url": both}, headers=AUTH)
        assert r.status_code == 200, r.text
        drained = [(w["role"], w["cordoned"]) for w in r.json()["workers"]]
        assert drained == [("context", True), ("generation", True)]
        r = httpx.post(url + "/admin/workers/remove", json={"url": etcd}, headers=AUTH)
        err = _error(r, 409)
        assert err["type"] == "conflict_error" and "drain it instead" in err["message"]
        r = httpx.post(url + "/admin/workers/drain", json={"url": etcd}, headers=AUTH)
        assert r.status_code == 200 and r.json()["workers"][0]["cordoned"]
        r = httpx.post(url + "/admin/workers/remove", json={"url": both}, headers=AUTH)
        assert [w["role"] for w in r.json()["workers"]] == ["context", "generation"]
    assert [w.url for w in membership.workers()] == [etcd]
