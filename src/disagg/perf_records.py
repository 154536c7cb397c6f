"""Per-request timing records (`GET /perf_metrics`): for the last N requests, when each
step happened on the orchestrator's steady clock, in ms after the request's arrival, with the
workers that served it. With `request_perf_metrics`, the workers' own steps of each leg (see
`leg_timing`) join them, mapped onto that clock by each worker's estimated offset. A bounded
buffer (TensorRT-LLM's `perf_metrics_max_requests`; 0 keeps none). It records; it never
changes how a request is served.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from disagg import leg_timing
from disagg.clock_offsets import ClockOffsets, sample
from disagg.leg_timing import LegTiming

log = logging.getLogger(__name__)

# The orchestrator's steps, in the order a request passes them (absent when it skipped one).
STEPS = (
    "context_sent",
    "context_first_byte",
    "context_done",
    "generation_sent",
    "generation_accepted",
    "first_token",
    "last_token",
)
# A worker's steps of a leg, as `<leg>_<name>_ms`.
WORKER_STEPS = (
    "received",
    "scheduled",
    "first_token",
    "kv_transfer_start",
    "kv_transfer_end",
    "last_token",
    "responded",
)


@dataclass
class LegRecord:
    """One leg attempt as the orchestrator saw it (time.monotonic()): sent, and its answer's
    first byte (headers); the worker's report, once it came, in `timing`."""

    url: str
    sent: float
    first_byte: float | None = None
    timing: LegTiming | None = None

    def report(self, raw: bytes | str | None, offsets: ClockOffsets) -> None:
        """Take the worker's report (the header's or the SSE event's text); a malformed one is
        dropped with a warning. A good one is also a clock sample of that worker."""
        if raw is None:
            return
        timing = leg_timing.decode(raw)
        if timing is None:
            log.warning("ignoring malformed leg timing from %s: %.200r", self.url, raw)
            return
        self.timing = timing
        if self.first_byte is not None:
            s = sample(self.sent, timing.received, timing.responded, self.first_byte)
            if s is None:
                log.warning("leg timing from %s does not fit its exchange; ignored", self.url)
                self.timing = None
            else:
                offsets.add(self.url, s)


class PerfRecords:
    def __init__(self, max_requests: int) -> None:
        self.enabled = max_requests > 0
        self._records: deque[dict[str, Any]] = deque(maxlen=max(1, max_requests))

    def add(
        self,
        arrival: float,
        times: dict[str, float],
        info: dict[str, Any],
        legs: dict[str, LegRecord] | None = None,
        offsets: ClockOffsets | None = None,
    ) -> None:
        """`arrival` and `times` on time.monotonic(); `info`: request id, endpoint, workers;
        `legs`: the legs that served it ("context", "generation"), with their reports."""
        if not self.enabled:
            return
        steps = {f"{k}_ms": _ms(times[k] - arrival) for k in STEPS if k in times}
        record = {
            **info,
            "arrival_unix": round(time.time() - (time.monotonic() - arrival), 6),
            **steps,
        }
        if legs and offsets is not None:
            record |= _worker_steps(arrival, legs, offsets)
        self._records.append(record)

    def last(self) -> list[dict[str, Any]]:
        return list(self._records)


def _worker_steps(
    arrival: float, legs: dict[str, LegRecord], offsets: ClockOffsets
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    clock: dict[str, float] = {}
    for name, leg in legs.items():
        best = offsets.best(leg.url)
        if leg.timing is None or best is None:
            continue
        t = leg.timing
        marks = {"received": t.received, "responded": t.responded, **t.steps()}
        for step in WORKER_STEPS:
            if step in marks:
                out[f"{name}_worker_{step}_ms"] = _ms(marks[step] - best.offset - arrival)
        if t.kv_transfer_start is not None and t.kv_transfer_end is not None:
            out["kv_transfer_ms"] = _ms(t.kv_transfer_end - t.kv_transfer_start)
            out["kv_transfer_bytes"] = t.kv_transfer_bytes
        wall = offsets.wall_offset(leg.url)
        if wall is not None:
            clock[name] = _ms(wall)
            clock[f"{name}_error"] = _ms(best.delay / 2)
    if clock:
        out["clock_offset_ms"] = clock
    return out


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 3)
