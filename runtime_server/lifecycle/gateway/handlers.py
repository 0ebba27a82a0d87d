"""The gateway's request handlers (docs/protocol.md, "HTTP API"): what every handler does (the
checks of ``access``, failures in the shape of ``failures``, a streamed body) and the handlers of
the Runs — create, list, get, delete, their files. Invocations are ``invoke``'s, live output
``logs``'.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from asyncio import Future
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar, ParamSpec, TypeVar

import grpc
import grpc.aio
from tornado import httputil, web
from tornado.http1connection import HTTP1Connection

from fnkernel.adapters._payloads import JSON
from fnkernel.runtime_server import limits, tracing, wire
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server.errors import (
    InvalidField,
    NoRuntimePod,
    RunNotFound,
    RunNotReady,
)
from fnkernel.runtime_server.lifecycle.gateway import access
from fnkernel.runtime_server.lifecycle.gateway.failures import (
    TORNADO_CODES,
    FailureResponse,
    known_failure,
)
from fnkernel.runtime_server.lifecycle.gateway.routes import Routes
from fnkernel.runtime_server.lifecycle.runs import Run
from fnkernel.runtime_server.wire import (
    ATTEMPT_KEY,
    DIGEST_KEY,
    POD_KEY,
)

P = ParamSpec("P")
T = TypeVar("T")

LOG = logging.getLogger("fnkernel.gateway")
CREATE_WAIT_SECONDS = 90.0  # POST /v1/runs answers once the Run is Ready or Failed
# Tornado's cap on a chunked body, which BodyHandler counts and bounds itself: none to speak of.
_UNCAPPED = 1 << 62


def log_failure(handler: web.RequestHandler) -> None:
    """The access log names the requests that failed (4xx as a warning, 5xx as an error); a
    line per successful call would cost more than the call's own work in the gateway. A 429
    is information: the answer a busy function gives, which a map waits out by asking again
    every few milliseconds."""
    status = handler.get_status()
    if status >= 400:
        level = logging.ERROR if status >= 500 else logging.WARNING
        if status == 429:
            level = logging.INFO
        request = handler.request
        LOG.log(level, "%d %s %s (%s)", status, request.method, request.uri, request.remote_ip)


class BaseHandler(web.RequestHandler):
    gateway: Routes
    bodies: tuple[str, ...] = (JSON,)  # the media types its requests' bodies may be
    # The query parameters each method takes (docs/protocol.md, "HTTP API"); any other is
    # refused, 400 naming it, as a body's unknown field is — not ignored.
    parameters: Mapping[str, tuple[str, ...]] = {}

    def initialize(self, gateway: Routes) -> None:
        self.gateway = gateway
        self.origin: str | None = None  # an allowed Origin the request came from

    def _name_origin(self) -> None:
        """Name the allowed Origin in the answer (CORS), so that its page can read it."""
        if self.origin is not None:
            self.set_header("Access-Control-Allow-Origin", self.origin)
            self.set_header("Vary", "Origin")
            self.set_header("Access-Control-Expose-Headers", access.EXPOSED_HEADERS)

    def prepare(self) -> Awaitable[None] | None:
        """The checks of README "Security" (``access``), before anything is looked up or
        called; an allowed Origin is named in every answer, a refusal included."""
        request, allowed = self.request, self.gateway.access
        self.origin = access.check_origin(request, allowed, self.gateway.listen_host)
        self._name_origin()
        if self.gateway.stopping:
            raise FailureResponse("UNAVAILABLE", "the gateway is stopping; its calls in flight end")
        self.gateway.in_progress.add(self)
        if request.method == "OPTIONS":
            return None  # a CORS preflight carries no token; options() answers it
        # A method the path does not take is 405 (tornado's), whatever its body's type.
        method = (request.method or "").lower()
        taken = getattr(type(self), method, None) is not getattr(web.RequestHandler, method, None)
        access.check_credentials(request, allowed, self.bodies if taken else None)
        known = self.parameters.get(method, ())
        for parameter in request.query_arguments:
            if taken and parameter not in known:
                takes = f"; it takes {', '.join(known)}" if known else ""
                raise InvalidField(
                    parameter[:40], f"is not a parameter of {request.method} {request.path}{takes}"
                )
        return None

    def on_finish(self) -> None:
        self.gateway.in_progress.discard(self)

    def on_connection_close(self) -> None:
        self.gateway.in_progress.discard(self)

    def options(self, *_: str) -> None:
        """The CORS preflight of an allowed origin (prepare refused every other one)."""
        if "Origin" not in self.request.headers:
            raise FailureResponse(
                "METHOD_NOT_ALLOWED", status=405, message="OPTIONS is only a CORS preflight here"
            )
        # The route's own methods: a page may do what any caller may (PUT a secret, say).
        methods = [method for method in self.allowed_methods() if method != "OPTIONS"]
        self.set_header("Access-Control-Allow-Methods", ", ".join(methods))
        self.set_header("Access-Control-Allow-Headers", access.ALLOWED_REQUEST_HEADERS)
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
        if failure.code in wire.RETRY_AFTER_CODES and failure.extra.pop("retry", True):
            self.set_header("Retry-After", "1")
        if failure.status == 401:
            self.set_header("WWW-Authenticate", "Bearer")
        invocation_id = failure.extra.pop("invocationId", "")
        if invocation_id:  # a call that ran (or was refused) names it, as an answer does
            self.set_header(wire.INVOCATION_ID_HEADER, invocation_id)
        self.send_json(
            failure.status,
            {
                "code": failure.code,
                "message": failure.message,
                "runUid": failure.extra.pop("runUid", ""),
                "invocationId": invocation_id,
                **failure.extra,
            },
        )

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """Every failure, ours and tornado's, in the JSON shape of docs/protocol.md, "Errors"."""
        exc_info = kwargs.get("exc_info")
        failure = self.failure(exc_info[1] if exc_info else None, status_code)
        self._name_origin()  # tornado cleared the headers set before the failure
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
            said = error.log_message if isinstance(error, web.HTTPError) else None
            if said:  # tornado's own words name what it refused (a query's non-UTF-8 value)
                with contextlib.suppress(TypeError, ValueError):
                    said = said % error.args if error.args else said  # type: ignore[union-attr]
                reason = f"{reason}: {said}"
            return FailureResponse(TORNADO_CODES.get(status, name), reason, status=status)
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

    async def blocking(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kwargs))

    async def described(self, run: Run) -> dict[str, Any]:
        """The Run as the gateway shows it; a replica set's replica 0 with every replica."""
        body = run.to_json()
        if run.spec.replicas != 1 and not run.spec.replica_of:
            replicas = await self.blocking(self.gateway.control_plane.replicas_of, run)
            body["replicas"] = [
                {
                    "name": replica.name,
                    "uid": replica.uid,
                    "phase": replica.status.phase,
                    "attempt": replica.status.attempt,
                    "assignedPod": replica.status.assigned_pod,
                    "inFlight": self.gateway.in_flight.get(replica.uid, 0),
                }
                for replica in replicas
            ]
        return body


