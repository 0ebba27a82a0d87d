"""Where the gateway sends a call (docs/protocol.md, "Replicas"): the pod a Run is assigned to, a
channel to its runtimed, and a replica set's choice of replica.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from pathlib import Path

import grpc
import grpc.aio
from tornado import httpserver

from fnkernel.runtime_server import limits
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import logs_pb2_grpc, payloads_pb2_grpc
from fnkernel.runtime_server.errors import (
    NoRuntimePod,
    RunFailed,
    RunNotFound,
    RunNotReady,
)
from fnkernel.runtime_server.lifecycle.controlplane import ControlPlane
from fnkernel.runtime_server.lifecycle.gateway.access import Access
from fnkernel.runtime_server.lifecycle.gateway.failures import all_busy
from fnkernel.runtime_server.lifecycle.runs import Run, replica_names
from fnkernel.runtime_server.lifecycle.secrets import NoSecrets, Secrets
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS
from fnkernel.runtime_server.wire import FAILED, IDLE, READY

# Request headers must arrive whole within this long of the connection or of the answer before
# on it: a client sending a byte every few seconds does not hold a connection for ever. Tornado
# has one timer for both, so a kept-alive connection idle this long is closed too (clients
# reconnect: the client library repeats a request that met a closed kept-alive connection).
HEADER_TIMEOUT_SECONDS = 10.0
# Which replica served an invocation is remembered for the last this many calls to a replica
# set (a follower of its live output asks).
_ROUTED_INVOCATIONS = 4096


class Routes:
    """What the gateway's handlers share: the control plane, who may call (``Access``), a channel
    to each pod's runtimed, and where each call goes (the assigned pod, a replica set's turn)."""

    def __init__(
        self,
        control_plane: ControlPlane,
        access: Access | None = None,
        *,
        secrets: Secrets | None = None,
        body_timeout: float = 60.0,
        header_timeout: float = HEADER_TIMEOUT_SECONDS,
        max_payload_bytes: int = limits.DEFAULT_MAX_SPOOLED_BYTES,
        spool: Path | None = None,
    ) -> None:
        """`max_payload_bytes`: the largest payload or result (docs/protocol.md, "Large
        payloads"); `spool`: the directory the pods of this machine spool payloads in, which a
        caller on this machine writes its own to (None on Kubernetes: no caller shares it)."""
        self.control_plane = control_plane
        self.max_payload_bytes = max_payload_bytes
        self.spool = spool
        self.store = control_plane.store
        self.access = access or Access()
        self.secrets = secrets or NoSecrets()
        # A body that has not arrived whole by then closes the connection: a client that sends
        # less than its Content-Length does not hold a connection forever.
        self.body_timeout = body_timeout
        self.header_timeout = header_timeout
        self.listen_host = ""
        # Stopping (``Gateway.close``): new requests are refused while those in progress end.
        self.stopping = False
        self.in_progress: set[object] = set()  # the requests being answered (their handlers)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, pb_grpc.FunctionRuntimeStub] = {}
        self._server: httpserver.HTTPServer | None = None
        self.address = ""
        # Calls this gateway has in flight, by Run uid, and where each function's round robin
        # stands (docs/protocol.md, "Replicas"); the IOLoop's thread alone touches them.
        self.in_flight: dict[str, int] = {}
        self._turn: dict[str, int] = {}
        # Invocation ID → the replica that serves it, for a follower of a replica set's call.
        self.routed: OrderedDict[str, str] = OrderedDict()
        self._log_stubs: dict[str, logs_pb2_grpc.InvocationLogsStub] = {}
        self._payload_stubs: dict[str, payloads_pb2_grpc.PayloadsStub] = {}

    def stub(self, address: str) -> pb_grpc.FunctionRuntimeStub:
        stub = self._stubs.get(address)
        if stub is None:
            stub = self._stubs[address] = pb_grpc.FunctionRuntimeStub(self._channel(address))
        return stub

    def logs_stub(self, address: str) -> logs_pb2_grpc.InvocationLogsStub:
        stub = self._log_stubs.get(address)
        if stub is None:
            channel = self._channel(address)
            stub = self._log_stubs[address] = logs_pb2_grpc.InvocationLogsStub(channel)
        return stub

    def payloads_stub(self, address: str) -> payloads_pb2_grpc.PayloadsStub:
        stub = self._payload_stubs.get(address)
        if stub is None:
            channel = self._channel(address)
            stub = self._payload_stubs[address] = payloads_pb2_grpc.PayloadsStub(channel)
        return stub

    def _channel(self, address: str) -> grpc.aio.Channel:
        """The one channel to `address`'s runtimed, which both its stubs share."""
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
        return channel

    def pod_of(self, run: Run) -> tuple[str, str]:
        """The pod the Run is assigned to and its runtimed's address, if it can take calls."""
        # runtimed checks too, but its view may lag a tick
        if run.status.phase not in (READY, IDLE):
            detail = f": {run.status.message}" if run.status.message else ""
            why = f"run {run.name} is {run.status.phase} (attempt {run.status.attempt}){detail}"
            if run.status.phase == FAILED:  # "so": the Run, not what failed it (a secret)
                unset = "" in run.status.secret_versions.values()  # docs/protocol.md, "Secrets"
                until = "its secrets are set" if unset else "it is made again"
                raise RunFailed(f"{why}; the Run stays Failed until {until}", run.uid)
            raise RunNotReady(why)
        pod = self.store.pod_fresh(run.status.assigned_pod)
        if pod is None or not pod.alive():
            raise NoRuntimePod(
                f"run {run.name}: pod {run.status.assigned_pod or '(none)'} is not serving"
            )
        return pod.name, pod.address

    def route(self, run: Run) -> tuple[str, pb_grpc.FunctionRuntimeStub]:
        """The pod the Run is assigned to and a stub for its runtimed, if it can take calls."""
        pod, address = self.pod_of(run)
        return pod, self.stub(address)

    def remember_route(self, invocation_id: str, replica: str) -> None:
        self.routed[invocation_id] = replica
        self.routed.move_to_end(invocation_id)
        if len(self.routed) > _ROUTED_INVOCATIONS:
            self.routed.popitem(last=False)

    def replicas(self, run: Run) -> list[Run]:
        """The replica set of function `run` (replica 0), in the order to try them: those that
        can take calls, least in flight first and, among equals, round robin from the one after
        the last chosen. RESOURCE_EXHAUSTED if every one is busy."""
        found = [run]
        for name in replica_names(run)[1:]:
            with contextlib.suppress(RunNotFound):
                found.append(self.store.get_fresh(name))
        turn = self._turn.get(run.name, 0)
        self._turn[run.name] = turn + 1
        ready = [r for r in found if r.status.phase in (READY, IDLE)]
        if not ready:
            return found  # none can take calls: route() says why, naming the first
        count = len(ready)
        order = sorted(
            range(count), key=lambda i: (self.in_flight.get(ready[i].uid, 0), (i - turn) % count)
        )
        if self.in_flight.get(ready[order[0]].uid, 0):
            raise all_busy(run.name, len(ready))
        return [ready[i] for i in order if not self.in_flight.get(ready[i].uid, 0)]
