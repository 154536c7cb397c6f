"""`Ahead`: the head a stream gets from the context answer, and the filter that keeps the
generation worker's stream from sending it twice, for each endpoint's shape."""

from __future__ import annotations

import json
from typing import Any

import pytest

from disagg.ahead import Ahead
from disagg.endpoints import ENDPOINTS, ContextOutcome
from disagg.formats import DONE, ChatShape, CompletionShape, ResponsesShape, Shape


def _ctx(text: str) -> ContextOutcome:
    params = {"first_gen_tokens": [7], "ctx_request_id": 1, "encoded_opaque_state": "s"}
    return ContextOutcome(False, params, [1, 2, 3], {}, text, "not_finished")


def _context_answer(kind: str) -> dict[str, Any]:
    rid = {"completions": "cmpl-ctx", "chat": "chatcmpl-ctx", "responses": "resp_ctx"}[kind]
    key = "created_at" if kind == "responses" else "created"
    return {"id": rid, "model": "tiny", key: 100}


def _worker_stream(kind: str, pieces: list[str], repeat: str | None) -> list[bytes]:
    """What a generation worker streams: its opening events, `repeat` (the first token's
    text, which it sends again) when given, the pieces, and its end; one event a chunk."""
    shape: Shape = {
        "completions": CompletionShape("cmpl-gen", "tiny", 101),
        "chat": ChatShape("chatcmpl-gen", "tiny", 101),
        "responses": ResponsesShape("resp_gen", "tiny", 101),
    }[kind]
    texts = ([repeat] if repeat else []) + pieces
    usage = {"prompt_tokens": 3, "completion_tokens": len(texts), "total_tokens": 3 + len(texts)}
    events = shape.stream_start() + [shape.stream_delta(t) for t in texts]
    return [*events, *shape.stream_end("".join(texts), "stop", usage), DONE]


def _client_sees(kind: str, first: str, chunks: list[bytes]) -> list[dict[str, Any]]:
    ahead = Ahead(ENDPOINTS[kind], _context_answer(kind), _ctx(first))
    out = ahead.head + b"".join(ahead.strip(c) for c in chunks)
    events = [e for e in out.replace(b"\r\n", b"\n").split(b"\n\n") if e]
    assert events[-1] == DONE.strip()
    return [json.loads(e.split(b"data: ", 1)[1]) for e in events[:-1]]


def _text(kind: str, events: list[dict[str, Any]]) -> str:
    if kind == "responses":
        return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    if kind == "chat":
        return "".join(
            e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]
        )
    return "".join(e["choices"][0]["text"] for e in events if e["choices"])


@pytest.mark.parametrize("kind", ["completions", "chat", "responses"])
@pytest.mark.parametrize("repeats", [True, False], ids=["repeats", "does-not-repeat"])
def test_the_client_sees_one_stream(kind: str, repeats: bool) -> None:
    events = _client_sees(
        kind, "He", _worker_stream(kind, ["llo", " world"], "He" if repeats else None)
    )
    assert _text(kind, events) == "Hello world"
    if kind == "responses":
        # one opening, every id the head's, numbered in order (when the worker repeats the
        # token, as TensorRT-LLM's and ours do: the numbers after it are the worker's)
        numbers = [e["sequence_number"] for e in events]
        assert numbers == list(range(len(events))) if repeats else sorted(numbers) == numbers
        assert [e["type"] for e in events].count("response.created") == 1
        assert {e["response"]["id"] for e in events if "response" in e} == {"resp_ctx"}
        assert {e["item_id"] for e in events if "item_id" in e} == {"msg_ctx"}
        assert events[-1]["response"]["output"][0]["id"] == "msg_ctx"
    else:
        assert {e["id"] for e in events} == {
            "cmpl-ctx" if kind == "completions" else "chatcmpl-ctx"
        }
    if kind == "chat":
        roles = [e for e in events if e["choices"] and "role" in e["choices"][0]["delta"]]
        assert len(roles) == 1 and events[0] is roles[0]
        assert events[1]["choices"][0]["delta"] == {"content": "He"}  # the token, at once


def test_a_worker_chunk_longer_than_the_sent_text_is_cut() -> None:
    # the first token's text and the next in one event
    events = _client_sees("completions", "He", _worker_stream("completions", ["Hello", "!"], None))
    assert _text("completions", events) == "Hello!"
    assert [e["choices"][0]["text"] for e in events[:3]] == ["He", "llo", "!"]


def test_a_first_token_with_no_text_yet() -> None:
    # a token that is half of a UTF-8 character: the client gets only the opening
    ahead = Ahead(ENDPOINTS["chat"], _context_answer("chat"), _ctx(""))
    assert ahead.head.count(b"data: ") == 1
    events = _client_sees("chat", "", _worker_stream("chat", ["\u00e9", "t\u00e9"], None))
    assert _text("chat", events) == "\u00e9t\u00e9"


def test_several_events_in_one_chunk_and_crlf() -> None:
    chunks = _worker_stream("completions", ["a", "b"], "Z")
    joined = b"".join(chunks).replace(b"\n\n", b"\r\n\r\n")
    events = _client_sees("completions", "Z", [joined])
    assert _text("completions", events) == "Zab"


def test_after_the_repeat_bytes_pass_unparsed() -> None:
    ahead = Ahead(ENDPOINTS["completions"], _context_answer("completions"), _ctx("A"))
    chunks = _worker_stream("completions", ["B"], "A")
    assert ahead.strip(chunks[0]) == b""  # the repeated token
    assert not ahead._skipping
    # a later chunk that is not even JSON goes through (its ids rewritten)
    assert ahead.strip(b'data: {"id":"cmpl-gen",broken\n\n') == b'data: {"id":"cmpl-ctx",broken\n\n'


def test_an_error_event_first_passes_whole() -> None:
    ahead = Ahead(ENDPOINTS["chat"], _context_answer("chat"), _ctx("Hi"))
    error = b'data: {"error":{"message":"engine error","type":"server_error"}}\n\n'
    assert ahead.strip(error) == error
    assert ahead.strip(DONE) == DONE


def test_tokens_sent_are_kept() -> None:
    assert Ahead(ENDPOINTS["chat"], _context_answer("chat"), _ctx("x")).tokens == [7]


@pytest.mark.parametrize(
    ("body", "ahead"),
    [
        ({}, True),
        ({"n": 1}, True),
        ({"n": 2}, False),
        ({"logprobs": 2}, False),
        ({"logprobs": True, "top_logprobs": 3}, False),
        ({"logprobs": False}, True),
        ({"echo": True}, False),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, False),
    ],
)
def test_which_streams_go_ahead(body: dict[str, Any], ahead: bool) -> None:
    assert ENDPOINTS["chat"].streams_ahead({"model": "tiny", **body}) is ahead
