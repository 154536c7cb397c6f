"""Workloads of `disagg bench`: seeded, deterministic streams of request bodies for the
completions, chat and responses endpoints, parsed from spec strings such as
`fixed:in=128,out=32`. Prompts are counted in characters: the reference model's tokenizer is
byte-level, so N characters are N tokens. Builds bodies only; sending them is the runner's.
"""

from __future__ import annotations

import itertools
import random
import string
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec

Endpoint = Literal["completions", "chat", "responses"]
PATHS: dict[Endpoint, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
}
_ENDPOINT_OF = {path: endpoint for endpoint, path in PATHS.items()}
_PROMPT_KEYS: dict[Endpoint, str] = {
    "completions": "prompt",
    "chat": "messages",
    "responses": "input",
}
_LETTERS = string.ascii_lowercase + " " * 5  # about one space in six: word-like text


class WorkloadError(ValueError):
    """A workload spec or JSONL file that cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class Request:
    """One request to send: the path under the target (`/v1/completions`) and its body,
    without `stream` (the runner sets it)."""

    path: str
    body: dict[str, Any]


class Workload(Protocol):
    @property
    def spec(self) -> str:
        """The spec string this workload is parsed from, every parameter spelled out."""
        ...

    def requests(self, endpoint: Endpoint, model: str, seed: int) -> Iterator[Request]:
        """An endless stream of requests, the same for the same arguments."""
        ...


def text(rng: random.Random, n: int) -> str:
    """n characters of word-like lowercase text."""
    return "".join(rng.choices(_LETTERS, k=n))


def single_turn(endpoint: Endpoint, model: str, prompt: str, max_tokens: int) -> Request:
    """A one-prompt request; `ignore_eos` so the answer has exactly `max_tokens` tokens."""
    body: dict[str, Any] = {"model": model}
    if endpoint == "completions":
        body.update(prompt=prompt, max_tokens=max_tokens)
    elif endpoint == "chat":
        body.update(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens)
    else:
        body.update(input=prompt, max_output_tokens=max_tokens)
    body["ignore_eos"] = True
    return Request(PATHS[endpoint], body)


@dataclass(frozen=True)
class Fixed:
    """Every prompt `in` characters, every answer `out` tokens."""

    in_: int = 128
    out: int = 32

    @property
    def spec(self) -> str:
        return f"fixed:in={self.in_},out={self.out}"

    def requests(self, endpoint: Endpoint, model: str, seed: int) -> Iterator[Request]:
        rng = random.Random(seed)
        while True:
            yield single_turn(endpoint, model, text(rng, self.in_), self.out)


@dataclass(frozen=True)
class Mix:
    """Long and short prompts: each request is long with probability `long_share`."""

    long: int = 2048
    short: int = 128
    long_share: float = 0.2
    out: int = 32

    @property
    def spec(self) -> str:
        return (
            f"mix:long={self.long},short={self.short},long_share={self.long_share},out={self.out}"
        )

    def requests(self, endpoint: Endpoint, model: str, seed: int) -> Iterator[Request]:
        rng = random.Random(seed)
        while True:
            n = self.long if rng.random() < self.long_share else self.short
            yield single_turn(endpoint, model, text(rng, n), self.out)


@dataclass(frozen=True)
class SharedPrefix:
    """Multi-turn chats, each on one of `systems` system prompts of `system_len` characters;
    turn t's conversation is turn t-1's plus a stand-in answer of `out` characters and a new
    user message of `user_len`, so every turn's prompt starts with the one before it. Chats
    come in groups of `systems` (one per system prompt), turn by turn within a group, so a
    chat's next turn is sent `systems` requests after its previous one."""

    systems: int = 8
    turns: int = 4
    system_len: int = 1024
    user_len: int = 64
    out: int = 32

    @property
    def spec(self) -> str:
        return (
            f"shared-prefix:systems={self.systems},turns={self.turns},"
            f"system_len={self.system_len},user_len={self.user_len},out={self.out}"
        )

    def requests(self, endpoint: Endpoint, model: str, seed: int) -> Iterator[Request]:
        rng = random.Random(seed)
        prompts = [text(rng, self.system_len) for _ in range(self.systems)]
        while True:
            chats = [[{"role": "system", "content": p}] for p in prompts]
            for turn in range(self.turns):
                for chat in chats:
                    if turn:
                        chat.append({"role": "assistant", "content": text(rng, self.out)})
                    chat.append({"role": "user", "content": text(rng, self.user_len)})
                    yield self._request(endpoint, model, chat)

    def _request(self, endpoint: Endpoint, model: str, chat: list[dict[str, str]]) -> Request:
        if endpoint == "completions":
            return single_turn(endpoint, model, "\n".join(m["content"] for m in chat), self.out)
        request = single_turn(endpoint, model, "", self.out)
        request.body[_PROMPT_KEYS[endpoint]] = [dict(m) for m in chat]
        return request


