"""The client's kept-alive connections to a gateway (docs/protocol.md, "Errors"): a connection
the gateway closed while idle is not used again, and an invoke whose connection closed after it
was sent is never sent again — it may have run. Against a stand-in gateway (a test double: a
socket server that answers, or closes, as each test says), since a real one cannot be made to
close at those moments."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import FunctionUnavailable, NotSupported
from fnkernel.runtime_server.client.transport import failure_of

OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"runs":[]}'
ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Invocation-Id: inv_1\r\n"
    b"Content-Length: 1\r\n\r\n1"
)


class StandIn:
    """A gateway stand-in on 127.0.0.1: for each request read, `answer(n, request)` gives the
    bytes to send (None: close the connection without answering); `close_after`: it closes
    each connection once it answered (a gateway ending an idle kept-alive connection), and says
    so (``closed``)."""

    def __init__(self, answer: Callable[[int, bytes], bytes | None], close_after: bool) -> None:
        self.requests: list[bytes] = []
        self.closed = threading.Semaphore(0)  # released once for each connection it closed
        self._answer = answer
        self._close_after = close_after
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(connection,), daemon=True).start()

    def _one(self, connection: socket.socket) -> None:
        with connection:
            while request := _read_request(connection):
                self.requests.append(request)
                reply = self._answer(len(self.requests), request)
                if reply is None:
                    break  # closed without an answer
                connection.sendall(reply)
                if self._close_after:
                    # The gateway's side ends (EOF to the client); a request sent on it anyway
                    # is still read, and counted, but never answered.
                    connection.shutdown(socket.SHUT_WR)
                    self.closed.release()
                    if late := _read_request(connection):
                        self.requests.append(late)
                    return
        self.closed.release()

    def close(self) -> None:
        self._server.close()


def _read_request(connection: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        body += connection.recv(65536)
    return head


@pytest.fixture
def stand_in() -> Iterator[Callable[..., StandIn]]:
    made: list[StandIn] = []

    def make(answer: Callable[[int, bytes], bytes | None], close_after: bool = False) -> StandIn:
        made.append(StandIn(answer, close_after))
        return made[-1]

    yield make
    for one in made:
        one.close()


def test_an_invoke_cut_off_after_it_was_sent_is_never_sent_again(
    stand_in: Callable[..., StandIn],
) -> None:
    # The second request, an invoke, is read and its connection closed without an answer (the
    # gateway died under it): the handler may have run, so the client says so and does not
    # send it again — before, it was resent on a new connection, and ran twice.
    gateway = stand_in(lambda number, request: OK if number == 1 else None)
    client = Client(gateway.address, token="t")
    assert client.list_runs() == []  # leaves a kept-alive connection
    with pytest.raises(FunctionUnavailable, match=r"cut off: the gateway .* may have run"):
        client.invoke("f", {"n": 1}, by_reference=False)  # to the gateway, as from afar
    assert [request.split(b" ")[1] for request in gateway.requests] == [
        b"/v1/runs",
        b"/v1/runs/f:invoke",
    ]  # sent once


def test_a_connection_the_gateway_closed_while_idle_is_not_used_again(
    stand_in: Callable[..., StandIn],
) -> None:
    # Each connection is closed once answered, though HTTP/1.1 keeps it alive: the next call
    # takes a new one, and its one request is answered.
    gateway = stand_in(lambda number, request: OK if number == 1 else ANSWER, close_after=True)
    client = Client(gateway.address, token="t")
    assert client.list_runs() == []
    assert gateway.closed.acquire(timeout=10)  # the connection the client keeps is closed
    assert client.invoke("f", {"n": 1}, by_reference=False).decoded() == 1
    assert len(gateway.requests) == 2  # none on the connection the gateway ended


def test_an_answer_that_is_not_the_gateways_json_is_said_in_one_line() -> None:
    # docs/protocol.md, "Errors": every failure of the gateway's is a JSON body; what answers
    # with a page instead (a proxy's 502, another server's 501) is something else at that
    # address, said so in one line of its text, the class still the status's.
    page = (
        b"<!DOCTYPE HTML>\n<html lang='en'>\n  <head><title>Error response</title></head>\n"
        b"  <body>\n    <h1>Error response</h1>\n    <p>Error code: 501</p>\n"
        b"    <p>Message: Unsupported method ('POST').</p>\n  </body>\n</html>\n"
    )
    failure = failure_of(501, page)
    assert isinstance(failure, NotSupported)
    assert str(failure) == (
        "HTTP 501 from something that is not an fnkernel gateway (a proxy, or another server at "
        "that address): Error response Error response Error code: 501 Message: Unsupported "
        "method ('POST')."
    )
    ours = failure_of(404, b'{"code": "NOT_FOUND", "message": "no run named \'x\'"}')
    assert str(ours) == "no run named 'x' (NOT_FOUND)"
