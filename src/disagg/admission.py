"""Admission: how many client requests the orchestrator serves at once, a bounded FIFO queue
for the rest, and the count that graceful drain waits on.

A request holds a slot from admission until its answer (or stream) is over. Beyond
`max_concurrent` it waits in line, at most `max_queued` deep and at most `queue_timeout_s`;
past either it gets 429 with `Retry-After`. It never places or sends anything.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import AsyncIterator

from disagg.errors import TooManyRequests


class Admission:
    def __init__(self, max_concurrent: int = 0, max_queued: int = 0, queue_timeout_s: float = 0):
        self.max_concurrent = max_concurrent  # 0: no limit
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._idle = asyncio.Event()
        self._idle.set()
        self.last_wait_s = 0.0  # the latest admitted request's queue wait

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        """Hold a slot for the body of the `async with`; yields the seconds spent queued."""
        waited = await self._acquire()
        try:
            yield waited
        finally:
            self._release()

    async def _acquire(self) -> float:
        if not self.max_concurrent or (self.active < self.max_concurrent and not self._waiters):
            self._take()
            return 0.0
        if len(self._waiters) >= self.max_queued:
            raise TooManyRequests(
                f"the server is at capacity ({self.active} requests running,"
                f" {len(self._waiters)} queued)",
                self._retry_after(),
                "queue_full",
            )
        start = time.monotonic()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await fut  # _release hands the slot over: `active` already counts us
        except BaseException as exc:
            if fut.done() and not fut.cancelled():
                self._release()  # handed a slot as the wait ended: pass it on
            if isinstance(exc, TimeoutError):
                raise TooManyRequests(
                    f"no capacity within {self.queue_timeout_s:g} s (queue timeout)",
                    self._retry_after(),
                    "queue_timeout",
                ) from None
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(fut)
        self.last_wait_s = time.monotonic() - start
        return self.last_wait_s

    def _take(self) -> None:
        self.active += 1
        self._idle.clear()

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to the waiter; `active` stays
                return
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    def _retry_after(self) -> int:
        return max(1, math.ceil(self.queue_timeout_s))

    async def idle(self) -> None:
        """Return once no request holds a slot."""
        await self._idle.wait()
