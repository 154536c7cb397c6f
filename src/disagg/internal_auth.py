"""Internal authentication between the orchestrator and workers, and between workers, with
one shared key (`internal_auth_key`). Pure: signing and checking only, no I/O.

Requests: the sender adds `x-disagg-auth-timestamp` (unix seconds), `x-disagg-auth-nonce`
(random, the request's id for replay checks) and `x-disagg-auth-signature: v1=<hex>`, an
HMAC-SHA256 over `canonical()`: method, path with query, timestamp, nonce and the body's
SHA-256, one a line. The body digest covers everything the body names (disagg_request_id,
the opaque state, ...). A receiver refuses a request older or newer than its window and a
nonce it saw within the window. TensorRT-LLM workers get their own header as well
(`trtllm_auth_header`). Opaque states are sealed by `seal` and checked by `unseal`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from disagg.errors import Unauthorized

if TYPE_CHECKING:
    from disagg.config import ClusterConfig

TIMESTAMP_HEADER = "x-disagg-auth-timestamp"
NONCE_HEADER = "x-disagg-auth-nonce"
SIGNATURE_HEADER = "x-disagg-auth-signature"
TRTLLM_HEADER = "x-trtllm-disagg-auth"
_VERSION = "v1"
_REQUEST_DOMAIN = b"disagg-request-v1"  # no signature of one kind passes for another
_SEAL_DOMAIN = b"disagg-sealed-v1\n"
_NONCE = re.compile(r"[A-Za-z0-9_-]{16,64}")
_SIGNATURE = re.compile(r"v1=([0-9a-f]{64})")
_HEX64 = re.compile(r"[0-9a-f]{64}")
MAX_NONCES = 100_000  # ~10 MB; past it the oldest go and requests as old are refused


def canonical(method: str, path: str, timestamp: str, nonce: str, body: bytes) -> bytes:
    """What a request's signature covers. `path` includes the query string, as sent."""
    digest = hashlib.sha256(body).hexdigest()
    parts = [method.upper(), path, timestamp, nonce, digest]
    return _REQUEST_DOMAIN + b"\n" + "\n".join(parts).encode()


