"""One exception hierarchy for disagg; each error knows its HTTP status and OpenAI error body.

The frontends (orchestrator and reference worker) turn these into responses in one place;
nothing else formats error bodies.
"""

from __future__ import annotations

from typing import Any


class DisaggError(Exception):
    """Base of every error a client may see."""

    status = 500
    type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def headers(self) -> dict[str, str]:
        """Extra response headers (e.g. `Retry-After`)."""
        return {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


class InvalidRequest(DisaggError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(DisaggError):
    status = 401
    type = "authentication_error"


class Forbidden(DisaggError):
    """The caller may be who it says, but this action is not allowed here."""

    status = 403
    type = "permission_error"


class NotFound(DisaggError):
    status = 404
    type = "not_found_error"


class Conflict(DisaggError):
    """The request clashes with the current state (e.g. adding a worker a pool has)."""

    status = 409
    type = "conflict_error"


class ModelNotFound(DisaggError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist.", param="model", code="model_not_found"
        )


class RequestTimeout(DisaggError):
    """The client did not send its whole body in time (a slow or stalled client)."""

    status = 408
    type = "invalid_request_error"


class PayloadTooLarge(DisaggError):
    status = 413
    type = "invalid_request_error"


class UpstreamError(DisaggError):
    """A worker answered with an error status; 4xx is kept, 5xx becomes 502."""

    type = "upstream_error"

    def __init__(
        self,
        worker_status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.worker_status = worker_status
        self.status = worker_status if 400 <= worker_status < 500 else 502
        if self.status < 500:
            self.type = "invalid_request_error"


class WorkerUnavailable(DisaggError):
    """A worker could not be reached or broke the connection.

    `transient`: a TCP fault (reset, server disconnected) that a retry usually cures.
    `sent`: the request may have reached the worker (False only when connecting failed).
    """

    status = 502
    type = "upstream_error"

    def __init__(
        self,
        message: str,
        *,
        transient: bool = False,
        sent: bool = True,
        code: str | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.transient, self.sent = transient, sent


# The `code` a generation worker gives when pulling KV from the context worker failed: the
# fault is the context worker's, not the generation worker's.
KV_TRANSFER_FAILED = "kv_transfer_failed"


class ServiceUnavailable(DisaggError):
    """No ready worker in a pool, or the server is shutting down."""

    status = 503
    type = "service_unavailable"


class TooManyRequests(DisaggError):
    """The admission queue is full or the wait for a slot timed out."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int, reason: str) -> None:
        super().__init__(message, code="rate_limit_exceeded")
        self.retry_after_s = retry_after_s
        self.reason = reason  # queue_full | queue_timeout

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class GatewayTimeout(DisaggError):
    status = 504
    type = "timeout"


class DeadlineExceeded(GatewayTimeout):
    """The whole request's deadline passed: nothing more is tried."""
