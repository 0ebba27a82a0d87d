"""The client library of the gateway (docs/protocol.md, "Runs"): used by the CLI, the kernel and the tests.

Standard library only (``http.client``), so importing it costs nothing — the kernel imports it at
start and must not pay for grpc. Addresses are ``http://host:port`` or ``unix:/path``.
"""

from __future__ import annotations

import contextlib
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from fnkernel.runtime_server import limits, payloads, wire
from fnkernel.runtime_server.client.errors import (
    FunctionNotFound,
    FunctionUnavailable,
    GatewayError,
    InvalidRequest,
    PayloadTooLarge,
    RequestCancelled,
    SecretNotFound,
    UnsupportedMediaType,
)
from fnkernel.runtime_server.client.files import (
    Counted,
    FileBody,
    Sink,
    size_of,
    spool_stream,
    write_out,
)
from fnkernel.runtime_server.client.live import LiveFollow, LogCallback
from fnkernel.runtime_server.client.local import Local, meant, result_in
from fnkernel.runtime_server.client.maps import MapRun
from fnkernel.runtime_server.client.sources import parse_pairs, read_source
from fnkernel.runtime_server.client.transport import (
    DEFAULT_ADDRESS,
    Headers,
    Unsent,
    default_address,
    quote,
    spans_of,
)
from fnkernel.runtime_server.client.views import NOT_SPOOLED, InvocationResult, Run
from fnkernel.runtime_server.errors import InvalidField
from fnkernel.runtime_server.function_runtime.spool import new_name

__all__ = [
    "DEFAULT_ADDRESS",
    "Client",
    "InvocationResult",
    "Run",
    "default_address",
    "parse_pairs",
    "read_source",
    "spans_of",
]


