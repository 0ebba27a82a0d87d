"""An OTLP trace collector in the test's process: a test double of a team's Jaeger or Tempo
(OpenTelemetry's own TraceService, keeping every span it is sent), for the tracing tests and the
benchmarks that read a component's spans (docs/protocol.md, "Tracing")."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from fnkernel.runtime_server import tracing


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            self.spans += tracing.decode(request.SerializeToString())
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[dict[str, Any]]:
        """Every span received so far."""
        with self._lock:
            return list(self.spans)

    def services(self) -> set[str]:
        with self._lock:
            return {span["service"] for span in self.spans}


@contextlib.contextmanager
def collecting() -> Iterator[tuple[Collector, str]]:
    """A collector on a free loopback port, and its endpoint (``FNKERNEL_OTLP_ENDPOINT``)."""
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield collector, f"http://127.0.0.1:{port}"
    finally:
        server.stop(0)
