"""README, "Security": what a web page, or another program on the same machine, can and cannot do
to the gateway. Every request here is a real HTTP request to a real `fnkernel gateway` process."""

from __future__ import annotations

import json
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from fnkernel.runtime_server import tokens
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import (
    GatewayUnreachable,
    HeadersTooLarge,
    MethodNotAllowed,
)
from fnkernel.runtime_server.daemon import Child, spawn
from fnkernel.runtime_server.lifecycle.gateway import Access
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.support import http_call, wait_until

# The attack of the issue: a module that runs code when it is imported, at registration.
PWNED = "open('pwned', 'w').write('x')\ndef handler(e):\n    return e\n"
ATTACK = json.dumps(
    {"name": "x", "runtime": "python", "handler": "h.handler", "files": {"h.py": PWNED}}
).encode()


def no_code_ran(stack: Stack) -> bool:
    return not list(stack.workspace_root.rglob("pwned")) and not any(
        run["name"] == "x" for run in Client(stack.gateway_address).list_runs()
    )


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Child]:
    """A bare `fnkernel gateway` on loopback TCP with its defaults (no pods: nothing to run),
    but for one-second body and header timeouts."""
    child = spawn(
        ["gateway", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
         "--body-timeout", "1", "--header-timeout", "1"]
    )  # fmt: skip
    yield child
    child.stop()


def raw(address: str, request: bytes, timeout: float = 10) -> bytes:
    """Send `request` bytes as they are; everything the gateway answers until it closes."""
    url = urllib.parse.urlsplit(address)
    with socket.create_connection((url.hostname, url.port), timeout=timeout) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain;charset=UTF-8",  # what fetch() and sendBeacon send cross-origin, no preflight
        "application/x-www-form-urlencoded",  # an HTML form
        "multipart/form-data; boundary=x",
        None,  # a Blob without a type: no Content-Type at all
    ],
)
def test_a_cross_origin_simple_post_cannot_create_a_run(
    shared_stack: Stack, content_type: str | None
) -> None:
    # None: an empty header, as http_call would otherwise send a body as JSON.
    headers = {"Origin": "https://evil.example", "Content-Type": content_type or ""}
    body = ATTACK
    if content_type and content_type.startswith("multipart/"):
        body = (
            b'--x\r\nContent-Disposition: form-data; name="a"\r\n\r\n' + ATTACK + b"\r\n--x--\r\n"
        )
    # What a page can send: no token. Refused for the Origin before anything else is read.
    status, _, reply = http_call(
        shared_stack.gateway_address, "POST", "/v1/runs", body, headers, authenticate=False
    )
    assert status == 403 and "Origin" in json.loads(reply)["message"]
    # Even with the token and no Origin, only JSON is taken.
    headers.pop("Origin")
    status, _, reply = http_call(shared_stack.gateway_address, "POST", "/v1/runs", body, headers)
    assert status == 415, reply
    assert json.loads(reply)["code"] == "UNSUPPORTED_MEDIA_TYPE"
    assert no_code_ran(shared_stack)


def test_a_json_post_from_a_disallowed_origin_is_403(shared_stack: Stack) -> None:
    status, _, _ = http_call(
        shared_stack.gateway_address,
        "POST",
        "/v1/runs",
        ATTACK,
        {"Origin": "http://localhost:8888"},  # even a local Jupyter page: none allowed by default
    )
    assert status == 403
    assert no_code_ran(shared_stack)


def test_a_foreign_host_header_is_403_dns_rebinding(shared_stack: Stack) -> None:
    port = urllib.parse.urlsplit(shared_stack.gateway_address).port
    for host in (f"evil.example:{port}", "evil.example", f"10.1.2.3:{port}"):
        status, _, body = http_call(
            shared_stack.gateway_address, "GET", "/v1/runs", headers={"Host": host}
        )
        assert status == 403, host
        assert "Host" in json.loads(body)["message"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]"):
        assert (
            http_call(shared_stack.gateway_address, "GET", "/v1/runs", headers={"Host": host})[0]
            == 200
        ), host


