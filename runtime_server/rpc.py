"""What every gRPC server and client of fnkernel shares: message limits, reflection, health,
deadlines, and the translation of our errors into statuses (docs/protocol.md, "Errors")."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from fnkernel.adapters.errors import HandlerError, InvocationCancelled
from fnkernel.runtime_server import limits, tracing, wire
from fnkernel.runtime_server.errors import TooManyFollowers

LOG = logging.getLogger("fnkernel.rpc")
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
# docs/architecture.md, "Measured facts the design rests on": raise both limits on every server and client; we enforce 6 MiB ourselves.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", limits.GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", limits.GRPC_MAX_MESSAGE_BYTES),
]
# A unary call between two of our own processes (``CancellableCalls``: a caller to runtimed,
# runtimed to its server) on grpc's minimal channel stack, its deadline still checked: 3-4% off
# a call (docs/architecture.md, "grpc's I/O engine"). What goes is the channel's idle timer and
# its own check of message sizes, which the server at the other end, ours, makes anyway.
HOP_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.minimal_stack", 1),
    ("grpc.enable_deadline_checking", 1),
]
# A channel whose server-streaming calls are read by the calling thread itself, not handed over
# from a channel thread of grpc's (docs/architecture.md, "A map's items in batches").
STREAM_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("SingleThreadedUnaryStream", 1),
]  # grpc.experimental's name


def add_reflection(server: grpc.Server, service_names: list[str]) -> None:
    """Serve reflection as v1alpha and v1: grpcio-reflection only names v1alpha, and the two
    protocols have identical wire messages (docs/architecture.md, "Measured facts the design rests on"), so one servicer answers both."""
    names = [*service_names, reflection.SERVICE_NAME, REFLECTION_V1]
    servicer = reflection.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.method_handlers_generic_handler(
        REFLECTION_V1,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1,))


def add_health(server: grpc.Server, service_names: list[str]) -> health.HealthServicer:
    servicer = health.HealthServicer()  # it answers SERVING for the server itself ("") already
    for name in service_names:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


class CallerContext(Protocol):
    """What a hop reads of a call it serves, and answers it with: an RPC's servicer context, or
    a call's on a stream (``callstream.CallContext``)."""

    def invocation_metadata(self) -> Any: ...

    def time_remaining(self) -> float | None: ...

    def set_trailing_metadata(self, trailing_metadata: Any) -> None: ...


def listen_on(server: grpc.Server | grpc.aio.Server, listen: str) -> str:
    """Bind `listen` (``host:port`` or ``unix:PATH``); the address clients dial (the port a
    ``host:0`` was given). RuntimeError if it cannot be bound (grpcio's), or reached (ours,
    naming why)."""
    if listen.startswith("unix:"):
        problem = wire.unix_target_problem(listen[5:])
        if problem is not None:
            raise RuntimeError(problem)
        server.add_insecure_port(listen)
        return listen
    port = server.add_insecure_port(listen)
    return f"{listen.rpartition(':')[0]}:{port}"


_MAX_LOGS_TRAILER = 4096
_NO_DEADLINE = 1e9  # the sync server reports ~9.2e18 s remaining when the client set none

S = TypeVar("S")
T = TypeVar("T")
R = TypeVar("R")


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    """The gRPC status wire.GRPC_STATUS gives `exc`, or None for an unexpected error."""
    name = wire.status_name(exc)
    return None if name is None else grpc.StatusCode[name]


_EXTRA_TRAILERS = "fn_extra_trailers"


def with_trailers(exc: BaseException, trailers: tuple[tuple[str, str | bytes], ...]) -> None:
    """Send `trailers` with the status `exc` is answered with (a traced hop's spans), in place
    of any of the same key an upstream call's status relays."""
    setattr(exc, _EXTRA_TRAILERS, trailers)


def answer_failure(exc: Exception, context: grpc.ServicerContext, method: str) -> None:
    """Abort the RPC with the status `exc` maps to (docs/protocol.md, "Errors"); no Python
    traceback ever reaches a status message."""
    code, message, trailers = failure_status(exc, method)
    if trailers:
        context.set_trailing_metadata(trailers)
    context.abort(code, message)


