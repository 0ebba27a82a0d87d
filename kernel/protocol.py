"""The FunctionRuntime protocol itself, from a notebook: for teaching (``protocol_tour.ipynb``).

``runtime_server("python")`` starts a private Runtime Server (no runtimed, no gateway) and returns
a client whose calls take and return the JSON of the grpcurl examples in docs/protocol.md, "Services"::

    rt = runtime_server("python")
    rt.RegisterFunction({"runUid": "run-1", "registrationAttempt": 1, ...})

Calls are recorded by ``%fn_trace``, an interrupt cancels the call in flight (the sync stub's
``.future()``, cancelled from the kernel's control thread), and a failure raises the docs/protocol.md, "Errors"
class of its status, shown as one line. grpc is imported here, and only when this is used.
"""

from __future__ import annotations

import itertools
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from fnkernel.kernel.functions import InvocationInterrupted, wait_until_free
from fnkernel.kernel.trace import KernelSpan, Trace, decode_message
from fnkernel.runtime_server import limits, tracing, wire
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.client.errors import (
    GatewayError,
    InvalidRequest,
    NotSupported,
    from_response,
)
from fnkernel.runtime_server.daemon import Child, serve_args, spawn
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS, failure_body, trailer_value
from fnkernel.runtime_server.wire import http_status
from fnkernel.system.private import private_tempdir, sweep

SERVICE = "FunctionRuntime"
_REQUESTS = {
    "RegisterFunction": pb.RegisterFunctionRequest,
    "InvokeFunction": pb.InvokeFunctionRequest,
    "FunctionStatus": pb.FunctionStatusRequest,
    "UnregisterFunction": pb.UnregisterFunctionRequest,
}


def _ended(span: KernelSpan | None, code: grpc.StatusCode, trailers: Any) -> dict[str, Any]:
    """A traced call's TracedCall fields (none if it was not traced)."""
    if span is None:
        return {}
    failed = "" if code == grpc.StatusCode.OK else code.name
    spans = trailer_value(trailers, wire.SPANS_KEY) or b""
    return span.ended(({"rpc.grpc.status_code": code.value[0]}, failed), spans)


def error_of(err: grpc.RpcError, method: str) -> GatewayError:
    """A gRPC failure as the gateway would answer it, raised as its client would
    (``FunctionBusy`` for RESOURCE_EXHAUSTED, ...): the gateway and the protocol read the same
    in a notebook."""
    body = failure_body(err)
    body["message"] = f"{method}: {body['message']}"
    return from_response(body, http_status(body["code"]))


