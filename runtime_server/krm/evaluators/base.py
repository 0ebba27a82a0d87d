"""The one interface every evaluator implements, and the errors it may raise (docs/protocol.md, "Evaluators")."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from runtime_server.krm.resources.resourcelist import ResourceList


def split_image(image: str) -> tuple[str, str]:
    """``name[:tag][@digest]`` → (name, tag)."""
    name = image.partition("@")[0]
    head, _, last = name.rpartition("/")
    if ":" in last:
        last, _, tag = last.partition(":")
        return (f"{head}/{last}" if head else last), tag
    return name, ""


@dataclass(frozen=True)
class EvalRequest:
    """``EvaluateFunctionRequest``: a ResourceList (YAML bytes) and the function to run on it.

    A pipeline passes the ResourceList it holds as `parsed` (and no bytes): an evaluator that
    runs functions on parsed nodes (builtin) changes it in place and answers with it, so comments
    and styles survive without a serialization; every other one takes ``serialized()``."""

    resource_list: bytes
    image: str
    tag: str = ""
    exec_path: str = ""
    parsed: ResourceList | None = None

    def serialized(self) -> bytes:
        if self.parsed is not None and not self.resource_list:
            return self.parsed.to_bytes()
        return self.resource_list


@dataclass(frozen=True)
class EvalResponse:
    """``EvaluateFunctionResponse`` plus which evaluator served it (the multi-evaluator fills it)."""

    resource_list: bytes
    log: bytes = b""
    evaluator: str = ""
    skipped: tuple[str, ...] = ()  # evaluators of a chain that answered NotFound first
    parsed: ResourceList | None = None  # the request's `parsed`, changed in place (builtin)


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


class InvalidRequest(EvaluatorError):
    """The request itself is wrong: unparsable input, an exec_path outside the sandbox, ..."""


class DeadlineExceeded(EvaluatorError):
    """The function did not finish before the deadline; it was stopped."""


class EvaluatorSystemError(EvaluatorError):
    """Infrastructure failed (a pod did not start, a connection broke): not the function's fault."""


class Evaluator(Protocol):
    """Synchronous, cancellable (by `deadline`), stateless between calls."""

    name: str

    def evaluate(self, request: EvalRequest, deadline: float | None = None) -> EvalResponse:
        """Run the function; `deadline` is a ``time.monotonic()`` instant or None."""
        ...


def remaining(deadline: float | None) -> float | None:
    """Seconds left before `deadline` (None: no deadline); raises once it has passed."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the deadline passed before the function ran")
    return left
