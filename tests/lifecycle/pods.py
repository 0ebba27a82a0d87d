"""A pod of the embedded runtime for the runtimed tests: a real Runtime Server and a real runtimed on
Unix sockets, sharing a real SQLite Run store with the control plane."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.function_runtime.server import RuntimeServer
from fnkernel.runtime_server.lifecycle.controlplane import ControlPlane
from fnkernel.runtime_server.lifecycle.runs import Run
from fnkernel.runtime_server.lifecycle.runtimed import Runtimed
from fnkernel.runtime_server.lifecycle.runtimed.packages import PackageCache
from fnkernel.runtime_server.lifecycle.secrets import SecretFiles
from fnkernel.runtime_server.lifecycle.sqlite import SqliteRunStore
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS
from fnkernel.runtime_server.wire import (
    POD_KEY,
)

POD = "python-0"


@dataclass
class Pod:
    store: SqliteRunStore
    control_plane: ControlPlane
    runtimed: Runtimed
    proxy: pb_grpc.FunctionRuntimeStub
    server: pb_grpc.FunctionRuntimeStub

    def create(self, name: str, files: dict[str, str], handler: str = "handler.handle") -> Run:
        files = {path: textwrap.dedent(text) for path, text in files.items()}
        self.control_plane.create_run(name=name, runtime="python", handler=handler, files=files)
        return self.control_plane.wait_settled(name, timeout=20)

    def invoke(self, run: Run, payload: bytes = b"{}", *, registration_id: str = "", pod=POD):  # type: ignore[no-untyped-def]
        return self.proxy.InvokeFunction(
            pb.InvokeFunctionRequest(
                registration=pb.FunctionRegistration(
                    run_uid=run.uid, registration_id=registration_id
                ),
                input=payload,
                content_type="application/json",
            ),
            metadata=((POD_KEY, pod),),
            timeout=20,
        )


def pod_runtimed(store: SqliteRunStore, server_address: str, workspace: Path) -> Runtimed:
    """The runtimed of pod POD, writing its Runs' files in WORKSPACE/POD (not started)."""
    return Runtimed(
        store,
        pod=POD,
        runtime="python",
        server_address=server_address,
        workspace=workspace / POD,
        packages=PackageCache(workspace.parent / "packages"),
        secrets=SecretFiles(workspace.parent / "secrets"),
        poll_interval=0.2,
    )


def pod_of(tmp_path: Path, *, oneshot_only: bool = False) -> Iterator[Pod]:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    server = RuntimeServer("python", workspace, oneshot_only=oneshot_only)
    server_address = server.start(f"unix:{tmp_path}/server.sock")
    store = SqliteRunStore(tmp_path / "runs.db")
    runtimed = pod_runtimed(store, server_address, workspace)
    address = runtimed.start(f"unix:{tmp_path}/runtimed.sock")
    channels = [
        grpc.insecure_channel(a, options=CHANNEL_OPTIONS) for a in (address, server_address)
    ]
    try:
        yield Pod(
            store,
            ControlPlane(store),
            runtimed,
            pb_grpc.FunctionRuntimeStub(channels[0]),
            pb_grpc.FunctionRuntimeStub(channels[1]),
        )
    finally:
        for channel in channels:
            channel.close()
        runtimed.stop(0)
        server.stop(0)
