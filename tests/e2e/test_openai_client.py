"""The official openai client against the orchestrator, 1+1 and 2+2 workers."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import Cluster, assert_no_leaks, route_of


@pytest.fixture(params=["1x1", "2x2"])
def any_cluster(request: pytest.FixtureRequest) -> Cluster:
    name = "cluster" if request.param == "1x1" else "cluster2"
    c: Cluster = request.getfixturevalue(name)
    return c


def client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_completions(any_cluster: Cluster) -> None:
    out = client(any_cluster).completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=12, temperature=0
    )
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert len(out.choices[0].text) > 0
    assert out.usage is not None
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == len(b"The quick brown fox") + 1  # + BOS
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert_no_leaks(any_cluster)


def test_completions_stream(any_cluster: Cluster) -> None:
    c = client(any_cluster)
    full = c.completions.create(model="tiny", prompt="Streaming test", max_tokens=10, temperature=0)
    chunks = list(
        c.completions.create(
            model="tiny",
            prompt="Streaming test",
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens  # type: ignore[union-attr]
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert reasons[-1] == "length"
    assert_no_leaks(any_cluster)


def test_chat(any_cluster: Cluster) -> None:
    out = client(any_cluster).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=8,
        temperature=0,
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content
    assert out.usage is not None and out.usage.completion_tokens == 8
    assert_no_leaks(any_cluster)


def test_chat_stream(any_cluster: Cluster) -> None:
    c = client(any_cluster)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say something about prefill and decode."},
    ]
    full = c.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=20,
        temperature=0,
    )
    stream = c.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and full.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, 20)
    assert_no_leaks(any_cluster)


def test_responses(any_cluster: Cluster) -> None:
    c = client(any_cluster)
    out = c.responses.create(
        model="tiny", input="What is a KV cache?", max_output_tokens=9, temperature=0
    )
    assert out.status == "incomplete"  # stopped by max_output_tokens
    assert out.output[0].status == "incomplete"
    assert out.output_text
    assert out.usage is not None and out.usage.output_tokens == 9
    events = list(
        c.responses.create(
            model="tiny",
            input="What is a KV cache?",
            max_output_tokens=9,
            temperature=0,
            stream=True,
        )
    )
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == out.output_text
    final = events[-1]
    assert final.type == "response.incomplete"
    assert final.response.usage is not None
    assert final.response.usage.input_tokens == out.usage.input_tokens
    assert_no_leaks(any_cluster)


def test_models_health_cluster_info(cluster: Cluster) -> None:
    models = client(cluster).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(cluster.url + "/health").status_code == 200
    info = httpx.get(cluster.url + "/cluster_info").json()
    assert [w["url"] for w in info["context_servers"]] == cluster.context_urls
    assert [w["url"] for w in info["generation_servers"]] == cluster.generation_urls
    assert all(w["ready"] and w["in_flight"] == 0 for w in info["context_servers"])


def test_route_header_and_round_robin(cluster2: Cluster) -> None:
    seen_ctx, seen_gen = set(), set()
    c = client(cluster2)
    for i in range(4):
        raw = c.completions.with_raw_response.create(
            model="tiny", prompt=f"rr {i}", max_tokens=3, temperature=0
        )
        route = route_of(raw)
        seen_ctx.add(route["context"])
        seen_gen.add(route["generation"])
    assert seen_ctx == set(cluster2.context_urls)
    assert seen_gen == set(cluster2.generation_urls)
    assert_no_leaks(cluster2)


def test_chat_max_completion_tokens_wins(cluster: Cluster) -> None:
    out = client(cluster).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        max_completion_tokens=1,
        temperature=0,
    )
    assert out.usage is not None and out.usage.completion_tokens == 1
    out = client(cluster).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        max_completion_tokens=4,
        temperature=0,
    )
    assert out.usage is not None and out.usage.completion_tokens == 4
    assert_no_leaks(cluster)
