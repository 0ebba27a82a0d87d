"""The spans of one call, hop by hop, on OpenTelemetry's conventions (docs/protocol.md, "Tracing").

A call that carries a W3C ``traceparent`` (the HTTP header, or the gRPC metadata key of the same
name) is traced: each hop records its spans with the OpenTelemetry SDK — a server span for the
call it received, a client span for the call it makes, both named and attributed as
OpenTelemetry's semantic conventions say for RPC and HTTP — and passes the context of its client
span on. On the way back each hop hands its caller its own spans and those it was handed, OTLP
encoded (``ExportTraceServiceRequest``, the format every OpenTelemetry backend reads), in the
``fn-spans-bin`` trailer or the gateway's ``X-Fn-Spans`` header: the caller that asked gets the
whole call's trace without a collector.

The Runtime Server records the worker's span on its behalf (a worker imports no OpenTelemetry)
and hands the worker that span's ``traceparent`` for the handler (``Hop.delegate``).
Work that happens apart from the call that asked for it — a registration, in runtimed; a KRM
render — is recorded only where it is exported (``recorded``), with a span per step; where it
is not, the ``Untraced`` hop records nothing, so that code needs no checks.

A call without ``traceparent`` costs a metadata lookup per hop and imports nothing: the SDK is
loaded on the first traced call (never by the kernel's start). With an OTLP endpoint in the
environment (``FNKERNEL_OTLP_ENDPOINT``, else OpenTelemetry's own ``OTEL_EXPORTER_OTLP_ENDPOINT``)
every call is traced — one without ``traceparent`` starts a trace at the gateway — and each
process exports its spans there over OTLP/gRPC, in batches, off the call's path.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fnkernel.runtime_server import limits, wire

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import Span, SpanProcessor
    from opentelemetry.trace import Tracer

# Our own attributes (OpenTelemetry's are used where one exists: rpc.*, http.*).
RUN_UID = "fnkernel.run_uid"
REGISTRATION_ID = "fnkernel.registration_id"
REGISTRATION_ATTEMPT = "fnkernel.registration_attempt"
INVOCATION_ID = "fnkernel.invocation_id"
FENCE = "fnkernel.fence"  # the fence's decision: "passed", or what it refused
RUNTIME = "fnkernel.runtime"
RUN_NAME = "fnkernel.run_name"
RUN_PHASE = "fnkernel.run_phase"
REGISTRATION_STATE = "fnkernel.registration_state"  # what RegisterFunction answered
SUPERSEDED = "fnkernel.superseded"  # the registration ID a higher attempt superseded

RPC_SERVICE = "executor.v1.FunctionRuntime"  # the proto's package and service
INVOKE_SPAN = f"{RPC_SERVICE}/InvokeFunction"  # OpenTelemetry's RPC span name: service/method
REGISTER_SPAN = f"{RPC_SERVICE}/RegisterFunction"

ENDPOINT_ENVS = ("FNKERNEL_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
# Read once, as each process starts: where its spans are exported ("" for nowhere).
EXPORT_ENDPOINT = next((os.environ[name] for name in ENDPOINT_ENVS if os.environ.get(name)), "")

_tracers: dict[str, Tracer] = {}
# Span processors given by exporting_to, which every tracer of this process hands its spans to.
_processors: list[SpanProcessor] = []


def _tracer(component: str) -> Tracer:
    """This process's tracer for `component`, its provider made on first use (exporting to
    EXPORT_ENDPOINT when there is one, and to the processors of exporting_to)."""
    if component not in _tracers:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

        class Handing(SpanProcessor):
            def on_start(self, span: Any, parent_context: Any = None) -> None:
                for processor in list(_processors):
                    processor.on_start(span, parent_context)

            def on_end(self, span: Any) -> None:
                for processor in list(_processors):
                    processor.on_end(span)

        resource = Resource({"service.name": f"fnkernel-{component}", "process.pid": os.getpid()})
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(Handing())
        if EXPORT_ENDPOINT:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            exporter = OTLPSpanExporter(endpoint=EXPORT_ENDPOINT)
            provider.add_span_processor(BatchSpanProcessor(exporter))
        _tracers[component] = provider.get_tracer("fnkernel")
    return _tracers[component]


@contextlib.contextmanager
def exporting_to(processor: SpanProcessor) -> Iterator[None]:
    """While the block runs, this process records every call and every registration and KRM
    step, as it does with an endpoint, and hands each span to `processor` as well (an
    OpenTelemetry span processor: a program that runs the components in its own process, with
    its own exporter; a test, with OpenTelemetry's in-memory one)."""
    _processors.append(processor)
    try:
        yield
    finally:
        _processors.remove(processor)


def exporting() -> bool:
    """Whether this process exports the spans it records (to an endpoint, or a processor)."""
    return bool(EXPORT_ENDPOINT or _processors)


def traced(traceparent: str | None) -> bool:
    """Whether a call with this `traceparent` (None: none) is traced here."""
    return bool(traceparent or EXPORT_ENDPOINT or _processors)


def rpc_attributes(method: str) -> dict[str, Any]:
    """OpenTelemetry's RPC span attributes for a FunctionRuntime method."""
    return {"rpc.system": "grpc", "rpc.service": RPC_SERVICE, "rpc.method": method}


def invoke_hop(component: str, traceparent: str | None, request: Any) -> Hop:
    """The Hop of an InvokeFunction call `request` received: its server span, attributed with
    the run UID, registration ID and invocation ID the request carries."""
    return Hop(component, traceparent, INVOKE_SPAN, {
        **rpc_attributes("InvokeFunction"),
        RUN_UID: request.registration.run_uid,
        REGISTRATION_ID: request.registration.registration_id,  # "" at runtimed: not filled in
        INVOCATION_ID: request.invocation_id,
    })  # fmt: skip


def recorded(
    component: str,
    traceparent: str | None,
    name: str,
    attributes: dict[str, Any],
    *,
    kind: str = "SERVER",
) -> Hop | Untraced:
    """The Hop of work whose spans are exported, never handed back (a registration, a KRM
    render): recorded only where this process exports (`exporting`), in the trace of
    `traceparent` if there is one; else nothing is recorded (Untraced)."""
    if not exporting():
        return UNTRACED
    return Hop(component, traceparent, name, attributes, kind=kind)


class Hop:
    """One hop's spans of a traced call: its server span (the call it received) and, under it,
    a client span while it calls the next hop, the span of work it delegates, and its steps.
    `finish` ends them and gives the spans to hand back."""

    def __init__(
        self,
        component: str,
        traceparent: str | None,
        name: str,
        attributes: dict[str, Any],
        *,
        kind: str = "SERVER",  # OpenTelemetry's SpanKind: INTERNAL for work nobody called for
    ) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = _tracer(component)
        # none (exporting, an untraced caller): this hop's span starts a trace of its own
        parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent or ""})
        self.span: Span = self._tracer.start_span(  # type: ignore[assignment]
            name, context=parent, kind=getattr(trace.SpanKind, kind), attributes=attributes
        )
        self._client: Span | None = None
        self._delegate: Span | None = None
        self._spans: list[Span] = [self.span]
        self._downstream: list[bytes] = []

    def set(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)

    @property
    def traceparent(self) -> str:
        """This hop's span's context, for work it asks for that is done later (a Run's)."""
        return _traceparent(self.span)

    @contextlib.contextmanager
    def step(self, name: str, attributes: dict[str, Any] | None = None) -> Iterator[None]:
        """One step of this hop's work: an internal span, the child of the hop's, failed with
        the exception that ends the step, if one does."""
        from opentelemetry import trace

        span = self._child(self._tracer, name, trace.SpanKind.INTERNAL, attributes or {})
        try:
            yield
        except BaseException as exc:
            _failed(span, why(exc))
            raise
        finally:
            span.end()

    def ended(self, name: str, attributes: dict[str, Any], seconds: float, error: str = "") -> None:
        """A step of this hop's work that took `seconds` and ended just now (`error`: why it
        failed), recorded once it is over: an internal span, the child of the hop's."""
        from opentelemetry import trace

        now = time.time_ns()
        span = self._child(
            self._tracer, name, trace.SpanKind.INTERNAL, attributes, now - int(seconds * 1e9)
        )
        if error:
            _failed(span, error)
        span.end(end_time=now)
        self._spans.append(span)

    def call(self, name: str, attributes: dict[str, Any]) -> str:
        """Start the client span of the call to the next hop; its ``traceparent``."""
        from opentelemetry import trace

        self._client = self._child(self._tracer, name, trace.SpanKind.CLIENT, attributes)
        return _traceparent(self._client)

    def delegate(self, component: str, name: str, attributes: dict[str, Any]) -> str:
        """Start the span of the work `component` does for this hop, recorded here on its
        behalf (a worker imports no OpenTelemetry): a server span of that component's, the
        child of this hop's. Its ``traceparent``, for the component to hand its code;
        `delegated` ends it."""
        from opentelemetry import trace

        self._delegate = self._child(_tracer(component), name, trace.SpanKind.SERVER, attributes)
        return _traceparent(self._delegate)

    def delegated(self, error: str = "") -> None:
        """The delegated work is over (`error`: why it failed)."""
        if self._delegate is not None and self._delegate.is_recording():
            if error:
                _failed(self._delegate, error)
            self._delegate.end()

    def _child(
        self,
        tracer: Tracer,
        name: str,
        kind: Any,
        attributes: dict[str, Any],
        start_time: int | None = None,  # Unix ns; None: now
    ) -> Span:
        from opentelemetry import trace

        context = trace.set_span_in_context(self.span)
        span: Span = tracer.start_span(  # type: ignore[assignment]
            name, context=context, kind=kind, attributes=attributes, start_time=start_time
        )
        self._spans.append(span)
        return span

    def called(self, grpc_status: int, downstream: bytes | None) -> None:
        """The next hop answered with `grpc_status` (0: OK) and handed back `downstream`."""
        if self._client is not None:
            self._client.set_attribute("rpc.grpc.status_code", grpc_status)
            if grpc_status:
                named = grpc_status < len(wire.GRPC_CODE_NAMES)
                _failed(
                    self._client,
                    wire.GRPC_CODE_NAMES[grpc_status] if named else f"gRPC status {grpc_status}",
                )
            self._client.end()
        if downstream:
            self._downstream.append(downstream)

    def finish(self, attributes: dict[str, Any], error: str = "") -> bytes:
        """End the hop's spans with `attributes` (`error`: why it failed); its spans and those
        handed to it, as one OTLP ``ExportTraceServiceRequest``."""
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        for key, value in attributes.items():
            self.span.set_attribute(key, value)
        if error:
            _failed(self.span, error)
        for span in self._spans[1:]:  # a call or delegated work cut short by this hop's end
            if span.is_recording():
                span.end()
        self.span.end()
        # Serialized protobuf messages concatenated are one message with their repeated fields
        # joined: the spans handed to us are passed on without being parsed.
        return b"".join((encode_spans(self._spans).SerializeToString(), *self._downstream))


