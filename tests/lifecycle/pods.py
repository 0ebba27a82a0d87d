"""A pod of the embedded runtime for the runtimed tests: a real Runtime Server and a real runtimed on
Unix sockets, sharing a real SQLite Run store with the control plane. Its InvokeFunction is
called either way a caller reaches runtimed (``CALLS``): as a unary RPC (the gateway's), or as
a message of runtimed's call streams on its event loop (a caller on this machine's: docs/
protocol.md, "Call streams")."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from fnkernel.runtime_server import callstream
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import callstreams_pb2 as cs
from fnkernel.runtime_server.function_runtime.server import RuntimeServer
from fnkernel.runtime_server.lifecycle.controlplane import ControlPlane
from fnkernel.runtime_server.lifecycle.runs import Run
from fnkernel.runtime_server.lifecycle.runtimed import Runtimed
from fnkernel.runtime_server.lifecycle.runtimed.packages import PackageCache
from fnkernel.runtime_server.lifecycle.secrets import SecretFiles
from fnkernel.runtime_server.lifecycle.sqlite import SqliteRunStore
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS
from fnkernel.runtime_server.wire import POD_KEY, call_streams_target

POD = "python-0"
CALLS = ("unary", "stream")  # how a call reaches runtimed: an RPC, or a call stream's message


class StreamedInvoke:
    """InvokeFunction as a stub's (called, or ``with_call``), each call the one message of a
    stream of its own to runtimed's call streams: nothing falls back to a unary RPC, so a call
    that does not reach them fails."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._open = channel.stream_stream(
            callstream.STREAM_PATH,
            request_serializer=cs.StreamedCall.SerializeToString,
            response_deserializer=cs.StreamedAnswer.FromString,
        )

    def __call__(self, request: pb.InvokeFunctionRequest, **kwargs: Any) -> Any:
        return self.with_call(request, **kwargs)[0]

    def with_call(
        self,
        request: pb.InvokeFunctionRequest,
        metadata: Any = (),
        timeout: float | None = None,
    ) -> tuple[pb.InvokeFunctionResponse, callstream.Answered]:
        message = callstream.streamed_call(request.SerializeToString(), timeout, metadata)
        answers = self._open(iter([message]), timeout=60)
        response, trailers = callstream.answered(next(answers))
        return pb.InvokeFunctionResponse.FromString(response), callstream.Answered(trailers)


@dataclass
class Pod:
    store: SqliteRunStore
    control_plane: ControlPlane
    runtimed: Runtimed
    proxy: pb_grpc.FunctionRuntimeStub
    server: pb_grpc.FunctionRuntimeStub
    streamed: StreamedInvoke | None = None  # the calls go on runtimed's call streams

    @property
    def invoke_function(self) -> Any:
        """runtimed's InvokeFunction, as the pod's calls reach it (``CALLS``)."""
        return self.streamed if self.streamed is not None else self.proxy.InvokeFunction

    def create(
        self, name: str, files: dict[str, str], handler: str = "handler.handle", **spec: Any
    ) -> Run:
        files = {path: textwrap.dedent(text) for path, text in files.items()}
        self.control_plane.create_run(
            name=name, runtime="python", handler=handler, files=files, **spec
        )
        return self.control_plane.wait_settled(name, timeout=20)

    def invoke(self, run: Run, payload: bytes = b"{}", *, registration_id: str = "", pod=POD):  # type: ignore[no-untyped-def]
        return self.invoke_function(
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


def pod_of(tmp_path: Path, *, oneshot_only: bool = False, calls: str = "unary") -> Iterator[Pod]:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    server = RuntimeServer("python", workspace, oneshot_only=oneshot_only)
    server_address = server.start(f"unix:{tmp_path}/server.sock")
    store = SqliteRunStore(tmp_path / "runs.db")
    runtimed = pod_runtimed(store, server_address, workspace)
    address = runtimed.start(f"unix:{tmp_path}/runtimed.sock")
    streams_at = call_streams_target(address)
    assert streams_at is not None
    channels = [
        grpc.insecure_channel(a, options=CHANNEL_OPTIONS)
        for a in (address, server_address, streams_at)
    ]
    try:
        yield Pod(
            store,
            ControlPlane(store),
            runtimed,
            pb_grpc.FunctionRuntimeStub(channels[0]),
            pb_grpc.FunctionRuntimeStub(channels[1]),
            StreamedInvoke(channels[2]) if calls == "stream" else None,
        )
    finally:
        for channel in channels:
            channel.close()
        runtimed.stop(0)
        server.stop(0)