class TracedHandler(BaseHandler):
    """A handler whose `traced_methods` are each one traced hop (docs/protocol.md, "Tracing"):
    its HTTP server span (``METHOD route``, OpenTelemetry's HTTP attributes and the handler's
    ``span_attributes``) begins once the checks of ``prepare`` pass and ends as the answer is
    finished — with its status code and, for a failure, its code and message — or, for a caller
    who went away, by ``abandon``. Its spans are handed back in ``X-Fn-Spans`` where
    `spans_handed_back` and the caller sent a ``traceparent``; else they are recorded only where
    the gateway exports (``tracing.recorded``). The handler adds its own spans to ``hop``."""

    route: ClassVar[str]
    traced_methods: ClassVar[frozenset[str]] = frozenset({"POST"})
    spans_handed_back: ClassVar[bool] = False
    hop: tracing.Hop | tracing.Untraced = tracing.UNTRACED

    def span_attributes(self) -> dict[str, Any]:
        """What the server span says beside the HTTP attributes (the Run's name, ...)."""
        return {}

    def prepare(self) -> Awaitable[None] | None:
        super().prepare()
        self._failure = ""
        method = self.request.method or ""
        if method not in self.traced_methods:
            return None
        traceparent = self.request.headers.get(wire.TRACEPARENT_HEADER)
        name = f"{method} {self.route}"
        attributes = {
            "http.request.method": method,
            "http.route": self.route,
            **self.span_attributes(),
        }
        if not self.spans_handed_back:
            self.hop = tracing.recorded("gateway", traceparent, name, attributes)
        elif tracing.traced(traceparent):
            self.hop = tracing.Hop("gateway", traceparent, name, attributes)
        return None

    def send_failure(self, failure: FailureResponse) -> None:
        self._failure = f"{failure.code}: {failure.message}"
        super().send_failure(failure)

    def finish(self, chunk: str | bytes | dict[str, Any] | None = None) -> Future[None]:
        self._end_span(self.get_status(), self._failure)
        return super().finish(chunk)

    def abandon(self, why: str) -> None:
        """End the span of a call whose caller went away: no answer, so no status code."""
        self._end_span(0, why)

    def _end_span(self, status: int, error: str) -> None:
        hop, self.hop = self.hop, tracing.UNTRACED
        if hop is tracing.UNTRACED:
            return
        spans = hop.finish({"http.response.status_code": status} if status else {}, error=error)
        if self.spans_handed_back and spans and self.request.headers.get(wire.TRACEPARENT_HEADER):
            self.set_header(wire.SPANS_HEADER, base64.b64encode(spans).decode("ascii"))


