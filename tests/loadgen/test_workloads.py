"""Workloads of `disagg bench`: the same seed gives the same bodies, each endpoint gets its own
body shape, mix keeps its long share, shared-prefix turns extend the turn before them, and a
JSONL file is read line by line with errors that name the line."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from disagg.loadgen.workloads import (
    PATHS,
    Endpoint,
    Fixed,
    Mix,
    Request,
    SharedPrefix,
    Workload,
    WorkloadError,
    parse_workload,
)

ENDPOINTS: tuple[Endpoint, ...] = ("completions", "chat", "responses")


def take(workload: Workload, n: int, endpoint: Endpoint = "completions", seed: int = 0) -> list:
    return list(itertools.islice(workload.requests(endpoint, "tiny", seed), n))


def prompt_of(request: Request) -> Any:
    body = request.body
    return body.get("prompt", body.get("messages", body.get("input")))


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("fixed:in=128,out=32", Fixed(128, 32)),
        ("fixed", Fixed()),
        ("fixed:out=4", Fixed(128, 4)),
        ("mix:long=2048,short=128,long_share=0.2,out=32", Mix(2048, 128, 0.2, 32)),
        ("shared-prefix:systems=8,turns=4,system_len=1024,out=32", SharedPrefix(8, 4, 1024)),
        ("shared-prefix:user_len=10", SharedPrefix(user_len=10)),
    ],
)
def test_parses_specs(spec: str, expected: Workload) -> None:
    workload = parse_workload(spec)
    assert workload == expected
    assert parse_workload(workload.spec) == workload  # the echoed spec reads back the same


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("steady:in=1", "unknown workload 'steady'"),
        ("fixed:in=128,outt=3", "keys in, out"),
        ("fixed:in=abc", "in='abc' is not int"),
        ("fixed:in=0", "in must be at least 1"),
        ("fixed:in", "key=value"),
        ("mix:long_share=1.5", "long_share must be between 0 and 1"),
        ("jsonl:", "needs a path"),
        ("jsonl:/nonexistent/requests.jsonl", "cannot read /nonexistent/requests.jsonl"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, says: str) -> None:
    with pytest.raises(WorkloadError, match=says.replace("(", r"\(")):
        parse_workload(spec)


@pytest.mark.parametrize(
    "workload", [Fixed(16, 4), Mix(64, 8, 0.5, 4), SharedPrefix(2, 3, 32, 8, 4)], ids=repr
)
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_same_seed_same_bodies(workload: Workload, endpoint: Endpoint) -> None:
    first = take(workload, 30, endpoint, seed=7)
    assert first == take(workload, 30, endpoint, seed=7)
    assert first != take(workload, 30, endpoint, seed=8)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_fixed_bodies_per_endpoint(endpoint: Endpoint) -> None:
    requests = take(Fixed(100, 12), 5, endpoint)
    for r in requests:
        assert r.path == PATHS[endpoint]
        assert r.body["model"] == "tiny" and r.body["ignore_eos"] is True
        assert "stream" not in r.body  # the runner's to set
    bodies = [r.body for r in requests]
    if endpoint == "completions":
        assert all(len(b["prompt"]) == 100 and b["max_tokens"] == 12 for b in bodies)
    elif endpoint == "chat":
        assert all(b["max_tokens"] == 12 for b in bodies)
        assert all(b["messages"][0]["role"] == "user" for b in bodies)
        assert all(len(b["messages"][0]["content"]) == 100 for b in bodies)
    else:
        assert all(len(b["input"]) == 100 and b["max_output_tokens"] == 12 for b in bodies)
        assert all("max_tokens" not in b for b in bodies)
    assert len({json.dumps(b) for b in bodies}) == 5  # distinct prompts: no accidental cache hits


def test_mix_keeps_its_long_share() -> None:
    lengths = [len(r.body["prompt"]) for r in take(Mix(300, 20, 0.2, 4), 2000)]
    assert set(lengths) == {300, 20}
    assert 0.17 < lengths.count(300) / len(lengths) < 0.23
    assert {len(r.body["prompt"]) for r in take(Mix(300, 20, 0.0, 4), 200)} == {20}


def test_shared_prefix_chat_turns_extend_the_turn_before() -> None:
    systems, turns = 3, 4
    requests = take(SharedPrefix(systems, turns, 50, 10, 5), systems * turns * 2, "chat")
    groups = [requests[i : i + systems * turns] for i in range(0, len(requests), systems * turns)]
    system_prompts = set()
    for group in groups:
        for chat in range(systems):
            convo = [group[t * systems + chat].body["messages"] for t in range(turns)]
            system_prompts.add(convo[0][0]["content"])
            for before, after in itertools.pairwise(convo):
                assert after[: len(before)] == before
                assert [m["role"] for m in after[len(before) :]] == ["assistant", "user"]
                assert len(after[len(before)]["content"]) == 5  # the answer stands in for `out`
            assert convo[0][0]["role"] == "system" and len(convo[0][0]["content"]) == 50
            assert len(convo[-1]) == 2 * turns
    assert len(system_prompts) == systems  # the next group shares the same system prompts
    assert all(r.body["max_tokens"] == 5 and r.body["ignore_eos"] for r in requests)


def test_shared_prefix_completions_and_responses() -> None:
    systems, turns = 2, 3
    prompts = [r.body["prompt"] for r in take(SharedPrefix(systems, turns, 40, 8, 6), 6)]
    for chat in range(systems):
        convo = [prompts[t * systems + chat] for t in range(turns)]
        for before, after in itertools.pairwise(convo):
            assert after.startswith(before) and len(after) == len(before) + 2 + 6 + 8
    responses = take(SharedPrefix(systems, turns, 40, 8, 6), 6, "responses")
    chats = take(SharedPrefix(systems, turns, 40, 8, 6), 6, "chat")
    assert [r.body["input"] for r in responses] == [c.body["messages"] for c in chats]
    assert all(r.body["max_output_tokens"] == 6 for r in responses)


def write(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_lines_become_requests(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '{"prompt": "hello", "max_tokens": 3}',
        "",
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "model": "other"}',
        '{"path": "/v1/responses", "prompt": "as input", "max_tokens": 4}',
        '{"input": "responses body", "max_output_tokens": 5, "temperature": 0}',
    )
    workload = parse_workload(f"jsonl:{path}")
    assert workload.spec == f"jsonl:{path}"
    requests = take(workload, 8, "chat")
    assert [r.path for r in requests[:4]] == [
        "/v1/chat/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/responses",
    ]
    assert requests[0].body == {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 3,
    }
    assert requests[1].body["model"] == "other"  # a line's own model is kept
    assert requests[2].body == {"model": "tiny", "input": "as input", "max_output_tokens": 4}
    assert requests[3].body["temperature"] == 0
    assert requests[4:] == requests[:4]  # then from the top again
    as_completions = take(workload, 1, "completions")[0]
    assert as_completions.body == {"model": "tiny", "prompt": "hello", "max_tokens": 3}


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('{"prompt": "x"', "requests.jsonl:2: not JSON"),
        ('["prompt"]', "requests.jsonl:2: expected a JSON object"),
        ('{"max_tokens": 3}', "requests.jsonl:2: a body needs `prompt`, `messages` or `input`"),
        ('{"path": "/v1/embeddings", "prompt": "x"}', "requests.jsonl:2: `path` must be one of"),
        ('{"prompt": "x", "max_tokens": 0}', "requests.jsonl:2: `max_tokens` must be a positive"),
        ('{"prompt": "x", "max_tokens": "3"}', "`max_tokens` must be a positive integer"),
        ('{"prompt": 3}', "`prompt` must be a string or a list"),
        ('{"path": "/v1/chat/completions", "input": "x"}', "needs `messages`"),
    ],
)
def test_jsonl_bad_lines_are_named(tmp_path: Path, line: str, says: str) -> None:
    path = write(tmp_path, '{"prompt": "fine"}', line)
    with pytest.raises(WorkloadError, match=says.replace("[", r"\[")):
        parse_workload(f"jsonl:{path}")


def test_jsonl_empty_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="has no requests"):
        parse_workload(f"jsonl:{write(tmp_path, '', '  ')}")
