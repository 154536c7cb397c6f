"""Each worker's clock offset, estimated NTP-style from the legs themselves: the orchestrator
sent at t1 and heard back at t4 (its steady clock); the worker read the request at t2 and
answered at t3 (its wall clock). offset = ((t2 - t1) + (t3 - t4)) / 2, wrong by at most
half the round trip delay (t4 - t1) - (t3 - t2); of a worker's last samples, the one with
the least delay wins (NTP's clock filter). It estimates; it never touches a request.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

SAMPLES = 8  # per worker
_SLACK_S = 0.002  # how far a worker's own span may exceed the round trip (clock resolution)


@dataclass(frozen=True)
class Sample:
    offset: float  # worker wall clock minus orchestrator steady clock, seconds
    delay: float  # round trip minus the worker's own time, seconds


def sample(t1: float, t2: float, t3: float, t4: float) -> Sample | None:
    """One exchange's estimate; None when the times cannot be one exchange (the worker's
    span is longer than the round trip that contained it)."""
    delay = (t4 - t1) - (t3 - t2)
    if t4 < t1 or t3 < t2 or delay < -_SLACK_S:
        return None
    return Sample(((t2 - t1) + (t3 - t4)) / 2, max(delay, 0.0))


class ClockOffsets:
    def __init__(self) -> None:
        self._samples: dict[str, deque[Sample]] = {}

    def add(self, worker: str, s: Sample) -> None:
        self._samples.setdefault(worker, deque(maxlen=SAMPLES)).append(s)

    def best(self, worker: str) -> Sample | None:
        samples = self._samples.get(worker)
        return min(samples, key=lambda s: s.delay) if samples else None

    def to_local(self, worker: str, t: float) -> float | None:
        """A worker's wall-clock time on the orchestrator's steady clock."""
        best = self.best(worker)
        return None if best is None else t - best.offset

    def wall_offset(self, worker: str) -> float | None:
        """How far the worker's wall clock is ahead of the orchestrator's, in seconds."""
        best = self.best(worker)
        return None if best is None else best.offset - (time.time() - time.monotonic())

    def forget(self, keep: set[str]) -> None:
        """Drop the workers that left the cluster."""
        for url in set(self._samples) - keep:
            del self._samples[url]
