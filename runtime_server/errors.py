"""What the FunctionRuntime state machine rejects, named for what the caller did wrong.

No gRPC here: ``runtime_server.function_runtime.servicer.GRPC_STATUS`` maps each class to a status code, in one table
(docs/protocol.md, "Registration" and "Limits").
"""

from __future__ import annotations


class RuntimeServerError(Exception):
    """Base class; ``str()`` is the one-line status message (it names the field or the cause)."""


class InvalidField(RuntimeServerError):
    """A request field breaks a docs/protocol.md, "Limits" limit."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class RegistrationNotFound(RuntimeServerError):
    """No registration has this Run UID (docs/protocol.md: FunctionStatus NotFound)."""


class StaleRegistration(RuntimeServerError):
    """The registration ID is not the current one for its Run UID; it can change nothing."""


class RegistrationNotReady(RuntimeServerError):
    """The current registration is REGISTERING, DRAINING or FAILED, so it cannot be invoked."""


class AttemptSuperseded(RuntimeServerError):
    """RegisterFunction carried a lower registration_attempt than one already seen."""


class DigestConflict(RuntimeServerError):
    """Same Run UID and attempt, different registration_digest: nothing is replaced."""


class InvocationInFlight(RuntimeServerError):
    """v0.x allows one in-flight invocation per function Run and does not queue."""


class ShuttingDown(RuntimeServerError):
    """The server is draining for shutdown and accepts no new work."""


# The control plane (docs/protocol.md, "Runs")


class RunNotFound(RuntimeServerError):
    """No Run has this name."""


class RunAlreadyExists(RuntimeServerError):
    """A Run with this name exists already; delete it first or pick another name."""


class RunNotReady(RuntimeServerError):
    """The Run cannot take an invocation now: it is pending, retrying, failed or being deleted."""


class NoRuntimePod(RuntimeServerError):
    """No live Runtime Pod serves the Run's runtime."""


class RegistrationLost(RuntimeServerError):
    """The pod's Runtime Server no longer holds the Run's registration (it restarted); the Run is
    being registered again."""


class RoutedElsewhere(RuntimeServerError):
    """Routing fence: the Run is not assigned to the pod the call reached."""


class NotAllowedHere(RuntimeServerError):
    """Register/Unregister belong to runtimed itself; outside callers may not use them."""


# What a client of the gateway sees (docs/protocol.md, "Errors"): one class per HTTP status, named for what went
# wrong. ``runtime_server.client.ERRORS`` maps each status to its class.


class FunctionError(Exception):
    """A gateway request failed; ``str()`` is one line: the message and the gRPC code."""

    def __init__(self, body: dict[str, object], status: int) -> None:
        self.body = body
        self.status = status
        self.code = str(body.get("code", ""))
        self.message = str(body.get("message", ""))
        self.run_uid = str(body.get("runUid", ""))
        self.invocation_id = str(body.get("invocationId", ""))
        super().__init__(f"{self.message} ({self.code})" if self.code else self.message)

    def _render_traceback_(self) -> list[str]:
        """IPython shows this instead of a stack trace: one readable line (docs/protocol.md, "Kernel")."""
        return [f"{type(self).__name__}: {self}"]


class InvalidRequest(FunctionError):
    """400: a field of the request is invalid; the message names it."""


class Unauthorized(FunctionError):
    """401: the gateway wants a bearer token (``--token`` / ``$FNKERNEL_TOKEN``)."""


class PermissionDenied(FunctionError):
    """403: the call is not allowed from outside runtimed."""


class FunctionNotFound(FunctionError):
    """404: no function (Run) has this name, or it has no live registration."""


class FunctionExists(FunctionError):
    """409: a function with this name exists already."""


class PayloadTooLarge(FunctionError):
    """413: the request body is over the 6 MiB limit."""


class FunctionBusy(FunctionError):
    """429: the function already has an invocation in flight (v0.x does not queue)."""


class FunctionUnavailable(FunctionError):
    """503: the function is not ready (registering, retrying, draining) or its pod is down."""


class HandlerFailed(FunctionError):
    """502: the handler ran and failed; ``error_type``, ``error_message`` and ``logs`` tell why."""

    def __init__(self, body: dict[str, object], status: int) -> None:
        super().__init__(body, status)
        self.error_type = str(body.get("errorType", ""))
        self.error_message = str(body.get("errorMessage", ""))
        logs = body.get("logs")
        self.logs = list(logs) if isinstance(logs, list) else []


class InvocationTimedOut(FunctionError):
    """504: the invocation ran past its timeout and was stopped."""


class NotSupported(FunctionError):
    """501: the runtime does not support function mode."""


class GatewayInternalError(FunctionError):
    """500: a bug in the gateway; its log has the detail."""


class RegistrationFailed(FunctionError):
    """The Run ended ``Failed``: its handler cannot load (the message is the fatal error), or
    its registration failed past the retry policy."""


class GatewayUnreachable(FunctionError):
    """The gateway could not be reached at all."""


class RequestCancelled(FunctionError):
    """This client cancelled the request (``Client.cancel``, e.g. a kernel interrupt): its
    connection was closed, so the gateway cancelled the call and the handler was killed."""
