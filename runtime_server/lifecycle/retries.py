"""What a failed registration step means for its Run: the one retry decision (docs/architecture.md,
"Retries").

``decide(step, error)`` is pure: runtimed asks it for every failure it sees and acts on the answer;
the control plane's retry engine then spends the budget (``RetryPolicy``) of the charged ones.
"""

from __future__ import annotations

import enum

import grpc

from fnkernel.adapters.errors import (
    HANDLER_NOT_FOUND,
    IMPORT_MODULE_ERROR,
    INITIALIZATION_ERROR,
    INITIALIZATION_TIMEOUT,
    MEMORY_LIMIT_EXCEEDED,
    USER_CODE_SYNTAX_ERROR,
    WORKER_KILLED,
    WORKER_START_FAILED,
)

Code = grpc.StatusCode


class Step(enum.Enum):
    """What failed."""

    REGISTER = "RegisterFunction"  # the RPC answered an error status
    LOAD = (
        "load"  # the server answered FAILED: the handler did not load (error: fatal_error's type)
    )
    STATUS = "FunctionStatus"  # runtimed's poll of a READY registration answered an error status
    POD = "pod"  # the pod gave no sign of life for POD_GRACE_SECONDS (the control plane)


class Verdict(enum.Enum):
    FATAL = "fatal"  # the Run is Failed, with the error as its message; no retry
    RETRY_CHARGED = "retry, charged"  # Retrying: attempt + 1, counted against the budget
    RETRY_FREE = "retry, free"  # Retrying: attempt + 1, not counted (the platform's fault)
    WAIT = "wait"  # no answer, so nothing is known: keep the Run as it is and ask again


# No answer: the server is down, paused or restarting, or the call was cut off. That says nothing
# about what it holds (a pause is not a death).
NO_ANSWER = frozenset({Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.CANCELLED})
# RegisterFunction refused the request itself: the same request gets the same answer.
_REFUSED = frozenset(
    {
        Code.INVALID_ARGUMENT,  # a limit or a malformed handler
        Code.ALREADY_EXISTS,  # this attempt is registered with another digest
        Code.UNIMPLEMENTED,  # the runtime has no function mode; never a fallback to Execute
        Code.OUT_OF_RANGE,
        Code.PERMISSION_DENIED,
        Code.UNAUTHENTICATED,
    }
)
# The server holds something else than runtimed thinks: the registration is lost, by no fault of
# the function (a restarted server, a newer attempt it saw first).
_LOST = frozenset({Code.NOT_FOUND, Code.FAILED_PRECONDITION, Code.ABORTED})
# Load failures that are the platform's, not the handler's: a signal ended the worker (the OOM
# killer, an operator), or the OS would not start one (EAGAIN, ENOMEM, EMFILE).
INFRASTRUCTURE_LOAD_FAILURES = frozenset({WORKER_KILLED, WORKER_START_FAILED})
# Every load failure a worker reports (adapters/errors.py); all but the above name the handler's
# problem. A type not listed (a new runtime's) is the handler's too.
LOAD_FAILURES = frozenset(
    {
        USER_CODE_SYNTAX_ERROR,
        IMPORT_MODULE_ERROR,
        HANDLER_NOT_FOUND,
        INITIALIZATION_ERROR,
        INITIALIZATION_TIMEOUT,
        MEMORY_LIMIT_EXCEEDED,  # its import needs more than its memoryMb: so will the next
        *INFRASTRUCTURE_LOAD_FAILURES,
    }
)


def decide(step: Step, error: Code | str | None = None) -> Verdict:
    """The verdict on `step` failing with `error`: a gRPC status code for REGISTER and STATUS,
    the fatal_error's type (the text before its first ':') for LOAD, nothing for POD."""
    if step is Step.POD:
        return Verdict.RETRY_FREE
    if step is Step.LOAD:
        if not isinstance(error, str):
            raise TypeError(f"a load failure is a fatal_error type, not {error!r}")
        return Verdict.RETRY_CHARGED if error in INFRASTRUCTURE_LOAD_FAILURES else Verdict.FATAL
    if not isinstance(error, Code):
        raise TypeError(f"a {step.value} failure is a gRPC status code, not {error!r}")
    if error is Code.OK:
        raise ValueError("OK is not a failure")
    if error in NO_ANSWER:
        return Verdict.WAIT
    if step is Step.REGISTER and error in _REFUSED:
        return Verdict.FATAL
    if error in _LOST:
        return Verdict.RETRY_FREE
    # The server answered that it failed (INTERNAL, UNKNOWN, RESOURCE_EXHAUSTED, DATA_LOSS, …),
    # or refused a poll it should answer: retry, but within the budget, so that a server that
    # keeps failing ends the Run instead of spinning.
    return Verdict.RETRY_CHARGED


def fatal_error_type(fatal_error: str) -> str:
    """``"WorkerKilled: the handler exited…"`` → ``"WorkerKilled"``."""
    return fatal_error.partition(":")[0]
