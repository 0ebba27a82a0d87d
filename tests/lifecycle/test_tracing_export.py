"""docs/protocol.md, "Tracing": with an OTLP endpoint in the environment, every component exports
the spans of every call over OTLP/gRPC — here to a collector this test runs (a test double of a
team's Jaeger or Tempo: OpenTelemetry's own TraceService, recording what it is sent)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from fnkernel.runtime_server import tracing
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import GatewayError
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.support import wait_until


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self._lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            self.spans += tracing.decode(request.SerializeToString())
        return trace_service_pb2.ExportTraceServiceResponse()

    def services(self) -> set[str]:
        with self._lock:
            return {span["service"] for span in self.spans}


@pytest.fixture
def collector() -> Iterator[tuple[Collector, str]]:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collector, f"http://127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture
def exporting(
    tmp_path: Path, collector: tuple[Collector, str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Collector, Client]]:
    """A stack whose components export to the collector, and a client of its gateway."""
    received, endpoint = collector
    monkeypatch.setenv("FNKERNEL_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # OpenTelemetry's batch delay, in ms
    stack = Stack(tmp_path / "state", {"python": 1}, gateway_listen="127.0.0.1:0")
    stack.start()
    try:
        yield received, Client(stack.gateway_address)
    finally:
        stack.stop()


def test_with_an_otlp_endpoint_every_component_exports_each_calls_spans(
    exporting: tuple[Collector, Client],
) -> None:
    """A call that carries no traceparent is traced all the same: its trace starts at the
    gateway, every hop's spans reach the collector parented along the path, and the caller,
    who did not ask, gets none back."""
    received, client = exporting
    handler = {"handler.py": "def handle(event):\n    return event\n"}
    client.create_run("echo", runtime="python", handler="handler.handle", files=handler)
    result = client.invoke("echo", {"n": 1})
    assert result.value() == {"n": 1} and result.spans == b""
    wanted = {"fnkernel-gateway", "fnkernel-runtimed", "fnkernel-runtime-server", "fnkernel-worker"}
    wait_until(lambda: received.services() >= wanted, timeout=20)
    root = next(
        span
        for span in received.spans
        if span["service"] == "fnkernel-gateway" and span["kind"] == "SERVER"
    )
    assert root["parentSpanId"] == ""  # no caller's context: the gateway began the trace
    trace = {span["spanId"]: span for span in received.spans if span["traceId"] == root["traceId"]}
    path = [(root["service"], root["kind"])]
    span = root
    while children := [s for s in trace.values() if s["parentSpanId"] == span["spanId"]]:
        (span,) = children
        path.append((span["service"], span["kind"]))
    assert path == [
        ("fnkernel-gateway", "SERVER"),
        ("fnkernel-gateway", "CLIENT"),
        ("fnkernel-runtimed", "SERVER"),
        ("fnkernel-runtimed", "CLIENT"),
        ("fnkernel-runtime-server", "SERVER"),
        ("fnkernel-worker", "SERVER"),
    ]
    assert span["attributes"]["faas.invocation_id"] == result.invocation_id


def test_a_call_whose_client_hangs_up_is_exported_as_cancelled(
    exporting: tuple[Collector, Client],
) -> None:
    """A client that goes away cancels its call (docs/protocol.md, "HTTP API"); the gateway's
    span of it still ends, as cancelled, and is exported with the rest."""
    received, client = exporting
    handler = {"handler.py": "import time\ndef handle(event):\n    time.sleep(30)\n"}
    client.create_run("slow", runtime="python", handler="handler.handle", files=handler)
    calling = threading.Thread(target=lambda: _swallow(client, "slow"), daemon=True)
    calling.start()
    wait_until(lambda: (client.status("slow").get("live") or {}).get("inFlight") == 1)
    client.cancel()  # the connection is shut down: the gateway sees its client leave

    def cancelled_span() -> bool:
        return any(
            span["service"] == "fnkernel-gateway"
            and span["kind"] == "SERVER"
            and span["status"] == "CANCELLED: the client went away"
            for span in list(received.spans)
        )

    wait_until(cancelled_span, timeout=20)
    calling.join(10)


def _swallow(client: Client, name: str) -> None:
    with contextlib.suppress(GatewayError):
        client.invoke(name, {})
