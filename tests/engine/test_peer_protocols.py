"""The reference worker under other routers' PD protocols (see `engine.peer_protocols`): an
SGLang request (`bootstrap_room`) on a context worker prefills only; a vLLM prefill request
(`kv_transfer_params.do_remote_decode`) gets `kv_transfer_params` back for its decode leg;
generation workers serve both as plain requests."""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from tests.conftest import Procs, free_port, wait_healthy

SGLANG = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 12345}


def _worker(procs: Procs, role: str) -> str:
    port = free_port()
    procs.start("worker", "--role", role, "--port", str(port), "--simulate", "zero")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, procs)
    return url


def test_sglang_prefill_only_on_context_workers(procs: Procs) -> None:
    ctx, gen = _worker(procs, "context"), _worker(procs, "generation")
    body = {"model": "tiny", "prompt": "pd", "max_tokens": 6, "ignore_eos": True, **SGLANG}
    r = httpx.post(ctx + "/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "pd"}],
        "max_completion_tokens": 6,
        "stream": True,
        **SGLANG,
    }
    with httpx.stream("POST", ctx + "/v1/chat/completions", json=chat) as s:
        raw = b"".join(s.iter_bytes())
    assert s.status_code == 200 and raw.endswith(b"data: [DONE]\n\n")
    assert raw.count(b'"finish_reason":"length"') == 1
    r = httpx.post(gen + "/v1/completions", json=body)
    assert r.json()["usage"]["completion_tokens"] == 6  # the decode side generates them all
    assert "served_model_name" in httpx.get(ctx + "/server_info").json()


def test_vllm_prefill_answer_carries_kv_transfer_params(procs: Procs) -> None:
    ctx = _worker(procs, "context")
    body = {
        "model": "tiny",
        "prompt": "pd",
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    params = httpx.post(ctx + "/v1/completions", json=body).json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_port"] == urlsplit(ctx).port
    plain = httpx.post(ctx + "/v1/completions", json={**body, "kv_transfer_params": None})
    assert "kv_transfer_params" not in plain.json()