def header_text(headers: Any, name: str, default: str = "") -> str:
    """A request header as its sender wrote it: tornado gives header values as Latin-1, so UTF-8
    bytes arrive garbled (``'Ù£'`` for ``'٣'``) and an error message quoting one would be too."""
    value = str(headers.get(name, default))
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


def metadata_of(metadata: Any) -> dict[str, Any]:
    return {key: value for key, value in metadata or ()}


@web.stream_request_body
class BodyHandler(BaseHandler):
    """A handler of requests with a body, which is streamed: one larger than its route takes is
    refused with 413 before anything is looked up or called. Its Content-Length says so: the
    413 is sent at once, and the body then read and dropped as it comes (however large, within
    the body timeout) before the answer ends — so that a client that sends its body whole
    before it reads (Python's ``http.client``) reads the 413 too, not a reset connection; one
    that asked to be told first (``Expect: 100-continue``) is answered and the connection
    closed. A body without a Content-Length (chunked) is counted as it comes, and refused once
    it has arrived. Tornado's own cap on a body, the transport's 16 MiB, is lifted for both:
    past it, tornado would answer a bare 400 and close."""

    max_body = limits.MAX_PAYLOAD_BYTES

    def largest_body(self) -> tuple[int, str]:
        """The largest body this route takes at all, and what sets it (for the 413)."""
        return limits.GRPC_MAX_MESSAGE_BYTES, ""

    def whole_body(self) -> tuple[int, str]:
        """The largest body read whole here (the route's own, or one sent without a
        Content-Length), and what sets it (for the 413)."""
        return self.max_body, ""

    def content_length(self) -> int:
        """The body's Content-Length; -1 without one. Tornado has checked that it is ASCII
        digits (400 otherwise)."""
        length = self.request.headers.get("Content-Length", "")
        return int(length) if length.isascii() and length.isdigit() else -1

    def prepare(self) -> Awaitable[None] | None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._refused = False  # its 413 sent before its body, which is read and dropped
        self._held = False  # ``finish`` has held back that answer's end until the body is in
        super().prepare()
        length = self.content_length()
        if length > self.largest_body()[0]:
            refused = self._too_large(length, *self.largest_body())
            if self.request.headers.get("Expect", "").lower() == "100-continue":
                raise refused
            self._refused = True
            self._lift_cap(length)
            self.send_failure(refused)  # sent now: ``finish`` holds the answer's end back
        elif length < 0:
            self._lift_cap(_UNCAPPED)
        return None

    def finish(self, chunk: str | bytes | dict[str, Any] | None = None) -> Future[None]:
        if self._refused and not self._held:  # the 413, sent before its body is read
            self._held = True
            data = chunk.encode() if isinstance(chunk, str) else chunk
            assert isinstance(data, bytes)  # send_json's
            self.set_header("Content-Length", str(len(data)))
            self.write(data)
            return self.flush()
        return super().finish(chunk)

    def _lift_cap(self, size: int) -> None:
        """Let tornado read a body of `size` bytes: this handler bounds what it keeps."""
        if size > limits.GRPC_MAX_MESSAGE_BYTES:
            assert isinstance(self.request.connection, HTTP1Connection)
            self.request.connection.set_max_body_size(size)

    def _too_large(self, size: int, bound: int = 0, why: str = "") -> FailureResponse:
        bound = bound or self.max_body
        return FailureResponse(
            "PAYLOAD_TOO_LARGE",
            status=413,
            message=limits.body_too_large(size, bound, why),
        )

    def data_received(self, chunk: bytes) -> Awaitable[None] | None:
        self._size += len(chunk)
        if self._refused or self._size > self.whole_body()[0]:
            self._chunks.clear()  # keep reading, keep nothing
        else:
            self._chunks.append(chunk)
        return None

    def body(self) -> bytes:
        """The whole body; 413 if it was larger than the route takes."""
        if self._refused:
            raise web.Finish()  # its 413 was sent: read and dropped, the answer ends now
        if self._size > self.whole_body()[0]:
            raise self._too_large(self._size, *self.whole_body())
        return b"".join(self._chunks)


