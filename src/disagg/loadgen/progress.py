"""The live one-line progress of a load run on a terminal: requests done (of how many),
errors, the rate over the last ~2 s and the time elapsed, redrawn about 4 times a second
and cleared at the end. Counts what it is told; it sends nothing.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import TextIO

_CLEAR = "\r\x1b[K"
_WINDOW_S = 2.0


def progress_stream(stream: TextIO, *, force: bool = False) -> TextIO | None:
    """`stream` when it is a terminal (or `force`), else None: no progress line."""
    isatty = getattr(stream, "isatty", None)
    return stream if force or (isatty is not None and isatty()) else None


class Progress:
    """`async with Progress(stream, "c=8", total=200, duration_s=None) as p:` and
    `p.record(ok)` as each request ends; `line()` is what it draws."""

    def __init__(
        self,
        stream: TextIO,
        label: str,
        total: int | None,
        duration_s: float | None,
        interval_s: float = 0.25,
    ) -> None:
        self.stream, self.label, self.total, self.duration_s = stream, label, total, duration_s
        self.interval_s = interval_s
        self.done = self.errors = 0
        self.start = time.monotonic()
        self._recent: collections.deque[float] = collections.deque()
        self._task: asyncio.Task[None] | None = None

    def record(self, ok: bool) -> None:
        self.done += 1
        self.errors += not ok
        self._recent.append(time.monotonic())

    def rate(self, now: float) -> float:
        """Requests a second over the last ~2 s."""
        while self._recent and self._recent[0] < now - _WINDOW_S:
            self._recent.popleft()
        span = min(_WINDOW_S, now - self.start)
        return len(self._recent) / span if span > 0 else 0.0

    def line(self) -> str:
        now = time.monotonic()
        elapsed = now - self.start
        done = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
        clock = f"{elapsed:.1f}/{self.duration_s:g} s" if self.duration_s else f"{elapsed:.1f} s"
        return (
            f"{self.label}  {done} requests  {self.errors} errors  "
            f"{self.rate(now):.1f} req/s  {clock}"
        )

    async def _draw(self) -> None:
        while True:
            self.stream.write(_CLEAR + self.line())
            self.stream.flush()
            await asyncio.sleep(self.interval_s)

    async def __aenter__(self) -> Progress:
        self.start = time.monotonic()
        self._task = asyncio.create_task(self._draw())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # the drawing task ends; our caller goes on
        self.stream.write(_CLEAR)
        self.stream.flush()
