"""The OpenAI response and stream shapes of each endpoint, and SSE framing.

Shared by the reference worker (which answers in these shapes) and the orchestrator (which
turns a context leg that already finished into a stream). Pure functions; no I/O.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import msgspec

_json = msgspec.json.Encoder()

DONE = b"data: [DONE]\n\n"


def sse_data(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def sse_event(name: str, obj: Any) -> bytes:
    return b"event: " + name.encode() + b"\n" + sse_data(obj)


class Shape(Protocol):
    """One endpoint's answer: whole (non-streamed) or as stream events."""

    def response(self, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]: ...
    def stream_start(self) -> list[bytes]: ...
    def stream_delta(self, text: str) -> bytes: ...
    def stream_end(
        self, text: str, finish_reason: str, usage: dict[str, Any] | None
    ) -> list[bytes]: ...


class CompletionShape:
    def __init__(self, rid: str, model: str, created: int | None = None) -> None:
        self.rid, self.model, self.created = rid, model, created or int(time.time())

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
        }

    def response(self, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(), "choices": [choice], "usage": usage}

    def stream_start(self) -> list[bytes]:
        return []

    def stream_delta(self, text: str) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        return sse_data({**self._head(), "choices": [choice]})

    def stream_end(
        self, text: str, finish_reason: str, usage: dict[str, Any] | None
    ) -> list[bytes]:
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}
        out = [sse_data({**self._head(), "choices": [choice]})]
        if usage is not None:
            out.append(sse_data({**self._head(), "choices": [], "usage": usage}))
        return out


class ChatShape:
    def __init__(self, rid: str, model: str, created: int | None = None) -> None:
        self.rid, self.model, self.created = rid, model, created or int(time.time())

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return sse_data(
            {
                "id": self.rid,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
            }
        )

    def response(self, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        return {
            "id": self.rid,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }

    def stream_start(self) -> list[bytes]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def stream_delta(self, text: str) -> bytes:
        return self._chunk({"content": text}, None)

    def stream_end(
        self, text: str, finish_reason: str, usage: dict[str, Any] | None
    ) -> list[bytes]:
        out = [self._chunk({}, finish_reason)]
        if usage is not None:
            out.append(
                sse_data(
                    {
                        "id": self.rid,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": usage,
                    }
                )
            )
        return out


def responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "output_tokens": usage["completion_tokens"],
        "total_tokens": usage["total_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens_details": {"reasoning_tokens": 0},
    }


class ResponsesShape:
    """The Responses API: a response object and its typed stream events."""

    def __init__(self, rid: str, model: str, created: int | None = None) -> None:
        self.rid, self.model, self.created = rid, model, created or int(time.time())
        self.msg_id = "msg_" + rid.removeprefix("resp_")
        self._seq = 0

    def _event(self, name: str, **fields: Any) -> bytes:
        obj = {"type": name, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(name, obj)

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = (
            [{"type": "output_text", "text": text, "annotations": []}]
            if status != ("in_progress")
            else []
        )
        return {
            "type": "message",
            "id": self.msg_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def _object(
        self, status: str, output: list[Any], usage: Any, reason: str | None
    ) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": usage,
            "incomplete_details": {"reason": reason} if reason else None,
            "error": None,
        }

    def response(self, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        status, reason = {
            "length": ("incomplete", "max_output_tokens"),
            "not_finished": ("in_progress", None),  # a context_only leg: generation follows
        }.get(finish_reason, ("completed", None))
        item = self._message(text, "incomplete" if status == "incomplete" else "completed")
        return self._object(status, [item], responses_usage(usage), reason)

    def stream_start(self) -> list[bytes]:
        empty = self._object("in_progress", [], None, None)
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._event("response.created", response=empty),
            self._event("response.in_progress", response=empty),
            self._event(
                "response.output_item.added", output_index=0, item=self._message("", "in_progress")
            ),
            self._event(
                "response.content_part.added",
                item_id=self.msg_id,
                output_index=0,
                content_index=0,
                part=part,
            ),
        ]

    def stream_delta(self, text: str) -> bytes:
        return self._event(
            "response.output_text.delta",
            item_id=self.msg_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def stream_end(
        self, text: str, finish_reason: str, usage: dict[str, Any] | None
    ) -> list[bytes]:
        part = {"type": "output_text", "text": text, "annotations": []}
        final = self.response(text, finish_reason, usage or _zero_usage())
        name = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [
            self._event(
                "response.output_text.done",
                item_id=self.msg_id,
                output_index=0,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self._event(
                "response.content_part.done",
                item_id=self.msg_id,
                output_index=0,
                content_index=0,
                part=part,
            ),
            self._event("response.output_item.done", output_index=0, item=final["output"][0]),
            self._event(name, response=final),
        ]


def _zero_usage() -> dict[str, Any]:
    return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
