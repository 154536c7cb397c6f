"""A stream's first token goes to the client from the context leg's answer, before the
generation leg runs (`stream_first_token: context`, the default): one consistent stream,
retries that continue the token already sent, and nothing leaked when the generation leg
fails or the client leaves after the first token."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import (
    NO_BREAKER,
    BrokenWorker,
    Cluster,
    Procs,
    assert_no_leaks,
    route_of,
    start_cluster,
)


def _client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _events(r: httpx.Response) -> Iterator[tuple[float, Any]]:
    """Each SSE event's data (parsed, or "[DONE]") with the time it arrived."""
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            yield time.monotonic(), data if data == "[DONE]" else json.loads(data)


def test_one_consistent_stream_per_endpoint(cluster: Cluster) -> None:
    c = _client(cluster)
    prompt = "Ahead of the generation leg"
    full = c.completions.create(model="tiny", prompt=prompt, max_tokens=9, temperature=0)
    chunks = list(
        c.completions.create(model="tiny", prompt=prompt, max_tokens=9, temperature=0, stream=True)
    )
    assert "".join(ch.choices[0].text for ch in chunks) == full.choices[0].text
    assert len({ch.id for ch in chunks}) == 1

    messages = [{"role": "user", "content": prompt}]
    chat = list(
        c.chat.completions.create(
            model="tiny",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=9,
            temperature=0,
            stream=True,
        )
    )
    whole = c.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=9,
        temperature=0,
    )
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in chat)
        == whole.choices[0].message.content
    )
    assert [ch.choices[0].delta.role for ch in chat].count("assistant") == 1
    assert chat[0].choices[0].delta.role == "assistant" and len({ch.id for ch in chat}) == 1

    events = list(
        c.responses.create(
            model="tiny", input=prompt, max_output_tokens=9, temperature=0, stream=True
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events].count("response.created") == 1
    final = events[-1].response  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.choices[0].message.content
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    assert final.id == events[0].response.id  # type: ignore[union-attr]
    assert_no_leaks(cluster)


@pytest.fixture(scope="module")
def hanging_gen(
    procs: Procs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Cluster, Cluster]]:
    """Two clusters on one context worker pool whose generation worker never answers: the
    first token goes ahead in one (`context`), not in the other (`generation`)."""
    with BrokenWorker("hang") as url:
        tmp = tmp_path_factory.mktemp("hang")
        common: dict[str, Any] = {"first_token_timeout": 1.0, "max_retries": 0, **NO_BREAKER}
        ahead = start_cluster(procs, tmp, 1, 0, extra_gen=[url], **common)
        behind = start_cluster(
            procs, tmp, 1, 0, extra_gen=[url], stream_first_token="generation", **common
        )
        yield ahead, behind


def _stream(c: Cluster, prompt: str = "hanging generation worker") -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 8, "stream": True, "temperature": 0}


def test_the_first_token_does_not_wait_for_the_generation_leg(
    hanging_gen: tuple[Cluster, Cluster], mixed_worker: str
) -> None:
    c, _ = hanging_gen
    direct = httpx.post(
        mixed_worker + "/v1/completions",
        json={**_stream(c), "stream": False, "max_tokens": 1},
        timeout=60,
    ).json()
    sent = time.monotonic()
    with httpx.stream("POST", c.url + "/v1/completions", json=_stream(c), timeout=60) as r:
        assert r.status_code == 200
        events = list(_events(r))
    first_at, first = events[0]
    assert first["choices"][0]["text"] == direct["choices"][0]["text"]  # the context leg's token
    assert first_at - sent < 0.9  # long before the generation leg's 1 s timeout
    # then the generation leg's failure, as an error event, and the end
    (error_at, error), (_, done) = events[1], events[2]
    assert error["error"]["type"] == "timeout" and done == "[DONE]"
    assert error_at - sent >= 1.0
    assert_no_leaks(c)  # the context KV was released, the reservations finished


def test_generation_sends_it_keeps_the_http_status(hanging_gen: tuple[Cluster, Cluster]) -> None:
    _, c = hanging_gen
    r = httpx.post(c.url + "/v1/completions", json=_stream(c), timeout=60)
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
    assert_no_leaks(c)


def test_a_client_that_leaves_after_the_first_token(hanging_gen: tuple[Cluster, Cluster]) -> None:
    c, _ = hanging_gen
    with httpx.stream(
        "POST", c.url + "/v1/completions", json=_stream(c, "leaving"), timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the first token: gone before the generation leg answers
    assert_no_leaks(c, timeout_s=3.0)


@pytest.fixture(scope="module")
def half_broken_gen(
    procs: Procs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Cluster, str]]:
    """A generation pool of a worker that fails every leg (500) and a reference worker; one
    retry. The cluster and the broken worker's URL."""
    with BrokenWorker("500") as url:
        c = start_cluster(
            procs,
            tmp_path_factory.mktemp("half"),
            1,
            1,
            extra_gen=[url],
            max_retries=1,
            retry_interval=0.01,
            **NO_BREAKER,
        )
        yield c, url


def test_a_retry_continues_the_token_sent(
    half_broken_gen: tuple[Cluster, str], mixed_worker: str
) -> None:
    """The generation leg fails after it was sent (a new context leg is needed); the new
    generation leg continues from the first token the client has."""
    c, url = half_broken_gen
    body = {
        "model": "tiny",
        "prompt": "retried after its first token",
        "max_tokens": 10,
        "temperature": 0,
    }
    direct = httpx.post(mixed_worker + "/v1/completions", json=body, timeout=60).json()
    broken_routes = 0
    for _ in range(4):  # round robin: the broken worker takes every other placement
        with httpx.stream(
            "POST", c.url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            assert r.status_code == 200
            route = route_of(r)
            events = [data for _, data in _events(r)]
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert text == direct["choices"][0]["text"]
        broken_routes += route["generation"] == url
    assert broken_routes >= 1
    assert_no_leaks(c)


def test_sampled_stream_continues_its_first_token(half_broken_gen: tuple[Cluster, str]) -> None:
    """With sampling, a new context leg could sample another first token; the stream still
    reads as one answer: the usage counts every token once, and no token's text comes
    twice (the new generation leg repeats the token sent, which is taken out)."""
    c, _ = half_broken_gen
    oc = _client(c)
    for i in range(8):
        chunks = list(
            oc.completions.create(
                model="tiny",
                prompt=f"sampled {i}",
                max_tokens=6,
                temperature=1.0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        pieces = [ch.choices[0].text for ch in chunks if ch.choices]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
        assert len([p for p in pieces if p]) <= 6 and pieces[0] != ""
    assert_no_leaks(c)
