"""HTTP to the gateway (docs/protocol.md, "HTTP API"): connections kept alive over TCP or a Unix
socket, the bearer token, each request's wait, a failure status as its error class, NDJSON
streams, and cancelling what is in flight. Standard library only, as the whole client.
"""

from __future__ import annotations

import base64
import binascii
import collections
import contextlib
import http.client
import json
import os
import re
import select
import socket
import sys
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Self

from fnkernel.runtime_server import limits, tokens, wire
from fnkernel.runtime_server.client.errors import (
    FunctionUnavailable,
    GatewayError,
    GatewayUnreachable,
    InvalidRequest,
    RequestCancelled,
    from_response,
)
from fnkernel.runtime_server.client.files import CHUNK_BYTES, FileBody, Sink
from fnkernel.system.waiting import attempts

DEFAULT_ADDRESS = "http://127.0.0.1:8080"
_CONTINUE_WAIT_SECONDS = 1.0  # for a 100 (Continue) before a large body is sent anyway
_STALE_CONNECTION = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
# What an HTTP field value may not hold (RFC 9110, section 5.5): control characters but HTAB.
_NOT_IN_A_HEADER = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def check_address(address: str) -> None:
    """ValueError unless `address` is one a client can call: http://HOST:PORT,
    https://HOST[:PORT] or unix:PATH (a bare HOST:PORT is http), its port 1 to 65535."""
    if address.startswith("unix:") and len(address) > len("unix:"):
        return
    refused = (
        f"gateway address {address!r}: give http://HOST:PORT, https://HOST[:PORT] or unix:PATH"
    )
    scheme = address.split("://", 1)[0].lower() if "://" in address else "http"
    if scheme not in ("http", "https"):
        raise ValueError(refused)
    url = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
    try:
        port = url.port
    except ValueError:
        port = 0
    if port == 0 or not url.hostname or (port is None and "://" not in address):
        raise ValueError(f"{refused}, a port from 1 to 65535")


def default_address() -> str:
    return os.environ.get("FNKERNEL_RUNTIME") or DEFAULT_ADDRESS


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


