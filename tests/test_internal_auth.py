"""Internal authentication: signed requests verify and any altered field is refused; stale,
future and replayed requests are refused; the nonce memory stays bounded; TensorRT-LLM's
header has its known value; sealed opaque states refuse forged, altered, unsigned and
expired ones; the orchestrator's worker client and KV event feed sign what they send."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from disagg.cache_aware import CacheAwareRouting
from disagg.cluster import Cluster, StaticDiscovery
from disagg.config import ConfigError, static_config, with_environment, worker_auth_key
from disagg.demo import free_port
from disagg.engine.server import auth_middleware
from disagg.engine.transfer import OpaqueState, StateExpired, TransferError
from disagg.errors import Unauthorized, WorkerUnavailable
from disagg.http import error_middleware
from disagg.internal_auth import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    TRTLLM_HEADER,
    Signer,
    Verifier,
    canonical,
    path_of,
    signer_for,
    trtllm_auth_header,
)
from disagg.upstream import WorkerClient

KEY = b"cluster-secret"
NOW = 1_700_000_000.0
BODY = b'{"model":"tiny","disaggregated_params":{"disagg_request_id":7}}'


def _verifier(**kw: Any) -> Verifier:
    return Verifier(KEY, 60.0, clock=lambda: NOW, **kw)


def _signed(body: bytes = BODY, at: float = NOW, key: bytes = KEY) -> dict[str, str]:
    return Signer(key, clock=lambda: at).headers("POST", "/v1/completions", body)


def _refused(v: Verifier, headers: dict[str, str], **kw: Any) -> Unauthorized:
    args = {"method": "POST", "path": "/v1/completions", "body": BODY, **kw}
    with pytest.raises(Unauthorized) as info:
        v.check(args["method"], args["path"], headers, args["body"])
    assert info.value.status == 401 and info.value.type == "authentication_error"
    return info.value


def test_a_signed_request_verifies() -> None:
    headers = _signed()
    assert set(headers) == {TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER}
    assert headers[SIGNATURE_HEADER].startswith("v1=")
    _verifier().check("POST", "/v1/completions", headers, BODY)
    # The signature is the HMAC of the documented canonical string.
    ts, nonce = headers[TIMESTAMP_HEADER], headers[NONCE_HEADER]
    message = canonical("POST", "/v1/completions", ts, nonce, BODY)
    digest = hashlib.sha256(BODY).hexdigest()
    assert message == f"disagg-request-v1\nPOST\n/v1/completions\n{ts}\n{nonce}\n{digest}".encode()
    assert headers[SIGNATURE_HEADER] == "v1=" + hmac.new(KEY, message, "sha256").hexdigest()


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("method", {"method": "PUT"}),
        ("path", {"path": "/kv/fetch"}),
        ("query", {"path": "/v1/completions?x=1"}),
        ("body", {"body": BODY.replace(b"7", b"8")}),
        ("timestamp", {TIMESTAMP_HEADER: f"{NOW + 1:.3f}"}),
        ("nonce", {NONCE_HEADER: "0" * 32}),
        ("signature", {SIGNATURE_HEADER: "v1=" + "0" * 64}),
    ],
)
def test_each_altered_field_is_refused(field: str, change: dict[str, str]) -> None:
    headers = _signed()
    request = {k: v for k, v in change.items() if k in ("method", "path", "body")}
    headers.update({k: v for k, v in change.items() if k not in request})
    err = _refused(_verifier(), headers, **request)
    assert err.code == "invalid_signature", field
    assert "does not match" in err.message


def test_another_key_is_refused() -> None:
    assert _refused(_verifier(), _signed(key=b"other")).code == "invalid_signature"


@pytest.mark.parametrize("missing", [TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER])
def test_missing_headers_are_refused(missing: str) -> None:
    headers = {k: v for k, v in _signed().items() if k != missing}
    err = _refused(_verifier(), headers)
    assert err.code == "missing_signature" and missing in err.message
    assert _refused(_verifier(), {}).code == "missing_signature"


@pytest.mark.parametrize(
    "change",
    [
        {TIMESTAMP_HEADER: "yesterday"},
        {TIMESTAMP_HEADER: "nan"},
        {NONCE_HEADER: "short"},
        {NONCE_HEADER: "x" * 20 + "/"},
        {SIGNATURE_HEADER: "v2=" + "0" * 64},
        {SIGNATURE_HEADER: "0" * 64},
        {SIGNATURE_HEADER: "v1=" + "A" * 64},
    ],
)
def test_malformed_headers_are_refused(change: dict[str, str]) -> None:
    err = _refused(_verifier(), {**_signed(), **change})
    assert err.code == "malformed_signature" and "malformed" in err.message


@pytest.mark.parametrize(("offset", "word"), [(-61.0, "old"), (61.0, "in the future")])
def test_stale_and_future_timestamps_are_refused(offset: float, word: str) -> None:
    err = _refused(_verifier(), _signed(at=NOW + offset))
    assert err.code == "stale_timestamp" and word in err.message
    _verifier().check("POST", "/v1/completions", _signed(at=NOW + offset / 2), BODY)


def test_a_replayed_request_is_refused() -> None:
    v, headers = _verifier(), _signed()
    v.check("POST", "/v1/completions", headers, BODY)
    err = _refused(v, headers)
    assert err.code == "replayed_request" and "replayed" in err.message


def test_refused_requests_are_not_remembered() -> None:
    v, headers = _verifier(), _signed()
    _refused(v, headers, body=b"other")
    assert len(v) == 0
    v.check("POST", "/v1/completions", headers, BODY)  # the real one still passes


def test_the_nonce_memory_is_bounded() -> None:
    clock = [NOW]
    v = Verifier(KEY, 60.0, clock=lambda: clock[0], max_nonces=10)
    sent = []
    for i in range(25):
        headers = _signed(at=NOW + i * 0.01)
        v.check("POST", "/v1/completions", headers, BODY)
        sent.append(headers)
        assert len(v) <= 10
    # A nonce pushed out of the memory is still refused: its request is now too old.
    assert _refused(v, sent[0]).code == "stale_timestamp"
    assert _refused(v, sent[-1]).code == "replayed_request"
    # Past the window, the old nonces go: one entry left, the newest.
    clock[0] = NOW + 120
    v.check("POST", "/v1/completions", _signed(at=clock[0]), BODY)
    assert len(v) == 1


def test_trtllm_header_known_value() -> None:
    state, endpoint = "c3RhdGU=", "http://10.0.0.1:8001"
    canonical_json = (
        '{"ctx_info_endpoint":"http://10.0.0.1:8001","encoded_opaque_state":"c3RhdGU="}'
    )
    want = "sha256=" + hmac.new(KEY, canonical_json.encode(), hashlib.sha256).hexdigest()
    assert trtllm_auth_header(KEY, endpoint, state) == want
    assert trtllm_auth_header(KEY, [endpoint, "http://other"], state) == want
    no_endpoint = '{"ctx_info_endpoint":null,"encoded_opaque_state":"c3RhdGU="}'
    want = "sha256=" + hmac.new(KEY, no_endpoint.encode(), hashlib.sha256).hexdigest()
    signer = Signer(KEY)
    gen_leg = {"request_type": "generation_only", "encoded_opaque_state": state}
    assert signer.trtllm(gen_leg) == {TRTLLM_HEADER: want}
    assert signer.trtllm({"request_type": "context_only", "disagg_request_id": 1}) == {}
    assert signer.trtllm(None) == {}


def test_signer_for_and_worker_keys(tmp_path: Path) -> None:
    config = static_config(["127.0.0.1:1"], ["127.0.0.1:2"])
    assert signer_for(config) is None
    assert signer_for(with_environment(config, {"DISAGG_INTERNAL_AUTH_KEY": "k"})) is not None
    keyed = static_config(["127.0.0.1:1"], ["127.0.0.1:2"], internal_request_auth_key="k")
    assert signer_for(keyed) is not None
    key_file = tmp_path / "key"
    key_file.write_text("# the cluster's key\nsecret-from-file\n")
    assert worker_auth_key(str(key_file), {"DISAGG_INTERNAL_AUTH_KEY": "env"}) == (
        b"secret-from-file"
    )
    assert worker_auth_key(None, {"DISAGG_INTERNAL_AUTH_KEY": " env\n"}) == b"env"
    assert worker_auth_key(None, {}) is None
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match="internal_auth_key_file"):
        worker_auth_key(str(key_file), {})
    with pytest.raises(ConfigError, match="cannot read"):
        worker_auth_key(str(tmp_path / "nope"), {})


def test_path_of() -> None:
    assert path_of("http://h:1/kv/fetch") == "/kv/fetch"
    assert path_of("http://h:1/prefix/v1/completions?a=b") == "/prefix/v1/completions?a=b"
    assert path_of("http://h:1") == "/"


# -- opaque states --------------------------------------------------------------------------


def _state(expires_at: float = NOW + 30) -> OpaqueState:
    return OpaqueState("http://127.0.0.1:8001", 5, 40, 16, "float32", (2, 2, 16), expires_at)


def _tamper(sealed: str, **change: Any) -> str:
    text, signature = sealed.split(".")
    fields = json.loads(base64.b64decode(text))
    fields.update(change)
    return base64.b64encode(json.dumps(fields).encode()).decode() + "." + signature


def test_a_sealed_state_round_trips() -> None:
    sealed = _state().encode(KEY)
    assert "." in sealed
    assert OpaqueState.decode(sealed, KEY, now=NOW) == _state()
    assert OpaqueState.decode(sealed, None, now=NOW) == _state()  # a worker without a key


@pytest.mark.parametrize(
    "change",
    [{"endpoint": "http://169.254.169.254"}, {"ctx_request_id": 6}, {"expires_at": NOW + 999}],
)
def test_an_altered_state_is_refused(change: dict[str, Any]) -> None:
    with pytest.raises(Unauthorized, match="bad signature"):
        OpaqueState.decode(_tamper(_state().encode(KEY), **change), KEY, now=NOW)


def test_unsigned_and_foreign_states_are_refused_with_a_key() -> None:
    with pytest.raises(Unauthorized, match="not signed") as info:
        OpaqueState.decode(_state().encode(), KEY, now=NOW)
    assert info.value.code == "unsigned"
    with pytest.raises(Unauthorized, match="bad signature"):
        OpaqueState.decode(_state().encode(b"other"), KEY, now=NOW)
    with pytest.raises(Unauthorized):
        OpaqueState.decode(_state().encode(KEY) + "0", KEY, now=NOW)


def test_expired_states_are_refused_with_or_without_a_key() -> None:
    for key in (KEY, None):
        with pytest.raises(StateExpired, match="expired"):
            OpaqueState.decode(_state(NOW - 1).encode(key), key, now=NOW)
    # Older workers' states (no expires_at, unsigned) still decode where no key is set.
    fields = msgspec.to_builtins(_state())
    del fields["expires_at"]
    old = base64.b64encode(json.dumps(fields).encode()).decode()
    assert OpaqueState.decode(old, None, now=NOW).expires_at == 0.0
    with pytest.raises(TransferError):
        OpaqueState.decode("not base64!", None)


# -- the orchestrator's side ---------------------------------------------------------------


@contextlib.asynccontextmanager
async def _guarded(seen: list[web.Request]) -> AsyncIterator[str]:
    """A worker-like server that refuses (401) what is not signed with KEY."""

    async def ok(request: web.Request) -> web.Response:
        seen.append(request)
        if request.path == "/kv_cache_events":
            body = {"reset": False, "events": [], "last_event_id": 0, "block_size": 16}
            return web.json_response({"instance": "i", **body})
        return web.json_response({"ok": True})

    async def info(_r: web.Request) -> web.Response:
        return web.json_response({"block_size": 16})

    app = web.Application(middlewares=[error_middleware, auth_middleware(Verifier(KEY, 60))])
    app.add_routes([web.post("/{tail:.*}", ok), web.get("/server_info", info)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_the_worker_client_signs_every_post() -> None:
    async def main() -> None:
        seen: list[web.Request] = []
        async with _guarded(seen) as url:
            client = WorkerClient(1.0, signer=Signer(KEY))
            leg = {"disaggregated_params": {"request_type": "generation_only"}}
            leg["disaggregated_params"]["encoded_opaque_state"] = "c3RhdGU="
            assert await client.post(url, "/v1/completions", leg, 5.0) == {"ok": True}
            stream = await client.open_stream(url, "/v1/chat/completions", leg, 5.0)
            stream.close()
            await client.post(url, "/kv/handoff", {"disagg_request_id": 1}, 5.0)
            await client.release_kv(url, 3)
            await client.close()
            unsigned = WorkerClient(1.0)
            with pytest.raises(WorkerUnavailable, match="internal authentication") as info:
                await unsigned.post(url, "/v1/completions", leg, 5.0)
            assert info.value.code == "internal_auth_failed"
            await unsigned.close()
        paths = [r.path for r in seen]
        assert paths == ["/v1/completions", "/v1/chat/completions", "/kv/handoff", "/kv/release"]
        want = trtllm_auth_header(KEY, None, "c3RhdGU=")
        assert [r.headers.get(TRTLLM_HEADER) for r in seen] == [want, want, None, None]

    asyncio.run(main())


def test_the_kv_event_feed_signs_its_polls() -> None:
    async def main() -> None:
        seen: list[web.Request] = []
        async with _guarded(seen) as url:
            config = static_config(
                ["127.0.0.1:1"],
                [url],
                internal_auth_key=KEY.decode(),
                generation_servers={"router": {"type": "kv_cache_aware"}},
            )
            cache = CacheAwareRouting(config, Cluster(StaticDiscovery([], [url])))
            async with aiohttp.ClientSession() as session:
                await cache.start(session)
                await cache.stop()
        assert seen and all(r.path == "/kv_cache_events" for r in seen)

    asyncio.run(main())
