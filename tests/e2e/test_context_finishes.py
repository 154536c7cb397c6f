"""When the context leg already finished the request, no generation leg runs, and a
streaming client still gets the token as a proper chunk before [DONE]."""

from __future__ import annotations

import json

import httpx
import openai

from tests.conftest import Cluster, assert_no_leaks, route_of


def test_max_tokens_one_skips_generation(cluster: Cluster, mixed_worker: str) -> None:
    body = {"model": "tiny", "prompt": "One token only", "max_tokens": 1, "temperature": 0}
    r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert route_of(r)["generation"] == "-"
    direct = httpx.post(mixed_worker + "/v1/completions", json=body, timeout=60).json()
    out = r.json()
    assert out["choices"][0]["text"] == direct["choices"][0]["text"]
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 1
    assert "prompt_token_ids" not in out and "disaggregated_params" not in out["choices"][0]
    assert_no_leaks(cluster)


def test_stream_when_context_finished(cluster: Cluster) -> None:
    c = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len(text) == 1
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 1
    with httpx.stream(
        "POST",
        cluster.url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "hi", "max_tokens": 1, "stream": True},
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["choices"][0]["text"]
    assert_no_leaks(cluster)


def test_stop_string_at_first_token(cluster: Cluster, mixed_worker: str) -> None:
    body = {"model": "tiny", "prompt": "Stop early", "max_tokens": 8, "temperature": 0}
    first = httpx.post(
        mixed_worker + "/v1/completions", timeout=60, json={**body, "max_tokens": 1}
    ).json()["choices"][0]["text"]
    r = httpx.post(cluster.url + "/v1/completions", json={**body, "stop": [first]}, timeout=60)
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["text"] == ""
    assert route_of(r)["generation"] == "-"
    assert_no_leaks(cluster)


def test_usage_cached_tokens_from_context_leg(cluster: Cluster) -> None:
    prompt = "A shared prefix that spans more than one sixteen token block, for the cache. "
    c = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    c.completions.create(model="tiny", prompt=prompt + "first", max_tokens=4, temperature=0)
    second = c.completions.create(
        model="tiny", prompt=prompt + "second", max_tokens=4, temperature=0
    )
    assert second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= 64  # the shared full blocks were reused by the context leg
    assert second.usage.prompt_tokens == len(prompt + "second") + 1
    assert_no_leaks(cluster)