def test_allowed_origins_and_hosts_are_answered_with_cors(stack_factory) -> None:  # type: ignore[no-untyped-def]
    stack = stack_factory(
        {"python": 1}, allow_origins=["https://app.example"], allow_hosts=["fn.internal"]
    )
    origin = {"Origin": "https://app.example"}
    status, headers, _ = http_call(
        stack.gateway_address,
        "OPTIONS",
        "/v1/runs",
        headers={**origin, "Access-Control-Request-Method": "POST"},
        authenticate=False,  # a preflight carries no credentials
    )
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert headers["Access-Control-Allow-Methods"] == "GET, POST"  # the route's own
    # An allowed origin may use the whole API (README, "Security"): a secret's PUT too.
    status, headers, _ = http_call(
        stack.gateway_address,
        "OPTIONS",
        "/v1/secrets/db",
        headers={**origin, "Access-Control-Request-Method": "PUT"},
        authenticate=False,
    )
    assert status == 204 and headers["Access-Control-Allow-Methods"] == "DELETE, PUT"
    # README, "Security": what a page may send (a trace's context too) and read (every
    # header the HTTP API answers with: docs/protocol.md, "HTTP API").
    allowed = headers["Access-Control-Allow-Headers"].split(", ")
    assert {"Authorization", "Content-Type", "X-Invocation-Id", "X-Timeout-Ms", "X-Fn-Timeline",
            "X-Fn-Run-Uid", "traceparent"} <= set(allowed)  # fmt: skip
    status, headers, _ = http_call(stack.gateway_address, "GET", "/v1/runs", headers=origin)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://app.example"
    exposed = set(headers["Access-Control-Expose-Headers"].split(", "))
    assert {"X-Invocation-Id", "X-Fn-Outputs", "X-Fn-Attempt", "X-Fn-Logs", "X-Fn-Cold-Start",
            "X-Fn-Timeline", "X-Fn-Spans", "X-Fn-Run", "Retry-After"} <= exposed  # fmt: skip
    # A failure is the page's to read too: the origin is named in it, a refusal included.
    for method, path, authenticate, code in (
        ("GET", "/v1/runs/nosuch", True, 404),
        ("GET", "/v1/runs", False, 401),
        ("POST", "/v1/runs", True, 400),
    ):
        status, headers, _ = http_call(
            stack.gateway_address, method, path, b"{}" if method == "POST" else None,
            headers={**origin, "Content-Type": "application/json"}, authenticate=authenticate,
        )  # fmt: skip
        assert status == code, (path, status)
        assert headers.get("Access-Control-Allow-Origin") == "https://app.example", path
    status, _, _ = http_call(
        stack.gateway_address, "GET", "/v1/runs", headers={"Origin": "https://other.example"}
    )
    assert status == 403
    host = {"Host": "fn.internal"}
    assert http_call(stack.gateway_address, "GET", "/v1/runs", headers=host)[0] == 200


# Bad input is a 4xx naming the field, never a 500.


@pytest.mark.parametrize(
    ("files", "why"),
    [
        ({".": "x = 1"}, "relative path"),
        ({"a": "x = 1", "a/b.py": "y = 2"}, "both a file and a directory"),
        ({"x" * 300 + ".py": "x = 1"}, "too long"),
        ({"./h.py": "x = 1"}, "relative path"),
    ],
)
def test_bad_file_names_are_400_naming_files(
    shared_stack: Stack, files: dict[str, str], why: str
) -> None:
    body = {"name": "badfiles", "runtime": "python", "handler": "h.handler", "files": files}
    status, _, reply = http_call(
        shared_stack.gateway_address, "POST", "/v1/runs", json.dumps(body).encode()
    )
    assert status == 400, reply
    message = json.loads(reply)["message"]
    assert message.startswith("files:") and why in message


@pytest.mark.parametrize(
    ("method", "path", "says"),
    [
        ("DELETE", "/v1/runs/kept?foo=1", "foo: is not a parameter of DELETE /v1/runs/kept; "
         "it takes cancelInFlight, drainTimeoutMs"),
        ("DELETE", "/v1/runs/kept?cancelinflight=true", "cancelinflight: is not a parameter"),
        ("GET", "/v1/runs?all=1", "all: is not a parameter of GET /v1/runs"),
        ("GET", "/v1/runs/kept/logs?follw=1", "follw: is not a parameter of GET "
         "/v1/runs/kept/logs; it takes follow"),
        # Bytes that are not UTF-8 are named where they are, in tornado's words.
        ("DELETE", "/v1/runs/kept?drainTimeoutMs=%FF", "Bad Request: Invalid unicode in drainTimeoutMs"),
        ("GET", "/v1/runs/kept/invocations/%FF%FE/logs", "Bad Request: Invalid unicode in url"),
    ],
)  # fmt: skip
def test_a_query_parameter_a_route_does_not_take_is_400_naming_it(
    shared_stack: Stack, method: str, path: str, says: str
) -> None:
    # docs/protocol.md, "HTTP API": as a body's unknown field is refused, so is a query's — a
    # misspelt cancelInFlight would otherwise delete the Run, draining, as if it were not there.
    client = Client(shared_stack.gateway_address)
    if "kept" not in [run.name for run in client.list_runs()]:
        client.create_run("kept", runtime="python", handler="h.handler",
                          files={"h.py": "def handler(event):\n    return 1\n"})  # fmt: skip
    status, _, reply = http_call(shared_stack.gateway_address, method, path)
    assert status == 400, reply
    assert json.loads(reply)["message"].startswith(says), reply
    assert client.status("kept").name == "kept"  # nothing was deleted


