"""schedule_style generation_first end to end: the generation worker is picked first and its
leg waits there for the KV while the context leg runs; the context worker pushes the KV (or,
pulling, the orchestrator names where it is). Greedy output equals aggregated output either
way; a context leg that finishes at its first token cancels the waiting leg; a generation
worker that fails before it got the KV falls back to the context-first handoff; a waiting
leg that never gets a handoff gives its blocks back; and a worker refuses bad handoffs."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from disagg.demo import free_port
from tests.conftest import (
    NO_BREAKER,
    BrokenWorker,
    Cluster,
    Procs,
    assert_no_leaks,
    route_of,
    start_cluster,
    wait_healthy,
)

PROMPTS = [
    "a",
    "System: you are a helpful assistant that answers briefly. " * 3 + "What is a KV cache?",
    "decode " * 70,  # > 256 tokens: the context worker prefills it in chunks
]


def _complete(url: str, prompt: str, **kw: object) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _transfers(c: Cluster) -> dict[str, int]:
    total: dict[str, int] = {}
    for url in c.worker_urls:
        for k, v in httpx.get(url + "/stats").json()["transfers"].items():
            total[k] = total.get(k, 0) + v
    return total


MODE: dict[str, str] = {}  # the transfer mode of each cluster, by its url


@pytest.fixture(scope="module", params=["push", "pull"])
def gen_first(
    request: pytest.FixtureRequest, procs: Procs, tmp_path_factory: pytest.TempPathFactory
) -> Cluster:
    c = start_cluster(
        procs,
        tmp_path_factory.mktemp("genfirst"),
        1,
        1,
        schedule_style="generation_first",
        generation_first_transfer=request.param,
    )
    MODE[c.url] = request.param
    return c


def test_output_equals_aggregated(gen_first: Cluster, mixed_worker: str) -> None:
    before = _transfers(gen_first)
    for prompt in PROMPTS:
        want = _complete(mixed_worker, prompt).json()["choices"][0]["text"]
        r = _complete(gen_first.url, prompt)
        assert r.json()["choices"][0]["text"] == want
        route = route_of(r)
        assert route["context"] == gen_first.context_urls[0]
        assert route["generation"] == gen_first.generation_urls[0]
        assert r.json()["usage"]["prompt_tokens"] > 0
    moved = {k: v - before.get(k, 0) for k, v in _transfers(gen_first).items()}
    n = len(PROMPTS)
    if MODE[gen_first.url] == "push":  # the context worker sent every KV itself
        assert moved == {**moved, "pushed": n, "push_received": n, "fetch_served": 0}
    else:  # pull: the orchestrator named where each KV was, the waiting leg fetched it
        assert moved == {**moved, "handoff_received": n, "fetch_served": n, "pushed": 0}
    assert_no_leaks(gen_first)


def test_streamed_with_the_openai_client(gen_first: Cluster, mixed_worker: str) -> None:
    prompt = PROMPTS[1]
    want = _complete(mixed_worker, prompt).json()["choices"][0]["text"]
    client = openai.OpenAI(base_url=gen_first.url + "/v1", max_retries=0)
    stream = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12
    assert_no_leaks(gen_first)


def test_context_leg_that_finishes_cancels_the_waiting_leg(gen_first: Cluster) -> None:
    for stream in (False, True):
        r = _complete(gen_first.url, "one token only", max_tokens=1, stream=stream)
        assert r.status_code == 200
    assert_no_leaks(gen_first)


def test_a_generation_worker_that_fails_first_falls_back(procs: Procs, tmp_path: Path) -> None:
    """The waiting leg's worker answers 500 (and has no push endpoint): the context worker
    keeps the KV pinned, and the context-first handoff takes it to the other worker."""
    with BrokenWorker("500") as broken:
        c = start_cluster(
            procs,
            tmp_path,
            1,
            1,
            extra_gen=[broken],
            schedule_style="generation_first",
            router={"type": "round_robin"},
            **NO_BREAKER,
        )
        for i in range(4):  # round robin: every other request is placed on the broken one
            r = _complete(c.url, f"fall back {i}")
            assert route_of(r)["generation"] == c.generation_urls[0]
    assert_no_leaks(c)


def test_a_waiting_leg_without_handoff_gives_its_blocks_back(procs: Procs) -> None:
    port = free_port()
    procs.start("worker", "--role", "generation", "--port", str(port), "--kv-lease", "0.5")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, procs)
    body = {
        "model": "tiny",
        "prompt": "nobody hands this over",
        "max_tokens": 4,
        "disaggregated_params": {
            "request_type": "generation_only",
            "schedule_style": "generation_first",
            "disagg_request_id": 7,
        },
    }
    started = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 503 and "handed" in r.json()["error"]["message"]
    assert time.monotonic() - started < 10
    stats = httpx.get(url + "/stats").json()
    assert stats["handoffs"] == 0 and stats["kv"]["used"] == 0


def test_bad_handoffs_are_refused(gen_first: Cluster) -> None:
    gen = gen_first.generation_urls[0]
    nobody = {
        "disagg_request_id": 12345,
        "first_gen_tokens": [1],
        "prompt_token_ids": [1, 2, 3],
        "encoded_opaque_state": "e30=",  # {}: not a state
    }
    r = httpx.post(gen + "/kv/handoff", json=nobody)
    assert r.status_code == 400
    r = httpx.post(gen + "/kv/handoff", json={**nobody, "encoded_opaque_state": 5})
    assert r.status_code == 400
    r = httpx.post(gen + "/kv/push", content=b"\x00\x00\x00\x02{}")
    assert r.status_code == 400
    r = httpx.post(gen + "/kv/push", content=b"junk")
    assert r.status_code == 400
    assert_no_leaks(gen_first)
