"""When a failed leg is tried again: the design's retry rules as one small object.

A `RetryPolicy` is configuration; each request gets its own `RetryBudget` that says whether
one more attempt is allowed after a given failure. It decides only: it never sleeps, sends
or places (the orchestrator does).
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.errors import (
    DeadlineExceeded,
    DisaggError,
    GatewayTimeout,
    UpstreamError,
    WorkerUnavailable,
)


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 1  # for worker errors (5xx), failed connections, timeouts
    transient_retries: int = 5  # for TCP resets / server disconnected
    interval_s: float = 1.0

    @classmethod
    def off(cls) -> RetryPolicy:
        return cls(0, 0, 0.0)

    def budget(self) -> RetryBudget:
        return RetryBudget(self)


class RetryBudget:
    """The retries one request has left."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.retries = 0
        self.transient = 0

    @property
    def attempts(self) -> int:
        return 1 + self.retries + self.transient

    def spend(self, exc: BaseException) -> bool:
        """Whether the attempt that failed with `exc` may be tried again (and count it)."""
        if not isinstance(exc, DisaggError) or not retryable(exc):
            return False
        if isinstance(exc, WorkerUnavailable) and exc.transient:
            if self.transient < self.policy.transient_retries:
                self.transient += 1
                return True
            return False
        if self.retries < self.policy.max_retries:
            self.retries += 1
            return True
        return False


def retryable(exc: DisaggError) -> bool:
    """Worker faults are; the client's own mistakes (4xx) and capacity (503) are not."""
    if isinstance(exc, UpstreamError):
        return exc.status >= 500
    if isinstance(exc, DeadlineExceeded):
        return False
    return isinstance(exc, WorkerUnavailable | GatewayTimeout)
