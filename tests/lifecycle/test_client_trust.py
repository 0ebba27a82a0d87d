"""What a client trusts of a gateway on its own machine (README, "Security": "Clients find it
themselves", "The client trusts a spool the gateway file names"): the token and the spool a
gateway file names go to the server that gateway is, and to no other process listening at the
same port on another loopback address, or at the address while the stack is not there."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import GatewayError, GatewayUnreachable
from fnkernel.runtime_server.client.local import result_in
from fnkernel.runtime_server.lifecycle.stack import Stack

RESULT_NAME = "out-" + "A" * 22  # named as a spooled result is


class _Listener:
    """A process of another user at the gateway's port on another loopback address: it takes
    connections and records every byte it is sent."""

    def __init__(self, host: str, port: int) -> None:
        self.received = b""
        self._socket = socket.create_server((host, port))
        self._socket.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._socket.accept()
            except TimeoutError:
                continue
            with connection:
                connection.settimeout(1)
                try:
                    while chunk := connection.recv(65536):
                        self.received += chunk
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()


def test_a_gateways_token_goes_to_no_other_server_at_its_port(
    stack_factory: Callable[..., Stack],
) -> None:
    # The gateway is on 127.0.0.1:P; 127.0.0.2:P (or [::1]:P) is free for any local user to
    # take. A client given that address finds the gateway's file (a loopback name at its port)
    # — and refuses the server there before sending anything, the token least of all.
    stack = stack_factory({"python": 1})
    port = urllib.parse.urlsplit(stack.gateway_address).port
    assert port is not None
    other = _Listener("127.0.0.2", port)
    try:
        client = Client(f"http://127.0.0.2:{port}", timeout=5)
        assert client.token  # found: the same port, a loopback name
        with pytest.raises(GatewayUnreachable, match="is not the gateway this machine's gateway"):
            client.list_runs()
        assert other.received == b""
    finally:
        other.close()
    assert Client(stack.gateway_address).list_runs() is not None  # the gateway itself: served


class _NotTheGateway(http.server.BaseHTTPRequestHandler):
    """Whatever listens at the address while the stack does not: it names a directory of the
    user's as its spool, a file there as a call's result, and a socket as runtimed."""

    victim: Path

    def _json(self, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/payloads":
            self._json({"spool": str(self.victim), "maxBytes": 1 << 31,
                        "messageBytes": 6 << 20, "spoolFromBytes": 1 << 17})  # fmt: skip
        else:  # a route to a socket of its own
            self._json({"route": {"runUid": "u", "pod": "p", "runtimed": "unix:/tmp/x.sock"}})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._json(None, {"X-Fn-Output-Ref": f"{RESULT_NAME} 6", "X-Fn-Spool": str(self.victim)})

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def not_the_gateway(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    victim = tmp_path / "private"
    victim.mkdir(mode=0o700)
    (victim / RESULT_NAME).write_text('"kept"')
    handler = type("Handler", (_NotTheGateway,), {"victim": victim})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", victim
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_that_is_no_announced_gateway_gets_no_file_of_the_users(
    not_the_gateway: tuple[str, Path],
) -> None:
    # Another user's server at the address the client uses while the stack is not there (the
    # CLI's default port): it names a 0700 directory of the user's as its spool and a file in
    # it as the result. The client reads nothing there and frees nothing: only a spool a
    # gateway file names (or a Unix socket's of this user's) is trusted.
    address, victim = not_the_gateway
    client = Client(address, token="t")
    assert client.local_spool() is None
    with pytest.raises(GatewayError, match="which this client did not ask for and does not take"):
        client.invoke("x", {"a": 1})  # a result by reference it never asked for: not read
    assert (victim / RESULT_NAME).read_text() == '"kept"'
    assert sorted(path.name for path in victim.iterdir()) == [RESULT_NAME]
    assert client._route("x") == []  # never a direct call to a socket it names


def test_the_cli_on_a_server_that_is_no_gateway_takes_nothing(
    not_the_gateway: tuple[str, Path], tmp_path: Path
) -> None:
    address, victim = not_the_gateway
    out = tmp_path / "out.bin"
    done = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "invoke", "x", '{"name": "x"}',
         "--gateway", address, "--output", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and "did not ask for" in done.stderr, done.stderr
    assert "kept" not in done.stdout and "kept" not in (out.read_text() if out.exists() else "")
    assert sorted(path.name for path in victim.iterdir()) == [RESULT_NAME]


def test_a_result_the_answer_names_is_read_only_by_a_results_name(
    stack_factory: Callable[..., Stack], tmp_path: Path
) -> None:
    # Even the stack's own spool yields only a result: a name that is not one is refused, not
    # read nor freed.
    stack = stack_factory({"python": 1})
    client = Client(stack.gateway_address)
    spool = client.local_spool()
    assert spool is not None  # the gateway file names it
    for ref in ("../../etc/passwd 3", "in-" + "B" * 22 + " 3", "free-1 3"):
        with pytest.raises(GatewayError, match="names no result of the spool"):
            result_in(spool, ref)
