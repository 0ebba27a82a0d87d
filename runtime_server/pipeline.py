"""A gRPC server's call pipeline (docs/architecture.md, "One call pipeline per hop"): every
method of its services has its failures answered as statuses, each InvokeFunction is a
``ServedCall`` (the timeline and the trace its caller asked of the hop), and the RPCs in flight
are counted, so that the server stops as soon as they have ended."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from fnkernel.runtime_server import callstream, limits, tracing, wire
from fnkernel.runtime_server.rpc import (
    CallerContext,
    answer_failure,
    failure_status,
    traced_failure,
)


def _translated(behaviour: Callable[[Any, Any], Any], method: str) -> Callable[[Any, Any], Any]:
    def translated(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behaviour(request, context)
        except Exception as exc:
            answer_failure(exc, context, method)

    return translated


def _streamed(behaviour: Callable[[Any, Any], Any], method: str) -> Callable[[Any, Any], Any]:
    def streamed(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            yield from behaviour(request, context)
        except Exception as exc:
            answer_failure(exc, context, method)

    return streamed


_ASKED = frozenset(
    (wire.TIMELINE_KEY, wire.TRACEPARENT_KEY, wire.INPUT_REF_KEY, wire.OUTPUT_REF_FROM_KEY)
)


class ServedCall:
    """One InvokeFunction as a hop serves it: what the caller asked of this hop besides the call
    — its clock readings (docs/protocol.md, "Timeline": ``x-fn-timeline``) and its spans
    ("Tracing": a ``traceparent`` that is sampled). ``Pipeline`` begins it before the handler
    runs and answers it after; the handler reaches it by ``served_call()`` and puts on it what
    only it knows: the `trailers` to send and the `attributes` its span ends with."""

    __slots__ = (
        "_context",
        "_timeline_key",
        "attributes",
        "called",
        "hop",
        "input_ref",
        "output_from",
        "received",
        "trailers",
    )

    def __init__(
        self, component: str, timeline_key: str, request: Any, context: CallerContext
    ) -> None:
        self._context = context
        self._timeline_key = timeline_key  # this hop's readings' trailer
        # What the caller asked besides the call, read in one pass over its metadata: the
        # timeline, the trace context, and a large payload's references (docs/protocol.md,
        # "Large payloads": the spooled input's name, the size from which the output is one).
        asked = {key: value for key, value in context.invocation_metadata() if key in _ASKED}
        self.received = time.monotonic_ns() if asked.get(wire.TIMELINE_KEY) == "1" else 0
        self.input_ref = str(asked.get(wire.INPUT_REF_KEY, ""))
        self.output_from = str(asked.get(wire.OUTPUT_REF_FROM_KEY, ""))
        self.called = 0  # when a hop that calls another made its call (``upstream``)
        traceparent = str(asked[wire.TRACEPARENT_KEY]) if wire.TRACEPARENT_KEY in asked else None
        self.hop: tracing.Hop | None = (
            tracing.invoke_hop(component, traceparent, request)
            if tracing.traced(traceparent)
            else None
        )
        self.trailers: tuple[tuple[str, str | bytes], ...] = ()
        self.attributes: dict[str, Any] = {}

    def upstream(self, traceparent: str) -> tuple[tuple[str, str], ...]:
        """The metadata of this hop's own call onward: the timeline asked for again, and the
        context of its client span (`traceparent`; "" for none); stamps ``called``."""
        metadata: tuple[tuple[str, str], ...] = ((wire.TIMELINE_KEY, "1"),) if self.received else ()
        if self.received:
            self.called = time.monotonic_ns()
        if traceparent:
            metadata += ((wire.TRACEPARENT_KEY, traceparent),)
        return metadata

    def failed(self, exc: BaseException, fence: str) -> None:
        """The call fails with `exc`: a traced hop's span ends with the status it is answered
        with (`fence`: how this hop's fence judged it; "" if it did not)."""
        if self.hop is not None:
            if fence:
                self.hop.set(tracing.FENCE, fence)
            traced_failure(self.hop, exc)

    def answer(self) -> None:
        """Send the handler's `trailers` with this hop's own — its spans (finished with
        `attributes`) and its clock readings — as one metadata batch."""
        trailers = self.trailers
        if self.hop is not None:
            spans = self.hop.finish({"rpc.grpc.status_code": 0, **self.attributes})
            trailers += ((wire.SPANS_KEY, spans),)
        if self.received:
            readings = {"received": self.received}
            if self.called:
                readings["called"] = self.called
            readings["answered"] = time.monotonic_ns()
            trailers += ((self._timeline_key, wire.timeline_stamps(**readings)),)
        if trailers:
            self._context.set_trailing_metadata(trailers)


_SERVED: contextvars.ContextVar[ServedCall] = contextvars.ContextVar("fnkernel_served_call")
INVOKE_METHOD = "InvokeFunction"


def served_call() -> ServedCall:
    """The InvokeFunction call this thread serves (begun by the server's ``Pipeline``)."""
    return _SERVED.get()


class Pipeline(grpc.ServerInterceptor):
    """A gRPC server's call pipeline (docs/architecture.md, "One call pipeline per hop"): each
    method of `services` has its errors answered as statuses (``answer_failure``); and where
    `component` is given, each InvokeFunction a ``ServedCall`` — begun before the handler runs,
    answered after it returns, failed with the status it raised (`fence`: how this hop's fence
    judged that failure, docs/protocol.md's fence table)."""

    def __init__(
        self,
        services: Iterable[str],
        *,
        component: str = "",
        timeline_key: str = "",
        fence: Callable[[BaseException], str] = lambda exc: "",
    ) -> None:
        self._services = frozenset(services)
        self._component = component
        self._timeline_key = timeline_key
        self._fence = fence
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self._calls = threading.Condition()  # guards _active, the RPCs of `services` in flight
        self._active = 0
        # docs/protocol.md, "Call streams": InvokeFunction's calls on streams, at most so many
        # open; each call counted in flight as its RPC would be, not the stream that carries it.
        self._streams = threading.BoundedSemaphore(limits.MAX_CALL_STREAMS)
        self._stream: tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler] | None = None

    def stop(self, server: grpc.Server, grace: float) -> None:
        """Stop `server`: new RPCs refused, those of its services in flight given `grace`
        seconds, and no longer than they take. grpc's own grace also waits out each connection
        a client keeps open and idle, which a client on grpc's legacy poller reads no goodbye on
        (docs/architecture.md, "grpc's I/O engine"): a server with nothing in flight waited
        its whole grace, past a kernel's patience to shut down."""
        stopped = server.stop(grace)
        with self._calls:
            self._calls.wait_for(lambda: not self._active, timeout=grace)
        server.stop(None)  # what is left is idle connections (and health, reflection)
        stopped.wait()

    def _begun(self, context: grpc.ServicerContext) -> None:
        """Count the RPC of `context` in flight until it terminates: its status sent, not its
        handler returned (a stop then would cut off the answer)."""
        with self._calls:
            self._active += 1
        if not context.add_callback(self._ended):  # it has terminated already
            self._ended()

    def _ended(self) -> None:
        with self._calls:
            self._active -= 1
            if not self._active:
                self._calls.notify_all()

    def _counted(self, behaviour: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def counted(request: Any, context: grpc.ServicerContext) -> Any:
            self._begun(context)
            return behaviour(request, context)

        return counted

    def _counted_stream(self, behaviour: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def counted(request: Any, context: grpc.ServicerContext) -> Any:
            self._begun(context)
            yield from behaviour(request, context)

        return counted

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method == callstream.STREAM_PATH:
            return self._call_stream(continuation)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        # A method's handler is the same object call after call: wrap it once (a wrapper built
        # per call cost ~10 us of it, measured by benchmarks/interceptor.py).
        known = self._wrapped.get(handler_call_details.method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = self._wrap(handler, handler_call_details.method)
        self._wrapped[handler_call_details.method] = (handler, wrapped)
        return wrapped

    def _call_stream(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None]
    ) -> grpc.RpcMethodHandler | None:
        """The InvokeFunctions handler: each message through this pipeline's InvokeFunction
        (none where there is none, or where it is not a hop that serves calls)."""
        invoke = self.intercept_service(continuation, _InvokeCall()) if self._component else None
        if invoke is None:
            return None
        if self._stream is None or self._stream[0] is not invoke:
            self._stream = (invoke, callstream.serve(invoke, self._streams))
        return self._stream[1]

    def _wrap(self, handler: grpc.RpcMethodHandler, path: str) -> grpc.RpcMethodHandler:
        service, _, method = path.lstrip("/").rpartition("/")
        if service not in self._services:
            return handler
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._counted_stream(_streamed(handler.unary_stream, method)),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:  # a batch's: the caller's messages, its answers
            return grpc.stream_stream_rpc_method_handler(
                self._counted_stream(_streamed(handler.stream_stream, method)),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary is not None:  # its request is the caller's stream of messages
            return grpc.stream_unary_rpc_method_handler(
                self._counted(_translated(handler.stream_unary, method)),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_unary is None:
            return handler
        if method == INVOKE_METHOD and self._component:
            behaviour = self._served(handler.unary_unary)
        else:
            behaviour = _translated(handler.unary_unary, method)
        return grpc.unary_unary_rpc_method_handler(
            self._counted(behaviour),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _served(self, behaviour: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def served(request: Any, context: grpc.ServicerContext) -> Any:
            call = self.serving(request, context)
            token = _SERVED.set(call)
            try:
                response = behaviour(request, context)
            except Exception as exc:
                call.failed(exc, self._fence(exc))
                answer_failure(exc, context, INVOKE_METHOD)
            finally:
                _SERVED.reset(token)
            call.answer()
            return response

        return served

    # For a hop that serves InvokeFunction outside grpcio's server (runtimed's call streams on
    # an event loop: docs/architecture.md, "Call streams"), the same pipeline, step by step.

    def serving(self, request: Any, context: CallerContext) -> ServedCall:
        """Begin serving the InvokeFunction `request`, its metadata and trailers `context`'s."""
        return ServedCall(self._component, self._timeline_key, request, context)

    def failure(
        self, call: ServedCall, exc: Exception
    ) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str | bytes], ...]]:
        """`call` failed with `exc`: the status and trailers it is answered with."""
        call.failed(exc, self._fence(exc))
        return failure_status(exc, INVOKE_METHOD)

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """Count a call in flight, as an RPC's is, until the block ends (its answer sent)."""
        with self._calls:
            self._active += 1
        try:
            yield
        finally:
            self._ended()


class _InvokeCall(grpc.HandlerCallDetails):
    """The grpc.HandlerCallDetails by which a call stream finds the server's InvokeFunction."""

    method = callstream.INVOKE_PATH
    invocation_metadata: tuple[tuple[str, str], ...] = ()
