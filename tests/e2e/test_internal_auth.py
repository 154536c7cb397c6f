"""Internal authentication end to end: an orchestrator and workers that share a key serve
completions and streamed chat (context-first, and generation_first with push and pull) with
nothing refused; a worker refuses (401) whatever is not signed with the key, before it
decodes anything or connects anywhere: legs, KV fetches, pushes, handoffs, releases and
event polls; a forged or altered opaque state never reaches the endpoint it names; a
replayed KV fetch is refused; the GET endpoints stay open."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import yaml

from disagg.demo import free_port
from disagg.internal_auth import Signer
from tests.conftest import Cluster, Procs, assert_no_leaks, route_of, wait_healthy

KEY = "e2e-internal-key"
PROMPT = "System: answer briefly. What is a KV cache? " * 2


class Decoy:
    """An HTTP server that only counts what reaches it (it must stay at zero)."""

    def __init__(self) -> None:
        hits = self.hits = [0]

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                hits[0] += 1
                self.send_response(200)
                self.end_headers()

            do_GET = do_POST = _any

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Decoy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def workers(procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Path]:
    """One context and one generation worker holding KEY (from a key file)."""
    tmp = tmp_path_factory.mktemp("internal-auth")
    key_file = tmp / "internal.key"
    key_file.write_text(KEY + "\n")
    urls = []
    for role in ("context", "generation"):
        port = free_port()
        procs.start(
            "worker", "--role", role, "--port", str(port), "--internal-auth-key-file", str(key_file)
        )
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        wait_healthy(url, procs)
    return urls[0], urls[1], tmp


def _orchestrator(procs: Procs, workers: tuple[str, str, Path], **extra: Any) -> Cluster:
    ctx, gen, tmp = workers
    port = free_port()
    config = {
        "hostname": "127.0.0.1",
        "port": port,
        "context_servers": {"urls": [ctx]},
        "generation_servers": {"urls": [gen]},
        "internal_auth_key": KEY,
        **extra,
    }
    path = tmp / f"cluster-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    procs.start("serve", "--config", str(path))
    cluster = Cluster(f"http://127.0.0.1:{port}", [ctx], [gen])
    wait_healthy(cluster.url, procs)
    return cluster


def _stats(url: str) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(url + "/stats").json()
    return stats


def _refusals(c: Cluster) -> int:
    return sum(_stats(u)["auth_refused"] for u in c.worker_urls)


def _serve_both_ways(c: Cluster) -> None:
    """A completion and a streamed chat through `c`, none of their requests refused."""
    before = _refusals(c)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    r = httpx.post(c.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    assert route_of(r)["generation"] == c.generation_urls[0]
    client = openai.OpenAI(base_url=c.url + "/v1", max_retries=0)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert _refusals(c) == before
    assert_no_leaks(c)


def test_a_keyed_cluster_serves_context_first(procs: Procs, workers: Any) -> None:
    # kv_cache_aware: the orchestrator's KV event polls are signed too
    c = _orchestrator(procs, workers, router={"type": "kv_cache_aware"}, kv_events_interval=0.05)
    _serve_both_ways(c)


@pytest.mark.parametrize("transfer", ["push", "pull"])
def test_a_keyed_cluster_serves_generation_first(procs: Procs, workers: Any, transfer: str) -> None:
    c = _orchestrator(
        procs, workers, schedule_style="generation_first", generation_first_transfer=transfer
    )
    moved = "pushed" if transfer == "push" else "handoff_received"
    ctx, gen = (_stats(u)["transfers"] for u in c.worker_urls)
    before = ctx[moved] + gen[moved]
    _serve_both_ways(c)
    ctx, gen = (_stats(u)["transfers"] for u in c.worker_urls)
    assert ctx[moved] + gen[moved] == before + 2


# -- straight to the workers ------------------------------------------------------------------


def _post(url: str, path: str, obj: Any, key: str | None = KEY) -> httpx.Response:
    """POST JSON, signed with `key` (unsigned when None)."""
    body = msgspec.json.encode(obj)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers.update(Signer(key.encode()).headers("POST", path, body))
    return httpx.post(url + path, content=body, headers=headers, timeout=30)


def _forged_state(endpoint: str, signature: str | None = None) -> str:
    fields = {
        "endpoint": endpoint,
        "ctx_request_id": 1,
        "num_tokens": 3,
        "block_size": 16,
        "dtype": "float32",
        "layout": [2, 2, 16],
        "expires_at": 4e9,
    }
    text = base64.b64encode(json.dumps(fields).encode()).decode()
    return text if signature is None else f"{text}.{signature}"


def _generation_leg(state: str, prompt_ids: list[int]) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": "x",
        "prompt_token_ids": prompt_ids,
        "max_tokens": 4,
        "disaggregated_params": {
            "request_type": "generation_only",
            "disagg_request_id": 4242,
            "ctx_request_id": 1,
            "first_gen_tokens": [65],
            "encoded_opaque_state": state,
        },
    }


@pytest.fixture
def decoy() -> Iterator[Decoy]:
    with Decoy() as d:
        yield d


def _unchanged(url: str, before: dict[str, Any]) -> None:
    after = _stats(url)
    assert {**after, "auth_refused": 0} == {**before, "auth_refused": 0}
    assert after["auth_refused"] > before["auth_refused"]


def test_unsigned_and_wrongly_signed_legs_are_refused(workers: Any, decoy: Decoy) -> None:
    _ctx, gen, _ = workers
    leg = _generation_leg(_forged_state(decoy.url), [1, 2, 3])
    for key, code in ((None, "missing_signature"), ("not-the-key", "invalid_signature")):
        before = _stats(gen)
        r = _post(gen, "/v1/completions", leg, key=key)
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == code
        _unchanged(gen, before)
    assert decoy.hits[0] == 0


def test_forged_opaque_states_never_reach_their_endpoint(workers: Any, decoy: Decoy) -> None:
    ctx, gen, _ = workers
    ask = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    ask["disaggregated_params"] = {"request_type": "context_only", "disagg_request_id": 77}
    r = _post(ctx, "/v1/completions", ask)
    assert r.status_code == 200, r.text
    params = r.json()["choices"][0]["disaggregated_params"]
    real, ids = params["encoded_opaque_state"], r.json()["prompt_token_ids"]
    text, signature = real.split(".")
    fields = json.loads(base64.b64decode(text))
    altered = base64.b64encode(json.dumps({**fields, "endpoint": decoy.url}).encode()).decode()
    forged = {
        "unsigned": _forged_state(decoy.url),
        "signed with another key": Signer(b"other").seal(_forged_state(decoy.url)),
        "altered endpoint": f"{altered}.{signature}",
    }
    for what, state in forged.items():
        before = _stats(gen)
        r = _post(gen, "/v1/completions", _generation_leg(state, ids))  # the request is signed
        assert r.status_code == 401, (what, r.text)
        assert "encoded_opaque_state" in r.json()["error"]["message"]
        assert _stats(gen)["steps"] == before["steps"] and _stats(gen)["kv"] == before["kv"]
        handoff = {"disagg_request_id": 5, "first_gen_tokens": [65], "prompt_token_ids": ids}
        r = _post(gen, "/kv/handoff", {**handoff, "encoded_opaque_state": state})
        assert r.status_code == 401, (what, r.text)
    assert decoy.hits[0] == 0
    # The real KV is still pinned; fetching it takes it, and the same request again is refused.
    fetch = msgspec.json.encode({"ctx_request_id": fields["ctx_request_id"], "start_block": 0})
    headers = {"Content-Type": "application/json"}
    headers.update(Signer(KEY.encode()).headers("POST", "/kv/fetch", fetch))
    first = httpx.post(ctx + "/kv/fetch", content=fetch, headers=headers)
    assert first.status_code == 200 and first.content
    again = httpx.post(ctx + "/kv/fetch", content=fetch, headers=headers)
    assert again.status_code == 401 and again.json()["error"]["code"] == "replayed_request"
    assert _stats(ctx)["pinned"] == 0 and _stats(ctx)["kv"]["used"] == 0


@pytest.mark.parametrize("path", ["/kv/fetch", "/kv/release", "/kv/handoff", "/kv_cache_events"])
def test_the_kv_endpoints_need_a_signature(workers: Any, path: str) -> None:
    ctx, gen, _ = workers
    for url in (ctx, gen):
        r = _post(url, path, {"ctx_request_id": 0, "since": 0}, key=None)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "missing_signature"
    r = httpx.post(gen + "/kv/push", content=b"\x00\x00\x00\x02{}")
    assert r.status_code == 401
    if path == "/kv_cache_events":  # signed, it answers
        assert _post(ctx, path, {"since": 0}).json()["reset"] is True


def test_the_get_endpoints_stay_open(workers: Any) -> None:
    ctx, gen, _ = workers
    for url in (ctx, gen):
        for path in ("/health", "/server_info", "/v1/models", "/stats"):
            assert httpx.get(url + path).status_code == 200, path
    assert _stats(ctx)["pinned"] == 0 and _stats(gen)["kv"]["used"] == 0
