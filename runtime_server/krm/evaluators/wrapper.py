"""The wrapper server's evaluator (docs/protocol.md, "Wrapper server"): one function entrypoint, run per request.

``fnkernel wrapper-server --port P -- ENTRYPOINT...`` serves FunctionEvaluator with it: the
ResourceList goes to the entrypoint's stdin; exit 0 and a ResourceList on stdout is the answer;
a non-zero exit is a FunctionError keeping the parsed results and stderr; output that is not a
ResourceList is "failed to parse function output"; an entrypoint that cannot start is "failed to
execute". All three are INTERNAL at the gRPC layer, so a pod is not evicted for them.
"""

from __future__ import annotations

from collections.abc import Sequence

from fnkernel.runtime_server.errors import EvaluatorSystemError, FunctionError
from fnkernel.runtime_server.krm.evaluators.base import EvalRequest, EvalResponse
from fnkernel.runtime_server.krm.functions.processes import (
    memory_message,
    out_of_memory,
    run_function,
)
from fnkernel.runtime_server.krm.resources.resourcelist import InvalidResourceList, ResourceList


class WrapperEvaluator:
    name = "wrapper"

    def __init__(self, entrypoint: Sequence[str], label: str = "") -> None:
        if not entrypoint:
            raise ValueError("the wrapper server needs an entrypoint after --")
        self.entrypoint = list(entrypoint)
        self.label = label or self.entrypoint[0]  # how its failures name the function

    def evaluate(self, request: EvalRequest, deadline: float | None = None) -> EvalResponse:
        try:
            code, stdout, stderr = run_function(self.entrypoint, request.serialized(), deadline)
        except EvaluatorSystemError as exc:
            # Why, in stderr too: kpt's report of a failed step shows its stderr, not its error.
            raise FunctionError(
                f"failed to execute: {exc}", exit_code=-1, stderr=str(exc)
            ) from None
        log = stderr.decode("utf-8", "replace")
        if out_of_memory(code, stderr):
            why = memory_message(self.label)
            raise FunctionError(  # in stderr too: kpt's report shows a failed step's stderr
                f"{self.label} exited with {code}: {why}",
                exit_code=code,
                stderr=f"{log.rstrip()}\nfnkernel: {why}\n",
                resource_list=stdout,
            )
        try:
            output = ResourceList.parse(stdout)
        except InvalidResourceList as exc:
            raise FunctionError(
                f"failed to parse function output: {exc}",
                exit_code=code,
                stderr=log,
                resource_list=stdout,
            ) from None
        results = [dict(result) for result in output.results if isinstance(result, dict)]
        if code != 0:
            raise FunctionError(
                f"{self.label} exited with {code}",
                exit_code=code,
                stderr=log,
                results=results,
                resource_list=stdout,
            )
        return EvalResponse(stdout, stderr, self.name)
