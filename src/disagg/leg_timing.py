"""A worker's timing of one leg, on the wire: asked for with the request header
`x-disagg-return-timing: 1`, answered in the response header `x-disagg-leg-timing` (whole
answers) or as a last named SSE event `disagg.leg_timing` before `data: [DONE]` (streams).

Times are the worker's wall clock in Unix seconds; the orchestrator maps them onto its own
clock (see `clock_offsets`). This module owns the format and its checks, nothing else: a
malformed report is refused here (`None`), and its caller carries on without it.
"""

from __future__ import annotations

import math

import msgspec

REQUEST_HEADER = "x-disagg-return-timing"
RESPONSE_HEADER = "x-disagg-leg-timing"
EVENT = "disagg.leg_timing"
EVENT_PREFIX = b"event: " + EVENT.encode()
HEADER_BUDGET = 1024  # bytes; a report that would not fit sends only its core


class LegTiming(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """One leg as its worker saw it. `received` and `responded` bracket the worker's part of
    the exchange the orchestrator timed: request read, and response headers (a stream) or
    the whole answer written; they give the clock offset. The rest are optional steps."""

    received: float
    responded: float
    scheduled: float | None = None  # admitted to the running batch
    first_token: float | None = None  # a context leg: its prefill is done
    last_token: float | None = None
    kv_transfer_start: float | None = None  # generation legs: the KV moved in
    kv_transfer_end: float | None = None
    kv_transfer_bytes: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def steps(self) -> dict[str, float]:
        """The optional steps that happened, by name."""
        names = ("scheduled", "first_token", "last_token", "kv_transfer_start", "kv_transfer_end")
        return {n: v for n in names if (v := getattr(self, n)) is not None}


_CORE = ("received", "responded", "scheduled", "first_token")


def encode_header(timing: LegTiming) -> str:
    raw = msgspec.json.encode(timing)
    if len(raw) > HEADER_BUDGET:
        raw = msgspec.json.encode({k: getattr(timing, k) for k in _CORE})
    return raw.decode()


def encode_event(timing: LegTiming) -> bytes:
    return EVENT_PREFIX + b"\ndata: " + msgspec.json.encode(timing) + b"\n\n"


def decode(raw: bytes | str) -> LegTiming | None:
    """A report, or None when it is malformed: not the format, a time that is not finite,
    steps out of order, or negative counts."""
    try:
        timing = msgspec.json.decode(raw, type=LegTiming)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    times = [timing.received, *timing.steps().values(), timing.responded]
    if not all(math.isfinite(t) for t in times):
        return None
    if timing.responded < timing.received or any(t < timing.received for t in times):
        return None
    start, end = timing.kv_transfer_start, timing.kv_transfer_end
    if start is not None and end is not None and end < start:
        return None
    if min(timing.kv_transfer_bytes, timing.prompt_tokens, timing.cached_tokens) < 0:
        return None
    return timing


def split_event(chunk: bytes) -> tuple[bytes, bytes | None]:
    """`chunk` (whole SSE events) without the timing event, and that event's data if it
    was there."""
    at = chunk.find(EVENT_PREFIX)
    if at < 0 or (at > 0 and chunk[at - 1 : at] != b"\n"):
        return chunk, None
    end = chunk.find(b"\n\n", at)
    end = len(chunk) if end < 0 else end + 2
    event = chunk[at:end]
    data = b"".join(
        line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")
    )
    return chunk[:at] + chunk[end:], data
