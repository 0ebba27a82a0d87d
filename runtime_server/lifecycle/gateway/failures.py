"""How the gateway answers a failure (docs/protocol.md, "Errors"): every failure becomes a gRPC
status first (``wire.status_name`` for our own errors, the status itself for a call to runtimed)
and then an HTTP status through ``wire.HTTP_STATUS``, in the JSON body of ``FailureResponse``.
"""

from __future__ import annotations

from typing import Any

import grpc
import grpc.aio

from fnkernel.runtime_server import limits, wire
from fnkernel.runtime_server.errors import (
    RunFailed,
    RunTooLarge,
    storage_full,
)
from fnkernel.runtime_server.lifecycle.runs import Run
from fnkernel.runtime_server.rpc import failure_body

# The status names of the HTTP statuses tornado answers by itself (a malformed request, a method
# the path does not take); any other is named for its reason phrase.
TORNADO_CODES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}


class FailureResponse(Exception):
    """A failure, as the gateway answers it: the status name `code` (a gRPC status name, or
    HTTP's own for what the gateway refuses before any call: PAYLOAD_TOO_LARGE, ...), the HTTP
    `status` (from wire.HTTP_STATUS unless given) and the JSON body of docs/protocol.md,
    "Errors", `extra` included."""

    def __init__(self, code: str, message: str, *, status: int = 0, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status or wire.http_status(code)
        self.extra = extra


def all_busy(function: str, replicas: int) -> FailureResponse:
    """429 naming `function`, every one of its `replicas` busy — with this gateway's calls, or
    another caller's (docs/protocol.md, "Replicas")."""
    return FailureResponse(
        "RESOURCE_EXHAUSTED",
        f'every replica of "{function}" is busy ({replicas} in flight); '
        "try again, or create it with more replicas",
    )


def known_failure(error: BaseException | None) -> FailureResponse | None:
    """The answer to a failure of ours: a FailureResponse as it is, one of our error classes
    through wire.GRPC_STATUS, a full disk as 503 naming it; None for anything else (a bug)."""
    if error is not None:
        error = storage_full(error) or error
    if isinstance(error, FailureResponse):
        return error
    if isinstance(error, RunTooLarge):
        return FailureResponse("PAYLOAD_TOO_LARGE", limits.bounded(str(error)), status=413)
    if isinstance(error, RunFailed):  # terminal: named, and nobody told to come back
        return FailureResponse(
            "FAILED_PRECONDITION", limits.bounded(str(error)), runUid=error.run_uid, retry=False
        )
    if isinstance(error, Exception) and (code := wire.status_name(error)) is not None:
        return FailureResponse(code, limits.bounded(str(error)))
    return None


def rpc_error(err: grpc.aio.AioRpcError, run: Run, invocation_id: str = "") -> FailureResponse:
    """A status from runtimed as the gateway answers it (``rpc.failure_body``), naming the Run
    as gateway users know it; a handler error keeps its type and logs."""
    body = failure_body(err)
    code = body.pop("code")
    message = body.pop("message").replace(f"run {run.uid}", f'"{run.name}"')
    return FailureResponse(code, message, runUid=run.uid, invocationId=invocation_id, **body)
