"""executor.v1.Runtime/Execute: one handler call without registration (docs/protocol.md, "Services").

The same adapters, once: load, invoke, stop. Nothing emulates function mode through Execute.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fnkernel.adapters import Adapter, FunctionSpec
from fnkernel.adapters.errors import (
    INITIALIZATION_TIMEOUT,
    HandlerError,
    InitError,
    InvocationTimeout,
)
from fnkernel.runtime_server import limits
from fnkernel.runtime_server.limits import check_handler


@dataclass(frozen=True)
class ExecuteOutcome:
    output: bytes
    content_type: str
    outputs: dict[str, str] = field(default_factory=dict)
    exit_code: int = 0


def _failure(error_type: str, message: str) -> ExecuteOutcome:
    body = {"errorType": error_type, "errorMessage": limits.bounded(message)}
    return ExecuteOutcome(json.dumps(body).encode(), "application/json", {}, 1)


def execute(
    adapter_cls: type[Adapter],
    workspace_root: Path,
    *,
    run_uid: str,
    working_dir: str,
    handler: str,
    env: Mapping[str, str],
    input: bytes,
    content_type: str,
    timeout_millis: int,
    deadline: float | None = None,
    on_dispatch: Callable[[Callable[[], object]], None] | None = None,
) -> ExecuteOutcome:
    """Run `handler` once. A handler that fails to load or fails gives exit_code 1 and an
    ``{"errorType", "errorMessage"}`` body; a timeout raises InvocationTimeout, loading
    included: the call's timeout counts from its start (docs/protocol.md, "Errors")."""
    limits.check_run_uid(run_uid)
    directory = limits.resolve_working_dir(working_dir, workspace_root)
    check_handler(adapter_cls, handler, directory)
    env = limits.check_env(env)
    limits.check_input(input)
    media = limits.check_content_type(content_type, adapter_cls.content_types, adapter_cls.runtime)
    effective = time.monotonic() + limits.effective_timeout_millis(timeout_millis) / 1000
    if deadline is not None:
        effective = min(effective, deadline)
    adapter = adapter_cls(
        FunctionSpec(run_uid, directory, handler, env, limits.DEFAULT_MEMORY_MB),
        max_output_bytes=limits.MAX_PAYLOAD_BYTES,
        init_timeout=max(0.0, effective - time.monotonic()),
    )
    try:
        adapter.start()
        if on_dispatch is not None:
            on_dispatch(adapter.cancel)
        result = adapter.invoke(limits.new_id("inv_"), input, effective, content_type=media)
    except InitError as exc:
        if exc.error_type == INITIALIZATION_TIMEOUT:  # loading took the call's whole timeout
            raise InvocationTimeout(
                "the handler did not finish loading before the deadline"
            ) from None
        return _failure(exc.error_type, exc.message)
    except HandlerError as exc:
        return _failure(exc.error_type, exc.message)
    finally:
        adapter.close()
    problem = limits.outputs_problem(result.outputs)
    if problem is not None:
        return _failure("InvalidOutputs", problem)
    return ExecuteOutcome(result.output, result.content_type, result.outputs, 0)
