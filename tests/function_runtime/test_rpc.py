"""rpc.CancellableCalls (docs/architecture.md, "The proxy hop"): blocking calls that the caller of
a servicer can still cancel, each on a pooled channel of its own, against a real grpcio server.
And rpc.listen_on, which binds every gRPC server of ours."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from fnkernel.adapters.errors import InvocationCancelled
from fnkernel.runtime_server import wire
from fnkernel.runtime_server.rpc import (
    CHANNEL_OPTIONS,
    CancellableCalls,
    failure_body,
    listen_on,
    status_body,
)

FAST, SLOW = "/bench.Up/Fast", "/bench.Up/Slow"


class Upstream:
    """A server whose Slow call waits until its caller cancels it (then notes that)."""

    def __init__(self, address: str) -> None:
        self.cancelled = threading.Event()
        self.started = threading.Event()
        self.arrived = threading.Semaphore(0)

        def slow(request: bytes, context: grpc.ServicerContext) -> bytes:
            context.add_callback(self.cancelled.set)
            self.started.set()
            self.arrived.release()
            self.cancelled.wait(30)
            return request

        handlers = {
            "Fast": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
            "Slow": grpc.unary_unary_rpc_method_handler(slow),
        }
        self.server = grpc.server(futures.ThreadPoolExecutor(4), options=CHANNEL_OPTIONS)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("bench.Up", handlers),)
        )
        self.server.add_insecure_port(address)
        self.server.start()


class Context:
    """What CancellableCalls asks of a servicer context: ``add_callback``, whose callbacks gRPC
    runs when the caller's RPC ends — here, when the test says so."""

    def __init__(self, ended: bool = False) -> None:
        self.callbacks: list[Callable[[], None]] = []
        self.ended = ended

    def add_callback(self, callback: Callable[[], None]) -> bool:
        if self.ended:
            return False
        self.callbacks.append(callback)
        return True

    def end(self) -> None:
        for callback in self.callbacks:
            callback()


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[tuple[Upstream, str]]:
    address = f"unix:{tmp_path}/up.sock"
    server = Upstream(address)
    yield server, address
    server.server.stop(0)


def counting(made: list[grpc.Channel]) -> Callable[[grpc.Channel], grpc.Channel]:
    def stub(channel: grpc.Channel) -> grpc.Channel:
        made.append(channel)
        return channel

    return stub


def call(method: str, payload: bytes) -> Callable[[grpc.Channel], bytes]:
    return lambda channel: channel.unary_unary(method)(payload, timeout=10)


def test_a_call_that_ended_leaves_its_channel_open_for_the_next(
    upstream: tuple[Upstream, str],
) -> None:
    # The caller's RPC ends after ours (gRPC runs its callbacks then): that must not close the
    # channel, which is back in the pool and serves the next call.
    made: list[grpc.Channel] = []
    calls = CancellableCalls(upstream[1], counting(made))
    for n in range(3):
        context = Context()
        assert calls.call(call(FAST, b"%d" % n), context) == b"%d" % n  # type: ignore[arg-type]
        context.end()
    assert len(made) == 1
    calls.close()


def test_a_caller_that_goes_away_cancels_the_call_and_its_channel_is_not_reused(
    upstream: tuple[Upstream, str],
) -> None:
    server, address = upstream
    made: list[grpc.Channel] = []
    calls = CancellableCalls(address, counting(made))
    context = Context()
    outcome: list[BaseException | bytes] = []

    def slow() -> None:
        try:
            outcome.append(calls.call(call(SLOW, b"slow"), context))  # type: ignore[arg-type]
        except grpc.RpcError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=slow)
    thread.start()
    assert server.started.wait(10)
    context.end()  # the caller went away
    assert server.cancelled.wait(5)  # the upstream call saw it
    thread.join(10)
    assert isinstance(outcome[0], grpc.RpcError)
    assert outcome[0].code() == grpc.StatusCode.CANCELLED
    assert calls.call(call(FAST, b"next"), Context()) == b"next"  # type: ignore[arg-type]
    assert len(made) == 2  # a fresh channel: the closed one never goes back
    calls.close()


def test_a_caller_gone_before_the_call_starts_makes_no_call(
    upstream: tuple[Upstream, str],
) -> None:
    # Its answer could reach no one: InvocationCancelled (CANCELLED), and the channel stays usable.
    made: list[grpc.Channel] = []
    calls = CancellableCalls(upstream[1], counting(made))
    with pytest.raises(InvocationCancelled):
        calls.call(call(SLOW, b"late"), Context(ended=True))  # type: ignore[arg-type]
    assert not upstream[0].started.is_set()
    assert calls.call(call(FAST, b"next"), Context()) == b"next"  # type: ignore[arg-type]
    assert len(made) == 1
    calls.close()


def test_the_pool_keeps_a_bounded_number_of_idle_channels(upstream: tuple[Upstream, str]) -> None:
    # Three calls at a time, each on a channel of its own; two go back to the pool, one closes.
    server, address = upstream
    made: list[grpc.Channel] = []
    calls = CancellableCalls(address, counting(made))
    calls._MAX_IDLE = 2  # type: ignore[misc]
    threads = [
        threading.Thread(target=calls.call, args=(call(SLOW, b"x"), Context())) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert server.arrived.acquire(timeout=10)  # all three in flight together
    server.cancelled.set()  # now they answer
    for thread in threads:
        thread.join(10)
    assert len(made) == 3 and len(calls._idle) == 2
    calls.close()
    assert calls._idle == []


def test_listen_on_answers_the_address_clients_dial(tmp_path: Path) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(1))
    try:
        unix = f"unix:{tmp_path}/ok.sock"
        assert listen_on(server, unix) == unix
        for host in ("127.0.0.1", "[::1]"):
            bound, _, port = listen_on(server, f"{host}:0").rpartition(":")
            assert bound == host and int(port) > 0
    finally:
        server.stop(0)