def test_an_empty_create_names_the_first_field_a_run_needs(shared_stack: Stack) -> None:
    # docs/protocol.md, "HTTP API": POST /v1/runs {name, runtime, handler, files, ...}: an empty
    # body is refused naming what it lacks first, the Run's name.
    for body in (b"{}", b""):
        status, _, reply = http_call(shared_stack.gateway_address, "POST", "/v1/runs", body)
        assert status == 400, reply
        assert json.loads(reply)["message"].startswith("name: "), reply


def test_a_deeply_nested_body_is_400(shared_stack: Stack) -> None:
    body = b"[" * 100_000 + b"]" * 100_000
    status, _, reply = http_call(shared_stack.gateway_address, "POST", "/v1/runs", body)
    assert status == 400
    assert json.loads(reply)["message"].startswith("body:")


@pytest.mark.parametrize("value", ["9" * 30, "²", "1_000", "+1", "-1", "0x10", ""])
def test_x_timeout_ms_takes_ascii_digits_only(shared_stack: Stack, value: str) -> None:
    status, _, reply = http_call(
        shared_stack.gateway_address,
        "POST",
        "/v1/runs/anything:invoke",
        b"{}",
        {"X-Timeout-Ms": value},
    )
    assert status == 400, reply
    assert "X-Timeout-Ms" in json.loads(reply)["message"]


@pytest.mark.parametrize("value", ["%C2%B2", "9" * 30, str(10**13), "-5", "%205", "5%20", "5+"])
def test_drain_timeout_ms_takes_bounded_ascii_digits_only(shared_stack: Stack, value: str) -> None:
    status, _, reply = http_call(
        shared_stack.gateway_address, "DELETE", f"/v1/runs/anything?drainTimeoutMs={value}"
    )
    assert status == 400, reply
    assert "drainTimeoutMs" in json.loads(reply)["message"]


def test_a_100_kb_header_is_431(shared_stack: Stack) -> None:
    status, _, reply = http_call(
        shared_stack.gateway_address, "GET", "/v1/runs", headers={"X-Padding": "p" * 100_000}
    )
    assert status == 431
    assert json.loads(reply)["code"] == "REQUEST_HEADER_FIELDS_TOO_LARGE"
    # docs/protocol.md, "Errors": the client raises a class of its own for each status.
    client = Client(shared_stack.gateway_address, token=shared_stack.token)
    with pytest.raises(HeadersTooLarge, match="at most 65536"):
        client.request("GET", "/v1/runs", headers={"X-Padding": "p" * 100_000})
    with pytest.raises(MethodNotAllowed, match="PUT is not allowed on /v1/runs"):
        client.request("PUT", "/v1/runs", b"{}")


def test_a_body_shorter_than_its_content_length_does_not_hold_the_connection(
    gateway: Child,
) -> None:
    # The gateway runs with --body-timeout 1: the connection is closed, not held forever (the
    # socket's own timeout, 10 s, would raise instead).
    token = tokens.read_token_file(
        Path(gateway.argv[gateway.argv.index("--state-dir") + 1]) / "token"
    )
    request = (
        b"POST /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer %s\r\n"
        b'Content-Length: 100\r\n\r\n{"name":'
    ) % token.encode()
    url = urllib.parse.urlsplit(gateway.address)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(request)  # and then nothing: the write side stays open
        assert sock.recv(65536) == b""  # closed by the gateway


