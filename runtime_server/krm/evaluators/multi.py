"""The multi-evaluator: the chain (SPEC §5.2). Evaluators are tried in a fixed order; only
``NotFoundError`` falls through to the next; any other error is returned at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from runtime_server.krm.evaluators.base import (
    EvalRequest,
    EvalResponse,
    Evaluator,
    EvaluatorError,
    NotFoundError,
)

T = TypeVar("T")


class MultiEvaluator:
    name = "multi"

    def __init__(self, evaluators: Sequence[Evaluator]) -> None:
        if not evaluators:
            raise ValueError("a chain needs at least one evaluator")
        self.evaluators = list(evaluators)

    def evaluate(self, request: EvalRequest, deadline: float | None = None) -> EvalResponse:
        response, served, skipped = self.first(
            request.image, lambda evaluator: evaluator.evaluate(request, deadline)
        )
        return replace(response, evaluator=response.evaluator or served, skipped=skipped)

    def first(self, image: str, call: Callable[[Evaluator], T]) -> tuple[T, str, tuple[str, ...]]:
        """`call` on each evaluator in order until one has the function: its answer, its name
        and the names of those that did not. Only NotFoundError falls through."""
        tried: list[str] = []
        reasons: list[str] = []
        for evaluator in self.evaluators:
            try:
                answer = call(evaluator)
            except NotFoundError as exc:
                tried.append(evaluator.name)
                reasons.append(f"{evaluator.name}: {exc}")
                continue
            except EvaluatorError as exc:  # it has the function and it failed: stop here
                exc.evaluator, exc.skipped = exc.evaluator or evaluator.name, tuple(tried)
                raise
            return answer, evaluator.name, tuple(tried)
        raise NotFoundError(
            f"function {image} not found; tried {', '.join(tried)} ({'; '.join(reasons)})",
            tuple(tried),
        )
