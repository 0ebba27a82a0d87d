"""The multi-evaluator: the chain (docs/protocol.md, "Evaluators"). Evaluators are tried in a fixed order; only
``NotFoundError`` falls through to the next; any other error is returned at once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from fnkernel.runtime_server.errors import EvaluatorError, NotFoundError
from fnkernel.runtime_server.krm.evaluators.base import EvalRequest, EvalResponse, Evaluator


class MultiEvaluator:
    name = "multi"

    def __init__(self, evaluators: Sequence[Evaluator]) -> None:
        if not evaluators:
            raise ValueError("a chain needs at least one evaluator")
        self.evaluators = list(evaluators)

    def evaluate(self, request: EvalRequest, deadline: float | None = None) -> EvalResponse:
        """The first evaluator that has the function answers; only NotFoundError falls through.
        The response names the evaluator that served and those that did not have it."""
        tried: list[str] = []
        reasons: list[str] = []
        for evaluator in self.evaluators:
            try:
                response = evaluator.evaluate(request, deadline)
            except NotFoundError as exc:
                tried.append(evaluator.name)
                reasons.append(f"{evaluator.name}: {exc}")
                continue
            except EvaluatorError as exc:  # it has the function and it failed: stop here
                exc.evaluator, exc.skipped = exc.evaluator or evaluator.name, tuple(tried)
                raise
            return replace(
                response, evaluator=response.evaluator or evaluator.name, skipped=tuple(tried)
            )
        raise NotFoundError(
            f"function {request.image} not found; tried {', '.join(tried)} ({'; '.join(reasons)})",
            tuple(tried),
        )
