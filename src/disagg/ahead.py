"""Streams whose first token goes to the client ahead of their generation leg.

A context leg answers with the request's first token. A streaming client can have it at
once, before the generation leg is sent, has pulled the KV and is scheduled (on a GPU
cluster the KV transfer alone takes milliseconds). The orchestrator writes the stream's
opening events and that token in the client's shape (`Ahead.head`), then relays the
generation worker's stream without what the client already has: the worker's own opening
events and the first token's text, which the worker sends again (`first_gen_tokens` are the
start of its output). Ids in the worker's events (the response's, the Responses API's output
item's) are rewritten to the head's, so the client sees one stream.

Only the leading events are parsed; once the sent text is accounted for, the bytes pass
unparsed but for the id rewrite (a bytes replace of the quoted id). A worker that does not
send the first tokens again loses nothing: text that does not start with what was sent is
kept whole (a Responses stream's `sequence_number`s, the worker's, then repeat one number).

Streams that ask for what the context answer may not carry in the same shape (log
probabilities, several choices, an echoed prompt, tools) are not sent ahead
(`Endpoint.streams_ahead`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from disagg.endpoints import ContextOutcome, Endpoint

_json = msgspec.json.Encoder()
_decode = msgspec.json.Decoder()


class Ahead:
    """What went to the client from the context leg, and the filter that keeps the
    generation worker's stream from sending it twice."""

    def __init__(self, endpoint: Endpoint, resp: dict[str, Any], ctx: ContextOutcome) -> None:
        """`resp`: the context leg's answer; `ctx`: what the orchestrator read from it."""
        self.endpoint = endpoint
        shape, events = endpoint.stream_head(resp, ctx)
        self.head = b"".join(events)
        self.tokens: list[int] = list(ctx.params.get("first_gen_tokens") or [])
        self._ids = endpoint.stream_ids(shape)
        self._left: str = ctx.text  # sent text the worker's stream has not repeated yet
        self._skipping = True
        self._swaps: list[tuple[bytes, bytes]] = []

    def strip(self, chunk: bytes) -> bytes:
        """A chunk of whole SSE events from the generation worker, as the client gets it."""
        if self._skipping:
            chunk = self._skip(chunk)
        for old, new in self._swaps:
            chunk = chunk.replace(old, new)
        return chunk

    def _skip(self, chunk: bytes) -> bytes:
        sep = b"\r\n\r\n" if b"\r\n\r\n" in chunk else b"\n\n"
        kept: list[bytes] = []
        for event in chunk.split(sep):
            if self._skipping and event:
                kept_event = self._event(event)
                if kept_event is not None:
                    kept.append(kept_event)
            else:
                kept.append(event)
        return sep.join(kept)

    def _event(self, event: bytes) -> bytes | None:
        """One event while skipping: itself, rewritten, or None (the client has it)."""
        at = event.find(b"data:")
        obj: Any = None
        if at >= 0:
            try:
                obj = _decode.decode(event[at + 5 :])
            except msgspec.DecodeError:  # [DONE], or not JSON
                obj = None
        if not isinstance(obj, dict):
            self._skipping = False
            return event
        self._learn_ids(obj)
        text = self.endpoint.event_text(obj)
        if text is None:  # an event of any other kind: the worker repeats no more
            self._skipping = False
            return event
        if self._left.startswith(text):  # opening events ("") and repeated text
            self._left = self._left[len(text) :]
            if text and not self._left:
                self._skipping = False
            return None
        self._skipping = False
        if not self._left or not text.startswith(self._left):
            return event  # new text: this worker does not repeat what was sent
        self.endpoint.set_event_text(obj, text[len(self._left) :])
        self._left = ""
        return event[:at] + b"data: " + _json.encode(obj)

    def _learn_ids(self, obj: dict[str, Any]) -> None:
        for name, value in self.endpoint.event_ids(obj).items():
            head = self._ids.get(name)
            if head is None or value == head or not isinstance(value, str):
                continue
            old = _json.encode(value)
            if all(old != swap[0] for swap in self._swaps):
                self._swaps.append((old, _json.encode(head)))
