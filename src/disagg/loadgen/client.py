"""One request of the load generator: send a body, read the answer whole or as SSE, and time
it. Kept cheap so the load generator is never the bottleneck: SSE is split on blank lines and
only `data:` lines are decoded, into small msgspec Structs. A failed request never raises; it
comes back as a Sample whose `error` says what kind of failure it was.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from yarl import URL

ERROR_KINDS = ("http_4xx", "http_5xx", "connect", "timeout", "stream_error", "truncated")
_DETAIL_CHARS = 200


@dataclass(slots=True)
class Sample:
    """One request as the client saw it; times in seconds on `time.perf_counter`."""

    start: float
    end: float = 0.0
    ttft: float | None = None  # after start: first content chunk (a whole answer: its end)
    gaps: list[float] = field(default_factory=list)  # between content chunks
    output_tokens: int = 0
    status: int | None = None
    error: str | None = None  # one of ERROR_KINDS
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    def fail(self, kind: str, detail: object) -> Sample:
        self.end, self.error, self.detail = time.perf_counter(), kind, str(detail)[:_DETAIL_CHARS]
        return self


class _Usage(msgspec.Struct):
    completion_tokens: int | None = None
    output_tokens: int | None = None  # responses

    def tokens(self) -> int | None:
        return self.completion_tokens if self.completion_tokens is not None else self.output_tokens


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None  # completions
    delta: _Delta | None = None  # chat


class _Response(msgspec.Struct):
    usage: _Usage | None = None


class _Event(msgspec.Struct):
    """The fields of a chunk, an answer or a responses event that timing needs."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None
    type: str | None = None  # responses events
    delta: str | None = None  # responses: response.output_text.delta
    response: _Response | None = None  # responses: response.completed

    def has_content(self) -> bool:
        if self.delta and self.type == "response.output_text.delta":
            return True
        return any(c.text or (c.delta and c.delta.content) for c in self.choices or ())

    def tokens(self) -> int | None:
        usage = self.usage or (self.response.usage if self.response else None)
        return usage.tokens() if usage else None

    def failed(self) -> bool:
        return self.error is not None or self.type in ("error", "response.failed")


_decode = msgspec.json.Decoder(_Event).decode


async def send(
    session: aiohttp.ClientSession,
    url: URL | str,
    body: bytes,
    headers: dict[str, str],
    stream: bool,
    timeout_s: float,
) -> Sample:
    """POST `body` to `url` and time the answer (an SSE stream when `stream`)."""
    sample = Sample(time.perf_counter())
    try:
        async with (
            asyncio.timeout(timeout_s),
            session.post(url, data=body, headers=headers) as resp,
        ):
            sample.status = resp.status
            if resp.status >= 400:
                kind = "http_4xx" if resp.status < 500 else "http_5xx"
                return sample.fail(kind, (await resp.read()).decode(errors="replace"))
            return await (_read_stream(resp, sample) if stream else _read_whole(resp, sample))
    except TimeoutError:
        return sample.fail("timeout", f"no complete answer within {timeout_s} s")
    except aiohttp.ClientConnectorError as exc:
        return sample.fail("connect", exc)
    except (aiohttp.ClientError, OSError) as exc:  # dropped before the answer was complete
        return sample.fail("truncated", repr(exc))


async def _read_whole(resp: aiohttp.ClientResponse, sample: Sample) -> Sample:
    raw = await resp.read()
    try:
        event = _decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return sample.fail("truncated", f"answer is not a complete JSON object: {exc}")
    sample.end = time.perf_counter()
    sample.ttft = sample.end - sample.start
    sample.output_tokens = event.tokens() or 0
    return sample


async def _read_stream(resp: aiohttp.ClientResponse, sample: Sample) -> Sample:
    state = _Stream(sample)
    buffer = b""
    try:
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            *events, buffer = (buffer + chunk).split(b"\n\n")
            for event in events:
                state.event(event, now)
    except (aiohttp.ClientError, OSError) as exc:
        return sample.fail("truncated", repr(exc))
    return state.finish()


class _Stream:
    """What the SSE events of one answer have shown so far."""

    def __init__(self, sample: Sample) -> None:
        self.sample = sample
        self.last: float | None = None  # the last content chunk
        self.chunks = 0
        self.tokens: int | None = None  # from usage
        self.done = False
        self.error: str | None = None

    def event(self, raw: bytes, now: float) -> None:
        for line in raw.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                continue
            try:
                event = _decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.error = self.error or f"unreadable SSE data: {exc}"
                continue
            self._event(event, data, now)

    def _event(self, event: _Event, data: bytes, now: float) -> None:
        if event.failed():
            self.error = self.error or data.decode(errors="replace")
        if event.has_content():
            self.chunks += 1
            if self.last is None:
                self.sample.ttft = now - self.sample.start
            else:
                self.sample.gaps.append(now - self.last)
            self.last = now
        tokens = event.tokens()
        if tokens is not None:
            self.tokens = tokens

    def finish(self) -> Sample:
        sample = self.sample
        if self.error is not None:
            return sample.fail("stream_error", self.error)
        if not self.done:
            return sample.fail("truncated", "the stream ended without data: [DONE]")
        sample.end = time.perf_counter()
        sample.output_tokens = self.tokens if self.tokens is not None else self.chunks
        return sample
