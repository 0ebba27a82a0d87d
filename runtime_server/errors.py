"""What the FunctionRuntime state machine rejects, named for what the caller did wrong.

No gRPC here: ``runtime_server.wire.GRPC_STATUS`` maps each class to a status code, in one table
(docs/protocol.md, "Registration" and "Limits").
"""

from __future__ import annotations

import errno
from typing import Any


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


class InvocationNotFound(RuntimeServerError):
    """A follower asked for an invocation that is neither in flight nor the last one."""


class TooManyFollowers(RuntimeServerError):
    """Every live-log stream this process allows is open (docs/protocol.md, "Live output")."""


# The control plane (docs/protocol.md, "Runs")


class RunNotFound(RuntimeServerError):
    """No Run has this name."""


class RunReplaced(RunNotFound):
    """The Run a call was made for (``X-Fn-Run-Uid``) is gone, and another of its name stands in
    its place: that one is not called (docs/protocol.md, "Ownership")."""


class RunAlreadyExists(RuntimeServerError):
    """A Run with this name exists already; delete it first or pick another name."""


class RunTooLarge(RuntimeServerError):
    """The Run, with its files, is larger than its store can keep (on Kubernetes, an object
    of the API server); the message names the limit. The gateway answers 413."""


class RunFilesMissing(RuntimeServerError):
    """The Run exists but its files are not where its spec says: on Kubernetes, a ConfigMap of
    them is gone or holds other text (docs/kubernetes.md, "Reads"); the message names it."""


class RequirementsFailed(RuntimeServerError):
    """A Run's requirements could not be resolved or installed on its node; the message has
    the installer's own words (docs/protocol.md, "Requirements"). The Run fails: the same
    requirements fail the same way, so no retry."""


class SecretNotFound(RuntimeServerError):
    """No secret has this name (docs/protocol.md, "Secrets"): the message names it."""


class RunNotReady(RuntimeServerError):
    """The Run cannot take an invocation now: it is pending, retrying, failed or being deleted."""


class RunFailed(RunNotReady):
    """The Run is Failed: terminal until it is made again, so no caller is told to come back
    (no Retry-After). `run_uid` names it."""

    def __init__(self, message: str, run_uid: str) -> None:
        super().__init__(message)
        self.run_uid = run_uid


class NoRuntimePod(RuntimeServerError):
    """No live Runtime Pod serves the Run's runtime."""


class RegistrationLost(RuntimeServerError):
    """The pod's Runtime Server no longer holds the Run's registration (it restarted); the Run is
    being registered again."""


class RoutedElsewhere(RuntimeServerError):
    """Routing fence: the Run is not assigned to the pod the call reached."""


class StoreDamaged(RuntimeServerError):
    """The Run store cannot be used: SQLite finds its file damaged (``PRAGMA quick_check``) or
    not a database at all. ``str()`` names the file and gives SQLite's own words."""


class StorageFull(RuntimeServerError):
    """The disk holding the state dir is full (ENOSPC, EDQUOT; the SQLite store raises it for
    SQLite's "database or disk is full"): nothing was written, and the request may succeed once
    there is room."""


_NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def storage_full(exc: BaseException) -> StorageFull | None:
    """`exc` as StorageFull if it says the disk is full, naming what could not be written."""
    if isinstance(exc, StorageFull):
        return exc
    if not isinstance(exc, OSError) or exc.errno not in _NO_ROOM_ERRNOS:
        return None
    where = f" writing {exc.filename}" if exc.filename else ""
    return no_room(where, f"{errno.errorcode[exc.errno]}: {exc.strerror}")


def no_room(where: str, reason: str) -> StorageFull:
    """StorageFull naming what could not be written (`where`: " writing ...") and why."""
    return StorageFull(
        f"no space left on the state dir's disk{where} ({reason}): free some and try again"
    )


class NotAllowedHere(RuntimeServerError):
    """Register/Unregister belong to runtimed itself; outside callers may not use them."""


# The evaluator chain (docs/protocol.md, "Evaluators")


class EvaluatorError(Exception):
    """Base class; ``str()`` is one line naming the function and the cause. A chain fills in
    which evaluator raised it and which ones it skipped first."""

    evaluator: str = ""
    skipped: tuple[str, ...] = ()


class NotFoundError(EvaluatorError):
    """The function is not available from this evaluator: the chain may try the next one."""

    def __init__(self, message: str, tried: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.tried = tried


class FunctionError(EvaluatorError):
    """The function ran and failed. Keeps the exit code, stderr and the structured results (the
    ``results`` of the ResourceList it printed, when that parsed), not a flattened text."""

    def __init__(
        self,
        message: str,
        *,
        exit_code: int = 1,
        stderr: str = "",
        results: list[dict[str, Any]] | None = None,
        resource_list: bytes = b"",
    ) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.stderr = stderr
        self.results = results or []
        self.resource_list = resource_list


class InvalidEvaluateRequest(EvaluatorError):
    """The request itself is wrong: unparsable input, an exec_path outside the sandbox, ..."""


class DeadlineExceeded(EvaluatorError):
    """The function did not finish before the deadline; it was stopped."""


class EvaluatorSystemError(EvaluatorError):
    """Infrastructure failed (a pod did not start, a connection broke): not the function's fault."""
