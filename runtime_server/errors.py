"""What the FunctionRuntime state machine rejects, named for what the caller did wrong.

No gRPC here: ``runtime_server.servicer.GRPC_STATUS`` maps each class to a status code, in one table
(SPEC §2.1, §2.2).
"""

from __future__ import annotations


class RuntimeServerError(Exception):
    """Base class; ``str()`` is the one-line status message (it names the field or the cause)."""


class InvalidField(RuntimeServerError):
    """A request field breaks a SPEC §2.2 limit."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class RegistrationNotFound(RuntimeServerError):
    """No registration has this Run UID (seed: FunctionStatus NotFound)."""


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
