"""What a client of the gateway sees (docs/protocol.md, "Errors"): one class per HTTP status,
named for what went wrong, under one base, ``GatewayError``. ``ERRORS`` maps a status to its
class; ``from_response`` builds the one a failed response names. Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class GatewayError(Exception):
    """A gateway request failed; ``str()`` is one line: the message and the status name."""

    names_its_code = True  # str() ends with the status name, ``(NOT_FOUND)``

    def __init__(
        self,
        message: str,
        *,
        code: str = "",
        status: int = 0,
        run_uid: str = "",
        invocation_id: str = "",
        detail: Mapping[str, Any] | None = None,
    ) -> None:
        self.message = message
        self.code = code  # the gRPC status name, or the gateway's own (PAYLOAD_TOO_LARGE, ...)
        self.status = status  # the HTTP status; 0 when no response was had
        self.run_uid = run_uid
        self.invocation_id = invocation_id
        self.detail = dict(detail or {})  # the whole JSON error body, for %fn_debug
        self.spans = b""  # a traced call's: every hop's spans, OTLP (docs/protocol.md, "Tracing")
        self.retry_after = ""  # the gateway's Retry-After: the refusal may pass (429, 503)
        # A map's failure: the index of the item it failed on, and how many items the map had.
        self.item: tuple[int, int] | None = None
        super().__init__(f"{message} ({code})" if code and self.names_its_code else message)

    @classmethod
    def from_body(cls, body: Mapping[str, Any], status: int) -> GatewayError:
        return cls(
            str(body.get("message", "")),
            code=str(body.get("code", "")),
            status=status,
            run_uid=str(body.get("runUid", "")),
            invocation_id=str(body.get("invocationId", "")),
            detail=body,
        )

    def __str__(self) -> str:
        # A map's failure names its item wherever it is printed: a script's traceback, a log.
        text = super().__str__()
        return f"{text} ({self.item_phrase()})" if self.item else text

    def _render_traceback_(self) -> list[str]:
        """IPython shows this instead of a stack trace: one readable line (docs/protocol.md,
        "Kernel")."""
        return [f"{type(self).__name__}: {self}"]

    @property
    def logs(self) -> list[Any]:
        """What the call printed before it failed, when the answer carries it (a handler's
        failure, a timeout: docs/protocol.md, "Errors")."""
        logs = self.detail.get("logs")
        return list(logs) if isinstance(logs, list) else []

    def item_phrase(self) -> str:
        """``index 5 of 200 items``: the item a map's failure is of, by its index (``item``)."""
        index, total = self.item or (0, 0)
        return f"index {index} of {total} items"


class InvalidRequest(GatewayError):
    """400: a field of the request is invalid; the message names it."""


class Unauthorized(GatewayError):
    """401: the gateway wants a bearer token (README, "Security")."""

    # Where a client finds the token (README, "Security"), as a refusal tells its reader.
    FOUND_IN = (
        "$FNKERNEL_TOKEN, or the gateway file a stack writes in $FNKERNEL_RUNTIME_DIR (the "
        "same as the stack's)"
    )

    def _render_traceback_(self) -> list[str]:
        return [*super()._render_traceback_(), f"  the token: {self.FOUND_IN}"]


class PermissionDenied(GatewayError):
    """403: a disallowed Origin or Host, or a call outside callers may not make."""


class FunctionNotFound(GatewayError):
    """404: no function (Run) has this name, or the gateway has no such path."""


class SecretNotFound(FunctionNotFound):
    """404 for a secret: the stack keeps none of this name (``Client.delete_secret``). A
    FunctionNotFound too, as a 404 of the gateway's."""


class FunctionExists(GatewayError):
    """409: a function with this name exists already."""


class MethodNotAllowed(GatewayError):
    """405: the path does not take this method; the response's ``Allow`` names those it does."""


class PayloadTooLarge(GatewayError):
    """413: the request body is over the 6 MiB limit, or (on Kubernetes) the Run with its files
    is larger than the API server keeps; the message names the limit."""


class UnsupportedMediaType(GatewayError):
    """415: the request body is not of a type its route takes (docs/protocol.md, "Content
    types")."""


class NotAcceptable(GatewayError):
    """406: the function returned a content type the request's Accept does not take."""


class HeadersTooLarge(GatewayError):
    """431: the request's headers are over 64 KiB."""


class FunctionBusy(GatewayError):
    """429: the function already has an invocation in flight (the gateway queues none; a map
    waits for a free replica instead)."""


class FunctionUnavailable(GatewayError):
    """503: the function is not ready (registering, retrying, draining) or its pod is down."""


class HandlerFailed(GatewayError):
    """502: the handler ran and failed; ``error_type``, ``error_message`` and ``logs`` tell why."""

    # Its message begins "handler error:", which is all its status (UNKNOWN) says: ``str()``
    # reads "handler error: KeyError: 'x'", not "... (UNKNOWN)", as if the error were unknown.
    names_its_code = False

    @property
    def error_type(self) -> str:
        return str(self.detail.get("errorType", ""))

    @property
    def error_message(self) -> str:
        return str(self.detail.get("errorMessage", ""))


class InvocationTimedOut(GatewayError):
    """504: the invocation ran past its timeout and was stopped."""


class NotSupported(GatewayError):
    """501: the runtime does not support function mode."""


class GatewayInternalError(GatewayError):
    """500: a bug in the gateway; its log has the detail."""


class RegistrationFailed(GatewayError):
    """The Run ended ``Failed``: its handler cannot load (the message is the fatal error), or
    its registration failed past the retry policy."""


class GatewayUnreachable(GatewayError):
    """The gateway could not be reached at all."""


class RequestCancelled(GatewayError):
    """This client cancelled the request (``Client.cancel``, e.g. a kernel interrupt): its
    connection was closed, so the gateway cancelled the call and the handler was killed."""


# The HTTP status a gateway answered → the class raised (docs/protocol.md, "Errors", read
# backwards).
ERRORS: dict[int, type[GatewayError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: PermissionDenied,
    404: FunctionNotFound,
    405: MethodNotAllowed,
    409: FunctionExists,
    413: PayloadTooLarge,
    406: NotAcceptable,
    415: UnsupportedMediaType,
    429: FunctionBusy,
    431: HeadersTooLarge,
    500: GatewayInternalError,
    501: NotSupported,
    502: HandlerFailed,
    503: FunctionUnavailable,
    504: InvocationTimedOut,
}


def from_response(body: Mapping[str, Any], status: int) -> GatewayError:
    """The error a failed response names: the class of its status, built from its JSON body."""
    return ERRORS.get(status, GatewayError).from_body(body, status)
