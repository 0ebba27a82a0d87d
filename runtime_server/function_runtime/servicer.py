"""gRPC servicers: a thin translation layer over the Registry (docs/protocol.md, "Services").

Requests become keyword calls, results become messages, and every error class maps to a status code
in GRPC_STATUS, the one table of it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc

from fnkernel.runtime_server import limits, tracing
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import (
    logs_pb2,
    logs_pb2_grpc,
    payloads_pb2,
    payloads_pb2_grpc,
    registrations_pb2,
    registrations_pb2_grpc,
)
from fnkernel.runtime_server.errors import (
    RegistrationNotFound,
    RegistrationNotReady,
    StaleRegistration,
)
from fnkernel.runtime_server.function_runtime.oneshot import execute
from fnkernel.runtime_server.function_runtime.registration import RegistrationView, state_name
from fnkernel.runtime_server.function_runtime.registry import Registry
from fnkernel.runtime_server.function_runtime.spool import Spool
from fnkernel.runtime_server.pipeline import served_call
from fnkernel.runtime_server.rpc import (
    Followers,
    caller_deadline,
    cancel_on_client_exit,
    failure_status,
    logs_trailer,
    metadata_value,
    traced_failure,
)
from fnkernel.runtime_server.wire import (
    LOGS_KEY,
    OUTPUT_REF_FROM_KEY,
    OUTPUT_REF_KEY,
    TRACEPARENT_KEY,
)

LOG = logging.getLogger("fnkernel.runtime")
# docs/protocol.md, fence table: what the registration fence refuses a call with.
REGISTRATION_FENCE = (RegistrationNotFound, StaleRegistration, RegistrationNotReady)


def judged_by_fence(exc: BaseException) -> str:
    """How the registration fence judged a failed InvokeFunction (its span's ``fence``): it
    refused the call, or let it pass to a handler that failed."""
    return f"refused: {type(exc).__name__}" if isinstance(exc, REGISTRATION_FENCE) else "passed"


def _registration(view: RegistrationView) -> pb.FunctionRegistration:
    return pb.FunctionRegistration(run_uid=view.run_uid, registration_id=view.registration_id)


def function_status(
    registry: Registry, request: pb.FunctionStatusRequest
) -> pb.FunctionStatusResponse:
    view = registry.status(
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


class FunctionRuntimeServicer(pb_grpc.FunctionRuntimeServicer):
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def RegisterFunction(
        self, request: pb.RegisterFunctionRequest, context: grpc.ServicerContext
    ) -> pb.RegisterFunctionResponse:
        # docs/protocol.md, "Tracing": a registration's spans are exported, never handed back.
        hop = tracing.recorded("runtime-server", metadata_value(context, TRACEPARENT_KEY), tracing.REGISTER_SPAN, {
            **tracing.rpc_attributes("RegisterFunction"),
            tracing.RUN_UID: request.run_uid,
            tracing.REGISTRATION_ATTEMPT: request.registration_attempt,
        })  # fmt: skip
        try:
            view = self.registry.register(
                run_uid=request.run_uid,
                registration_attempt=request.registration_attempt,
                working_dir=request.working_dir,
                handler=request.handler,
                env=dict(request.env),
                idle_timeout_seconds=request.idle_timeout_seconds,
                registration_digest=request.registration_digest,
                memory_mb=request.memory_mb,
                hop=hop,
            )
        except Exception as exc:
            traced_failure(hop, exc)
            raise
        hop.finish({
            "rpc.grpc.status_code": 0,
            tracing.REGISTRATION_ID: view.registration_id,
            tracing.REGISTRATION_STATE: state_name(view.state),
        })  # fmt: skip
        return pb.RegisterFunctionResponse(registration=_registration(view), state=view.state)  # type: ignore[arg-type]

    def FunctionStatus(
        self, request: pb.FunctionStatusRequest, context: grpc.ServicerContext
    ) -> pb.FunctionStatusResponse:
        return function_status(self.registry, request)

    def InvokeFunction(
        self, request: pb.InvokeFunctionRequest, context: grpc.ServicerContext
    ) -> pb.InvokeFunctionResponse:
        call = served_call()
        invocation = self.registry.invoke(
            run_uid=request.registration.run_uid,
            registration_id=request.registration.registration_id,
            invocation_id=request.invocation_id,
            input=request.input,
            content_type=request.content_type,
            timeout_millis=request.timeout_millis,
            deadline=caller_deadline(context),
            on_dispatch=cancel_on_client_exit(context),
            hop=call.hop or tracing.UNTRACED,
            # docs/protocol.md, "Large payloads": fnkernel's metadata, beside the seed's call
            input_ref=call.input_ref,
            output_from=limits.parse_count(call.output_from, OUTPUT_REF_FROM_KEY)
            if call.output_from
            else 0,
        )
        result = invocation.result
        trailers: tuple[tuple[str, str | bytes], ...] = ()
        if result.logs:
            trailers += ((LOGS_KEY, logs_trailer(result.logs)),)
        if invocation.output_ref:
            spool = self.registry.spool
            if spool is not None and not context.is_active():  # gone: nobody takes the result
                spool.remove(invocation.output_ref)
            trailers += ((OUTPUT_REF_KEY, f"{invocation.output_ref} {result.spooled}"),)
        call.trailers = trailers
        call.attributes = {tracing.FENCE: "passed", tracing.INVOCATION_ID: invocation.invocation_id}
        return pb.InvokeFunctionResponse(
            registration=request.registration,
            invocation_id=invocation.invocation_id,
            output=result.output,
            content_type=result.content_type,
            # None when there are none: filling a map field from even an empty dict goes through
            # a generic Python update, ~7 us of every call (docs/architecture.md, "The hot path").
            outputs=result.outputs or None,
        )

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


class RegistrationsServicer(registrations_pb2_grpc.RegistrationsServicer):
    """FunctionStatus of several registrations in one round trip: runtimed's poll of its Runs
    (docs/protocol.md, "Registration"). Each answer is what FunctionStatus would have answered."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def FunctionStatuses(
        self, request: registrations_pb2.FunctionStatusesRequest, context: grpc.ServicerContext
    ) -> registrations_pb2.FunctionStatusesResponse:
        answers = []
        for one in request.requests:
            try:
                answer = registrations_pb2.FunctionStatusAnswer(
                    status=function_status(self.registry, one)
                )
            except Exception as exc:
                code, message, _ = failure_status(exc, "FunctionStatus")
                answer = registrations_pb2.FunctionStatusAnswer(code=code.value[0], message=message)
            answers.append(answer)
        return registrations_pb2.FunctionStatusesResponse(answers=answers)

    def StopLoading(
        self, request: registrations_pb2.StopLoadingRequest, context: grpc.ServicerContext
    ) -> registrations_pb2.StopLoadingResponse:
        stopped = self.registry.stop_loading(
            run_uid=request.run_uid, registration_attempt=request.registration_attempt
        )
        return registrations_pb2.StopLoadingResponse(stopped=stopped)


