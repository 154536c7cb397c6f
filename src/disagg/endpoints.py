"""How each OpenAI endpoint is split into a context and a generation leg and glued back.

One small class per endpoint: build the context request, read the context answer, build the
generation request, and turn a context answer that already finished into the client's
answer. Pure data transformation; no I/O, no placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

from disagg.formats import DONE, ChatShape, CompletionShape, ResponsesShape, Shape
from disagg.protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from disagg.protocol import usage as make_usage

# finish reasons by which a context_only answer says a generation leg must follow; "length"
# only counts when the client's own budget is not used up (TensorRT-LLM workers say "length"
# for a context leg that stopped after its first token).
UNFINISHED = frozenset({"not_finished", "length"})


def _finished(reason: str, generated: int, budget: int | None) -> bool:
    if reason not in UNFINISHED:
        return True
    return reason == "length" and budget is not None and generated >= budget


@dataclass(frozen=True)
class ContextOutcome:
    finished: bool
    params: dict[str, Any]
    prompt_token_ids: list[int]
    usage: dict[str, Any]  # chat/completions shape
    text: str
    finish_reason: str


class Endpoint:
    path: ClassVar[str]
    request_type: ClassVar[type[Any]]
    shape_type: ClassVar[type]
    max_tokens_keys: ClassVar[tuple[str, ...]] = ("max_tokens",)
    prompt_key: ClassVar[str] = "prompt"

    def context_request(
        self, body: dict[str, Any], disagg_id: int, push: tuple[str, int] | None = None
    ) -> dict[str, Any]:
        """`push`: generation_first's waiting generation worker and its slot id, where the
        context worker sends the KV itself."""
        req = {k: v for k, v in body.items() if k != "stream_options"}
        req["stream"] = False
        params: dict[str, Any] = {"request_type": "context_only", "disagg_request_id": disagg_id}
        if push is not None:
            params["schedule_style"] = "generation_first"
            params["gen_info_endpoint"], params["gen_request_id"] = push
        req["disaggregated_params"] = params
        return req

    def generation_first_request(self, body: dict[str, Any], slot: int) -> dict[str, Any]:
        """A generation leg sent before its context leg is done: the client's request, to
        wait on the worker under `slot` for its KV and first tokens."""
        req = dict(body)
        req["disaggregated_params"] = {
            "request_type": "generation_only",
            "schedule_style": "generation_first",
            "disagg_request_id": slot,
        }
        return req

    def generation_request(
        self, body: dict[str, Any], ctx: ContextOutcome, disagg_id: int
    ) -> dict[str, Any]:
        req = dict(body)
        self._set_prompt(req, ctx.prompt_token_ids)
        p = ctx.params
        req["disaggregated_params"] = {
            "request_type": "generation_only",
            "disagg_request_id": disagg_id,
            "ctx_request_id": p.get("ctx_request_id"),
            "first_gen_tokens": p.get("first_gen_tokens"),
            "encoded_opaque_state": p.get("encoded_opaque_state"),
            "draft_tokens": p.get("draft_tokens"),
            "ctx_usage": ctx.usage,
        }
        return {k: v for k, v in req.items() if v is not None}

    def _set_prompt(self, req: dict[str, Any], ids: list[int]) -> None:
        req["prompt_token_ids"] = ids

    def budget(self, body: dict[str, Any]) -> int | None:
        """The client's output token budget, when it set one."""
        for key in self.max_tokens_keys:
            if isinstance(body.get(key), int):
                return int(body[key])
        return None

    def expected_tokens(self, body: dict[str, Any], prompt_tokens: int | None = None) -> int:
        """A leg's expected token work for load-aware routing: the prompt's tokens (before
        any worker tokenized it, ~4 bytes of its JSON per token, or a token-id list's
        length) plus the output budget (256 when the client set none)."""
        if prompt_tokens is None:
            prompt = body.get(self.prompt_key)
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                prompt_tokens = len(prompt)
            else:
                prompt_tokens = len(msgspec.json.encode(prompt)) // 4 + 1
        return prompt_tokens + (self.budget(body) or 256)

    def outcome(self, resp: dict[str, Any], budget: int | None) -> ContextOutcome:
        choice = (resp.get("choices") or [{}])[0]
        reason = choice.get("finish_reason") or "stop"
        generated = int((resp.get("usage") or {}).get("completion_tokens", 1))
        return ContextOutcome(
            finished=_finished(reason, generated, budget),
            params=choice.get("disaggregated_params") or {},
            prompt_token_ids=list(resp.get("prompt_token_ids") or []),
            usage=resp.get("usage") or make_usage(0, 0, 0),
            text=self._text(choice),
            finish_reason=reason,
        )

    def _text(self, choice: dict[str, Any]) -> str:
        return str(choice.get("text") or "")

    def clean(self, resp: dict[str, Any], ctx: ContextOutcome | None) -> dict[str, Any]:
        """The answer as the client gets it: internal fields gone, usage over both legs."""
        resp.pop("prompt_token_ids", None)
        for choice in resp.get("choices") or ():
            choice.pop("disaggregated_params", None)
        if ctx is not None and isinstance(resp.get("usage"), dict):
            completion = int(resp["usage"].get("completion_tokens", 0))
            resp["usage"] = _merged(ctx.usage, completion)
        return resp

    def shape(self, resp: dict[str, Any]) -> Shape:
        rid = str(resp.get("id") or "")
        shape: Shape = self.shape_type(rid, str(resp.get("model", "")), resp.get("created"))
        return shape

    # -- streams whose first token went ahead (see `disagg.ahead`) ---------------------------

    def streams_ahead(self, body: dict[str, Any]) -> bool:
        """Whether a stream's first token may go to the client from the context answer: not
        when the client asks for what that answer may not carry in the stream's shape (log
        probabilities, several choices, the prompt echoed) or for tools (a worker may turn
        its output into tool calls)."""
        return (
            body.get("n") in (None, 1)
            and not body.get("logprobs")
            and not body.get("top_logprobs")
            and not body.get("echo")
            and not body.get("tools")
        )

    def stream_head(self, resp: dict[str, Any], ctx: ContextOutcome) -> tuple[Shape, list[bytes]]:
        """The start of the client's stream from a context answer: its opening events and the
        context leg's text, and the shape that goes on from there."""
        shape = self.shape(resp)
        out = shape.stream_start()
        if ctx.text:
            out.append(shape.stream_delta(ctx.text))
        return shape, out

    def stream_ids(self, shape: Shape) -> dict[str, str]:
        """The ids a stream of `shape` names its events by."""
        return {"id": str(getattr(shape, "rid", ""))}

    def event_ids(self, event: dict[str, Any]) -> dict[str, Any]:
        """The ids in one event of a worker's stream, by the names of `stream_ids`."""
        return {"id": event.get("id")}

    def event_text(self, event: dict[str, Any]) -> str | None:
        """The text one event of a worker's stream adds: "" for an event that only opens the
        stream, None for any other kind (an end, usage, an error)."""
        choice = _only_choice(event)
        if choice is None or "text" not in choice:
            return None
        return str(choice["text"] or "")

    def set_event_text(self, event: dict[str, Any], text: str) -> None:
        event["choices"][0]["text"] = text

    def finished_stream(
        self, resp: dict[str, Any], ctx: ContextOutcome, include_usage: bool
    ) -> list[bytes]:
        """A finished context answer as the stream the client asked for."""
        shape, out = self.stream_head(resp, ctx)
        out += shape.stream_end(
            ctx.text, ctx.finish_reason, _merged(ctx.usage, None) if include_usage else None
        )
        out.append(DONE)
        return out


