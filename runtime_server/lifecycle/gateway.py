"""The HTTP gateway (docs/protocol.md, "HTTP API", "Errors"): JSON over HTTP in front of each pod's runtimed.

Tornado (which ipykernel brings) serves it; the control plane runs in the same process. Every
failure becomes a gRPC status first (``wire.status_name`` for our own errors, the status itself
for a call to runtimed) and then an HTTP status through ``wire.HTTP_STATUS``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hmac
import ipaddress
import json
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from tornado import httpserver, httputil, iostream, netutil, web

from fnkernel.runtime_server import limits, tracing, wire
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import logs_pb2, logs_pb2_grpc
from fnkernel.runtime_server.errors import (
    InvalidField,
    NoRuntimePod,
    RunNotFound,
    RunNotReady,
    RunTooLarge,
    storage_full,
)
from fnkernel.runtime_server.lifecycle.controlplane import ControlPlane
from fnkernel.runtime_server.lifecycle.runs import Run, replica_names
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS, failure_body, trailer_logs
from fnkernel.runtime_server.wire import (
    ATTEMPT_KEY,
    COLD_START_KEY,
    DIGEST_KEY,
    IDLE,
    POD_KEY,
    READY,
    TIMELINE_KEY,
    TIMELINE_RUNTIMED_KEY,
    TIMELINE_SERVER_KEY,
    parse_timeline_stamps,
)

LOG = logging.getLogger("fnkernel.gateway")

CREATE_WAIT_SECONDS = 90.0  # POST /v1/runs answers once the Run is Ready or Failed
DEFAULT_LISTEN = "127.0.0.1:8080"
MAX_HEADER_BYTES = 64 * 1024  # larger request headers get 431
# Tornado buffers headers up to this size (then closes the connection), so that everything
# between MAX_HEADER_BYTES and it gets a 431 the client can read.
_HEADER_BUFFER_BYTES = 1024 * 1024
# Request headers must arrive whole within this long of the connection or of the answer before
# on it: a client sending a byte every few seconds does not hold a connection for ever. Tornado
# has one timer for both, so a kept-alive connection idle this long is closed too (clients
# reconnect: the client library repeats a request that met a closed kept-alive connection).
HEADER_TIMEOUT_SECONDS = 10.0
# A burst of connections waits in the kernel's accept queue instead of being reset (the kernel
# caps it at net.core.somaxconn).
LISTEN_BACKLOG = 4096
# Live output (docs/protocol.md, "Live output"): a follower that has not taken a line this long
# after it was written is cut off; which replica served an invocation is remembered for the
# last this many calls to a replica set.
FOLLOW_FLUSH_SECONDS = 30.0
_ROUTED_INVOCATIONS = 4096
EXPOSED_HEADERS = ", ".join(
    (
        wire.INVOCATION_ID_HEADER,
        wire.OUTPUTS_HEADER,
        wire.ATTEMPT_HEADER,
        wire.COLD_START_HEADER,
        wire.LOGS_HEADER,
        wire.TIMELINE_HEADER,
        "Retry-After",
    )
)
ALLOWED_REQUEST_HEADERS = ", ".join(
    (
        "Authorization",
        "Content-Type",
        wire.INVOCATION_ID_HEADER,
        wire.TIMEOUT_HEADER,
        wire.TIMELINE_HEADER,
    )
)


# The status names of the HTTP statuses tornado answers by itself (a malformed request, a method
# the path does not take); any other is named for its reason phrase.
_TORNADO_CODES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}


class FailureResponse(Exception):
    """A failure, as the gateway answers it: the status name `code` (a gRPC status name, or
    HTTP's own for what the gateway refuses before any call: PAYLOAD_TOO_LARGE, ...), the HTTP
    `status` (from wire.HTTP_STATUS unless given) and the JSON body of docs/protocol.md,
    "Errors", `extra` included."""

    def __init__(self, code: str, message: str, *, status: int = 0, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status or wire.http_status(code)
        self.extra = extra


@dataclass(frozen=True)
class Access:
    """Who may call the gateway (README, "Security"): the bearer token (None: no token, which
    the CLI allows on loopback only), the browser origins allowed (none by default), and the
    host names the Host header may carry besides the listen address and ``localhost``."""

    token: str | None = None
    allowed_origins: frozenset[str] = frozenset()
    allowed_hosts: frozenset[str] = frozenset()

    def token_matches(self, authorization: str) -> bool:
        if self.token is None:
            return True
        scheme, _, credentials = authorization.strip().partition(" ")
        # RFC 9110 §11.1: the scheme is case-insensitive.
        return scheme.lower() == "bearer" and hmac.compare_digest(
            credentials.strip().encode(), self.token.encode()
        )

    def host_allowed(self, host: str, listen_host: str) -> bool:
        """DNS rebinding: a page served from evil.example that resolves to 127.0.0.1 reaches
        us with ``Host: evil.example``; only our own names and addresses are answered."""
        return _host_allowed(host, listen_host, self.allowed_hosts)


@functools.lru_cache(maxsize=256)
def _host_allowed(host: str, listen_host: str, allowed_hosts: frozenset[str]) -> bool:
    """``Access.host_allowed``, remembered: every request asks, a client sends the same Host each
    time, and parsing two addresses cost ~14 us a request (warm). The cache is bounded, so a
    client sending ever new Hosts only misses it."""
    name = _host_name(host)
    if name == "localhost" or name in allowed_hosts:
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    if listen_host in ("", "0.0.0.0", "::"):
        return True  # bound to every address: any of ours may be named
    if listen_host == "localhost":
        return address.is_loopback
    try:
        bound = ipaddress.ip_address(listen_host)
    except ValueError:
        return False
    return address == bound or (address.is_loopback and bound.is_loopback)


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rpartition(":")[0] if host.count(":") == 1 else host


class Gateway:
    """The gateway's state: the control plane, runtimed channels, the bearer token."""

    def __init__(
        self,
        control_plane: ControlPlane,
        access: Access | None = None,
        *,
        body_timeout: float = 60.0,
        header_timeout: float = HEADER_TIMEOUT_SECONDS,
    ) -> None:
        self.control_plane = control_plane
        self.store = control_plane.store
        self.access = access or Access()
        # A body that has not arrived whole by then closes the connection: a client that sends
        # less than its Content-Length does not hold a connection forever.
        self.body_timeout = body_timeout
        self.header_timeout = header_timeout
        self.listen_host = ""
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

    def _channel(self, address: str) -> grpc.aio.Channel:
        """The one channel to `address`'s runtimed, which both its stubs share."""
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
        return channel

    def pod_of(self, run: Run) -> tuple[str, str]:
        """The pod the Run is assigned to and its runtimed's address, if it can take calls."""
        if run.phase not in (READY, IDLE):  # runtimed checks too, but its view may lag a tick
            detail = f": {run.message}" if run.message else ""
            raise RunNotReady(f"run {run.name} is {run.phase} (attempt {run.attempt}){detail}")
        pod = self.store.pod_fresh(run.assigned_pod)
        if pod is None or not pod.alive():
            raise NoRuntimePod(f"run {run.name}: pod {run.assigned_pod or '(none)'} is not serving")
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
        ready = [r for r in found if r.phase in (READY, IDLE)]
        if not ready:
            return found  # none can take calls: route() says why, naming the first
        count = len(ready)
        order = sorted(
            range(count), key=lambda i: (self.in_flight.get(ready[i].uid, 0), (i - turn) % count)
        )
        if self.in_flight.get(ready[order[0]].uid, 0):
            raise FailureResponse(
                "RESOURCE_EXHAUSTED",
                f'every replica of "{run.name}" is busy ({len(ready)} in flight); '
                "try again, or create it with more replicas",
            )
        return [ready[i] for i in order if not self.in_flight.get(ready[i].uid, 0)]

    def application(self) -> web.Application:
        args = {"gateway": self}
        return web.Application(
            [
                (r"/v1/runs", RunsHandler, args),
                (r"/v1/runs/([^/:]+):invoke", InvokeHandler, args),
                (r"/v1/runs/([^/:]+)/logs", LogsHandler, args),
                (r"/v1/runs/([^/:]+)/files", FilesHandler, args),
                (r"/v1/runs/([^/:]+)/invocations/([^/]+)/logs", LogsHandler, args),
                (r"/v1/runs/([^/:]+)", RunHandler, args),
            ],
            log_function=_log_failure,
            default_handler_class=NoSuchPath,
            default_handler_args=args,
        )

    def listen(self, listen: str) -> str:
        self._server = httpserver.HTTPServer(
            self.application(),
            max_body_size=limits.GRPC_MAX_MESSAGE_BYTES,
            max_header_size=_HEADER_BUFFER_BYTES,
            body_timeout=self.body_timeout,
            idle_connection_timeout=self.header_timeout,
            xheaders=False,
        )
        if listen.startswith("unix:"):
            self._server.add_socket(
                netutil.bind_unix_socket(listen[5:], mode=0o600, backlog=LISTEN_BACKLOG)
            )
            self.address = listen
            self.listen_host = "localhost"
        else:
            host, _, port = listen.rpartition(":")
            self.listen_host = host.strip("[]")
            sockets = netutil.bind_sockets(
                int(port), self.listen_host, family=socket.AF_UNSPEC, backlog=LISTEN_BACKLOG
            )
            self._server.add_sockets(sockets)
            bound = sockets[0].getsockname()[1]
            self.address = f"http://{host}:{bound}"
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            await self._server.close_all_connections()


def _log_failure(handler: web.RequestHandler) -> None:
    """The access log names the requests that failed (4xx as a warning, 5xx as an error); a
    line per successful call would cost more than the call's own work in the gateway."""
    status = handler.get_status()
    if status >= 400:
        level = logging.ERROR if status >= 500 else logging.WARNING
        request = handler.request
        LOG.log(level, "%d %s %s (%s)", status, request.method, request.uri, request.remote_ip)


class BaseHandler(web.RequestHandler):
    gateway: Gateway

    def initialize(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def prepare(self) -> Awaitable[None] | None:
        """The checks of README "Security", before anything is looked up or called."""
        request, access = self.request, self.gateway.access
        size = len(request.method or "") + len(request.uri or "")
        size += sum(len(k) + len(v) + 4 for k, v in request.headers.get_all())
        if size > MAX_HEADER_BYTES:
            raise FailureResponse(
                "REQUEST_HEADER_FIELDS_TOO_LARGE",
                status=431,
                message=f"request headers are {size} bytes; at most {MAX_HEADER_BYTES}",
            )
        if not access.host_allowed(request.host, self.gateway.listen_host):
            raise FailureResponse(
                "PERMISSION_DENIED", f"Host {request.host[:100]!r} is not allowed"
            )
        origin = request.headers.get("Origin")
        if origin is not None:
            if origin not in access.allowed_origins:
                raise FailureResponse(
                    "PERMISSION_DENIED", f"Origin {origin[:100]!r} is not allowed"
                )
            self.set_header("Access-Control-Allow-Origin", origin)
            self.set_header("Vary", "Origin")
            self.set_header("Access-Control-Expose-Headers", EXPOSED_HEADERS)
        if request.method == "OPTIONS":
            return None  # a CORS preflight carries no token; options() answers it
        if not access.token_matches(request.headers.get("Authorization", "")):
            raise FailureResponse("UNAUTHENTICATED", "missing or wrong bearer token")
        if request.method in ("POST", "PUT", "PATCH"):
            content_type = request.headers.get("Content-Type", "")
            media_type = content_type.split(";", 1)[0].strip().lower()
            if media_type != "application/json":
                # A browser sends text/plain and form bodies cross-origin without asking first.
                raise FailureResponse(
                    "UNSUPPORTED_MEDIA_TYPE",
                    status=415,
                    message=f"Content-Type must be application/json, got {content_type[:100]!r}",
                )
        return None

    def options(self, *_: str) -> None:
        """The CORS preflight of an allowed origin (prepare refused every other one)."""
        if "Origin" not in self.request.headers:
            raise FailureResponse(
                "METHOD_NOT_ALLOWED", status=405, message="OPTIONS is only a CORS preflight here"
            )
        self.set_header("Access-Control-Allow-Methods", "GET, POST, DELETE")
        self.set_header("Access-Control-Allow-Headers", ALLOWED_REQUEST_HEADERS)
        self.set_header("Access-Control-Max-Age", "600")
        self.set_status(204)
        self.finish()

    def json_body(self) -> dict[str, Any]:
        try:
            body = json.loads(self.body() or b"{}")
        except ValueError as exc:
            raise InvalidField("body", f"not JSON: {exc}") from None
        except RecursionError:
            raise InvalidField("body", "nested too deeply") from None
        if not isinstance(body, dict):
            raise InvalidField("body", "must be a JSON object")
        return body

    def body(self) -> bytes:
        return self.request.body  # BodyHandler streams its bodies instead

    def send_json(self, status: int, body: Any) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))

    def send_failure(self, failure: FailureResponse) -> None:
        if failure.code in wire.RETRY_AFTER_CODES:
            self.set_header("Retry-After", "1")
        if failure.status == 401:
            self.set_header("WWW-Authenticate", "Bearer")
        self.send_json(
            failure.status,
            {
                "code": failure.code,
                "message": failure.message,
                "runUid": failure.extra.pop("runUid", ""),
                "invocationId": failure.extra.pop("invocationId", ""),
                **failure.extra,
            },
        )

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """Every failure, ours and tornado's, in the JSON shape of docs/protocol.md, "Errors"."""
        exc_info = kwargs.get("exc_info")
        failure = self.failure(exc_info[1] if exc_info else None, status_code)
        if failure.status == 405:
            self.set_header("Allow", ", ".join(self.allowed_methods()))
        self.send_failure(failure)

    def failure(self, error: BaseException | None, status_code: int) -> FailureResponse:
        """What the gateway answers for `error` (None: tornado's own `status_code`)."""
        known = known_failure(error)
        if known is not None:
            return known
        if isinstance(error, web.HTTPError) or error is None:
            status = error.status_code if isinstance(error, web.HTTPError) else status_code
            if status == 405:
                allowed = ", ".join(self.allowed_methods())
                message = (
                    f"{self.request.method} is not allowed on {self.request.path}; use {allowed}"
                )
                return FailureResponse("METHOD_NOT_ALLOWED", message, status=405)
            reason = httputil.responses.get(status, "Unknown")
            name = reason.upper().replace(" ", "_").replace("-", "_")
            return FailureResponse(_TORNADO_CODES.get(status, name), reason, status=status)
        return FailureResponse("INTERNAL", f"internal error: {type(error).__name__}")

    def log_exception(self, typ: Any, value: BaseException | None, tb: Any) -> None:
        """Only a bug is logged with its stack: every other failure is an answer (and a line
        of the access log)."""
        if not isinstance(value, web.HTTPError) and known_failure(value) is None:
            LOG.error("internal error", exc_info=value)

    @classmethod
    def allowed_methods(cls) -> list[str]:
        """The methods this handler defines (an unknown path's: none)."""
        return [
            method
            for method in cls.SUPPORTED_METHODS
            if getattr(cls, method.lower()) is not getattr(web.RequestHandler, method.lower())
        ]

    async def blocking(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kwargs))

    async def described(self, run: Run) -> dict[str, Any]:
        """The Run as the gateway shows it; a replica set's replica 0 with every replica."""
        body = run.to_json()
        if run.replicas != 1 and not run.replica_of:
            replicas = await self.blocking(self.gateway.control_plane.replicas_of, run)
            body["replicas"] = [
                {
                    "name": replica.name,
                    "uid": replica.uid,
                    "phase": replica.phase,
                    "attempt": replica.attempt,
                    "assignedPod": replica.assigned_pod,
                    "inFlight": self.gateway.in_flight.get(replica.uid, 0),
                }
                for replica in replicas
            ]
        return body


