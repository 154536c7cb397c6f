"""Per-request timing records (`GET /perf_metrics`): for the last N requests, when each
step happened on the orchestrator's steady clock, relative to the request's arrival, with
the workers that served it. A bounded buffer (TensorRT-LLM's `perf_metrics_max_requests`;
0 keeps none). It records; it never changes how a request is served.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

# The steps, in the order a request passes them (absent when a request skipped one).
STEPS = (
    "context_sent",
    "context_done",
    "generation_sent",
    "generation_accepted",
    "first_token",
    "last_token",
)


class PerfRecords:
    def __init__(self, max_requests: int) -> None:
        self.enabled = max_requests > 0
        self._records: deque[dict[str, Any]] = deque(maxlen=max(1, max_requests))

    def add(
        self,
        arrival: float,
        times: dict[str, float],
        info: dict[str, Any],
    ) -> None:
        """`arrival` and `times` on time.monotonic(); `info`: request id, endpoint, workers."""
        if not self.enabled:
            return
        steps = {f"{k}_ms": round(1000 * (times[k] - arrival), 3) for k in STEPS if k in times}
        self._records.append(
            {
                **info,
                "arrival_unix": round(time.time() - (time.monotonic() - arrival), 6),
                **steps,
            }
        )

    def last(self) -> list[dict[str, Any]]:
        return list(self._records)