class NoSuchPath(BaseHandler):
    """A path the gateway does not serve: 404 in the documented shape, after the checks of
    README "Security" (a caller without the token learns nothing about the paths)."""

    def prepare(self) -> None:
        super().prepare()
        raise FailureResponse("NOT_FOUND", f"no such path: {self.request.path[:200]}")


# What a Run is created with (docs/protocol.md, "HTTP API"): a field besides these is a typo,
# refused rather than left to its default (``memoryMB`` for ``memoryMb``).
RUN_FIELDS = frozenset(
    ("name", "runtime", "handler", "files", "env", "idleTimeoutSeconds", "memoryMb",
     "replicas", "requirements", "secrets", "source")
)  # fmt: skip


class RunsHandler(TracedHandler, BodyHandler):
    route = "/v1/runs"  # a registration's spans are exported only (docs/protocol.md, "Tracing")
    # The files' text, at most 6 MiB in all (controlplane.check_files), grows when JSON escapes it.
    max_body = limits.GRPC_MAX_MESSAGE_BYTES

    async def get(self) -> None:
        runs = self.gateway.store.runs()
        self.send_json(200, {"runs": [run.to_json() for run in runs]})

    async def post(self) -> None:
        body = self.json_body()
        if unknown := sorted(set(body) - RUN_FIELDS):
            raise InvalidField(
                unknown[0], f"is not a field of a Run; its fields: {', '.join(sorted(RUN_FIELDS))}"
            )
        fields = {}
        for key in ("name", "runtime", "handler"):
            value = body.get(key)
            if not isinstance(value, str) or not value:
                raise InvalidField(key, "is required (a string)")
            fields[key] = value
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
        requirements = body.get("requirements") or []
        if not isinstance(requirements, list):
            raise InvalidField("requirements", "must be an array of PEP 508 requirements")
        secrets = body.get("secrets") or []
        if not isinstance(secrets, list):
            raise InvalidField("secrets", "must be an array of secret names")
        control_plane = self.gateway.control_plane
        hop = self.hop
        hop.set(tracing.RUN_NAME, fields["name"])
        with hop.step("create the Run"):
            run = await self.blocking(
                control_plane.create_run,
                **fields,
                files=files,
                env=env,
                idle_timeout_seconds=idle,
                memory_mb=memory,
                replicas=replicas,
                requirements=requirements,
                secrets=secrets,
                source=str(body.get("source", "")),
                traceparent=hop.traceparent,  # runtimed's registration joins this trace
            )
        hop.set(tracing.RUN_UID, run.uid)
        with hop.step("wait for its registration"):
            run = await self.blocking(control_plane.wait_settled, run.name, CREATE_WAIT_SECONDS)
        hop.set(tracing.RUN_PHASE, run.status.phase)
        self.send_json(201, await self.described(run))