def _only_choice(event: dict[str, Any]) -> dict[str, Any] | None:
    """A stream event's single choice while it is not finished."""
    choices = event.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice: dict[str, Any] = choices[0]
    return choice if choice.get("finish_reason") is None else None


def _merged(ctx_usage: dict[str, Any], completion_tokens: int | None) -> dict[str, Any]:
    prompt = int(ctx_usage.get("prompt_tokens", 0))
    cached = int((ctx_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    done = (
        int(ctx_usage.get("completion_tokens", 0))
        if completion_tokens is None
        else (completion_tokens)
    )
    return make_usage(prompt, done, cached)


class Completions(Endpoint):
    path = "/v1/completions"
    request_type = CompletionRequest
    shape_type = CompletionShape

    def _set_prompt(self, req: dict[str, Any], ids: list[int]) -> None:
        req["prompt"] = ids


class Chat(Endpoint):
    path = "/v1/chat/completions"
    request_type = ChatCompletionRequest
    shape_type = ChatShape
    # the worker honours max_completion_tokens over the deprecated max_tokens; so do we
    max_tokens_keys = ("max_completion_tokens", "max_tokens")
    prompt_key = "messages"

    def _text(self, choice: dict[str, Any]) -> str:
        return str((choice.get("message") or {}).get("content") or "")

    def event_text(self, event: dict[str, Any]) -> str | None:
        choice = _only_choice(event)
        delta = None if choice is None else choice.get("delta")
        if not isinstance(delta, dict) or not set(delta) <= {"role", "content"}:
            return None  # tool calls, reasoning, refusals: not plain text
        return str(delta.get("content") or "")

    def set_event_text(self, event: dict[str, Any], text: str) -> None:
        event["choices"][0]["delta"]["content"] = text


class Responses(Endpoint):
    path = "/v1/responses"
    request_type = ResponsesRequest
    shape_type = ResponsesShape
    max_tokens_keys = ("max_output_tokens",)
    prompt_key = "input"

    def context_request(
        self, body: dict[str, Any], disagg_id: int, push: tuple[str, int] | None = None
    ) -> dict[str, Any]:
        req = super().context_request(body, disagg_id, push)
        req.pop("stream_options", None)
        return req

    def outcome(self, resp: dict[str, Any], budget: int | None) -> ContextOutcome:
        status = resp.get("status")
        reason = (resp.get("incomplete_details") or {}).get("reason")
        finish = (
            "not_finished"
            if status == "in_progress"
            else ("length" if reason == "max_output_tokens" else "stop")
        )
        u = resp.get("usage") or {}
        cached = (u.get("input_tokens_details") or {}).get("cached_tokens", 0)
        return ContextOutcome(
            finished=_finished(finish, int(u.get("output_tokens", 1)), budget),
            params=resp.get("disaggregated_params") or {},
            prompt_token_ids=list(resp.get("prompt_token_ids") or []),
            usage=make_usage(
                int(u.get("input_tokens", 0)), int(u.get("output_tokens", 0)), int(cached)
            ),
            text="".join(
                part.get("text", "")
                for item in resp.get("output") or ()
                for part in item.get("content") or ()
            ),
            finish_reason=finish,
        )

    def clean(self, resp: dict[str, Any], ctx: ContextOutcome | None) -> dict[str, Any]:
        resp.pop("prompt_token_ids", None)
        resp.pop("disaggregated_params", None)
        u = resp.get("usage")
        if ctx is not None and isinstance(u, dict):
            p = ctx.usage
            u["input_tokens"] = p["prompt_tokens"]
            u["total_tokens"] = p["prompt_tokens"] + int(u.get("output_tokens", 0))
            u["input_tokens_details"] = {
                "cached_tokens": (p.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            }
        return resp

    def shape(self, resp: dict[str, Any]) -> Shape:
        return ResponsesShape(
            str(resp.get("id") or ""), str(resp.get("model", "")), resp.get("created_at")
        )

    def stream_ids(self, shape: Shape) -> dict[str, str]:
        assert isinstance(shape, ResponsesShape)
        return {"id": shape.rid, "item": shape.msg_id}

    def event_ids(self, event: dict[str, Any]) -> dict[str, Any]:
        kind = event.get("type")
        if kind in ("response.created", "response.in_progress"):
            return {"id": (event.get("response") or {}).get("id")}
        if kind == "response.output_item.added":
            return {"item": (event.get("item") or {}).get("id")}
        return {"item": event.get("item_id")}

    def event_text(self, event: dict[str, Any]) -> str | None:
        kind = event.get("type")
        if kind in _RESPONSES_OPENING:
            return ""
        if kind == "response.output_text.delta":
            return str(event.get("delta") or "")
        return None

    def set_event_text(self, event: dict[str, Any], text: str) -> None:
        event["delta"] = text


_RESPONSES_OPENING = frozenset(
    {
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    }
)

ENDPOINTS: dict[str, Endpoint] = {
    "completions": Completions(),
    "chat": Chat(),
    "responses": Responses(),
}