def failure_status(
    exc: Exception, method: str
) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str | bytes], ...]]:
    """The status `exc` is answered with: its code, its message and its trailers (a handler
    error's type and logs, a timeout's logs, a traced hop's spans)."""
    extra: tuple[tuple[str, str | bytes], ...] = getattr(exc, _EXTRA_TRAILERS, ())
    if isinstance(exc, grpc.RpcError):  # an upstream call's status passes through (proxy hop)
        upstream: Any = exc
        relayed = relayed_trailers(upstream.trailing_metadata(), {key for key, _ in extra})
        return upstream.code(), upstream.details() or "", relayed + extra
    code = status_of(exc)
    if code is None:
        LOG.exception("internal error in %s", method, exc_info=exc)
        return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}", extra
    if isinstance(exc, HandlerError):
        handler = ((wire.ERROR_TYPE_KEY, exc.error_type), (wire.LOGS_KEY, logs_trailer(exc.logs)))
        return code, limits.bounded(f"handler error: {exc}"), (*handler, *extra)
    logs = getattr(exc, "logs", ())  # a timeout's: what the handler wrote until then
    trailers = ((wire.LOGS_KEY, logs_trailer(logs)),) if logs else ()
    return code, limits.bounded(str(exc)), trailers + extra


def traced_failure(hop: tracing.Hop | tracing.Untraced, exc: BaseException) -> None:
    """End a traced hop with the status `exc` is answered with, and send its spans with that
    status."""
    upstream: Any = exc
    code = upstream.code() if isinstance(exc, grpc.RpcError) else status_of(exc)
    code = code or grpc.StatusCode.INTERNAL
    attributes: dict[str, Any] = {"rpc.grpc.status_code": code.value[0]}
    if isinstance(exc, grpc.RpcError):  # the hop beyond failed: its span says how
        why = upstream.details()
    else:
        why, attributes["fnkernel.error_type"] = str(exc), type(exc).__name__
    spans = hop.finish(attributes, error=f"{code.name}: {limits.bounded(why or '')}")
    if spans:  # none from a hop whose spans are exported only (tracing.recorded)
        with_trailers(exc, ((wire.SPANS_KEY, spans),))


def relayed_trailers(
    trailers: Any, replaced: set[str] | frozenset[str] = frozenset()
) -> tuple[tuple[str, str | bytes], ...]:
    """An upstream call's ``fn-*`` trailers (error type, logs), to pass on unchanged; those
    named in `replaced` are left for the hop to give its own."""
    return tuple((k, v) for k, v in trailers or () if k.startswith("fn-") and k not in replaced)


def metadata_map(pairs: Iterable[tuple[str, str | bytes]] | None) -> dict[str, bytes]:
    """gRPC metadata or trailers as a message carries them (a ``map<string, bytes>``: a batch's
    answer, a call stream's messages)."""
    return {key: value.encode() if isinstance(value, str) else value for key, value in pairs or ()}


def metadata_pairs(mapping: Mapping[str, bytes]) -> tuple[tuple[str, str | bytes], ...]:
    """``metadata_map``'s map as gRPC hands metadata over: text, but for ``-bin`` keys."""
    return tuple(
        (key, value if key.endswith("-bin") else value.decode()) for key, value in mapping.items()
    )


def trailer_value(trailers: Any, key: str) -> Any:
    """The value of `key` among a finished call's trailing metadata, or None."""
    return next((value for name, value in trailers or () if name == key), None)


def metadata_value(context: CallerContext, key: str) -> str | None:
    """The value of the caller's metadata `key`, or None."""
    for name, value in context.invocation_metadata():
        if name == key:
            return str(value)
    return None


def caller_timeout(context: CallerContext) -> float | None:
    """Seconds left before the caller's deadline, or None if it set none."""
    remaining = context.time_remaining()
    if remaining is None or remaining > _NO_DEADLINE:
        return None
    return float(remaining)


def caller_deadline(context: grpc.ServicerContext) -> float | None:
    remaining = caller_timeout(context)
    return None if remaining is None else time.monotonic() + remaining


def cancel_on_client_exit(context: grpc.ServicerContext) -> Callable[[Callable[[], object]], None]:
    """An on_dispatch hook: run `cancel` when the RPC ends early (client cancel or deadline).

    gRPC runs the callback ~0.2 ms after a client cancel (docs/architecture.md, "Measured facts the design rests on"); when it runs after a normal
    completion, cancelling a finished call is a no-op.
    """

    def on_dispatch(cancel: Callable[[], object]) -> None:
        def callback() -> None:
            cancel()

        if not context.add_callback(callback):
            cancel()  # the RPC already ended

    return on_dispatch


# What stands first in a trailer that does not carry the whole log; room is kept for it.
_LOGS_LEFT_OUT = (
    "[fnkernel: the call's log is longer than its answer carries (the last 4 KiB): "
    "{} earlier line(s) left out]"
)
_LEFT_OUT_ROOM = 160
_CUT_SHORT = " […]"


