"""Generation-first handoffs on a generation worker: a `generation_only` leg that arrives
before its context leg is done (`schedule_style: generation_first`) waits here, its KV blocks
already allocated, until either the context worker pushes the KV (`POST /kv/push`) or the
orchestrator says where to pull it (`POST /kv/handoff`). The one who hands off is answered
only once the waiting leg stored the KV (or failed to), so a context worker frees its copy
only when the KV is safe. Matching and waiting only: no HTTP, no model work.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from disagg.engine.transfer import KVPayload, OpaqueState
from disagg.errors import InvalidRequest


@dataclass
class Handoff:
    """What the context leg produced for a waiting generation leg: its first token(s), the
    prompt it computed (checked against the waiting leg's own), its usage, and the KV itself
    (`payload`, pushed) or where to pull it (`state`)."""

    first_gen_tokens: list[int]
    prompt_token_ids: list[int]
    ctx_usage: dict[str, Any] | None = None
    payload: KVPayload | None = None
    state: OpaqueState | None = None
    arrived: float = field(default_factory=time.perf_counter)  # when its handler began
    # set by the waiting leg once it stored the KV (or with why it could not)
    stored: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Handoffs:
    """Waiting generation-first legs by their `disagg_request_id`."""

    def __init__(self) -> None:
        self._waiting: dict[int, asyncio.Future[Handoff]] = {}

    def open(self, request_id: int) -> asyncio.Future[Handoff]:
        """A leg starts waiting; it must `close` the id when it stops, however it ends."""
        if request_id in self._waiting:
            raise InvalidRequest(
                f"a generation_first leg with disagg_request_id {request_id} already waits",
                param="disaggregated_params",
            )
        fut: asyncio.Future[Handoff] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = fut
        return fut

    def close(self, request_id: int) -> None:
        self._waiting.pop(request_id, None)

    async def deliver(self, request_id: int, handoff: Handoff, timeout_s: float) -> bool:
        """Hand `handoff` to the leg waiting for `request_id` and wait until it stored the
        KV: True then; False when no leg waits (gone, never came, or already handed);
        raises what the leg raised when it could not store it."""
        fut = self._waiting.pop(request_id, None)
        if fut is None or fut.done():
            return False
        fut.set_result(handoff)
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(handoff.stored)
        return True

    def __len__(self) -> int:
        return len(self._waiting)