class Client(Local):
    """One gateway: its Runs, their calls and maps (docs/protocol.md, "HTTP API")."""

    # Runs

    def create_run(
        self,
        name: str,
        *,
        runtime: str,
        handler: str,
        files: Mapping[str, str] | None = None,
        source: Path | None = None,
        env: Mapping[str, str] | None = None,
        idle_timeout_seconds: int = 0,
        memory_mb: int = 0,
        origin: str = "",
        replicas: int = 1,
        requirements: Sequence[str] = (),
        secrets: Sequence[str] = (),
    ) -> Run:
        """Create a Run from `files` or from the file or directory `source`; the Run as it
        stands once Ready or Failed. `origin` (default: the `source` path) is recorded as the
        Run's ``spec.source``. `replicas` > 1: that many Runs serve the function, and the
        answer lists them (docs/protocol.md, "Replicas"). `requirements`: the Python packages
        its handler imports, installed on its node (docs/protocol.md, "Requirements"). `secrets`:
        the names of the stack's secrets whose keys its handler sees as environment variables
        (docs/protocol.md, "Secrets")."""
        if files is None:
            if source is None:
                raise ValueError("create_run needs files or source")
            files = read_source(source)
        body = {
            "name": name,
            "runtime": runtime,
            "handler": handler,
            "files": dict(files),
            "env": dict(env or {}),
            "idleTimeoutSeconds": idle_timeout_seconds,
            "memoryMb": memory_mb,
            "source": origin or (str(source) if source is not None else ""),
        }
        if replicas != 1:
            body["replicas"] = replicas
        if requirements:
            body["requirements"] = list(requirements)
        if secrets:
            body["secrets"] = list(secrets)
        return Run(self._json("POST", "/v1/runs", body))

    def set_secret(self, name: str, data: Mapping[str, str]) -> dict[str, Any]:
        """Keep `data` (KEY: value) as the stack's secret `name`, replacing what it held; its
        name, new version and keys (docs/protocol.md, "Secrets")."""
        answer: dict[str, Any] = self._json(
            "PUT", f"/v1/secrets/{quote(name)}", {"data": dict(data)}
        )
        return answer

    def list_secrets(self) -> list[dict[str, Any]]:
        """The stack's secrets: each one's name, version and keys, never a value."""
        answer: dict[str, Any] = self._json("GET", "/v1/secrets")
        return list(answer["secrets"])

    def delete_secret(self, name: str) -> None:
        """Forget the stack's secret `name`; SecretNotFound if it keeps none of that name."""
        try:
            self._json("DELETE", f"/v1/secrets/{quote(name)}")
        except FunctionNotFound as exc:  # the gateway's 404, told as what it is about
            raise SecretNotFound.from_body(exc.detail, exc.status) from None

    def files(self, name: str) -> dict[str, Any]:
        """The source the Run `name` was created with: ``{name, runtime, handler, files}``."""
        answer: dict[str, Any] = self._json("GET", f"/v1/runs/{quote(name)}/files")
        return answer

    def list_runs(self) -> list[Run]:
        return [Run(run) for run in self._json("GET", "/v1/runs")["runs"]]

    def status(self, name: str) -> Run:
        """The Run and, as ``live``, its registration's FunctionStatus (None when it has none)."""
        return Run(self._json("GET", f"/v1/runs/{quote(name)}"))

    def delete_run(
        self, name: str, *, cancel_in_flight: bool = False, drain_timeout_millis: int = 0
    ) -> bool:
        """Unregister and delete: drain the in-flight invocation (at most `drain_timeout_millis`,
        0 for the gateway's default), or cancel it. False when its server still held it as
        the gateway's wait ended (202): the Run is gone all the same, and its runtimed
        unregisters it once the server lets go (docs/protocol.md, "Runs")."""
        query = urllib.parse.urlencode(
            {
                "cancelInFlight": "true" if cancel_in_flight else "false",
                "drainTimeoutMs": str(drain_timeout_millis),
            }
        )
        wait = limits.delete_wait_seconds(drain_timeout_millis, hops_below=2)
        status, _, _ = self.request("DELETE", f"/v1/runs/{quote(name)}?{query}", wait=wait)
        return status != 202

    # Invocation

    def invoke(
        self,
        name: str,
        payload: Any = None,
        *,
        data: bytes | BinaryIO | None = None,
        content_type: str = payloads.JSON,
        timeout_millis: int = 0,
        invocation_id: str = "",
        on_log: LogCallback | None = None,
        traceparent: str = "",
        by_reference: bool = True,
        run_uid: str = "",
        write_to: Sink | None = None,
    ) -> InvocationResult:
        """Invoke with `payload` encoded by its kind (``payloads.encode``; docs/protocol.md,
        "Content types": a DataFrame, table or array as Arrow IPC, bytes as octets, the rest as
        JSON; or a ``payloads.Outgoing`` made of one beforehand), or with the raw bytes `data`
        of `content_type`, or a binary file to read them from (TypeError for both, or for a
        `content_type` without `data`). The result's ``value()`` is of the kind the handler
        returned; with `write_to`, an open binary file, the result's bytes are written there as
        they came instead, and not held (its ``written`` says how many).

        On the gateway's machine (docs/protocol.md, "Large payloads"), a payload of at least
        SPOOL_FROM_BYTES is written once into the stack's spool and handed over by its name,
        and a result as large is read from there (an Arrow one mapped, not copied) — unless
        not `by_reference`: then every byte travels in the request and its answer, as it does
        from another machine (streamed past one message). There, `data` read from a file and a
        result for `write_to` go a MiB at a time (``client.files``), never held whole.

        `run_uid`: the uid of the Run the call is meant for; if the Run of that name is another
        (deleted and made again since), it is not called: FunctionNotFound (docs/protocol.md,
        "Ownership").

        `traceparent` (W3C) traces the call: every hop's spans come back as the result's (or
        the failure's) ``spans``, OTLP encoded (docs/protocol.md, "Tracing").

        `on_log(line)` is given each line the call logs (``{"stream", "text"}``), in order:
        as it is written once the call has run for FOLLOW_AFTER_SECONDS (from another
        thread), else — a quicker call, or when no live stream could be had — from its result
        or failure before this returns or raises (docs/protocol.md, "Live output")."""
        _check_timeout(timeout_millis)
        if invocation_id:
            _check_invocation_id(invocation_id)
        with self._preparing(name) as sending:
            return self._invoke(
                name, payload, data=data, content_type=content_type,
                timeout_millis=timeout_millis, invocation_id=invocation_id, on_log=on_log,
                traceparent=traceparent, by_reference=by_reference, run_uid=run_uid,
                write_to=write_to, sending=sending,
            )  # fmt: skip

    def _invoke(
        self,
        name: str,
        payload: Any,
        *,
        data: bytes | BinaryIO | None,
        content_type: str,
        timeout_millis: int,
        invocation_id: str,
        on_log: LogCallback | None,
        traceparent: str,
        by_reference: bool,
        run_uid: str,
        write_to: Sink | None,
        sending: Unsent,
    ) -> InvocationResult:
        """``invoke``'s call, `sending()` said as its request is about to be sent."""
        if data is not None and payload is not None:  # before a file given as data is read
            raise TypeError("invoke takes a payload or data=, not both")
        source = None  # `data` as a file: read into the spool when large, whole if not
        file_body: FileBody | None = None  # or, for another machine, read as it is sent
        if data is not None and not isinstance(data, bytes | bytearray | memoryview):
            if not callable(getattr(data, "read", None)):
                raise TypeError(f"data= is bytes or a binary file, not {type(data).__name__}")
            source, data = data, data.read(limits.SPOOL_FROM_BYTES)
            whole = size_of(source, len(data))
            large = len(data) == limits.SPOOL_FROM_BYTES
            if large and by_reference and self.local_spool() is not None:
                pass  # read into the spool below
            elif whole is not None and whole > limits.MAX_PAYLOAD_BYTES:  # a regular file
                file_body, source = FileBody(data, source, whole), None
            else:
                data, source = data + source.read(), None
        if data is not None:
            outgoing = payloads.Outgoing((data, content_type))
        elif content_type != payloads.JSON:
            raise TypeError(
                "content_type says what data= is; a payload is sent as its kind says "
                '(docs/protocol.md, "Content types")'
            )
        elif isinstance(payload, payloads.Outgoing):
            outgoing = payload
        else:
            outgoing = payloads.Outgoing.of(payload, "payload")
        # The payload's bytes, or an Arrow kind's table, written where its size says.
        encoded, table, size = outgoing.encoded, outgoing.table, outgoing.size
        if file_body is not None:
            size = file_body.size
        spool = None
        direct = by_reference and not traceparent and self._direct_allowed()
        if by_reference:  # asked of the gateway for a large input or a direct call; else as known
            asked = direct or size >= limits.SPOOL_FROM_BYTES
            spool = self.local_spool() if asked else self._spool_known()
        handed: Path | None = None  # the input, written to the spool (docs/protocol.md)
        headers: dict[str, str] = {}
        if spool is not None:
            headers[wire.OUTPUT_REF_FROM_HEADER] = str(limits.SPOOL_FROM_BYTES)
        if spool is not None and size >= limits.SPOOL_FROM_BYTES:
            # Before a byte is written (an Arrow stream is past its size; a file has its own).
            self._bounded(name, whole if source is not None and whole is not None else size)
            handed = spool / new_name("in")
            if source is not None and encoded is not None:  # its first bytes, then the rest
                first, media = encoded
                written = spool_stream(
                    str(handed), first, source, lambda size: self._bounded(name, size, more=True)
                )
            elif encoded is not None:
                with payloads.spool_file(str(handed), size) as out:
                    out.write(encoded[0])
                written, media = size, encoded[1]
            else:
                written, media = payloads.write_table(table, str(handed)), payloads.ARROW
            try:
                self._bounded(name, written)
            except PayloadTooLarge:
                handed.unlink()
                raise
            headers[wire.INPUT_REF_HEADER], body = handed.name, b""
        elif encoded is not None:
            body, media = encoded
        else:
            body, media = payloads.table_bytes(table), payloads.ARROW
        sent: bytes | FileBody = body if file_body is None else file_body
        headers["Content-Type"] = media
        if timeout_millis:
            headers[wire.TIMEOUT_HEADER] = str(timeout_millis)
        live = None
        if on_log is not None:
            invocation_id = invocation_id or limits.new_id("inv_")
            live = self.follow(name, invocation_id, on_log)
        if invocation_id:
            headers[wire.INVOCATION_ID_HEADER] = invocation_id
        if run_uid:
            headers[wire.RUN_UID_HEADER] = run_uid
        if traceparent:
            headers[wire.TRACEPARENT_HEADER] = traceparent
        started = time.perf_counter()
        into = Counted(write_to) if write_to is not None else None
        try:
            reply, output = _once_ready(
                lambda: self._invoked(
                    name, sent, headers, timeout_millis, direct=direct, into=into, live=live
                ),
                timeout_millis,
                sending,
            )
        except BaseException as failed:
            if live is not None:
                live.ended(failed)
            raise
        finally:
            if handed is not None:  # its call has ended (or never began): the server is done
                handed.unlink(missing_ok=True)
        if self._spool is None and reply.get(wire.SPOOL_HEADER):  # a large result came whole
            self._spool = (self._vouched_spool(reply[wire.SPOOL_HEADER]),)
        value: Any = NOT_SPOOLED
        written = -1
        ref = reply.get(wire.OUTPUT_REF_HEADER)
        if ref and spool is None:  # asked of no gateway this client trusts a spool of
            raise GatewayError(
                f"the answer names its result in a spool ({ref.split(' ', 1)[0]!r}), which this "
                "client did not ask for and does not take from this gateway; not read"
            )
        taken = result_in(spool, ref) if ref and spool is not None else None
        try:
            if into is not None:  # as it came (in the answer's body, written as it came; in
                # the answer; or from where the worker wrote it)
                written = into.written + write_out(into, output, str(taken or ""))
                output = b""
            elif taken is not None:  # read where the worker wrote it, then gone
                value = payloads.decode_file(
                    str(taken), reply.get("Content-Type", ""), "the result"
                )
        except BaseException as unread:  # nobody else will read it: not left for the sweep
            if taken is not None:
                taken.unlink(missing_ok=True)
            if isinstance(unread, KeyboardInterrupt):  # the call was over, only not read
                unread.answered = True  # type: ignore[attr-defined]
            raise
        spans = spans_of(reply) if traceparent else b""
        result = InvocationResult.answered(
            reply, output, started, spans=spans, spooled=value, written=written
        )
        if live is not None:
            live.ended(result)
        return result

    def _bounded(self, name: str, size: int, *, more: bool = False) -> None:
        """PayloadTooLarge if a payload of `size` bytes (`more`: at least, a stream's) is past
        the stack's bound, as the gateway would refuse it."""
        if size > self._max_payload:
            said = f"more than {self._max_payload}" if more else size
            message = limits.body_too_large(
                said, self._max_payload, self.bound_why, f"the payload of {name}"
            )
            raise PayloadTooLarge(message, code="PAYLOAD_TOO_LARGE", status=413)

    def _invoked(
        self,
        name: str,
        body: bytes | FileBody,
        headers: dict[str, str],
        timeout_millis: int,
        *,
        direct: bool,
        into: Sink | None = None,
        live: LiveFollow | None = None,
    ) -> tuple[Headers, bytes]:
        """The invoke request's answer, headers and body: from runtimed directly when this
        client shares the gateway's machine (`direct`, a local spool) and the gateway names
        routes for `name` (docs/protocol.md, "Calling runtimed directly"); else, or if they
        have gone, or every replica is busy, from the gateway. `live`: the call's follower,
        told which replica it went to."""
        routes: list[Any] = []
        if direct and isinstance(body, bytes) and self._spool_known() is not None:
            self._headers(headers)  # what HTTP could not carry is refused alike, before anything
            self._bounded(name, len(body))  # a bound under a spooled payload's size, too
            why = wire.unsupported_media(headers.get("Content-Type", ""), payloads.MEDIA_TYPES)
            if why is not None:  # as the gateway refuses it
                raise UnsupportedMediaType(why, code="UNSUPPORTED_MEDIA_TYPE", status=415)
            with contextlib.suppress(GatewayError):  # no such Run, say: the gateway answers it
                routes = self._route(name)
            if not meant(routes, name, headers.get(wire.RUN_UID_HEADER, "")):
                routes = []  # not the Run the call is meant for: the gateway says so
        if routes and isinstance(body, bytes):
            answered = self._called_directly(name, routes, body, headers, timeout_millis, live)
            if answered is not None:
                return answered
        try:
            _, reply, output = self.request(
                "POST", f"/v1/runs/{quote(name)}:invoke", body, headers,
                wait=limits.wait_seconds(timeout_millis, hops_below=2),  # the gateway, runtimed
                into=into,  # a result written as it comes, not held: from another machine
            )  # fmt: skip
        except RequestCancelled:  # in the words of a direct call's, as every failure is
            raise RequestCancelled(f"the call to {name} was cancelled", code="CANCELLED") from None
        return reply, output

    def follow(
        self, name: str, invocation_id: str, on_log: LogCallback, *, in_batch: bool = False
    ) -> LiveFollow:
        """Give `on_log` the lines of the call `invocation_id` of `name` as they are written,
        once it has run FOLLOW_AFTER_SECONDS (a batch's item: once it surely has); ``end`` it
        with the call (``LiveFollow``)."""
        return LiveFollow(self, name, invocation_id, on_log, in_batch=in_batch)

    def _map_client(self) -> Client:
        """A map's own client, as this one calls: cancelling it cancels that map's calls and
        nobody else's."""
        return _MapClient(self)

    def map(
        self,
        name: str,
        items: Iterable[Any],
        *,
        concurrency: int | None = None,
        return_exceptions: bool = False,
        timeout_millis: int = 0,
        progress: Callable[[int, int], None] | None = None,
        on_log: Callable[[int, dict[str, Any]], None] | None = None,
        on_result: Callable[[int, Any], None] | None = None,
        run_uid: str = "",
    ) -> list[Any]:
        """Invoke `name` once per item, up to `concurrency` calls in flight (default, and at
        most: its replica count, as a replica serves one call at a time), and return the
        results in input order (docs/protocol.md, "Replicas"): each output decoded from JSON,
        or as text when it is not JSON. An item refused because every replica is busy (another
        caller's calls) waits for one, up to its timeout.

        The first failure is raised once what is still running has been cancelled (the items
        not yet sent are never sent); with `return_exceptions`, each failure is returned in its
        item's place instead, as ``asyncio.gather`` does. Either way a failure's ``item`` is
        (its item's index, how many items). `progress(done, total)` is called from the
        calling thread every 50 ms while the map runs (calls finished or not), and once at the
        end; `on_result(index, result)` is called from it too, in input order, with each
        item's result as soon as it and every item before it are done (with
        `return_exceptions`, a failure in its place), so that a caller can pass results on
        while the map runs; an exception it raises stops the map as an interrupt does.
        `on_log(index, line)` is each call's ``invoke(on_log=)``, `run_uid` its
        ``invoke(run_uid=)``. An interrupt
        (KeyboardInterrupt) cancels every call in flight and is raised; the function stays
        registered."""
        work = payloads.items_of(items)
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        _check_timeout(timeout_millis)
        # On the stack's machine, a lane (a Run: the function's, or each replica's) per
        # thread, each keeping a batch of items fed (docs/protocol.md, "Batches"); the lanes
        # say how many replicas there are, else the function's status does. Asked by this
        # client: its connection kept alive, and what it learns kept for the next map (the
        # spool; the lanes, until a batch is refused on one).
        lanes: list[Any] = (self._lanes(name, run_uid) if work else None) or [None]
        calls = self._map_client()
        calls.channels_from = self
        replicas = len(lanes)
        if lanes[0] is None:
            replicas = int(self.status(name).get("spec", {}).get("replicas", 1))
        concurrency = min(concurrency or replicas, replicas)
        results: list[Any] = [None] * len(work)
        if not work:
            return results
        run = MapRun(calls, name, work, return_exceptions, timeout_millis, on_log, run_uid)
        with self._lock:
            self._maps.add(run)  # cancel() stops it
        try:
            return run.through(lanes, min(concurrency, len(work)), progress, on_result)
        finally:
            calls.close()
            with self._lock:
                self._maps.discard(run)
            if run.lane_gone:
                self.forget_routes(name)