def logs_trailer(logs: tuple[Any, ...]) -> bytes:
    """The last log lines that fit the trailer budget, oldest first, as compact JSON
    [{stream, text}] (docs/protocol.md, "Errors"). When not all fit, the first entry says how
    many were left out (with ``cut``: a client that wants them asks for the call's log), and a
    last line past the budget by itself is kept cut short, not left out whole."""
    entries = [{"stream": line.stream, "text": line.text} for line in logs]
    sizes = [len(_compact(entry)) + 1 for entry in entries]
    if 1 + sum(sizes) <= _MAX_LOGS_TRAILER:
        return _compact(entries).encode()
    budget = _MAX_LOGS_TRAILER - _LEFT_OUT_ROOM
    kept: list[dict[str, Any]] = []
    size = 1  # "["; each entry then adds itself and one "," or the closing "]"
    for entry, entry_size in zip(reversed(entries), reversed(sizes), strict=True):
        if size + entry_size > budget:
            break
        size += entry_size
        kept.append(entry)
    if not kept and entries:  # the last line alone is past the budget: its start, marked
        last = entries[-1]
        room = (budget - size - len(_compact({**last, "text": _CUT_SHORT})) - 1) // 6  # \uXXXX
        start = last["text"].encode()[:room].decode("utf-8", "ignore")
        kept.append({**last, "text": start + _CUT_SHORT})
    left_out = len(entries) - len(kept)
    kept.append({"stream": "stderr", "text": _LOGS_LEFT_OUT.format(left_out), "cut": True})
    return _compact(kept[::-1]).encode()


def trailer_logs(trailers: dict[str, Any]) -> list[Any]:
    """The log lines of ``logs_trailer``, read back; none if the trailer is absent or garbled."""
    raw = trailers.get(wire.LOGS_KEY)
    if not raw:
        return []
    try:
        return list(json.loads(raw))
    except ValueError:
        return []


def failure_body(err: grpc.RpcError) -> dict[str, Any]:
    """A failed call's status as the JSON body of docs/protocol.md, "Errors" — the one
    translation of a Runtime Server's (or runtimed's) status for a client: its code and message,
    and for a handler error (UNKNOWN) the error's type, its message and the handler's logs from
    the trailers. The gateway sends it; the teaching client raises it as the gateway's client
    would (``runtime_server.client.errors.from_response``)."""
    call: Any = err
    return status_body(call.code(), call.details() or "", dict(call.trailing_metadata() or ()))


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The status code numbered `number` in a message (a batch's answer, a poll's, carry one);
    UNKNOWN for a number grpc does not know."""
    return _STATUS_CODES.get(number, grpc.StatusCode.UNKNOWN)


# grpc's own words when a call's connection failed, with no status from the process it called
# (that process died, or was not there): what each means for the call (docs/protocol.md, "Errors").
_NOT_REACHED = "failed to connect"
# ... and a stopping server's words for the calls it ends with it (its GOAWAY's text).
_CUT_OFF = (
    "Socket closed",
    "Stream removed",
    "Connection reset",
    "Broken pipe",
    "Cancelling all calls",
)
# gRPC's own words for a deadline that passed with no answer from the process called: not the
# handler's deadline, which its server answers in words of its own.
_NO_ANSWER = "Deadline Exceeded"


def no_answer(code: grpc.StatusCode, message: str) -> bool:
    """Whether a status is gRPC's own for a deadline that passed with no answer from the
    process called (not the handler's deadline, which its server words itself)."""
    return code == grpc.StatusCode.DEADLINE_EXCEEDED and message == _NO_ANSWER


def never_sent(code: grpc.StatusCode, message: str) -> bool:
    """Whether a status is grpc's own for a connection that could not be made: the call never
    left (the process it calls is not there: stopped, or restarting)."""
    return code == grpc.StatusCode.UNAVAILABLE and _NOT_REACHED in message


def status_body(code: grpc.StatusCode, message: str, trailers: dict[str, Any]) -> dict[str, Any]:
    """``failure_body`` of a status given by its parts (a batch's answer carries them)."""
    if code == grpc.StatusCode.UNAVAILABLE:
        if never_sent(code, message):
            message = f"the call was not sent: a process on its path is not there ({message})"
        elif any(words in message for words in _CUT_OFF):
            message = (
                "the call was cut off: a process on its path went away while it was in flight,"
                f" so it may have run ({message})"
            )
    if no_answer(code, message):
        message = (
            f"{wire.NO_ANSWER}: a process on its path did "
            f"not answer (paused, overloaded), so it may have run ({message})"
        )
    body: dict[str, Any] = {"code": code.name, "message": message}
    if code == grpc.StatusCode.UNKNOWN:
        error_type = str(trailers.get(wire.ERROR_TYPE_KEY, ""))
        body["errorType"] = error_type
        body["errorMessage"] = message.removeprefix(f"handler error: {error_type}: ")
        body["logs"] = trailer_logs(trailers)
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        logs = trailer_logs(trailers)
        if logs:  # what the handler wrote before its deadline
            body["logs"] = logs
    return body


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


class Followers:
    """How many live-log streams a process relays at once (limits.MAX_LOG_FOLLOWERS): each
    holds an RPC thread for as long as its invocation runs, and calls must keep theirs."""

    def __init__(self, limit: int = limits.MAX_LOG_FOLLOWERS) -> None:
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)

    def stream(
        self,
        records: Callable[[], Iterator[R | None]],
        context: grpc.ServicerContext,
    ) -> Iterator[R]:
        """The records `records()` makes, holding a slot until they end or the caller leaves
        (a None: nothing new, and a moment to look)."""
        if not self._slots.acquire(blocking=False):
            raise TooManyFollowers(
                f"{self.limit} live-log streams are open here; the call's log comes with its result"
            )
        try:
            for record in records():
                if not context.is_active():
                    return
                if record is not None:
                    yield record
        finally:
            self._slots.release()