@contextlib.contextmanager
def finishing(hop: Hop | Untraced) -> Iterator[None]:
    """End `hop` as the block ends, failed with the exception that ends it, if one does (its
    spans are exported, not handed back)."""
    try:
        yield
    except BaseException as exc:
        hop.finish({}, error=why(exc))
        raise
    hop.finish({})


class Untraced:
    """A Hop of work that is not traced: each of its methods does nothing."""

    traceparent = ""

    def set(self, key: str, value: Any) -> None:
        pass

    def step(
        self, name: str, attributes: dict[str, Any] | None = None
    ) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def ended(self, name: str, attributes: dict[str, Any], seconds: float, error: str = "") -> None:
        pass

    def call(self, name: str, attributes: dict[str, Any]) -> str:
        return ""

    def called(self, grpc_status: int, downstream: bytes | None) -> None:
        pass

    def delegate(self, component: str, name: str, attributes: dict[str, Any]) -> str:
        return ""

    def delegated(self, error: str = "") -> None:
        pass

    def finish(self, attributes: dict[str, Any], error: str = "") -> bytes:
        return b""


UNTRACED = Untraced()


def why(exc: BaseException) -> str:
    """A span's error status for work `exc` ended: its type and message, bounded."""
    return limits.bounded(f"{type(exc).__name__}: {exc}")