class InvocationLogsServicer(logs_pb2_grpc.InvocationLogsServicer):
    """fnkernel's own stream of one invocation's log lines (docs/protocol.md, "Live output")."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.followers = Followers()

    def FollowInvocationLogs(
        self, request: logs_pb2.FollowInvocationLogsRequest, context: grpc.ServicerContext
    ) -> Iterator[logs_pb2.InvocationLogRecord]:
        yield from self.followers.stream(lambda: self._records(request, context), context)

    def _records(
        self, request: logs_pb2.FollowInvocationLogsRequest, context: grpc.ServicerContext
    ) -> Iterator[logs_pb2.InvocationLogRecord | None]:
        invocation_id, running, batches = self.registry.follow(
            run_uid=request.run_uid,
            registration_id=request.registration_id,
            invocation_id=request.invocation_id,
            wait=limits.FOLLOW_WAIT_SECONDS if request.follow else 0.0,
            caller_there=context.is_active,
        )
        yield logs_pb2.InvocationLogRecord(invocation_id=invocation_id, running=running)
        for batch in batches:
            for line in batch:
                yield logs_pb2.InvocationLogRecord(stream=line.stream, text=line.text, cut=line.cut)
            if not batch:
                yield None
            if not request.follow:
                return


class PayloadsServicer(payloads_pb2_grpc.PayloadsServicer):
    """fnkernel's own spool of payloads past one message (docs/protocol.md, "Large payloads"):
    an input streamed in before its call, an output streamed out after it."""

    def __init__(self, spool: Spool) -> None:
        self.spool = spool

    def PutPayload(
        self, request_iterator: Iterator[payloads_pb2.PayloadChunk], context: grpc.ServicerContext
    ) -> payloads_pb2.PayloadRef:
        first = next(request_iterator, None)
        size = first.size if first is not None else 0

        def chunks() -> Iterator[bytes]:
            if first is not None:
                yield first.data
            for chunk in request_iterator:
                yield chunk.data

        return payloads_pb2.PayloadRef(name=self.spool.put(size, chunks()), size=size)

    def TakePayload(
        self, request: payloads_pb2.PayloadRef, context: grpc.ServicerContext
    ) -> Iterator[payloads_pb2.PayloadChunk]:
        for data in self.spool.take(request.name):
            yield payloads_pb2.PayloadChunk(data=data)


class RuntimeServicer(pb_grpc.RuntimeServicer):
    """The base one-shot service (docs/protocol.md, "Services")."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

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
