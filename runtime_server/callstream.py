"""InvokeFunction calls on a stream already open (docs/protocol.md, "Call streams").

A grpcio server hands each new RPC from its polling thread to a pool thread, and then hands
that thread the RPC's message: two thread hand-offs on every hop of every call, most of what
a hop costs here (docs/architecture.md, "Call streams"). A message on a stream already open
costs only the second. So between our own processes — a client and runtimed, runtimed and its
Runtime Server — each InvokeFunction travels as a message of
fnkernel.v1alpha1.CallStreams/InvokeFunctions: its request, and the metadata and deadline the
unary call would have carried; answered with the response, or the status, and the trailers the
unary call would have had. The server reads each message with the handler that serves the
unary RPC, through the same call pipeline (``serve``), so a call means the same either way.

``Invoke`` is the calling side: ``with_call`` as grpc's, on one channel, over a stream of its
own while the server takes one, else as a unary RPC; ``AsyncInvoke`` the same on an event loop
(runtimed's relay of the calls on its own streams: docs/architecture.md, "Call streams")."""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import callstreams_pb2 as cs
from fnkernel.runtime_server.rpc import (
    HOP_CHANNEL_OPTIONS,
    metadata_map,
    metadata_pairs,
    never_sent,
)

SERVICE = cs.DESCRIPTOR.services_by_name["CallStreams"].full_name
STREAM_PATH = f"/{SERVICE}/InvokeFunctions"
INVOKE_PATH = f"/{pb.DESCRIPTOR.services_by_name['FunctionRuntime'].full_name}/InvokeFunction"
# How a server with MAX_CALL_STREAMS open refuses another (before reading it): its caller makes
# that call, and the rest on that channel, as unary RPCs.
STREAMS_FULL = "too many call streams open"
STREAMS_ENV = "FNKERNEL_CALL_STREAMS"  # "off": every call a unary RPC (to measure, or to rule out)

Metadata = Sequence[tuple[str, str | bytes]]


# The serving side


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details


class CallContext:
    """The servicer context of one call on a stream: the call's own metadata, deadline and
    trailers; its callbacks run when its answer is made, or when the stream ends first (the
    caller went away), as gRPC runs an RPC's when it terminates. `streaming`: whether the
    stream that carries it is still open."""

    def __init__(self, streaming: Callable[[], bool], call: cs.StreamedCall) -> None:
        self._streaming = streaming
        self._metadata = metadata_pairs(call.metadata)
        micros = call.timeout_micros
        self._deadline = time.monotonic() + micros / 1e6 if micros > 0 else None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], object]] | None = []  # None: terminated
        self.trailers: Metadata = ()

    def invocation_metadata(self) -> Metadata:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        return self._callbacks is not None and self._streaming()

    def add_callback(self, callback: Callable[[], object]) -> bool:
        with self._lock:
            if self._callbacks is None:
                return False
            self._callbacks.append(callback)
            return True

    def set_trailing_metadata(self, trailers: Metadata) -> None:
        self.trailers = tuple(trailers)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)

    def terminate(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks or [], None
        for callback in callbacks:
            callback()


def serve(
    invoke: grpc.RpcMethodHandler, streams: threading.BoundedSemaphore
) -> grpc.RpcMethodHandler:
    """The InvokeFunctions handler of a server whose InvokeFunction is `invoke` (its call
    pipeline's), at most as many open at once as `streams` allows."""
    read = invoke.request_deserializer or (lambda data: data)
    written = invoke.response_serializer or (lambda response: response)
    behaviour: Any = invoke.unary_unary

    def calls(stream: Iterator[cs.StreamedCall], context: grpc.ServicerContext) -> Iterator[Any]:
        if not streams.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, STREAMS_FULL)
        current: list[CallContext] = []

        def ended() -> None:  # the stream's RPC terminated: so does the call it has in flight
            for call in list(current):
                call.terminate()

        context.add_callback(ended)
        try:
            for message in stream:
                call = CallContext(context.is_active, message)
                current[:] = [call]
                try:
                    response = behaviour(read(message.request), call)
                except _Aborted as aborted:
                    answer = streamed_answer(None, call.trailers, aborted.code, aborted.details)
                else:
                    answer = streamed_answer(written(response), call.trailers)
                try:
                    yield answer  # grpc asks for the next once this one is sent
                finally:
                    current.clear()
                    call.terminate()  # as an RPC's callbacks run: with its answer sent
        finally:
            streams.release()

    return grpc.stream_stream_rpc_method_handler(
        calls,
        request_deserializer=cs.StreamedCall.FromString,
        response_serializer=cs.StreamedAnswer.SerializeToString,
    )


