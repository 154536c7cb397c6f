"""Who may call the orchestrator: client API keys (`Authorization: Bearer <key>`) for the
OpenAI endpoints and a separate admin key for the operator's views (/metrics, /cluster_info).

Keys are compared as SHA-256 digests with `hmac.compare_digest`, against every configured key
without stopping at the first match, so neither a key's content nor which key matched shows
in the timing. A presented key is never logged or echoed. Checks only: no routing, no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

from disagg.errors import Unauthorized


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer(headers: Mapping[str, str]) -> str | None:
    """The key of an `Authorization: Bearer <key>` header (also `x-api-key`), else None."""
    value = headers.get("Authorization", "")
    scheme, _, key = value.partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return key.strip()
    return headers.get("x-api-key") or None


class ClientAuth:
    def __init__(self, api_keys: Iterable[str] = (), admin_key: str | None = None) -> None:
        self._clients = [_digest(k) for k in api_keys]
        self._admin = _digest(admin_key) if admin_key else None

    @property
    def clients_need_keys(self) -> bool:
        return bool(self._clients)

    @property
    def admin_needs_key(self) -> bool:
        return self._admin is not None

    def check_client(self, headers: Mapping[str, str]) -> None:
        """An OpenAI endpoint: any client key (or the admin key) when keys are configured."""
        if not self._clients:
            return
        presented = bearer(headers)
        if presented is None:
            raise Unauthorized(
                "Missing API key: send it as `Authorization: Bearer <key>`.",
                code="missing_api_key",
            )
        digest, found = _digest(presented), False
        for known in [*self._clients, *([self._admin] if self._admin else [])]:
            found |= hmac.compare_digest(digest, known)
        if not found:
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")

    def check_admin(self, headers: Mapping[str, str]) -> None:
        """An operator's view: the admin key when one is configured (else open)."""
        if self._admin is None:
            return
        presented = bearer(headers)
        if presented is None or not hmac.compare_digest(_digest(presented), self._admin):
            raise Unauthorized(
                "This endpoint needs the admin key: `Authorization: Bearer <admin key>`.",
                code="invalid_api_key",
            )

    def is_admin(self, headers: Mapping[str, str]) -> bool:
        presented = bearer(headers)
        return (
            self._admin is not None
            and presented is not None
            and hmac.compare_digest(_digest(presented), self._admin)
        )