def _mac(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def path_of(url: str) -> str:
    """The path and query a server sees for `url` (what `Signer.for_url` signs)."""
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


class Signer:
    """Signs outgoing requests with the shared key."""

    def __init__(self, key: bytes, clock: Callable[[], float] = time.time) -> None:
        if not key:
            raise ValueError("an internal auth key must not be empty")
        self._key, self._clock = key, clock

    def headers(self, method: str, path: str, body: bytes) -> dict[str, str]:
        timestamp, nonce = f"{self._clock():.3f}", secrets.token_hex(16)
        signature = _mac(self._key, canonical(method, path, timestamp, nonce, body))
        return {
            TIMESTAMP_HEADER: timestamp,
            NONCE_HEADER: nonce,
            SIGNATURE_HEADER: f"{_VERSION}={signature}",
        }

    def for_url(self, method: str, url: str, body: bytes) -> dict[str, str]:
        return self.headers(method, path_of(url), body)

    def trtllm(self, disaggregated_params: Any) -> dict[str, str]:
        """TensorRT-LLM's header for a leg whose params carry its protected fields (a
        generation leg naming its KV); empty for other legs."""
        if not isinstance(disaggregated_params, Mapping):
            return {}
        state = disaggregated_params.get("encoded_opaque_state")
        endpoint = disaggregated_params.get("ctx_info_endpoint")
        if state is None and endpoint is None:
            return {}
        return {TRTLLM_HEADER: trtllm_auth_header(self._key, endpoint, state)}

    def seal(self, text: str) -> str:
        return seal(self._key, text)


def signer_for(config: ClusterConfig) -> Signer | None:
    """The orchestrator's signer; None (nothing signed) when no internal key is configured."""
    key = config.secrets.internal_auth_key
    return Signer(key) if key else None


def trtllm_auth_header(key: bytes, ctx_info_endpoint: Any, encoded_opaque_state: Any) -> str:
    """`sha256=<hex>`: HMAC-SHA256 over TensorRT-LLM's canonical JSON of the two fields
    (sorted keys, compact; a list of endpoints counts as its first)."""
    if isinstance(ctx_info_endpoint, list):
        ctx_info_endpoint = ctx_info_endpoint[0] if ctx_info_endpoint else None
    payload = {"ctx_info_endpoint": ctx_info_endpoint, "encoded_opaque_state": encoded_opaque_state}
    message = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return "sha256=" + _mac(key, message)


def seal(key: bytes, text: str) -> str:
    """`text` (no `.` in it, e.g. base64) with its signature: `<text>.<hex>`."""
    return f"{text}.{_mac(key, _SEAL_DOMAIN + text.encode())}"


def unseal(key: bytes | None, token: str, what: str) -> str:
    """The text a `seal` signed. With no key, whatever `token` holds (signed or not)."""
    text, dot, signature = token.rpartition(".")
    if not dot:
        text = token
    if key is None:
        return text
    if not dot:
        raise Unauthorized(f"{what} is not signed; this worker needs signed ones", code="unsigned")
    expected = _mac(key, _SEAL_DOMAIN + text.encode())
    if not _HEX64.fullmatch(signature) or not hmac.compare_digest(signature, expected):
        raise Unauthorized(
            f"{what} has a bad signature (forged, altered or signed with another key)",
            code="invalid_signature",
        )
    return text


class Verifier:
    """Checks incoming requests: signature, timestamp within `window_s`, fresh nonce."""

    def __init__(
        self,
        key: bytes,
        window_s: float,
        clock: Callable[[], float] = time.time,
        max_nonces: int = MAX_NONCES,
    ) -> None:
        if not key:
            raise ValueError("an internal auth key must not be empty")
        self._key, self.window_s, self._clock = key, window_s, clock
        self.max_nonces = max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> its timestamp
        self._floor = -math.inf  # requests this old or older are refused (nonces evicted)
        self.refused = 0  # requests refused so far (a worker's /stats shows it)

    def check(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> None:
        """Return if the request is authentic, fresh and new; else raise `Unauthorized`."""
        try:
            self._check(method, path, headers, body)
        except Unauthorized:
            self.refused += 1
            raise

    def _check(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> None:
        timestamp, nonce, signature = _read_headers(headers)
        expected = _mac(self._key, canonical(method, path, timestamp, nonce, body))
        if not hmac.compare_digest(signature, expected):
            raise Unauthorized(
                "internal auth signature does not match: wrong key, or the method, path,"
                " body, timestamp or nonce were altered",
                code="invalid_signature",
            )
        self._check_time(float(timestamp))
        self._remember(nonce, float(timestamp))

    def _check_time(self, ts: float) -> None:
        age = self._clock() - ts
        if abs(age) > self.window_s:
            when = f"{age:.1f} s old" if age > 0 else f"{-age:.1f} s in the future"
            raise Unauthorized(
                f"internal auth timestamp is {when}; signed requests are valid for"
                f" {self.window_s:g} s (are the clocks synchronized?)",
                code="stale_timestamp",
            )
        if ts <= self._floor:
            raise Unauthorized(
                "internal auth timestamp is older than the replay memory reaches; resend",
                code="stale_timestamp",
            )

    def _remember(self, nonce: str, ts: float) -> None:
        # Only authentic, fresh requests get here, so nobody can fill the memory for free.
        if nonce in self._seen:
            raise Unauthorized(
                "internal auth nonce already used: a replayed request", code="replayed_request"
            )
        horizon = self._clock() - self.window_s
        while self._seen and next(iter(self._seen.values())) < horizon:
            self._seen.popitem(last=False)  # a replay of it is refused as stale anyway
        while len(self._seen) >= self.max_nonces:
            _, old = self._seen.popitem(last=False)
            self._floor = max(self._floor, old)  # its replay is refused by the floor
        self._seen[nonce] = ts

    def __len__(self) -> int:
        """How many nonces are remembered."""
        return len(self._seen)


def _read_headers(headers: Mapping[str, str]) -> tuple[str, str, str]:
    """The three auth headers, checked for shape (the signature as bare hex)."""
    names = (TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER)
    values = [headers.get(h) for h in names]
    missing = [h for h, v in zip(names, values, strict=True) if not v]
    if missing:
        raise Unauthorized(
            "missing internal authentication (" + ", ".join(missing) + "): this worker takes"
            " only requests signed with the cluster's internal auth key",
            code="missing_signature",
        )
    timestamp, nonce, signature = (str(v) for v in values)
    try:
        ts_ok = math.isfinite(float(timestamp)) and len(timestamp) <= 32
    except ValueError:
        ts_ok = False
    if not ts_ok:
        raise Unauthorized(f"malformed {TIMESTAMP_HEADER}", code="malformed_signature")
    if not _NONCE.fullmatch(nonce):
        raise Unauthorized(f"malformed {NONCE_HEADER}", code="malformed_signature")
    match = _SIGNATURE.fullmatch(signature)
    if match is None:
        raise Unauthorized(
            f"malformed {SIGNATURE_HEADER}: expected v1=<64 hex digits>",
            code="malformed_signature",
        )
    return timestamp, nonce, match.group(1)