def streamed_answer(
    response: bytes | None,
    trailers: Metadata,
    code: grpc.StatusCode = grpc.StatusCode.OK,
    message: str = "",
) -> cs.StreamedAnswer:
    """A call's answer on a stream: its `response`, or (None) the status it failed with, and
    the `trailers` it sends either way."""
    answer = cs.StreamedAnswer(code=code.value[0], message=message)
    if response is not None:
        answer.response = response
    if trailers:
        answer.trailers.update(metadata_map(trailers))
    return answer


# The calling side


class StreamedError(grpc.RpcError):
    """A call on a stream that failed with a status, as grpc raises a unary call's."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: Metadata = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self._trailers = code, details, tuple(trailers)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailers


def _deadline_exceeded() -> StreamedError:
    """A call unanswered at its deadline, failed as a unary call's is."""
    return StreamedError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


def _stream_ended() -> StreamedError:
    """The server ended the stream unasked: the call on it was not read."""
    return StreamedError(grpc.StatusCode.UNAVAILABLE, "the call stream ended")


class Answered:
    """What ``Invoke.with_call`` returns beside the response: its trailers, as grpc's call."""

    __slots__ = ("_trailers",)

    def __init__(self, trailers: Metadata) -> None:
        self._trailers = trailers

    def trailing_metadata(self) -> Metadata:
        return self._trailers


class _Stream:
    """One open InvokeFunctions stream of `owner`'s: a call at a time, its answer read by its
    caller."""

    def __init__(self, channel: grpc.Channel, owner: Invoke) -> None:
        self._calls: queue.SimpleQueue[cs.StreamedCall | None] = queue.SimpleQueue()
        self.answers: Any = channel.stream_stream(
            STREAM_PATH,
            request_serializer=cs.StreamedCall.SerializeToString,
            response_deserializer=cs.StreamedAnswer.FromString,
        )(_sent(self._calls, weakref.ref(owner)))

    def call(self, message: cs.StreamedCall) -> cs.StreamedAnswer:
        self._calls.put(message)
        return next(self.answers)

    def close(self) -> None:
        self._calls.put(None)  # grpc's thread that sends the calls stops waiting for one
        self.answers.cancel()


def _sent(
    calls: queue.SimpleQueue[cs.StreamedCall | None], owner: weakref.ref[Invoke]
) -> Iterator[cs.StreamedCall]:
    """The calls to send, as they come, for grpc's thread that sends them; the stream ends
    (half-closed: its server's thread is freed) at ``close``, or once its owner is gone unclosed,
    which this thread, waiting here, would otherwise outlive and keep the channel open for."""
    while True:
        try:
            call = calls.get(timeout=_OWNER_CHECK_SECONDS)
        except queue.Empty:
            if owner() is None:
                return
            continue
        if call is None:
            return
        yield call


_OWNER_CHECK_SECONDS = 30.0