def test_listen_on_refuses_each_character_grpc_reads_in_a_unix_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/architecture.md, "Measured facts the design rests on": refused before binding, and
    # the message names the character — here the path's first, right after "unix:".
    monkeypatch.chdir(tmp_path)
    for char in ",?#%":
        server = grpc.server(futures.ThreadPoolExecutor(1))
        try:
            with pytest.raises(RuntimeError, match=f"holds {re.escape(char)}: {re.escape(char)}x"):
                listen_on(server, f"unix:{char}x.sock")
        finally:
            server.stop(0)
    assert list(tmp_path.iterdir()) == []
    assert wire.unix_target_problem("/srv/a,b%c/x.sock") == (
        "gRPC cannot name a Unix socket whose path holds , %: /srv/a,b%c/x.sock"
    )
    # What gRPC reads as a plain path character is taken (each connects, measured).
    assert wire.unix_target_problem(f"{tmp_path}/a b;c:d\\X.sock") is None


# rpc.failure_body: a failed call's status as the JSON error body of docs/protocol.md, "Errors".


def failing(
    address: str, code: grpc.StatusCode, message: str, trailers: tuple[tuple[str, object], ...]
) -> grpc.RpcError:
    """The error a call to a server that aborts with `code`, `message` and `trailers` raises."""

    def fail(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.set_trailing_metadata(trailers)
        context.abort(code, message)

    server = grpc.server(futures.ThreadPoolExecutor(1), options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "bench.Up", {"Fail": grpc.unary_unary_rpc_method_handler(fail)}
            ),
        )
    )
    server.add_insecure_port(address)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/bench.Up/Fail")(b"", timeout=10)
        return caught.value
    finally:
        server.stop(0)


def test_a_handler_error_keeps_its_type_message_and_logs(tmp_path: Path) -> None:
    logs = b'[{"stream":"stderr","text":"about to fail"}]'
    err = failing(
        f"unix:{tmp_path}/f.sock",
        grpc.StatusCode.UNKNOWN,
        "handler error: ValueError: bad order 7",
        ((wire.ERROR_TYPE_KEY, "ValueError"), (wire.LOGS_KEY, logs)),
    )
    assert failure_body(err) == {
        "code": "UNKNOWN",
        "message": "handler error: ValueError: bad order 7",
        "errorType": "ValueError",
        "errorMessage": "bad order 7",
        "logs": [{"stream": "stderr", "text": "about to fail"}],
    }


@pytest.mark.parametrize("logs", [None, b"", b"not json"])
def test_a_handler_error_without_readable_logs_has_none(tmp_path: Path, logs: bytes | None) -> None:
    trailers: tuple[tuple[str, object], ...] = ((wire.ERROR_TYPE_KEY, "WorkerCrashed"),)
    if logs is not None:
        trailers += ((wire.LOGS_KEY, logs),)
    err = failing(f"unix:{tmp_path}/f.sock", grpc.StatusCode.UNKNOWN, "x", trailers)
    body = failure_body(err)
    assert body["logs"] == [] and body["errorType"] == "WorkerCrashed"
    assert body["errorMessage"] == "x"


def test_any_other_status_is_its_code_and_message_only(tmp_path: Path) -> None:
    err = failing(
        f"unix:{tmp_path}/f.sock",
        grpc.StatusCode.NOT_FOUND,
        "run r1 is not registered",
        ((wire.ERROR_TYPE_KEY, "ignored"),),
    )
    assert failure_body(err) == {"code": "NOT_FOUND", "message": "run r1 is not registered"}


def test_what_a_status_does_not_say_is_empty_not_made_up(tmp_path: Path) -> None:
    # No message, and a handler error without its type trailer: empty strings, as the
    # documented body has every field.
    err = failing(f"unix:{tmp_path}/f.sock", grpc.StatusCode.UNKNOWN, "", ())
    assert failure_body(err) == {
        "code": "UNKNOWN",
        "message": "",
        "errorType": "",
        "errorMessage": "",
        "logs": [],
    }


def test_a_call_past_its_deadline_keeps_what_the_handler_wrote_until_then(tmp_path: Path) -> None:
    # docs/protocol.md, "Errors": a call past its deadline (DEADLINE_EXCEEDED) carries what the
    # handler wrote until then; one that wrote nothing has no logs at all.
    logs = b'[{"stream":"stdout","text":"step 1 of 3"}]'
    err = failing(
        f"unix:{tmp_path}/f.sock",
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "past 1000 ms",
        ((wire.LOGS_KEY, logs),),
    )
    assert failure_body(err) == {
        "code": "DEADLINE_EXCEEDED",
        "message": "past 1000 ms",
        "logs": [{"stream": "stdout", "text": "step 1 of 3"}],
    }
    silent = failing(f"unix:{tmp_path}/g.sock", grpc.StatusCode.DEADLINE_EXCEEDED, "past", ())
    assert failure_body(silent) == {"code": "DEADLINE_EXCEEDED", "message": "past"}


@pytest.mark.parametrize(
    "words",
    ["Socket closed", "Cancelling all calls"],  # a server gone; one stopping with calls in flight
)
def test_a_call_cut_off_says_what_it_means_for_the_call(words: str) -> None:
    # docs/protocol.md, "Errors": a call cut off may have run — said so, with gRPC's words
    # after. A call in flight when `fnkernel down` outlasts its drain ended in the stopping
    # server's words alone ("Cancelling all calls").
    body = status_body(grpc.StatusCode.UNAVAILABLE, words, {})
    assert body["message"] == (
        "the call was cut off: a process on its path went away while it was in flight, so it "
        f"may have run ({words})"
    )
