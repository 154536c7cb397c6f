"""Tokenizers for the reference worker: bytes, Hugging Face ``tokenizer.json``, streaming decode.

Owns text <-> token id conversion and the simple chat template. It must not import ``tokenizers``
at module import time (the package works without it) and never adds BOS itself in ``encode``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Tokenizer",
    "render_chat",
]


class Tokenizer(Protocol):
    """What the worker needs from a tokenizer."""

    bos_id: int | None
    eos_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS=256, EOS=257, PAD=258."""

    def __init__(self) -> None:
        self.bos_id: int | None = 256
        self.eos_id: int | None = 257
        self.pad_id: int = 258
        self.vocab_size: int = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")


def _config_token(config: Mapping[str, Any], key: str) -> str | None:
    """``tokenizer_config.json`` stores special tokens as a string or an AddedToken dict."""
    value = config.get(key)
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (via the ``tokenizers`` package).

    BOS/EOS come from the explicit arguments, else ``tokenizer_config.json`` next to the file,
    else well-known special-token names present in the vocabulary, else ``None``.
    """

    def __init__(
        self, path: str | Path, bos_id: int | None = None, eos_id: int | None = None
    ) -> None:
        from tokenizers import Tokenizer as _HFTok  # lazy: optional dependency

        path = Path(path)
        self._tok: Any = _HFTok.from_file(str(path))
        self.vocab_size: int = int(self._tok.get_vocab_size(with_added_tokens=True))
        config: dict[str, Any] = {}
        config_path = path.parent / "tokenizer_config.json"
        if config_path.is_file():
            loaded = json.loads(config_path.read_text(encoding="utf-8"))
            config = loaded if isinstance(loaded, dict) else {}
        self.bos_id: int | None = bos_id if bos_id is not None else self._find(config, "bos_token")
        self.eos_id: int | None = eos_id if eos_id is not None else self._find(config, "eos_token")

    def _find(self, config: Mapping[str, Any], key: str) -> int | None:
        named = _config_token(config, key)
        names = (
            (named,) if named is not None else (_BOS_NAMES if key == "bos_token" else _EOS_NAMES)
        )
        for name in names:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return int(tid)
        return None

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._tok.encode(text, add_special_tokens=False).ids]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=True))


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text pieces.

    Decodes a short window (the previously emitted tokens plus the pending ones) rather than the
    whole sequence, so each step is O(window) and tokenizers that strip a leading space off the
    first token still render the space of later tokens. Text whose tail is an incomplete UTF-8
    sequence (decoded as U+FFFD) is held back until a later token completes it or ``flush``.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window (already emitted tokens)
        self._read = 0  # end of the emitted tokens

    def feed(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(int(token_id))
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        text = self._tokenizer.decode(self._ids[self._prefix :])
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Return whatever is still held back (incomplete characters render as U+FFFD)."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        text = self._tokenizer.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text) :]


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, Mapping) and part.get("type", "text") == "text":
            parts.append(str(part.get("text") or ""))
    return "".join(parts)


def render_chat(messages: Sequence[Mapping[str, Any]]) -> str:
    """The worker's chat template: ``<|role|>\\n{content}\\n`` per message, then the reply cue."""
    out = [f"<|{m.get('role') or 'user'}|>\n{_content_text(m.get('content'))}\n" for m in messages]
    out.append("<|assistant|>\n")
    return "".join(out)
