"""What can go wrong inside an adapter, named for the user (docs/protocol.md, "Limits", "Adapters").

These carry no gRPC: the Runtime Server maps each class to a status code in exactly one table
(``runtime_server.wire.GRPC_STATUS``).
"""

from __future__ import annotations

import re
from typing import Any

# Error types that leave the process (fatal_error, fn-error-type), each spelled once, here. Which
# load failures are retried is runtime_server/lifecycle/retries.py.
USER_CODE_SYNTAX_ERROR = "UserCodeSyntaxError"  # the handler file does not parse
IMPORT_MODULE_ERROR = "ImportModuleError"  # its module (or one it imports) failed to import
INITIALIZATION_TIMEOUT = "InitializationTimeout"  # it did not finish loading in time
WORKER_KILLED = "WorkerKilled"  # a signal ended the worker while it loaded: retried
WORKER_START_FAILED = "WorkerStartFailed"  # the OS would not start the worker: retried
WORKER_CRASHED = "WorkerCrashed"  # the worker exited in the middle of a call
INITIALIZATION_ERROR = "InitializationError"
HANDLER_NOT_FOUND = "HandlerNotFound"
OUTPUT_TOO_LARGE = "OutputTooLarge"
CORRUPT_RESPONSE = "CorruptResponse"  # the worker's answer was not this call's: it is restarted
MEMORY_LIMIT_EXCEEDED = "MemoryLimitExceeded"  # the handler needed more than its memoryMb
# How a program says that an allocation failed as it dies of it: Rust (then SIGABRT; or a panic,
# as Starlark's arena does, which pyo3 raises in Python), Python, Go, C's and bash's xmalloc.
# One place for the handlers' workers and the KRM functions' steps. And a Python worker's
# native libraries as they exit of it: OpenBLAS (numpy's) while it loads.
OUT_OF_MEMORY = re.compile(
    r"memory allocation of \d+ bytes failed|^MemoryError\b|fatal error: runtime: out of memory"
    r"|PanicException: out of memory$"
    r"|\bx(?:m|re)alloc: .*cannot allocate|^OpenBLAS error: Memory allocation still failed",
    re.MULTILINE,
)


def ran_out_of_memory(stderr: list[str]) -> str:
    """The line of a dying process's last lines of `stderr` that says it ran out of memory
    (OUT_OF_MEMORY), or ""."""
    return next((text for text in reversed(stderr[-3:]) if OUT_OF_MEMORY.search(text)), "")


class AdapterError(Exception):
    """Base class of every adapter failure; ``str()`` is a one-line message for the user."""


class InvalidHandler(AdapterError, ValueError):
    """The handler string is malformed or points outside the working directory.

    Raised before any file is touched (docs/protocol.md, "Limits", handler rows).
    """


class InitError(AdapterError):
    """The handler could not be loaded: syntax error, import error, missing function.

    ``error_type`` names the failure (``UserCodeSyntaxError``, ``ImportModuleError``,
    ``HandlerNotFound``, ``InitializationError``, or ``WorkerKilled`` when a signal ended the
    worker); ``message`` is bounded text with no traceback.
    """

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message


class HandlerError(AdapterError):
    """The handler ran and failed: it raised, exited non-zero, or returned something unencodable.

    ``logs`` holds what the handler logged during the call (a traceback goes there, never into
    the message).
    """

    # The worker cannot be trusted after it (its frames, its memory): it is replaced.
    spoils_worker = False

    def __init__(self, error_type: str, message: str, logs: tuple[Any, ...] = ()) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message
        self.logs = logs


class InvalidInput(AdapterError):
    """The invocation payload cannot be given to this runtime (not JSON, a NUL byte for Bash)."""

    logs: tuple[Any, ...] = ()


class InvocationTimeout(AdapterError):
    """The invocation exceeded its deadline; the worker was killed and is being replaced.
    `logs`: what the handler wrote until then (docs/protocol.md, "Errors")."""

    logs: tuple[Any, ...] = ()


class InvocationCancelled(AdapterError):
    """The invocation was cancelled (client cancel or unregister); the worker was killed.
    `logs`: what the handler wrote until then."""

    logs: tuple[Any, ...] = ()


class WorkerUnavailable(AdapterError):
    """No worker could be made ready in time (for example a replacement is still importing)."""


class CorruptResponse(HandlerError):
    """What the worker wrote on its response pipe is not a well-formed answer to this call —
    junk, or a frame without this call's nonce (a handler that wrote to the worker's own
    descriptor). The frame stream can no longer be trusted, so the worker is killed and replaced:
    this call fails with this error and the next one gets a fresh worker, never another call's
    answer."""

    spoils_worker = True

    def __init__(self, what: str) -> None:
        super().__init__(
            CORRUPT_RESPONSE,
            f"the worker's answer was not this call's ({what}); the worker was restarted",
        )


# How to give a function more memory, wherever it ran out.
MORE_MEMORY = (
    "give it more with %%function NAME --memory MIB, or the Run's memoryMb "
    "(fnkernel runs create --memory MIB)"
)


def loading_out_of_memory(memory_mb: int, how: str) -> InitError:
    """Loading the handler needed more than `memory_mb`: `how` says where (``at h.py line 1``)
    or what its process last said."""
    return InitError(
        MEMORY_LIMIT_EXCEEDED,
        f"loading the handler needed more than its {memory_mb} MiB of memory (memoryMb) "
        f"{how}; {MORE_MEMORY}",
    )


class MemoryLimitExceeded(HandlerError):
    """The handler needed more memory than its registration's memory_mb allows (docs/protocol.md,
    "Limits"): the call fails naming the limit, and the worker, whose state a failed allocation
    may have left half made, is replaced; the registration stays READY."""

    spoils_worker = True

    def __init__(self, memory_mb: int) -> None:
        super().__init__(
            MEMORY_LIMIT_EXCEEDED,
            f"the handler needed more than its {memory_mb} MiB of memory (memoryMb); "
            f"its worker was restarted; {MORE_MEMORY}",
        )