@dataclass(frozen=True)
class Jsonl:
    """Requests read from a file, one JSON object a line, sent in file order and again from
    the top when the run wants more. A line is a body for its endpoint (`messages`: chat,
    `input`: responses, else the run's endpoint), or `{"prompt": ..., "max_tokens": ...}`,
    fitted to the endpoint; a `path` key (`/v1/chat/completions`) picks the endpoint."""

    path: str
    lines: tuple[tuple[str | None, dict[str, Any]], ...]  # (path given or None, body)

    @property
    def spec(self) -> str:
        return f"jsonl:{self.path}"

    def requests(self, endpoint: Endpoint, model: str, seed: int) -> Iterator[Request]:
        for path, body in itertools.cycle(self.lines):
            yield fit(path, body, endpoint, model)


def fit(path: str | None, body: dict[str, Any], endpoint: Endpoint, model: str) -> Request:
    """A JSONL line as a request: to `path`, else to the endpoint its body is for (else
    `endpoint`); a bare `prompt` rewritten for chat and responses; `model` filled in."""
    if path is not None:
        endpoint = _ENDPOINT_OF[path]
    elif "messages" in body:
        endpoint = "chat"
    elif "input" in body:
        endpoint = "responses"
    body = {"model": model, **body}
    key = _PROMPT_KEYS[endpoint]
    if key not in body:
        prompt = body.pop("prompt")
        body[key] = [{"role": "user", "content": prompt}] if endpoint == "chat" else prompt
        if endpoint == "responses" and "max_tokens" in body:
            body["max_output_tokens"] = body.pop("max_tokens")
    return Request(PATHS[endpoint], body)


def read_jsonl(path: str) -> Jsonl:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise WorkloadError(f"jsonl: cannot read {path}: {exc.strerror or exc}") from None
    lines = []
    for number, line in enumerate(raw.splitlines(), 1):
        if line.strip():
            lines.append(_line(line, f"{path}:{number}"))
    if not lines:
        raise WorkloadError(f"jsonl: {path} has no requests")
    return Jsonl(path, tuple(lines))


def _line(line: bytes, where: str) -> tuple[str | None, dict[str, Any]]:
    try:
        body = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise WorkloadError(f"{where}: not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise WorkloadError(f"{where}: expected a JSON object (a request body)")
    path = body.pop("path", None)
    if path is not None and path not in _ENDPOINT_OF:
        raise WorkloadError(f"{where}: `path` must be one of {', '.join(_ENDPOINT_OF)}")
    if not any(key in body for key in ("prompt", "messages", "input")):
        raise WorkloadError(f"{where}: a body needs `prompt`, `messages` or `input`")
    needs = _PROMPT_KEYS[_ENDPOINT_OF[path]] if path else None
    if needs and needs not in body and not isinstance(body.get("prompt"), str):
        raise WorkloadError(f"{where}: a body for {path} needs `{needs}` (or a string `prompt`)")
    if "prompt" in body and not isinstance(body["prompt"], str | list):
        raise WorkloadError(f"{where}: `prompt` must be a string or a list")
    for key in ("max_tokens", "max_output_tokens"):
        value = body.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise WorkloadError(f"{where}: `{key}` must be a positive integer")
    return path, body


_KINDS: dict[str, type[Fixed] | type[Mix] | type[SharedPrefix]] = {
    "fixed": Fixed,
    "mix": Mix,
    "shared-prefix": SharedPrefix,
}


def parse_workload(spec: str) -> Workload:
    """`fixed:in=128,out=32`, `mix:long=2048,short=128,long_share=0.2,out=32`,
    `shared-prefix:systems=8,turns=4,system_len=1024,out=32` or `jsonl:PATH`; a kind alone
    takes its defaults."""
    kind, _, params = spec.partition(":")
    if kind == "jsonl":
        if not params:
            raise WorkloadError("jsonl: needs a path, as in jsonl:requests.jsonl")
        return read_jsonl(params)
    cls = _KINDS.get(kind)
    if cls is None:
        kinds = ", ".join([*_KINDS, "jsonl"])
        raise WorkloadError(f"unknown workload {kind!r}; one of {kinds} (as in {Fixed().spec})")
    return cls(**_params(cls, kind, params))


def _params(cls: type, kind: str, params: str) -> dict[str, Any]:
    types = {f.name.rstrip("_"): (f.name, f.type) for f in fields(cls)}
    out: dict[str, Any] = {}
    for item in filter(None, params.split(",")):
        key, eq, value = item.partition("=")
        if key not in types or not eq:
            raise WorkloadError(f"{kind}: expected key=value with keys {', '.join(types)}")
        name, kind_of = types[key]
        out[name] = _number(kind, key, value, float if kind_of == "float" else int)
    _check(kind, out)
    return out


def _number(kind: str, key: str, value: str, as_type: type[int] | type[float]) -> int | float:
    try:
        number = as_type(value)
    except ValueError:
        raise WorkloadError(f"{kind}: {key}={value!r} is not {as_type.__name__}") from None
    if number < (0 if as_type is float else 1):
        raise WorkloadError(f"{kind}: {key} must be at least {0 if as_type is float else 1}")
    return number


def _check(kind: str, params: dict[str, Any]) -> None:
    share = params.get("long_share")
    if share is not None and share > 1:
        raise WorkloadError(f"{kind}: long_share must be between 0 and 1")
