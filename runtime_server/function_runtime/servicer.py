"""gRPC servicers: a thin translation layer over the Registry (seed 000, SPEC §2).

Requests become keyword calls, results become messages, and every error class maps to a status code
in GRPC_STATUS, the one table of it.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from adapters.errors import (
    HandlerError,
    InvalidInput,
    InvocationCancelled,
    InvocationTimeout,
    WorkerUnavailable,
)
from runtime_server import limits
from runtime_server._proto.executor.v1 import runtime_pb2 as pb
from runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from runtime_server.errors import (
    AttemptSuperseded,
    DigestConflict,
    InvalidField,
    InvocationInFlight,
    NoRuntimePod,
    NotAllowedHere,
    RegistrationLost,
    RegistrationNotFound,
    RegistrationNotReady,
    RoutedElsewhere,
    RunAlreadyExists,
    RunNotFound,
    RunNotReady,
    ShuttingDown,
    StaleRegistration,
)
from runtime_server.function_runtime.oneshot import execute
from runtime_server.function_runtime.registry import RegistrationView, Registry

LOG = logging.getLogger("fnkernel.runtime")

# SPEC §2.1/§2.2/§2.3: each failure, by class, to its gRPC status.
GRPC_STATUS: dict[type[Exception], grpc.StatusCode] = {
    InvalidField: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    RegistrationNotFound: grpc.StatusCode.NOT_FOUND,
    DigestConflict: grpc.StatusCode.ALREADY_EXISTS,
    StaleRegistration: grpc.StatusCode.FAILED_PRECONDITION,
    RegistrationNotReady: grpc.StatusCode.FAILED_PRECONDITION,
    AttemptSuperseded: grpc.StatusCode.FAILED_PRECONDITION,
    InvocationInFlight: grpc.StatusCode.RESOURCE_EXHAUSTED,
    InvocationTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    InvocationCancelled: grpc.StatusCode.CANCELLED,
    WorkerUnavailable: grpc.StatusCode.UNAVAILABLE,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    HandlerError: grpc.StatusCode.UNKNOWN,
    # SPEC §4: the control plane and runtimed
    RunNotFound: grpc.StatusCode.NOT_FOUND,
    RunAlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    RunNotReady: grpc.StatusCode.FAILED_PRECONDITION,
    RoutedElsewhere: grpc.StatusCode.FAILED_PRECONDITION,
    NoRuntimePod: grpc.StatusCode.UNAVAILABLE,
    RegistrationLost: grpc.StatusCode.UNAVAILABLE,
    NotAllowedHere: grpc.StatusCode.PERMISSION_DENIED,
}
ERROR_TYPE_KEY = "fn-error-type"
LOGS_KEY = "fn-logs-bin"  # the invocation's log lines, JSON, bounded (for notebooks and CLIs)
_MAX_LOGS_TRAILER = 4096
_NO_DEADLINE = 1e9  # the sync server reports ~9.2e18 s remaining when the client set none

F = TypeVar("F", bound=Callable[..., Any])


def status_of(exc: Exception) -> grpc.StatusCode | None:
    for cls in type(exc).__mro__:
        if cls in GRPC_STATUS:
            return GRPC_STATUS[cls]
    return None


def translate_errors(method: F) -> F:
    """Abort the RPC with the mapped status; no Python traceback ever reaches a status message."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except grpc.RpcError as exc:  # an upstream call's status passes through (proxy hop)
            upstream: Any = exc
            context.set_trailing_metadata(relayed_trailers(upstream.trailing_metadata()))
            context.abort(upstream.code(), upstream.details() or "")
        except Exception as exc:
            code = status_of(exc)
            if code is None:
                LOG.exception("internal error in %s", method.__name__)
                context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
            if isinstance(exc, HandlerError):
                context.set_trailing_metadata(
                    ((ERROR_TYPE_KEY, exc.error_type), (LOGS_KEY, logs_trailer(exc.logs)))
                )
                context.abort(code, limits.bounded(f"handler error: {exc}"))
            context.abort(code, limits.bounded(str(exc)))

    return wrapper  # type: ignore[return-value]


def relayed_trailers(trailers: Any) -> tuple[tuple[str, str | bytes], ...]:
    """An upstream call's ``fn-*`` trailers (error type, logs), to pass on unchanged."""
    return tuple((k, v) for k, v in trailers or () if k.startswith("fn-"))


def caller_timeout(context: grpc.ServicerContext) -> float | None:
    """Seconds left before the caller's deadline, or None if it set none."""
    remaining = context.time_remaining()
    if remaining is None or remaining > _NO_DEADLINE:
        return None
    return float(remaining)


def caller_deadline(context: grpc.ServicerContext) -> float | None:
    remaining = caller_timeout(context)
    return None if remaining is None else time.monotonic() + remaining