class Unsent:
    """An invoke not sent yet (``Transport._preparing``): its payload converted or written, or
    the call waiting to be sent again; ``cancel`` stops it before anything is sent."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.waiting = True  # not in flight: a cancel of it cancels nothing sent
        self._cancelled = False
        self._woken: threading.Event | None = None  # made only to wait on: every call has one

    def cancel(self) -> int:
        """Cancelled (from another thread): 1 if nothing of it was in flight, else 0 (its
        request is cancelled as a request)."""
        self._cancelled = True
        if (woken := self._woken) is not None:  # made before `wait` looks at `_cancelled`
            woken.set()
        return int(self.waiting)

    def __call__(self) -> None:
        """Its request is about to be sent: RequestCancelled if it was cancelled."""
        if self._cancelled:
            raise self._stopped("before it was sent: its payload was still being converted")
        self.waiting = False

    def wait(self, seconds: float, why: str) -> None:
        """Wait `seconds` to send it again (it was refused before it ran, for `why`):
        RequestCancelled, with nothing sent, if it is cancelled meanwhile."""
        self.waiting = True
        woken = self._woken = self._woken or threading.Event()
        if self._cancelled:
            woken.set()
        if woken.wait(seconds):
            raise self._stopped(f"while it waited: {why}")

    def _stopped(self, when: str) -> RequestCancelled:
        unsent = RequestCancelled(f"the call of {self.name} was cancelled {when}", code="CANCELLED")
        unsent.unsent = True  # type: ignore[attr-defined]  # nothing ran
        return unsent


_LOOK_UP: Any = object()  # Transport's `announced` not given: read from the gateway file


class Transport:
    """HTTP to one gateway. Thread-safe: each request takes an idle kept-alive connection or
    opens one."""

    def __init__(
        self,
        address: str | None = None,
        *,
        token: str | None = None,
        timeout: float = 300,
        announced: Any = _LOOK_UP,
    ) -> None:
        self.address = address or default_address()
        # README, "Security": the token given, else $FNKERNEL_TOKEN, else the one the gateway
        # at this address left in its gateway file on this machine.
        # One found in the gateway file is looked for again when the gateway refuses it: a
        # stack started again on the same state dir has a new one (``_token_renewed``).
        self._token_found = token is None and not os.environ.get(tokens.TOKEN_ENV)
        given = "the token given" if token is not None else f"${tokens.TOKEN_ENV}"
        # What this machine's gateway at the address said of itself (its token, its spool):
        # trusted only of the server that gateway is (``_connect``: tokens.holds). Read from
        # its gateway file, unless `announced` is what a client at this address read there
        # already (a map's own client: its parent's).
        if announced is _LOOK_UP:
            announced = tokens.find_gateway(self.address)
        self._announced: dict[str, object] | None = announced
        if token is not None:
            token = token.strip()  # as a token file's (`open(path).read()`: its newline)
        else:
            token = (os.environ.get(tokens.TOKEN_ENV) or "").strip() or _found_token(
                self._announced
            )
        self.token = token
        self.timeout = timeout
        self._lock = threading.Lock()
        self._idle: list[http.client.HTTPConnection] = []  # kept alive, one per concurrent caller
        self._busy: dict[http.client.HTTPConnection, bool] = {}  # in use → cancelled
        self._spool: tuple[Path | None] | None = None  # Client.local_spool's answer, once asked
        # Calls without the gateway (Client._invoked, a map's batches): each function's routes
        # (its Run's, or its replicas'), this client's calls in flight on each Run, and
        # runtimed's channels.
        self._routes: dict[str, list[Any]] = {}
        self._calls_on: collections.Counter[str] = collections.Counter()
        self._turns: collections.Counter[str] = collections.Counter()  # round robin, by function
        self._maps: set[Any] = set()  # the maps running on this client (``Client.map``)
        # Invokes not sent yet: converting or writing their payload, or waiting for their Run
        # to be ready again (``_preparing``); ``cancel`` reaches each.
        self._preparing_calls: set[Unsent] = set()
        self._direct: Any = None
        # The client whose channels to runtimed this one's batches share (a map's own client:
        # its client's), if any.
        self.channels_from: Any = None
        self._max_payload = limits.DEFAULT_MAX_SPOOLED_BYTES  # the gateway's, once asked
        # What sets that bound, as a refusal names it: the flag and the variable, unless the
        # caller knows which (a kernel knows whether its runtime is its own).
        self.bound_why = limits.MAX_PAYLOAD_WHY
        # Last: a refused address or token leaves an object __del__ closes.
        check_address(self.address)
        if token and _NOT_IN_A_HEADER.search(token):  # named, never quoted: it is a secret
            raise ValueError(f"{given} holds a control character, which no token has")

    def _connect(self, timeout: float | None = 0) -> http.client.HTTPConnection:
        """A new connection; `timeout` for its reads (0: the client's, None: none)."""
        timeout = self.timeout if timeout == 0 else timeout
        if self.address.startswith("unix:"):
            return _UnixConnection(self.address[5:], timeout)  # type: ignore[arg-type]
        url = urllib.parse.urlsplit(
            self.address if "://" in self.address else f"http://{self.address}"
        )
        connection: http.client.HTTPConnection
        if url.scheme.lower() == "https":  # a gateway behind TLS (an ingress): never in clear
            import ssl

            connection = http.client.HTTPSConnection(
                url.hostname or "", url.port, timeout=timeout, context=ssl.create_default_context()
            )
        else:
            connection = http.client.HTTPConnection(
                url.hostname or "127.0.0.1", url.port, timeout=timeout
            )
        if self._announced is not None:  # its token and spool are that gateway's alone
            _only_to(connection, str(self._announced.get("address", "")))
        return connection

    def _headers(self, headers: Mapping[str, str] | None = None) -> dict[str, str]:
        """The request's headers; InvalidRequest, before anything is sent, for a value HTTP
        cannot carry (the gateway's server would answer 400 and close the connection, and the
        close can reach the client before the answer does)."""
        sent = {"Content-Type": "application/json", **(headers or {})}
        for name, value in sent.items():
            if _NOT_IN_A_HEADER.search(value):
                raise InvalidRequest(
                    f"{name} holds a control character, which an HTTP header cannot carry",
                    code="INVALID_ARGUMENT",
                    status=400,
                )
        if self.token:
            sent["Authorization"] = f"Bearer {self.token}"
        return sent

    def request(
        self,
        method: str,
        path: str,
        body: bytes | FileBody | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        wait: float = 0,
        into: Sink | None = None,
    ) -> tuple[int, http.client.HTTPMessage, bytes]:
        """Send one request; raise the class of a failure status (``errors.ERRORS``). `wait`:
        how long to wait for the answer, if longer than the client's timeout (an invocation's
        own: ``invoke``). `into`: where a successful answer's body is written as it comes, a
        chunk at a time, never held whole (its body is then b"")."""
        sent = self._headers(headers)
        wait = max(wait, self.timeout)
        for attempt in attempts(2):  # the second on a new connection, if the first was stale
            # A retry takes a new connection: the other kept-alive ones may be as stale.
            connection = self._kept_alive() if attempt.number == 1 else None
            reused = connection is not None
            if connection is None:
                connection = self._connect(timeout=wait)
                with self._lock:
                    self._busy[connection] = False
            elif connection.sock is not None:  # kept alive: set for this request's wait
                connection.sock.settimeout(wait)
            unsent = False  # a body the gateway refused before it was sent
            delivered = False  # the whole request went out: the gateway may act on it
            try:
                if isinstance(body, FileBody) or (
                    body is not None and len(body) > limits.MAX_PAYLOAD_BYTES
                ):
                    unsent = not _send_expecting(connection, method, path, body, sent, wait)
                else:
                    connection.request(method, path, body=body, headers=sent)
                delivered = not unsent
                if self._busy.get(connection):  # cancelled while it was still connecting
                    raise ConnectionAbortedError("cancelled")
                response = connection.getresponse()
                if into is not None and response.status < 300:
                    data = _streamed(response, into)
                else:
                    data = response.read()
            except _NotTaken as refused:  # the sink's own failure (a full disk), not the call's
                connection.close()
                with self._lock:
                    self._busy.pop(connection, None)
                raise refused.error from None
            except (ConnectionError, http.client.HTTPException, OSError) as exc:
                connection.close()
                with self._lock:
                    cancelled = self._busy.pop(connection, False)
                if cancelled:
                    raise RequestCancelled(
                        f"{method} {path} was cancelled", code="CANCELLED"
                    ) from None
                if delivered and _is_invoke(method, path):
                    # Never sent again: the call may have run, as the gateway says of a call
                    # a process under it dropped (docs/protocol.md, "Errors").
                    raise FunctionUnavailable(
                        f"the call was cut off: the gateway at {self.address} went away while "
                        f"it was in flight, so it may have run ({exc})",
                        code="UNAVAILABLE",
                        status=503,
                    ) from None
                if reused and isinstance(exc, _STALE_CONNECTION):
                    continue  # a kept-alive connection the gateway had closed: never acted on
                raise GatewayUnreachable(
                    f"cannot reach the gateway at {self.address}: {exc}"
                ) from None
            except BaseException:  # KeyboardInterrupt mid-request: the connection is unusable
                connection.close()
                with self._lock:
                    self._busy.pop(connection, None)
                raise
            closes = response.will_close or unsent  # the gateway still waits for that body
            with self._lock:
                self._busy.pop(connection, None)
                if not closes:
                    self._idle.append(connection)
            if closes:
                connection.close()
            break
        if response.status == 401 and self._token_renewed():  # refused before anything ran
            return self.request(method, path, body, headers, wait=wait)
        if response.status >= 400:
            failure = failure_of(response.status, data)
            failure.spans = spans_of(response.headers)
            failure.retry_after = response.headers.get("Retry-After", "")
            raise failure
        return response.status, response.headers, data

    def _token_renewed(self) -> bool:
        """Whether the gateway at this address now has another token in its gateway file (it
        was started again) than the one this client found there, now taken instead."""
        if not self._token_found:
            return False
        announced = tokens.find_gateway(self.address)
        token = _found_token(announced)
        if token is None or token == self.token:
            return False
        self.token, self._announced = token, announced
        return True

    @property
    def announced_spool(self) -> str | None:
        """The spool this machine's gateway at the address named in its gateway file, if one
        did: the one a client hands payloads over in (``Client.local_spool``)."""
        spool = (self._announced or {}).get("spool")
        return spool if isinstance(spool, str) and spool else None

    def _kept_alive(self) -> http.client.HTTPConnection | None:
        """An idle kept-alive connection the gateway has not closed, marked busy; None if
        there is none. An idle connection has nothing to read: one that does (the gateway's
        close, as EOF) is done, and a request sent on it could be cut off once sent."""
        while True:
            with self._lock:
                if not self._idle:
                    return None
                connection = self._idle.pop()
                self._busy[connection] = False
            sock = connection.sock
            try:
                dropped = sock is None or bool(select.select([sock], [], [], 0)[0])
            except (OSError, ValueError):
                dropped = True
            if not dropped:
                return connection
            connection.close()
            with self._lock:
                self._busy.pop(connection, None)

    def follow_logs(
        self, name: str, invocation_id: str = "", *, follow: bool = True
    ) -> Iterator[dict[str, Any]]:
        """The NDJSON records of an invocation's log (docs/protocol.md, "Live output"): its
        head (``invocationId``, ``run``, ``running``), each line (``stream``, ``text``), and
        ``{"end": true}`` once it is over; with `follow`, lines as they are written. An
        invocation_id "": the call in flight on `name`, else its last one."""
        path = f"/v1/runs/{quote(name)}"
        if invocation_id:
            path += f"/invocations/{quote(invocation_id)}"
        path += f"/logs?follow={int(follow)}"
        connection = self._connect(timeout=None)  # a quiet handler may print nothing for long
        yield from self._records(connection, path)

    def _records(
        self, connection: http.client.HTTPConnection, path: str
    ) -> Iterator[dict[str, Any]]:
        with self._lock:
            self._busy[connection] = False  # cancel() reaches it too
        try:
            connection.request("GET", path, headers=self._headers())
            response = connection.getresponse()
            if response.status >= 400:
                raise failure_of(response.status, response.read())
            while line := response.readline():
                yield json.loads(line)
        except (ConnectionError, http.client.HTTPException, OSError) as exc:
            with self._lock:
                cancelled = self._busy.get(connection, False)
            if cancelled:
                raise RequestCancelled(f"GET {path} was cancelled", code="CANCELLED") from None
            raise GatewayUnreachable(f"cannot reach the gateway at {self.address}: {exc}") from None
        finally:
            with self._lock:
                self._busy.pop(connection, None)
            connection.close()

    @contextlib.contextmanager
    def _preparing(self, name: str) -> Iterator[Unsent]:
        """An invoke of `name`, from its payload's conversion to its answer: ``cancel`` reaches
        it while it is not sent (converted, written, or waiting to be sent again); the
        ``Unsent`` given says, as its request is about to be sent, RequestCancelled if it was
        cancelled meanwhile (nothing was sent)."""
        call = Unsent(name)
        with self._lock:
            self._preparing_calls.add(call)
        try:
            yield call
        finally:
            with self._lock:
                self._preparing_calls.discard(call)

    def cancel(self) -> int:
        """From another thread: abort every request in flight. Each connection is shut down, so
        the gateway cancels its call (the handler is killed) and each caller gets
        ``RequestCancelled``; an invoke still converting its payload is never sent. Returns how
        many requests were cancelled."""
        with self._lock:
            busy = list(self._busy)
            for connection in busy:
                self._busy[connection] = True
            calls = list(self._preparing_calls)
        preparing = sum(call.cancel() for call in calls)
        for connection in busy:
            sock = connection.sock
            if sock is not None:
                with contextlib.suppress(OSError):  # already closed: the request is over
                    sock.shutdown(socket.SHUT_RDWR)
        direct = self._direct.cancel() if self._direct is not None else 0
        with self._lock:
            maps = list(self._maps)
        for running in maps:  # each stops: its calls in flight cancelled, the rest never sent
            running.cancel()
        return len(busy) + preparing + direct + len(maps)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Not when __init__ was refused its arguments; nor once the interpreter is ending (a
        # client never closed, dropped at exit): grpc's threads run no more by then, and closing
        # a direct call's channel waits on them forever — the process never exited. Its end
        # closes every socket.
        if hasattr(self, "_lock") and not sys.is_finalizing():
            self.close()

    def close(self) -> None:
        """Close the idle kept-alive connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()
        if self._direct is not None:
            self._direct.close()

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        payload = None if body is None else json.dumps(body).encode()
        status, _, data = self.request(method, path, payload)
        try:
            return json.loads(data) if data else None
        except ValueError:  # a page, say: what answered is no gateway (failure_of)
            raise GatewayError(
                f"{method} {path} was answered by something that is not an fnkernel gateway (a "
                f"proxy, or another server at {self.address}): HTTP {status}, not JSON: "
                f"{_page_text(data, 120)}",
                status=status,
            ) from None


def _send_expecting(
    connection: http.client.HTTPConnection,
    method: str,
    path: str,
    body: bytes | FileBody,
    headers: Mapping[str, str],
    wait: float,
) -> bool:
    """Send a large request's headers with ``Expect: 100-continue`` and its body only once the
    gateway says to go on (RFC 9110, section 10.1.1): a body it refuses at once (413, past its
    bound) is never sent, and its answer is read instead of a broken pipe. Without an answer
    within a second, the body is sent anyway, as the RFC lets a client. Whether it was sent."""
    connection.putrequest(method, path, skip_accept_encoding=True)
    for name, value in {
        **headers,
        "Content-Length": str(len(body)),
        "Expect": "100-continue",
    }.items():
        connection.putheader(name, value)
    connection.endheaders()
    sock = connection.sock
    assert sock is not None  # endheaders connected it
    ready, _, _ = select.select([sock], [], [], min(wait, _CONTINUE_WAIT_SECONDS))
    if ready and not sock.recv(12, socket.MSG_PEEK).startswith(b"HTTP/1.1 100"):
        return False  # a final answer: getresponse reads it; the connection goes with it
    # getresponse skips the 100 (Continue)
    for chunk in body.chunks() if isinstance(body, FileBody) else (body,):
        connection.send(chunk)
    return True


def _is_invoke(method: str, path: str) -> bool:
    """Whether a request runs a handler: the one request never sent twice."""
    return method == "POST" and path.split("?", 1)[0].endswith(":invoke")


def _found_token(announced: Mapping[str, object] | None) -> str | None:
    token = (announced or {}).get("token")
    return token if isinstance(token, str) and token else None


def _only_to(connection: http.client.HTTPConnection, announced: str) -> None:
    """Make `connection` refuse, before a byte is sent, a server that is not the gateway that
    announced `announced` (``tokens.holds``): another local user listening at the same port
    on another loopback address would be sent that gateway's token, and trusted as to its
    spool."""
    allowed = tokens.holds(announced)
    connect = connection.connect

    def checked() -> None:
        connect()
        assert connection.sock is not None  # connect() made it
        peer = str(connection.sock.getpeername()[0])
        if not allowed(peer):
            connection.close()
            raise ConnectionRefusedError(
                f"the server at {peer} is not the gateway this machine's gateway file names "
                f"({announced}): another process listens at that port; nothing was sent"
            )

    connection.connect = checked  # type: ignore[method-assign]


class _NotTaken(Exception):
    """A sink that would not take an answer's bytes (``request``'s `into`): its `error`."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _streamed(response: http.client.HTTPResponse, into: Sink) -> bytes:
    """`response`'s body written to `into` a chunk at a time; b"" (none of it held)."""
    while chunk := response.read(CHUNK_BYTES):
        try:
            into.write(chunk)
        except Exception as exc:
            raise _NotTaken(exc) from exc
    return b""


def quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


# An answer's headers: the gateway's, or those a call without it makes alike (client.direct).
Headers = http.client.HTTPMessage | Mapping[str, str]


def spans_of(headers: Headers) -> bytes:
    """A traced call's X-Fn-Spans, decoded from base64; b"" when there are none."""
    value = headers.get(wire.SPANS_HEADER)
    try:
        return base64.b64decode(value, validate=True) if value else b""
    except binascii.Error:
        return b""


def failure_of(status: int, data: bytes) -> GatewayError:
    """The error a failed answer names. One that is not the gateway's JSON (docs/protocol.md,
    "Errors") came from something else at that address — a proxy, another server — and is
    said so, its text in one line (an HTML page's without its tags)."""
    try:
        body = json.loads(data)
        if not isinstance(body, dict):
            raise ValueError("not an error body")
    except ValueError:
        body = {
            "message": f"HTTP {status} from something that is not an fnkernel gateway (a proxy, "
            f"or another server at that address): {_page_text(data, 200)}"
        }
    return from_response(body, status)


_TAG = re.compile(r"<[^>]*>")


def _page_text(data: bytes, most: int) -> str:
    """What an answer that is no gateway's says (an HTML page), as one line of at most `most`
    characters, without its tags."""
    text = " ".join(_TAG.sub(" ", data[: most * 16].decode("utf-8", "replace")).split())
    return text if len(text) <= most else text[: most - 1] + "…"
