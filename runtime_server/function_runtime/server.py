"""Assemble a Runtime Server: services, reflection (v1 and v1alpha), health, message limits."""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health

from fnkernel.adapters import runtimes
from fnkernel.runtime_server import callstream, limits
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import (
    batches_pb2,
    batches_pb2_grpc,
    logs_pb2,
    logs_pb2_grpc,
    payloads_pb2,
    payloads_pb2_grpc,
    registrations_pb2,
    registrations_pb2_grpc,
)
from fnkernel.runtime_server.function_runtime.batches import BatchesServicer
from fnkernel.runtime_server.function_runtime.registry import Registry
from fnkernel.runtime_server.function_runtime.servicer import (
    FunctionRuntimeServicer,
    InvocationLogsServicer,
    PayloadsServicer,
    RegistrationsServicer,
    RuntimeServicer,
    judged_by_fence,
)
from fnkernel.runtime_server.function_runtime.spool import Spool
from fnkernel.runtime_server.pipeline import Pipeline
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS, add_health, add_reflection, listen_on
from fnkernel.runtime_server.wire import TIMELINE_SERVER_KEY
from fnkernel.system.private import sweep

RUNTIME_SERVICE = pb.DESCRIPTOR.services_by_name["Runtime"].full_name
FUNCTION_RUNTIME_SERVICE = pb.DESCRIPTOR.services_by_name["FunctionRuntime"].full_name
# fnkernel's own, beside FunctionRuntime (docs/protocol.md, "Live output")
INVOCATION_LOGS_SERVICE = logs_pb2.DESCRIPTOR.services_by_name["InvocationLogs"].full_name
PAYLOADS_SERVICE = payloads_pb2.DESCRIPTOR.services_by_name[
    "Payloads"
].full_name  # "Large payloads"
BATCHES_SERVICE = batches_pb2.DESCRIPTOR.services_by_name["Batches"].full_name  # "Batches"
REGISTRATIONS_SERVICE = registrations_pb2.DESCRIPTOR.services_by_name[
    "Registrations"
].full_name  # "Registration": runtimed's poll
DEFAULT_LISTEN = "127.0.0.1:9090"


class RuntimeServer:
    """One Runtime Server serving one built-in runtime, as a Runtime Pod runs one image (docs/protocol.md, "Services")."""

    def __init__(
        self,
        runtime: str,
        workspace_root: Path,
        *,
        oneshot_only: bool = False,
        max_workers: int = 32,
        register_wait: float = limits.REGISTER_LOAD_SECONDS,
        spool: Spool | None = None,
    ) -> None:
        """`spool`: where payloads past one message wait (docs/protocol.md, "Large payloads");
        None: only payloads that fit one message."""
        adapter = runtimes.runtime(runtime).adapter()  # UnknownRuntime names the choices
        self.runtime = runtime
        sweep(runtime)  # the worker scratch dirs of Runtime Servers that were killed
        if spool is not None:
            spool.sweep()  # what a killed server's calls left
        self.spool = spool
        self._stop_sweeping = threading.Event()
        self.registry = Registry(adapter, workspace_root, register_wait=register_wait, spool=spool)
        pipeline = Pipeline(
            (
                RUNTIME_SERVICE,
                FUNCTION_RUNTIME_SERVICE,
                INVOCATION_LOGS_SERVICE,
                PAYLOADS_SERVICE,
                BATCHES_SERVICE,
                REGISTRATIONS_SERVICE,
            ),
            component="runtime-server",
            timeline_key=TIMELINE_SERVER_KEY,
            fence=judged_by_fence,
        )
        self._pipeline = pipeline
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
            interceptors=[pipeline],
            options=CHANNEL_OPTIONS,
        )
        services = [RUNTIME_SERVICE]
        pb_grpc.add_RuntimeServicer_to_server(RuntimeServicer(self.registry), self.server)
        if (
            not oneshot_only
        ):  # docs/protocol.md, "Services": a Runtime without function mode registers Runtime alone
            services.append(FUNCTION_RUNTIME_SERVICE)
            pb_grpc.add_FunctionRuntimeServicer_to_server(
                FunctionRuntimeServicer(self.registry), self.server
            )
            logs_pb2_grpc.add_InvocationLogsServicer_to_server(
                InvocationLogsServicer(self.registry), self.server
            )
            batches_pb2_grpc.add_BatchesServicer_to_server(
                BatchesServicer(self.registry), self.server
            )
            registrations_pb2_grpc.add_RegistrationsServicer_to_server(
                RegistrationsServicer(self.registry), self.server
            )
        extensions = (
            []
            if oneshot_only
            else [
                INVOCATION_LOGS_SERVICE,
                BATCHES_SERVICE,
                REGISTRATIONS_SERVICE,
                callstream.SERVICE,
            ]
        )
        if spool is not None and not oneshot_only:
            payloads_pb2_grpc.add_PayloadsServicer_to_server(PayloadsServicer(spool), self.server)
            extensions.append(PAYLOADS_SERVICE)
        self.health = add_health(self.server, services)
        add_reflection(self.server, [*services, *extensions, health.SERVICE_NAME])
        self.address = ""

    def start(self, listen: str = DEFAULT_LISTEN) -> str:
        """Bind `listen` (``host:port`` or ``unix:PATH``) and start; returns the bound address."""
        self.address = listen_on(self.server, listen)
        self.server.start()
        if self.spool is not None:  # what nobody claims, swept every minute while it serves
            self.spool.start_sweeping(self._stop_sweeping)
        return self.address

    def stop(self, drain_seconds: float = 10.0) -> None:
        """Refuse new RPCs, let in-flight invocations finish (bounded), then stop every worker."""
        self.health.enter_graceful_shutdown()
        self._pipeline.stop(self.server, drain_seconds)
        self._stop_sweeping.set()
        self.registry.shutdown()
        if self.spool is not None:  # its calls are over: the pages kept for the next go too
            self.spool.drop_free_files()