class Invoke:
    """InvokeFunction on `channel`, a request's bytes in and the response's bytes out, called as
    grpc's ``with_call``: a call at a time, each a message of one stream while the server takes
    one (else, and from then on, a unary RPC; always, where the environment has
    FNKERNEL_CALL_STREAMS=off). ``close`` ends the stream; so does closing the channel, after
    which ``close`` still frees the thread grpc keeps for the stream's sending.

    `streams_at`: where the server takes its call streams, if not on `channel`'s target (runtimed
    serves them on a socket of its own: ``wire.call_streams_target``); a channel to it is this
    object's, and ``close`` closes it. Nothing there to connect to is a refusal too."""

    def __init__(self, channel: grpc.Channel, streams_at: str | None = None) -> None:
        self._unary = channel.unary_unary(
            INVOKE_PATH, request_serializer=None, response_deserializer=None
        )
        self._elsewhere = streams_at is not None
        self._channel = (
            grpc.insecure_channel(streams_at, options=HOP_CHANNEL_OPTIONS)
            if streams_at is not None
            else channel
        )
        self._stream: _Stream | None = None
        self._streams = os.environ.get(STREAMS_ENV) != "off"  # and not refused yet

    def with_call(
        self, request: bytes, timeout: float | None = None, metadata: Metadata | None = None
    ) -> tuple[bytes, Answered]:
        if self._streams:
            answer = self._streamed(request, timeout, metadata)
            if answer is not None:
                response, trailers = answered(answer)
                return response, Answered(trailers)
        response, call = self._unary.with_call(
            request, timeout=timeout, metadata=tuple(metadata) if metadata else None
        )
        return response, Answered(tuple(call.trailing_metadata() or ()))

    def _streamed(
        self, request: bytes, timeout: float | None, metadata: Metadata | None
    ) -> cs.StreamedAnswer | None:
        """The call's answer on the stream; None if the server refused the stream (the call
        was not read: make it as a unary RPC)."""
        stream = self._stream
        if stream is None or stream.answers.done():  # ended since (its server stopped, say)
            stream = self._stream = _Stream(self._channel, self)
        message = streamed_call(request, timeout, metadata)
        watch = _WATCHDOG.watch(time.monotonic() + timeout, stream) if timeout is not None else None
        try:
            return stream.call(message)
        except grpc.RpcError as err:
            self._stream = None
            stream.close()
            if watch is not None and watch.fired:
                raise _deadline_exceeded() from None
            if refused(err) or (self._elsewhere and never_sent(err.code(), err.details() or "")):
                self._streams = False
                return None
            raise
        except StopIteration:  # the server ended the stream unasked: this call was not read
            self._stream = None
            stream.close()
            raise _stream_ended() from None
        except BaseException:  # an interrupt while it waits: the stream goes with the call
            self._stream = None
            stream.close()
            raise
        finally:
            if watch is not None:
                _WATCHDOG.unwatch(watch)

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        if self._elsewhere:
            self._channel.close()


_STATUS = {code.value[0]: code for code in grpc.StatusCode}


def streamed_call(
    request: bytes, timeout: float | None, metadata: Metadata | None
) -> cs.StreamedCall:
    """A call as a stream's message: its request, metadata and deadline (`timeout` seconds)."""
    message = cs.StreamedCall(request=request, metadata=metadata_map(metadata))
    if timeout is not None:
        message.timeout_micros = max(1, int(timeout * 1e6))
    return message


def answered(answer: cs.StreamedAnswer) -> tuple[bytes, Metadata]:
    """A call's response and trailers from its answer on a stream; StreamedError, with the
    trailers, if it failed."""
    trailers = metadata_pairs(answer.trailers)
    if answer.code:
        code = _STATUS.get(answer.code, grpc.StatusCode.UNKNOWN)
        raise StreamedError(code, answer.message, trailers)
    return answer.response, trailers


def refused(err: grpc.RpcError) -> bool:
    """Whether a stream failed with its server's refusal to take it (before it read a call): too
    many open, or none served there. Its caller makes that call, and the rest, as unary RPCs."""
    code = err.code()
    return code == grpc.StatusCode.UNIMPLEMENTED or (
        code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.details() == STREAMS_FULL
    )


