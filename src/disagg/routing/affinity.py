"""Conversation (session) affinity: the legs of one conversation go to the worker that served
it before, so its KV cache keeps paying off, while that worker is available and not
overloaded; otherwise (and for requests without a conversation) the least loaded worker,
which becomes the conversation's. The memory of conversations is bounded (LRU). No I/O."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from disagg.cluster import Pool, WorkerState
from disagg.routing import RouteRequest
from disagg.routing.candidates import candidates

DEFAULT_MAX_IMBALANCE = 4  # legs in flight beyond the least loaded worker's
DEFAULT_MAX_CONVERSATIONS = 100_000


class ConversationAffinity:
    def __init__(
        self,
        pool: Pool,
        max_imbalance: int = DEFAULT_MAX_IMBALANCE,
        max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
    ) -> None:
        self.pool = pool
        self.max_imbalance, self.max_conversations = max_imbalance, max_conversations
        self._home: OrderedDict[str, str] = OrderedDict()  # conversation -> worker url
        self._next = 0

    @classmethod
    def from_args(cls, pool: Pool, args: Mapping[str, Any]) -> ConversationAffinity:
        return cls(
            pool,
            int(args.get("max_imbalance", DEFAULT_MAX_IMBALANCE)),
            int(args.get("max_conversations", DEFAULT_MAX_CONVERSATIONS)),
        )

    def pick(self, request: RouteRequest) -> WorkerState:
        ready = candidates(self.pool, request)
        low = min(w.in_flight for w in ready)
        worker = None
        key = request.conversation
        if key is not None and (url := self._home.get(key)) is not None:
            home = next((w for w in ready if w.url == url), None)
            if home is not None and home.in_flight - low <= self.max_imbalance:
                worker = home
        if worker is None:
            least = [w for w in ready if w.in_flight == low]
            worker = least[self._next % len(least)]
            self._next += 1
        if key is not None:
            self._home[key] = worker.url
            self._home.move_to_end(key)
            if len(self._home) > self.max_conversations:
                self._home.popitem(last=False)
        worker.in_flight += 1
        return worker

    def finish(self, worker: WorkerState, request: RouteRequest, success: bool) -> None:
        worker.in_flight -= 1