def known_failure(error: BaseException | None) -> FailureResponse | None:
    """The answer to a failure of ours: a FailureResponse as it is, one of our error classes
    through wire.GRPC_STATUS, a full disk as 503 naming it; None for anything else (a bug)."""
    if error is not None:
        error = storage_full(error) or error
    if isinstance(error, FailureResponse):
        return error
    if isinstance(error, RunTooLarge):
        return FailureResponse("PAYLOAD_TOO_LARGE", limits.bounded(str(error)), status=413)
    if isinstance(error, Exception) and (code := wire.status_name(error)) is not None:
        return FailureResponse(code, limits.bounded(str(error)))
    return None


def rpc_error(err: grpc.aio.AioRpcError, run: Run, invocation_id: str = "") -> FailureResponse:
    """A status from runtimed as the gateway answers it (``rpc.failure_body``), naming the Run
    as gateway users know it; a handler error keeps its type and logs."""
    body = failure_body(err)
    code = body.pop("code")
    message = body.pop("message").replace(f"run {run.uid}", f'"{run.name}"')
    return FailureResponse(code, message, runUid=run.uid, invocationId=invocation_id, **body)


def header_text(headers: Any, name: str, default: str = "") -> str:
    """A request header as its sender wrote it: tornado gives header values as Latin-1, so UTF-8
    bytes arrive garbled (``'Ù£'`` for ``'٣'``) and an error message quoting one would be too."""
    value = str(headers.get(name, default))
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


