"""The one interface every evaluator implements (docs/protocol.md, "Evaluators"); the errors it
may raise are in runtime_server.errors."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from fnkernel.runtime_server.errors import DeadlineExceeded
from fnkernel.runtime_server.krm.resources.resourcelist import ResourceList


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
