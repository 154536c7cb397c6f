"""How each endpoint's request is split into legs and glued back (no I/O)."""

from __future__ import annotations

from disagg.endpoints import ENDPOINTS, ContextOutcome


def _ctx(finished: bool = False) -> ContextOutcome:
    params = {
        "ctx_request_id": 7,
        "first_gen_tokens": [65],
        "encoded_opaque_state": "c3Rh",
        "draft_tokens": None,
    }
    usage = {
        "prompt_tokens": 10,
        "completion_tokens": 1,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    return ContextOutcome(finished, params, [256, 1, 2], usage, "A", "not_finished")


def test_context_request_is_unstreamed_context_only() -> None:
    body = {
        "model": "m",
        "prompt": "p",
        "stream": True,
        "stream_options": {"include_usage": 1},
        "max_tokens": 5,
        "my_extra_param": {"kept": True},
    }
    req = ENDPOINTS["completions"].context_request(body, 42)
    assert req["stream"] is False and "stream_options" not in req
    assert req["disaggregated_params"] == {"request_type": "context_only", "disagg_request_id": 42}
    assert req["max_tokens"] == 5 and req["my_extra_param"] == {"kept": True}
    assert body["stream"] is True  # the client's body is not modified


def test_generation_request_carries_handoff() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "top_k": 3,
    }
    req = ENDPOINTS["chat"].generation_request(body, _ctx(), 43)
    p = req["disaggregated_params"]
    assert p["request_type"] == "generation_only" and p["ctx_request_id"] == 7
    assert p["first_gen_tokens"] == [65] and p["encoded_opaque_state"] == "c3Rh"
    assert p["ctx_usage"]["prompt_tokens"] == 10
    assert req["prompt_token_ids"] == [256, 1, 2] and req["stream"] is True and req["top_k"] == 3
    comp = ENDPOINTS["completions"].generation_request({"model": "m", "prompt": "x"}, _ctx(), 1)
    assert comp["prompt"] == [256, 1, 2]


def test_outcome_length_is_finished_only_when_budget_spent() -> None:
    resp = {
        "choices": [
            {"text": "A", "finish_reason": "length", "disaggregated_params": {"ctx_request_id": 1}}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        "prompt_token_ids": [1],
    }
    ep = ENDPOINTS["completions"]
    assert ep.outcome(resp, 1).finished
    assert not ep.outcome(resp, 5).finished
    resp["choices"][0]["finish_reason"] = "stop"
    assert ep.outcome(resp, 5).finished


def test_clean_merges_usage_and_strips_internals() -> None:
    resp = {
        "choices": [{"text": "AB", "finish_reason": "length", "disaggregated_params": {"x": 1}}],
        "prompt_token_ids": [1],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    out = ENDPOINTS["completions"].clean(resp, _ctx())
    assert "prompt_token_ids" not in out and "disaggregated_params" not in out["choices"][0]
    assert out["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_expected_tokens_for_load_aware_routing() -> None:
    comp, chat = ENDPOINTS["completions"], ENDPOINTS["chat"]
    assert comp.expected_tokens({"prompt": [1, 2, 3], "max_tokens": 10}) == 13
    assert comp.expected_tokens({"prompt": "x" * 398, "max_tokens": 10}) == 100 + 1 + 10
    assert comp.expected_tokens({"prompt": "hi"}) == 2 + 256  # no budget: 256 expected
    body = {"messages": [{"role": "user", "content": "y" * 1000}], "max_completion_tokens": 5}
    long_chat = chat.expected_tokens(body)
    assert long_chat > chat.expected_tokens({**body, "messages": []})
    assert chat.expected_tokens(body, prompt_tokens=40) == 45  # the real length, once known