class _MapClient(Client):
    """A map's own client (``Client.map``): what its parent knows of the gateway's spool, and
    calls without the gateway only where its parent makes them (a kernel's, say, not while
    ``%fn_trace`` shows each gateway request)."""

    def __init__(self, parent: Client) -> None:
        super().__init__(
            parent.address, token=parent.token, timeout=parent.timeout, announced=parent._announced
        )
        self._parent, self._token_found = parent, parent._token_found
        self._spool, self._max_payload = parent._spool, parent._max_payload
        self.bound_why = parent.bound_why

    def _direct_allowed(self) -> bool:
        return self._parent._direct_allowed()


# A call refused while its Run is registered again is sent again after this, doubling up to
# the cap: the gateway's Retry-After (1 s), while a registration takes a fraction of it.
_NOT_READY_FIRST_WAIT_SECONDS = 0.05
_NOT_READY_WAIT_CAP_SECONDS = 1.0


def _once_ready(
    invoked: Callable[[], tuple[Headers, bytes]], timeout_millis: int, sending: Unsent
) -> tuple[Headers, bytes]:
    """`invoked()`, made again while the Run is registered again — refused before it ran, 503
    FAILED_PRECONDITION with Retry-After: a secret of it set again, its server restarted
    (docs/protocol.md, "Errors") — up to the call's own timeout, as a map's item waits for a
    free replica. A Failed Run (no Retry-After) is refused at once."""
    deadline = time.monotonic() + limits.effective_timeout_millis(timeout_millis) / 1000
    pause = _NOT_READY_FIRST_WAIT_SECONDS
    waited = False
    while True:
        sending()  # cancelled while its payload was converted or written: not sent
        try:
            return invoked()
        except FunctionUnavailable as refused:
            if refused.code != "FAILED_PRECONDITION" or not refused.retry_after:
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                if not waited:
                    raise
                message = f"{refused.message}; waited for it to be ready until the call's timeout"
                raise FunctionUnavailable.from_body(
                    {**refused.detail, "message": message}, refused.status
                ) from None
            sending.wait(min(pause, left), refused.message)
            waited, pause = True, min(pause * 2, _NOT_READY_WAIT_CAP_SECONDS)


def _check_invocation_id(invocation_id: str) -> None:
    """An invocation ID the gateway would refuse (docs/protocol.md, "Limits"), refused by its
    name before anything is sent, not by the header it would have gone in."""
    try:
        limits.check_invocation_id(invocation_id)
    except InvalidField as exc:
        raise InvalidRequest(
            f"{exc}, got {invocation_id!r}", code="INVALID_ARGUMENT", status=400
        ) from None


def _check_timeout(timeout_millis: int) -> None:
    """A timeout that is not a count of milliseconds, refused before anything is sent, as the
    gateway refuses its header (400)."""
    if (
        isinstance(timeout_millis, bool)
        or not isinstance(timeout_millis, int)
        or timeout_millis < 0
    ):
        raise InvalidRequest(
            f"timeout_millis: must be a count of milliseconds (0: the function's own), got "
            f"{timeout_millis!r}",
            code="INVALID_ARGUMENT",
            status=400,
        )
