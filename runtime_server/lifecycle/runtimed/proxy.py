"""runtimed's own gRPC ports, the proxy hop (docs/protocol.md, "Runs"; docs/architecture.md, "The
proxy hop"): InvokeFunction and FunctionStatus arrive with a run_uid and an empty
registration_id; runtimed fills in the active registration and calls its colocated server.
The caller names the pod it routed to in ``x-fn-pod`` (the routing fence). The servicers use
the agent only through ``Agent``.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health

from fnkernel.runtime_server import callstream, limits, tracing
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import (
    batches_pb2,
    batches_pb2_grpc,
    logs_pb2,
    logs_pb2_grpc,
    payloads_pb2,
    payloads_pb2_grpc,
)
from fnkernel.runtime_server.errors import (
    InvalidField,
    InvocationNotFound,
    NotAllowedHere,
    RegistrationLost,
    RegistrationNotFound,
    RoutedElsewhere,
)
from fnkernel.runtime_server.function_runtime.server import (
    BATCHES_SERVICE,
    FUNCTION_RUNTIME_SERVICE,
    INVOCATION_LOGS_SERVICE,
    PAYLOADS_SERVICE,
)
from fnkernel.runtime_server.lifecycle.runs import (
    Run,
)
from fnkernel.runtime_server.lifecycle.runtimed.server import Active
from fnkernel.runtime_server.pipeline import Pipeline, ServedCall, served_call
from fnkernel.runtime_server.rpc import (
    CHANNEL_OPTIONS,
    CancellableCalls,
    Followers,
    add_health,
    add_reflection,
    caller_timeout,
    metadata_value,
    relayed_trailers,
    trailer_value,
)
from fnkernel.runtime_server.wire import (
    ATTEMPT_KEY,
    COLD_START_KEY,
    DIGEST_KEY,
    INPUT_REF_KEY,
    OUTPUT_REF_FROM_KEY,
    POD_KEY,
    SPANS_KEY,
    TIMELINE_RUNTIMED_KEY,
)

LOG = logging.getLogger("fnkernel.runtimed")
PROXY_THREADS = 32  # the calls runtimed's gRPC port serves at once


class Agent(Protocol):
    """What the proxy hop asks of runtimed (``Runtimed``)."""

    calls: CancellableCalls[callstream.Invoke]  # its server's InvokeFunction ("Call streams")
    server_stub: pb_grpc.FunctionRuntimeStub
    logs_stub: logs_pb2_grpc.InvocationLogsStub
    payloads_stub: payloads_pb2_grpc.PayloadsStub
    batches_stub: batches_pb2_grpc.BatchesStub

    def fenced_run(self, run_uid: str, routed_to: str | None) -> Run: ...

    def active(self, run: Run) -> Active | None: ...

    def ready(self, run_uid: str, routed_to: str | None) -> tuple[Run, Active] | None: ...

    def resolve(
        self, run_uid: str, routed_to: str | None, *, fast: bool = True
    ) -> tuple[Run, Active, bool]: ...

    def served(self, run: Run, active: Active) -> None: ...

    def call_cut_off(self, run: Run, active: Active, invocation_id: str) -> None: ...

    def registration_lost(self, run: Run, active: Active, how: str = "") -> None: ...


def judged_by_fence(exc: BaseException) -> str:
    """How the routing fence judged a failed InvokeFunction (docs/protocol.md, fence table): it
    refused a call routed to the wrong pod; any other failure it did not judge ("")."""
    return f"refused: {type(exc).__name__}" if isinstance(exc, RoutedElsewhere) else ""


def _outside_id(run_uid: str, registration_id: str, field: str = "") -> None:
    """What a caller of runtimed names: the Run UID, and never the registration ID, which
    runtimed fills in (`field`: the message's field holding the two, "" for the message's own)."""
    if registration_id:
        raise InvalidField(
            f"{field}registration_id",
            "must be empty at runtimed: the proxy hop fills in the active registration",
        )
    if not run_uid:
        raise InvalidField(f"{field}run_uid", "must not be empty")


class RelayedInvoke:
    """An InvokeFunction request as the proxy hop relays it (docs/architecture.md, "The proxy
    hop"): read for the fence, its bytes passed on as they came with what the hop fills in
    appended (``forwarded``), never serialized again; the server's answer goes back as its
    bytes too. Protobuf merges a message given twice, field by field, the last scalar winning."""

    __slots__ = ("data", "message")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.message = pb.InvokeFunctionRequest.FromString(data)

    # What the hop's span is attributed with (``tracing.invoke_hop``), as the message's.
    @property
    def registration(self) -> pb.FunctionRegistration:
        return self.message.registration

    @property
    def invocation_id(self) -> str:
        return self.message.invocation_id

    def forwarded(self, registration_id: str, timeout_millis: int) -> bytes:
        """The request with the active `registration_id` filled in (and `timeout_millis`, if
        not 0, in place of the caller's)."""
        filled = pb.InvokeFunctionRequest(
            registration=pb.FunctionRegistration(registration_id=registration_id),
            timeout_millis=timeout_millis,
        )
        return self.data + filled.SerializeToString()


def invoked_run(request: RelayedInvoke) -> str:
    """The Run UID a proxied InvokeFunction names (and never a registration ID)."""
    registration = request.message.registration
    _outside_id(registration.run_uid, registration.registration_id, "registration.")
    return registration.run_uid


def relayed(
    request: RelayedInvoke, timeout: float | None, active: Active, call: ServedCall
) -> tuple[bytes, tuple[tuple[str, str], ...]]:
    """The proxy hop's call onward of `request` (its caller's deadline `timeout` seconds away,
    or none) on the registration `active`: the request's bytes and its metadata."""
    hop, traceparent = call.hop, ""
    if hop is not None:  # the routing fence passed, and the registration ID is filled in
        hop.set(tracing.FENCE, "passed")
        hop.set(tracing.REGISTRATION_ID, active.registration_id)
        hop.set(tracing.REGISTRATION_ATTEMPT, active.attempt)
        traceparent = hop.call(tracing.INVOKE_SPAN, tracing.rpc_attributes("InvokeFunction"))
    timeout_millis = 0  # the caller's, as it came
    if timeout is not None:
        # docs/protocol.md: runtimed bounds timeout_millis by the caller's (gateway's) deadline.
        bound = max(1, int(timeout * 1000))
        timeout_millis = min(limits.effective_timeout_millis(request.message.timeout_millis), bound)
    forwarded = request.forwarded(active.registration_id, timeout_millis)
    # fnkernel's own metadata of a large payload passes on as it came ("Large payloads").
    upstream = call.upstream(traceparent)
    if call.input_ref:
        upstream += ((INPUT_REF_KEY, call.input_ref),)
    if call.output_from:
        upstream += ((OUTPUT_REF_FROM_KEY, call.output_from),)
    return forwarded, upstream


def relay_failed(call: ServedCall, err: grpc.RpcError) -> None:
    """The call onward failed with `err`: a traced hop's span says so, with the server's spans."""
    if call.hop is not None:
        call.hop.called(err.code().value[0], trailer_value(err.trailing_metadata(), SPANS_KEY))


def relay_answered(call: ServedCall, trailers: Any, active: Active, cold: bool) -> None:
    """The call onward on `active` was answered with `trailers`: this hop's own go in the
    server's trailers — one metadata batch, not two (docs/protocol.md, "Proxy hop")."""
    metadata: tuple[tuple[str, str | bytes], ...] = ((ATTEMPT_KEY, str(active.attempt)),)
    if cold:
        metadata += ((COLD_START_KEY, "1"),)
    if call.hop is not None:
        call.hop.called(0, trailer_value(trailers, SPANS_KEY))
    call.trailers = metadata + relayed_trailers(trailers, {SPANS_KEY})


class ProxyServicer(pb_grpc.FunctionRuntimeServicer):
    """runtimed's own FunctionRuntime port (docs/protocol.md: the gateway routes here, never to a server)."""

    def __init__(self, runtimed: Agent) -> None:
        self.runtimed = runtimed

    def InvokeFunction(self, request: RelayedInvoke, context: grpc.ServicerContext) -> bytes:
        run_uid = invoked_run(request)
        routed_to = metadata_value(context, POD_KEY)
        run, active, cold = self.runtimed.resolve(run_uid, routed_to)
        try:
            return self._forward(request, context, run, active, cold)
        except grpc.RpcError as err:
            self.upstream_failed(err, request, run, active, caller_there=context.is_active())
        run, active, cold = self.runtimed.resolve(run_uid, routed_to, fast=False)
        return self._forward(request, context, run, active, cold)

    def upstream_failed(
        self,
        err: grpc.RpcError,
        request: RelayedInvoke,
        run: Run,
        active: Active,
        *,
        caller_there: bool,
    ) -> None:
        """What the server's failure `err` of `request` on `active` tells runtimed; raised again,
        but for a refusal before the call ran (the registration was just drained for idling,
        or superseded): then the caller resolves again under the run lock, once."""
        if err.code() == grpc.StatusCode.UNAVAILABLE and caller_there:
            # The call broke off with its caller still there: the server may have died.
            self.runtimed.call_cut_off(run, active, request.invocation_id or "a call")
            raise err
        if err.code() == grpc.StatusCode.NOT_FOUND:
            # The server restarted and lost the registration; the Run still exists, so
            # this is "come back soon" (503), never "no such function" (404).
            self.runtimed.registration_lost(run, active)
            raise RegistrationLost(
                f"run {run.uid}: its Runtime Server restarted; registering it again"
            ) from None
        if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise err

    def _forward(
        self,
        request: RelayedInvoke,
        context: grpc.ServicerContext,
        run: Run,
        active: Active,
        cold: bool,
    ) -> bytes:
        """Call the server with the active registration: its answer, as the server sent it."""
        call = served_call()
        timeout = caller_timeout(context)
        forwarded, upstream = relayed(request, timeout, active, call)
        # The caller went away: the call is cancelled, and the handler dies.
        try:
            response, answered = self.runtimed.calls.call(
                lambda invoke: invoke.with_call(
                    forwarded, timeout=timeout, metadata=upstream or None
                ),
                context,
            )
        except grpc.RpcError as err:
            relay_failed(call, err)
            raise
        relay_answered(call, answered.trailing_metadata(), active, cold)
        self.runtimed.served(run, active)
        return response

    def FunctionStatus(
        self, request: pb.FunctionStatusRequest, context: grpc.ServicerContext
    ) -> pb.FunctionStatusResponse:
        _outside_id(
            request.registration.run_uid, request.registration.registration_id, "registration."
        )
        run = self.runtimed.fenced_run(
            request.registration.run_uid, metadata_value(context, POD_KEY)
        )
        active = self.runtimed.active(run)
        if active is None:
            raise RegistrationNotFound(
                f"run {run.name} has no registration now ({run.status.phase})"
            )
        context.send_initial_metadata(
            ((DIGEST_KEY, active.digest), (ATTEMPT_KEY, str(active.attempt)))
        )
        forwarded = pb.FunctionStatusRequest()
        forwarded.CopyFrom(request)
        forwarded.registration.registration_id = active.registration_id
        wait = limits.status_wait_seconds(hops_below=1)
        return self.runtimed.server_stub.FunctionStatus(forwarded, timeout=wait)

    def RegisterFunction(
        self, request: pb.RegisterFunctionRequest, context: grpc.ServicerContext
    ) -> pb.RegisterFunctionResponse:
        raise NotAllowedHere("RegisterFunction is runtimed's own call; create a Run instead")

    def UnregisterFunction(
        self, request: pb.UnregisterFunctionRequest, context: grpc.ServicerContext
    ) -> pb.UnregisterFunctionResponse:
        raise NotAllowedHere("UnregisterFunction is runtimed's own call; delete the Run instead")


class BatchesProxyServicer(batches_pb2_grpc.BatchesServicer):
    """runtimed's relay of a batch of one Run's calls (docs/protocol.md, "Batches"): fenced and
    filled in as an invoke is, then each answer passed on as it comes, and each message of
    more items the caller sends on."""

    def __init__(self, runtimed: Agent) -> None:
        self.runtimed = runtimed

    def InvokeBatch(
        self,
        request_iterator: Iterator[batches_pb2.InvokeBatchRequest],
        context: grpc.ServicerContext,
    ) -> Iterator[batches_pb2.BatchAnswers]:
        first = next(request_iterator, None)
        if first is None:
            return  # nothing sent: nothing to call
        _outside_id(first.run_uid, first.registration_id)
        routed_to = metadata_value(context, POD_KEY)
        run, active, _ = self.runtimed.resolve(first.run_uid, routed_to)
        later = _Later(request_iterator)
        try:
            yield from self._tried(first, later, routed_to, run, active, context)
        finally:
            later.close()

    def _tried(
        self,
        first: batches_pb2.InvokeBatchRequest,
        later: _Later,
        routed_to: str | None,
        run: Run,
        active: Active,
        context: grpc.ServicerContext,
    ) -> Iterator[batches_pb2.BatchAnswers]:
        """The relayed batch's answers; tried again, once, if refused before its first call. The
        caller's later messages go on from the try that has an answer (``_Later``)."""
        for again in (False, True):
            answered = False
            try:
                for answer in self._relayed(first, later.view(), context, active):
                    if not answered:
                        answered = True
                        later.settle()  # no try after an answer: the caller's next messages go on
                    yield answer
            except grpc.RpcError as err:
                if again or answered or err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    self._failed(err, run, active, context)
                    raise
                # Refused before its first call (drained for idling, say): resolve again, once,
                # as InvokeFunction does, and send the server what the caller sent so far.
                run, active, _ = self.runtimed.resolve(first.run_uid, routed_to, fast=False)
            else:
                break
        self.runtimed.served(run, active)

    def _relayed(
        self,
        first: batches_pb2.InvokeBatchRequest,
        later: Iterator[batches_pb2.InvokeBatchRequest],
        context: grpc.ServicerContext,
        active: Active,
    ) -> Iterator[batches_pb2.BatchAnswers]:
        forwarded = batches_pb2.InvokeBatchRequest()
        forwarded.CopyFrom(first)
        forwarded.registration_id = active.registration_id
        sent = iter((forwarded,)) if first.last else itertools.chain((forwarded,), later)
        answers = self.runtimed.batches_stub.InvokeBatch(sent, timeout=caller_timeout(context))
        context.add_callback(answers.cancel)  # the caller left: its item is cancelled
        yield from answers

    def _failed(
        self, err: grpc.RpcError, run: Run, active: Active, context: grpc.ServicerContext
    ) -> None:
        """What a broken-off or lost batch tells runtimed, as a proxied invoke's would."""
        if err.code() == grpc.StatusCode.UNAVAILABLE and context.is_active():
            self.runtimed.call_cut_off(run, active, "a batch")
        elif err.code() == grpc.StatusCode.NOT_FOUND:
            self.runtimed.registration_lost(run, active)
            raise RegistrationLost(
                f"run {run.uid}: its Runtime Server restarted; registering it again"
            ) from None


class _Later:
    """The messages a caller sends after a batch's first, for the try upstream to send on
    (``view``), none of them read from the caller before the batch has an answer (``settle``):
    a try refused before its first call is made again, once, and its view then ends, having
    taken no message the second try must send."""

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source
        self._ready = threading.Condition()
        self._settled = False
        self._views = 0  # the newest view's number: an older one ends

    def settle(self) -> None:
        with self._ready:
            self._settled = True
            self._ready.notify_all()

    def close(self) -> None:
        """The relay is over (answered, failed, or its caller gone): a view still waiting ends."""
        with self._ready:
            self._views += 1
            self._ready.notify_all()

    def view(self) -> Iterator[Any]:
        """The messages for a try that begins now; an older try's view ends."""
        with self._ready:
            self._views += 1
            self._ready.notify_all()
            return self._sent(self._views)

    def _sent(self, mine: int) -> Iterator[Any]:
        with self._ready:
            self._ready.wait_for(lambda: self._settled or mine != self._views)
            if mine != self._views:
                return
        yield from self._source


class LogsProxyServicer(logs_pb2_grpc.InvocationLogsServicer):
    """runtimed's relay of an invocation's live log lines (docs/protocol.md, "Live output"):
    fenced and filled in as an invoke is, then passed through record by record."""

    def __init__(self, runtimed: Agent) -> None:
        self.runtimed = runtimed
        self.followers = Followers()

    def FollowInvocationLogs(
        self, request: logs_pb2.FollowInvocationLogsRequest, context: grpc.ServicerContext
    ) -> Iterator[logs_pb2.InvocationLogRecord]:
        yield from self.followers.stream(lambda: self._relayed(request, context), context)

    def _relayed(
        self, request: logs_pb2.FollowInvocationLogsRequest, context: grpc.ServicerContext
    ) -> Iterator[logs_pb2.InvocationLogRecord]:
        _outside_id(request.run_uid, request.registration_id)
        run = self.runtimed.fenced_run(request.run_uid, metadata_value(context, POD_KEY))
        active = self.runtimed.active(run)
        if active is None:
            raise InvocationNotFound(f"run {run.name} has no registration now ({run.status.phase})")
        forwarded = logs_pb2.FollowInvocationLogsRequest()
        forwarded.CopyFrom(request)
        forwarded.registration_id = active.registration_id
        records = self.runtimed.logs_stub.FollowInvocationLogs(
            forwarded, timeout=caller_timeout(context)
        )
        context.add_callback(records.cancel)  # the caller left: so does the upstream stream
        yield from records


class PayloadsProxyServicer(payloads_pb2_grpc.PayloadsServicer):
    """runtimed's relay of its server's spool (docs/protocol.md, "Large payloads"): a payload
    belongs to the node, not to a registration, so nothing is filled in; each chunk is passed
    on as it comes, never the whole payload held."""

    def __init__(self, runtimed: Agent) -> None:
        self.runtimed = runtimed

    def PutPayload(
        self, request_iterator: Iterator[payloads_pb2.PayloadChunk], context: grpc.ServicerContext
    ) -> payloads_pb2.PayloadRef:
        return self.runtimed.payloads_stub.PutPayload(
            request_iterator, timeout=caller_timeout(context)
        )

    def TakePayload(
        self, request: payloads_pb2.PayloadRef, context: grpc.ServicerContext
    ) -> Iterator[payloads_pb2.PayloadChunk]:
        chunks = self.runtimed.payloads_stub.TakePayload(request, timeout=caller_timeout(context))
        context.add_callback(chunks.cancel)  # the caller left: so does the upstream stream
        yield from chunks


def proxy_ports(
    runtimed: Agent,
) -> tuple[grpc.Server, health.HealthServicer, Pipeline, ProxyServicer]:
    """runtimed's gRPC server, not yet bound: the proxy hop's FunctionRuntime, the relays of
    live output, of the spool and of batches, health and reflection; its call pipeline, which
    stops it; and its FunctionRuntime servicer, whose relay its call streams share."""
    pipeline = Pipeline(
        (FUNCTION_RUNTIME_SERVICE, INVOCATION_LOGS_SERVICE, PAYLOADS_SERVICE, BATCHES_SERVICE),
        component="runtimed",
        timeline_key=TIMELINE_RUNTIMED_KEY,
        fence=judged_by_fence,
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=PROXY_THREADS, thread_name_prefix="proxy"),
        interceptors=[pipeline],
        options=CHANNEL_OPTIONS,
    )
    proxy = ProxyServicer(runtimed)
    _add_proxy_servicer(proxy, server)
    logs_pb2_grpc.add_InvocationLogsServicer_to_server(LogsProxyServicer(runtimed), server)
    payloads_pb2_grpc.add_PayloadsServicer_to_server(PayloadsProxyServicer(runtimed), server)
    batches_pb2_grpc.add_BatchesServicer_to_server(BatchesProxyServicer(runtimed), server)
    checks = add_health(server, [FUNCTION_RUNTIME_SERVICE])
    add_reflection(
        server,
        [
            FUNCTION_RUNTIME_SERVICE,
            INVOCATION_LOGS_SERVICE,
            PAYLOADS_SERVICE,
            BATCHES_SERVICE,
            callstream.SERVICE,
            health.SERVICE_NAME,
        ],
    )
    return server, checks, pipeline, proxy


def _add_proxy_servicer(servicer: ProxyServicer, server: grpc.Server) -> None:
    """FunctionRuntime's four methods as ``pb_grpc.add_FunctionRuntimeServicer_to_server`` adds
    them, but InvokeFunction's request read as a ``RelayedInvoke`` and its answer, the
    server's bytes, sent as they are."""
    messages: dict[str, tuple[Any, Any]] = {
        "RegisterFunction": (pb.RegisterFunctionRequest, pb.RegisterFunctionResponse),
        "FunctionStatus": (pb.FunctionStatusRequest, pb.FunctionStatusResponse),
        "UnregisterFunction": (pb.UnregisterFunctionRequest, pb.UnregisterFunctionResponse),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )
        for name, (request, response) in messages.items()
    }
    handlers["InvokeFunction"] = grpc.unary_unary_rpc_method_handler(
        servicer.InvokeFunction, request_deserializer=RelayedInvoke
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(FUNCTION_RUNTIME_SERVICE, handlers),)
    )
    # As the generated code does; grpc's type stubs do not know the method yet.
    server.add_registered_method_handlers(FUNCTION_RUNTIME_SERVICE, handlers)  # type: ignore[attr-defined]