def test_every_connection_of_a_burst_of_1000_gets_an_answer(shared_stack: Stack) -> None:
    # A listen backlog of 128 reset connections under such a burst; now each one is answered.
    url = urllib.parse.urlsplit(shared_stack.gateway_address)
    if shutil.which("ss"):  # the backlog itself: ss shows it as a listening socket's Send-Q
        listing = subprocess.run(
            ["ss", "-Hltn", f"sport = :{url.port}"], capture_output=True, text=True, timeout=10
        ).stdout.split()
        assert int(listing[2]) >= 1024, listing
    request = (
        f"GET /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        f"Authorization: Bearer {shared_stack.token}\r\n\r\n"
    ).encode()
    sockets = []
    try:
        for _ in range(1000):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex((url.hostname, url.port))
            sockets.append(sock)
        answers: dict[int, bytes] = {}
        deadline = time.monotonic() + 60
        poller = select.poll()  # no FD_SETSIZE limit, unlike select()
        by_fd = {sock.fileno(): index for index, sock in enumerate(sockets)}
        for sock in sockets:
            poller.register(sock, select.POLLOUT)  # connected: send the request
        while len(answers) < len(sockets) and time.monotonic() < deadline:
            for fd, events in poller.poll(100):  # wait until some socket can make progress
                index = by_fd[fd]
                sock = sockets[index]
                try:
                    if events & select.POLLOUT:
                        sock.send(request)
                        poller.modify(sock, select.POLLIN)
                        continue
                    answers[index] = sock.recv(64)
                except OSError as exc:  # refused or reset: no HTTP answer
                    answers[index] = repr(exc).encode()
                poller.unregister(sock)
    finally:
        for sock in sockets:
            sock.close()
    statuses = [answer[:12] for answer in answers.values()]
    assert len(answers) == 1000
    assert all(status in (b"HTTP/1.1 200", b"HTTP/1.1 429") for status in statuses), {
        s for s in statuses if s not in (b"HTTP/1.1 200", b"HTTP/1.1 429")
    }
    wait_until(lambda: http_call(shared_stack.gateway_address, "GET", "/v1/runs")[0] == 200)


