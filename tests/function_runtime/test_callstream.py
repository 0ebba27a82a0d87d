"""InvokeFunction calls on a stream already open, ``callstream`` (docs/protocol.md, "Call
streams"): tried against real grpcio servers — one with our call pipeline, as runtimed and the
Runtime Server have, and one without — with handlers that do only their part."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from fnkernel.adapters.errors import InvocationCancelled
from fnkernel.runtime_server import callstream, limits
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.errors import InvalidField
from fnkernel.runtime_server.pipeline import Pipeline, served_call
from fnkernel.runtime_server.rpc import CancellableCalls, trailer_value
from fnkernel.runtime_server.wire import INPUT_REF_KEY, TIMELINE_KEY, TIMELINE_SERVER_KEY
from tests.support import wait_until

FUNCTION_RUNTIME = pb.DESCRIPTOR.services_by_name["FunctionRuntime"].full_name


class Handlers(pb_grpc.FunctionRuntimeServicer):
    """InvokeFunction by its invocation ID: "bad" and "boom" fail, "hold" waits until released
    (noting when its caller goes away), "seen" answers what it was sent besides the input."""

    def __init__(self) -> None:
        self.unary: list[bool] = []  # each call: was it an RPC of its own?
        self.held = threading.Semaphore(0)
        self.release = threading.Event()
        self.gone = threading.Event()

    def InvokeFunction(self, request: Any, context: Any) -> Any:
        self.unary.append(isinstance(context, grpc.ServicerContext))
        if request.invocation_id == "bad":
            raise InvalidField("input", "not what this handler takes")
        if request.invocation_id == "boom":
            raise RuntimeError("a bug")
        if request.invocation_id == "hold":
            context.add_callback(self.gone.set)
            self.held.release()
            self.release.wait(30)
        if request.invocation_id == "seen":
            seen = {
                key: value for key, value in context.invocation_metadata() if key == INPUT_REF_KEY
            }
            seen["deadline"] = context.time_remaining() is not None
            return pb.InvokeFunctionResponse(outputs={k: str(v) for k, v in seen.items()})
        with contextlib.suppress(LookupError):  # none on a server without the pipeline
            served_call().trailers = (("fn-handler", "its own"),)
        return pb.InvokeFunctionResponse(output=request.input)


class Server:
    def __init__(self, tmp_path: Path, *, pipeline: bool = True) -> None:
        self.handlers = Handlers()
        self.pipeline = Pipeline(
            [FUNCTION_RUNTIME], component="runtime-server", timeline_key=TIMELINE_SERVER_KEY
        )
        interceptors = [self.pipeline] if pipeline else []
        workers = limits.MAX_CALL_STREAMS + 8
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers), interceptors=interceptors
        )
        pb_grpc.add_FunctionRuntimeServicer_to_server(self.handlers, self.server)
        self.address = f"unix:{tmp_path}/hop.sock"
        self.server.add_insecure_port(self.address)
        self.server.start()
        self.channels: list[grpc.Channel] = []

    def invoke(self) -> callstream.Invoke:
        channel = grpc.insecure_channel(self.address)
        self.channels.append(channel)
        return callstream.Invoke(channel)

    def close(self) -> None:
        self.handlers.release.set()
        for channel in self.channels:
            channel.close()
        self.server.stop(None)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    hop = Server(tmp_path)
    yield hop
    hop.close()


def request(invocation_id: str = "", data: bytes = b"{}") -> bytes:
    return pb.InvokeFunctionRequest(invocation_id=invocation_id, input=data).SerializeToString()


def outcome(invoke: Any, invocation_id: str, **kwargs: Any) -> tuple[Any, ...]:
    """What a caller learns of a call: the response and trailers, or the status and trailers."""
    try:
        response, call = invoke(request(invocation_id), timeout=10, **kwargs)
    except grpc.RpcError as err:
        failed: Any = err
        trailers = dict(failed.trailing_metadata() or ())
        return failed.code(), failed.details(), trailers
    return pb.InvokeFunctionResponse.FromString(response), dict(call.trailing_metadata())


def test_a_call_on_the_stream_is_answered_as_its_unary_call_is(server: Server) -> None:
    # The same handler and pipeline answer both: the response, or the status and its message,
    # and the trailers — the handler's and the hop's own — alike, call after call.
    streamed = server.invoke()
    unary = grpc.insecure_channel(server.address).unary_unary(callstream.INVOKE_PATH).with_call
    for invocation_id in ("", "bad", "boom", ""):
        on_stream = outcome(streamed.with_call, invocation_id)
        as_rpc = outcome(unary, invocation_id)
        assert on_stream == as_rpc
    assert server.handlers.unary == [False, True] * 4
    timed = outcome(streamed.with_call, "", metadata=((TIMELINE_KEY, "1"),))
    assert trailer_value(tuple(timed[1].items()), TIMELINE_SERVER_KEY)


def test_each_call_has_its_own_metadata_and_deadline(server: Server) -> None:
    invoke = server.invoke()
    first = outcome(invoke.with_call, "seen", metadata=((INPUT_REF_KEY, "in-1"),))
    second = invoke.with_call(request("seen"), timeout=None)
    assert dict(first[0].outputs) == {INPUT_REF_KEY: "in-1", "deadline": "True"}
    assert dict(pb.InvokeFunctionResponse.FromString(second[0]).outputs) == {"deadline": "False"}
    assert server.handlers.unary == [False, False]


def test_a_caller_that_goes_away_cancels_the_call_it_has_on_the_stream(server: Server) -> None:
    # As a unary call's: the call is cancelled (its handler told), the caller hears
    # InvocationCancelled, and the next call is made on a fresh channel and stream.
    calls = CancellableCalls(server.address, callstream.Invoke)
    failed: list[BaseException] = []

    def held() -> None:
        try:
            calls.call(lambda invoke: invoke.with_call(request("hold"), timeout=30))
        except InvocationCancelled as exc:
            failed.append(exc)

    thread = threading.Thread(target=held)
    thread.start()
    assert server.handlers.held.acquire(timeout=10)
    assert calls.cancel() == 1
    assert server.handlers.gone.wait(10)
    thread.join(10)
    assert len(failed) == 1
    response, _ = calls.call(lambda invoke: invoke.with_call(request("", b"[1]"), timeout=10))
    assert pb.InvokeFunctionResponse.FromString(response).output == b"[1]"
    assert server.handlers.unary == [False, False]
    calls.close()


def test_a_call_unanswered_at_its_deadline_fails_as_a_unary_call_would(server: Server) -> None:
    invoke = server.invoke()
    with pytest.raises(grpc.RpcError) as failed:
        invoke.with_call(request("hold"), timeout=0.5)
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    assert server.handlers.gone.wait(10)  # the stream went with it: its server was told
    server.handlers.release.set()
    response, _ = invoke.with_call(request("", b"[2]"), timeout=10)  # on a new stream
    assert pb.InvokeFunctionResponse.FromString(response).output == b"[2]"
    assert server.handlers.unary == [False, False]


def test_a_server_with_its_streams_full_is_called_unary(server: Server) -> None:
    # Each stream holds one of the server's threads while it is open: past MAX_CALL_STREAMS
    # the server refuses one before reading it, and that call is made as an RPC of its own.
    invokes = [server.invoke() for _ in range(limits.MAX_CALL_STREAMS + 1)]
    for number, invoke in enumerate(invokes):
        response, _ = invoke.with_call(request("", b"%d" % number), timeout=10)
        assert pb.InvokeFunctionResponse.FromString(response).output == b"%d" % number
    assert server.handlers.unary == [False] * limits.MAX_CALL_STREAMS + [True]
    invokes[0].close()  # a stream ended frees its place (once its server has seen it end)
    wait_until(
        lambda: server.invoke().with_call(request(), timeout=10) and not server.handlers.unary[-1]
    )


def test_on_a_loop_calls_past_the_streams_a_server_takes_are_unary_the_rest_streamed(
    server: Server,
) -> None:
    # docs/protocol.md, "Call streams": a caller on an event loop (runtimed's relay) calls from
    # many tasks on one channel; the server refuses the stream past its bound, whose call is
    # made unary, and so is each call past as many streams as it took — the others stay on
    # their streams, round after round.
    width = limits.MAX_CALL_STREAMS + 1

    async def rounds() -> list[list[bool]]:
        channel = grpc.aio.insecure_channel(server.address)
        invoke = callstream.AsyncInvoke(channel)
        loop = asyncio.get_running_loop()
        seen = []
        try:
            for _ in range(2):
                server.handlers.unary.clear()
                server.handlers.release.clear()
                calls = [
                    asyncio.ensure_future(invoke.with_call(request("hold"), 30, ()))
                    for _ in range(width)
                ]
                for _ in range(width):  # every call in flight at once
                    assert await loop.run_in_executor(None, server.handlers.held.acquire, True, 10)
                server.handlers.release.set()
                answers = await asyncio.gather(*calls)
                assert [pb.InvokeFunctionResponse.FromString(a).output for a, _ in answers] == [
                    b"{}"
                ] * width
                seen.append(sorted(server.handlers.unary))
        finally:
            invoke.close()
            await channel.close(None)
        return seen

    assert asyncio.run(rounds()) == [[False] * (width - 1) + [True]] * 2


def test_a_server_without_call_streams_is_called_unary(tmp_path: Path) -> None:
    hop = Server(tmp_path, pipeline=False)  # no pipeline: InvokeFunctions is not served
    try:
        invoke = hop.invoke()
        for _ in range(2):
            response, _ = invoke.with_call(request("", b"[3]"), timeout=10)
            assert pb.InvokeFunctionResponse.FromString(response).output == b"[3]"
        assert hop.handlers.unary == [True, True]
    finally:
        hop.close()


def test_a_server_whose_streams_socket_is_not_there_is_called_unary(
    server: Server, tmp_path: Path
) -> None:
    # docs/protocol.md, "Call streams": runtimed takes its streams on a socket of its own; a
    # caller that finds nothing there (it could not be bound) makes its calls as unary RPCs.
    channel = grpc.insecure_channel(server.address)
    invoke = callstream.Invoke(channel, f"unix:{tmp_path}/nothing-here.sock")
    try:
        for _ in range(2):
            assert outcome(invoke.with_call, "")[0].output == b"{}"
        assert server.handlers.unary == [True, True]
    finally:
        invoke.close()
        channel.close()


def test_call_streams_turned_off_make_every_call_an_rpc(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(callstream.STREAMS_ENV, "off")
    invoke = server.invoke()
    assert outcome(invoke.with_call, "")[0].output == b"{}"
    assert server.handlers.unary == [True]


def test_a_stopping_server_waits_for_calls_on_streams_not_for_idle_streams(
    server: Server,
) -> None:
    # A call on a stream is in flight as its RPC would be: the server's stop waits for it. An
    # open stream with no call in flight is not: the server stops without waiting out its
    # grace (60 s here), as it does for an idle connection.
    idle = server.invoke()
    idle.with_call(request(), timeout=10)
    busy = server.invoke()
    answered: list[bytes] = []
    thread = threading.Thread(
        target=lambda: answered.append(busy.with_call(request("hold"), timeout=30)[0])
    )
    thread.start()
    assert server.handlers.held.acquire(timeout=10)
    stopping = threading.Thread(target=lambda: server.pipeline.stop(server.server, 60))
    stopping.start()
    unary = grpc.insecure_channel(server.address).unary_unary(callstream.INVOKE_PATH)

    def refused() -> bool:  # the stop has begun: new RPCs are turned away
        try:
            unary(request(), timeout=10)
        except grpc.RpcError:
            return True
        return False

    wait_until(refused, timeout=10)
    server.handlers.release.set()
    thread.join(10)
    assert answered and pb.InvokeFunctionResponse.FromString(answered[0]).output == b"{}"
    wait_until(lambda: not stopping.is_alive(), timeout=20)


def test_a_caller_dropped_without_closing_frees_its_streams_place(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # grpc's thread that sends a stream's calls waits on the caller's next one; once the caller
    # is gone, unclosed, it ends the stream, so the server's thread and place are not held.
    monkeypatch.setattr(callstream, "_OWNER_CHECK_SECONDS", 0.05)
    dropped = [server.invoke() for _ in range(limits.MAX_CALL_STREAMS)]
    for invoke in dropped:
        invoke.with_call(request(), timeout=10)
    del invoke, dropped
    gc.collect()
    server.handlers.unary.clear()
    fresh = [server.invoke() for _ in range(limits.MAX_CALL_STREAMS)]

    def all_streamed() -> bool:
        server.handlers.unary.clear()
        for invoke in fresh:
            invoke.close()  # each call below on a stream of its own, opened then
            invoke.with_call(request(), timeout=10)
        return server.handlers.unary == [False] * limits.MAX_CALL_STREAMS

    wait_until(all_streamed, timeout=20)
