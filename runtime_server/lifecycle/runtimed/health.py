"""runtimed's watch over its colocated server's health (docs/architecture.md, "Seams": pod
liveness), reported two ways: runtimed's own gRPC health, which a readiness probe reads (on
Kubernetes, the pod's liveness), and the pod's heartbeat in the Run store.
"""

from __future__ import annotations

import math
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fnkernel.runtime_server.function_runtime.server import FUNCTION_RUNTIME_SERVICE
from fnkernel.runtime_server.lifecycle.runs import HEARTBEAT_SECONDS, POD_GRACE_SECONDS, RunStore

_HEALTH_CHECK_SECONDS = 0.5


class Heartbeat:
    """The health of pod `pod`'s server, checked through `channel` and written to `store`."""

    def __init__(
        self, channel: grpc.Channel, store: RunStore, pod: str, runtime: str, interval: float
    ) -> None:
        """`interval`: at most how long between two heartbeats (and HEARTBEAT_SECONDS)."""
        self._health = health_pb2_grpc.HealthStub(channel)
        self._store = store
        self._pod = pod
        self._runtime = runtime
        self._interval = min(interval, HEARTBEAT_SECONDS)
        self.servicer: health.HealthServicer | None = None  # runtimed's own, once it serves
        self.healthy = False  # the last health check's answer
        self._server_answered = -math.inf  # when a health check last succeeded: not yet
        self._reported: bool | None = None  # the health the last heartbeat wrote
        self.next_beat = 0.0

    def _server_healthy(self) -> bool:
        try:
            reply = self._health.Check(
                health_pb2.HealthCheckRequest(), timeout=_HEALTH_CHECK_SECONDS
            )
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def beat(self, address: str, *, now: bool = False, answered: float = -math.inf) -> None:
        """Check the server and write the pod's heartbeat (its runtimed at `address`): when one
        is due, when the health it reports changed, or `now`. `answered`: when the server last
        answered another call (monotonic), which stands in for the check within an interval.
        The pod is reported unhealthy only once its server has not answered for
        POD_GRACE_SECONDS: one missed check is a pause (a GC, a busy CPU), not a death, and
        declaring the pod gone would cost each of its Runs an attempt and its call."""
        checked = time.monotonic()
        self.healthy = checked - answered < self._interval or self._server_healthy()
        if self.healthy:
            self._server_answered = checked
        healthy = checked - self._server_answered < POD_GRACE_SECONDS
        if healthy != self._reported and self.servicer is not None:
            # What a readiness probe of this port sees (on Kubernetes, the pod's liveness).
            serving = health_pb2.HealthCheckResponse.SERVING
            status = serving if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
            for service in ("", FUNCTION_RUNTIME_SERVICE):
                self.servicer.set(service, status)
        if now or healthy != self._reported or checked >= self.next_beat:
            self._store.heartbeat(self._pod, self._runtime, address, healthy)
            self._reported = healthy
            self.next_beat = checked + self._interval