def _traceparent(span: Span) -> str:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier["traceparent"]


def _failed(span: Span, why: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, why))


def decode(data: bytes) -> list[dict[str, Any]]:
    """The spans of an OTLP ``ExportTraceServiceRequest``, flat and in start order: each with
    its ``service``, ``name``, ``kind``, ``traceId``, ``spanId``, ``parentSpanId`` (hex),
    ``start``/``end`` (Unix ns), ``attributes`` and ``status`` (``""`` or the error)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanMessage
    from opentelemetry.proto.trace.v1.trace_pb2 import Status as StatusMessage

    request = ExportTraceServiceRequest()
    request.ParseFromString(data)
    spans = []
    for resource_spans in request.resource_spans:
        service = next(
            (a.value.string_value for a in resource_spans.resource.attributes
             if a.key == "service.name"), "",
        )  # fmt: skip
        for scope in resource_spans.scope_spans:
            for span in scope.spans:
                failed = span.status.code == StatusMessage.STATUS_CODE_ERROR
                spans.append(
                    {
                        "service": service,
                        "name": span.name,
                        "kind": SpanMessage.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
                        "traceId": span.trace_id.hex(),
                        "spanId": span.span_id.hex(),
                        "parentSpanId": span.parent_span_id.hex(),
                        "start": span.start_time_unix_nano,
                        "end": span.end_time_unix_nano,
                        "attributes": {a.key: _value(a.value) for a in span.attributes},
                        "status": (span.status.message or "error") if failed else "",
                    }
                )
    return sorted(spans, key=lambda span: span["start"])


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None
