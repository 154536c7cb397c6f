"""KV transfer between reference workers: the opaque state and the binary block format.

The context worker describes where its pinned KV lives, and until when, in
`encoded_opaque_state` (base64 of JSON, sealed with the internal auth key when the cluster has
one: `<base64>.<hmac>`, so nobody can point a generation worker elsewhere); the generation
worker pulls the blocks over HTTP as one binary body: a 4-byte
big-endian header length, a JSON header (shape, dtype, num_tokens, and for a push the handoff's
`meta`) and the raw array.
No I/O here: encoding, decoding and checks only.
"""

from __future__ import annotations

import base64
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from disagg.internal_auth import seal, unseal


class TransferError(ValueError):
    """A malformed opaque state or KV payload."""


class StateExpired(TransferError):
    """The opaque state's KV lease is over: its KV is gone (or about to be)."""


class OpaqueState(msgspec.Struct, frozen=True):
    endpoint: str  # base URL of the context worker that holds the KV
    ctx_request_id: int
    num_tokens: int
    block_size: int
    dtype: str
    layout: tuple[int, int, int]  # (num_layers, num_kv_heads, head_dim)
    # unix time the KV lease ends; 0: unknown (a state from a worker before leases were told)
    expires_at: float = 0.0

    def encode(self, key: bytes | None = None) -> str:
        text = base64.b64encode(msgspec.json.encode(self)).decode()
        return seal(key, text) if key else text

    @classmethod
    def decode(cls, text: str, key: bytes | None = None, now: float | None = None) -> OpaqueState:
        """The state in `text`: with a `key` only a state sealed with it (else
        `Unauthorized`, before anything is decoded); `StateExpired` past its lease."""
        raw = unseal(key, text, "encoded_opaque_state")
        try:
            state = msgspec.json.decode(base64.b64decode(raw, validate=True), type=cls)
        except (ValueError, msgspec.DecodeError) as exc:
            raise TransferError(f"invalid encoded_opaque_state: {exc}") from None
        now = time.time() if now is None else now
        if state.expires_at and now > state.expires_at:
            raise StateExpired(
                f"encoded_opaque_state expired {now - state.expires_at:.1f} s ago: the context"
                " worker's KV lease is over"
            )
        return state


@dataclass(frozen=True)
class KVPayload:
    data: np.ndarray  # (num_layers, 2, n_blocks, block_size, num_kv_heads, head_dim)
    num_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)  # what a pushed handoff carries

    def to_bytes(self) -> bytes:
        header: dict[str, Any] = {
            "shape": list(self.data.shape),
            "dtype": str(self.data.dtype),
            "num_tokens": self.num_tokens,
        }
        if self.meta:
            header["meta"] = self.meta
        raw = msgspec.json.encode(header)
        return struct.pack(">I", len(raw)) + raw + np.ascontiguousarray(self.data).tobytes()

    @classmethod
    def from_bytes(cls, body: bytes, expect: OpaqueState) -> KVPayload:
        if len(body) < 4:
            raise TransferError("KV payload truncated")
        (n,) = struct.unpack(">I", body[:4])
        try:
            header: dict[str, Any] = msgspec.json.decode(body[4 : 4 + n])
            shape = tuple(int(x) for x in header["shape"])
            dtype = np.dtype(header["dtype"])
            num_tokens, meta = int(header["num_tokens"]), header.get("meta") or {}
            if not isinstance(meta, dict):
                raise TypeError("meta must be an object")
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"bad KV payload header: {exc}") from None
        layers, kvh, hd = expect.layout
        if len(shape) != 6 or (shape[0], shape[1], shape[3], shape[4], shape[5]) != (
            layers,
            2,
            expect.block_size,
            kvh,
            hd,
        ):
            raise TransferError(f"KV payload shape {shape} does not match the expected layout")
        if dtype != np.dtype(expect.dtype):
            raise TransferError(f"KV payload dtype {dtype} != expected {expect.dtype}")
        raw = body[4 + n :]
        if len(raw) != int(np.prod(shape)) * dtype.itemsize:
            raise TransferError("KV payload size does not match its shape")
        return cls(np.frombuffer(raw, dtype=dtype).reshape(shape), num_tokens, meta)