class CancellableCalls(Generic[S]):
    """Blocking calls to one target that their caller can still cancel (docs/architecture.md,
    "The proxy hop"): a servicer whose own caller goes away, a client's ``cancel()``.

    grpc's blocking call gives no handle to cancel it; ``.future()`` does, but hands every
    answer from the channel's own thread to the caller's (0.15 to 0.23 ms a call, measured). So
    each call here takes a channel of its own from a pool — channels to one target share one
    connection — and cancelling a call closes that channel, which cancels its one call. A
    channel goes back to the pool only if its call ended without that."""

    _MAX_IDLE = 64

    def __init__(self, target: str, stub: Callable[[grpc.Channel], S]) -> None:
        self._target = target
        self._stub = stub
        self._lock = threading.Lock()
        self._idle: list[tuple[grpc.Channel, S]] = []
        self._cancels: set[Callable[[], None]] = set()  # of the calls in flight

    def call(self, rpc: Callable[[S], T], context: grpc.ServicerContext | None = None) -> T:
        """``rpc(stub)`` on a channel of its own, cancelled if `context`'s RPC ends first, by
        ``cancel``, or by an interrupt while it waits. Cancelled, a call without a `context` (a
        client's) raises InvocationCancelled; a servicer's, the RpcError (its caller is gone)."""
        with self._lock:
            pair = self._idle.pop() if self._idle else None
        if pair is None:
            channel = grpc.insecure_channel(self._target, options=HOP_CHANNEL_OPTIONS)
            pair = (channel, self._stub(channel))
        channel, stub = pair
        state = {"ended": False, "cancelled": False}
        guard = threading.Lock()

        def cancel() -> None:  # gRPC runs it when the caller's RPC ends, however it ends
            with guard:
                if state["ended"]:
                    return  # our call ended first: the channel may serve another by now
                state["cancelled"] = True
            _closed(pair)

        if context is not None and not context.add_callback(cancel):  # it has ended already
            self._give_back(pair)
            raise InvocationCancelled("the caller went away before the call was made")
        with self._lock:
            self._cancels.add(cancel)
        try:
            return rpc(stub)
        except grpc.RpcError:
            if state["cancelled"] and context is None:
                raise InvocationCancelled("the call was cancelled") from None
            raise
        except BaseException:  # an interrupt while it waits: the call goes with it
            cancel()
            raise
        finally:
            with self._lock:
                self._cancels.discard(cancel)
            with guard:
                state["ended"] = True
            if not state["cancelled"]:
                self._give_back(pair)

    def cancel(self) -> int:
        """From another thread: cancel every call in flight; how many there were."""
        with self._lock:
            cancels = list(self._cancels)
        for cancel in cancels:
            cancel()
        return len(cancels)

    def _give_back(self, pair: tuple[grpc.Channel, S]) -> None:
        with self._lock:
            if len(self._idle) < self._MAX_IDLE:
                self._idle.append(pair)
                return
        _closed(pair)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for pair in idle:
            _closed(pair)


def _closed(pair: tuple[grpc.Channel, Any]) -> None:
    """Close a pooled channel, and its stub if it holds more than the channel (a stream's
    sending thread: ``callstream.Invoke``)."""
    pair[0].close()
    closing = getattr(pair[1], "close", None)
    if closing is not None:
        closing()