CREATE = ["runs", "create", "x", "--runtime", "python", "--source", ".", "--handler", "h.h"]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["invoke", "x", "--timeout-ms", "1_000"], "--timeout-ms"),
        (["invoke", "x", "--timeout-ms", "²"], "--timeout-ms"),
        ([*CREATE, "--idle-timeout", "-1"], "--idle-timeout"),
        (["up", "--poll-interval", "inf"], "--poll-interval"),
        (["up", "--poll-interval", "0"], "--poll-interval: must be more than 0 seconds"),
        (["wrapper-server", "--port", "99999", "--", "cat"], "--port: must be a port from 0 to"),
        ([*CREATE, "--replicas", "1e23"], "--replicas: must be a whole number in ASCII digits"),
        (["runtimed", "--pod", "p", "--runtime", "python", "--server", "nonsense"], "--server"),
        (["serve", "--runtime", "python", "--drain-timeout", "1e300"], "--drain-timeout"),
    ],
)
def test_cli_numbers_are_plain_ascii_and_bounded(args: list[str], flag: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert flag in done.stderr


@pytest.mark.parametrize(
    ("host", "listen_host", "allowed"),
    [
        ("127.0.0.1:8080", "127.0.0.1", True),
        ("[::1]:8080", "127.0.0.1", True),
        ("127.0.0.1:8080", "localhost", True),
        ("localhost", "10.0.0.5", True),
        ("10.0.0.5:8080", "10.0.0.5", True),
        ("10.0.0.6:8080", "10.0.0.5", False),
        ("127.0.0.1", "10.0.0.5", False),
        ("10.0.0.6", "0.0.0.0", True),
        ("evil.example", "0.0.0.0", False),
        ("fn.internal:80", "127.0.0.1", True),
        ("FN.INTERNAL", "127.0.0.1", True),
        ("", "127.0.0.1", False),
    ],
)
def test_the_host_header_names_the_listen_address_localhost_or_an_allowed_host(
    host: str, listen_host: str, allowed: bool
) -> None:
    access = Access(allowed_hosts=frozenset({"fn.internal"}))
    assert access.host_allowed(host, listen_host) is allowed


def test_headers_sent_a_byte_at_a_time_do_not_hold_connections(gateway: Child) -> None:
    # Slowloris: 20 connections, each sending one more byte of its headers every 0.3 s, are
    # each closed once --header-timeout (1 s here) has passed, though none ever stops sending.
    url = urllib.parse.urlsplit(gateway.address)
    sockets = [socket.create_connection((url.hostname, url.port), timeout=10) for _ in range(20)]
    started = time.monotonic()
    try:
        for sock in sockets:
            sock.sendall(b"GET /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        open_ones = list(sockets)
        while open_ones and time.monotonic() - started < 8:
            for sock in list(open_ones):
                try:
                    sock.sendall(b"X")
                except OSError:
                    open_ones.remove(sock)  # closed by the gateway
                    continue
                if select.select([sock], [], [], 0)[0] and sock.recv(1) == b"":
                    open_ones.remove(sock)
            select.select([], [], [], 0.3)
        assert not open_ones, f"{len(open_ones)} of 20 still open after 8 s"
    finally:
        for sock in sockets:
            sock.close()


@pytest.mark.parametrize(
    ("path", "length"),
    # past each route's bound: a create's 16 MiB, an invoke's --max-payload-bytes (2 GiB)
    [("/v1/runs", 50 << 20), ("/v1/runs/anything:invoke", 3 << 30)],
)
def test_a_body_past_its_routes_bound_is_413_before_it_is_read(
    shared_stack: Stack, path: str, length: int
) -> None:
    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {shared_stack.token}\r\nContent-Length: {length}\r\n\r\n"
    ).encode()  # and none of the body: the answer comes before it
    url = urllib.parse.urlsplit(shared_stack.gateway_address)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(request)  # the write side stays open, as a client still sending would
        answer = b""
        while b"}" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["code"] == "PAYLOAD_TOO_LARGE"


def test_a_non_ascii_number_is_quoted_as_it_was_sent(shared_stack: Stack) -> None:
    # "٣" (ARABIC-INDIC DIGIT THREE) in UTF-8: refused, and named as such, not as 'Ù£'.
    request = (
        "POST /v1/runs/anything:invoke HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/json\r\nConnection: close\r\n"
        f"Authorization: Bearer {shared_stack.token}\r\nX-Timeout-Ms: \u0663\r\n"
        "Content-Length: 2\r\n\r\n{}"
    ).encode()
    answer = raw(shared_stack.gateway_address, request)
    assert answer.startswith(b"HTTP/1.1 400 ")
    message = json.loads(answer.partition(b"\r\n\r\n")[2])["message"]
    assert message == "X-Timeout-Ms: must be an integer from 0 to 9223372036854775807, got '\u0663'"


def test_the_client_reconnects_when_the_gateway_closed_every_kept_alive_connection(
    gateway: Child,
) -> None:
    # The gateway closes a connection idle for --header-timeout (1 s here). A client holding two
    # such connections (one per concurrent caller) must not try the second stale one as well.
    client = Client(gateway.address)
    idle = [client._connect(), client._connect()]
    for connection in idle:
        connection.request("GET", "/v1/runs", headers={"Authorization": f"Bearer {client.token}"})
        assert connection.getresponse().read()
    for connection in idle:
        assert connection.sock is not None
        wait_until(lambda: select.select([connection.sock], [], [], 0)[0], timeout=10)  # noqa: B023
    client._idle[:] = idle
    assert client.list_runs() == []


def test_an_https_gateway_address_is_spoken_to_in_tls_never_in_clear() -> None:
    # README, "Security": the token goes in every request; to an https:// address (a gateway
    # behind a TLS ingress) it goes inside TLS — before, it went in clear to port 80. A
    # listener that is not TLS sees a handshake, never the request.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        client = Client(f"https://127.0.0.1:{port}", token="never-in-clear", timeout=5)
        heard: list[bytes] = []

        def hear() -> None:
            connection, _ = listener.accept()
            with connection:
                heard.append(connection.recv(4096))

        hearing = threading.Thread(target=hear, daemon=True)
        hearing.start()
        with pytest.raises(GatewayUnreachable):
            client.list_runs()
        hearing.join(10)
    assert heard and heard[0][:2] == b"\x16\x03"  # a TLS handshake record
    assert b"never-in-clear" not in heard[0] and b"Authorization" not in heard[0]
    assert Client("https://gw.example", token="t")._connect().port == 443
    refused = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "runs", "list", "--gateway",
         "ftp://gw.example"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (
        refused.returncode == 2 and "give http://HOST:PORT, https://HOST[:PORT]" in refused.stderr
    )
    assert "Traceback" not in refused.stderr and "Exception ignored" not in refused.stderr
