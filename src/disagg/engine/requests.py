"""How the reference worker reads an OpenAI request: prompt token ids, sampling, leg type.

Turns a validated request into what the scheduler runs. No I/O and no HTTP here.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from disagg.engine.scheduler import SamplingParams
from disagg.engine.tokenizer import Tokenizer, render_chat
from disagg.errors import InvalidRequest
from disagg.formats import ChatShape, CompletionShape, ResponsesShape, Shape
from disagg.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DisaggregatedParams,
    ResponsesRequest,
)

DEFAULT_MAX_TOKENS = {"completions": 16, "chat": 256, "responses": 256}


@dataclass(frozen=True)
class Job:
    """One request as the engine sees it."""

    kind: str  # "completions" | "chat" | "responses"
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    shape: Shape
    disagg: DisaggregatedParams


def _prompt_ids(tok: Tokenizer, text: str) -> list[int]:
    ids = tok.encode(text)
    return [tok.bos_id, *ids] if tok.bos_id is not None else ids


def _completion_prompt(tok: Tokenizer, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return _prompt_ids(tok, prompt)
    if len(prompt) == 1 and not isinstance(prompt[0], int):
        return _completion_prompt(tok, prompt[0])
    if all(isinstance(x, int) for x in prompt):
        return list(prompt)
    raise InvalidRequest(
        "batched prompts are not supported; send one prompt per request", param="prompt"
    )


def _responses_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    for item in req.input:
        content = item.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequest(
                "input item `content` must be a string or a list of parts", param="input"
            )
        if isinstance(content, list):
            content = [
                {"type": "text", "text": p.get("text", "")} for p in content if isinstance(p, dict)
            ]
        messages.append({"role": str(item.get("role", "user")), "content": content})
    return messages


def _sampling(req: Any, max_tokens: int, stop: Any) -> SamplingParams:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=getattr(req, "top_k", None) or 0,
        seed=getattr(req, "seed", None),
        stop=stops,
        ignore_eos=bool(getattr(req, "ignore_eos", False)),
    )


def prompt_ids(req: Any, tok: Tokenizer) -> list[int]:
    """The prompt's token ids as the worker computes them (chat template included); the
    orchestrator uses the same function to hash prompts for cache-aware routing."""
    if isinstance(req, CompletionRequest):
        return _completion_prompt(tok, req.prompt)
    if isinstance(req, ChatCompletionRequest):
        return req.prompt_token_ids or _prompt_ids(
            tok, render_chat([{"role": m.role, "content": m.content} for m in req.messages])
        )
    assert isinstance(req, ResponsesRequest)
    return req.prompt_token_ids or _prompt_ids(tok, render_chat(_responses_messages(req)))


def build_job(kind: str, req: Any, tok: Tokenizer, model_name: str, max_len: int) -> Job:
    """Read `req` (a validated request of endpoint `kind`) into a Job."""
    rid_prefix = {"completions": "cmpl-", "chat": "chatcmpl-", "responses": "resp_"}[kind]
    rid = rid_prefix + uuid.uuid4().hex
    created = int(time.time())
    shape: Shape
    ids = prompt_ids(req, tok)
    if isinstance(req, CompletionRequest):
        budget, stop, shape = req.max_tokens, req.stop, CompletionShape(rid, model_name, created)
    elif isinstance(req, ChatCompletionRequest):
        budget, stop, shape = req.token_budget(), req.stop, ChatShape(rid, model_name, created)
    else:
        budget, stop, shape = req.max_output_tokens, None, ResponsesShape(rid, model_name, created)
    if getattr(req, "n", 1) != 1:
        raise InvalidRequest("only n=1 is supported", param="n")
    if not ids:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if any(not 0 <= t < tok.vocab_size for t in ids):
        raise InvalidRequest("prompt token id out of the vocabulary", param="prompt")
    room = max_len - len(ids)
    if room <= 0:
        raise InvalidRequest(
            f"the prompt has {len(ids)} tokens; this model's limit is {max_len}", param="prompt"
        )
    max_tokens = DEFAULT_MAX_TOKENS[kind] if budget is None else budget
    if max_tokens > room:
        raise InvalidRequest(
            f"max_tokens={max_tokens} plus the prompt's {len(ids)} tokens exceeds this model's"
            f" context length of {max_len}",
            param="max_tokens",
        )
    if max_tokens == 0:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    opts = getattr(req, "stream_options", None)
    return Job(
        kind,
        ids,
        _sampling(req, max_tokens, stop),
        bool(req.stream),
        bool(opts and opts.include_usage),
        shape,
        req.disaggregated_params or DisaggregatedParams(),
    )