def cancel_on_client_exit(context: grpc.ServicerContext) -> Callable[[Callable[[], object]], None]:
    """An on_dispatch hook: run `cancel` when the RPC ends early (client cancel or deadline).

    gRPC runs the callback ~0.2 ms after a client cancel (SPEC §3.1); when it runs after a normal
    completion, cancelling a finished call is a no-op.
    """

    def on_dispatch(cancel: Callable[[], object]) -> None:
        def callback() -> None:
            cancel()

        if not context.add_callback(callback):
            cancel()  # the RPC already ended

    return on_dispatch


def logs_trailer(logs: tuple[Any, ...]) -> bytes:
    """The last log lines that fit the trailer budget, as JSON [{stream, text}]."""
    kept: list[dict[str, str]] = []
    size = 2
    for line in reversed(logs):
        entry = {"stream": line.stream, "text": line.text}
        size += len(json.dumps(entry)) + 1
        if size > _MAX_LOGS_TRAILER:
            break
        kept.append(entry)
    return json.dumps(kept[::-1]).encode()


def _registration(view: RegistrationView) -> pb.FunctionRegistration:
    return pb.FunctionRegistration(run_uid=view.run_uid, registration_id=view.registration_id)


class FunctionRuntimeServicer(pb_grpc.FunctionRuntimeServicer):
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    @translate_errors
    def RegisterFunction(
        self, request: pb.RegisterFunctionRequest, context: grpc.ServicerContext
    ) -> pb.RegisterFunctionResponse:
        view = self.registry.register(
            run_uid=request.run_uid,
            registration_attempt=request.registration_attempt,
            working_dir=request.working_dir,
            handler=request.handler,
            env=dict(request.env),
            idle_timeout_seconds=request.idle_timeout_seconds,
            registration_digest=request.registration_digest,
        )
        return pb.RegisterFunctionResponse(registration=_registration(view), state=view.state)  # type: ignore[arg-type]

    @translate_errors
    def FunctionStatus(
        self, request: pb.FunctionStatusRequest, context: grpc.ServicerContext
    ) -> pb.FunctionStatusResponse:
        view = self.registry.status(
            run_uid=request.registration.run_uid,
            registration_id=request.registration.registration_id,
        )
        return pb.FunctionStatusResponse(
            registration=_registration(view),
            state=view.state,  # type: ignore[arg-type]
            in_flight=view.in_flight,
            last_activity_unix_nano=view.last_activity_unix_nano,
            fatal_error=view.fatal_error,
        )

    @translate_errors
    def InvokeFunction(
        self, request: pb.InvokeFunctionRequest, context: grpc.ServicerContext
    ) -> pb.InvokeFunctionResponse:
        invocation = self.registry.invoke(
            run_uid=request.registration.run_uid,
            registration_id=request.registration.registration_id,
            invocation_id=request.invocation_id,
            input=request.input,
            content_type=request.content_type,
            timeout_millis=request.timeout_millis,
            deadline=caller_deadline(context),
            on_dispatch=cancel_on_client_exit(context),
        )
        result = invocation.result
        if result.logs:
            context.set_trailing_metadata(((LOGS_KEY, logs_trailer(result.logs)),))
        return pb.InvokeFunctionResponse(
            registration=request.registration,
            invocation_id=invocation.invocation_id,
            output=result.output,
            content_type=result.content_type,
            outputs=result.outputs,
        )

    @translate_errors
    def UnregisterFunction(
        self, request: pb.UnregisterFunctionRequest, context: grpc.ServicerContext
    ) -> pb.UnregisterFunctionResponse:
        self.registry.unregister(
            run_uid=request.registration.run_uid,
            registration_id=request.registration.registration_id,
            cancel_in_flight=request.cancel_in_flight,
            drain_timeout_millis=request.drain_timeout_millis,
        )
        return pb.UnregisterFunctionResponse(registration=request.registration)


class RuntimeServicer(pb_grpc.RuntimeServicer):
    """The base one-shot service (SPEC §2)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    @translate_errors
    def Execute(
        self, request: pb.ExecuteRequest, context: grpc.ServicerContext
    ) -> pb.ExecuteResponse:
        outcome = execute(
            self.registry.adapter_cls,
            self.registry.workspace_root,
            run_uid=request.run_uid,
            working_dir=request.working_dir,
            handler=request.handler,
            env=dict(request.env),
            input=request.input,
            content_type=request.content_type,
            timeout_millis=request.timeout_millis,
            deadline=caller_deadline(context),
            on_dispatch=cancel_on_client_exit(context),
        )
        return pb.ExecuteResponse(
            output=outcome.output,
            content_type=outcome.content_type,
            outputs=outcome.outputs,
            exit_code=outcome.exit_code,
        )
