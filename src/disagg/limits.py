"""Bounds on what one client request may ask for, each from config with a default: prompt
tokens, output tokens, messages, stop strings, and `n`. A violation is a 400 that names the
parameter; the request never reaches a worker. Checks only: no I/O, no routing.
"""

from __future__ import annotations

from typing import Any

from disagg.config import ClusterConfig
from disagg.endpoints import Endpoint
from disagg.errors import InvalidRequest


class Limits:
    def __init__(self, config: ClusterConfig) -> None:
        self.max_prompt_tokens = config.max_prompt_tokens
        self.max_tokens = config.max_tokens_limit
        self.max_messages = config.max_messages
        self.max_stops = config.max_stop_sequences
        self.max_stop_length = config.max_stop_length

    def check(self, body: dict[str, Any], endpoint: Endpoint, prompt_tokens: int | None) -> None:
        """`body` already has the endpoint's types (a validated request); `prompt_tokens` as
        the router's tokenizer counts them (None when it could not read the prompt: the
        worker then answers the client's error)."""
        self._budget(body, endpoint)
        if body.get("n", 1) != 1:
            raise InvalidRequest("only n=1 is supported", param="n")
        self._messages(body, endpoint)
        self._stops(body.get("stop"))
        if prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            raise InvalidRequest(
                f"the prompt has {prompt_tokens} tokens; this server takes at most"
                f" {self.max_prompt_tokens}",
                param=endpoint.prompt_key,
                code="context_length_exceeded",
            )

    def _budget(self, body: dict[str, Any], endpoint: Endpoint) -> None:
        for key in endpoint.max_tokens_keys:
            value = body.get(key)
            if isinstance(value, int) and value > self.max_tokens:
                raise InvalidRequest(f"`{key}` must be at most {self.max_tokens}", param=key)
            if value == 0:
                raise InvalidRequest(f"`{key}` must be at least 1", param=key)

    def _messages(self, body: dict[str, Any], endpoint: Endpoint) -> None:
        key = endpoint.prompt_key
        items = body.get(key)
        if (
            key in ("messages", "input")
            and isinstance(items, list)
            and len(items) > self.max_messages
        ):
            raise InvalidRequest(
                f"`{key}` has {len(items)} items; at most {self.max_messages} are allowed",
                param=key,
            )

    def _stops(self, stop: Any) -> None:
        # validated as str | list[str] where the endpoint has `stop`; elsewhere it is an
        # unknown field, passed on, bounded all the same
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        if len(stops) > self.max_stops:
            raise InvalidRequest(
                f"`stop` has {len(stops)} strings; at most {self.max_stops} are allowed",
                param="stop",
            )
        if any(isinstance(s, str) and len(s) > self.max_stop_length for s in stops):
            raise InvalidRequest(
                f"a `stop` string is longer than {self.max_stop_length} characters",
                param="stop",
            )
