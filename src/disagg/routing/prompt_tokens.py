"""The prompt's token ids and block hashes as the worker will see them, for cache-aware
routing: the same prompt construction as the reference worker (chat template included),
with its byte tokenizer, or a local Hugging Face checkpoint's tokenizer.json.

A prompt it cannot read gives no hashes (the worker answers the client's error); it never
rejects a request itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disagg.engine.kv_cache import block_hashes
from disagg.engine.requests import prompt_ids
from disagg.engine.tokenizer import ByteTokenizer, Tokenizer
from disagg.errors import DisaggError


class PromptHasher:
    def __init__(self, tokenizer: Tokenizer, block_size: int) -> None:
        self.tokenizer, self.block_size = tokenizer, block_size

    @classmethod
    def named(cls, name: str, block_size: int) -> PromptHasher:
        """`tiny` (the reference worker's byte tokenizer) or a local checkpoint directory."""
        if name == "tiny":
            return cls(ByteTokenizer(), block_size)
        from disagg.engine.checkpoint import load_tokenizer

        path = Path(name)
        raw = json.loads((path / "config.json").read_text())
        return cls(load_tokenizer(path, raw), block_size)

    def ids(self, request: Any) -> list[int] | None:
        try:
            return prompt_ids(request, self.tokenizer)
        except (DisaggError, AttributeError, TypeError, ValueError):
            return None

    def hashes(self, ids: list[int]) -> tuple[int, ...]:
        """Chained hashes of the full blocks of all prompt tokens but the last (the worker
        always computes the last one, so it is never a cache hit)."""
        return tuple(block_hashes(ids[:-1], self.block_size))
