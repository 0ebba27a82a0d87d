"""The builtin evaluator: KRM functions implemented in Python, run in-process (docs/protocol.md, "Evaluators").

Each function answers to its bare name and to the two catalog registries' names, with any tag or
digest: ``set-namespace``, ``ghcr.io/kptdev/krm-functions-catalog/set-namespace:v0.4.1``,
``gcr.io/kpt-fn/set-namespace@sha256:…``. Anything else is ``NotFoundError``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from fnkernel.runtime_server.errors import FunctionError, InvalidEvaluateRequest, NotFoundError
from fnkernel.runtime_server.krm.evaluators.base import (
    EvalRequest,
    EvalResponse,
    remaining,
    split_image,
)
from fnkernel.runtime_server.krm.functions.processes import Bounds, running
from fnkernel.runtime_server.krm.functions.replacements import apply_replacements
from fnkernel.runtime_server.krm.functions.set_metadata import set_annotations, set_labels
from fnkernel.runtime_server.krm.functions.set_namespace import set_namespace
from fnkernel.runtime_server.krm.functions.starlark import starlark_run
from fnkernel.runtime_server.krm.resources.resourcelist import (
    ERROR,
    FunctionFailure,
    InvalidResourceList,
    ResourceList,
)

KrmFunction = Callable[[ResourceList], None]
# What the catalog's functions print on stderr when they fail; kpt shows it and records it in the
# render status, so ours say the same (docs/krm.md, "Results").
FAILURE_STDERR = "failed to evaluate function: error: function failure"
CATALOG_PREFIXES = ("ghcr.io/kptdev/krm-functions-catalog/", "gcr.io/kpt-fn/")
FUNCTIONS: dict[str, KrmFunction] = {
    "set-namespace": set_namespace,
    "set-labels": set_labels,
    "set-annotations": set_annotations,
    "starlark": starlark_run,
    "apply-replacements": apply_replacements,
}


def bare_name(image: str) -> str:
    """The function name an image refers to, without registry prefix, tag or digest."""
    name, _ = split_image(image)
    for prefix in CATALOG_PREFIXES:
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return name


class BuiltinEvaluator:
    name = "builtin"

    def __init__(self, functions: Mapping[str, KrmFunction] | None = None) -> None:
        self._functions = dict(FUNCTIONS if functions is None else functions)
        self._lock = threading.Lock()

    def register(self, name: str, function: KrmFunction) -> None:
        """Add a function (e.g. ``fn://NAME`` from a notebook) under exactly `name`."""
        with self._lock:
            self._functions[name] = function

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._functions)

    def lookup(self, image: str) -> KrmFunction | None:
        with self._lock:
            if image in self._functions:  # fn://NAME and other exact names
                return self._functions[image]
            name = bare_name(image)
            if "/" in name:  # another registry: not ours
                return None
            return self._functions.get(name)

    def evaluate(self, request: EvalRequest, deadline: float | None = None) -> EvalResponse:
        """Run the function on the request's parsed ResourceList itself when it has one (a
        pipeline's), else on the parsed bytes."""
        function = self.lookup(request.image)
        if function is None:
            raise NotFoundError(f"{request.image} is not a builtin function")
        rl = request.parsed
        if rl is None:
            try:
                rl = ResourceList.parse(request.resource_list)
            except InvalidResourceList as exc:
                raise InvalidEvaluateRequest(
                    f"{request.image}: the input is not a ResourceList: {exc}"
                ) from None
        remaining(deadline)
        try:
            with running(Bounds(), deadline):  # within a pipeline's step, the step's bounds
                function(rl)
            failed = rl.has_errors()
        except FunctionFailure:
            failed = True
        if failed:
            errors = [r for r in rl.results if isinstance(r, dict) and r.get("severity") == ERROR]
            first = errors[0].get("message", "") if errors else "function failure"
            raise FunctionError(
                f"{request.image} failed: {first}",
                exit_code=1,
                stderr="\n".join([*rl.stderr, FAILURE_STDERR]),
                results=[dict(r) for r in rl.results if isinstance(r, dict)],
            )
        log = "\n".join(rl.stderr).encode()
        if request.parsed is not None:
            return EvalResponse(b"", log, self.name, parsed=rl)
        return EvalResponse(rl.to_bytes(), log, self.name)