class AsyncInvoke:
    """``Invoke`` on an event loop, on the grpc.aio `channel`: calls from many callers at once,
    each on an open stream of its own taken from those idle (or a new one) and given back once
    answered. A call cancelled (its task's caller gone away), or still unanswered at its
    deadline (DEADLINE_EXCEEDED, as a unary call's), cancels its stream, never given back. A
    refused stream's call, and from then on each call past as many streams as were open then,
    is a unary RPC (all of them where the server serves no call streams)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._open = channel.stream_stream(
            STREAM_PATH,
            request_serializer=cs.StreamedCall.SerializeToString,
            response_deserializer=cs.StreamedAnswer.FromString,
        )
        self._unary = channel.unary_unary(
            INVOKE_PATH, request_serializer=None, response_deserializer=None
        )
        self._idle: list[grpc.aio.StreamStreamCall] = []
        self._streams = 0  # open: idle, or carrying a call
        # How many the server takes (learned from its refusal); none where the environment has
        # FNKERNEL_CALL_STREAMS=off.
        self._most: float = 0 if os.environ.get(STREAMS_ENV) == "off" else float("inf")

    async def with_call(
        self, request: bytes, timeout: float | None, metadata: Metadata
    ) -> tuple[bytes, Metadata]:
        """The call's response and trailers; grpc.RpcError if it failed."""
        stream = self._stream()
        if stream is not None:
            answer = await self._streamed(
                stream, streamed_call(request, timeout, metadata), timeout
            )
            if answer is not None:
                return answered(answer)
        call = self._unary(request, timeout=timeout, metadata=tuple(metadata) or None)
        response: bytes = await call
        return response, tuple(await call.trailing_metadata() or ())

    def _stream(self) -> grpc.aio.StreamStreamCall | None:
        """An idle stream, or a new one while the server takes more; None: call unary."""
        while self._idle:
            stream = self._idle.pop()
            if not stream.done():
                return stream
            self._streams -= 1  # ended since (its server stopped, say)
        if self._streams >= self._most:
            return None
        self._streams += 1
        return self._open(None)

    async def _streamed(
        self, stream: grpc.aio.StreamStreamCall, message: cs.StreamedCall, timeout: float | None
    ) -> cs.StreamedAnswer | None:
        """The call's answer on `stream`; None if the server refused the stream."""
        try:
            async with asyncio.timeout(timeout):
                await stream.write(message)
                answer = await stream.read()
        except TimeoutError:
            self._ended(stream)
            raise _deadline_exceeded() from None
        except grpc.RpcError as err:
            self._ended(stream)
            if refused(err):
                self._most = self._streams
                return None
            raise
        except BaseException:  # cancelled: the stream goes with the call
            self._ended(stream)
            raise
        if not isinstance(answer, cs.StreamedAnswer):  # EOF: ended unasked, this call not read
            self._ended(stream)
            raise _stream_ended()
        self._idle.append(stream)
        return answer

    def _ended(self, stream: grpc.aio.StreamStreamCall) -> None:
        stream.cancel()
        self._streams -= 1

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for stream in idle:
            self._ended(stream)


class _Watch:
    __slots__ = ("deadline", "fired", "stream")

    def __init__(self, deadline: float, stream: _Stream) -> None:
        self.deadline, self.stream, self.fired = deadline, stream, False


class _Watchdog:
    """The deadline of each call on a stream, which a stream's RPC cannot have: a call still
    unanswered at its deadline has its stream cancelled, and fails as a unary call's would
    (DEADLINE_EXCEEDED). One thread for the process, started with the first call; it sleeps
    until the earliest deadline and is woken only by a call due before that."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._watches: set[_Watch] = set()
        self._wake_at = float("inf")
        self._thread: threading.Thread | None = None

    def watch(self, deadline: float, stream: _Stream) -> _Watch:
        watch = _Watch(deadline, stream)
        with self._ready:
            self._watches.add(watch)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="call-deadlines", daemon=True
                )
                self._thread.start()
            if deadline < self._wake_at:
                self._ready.notify()
        return watch

    def unwatch(self, watch: _Watch) -> None:
        with self._ready:
            self._watches.discard(watch)

    def _run(self) -> None:
        while True:
            with self._ready:
                now = time.monotonic()
                due = [watch for watch in self._watches if watch.deadline <= now]
                for watch in due:
                    watch.fired = True
                    self._watches.discard(watch)
                self._wake_at = min((w.deadline for w in self._watches), default=float("inf"))
                if not due:
                    wait = self._wake_at - now
                    self._ready.wait(None if wait == float("inf") else wait)
                    continue
            for watch in due:
                watch.stream.answers.cancel()


_WATCHDOG = _Watchdog()