def _metadata(metadata: Any) -> dict[str, Any]:
    return {key: value for key, value in metadata or ()}


def _timeline(gateway: dict[str, int], trailers: dict[str, Any]) -> str:
    """The X-Fn-Timeline answer: each hop's monotonic clock readings, in ns (docs/protocol.md,
    "Timeline")."""
    hops = {"gateway": gateway}
    for hop, key in (("runtimed", TIMELINE_RUNTIMED_KEY), ("server", TIMELINE_SERVER_KEY)):
        hops[hop] = parse_timeline_stamps(str(trailers.get(key, "")))
    return json.dumps(hops, separators=(",", ":"))


@web.stream_request_body
class BodyHandler(BaseHandler):
    """A handler of requests with a body, which is streamed: one larger than `max_body` is
    refused with 413 before anything is looked up or called — once it has arrived, read and
    dropped as it came, so the client gets a clean answer; at once when its Content-Length is
    past the transport's cap (where tornado itself would answer 400 and reset the connection)."""

    max_body = limits.MAX_PAYLOAD_BYTES

    def prepare(self) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        super().prepare()
        # Tornado has checked that Content-Length is ASCII digits (400 otherwise).
        length = self.request.headers.get("Content-Length", "")
        if length.isascii() and length.isdigit() and int(length) > limits.GRPC_MAX_MESSAGE_BYTES:
            raise self._too_large(int(length))

    def _too_large(self, size: int) -> FailureResponse:
        return FailureResponse(
            "PAYLOAD_TOO_LARGE",
            status=413,
            message=f"request body is {size} bytes; at most {self.max_body}",
        )

    def data_received(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._size > self.max_body:
            self._chunks.clear()  # keep reading, keep nothing
        else:
            self._chunks.append(chunk)

    def body(self) -> bytes:
        """The whole body; 413 if it was larger than `max_body`."""
        if self._size > self.max_body:
            raise self._too_large(self._size)
        return b"".join(self._chunks)


class NoSuchPath(BaseHandler):
    """A path the gateway does not serve: 404 in the documented shape, after the checks of
    README "Security" (a caller without the token learns nothing about the paths)."""

    def prepare(self) -> None:
        super().prepare()
        raise FailureResponse("NOT_FOUND", f"no such path: {self.request.path[:200]}")


class RunsHandler(BodyHandler):
    # The files' text, at most 6 MiB in all (controlplane.check_files), grows when JSON escapes it.
    max_body = limits.GRPC_MAX_MESSAGE_BYTES

    async def get(self) -> None:
        runs = self.gateway.store.runs()
        self.send_json(200, {"runs": [run.to_json() for run in runs]})

    async def post(self) -> None:
        body = self.json_body()
        files = body.get("files")
        env = body.get("env") or {}
        if not isinstance(files, dict):
            raise InvalidField("files", "must be an object mapping relative paths to text")
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise InvalidField("env", "must be an object of string values")
        idle = body.get("idleTimeoutSeconds", 0)
        if not isinstance(idle, int) or isinstance(idle, bool):
            raise InvalidField("idleTimeoutSeconds", "must be an integer")
        memory = body.get("memoryMb", 0)
        if not isinstance(memory, int) or isinstance(memory, bool):
            raise InvalidField("memoryMb", "must be an integer (MiB)")
        replicas = body.get("replicas", 1)
        if not isinstance(replicas, int) or isinstance(replicas, bool):
            raise InvalidField("replicas", "must be an integer")
        fields = {}
        for key in ("name", "runtime", "handler"):
            value = body.get(key)
            if not isinstance(value, str) or not value:
                raise InvalidField(key, "is required (a string)")
            fields[key] = value
        control_plane = self.gateway.control_plane
        # docs/protocol.md, "Tracing": a registration's spans, exported only.
        hop = tracing.recorded("gateway", self.request.headers.get(wire.TRACEPARENT_HEADER), "POST /v1/runs", {
            "http.request.method": "POST",
            "http.route": "/v1/runs",
            tracing.RUN_NAME: fields["name"],
        })  # fmt: skip
        try:
            with hop.step("create the Run"):
                run = await self.blocking(
                    control_plane.create_run,
                    **fields,
                    files=files,
                    env=env,
                    idle_timeout_seconds=idle,
                    memory_mb=memory,
                    replicas=replicas,
                    source=str(body.get("source", "")),
                    traceparent=hop.traceparent,  # runtimed's registration joins this trace
                )
            hop.set(tracing.RUN_UID, run.uid)
            with hop.step("wait for its registration"):
                run = await self.blocking(control_plane.wait_settled, run.name, CREATE_WAIT_SECONDS)
        except Exception as exc:
            failure = self.failure(exc, 500)
            hop.finish(
                {"http.response.status_code": failure.status},
                error=f"{failure.code}: {failure.message}",
            )
            raise
        hop.finish({"http.response.status_code": 201, tracing.RUN_PHASE: run.phase})
        self.send_json(201, await self.described(run))


class RunHandler(BaseHandler):
    async def get(self, name: str) -> None:
        run = self.gateway.store.get(name)
        body = await self.described(run)
        body["live"] = None
        try:
            pod, stub = self.gateway.route(run)
            call = stub.FunctionStatus(
                pb.FunctionStatusRequest(registration=pb.FunctionRegistration(run_uid=run.uid)),
                timeout=5,
                metadata=((POD_KEY, pod),),
            )
            status = await call
            initial = _metadata(await call.initial_metadata())
            body["live"] = {
                "state": pb.FunctionRegistrationState.Name(status.state).removeprefix(
                    "FUNCTION_REGISTRATION_STATE_"
                ),
                "registrationId": status.registration.registration_id,
                "registrationAttempt": int(initial.get(ATTEMPT_KEY, 0) or 0),
                "registrationDigest": str(initial.get(DIGEST_KEY, "")),
                "inFlight": status.in_flight,
                "lastActivityUnixNano": status.last_activity_unix_nano,
                "fatalError": status.fatal_error,
            }
        except grpc.aio.AioRpcError as err:
            body["liveError"] = f"{err.code().name}: {err.details()}"
        except (NoRuntimePod, RunNotReady) as exc:
            body["liveError"] = str(exc)
        self.send_json(200, body)

    async def delete(self, name: str) -> None:
        # strip=False: numbers are ASCII digits only, so " 5" and "5 " are refused, not trimmed.
        cancel = self.get_query_argument("cancelInFlight", "false", strip=False)
        drain = self.get_query_argument("drainTimeoutMs", "0", strip=False)
        if cancel not in ("true", "false"):
            raise InvalidField("cancelInFlight", f"must be true or false, got {cancel[:40]!r}")
        drain_millis = limits.parse_count(drain, "drainTimeoutMs", limits.MAX_DRAIN_TIMEOUT_MILLIS)
        await self.blocking(
            self.gateway.control_plane.delete_run,
            name,
            cancel_in_flight=cancel == "true",
            drain_timeout_millis=drain_millis,
        )
        self.set_status(204)
        self.finish()


class FilesHandler(BaseHandler):
    """GET /v1/runs/{name}/files — the source a Run was created with, for ``fnkernel export``
    (docs/krm.md, "A notebook function kpt can run")."""

    async def get(self, name: str) -> None:
        run = self.gateway.store.get(name)
        files = await self.blocking(self.gateway.store.files, run.uid)
        self.send_json(
            200, {"name": run.name, "runtime": run.runtime, "handler": run.handler, "files": files}
        )


class InvokeHandler(BodyHandler):
    """POST /v1/runs/{name}:invoke — the body is the JSON payload (BodyHandler: bounded by
    MAX_PAYLOAD_BYTES, refused with 413 before anything is looked up or called)."""

    def prepare(self) -> None:
        self._received = time.monotonic_ns()  # the timeline's first reading (docs/protocol.md)
        self._call: grpc.aio.UnaryUnaryCall | None = None
        self._hop: tracing.Hop | None = None  # a traced call's spans (docs/protocol.md, "Tracing")
        super().prepare()

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        if self._hop is not None:  # a traced call that failed: its spans go with the failure
            exc_info = kwargs.get("exc_info")
            failure = self.failure(exc_info[1] if exc_info else None, status_code)
            self._finish_trace(failure.status, f"{failure.code}: {failure.message}")
        super().write_error(status_code, **kwargs)

    def _finish_trace(self, status: int, error: str = "") -> None:
        """End a traced call's spans: `status` its HTTP answer (0: none, the client left)."""
        hop, self._hop = self._hop, None
        if hop is not None:
            attributes = {"http.response.status_code": status} if status else {}
            spans = hop.finish(attributes, error=error)
            if self.request.headers.get(wire.TRACEPARENT_HEADER):  # the caller asked for them
                self.set_header(wire.SPANS_HEADER, base64.b64encode(spans).decode("ascii"))

    def on_connection_close(self) -> None:
        # The client hung up (an interrupted notebook cell): cancel, so the handler is killed.
        if self._call is not None:
            self._call.cancel()

    async def _call_run(
        self,
        run: Run,
        payload: bytes,
        invocation_id: str,
        timeout_millis: int,
        timeline: bool,
        *,
        counted: bool,
    ) -> tuple[pb.InvokeFunctionResponse, dict[str, Any], int] | None:
        """InvokeFunction on `run` through its pod's runtimed: the response, its trailers and
        when it was called; None if the client went away. `counted`: kept in the gateway's
        count of calls in flight (a replica set's)."""
        pod, stub = self.gateway.route(run)
        request = pb.InvokeFunctionRequest(
            registration=pb.FunctionRegistration(run_uid=run.uid),
            invocation_id=invocation_id,
            input=payload,
            content_type=self.request.headers.get("Content-Type", "application/json"),
            timeout_millis=timeout_millis,
        )
        deadline = limits.wait_seconds(timeout_millis, hops_below=1)  # runtimed
        metadata: tuple[tuple[str, str], ...] = ((POD_KEY, pod),)
        if timeline:
            metadata += ((TIMELINE_KEY, "1"),)
        if self._hop is not None:
            self._hop.set(tracing.RUN_UID, run.uid)
            traceparent = self._hop.call(
                tracing.INVOKE_SPAN, tracing.rpc_attributes("InvokeFunction")
            )
            metadata += ((wire.TRACEPARENT_KEY, traceparent),)
        in_flight = self.gateway.in_flight
        if counted:
            in_flight[run.uid] = in_flight.get(run.uid, 0) + 1
            if invocation_id:
                self.gateway.remember_route(invocation_id, run.name)
        called = time.monotonic_ns()
        self._call = stub.InvokeFunction(request, timeout=deadline, metadata=metadata)
        try:
            response = await self._call
            trailers = _metadata(await self._call.trailing_metadata())
        except grpc.aio.AioRpcError as err:
            if self._hop is not None:
                spans = _metadata(err.trailing_metadata()).get(wire.SPANS_KEY)
                self._hop.called(err.code().value[0], spans)
            raise rpc_error(err, run, invocation_id) from None
        except asyncio.CancelledError:
            return None
        finally:
            if counted:
                left = in_flight.pop(run.uid, 1) - 1
                if left:
                    in_flight[run.uid] = left
        return response, trailers, called

    async def post(self, name: str) -> None:
        body_read = time.monotonic_ns()  # the whole body is in: the timeline's second reading
        payload = self.body()
        headers = self.request.headers
        invocation_id = limits.check_invocation_id(header_text(headers, wire.INVOCATION_ID_HEADER))
        # Any int64 is taken, as on the wire, and capped like timeout_millis (limits.py).
        timeout_millis = limits.parse_count(
            header_text(headers, wire.TIMEOUT_HEADER, "0"), wire.TIMEOUT_HEADER
        )
        traceparent = headers.get(wire.TRACEPARENT_HEADER)
        if tracing.traced(traceparent):
            self._hop = tracing.Hop("gateway", traceparent, "POST /v1/runs/{name}:invoke", {
                "http.request.method": "POST",
                "http.route": "/v1/runs/{name}:invoke",
                tracing.RUN_NAME: name,
                tracing.INVOCATION_ID: invocation_id,
            })  # fmt: skip
        run = self.gateway.store.get_fresh(name)
        timeline = headers.get(wire.TIMELINE_HEADER) == "1"
        if run.replicas == 1 or run.replica_of:
            answer = await self._call_run(
                run, payload, invocation_id, timeout_millis, timeline, counted=False
            )
        else:
            # A replica set: the free replica that has the fewest calls in flight (docs/
            # protocol.md, "Replicas"); one busy with another gateway's call gives the next.
            candidates = self.gateway.replicas(run)
            for index, candidate in enumerate(candidates):
                last = index == len(candidates) - 1
                try:
                    answer = await self._call_run(
                        candidate, payload, invocation_id, timeout_millis, timeline, counted=True
                    )
                except (RunNotReady, NoRuntimePod):
                    if last:
                        raise
                    continue
                except FailureResponse as failure:
                    if last or failure.code != "RESOURCE_EXHAUSTED":
                        raise
                    continue
                run = candidate
                break
        if answer is None:  # the client went away: its call was cancelled
            self._finish_trace(0, "CANCELLED: the client went away")
            return
        response, trailers, called = answer
        if self._hop is not None:
            self._hop.called(0, trailers.get(wire.SPANS_KEY))
            self._hop.set(tracing.INVOCATION_ID, response.invocation_id)
            self._finish_trace(200)
        self.set_header("Content-Type", response.content_type or "application/json")
        self.set_header(wire.INVOCATION_ID_HEADER, response.invocation_id)
        outputs = json.dumps(dict(response.outputs), sort_keys=True) if response.outputs else "{}"
        self.set_header(wire.OUTPUTS_HEADER, outputs)
        self.set_header(wire.ATTEMPT_HEADER, str(trailers.get(ATTEMPT_KEY, run.attempt)))
        if run.replicas != 1:
            self.set_header(wire.RUN_HEADER, run.name)
        if trailers.get(COLD_START_KEY) == "1":
            self.set_header(wire.COLD_START_HEADER, "1")
        logs = trailer_logs(trailers)
        if logs:  # json.dumps writes ASCII: non-ASCII text is \u-escaped
            self.set_header(wire.LOGS_HEADER, json.dumps(logs))
        if timeline:
            readings = {
                "received": self._received,
                "body": body_read,
                "called": called,
                "answered": time.monotonic_ns(),
            }
            self.set_header(wire.TIMELINE_HEADER, _timeline(readings, trailers))
        self.finish(response.output)


class LogsHandler(BaseHandler):
    """GET /v1/runs/{name}/invocations/{id}/logs and /v1/runs/{name}/logs (the call in flight,
    else the last one): an invocation's log lines as NDJSON, streamed while it runs with
    ``?follow=1`` (docs/protocol.md, "Live output")."""

    def prepare(self) -> Awaitable[None] | None:
        self._call: Any = None
        return super().prepare()

    def on_connection_close(self) -> None:
        if self._call is not None:
            self._call.cancel()  # the follower left: so does the stream behind it

    async def get(self, name: str, invocation_id: str = "") -> None:
        follow = self.get_query_argument("follow", "0", strip=False)
        if follow not in ("0", "1", "false", "true"):
            raise InvalidField("follow", f"must be 1 or 0 (true or false), got {follow[:40]!r}")
        if invocation_id:
            invocation_id = limits.check_invocation_id(invocation_id)
        run = self.gateway.store.get_fresh(name)
        replica = self.gateway.routed.get(invocation_id) if invocation_id else None
        if replica is not None and run.replicas != 1 and not run.replica_of:
            run = self.gateway.store.get_fresh(replica)
        pod, address = self.gateway.pod_of(run)
        request = logs_pb2.FollowInvocationLogsRequest(
            run_uid=run.uid, invocation_id=invocation_id, follow=follow in ("1", "true")
        )
        deadline = limits.wait_seconds(limits.MAX_TIMEOUT_MILLIS, hops_below=1)  # the longest call
        call = self.gateway.logs_stub(address).FollowInvocationLogs(
            request, timeout=deadline, metadata=((POD_KEY, pod),)
        )
        self._call = call
        records = aiter(call)
        try:
            first = await anext(records)
        except grpc.aio.AioRpcError as err:
            raise rpc_error(err, run, invocation_id) from None
        except StopAsyncIteration:  # runtimed always names the invocation first
            raise FailureResponse(
                "UNAVAILABLE", f'"{run.name}": the log stream ended at once'
            ) from None
        except asyncio.CancelledError:
            return  # the client went away
        self.set_header("Content-Type", "application/x-ndjson")
        self.set_header("Cache-Control", "no-store")
        head = {"invocationId": first.invocation_id, "run": run.name, "running": first.running}
        if not await self._send(head):
            return
        try:
            async for record in records:
                line = {"stream": record.stream, "text": record.text}
                if record.cut:
                    line["cut"] = True
                if not await self._send(line):
                    return
        except grpc.aio.AioRpcError as err:
            failure = rpc_error(err, run, first.invocation_id)
            await self._send({"error": {"code": failure.code, "message": failure.message}})
        except asyncio.CancelledError:
            return
        else:
            await self._send({"end": True})
        self.finish()

    async def _send(self, record: dict[str, Any]) -> bool:
        """Write one NDJSON line; False (and the stream cancelled) if the client does not take
        it within FOLLOW_FLUSH_SECONDS or has gone."""
        self.write(json.dumps(record) + "\n")
        try:
            await asyncio.wait_for(self.flush(), FOLLOW_FLUSH_SECONDS)
        except (TimeoutError, iostream.StreamClosedError):
            self._call.cancel()
            self.request.connection.close()  # type: ignore[union-attr]
            return False
        return True