# What a delete answers (202) when the Run's server still held it as the wait ended.
DELETED_UNCONFIRMED = (
    "removed from the store, but its Runtime Server still held it when the wait ended (it did "
    "not answer, or the registration was still loading): its runtimed unregisters it once the "
    "server lets go"
)


class RunHandler(BaseHandler):
    parameters = {"delete": ("cancelInFlight", "drainTimeoutMs")}

    async def get(self, name: str) -> None:
        run = self.gateway.store.get(name)
        body = await self.described(run)
        body["live"], error = await self._live(run)
        if error:
            body["liveError"] = error
        if "replicas" in body:
            # Each replica's calls in flight as its server counts them: a map's batches and
            # direct calls never pass the gateway (docs/protocol.md, "Batches").
            lives = await asyncio.gather(*(self._live_of(m["name"]) for m in body["replicas"][1:]))
            for member, live in zip(body["replicas"], [body["live"], *lives], strict=True):
                if live is not None:
                    member["inFlight"] = live["inFlight"]
        self.send_json(200, body)

    async def _live_of(self, name: str) -> dict[str, Any] | None:
        try:
            run = self.gateway.store.get(name)
        except RunNotFound:
            return None  # deleted meanwhile
        return (await self._live(run))[0]

    async def _live(self, run: Run) -> tuple[dict[str, Any] | None, str]:
        """The Run's registration as its server has it (FunctionStatus), or why there is none."""
        try:
            pod, stub = self.gateway.route(run)
            call = stub.FunctionStatus(
                pb.FunctionStatusRequest(registration=pb.FunctionRegistration(run_uid=run.uid)),
                timeout=limits.status_wait_seconds(hops_below=2),  # runtimed, the server
                metadata=((POD_KEY, pod),),
            )
            status = await call
            initial = metadata_of(await call.initial_metadata())
        except grpc.aio.AioRpcError as err:
            return None, f"{err.code().name}: {err.details()}"
        except (NoRuntimePod, RunNotReady) as exc:
            return None, str(exc)
        return {
            "state": pb.FunctionRegistrationState.Name(status.state).removeprefix(
                "FUNCTION_REGISTRATION_STATE_"
            ),
            "registrationId": status.registration.registration_id,
            "registrationAttempt": int(initial.get(ATTEMPT_KEY, 0) or 0),
            "registrationDigest": str(initial.get(DIGEST_KEY, "")),
            "inFlight": status.in_flight,
            "lastActivityUnixNano": status.last_activity_unix_nano,
            "fatalError": status.fatal_error,
        }, ""

    async def delete(self, name: str) -> None:
        # strip=False: numbers are ASCII digits only, so " 5" and "5 " are refused, not trimmed.
        cancel = self.get_query_argument("cancelInFlight", "false", strip=False)
        drain = self.get_query_argument("drainTimeoutMs", "0", strip=False)
        if cancel not in ("true", "false"):
            raise InvalidField("cancelInFlight", f"must be true or false, got {cancel[:40]!r}")
        drain_millis = limits.parse_count(drain, "drainTimeoutMs", limits.MAX_DRAIN_TIMEOUT_MILLIS)
        gone = await self.blocking(
            self.gateway.control_plane.delete_run,
            name,
            cancel_in_flight=cancel == "true",
            drain_timeout_millis=drain_millis,
        )
        if not gone:  # removed, but its server still held it: say so, not "unregistered"
            self.send_json(202, {"name": name, "message": DELETED_UNCONFIRMED})
            return
        self.set_status(204)
        self.finish()


class FilesHandler(BaseHandler):
    """GET /v1/runs/{name}/files — the source a Run was created with, for ``fnkernel export``
    (docs/krm.md, "A notebook function kpt can run")."""

    async def get(self, name: str) -> None:
        run = self.gateway.store.get(name)
        files = await self.blocking(self.gateway.store.files, run.uid)
        self.send_json(
            200,
            {
                "name": run.name,
                "runtime": run.spec.runtime,
                "handler": run.spec.handler,
                "files": files,
            },
        )