def _request(method: str, request: dict[str, Any]) -> Any:
    """`request`, grpcurl's JSON, as METHOD's request message; what grpc would answer a call
    it cannot make — a method FunctionRuntime lacks (UNIMPLEMENTED), a request that is no
    such message (INVALID_ARGUMENT: a field misspelled, of another type, input not base64)
    — raised before anything is sent, a GatewayError as the server's answers are: one line."""
    kind = _REQUESTS.get(method)
    if kind is None:
        raise NotSupported(
            f"FunctionRuntime has no method {method!r}; one of {', '.join(_REQUESTS)}",
            code="UNIMPLEMENTED",
            status=http_status("UNIMPLEMENTED"),
        )
    try:
        message = kind()
        return json_format.ParseDict(request, message)
    except (json_format.ParseError, TypeError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InvalidRequest(
            f"{method}: the request is no {message.DESCRIPTOR.name}: {reason}",
            code="INVALID_ARGUMENT",
            status=http_status("INVALID_ARGUMENT"),
        ) from None


class FunctionRuntimeClient:
    """One Runtime Server's FunctionRuntime service, called with JSON requests. The methods
    carry the RPCs' own names, as those grpcurl examples spell them."""

    def __init__(self, address: str, trace: Trace, workspace_root: Path | None = None) -> None:
        self.address = address
        self.trace = trace
        self.workspace_root = workspace_root
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.FunctionRuntimeStub(self._channel)
        self._in_flight: set[grpc.Future] = set()
        self._lock = threading.Lock()
        self._dirs = itertools.count(1)

    def call(self, method: str, request: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
        """``FunctionRuntime/METHOD`` with `request` as grpcurl's JSON; the reply as JSON."""
        message = _request(method, request)
        started = time.perf_counter()
        span = metadata = None
        if self.trace.on and method == "InvokeFunction":  # traced (docs/protocol.md, "Tracing")
            name, attributes = tracing.INVOKE_SPAN, tracing.rpc_attributes(method)
            span = KernelSpan(name, attributes, message.invocation_id)
            metadata = ((wire.TRACEPARENT_KEY, span.traceparent),)
        with self._lock:
            # Under the lock that cancel() takes: once the server sees the call, an interrupt
            # finds it here (not in the instant between sending it and recording it).
            future = getattr(self._stub, method).future(message, timeout=timeout, metadata=metadata)
            self._in_flight.add(future)
        shown = decode_message(request)
        try:
            reply = future.result()
        except grpc.FutureCancelledError:
            self._record(method, shown, "CANCELLED", started)
            if method == "InvokeFunction":  # as a %%function's invoke does
                with self.trace.bookkeeping():
                    wait_until_free(lambda: self._busy(request.get("registration", {})))
            raise InvocationInterrupted(f"{method} cancelled") from None
        except grpc.RpcError as err:
            error = error_of(err, method)
            traced = _ended(span, err.code(), err.trailing_metadata())
            self._record(method, shown, error.code, started, **traced)
            raise error from None
        finally:
            with self._lock:
                self._in_flight.discard(future)
        answer: dict[str, Any] = json_format.MessageToDict(reply)
        traced = _ended(span, grpc.StatusCode.OK, future.trailing_metadata())
        self._record(method, shown, "OK", started, decode_message(answer), **traced)
        return answer

    def _busy(self, registration: dict[str, Any]) -> bool:
        wait = limits.status_wait_seconds(hops_below=1)
        status = self.call("FunctionStatus", {"registration": registration}, timeout=wait)
        return bool(int(status.get("inFlight", 0)))

    def _record(
        self,
        method: str,
        request: Any,
        status: str,
        started: float,
        response: Any = None,
        **traced: Any,
    ) -> None:
        latency = (time.perf_counter() - started) * 1000
        self.trace.record(f"{SERVICE}/{method}", request, status, latency, response, **traced)

    def RegisterFunction(self, request: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
        return self.call("RegisterFunction", request, timeout)

    def InvokeFunction(self, request: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
        return self.call("InvokeFunction", request, timeout)

    def FunctionStatus(self, request: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
        return self.call("FunctionStatus", request, timeout)

    def UnregisterFunction(self, request: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
        return self.call("UnregisterFunction", request, timeout)

    def try_call(self, method: str, request: dict[str, Any], timeout: float = 60) -> Any:
        """Call, print the outcome in one line — ``OK`` and the reply, or the status and why —
        and return the reply or the error. For showing failures on purpose."""
        try:
            reply = self.call(method, request, timeout)
        except GatewayError as error:
            message = error.message.removeprefix(f"{method}: ")  # the line names it already
            print(f"{method} → {error.code}: {message} ({type(error).__name__})")
            return error
        print(f"{method} → OK {json.dumps(decode_message(reply))}")
        return reply

    def workdir(self, files: dict[str, str]) -> str:
        """A fresh working dir under the server's workspace root holding `files`; its path."""
        if self.workspace_root is None:
            raise ValueError("this client has no workspace root to write into")
        directory = self.workspace_root / f"fn-{next(self._dirs)}"
        directory.mkdir(mode=0o700)
        for name, text in files.items():
            (directory / name).write_text(text)
        return str(directory)

    def cancel(self) -> int:
        """From another thread: cancel every call in flight; how many."""
        with self._lock:
            in_flight = list(self._in_flight)
        return sum(bool(future.cancel()) for future in in_flight)

    def close(self) -> None:
        self._channel.close()


class TeachingServer(FunctionRuntimeClient):
    """A private Runtime Server child process and its client; ``stop()`` ends it."""

    def __init__(self, runtime: str, trace: Trace) -> None:
        self.runtime = runtime
        sweep("tour")
        self.state_dir = private_tempdir("tour")
        workspace = self.state_dir / "workspace"
        workspace.mkdir()
        listen = f"unix:{self.state_dir / 'server.sock'}"
        self.child: Child = spawn(serve_args(runtime, listen, workspace), die_with_parent=True)
        super().__init__(self.child.address, trace, workspace)

    def stop(self) -> None:
        self.close()
        self.child.stop(5)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def __repr__(self) -> str:
        return f"<{self.runtime} Runtime Server at {self.address} (pid {self.child.pid})>"


def runtime_server(runtime: str = "python") -> TeachingServer:
    """Start a private Runtime Server of `runtime` for this kernel; it stops with the kernel."""
    from IPython.core.getipython import get_ipython

    from fnkernel.kernel.session import session_of

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("runtime_server() needs a running IPython kernel")
    session = session_of(shell)
    server = TeachingServer(runtime, session.trace)
    session.cancellers.append(server.cancel)
    session.closers.append(server.stop)
    return server


def pretty(value: Any) -> None:
    """Print a reply as indented JSON (what grpcurl prints)."""
    print(json.dumps(value, indent=2))
