"""The client library of the gateway (docs/protocol.md, "Runs"): used by the CLI, the kernel and the tests.

Standard library only (``http.client``), so importing it costs nothing — the kernel imports it at
start and must not pay for grpc. Addresses are ``http://host:port`` or ``unix:/path``.
"""

from __future__ import annotations

import base64
import binascii
import collections
import contextlib
import functools
import http.client
import json
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from fnkernel.runtime_server import jsoncodec, limits, tokens, wire
from fnkernel.runtime_server.client.errors import (
    FunctionBusy,
    GatewayError,
    GatewayUnreachable,
    HandlerFailed,
    InvalidRequest,
    InvocationTimedOut,
    RequestCancelled,
    from_response,
)
from fnkernel.runtime_server.client.views import InvocationResult, Run

DEFAULT_ADDRESS = "http://127.0.0.1:8080"
# Live output (docs/protocol.md, "Live output"): a call with an on_log that has not answered by
# then is followed; how long its answer waits for the stream's last lines.
FOLLOW_AFTER_SECONDS = 0.05
_FOLLOW_END_SECONDS = 2.0
_MAP_PROGRESS_SECONDS = 0.05  # how often a map reports progress (and at its end)
# A map's item refused as busy (another caller holds every replica) is sent again after a wait
# that starts here and doubles up to the cap, until the item's own timeout has passed.
_BUSY_FIRST_WAIT_SECONDS = 0.002
_BUSY_WAIT_CAP_SECONDS = 0.05
LogCallback = Callable[[dict[str, Any]], None]
_STALE_CONNECTION = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
_SKIPPED = frozenset({"__pycache__", ".git", ".ipynb_checkpoints"})
# What an HTTP field value may not hold (RFC 9110, section 5.5): control characters but HTAB.
_NOT_IN_A_HEADER = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def parse_pairs(pairs: Iterable[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict; ValueError names the first that is not one. (Env of a
    Run, a function's ConfigMap data: the CLI and the magics parse both with it.)"""
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{pair!r} is not KEY=VALUE")
        parsed[key] = value
    return parsed


def default_address() -> str:
    return os.environ.get("FNKERNEL_RUNTIME") or DEFAULT_ADDRESS


def read_source(path: Path) -> dict[str, str]:
    """A file, or every file under a directory, as {relative path: text} for POST /v1/runs."""
    if path.is_file():
        files = {path.name: path}
    elif path.is_dir():
        files = {}
        for directory, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in _SKIPPED)
            for name in sorted(names):
                file = Path(directory, name)
                files[file.relative_to(path).as_posix()] = file
    else:
        raise FileNotFoundError(f"source {path} does not exist")
    try:
        return {name: file.read_text(encoding="utf-8") for name, file in files.items()}
    except UnicodeDecodeError as exc:
        raise ValueError(f"source {path}: every file must be UTF-8 text ({exc.reason})") from None


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


class Client:
    """One gateway. Thread-safe: each request takes an idle kept-alive connection or opens one."""

    def __init__(
        self, address: str | None = None, *, token: str | None = None, timeout: float = 300
    ) -> None:
        self.address = address or default_address()
        # README, "Security": the token given, else $FNKERNEL_TOKEN, else the one the gateway
        # at this address left in its gateway file on this machine.
        if token is None:
            token = os.environ.get(tokens.TOKEN_ENV) or tokens.find_token(self.address)
        self.token = token
        self.timeout = timeout
        self._lock = threading.Lock()
        self._idle: list[http.client.HTTPConnection] = []  # kept alive, one per concurrent caller
        self._busy: dict[http.client.HTTPConnection, bool] = {}  # in use → cancelled

    def _connect(self, timeout: float | None = 0) -> http.client.HTTPConnection:
        """A new connection; `timeout` for its reads (0: the client's, None: none)."""
        timeout = self.timeout if timeout == 0 else timeout
        if self.address.startswith("unix:"):
            return _UnixConnection(self.address[5:], timeout)  # type: ignore[arg-type]
        url = urllib.parse.urlsplit(
            self.address if "://" in self.address else f"http://{self.address}"
        )
        return http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout)

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
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        wait: float = 0,
    ) -> tuple[int, http.client.HTTPMessage, bytes]:
        """Send one request; raise the class of a failure status (``errors.ERRORS``). `wait`:
        how long to wait for the answer, if longer than the client's timeout (an invocation's
        own: ``invoke``)."""
        sent = self._headers(headers)
        wait = max(wait, self.timeout)
        for attempt in range(2):
            with self._lock:
                # A retry takes a new connection: the other kept-alive ones may be as stale.
                connection = self._idle.pop() if self._idle and not attempt else None
                if connection is not None:
                    self._busy[connection] = False
            reused = connection is not None
            if connection is None:
                connection = self._connect(timeout=wait)
                with self._lock:
                    self._busy[connection] = False
            elif connection.sock is not None:  # kept alive: set for this request's wait
                connection.sock.settimeout(wait)
            try:
                connection.request(method, path, body=body, headers=sent)
                if self._busy.get(connection):  # cancelled while it was still connecting
                    raise ConnectionAbortedError("cancelled")
                response = connection.getresponse()
                data = response.read()
            except (ConnectionError, http.client.HTTPException, OSError) as exc:
                connection.close()
                with self._lock:
                    cancelled = self._busy.pop(connection, False)
                if cancelled:
                    raise RequestCancelled(
                        f"{method} {path} was cancelled", code="CANCELLED"
                    ) from None
                if reused and isinstance(exc, _STALE_CONNECTION):
                    continue  # a kept-alive connection the gateway had closed: never ran
                raise GatewayUnreachable(
                    f"cannot reach the gateway at {self.address}: {exc}"
                ) from None
            except BaseException:  # KeyboardInterrupt mid-request: the connection is unusable
                connection.close()
                with self._lock:
                    self._busy.pop(connection, None)
                raise
            with self._lock:
                self._busy.pop(connection, None)
                if not response.will_close:
                    self._idle.append(connection)
            if response.will_close:
                connection.close()
            break
        if response.status >= 400:
            failure = _failure(response.status, data)
            failure.spans = spans_of(response.headers)
            raise failure
        return response.status, response.headers, data

    def follow_logs(
        self, name: str, invocation_id: str = "", *, follow: bool = True
    ) -> Iterator[dict[str, Any]]:
        """The NDJSON records of an invocation's log (docs/protocol.md, "Live output"): its
        head (``invocationId``, ``run``, ``running``), each line (``stream``, ``text``), and
        ``{"end": true}`` once it is over; with `follow`, lines as they are written. An
        invocation_id "": the call in flight on `name`, else its last one."""
        path = f"/v1/runs/{_quote(name)}"
        if invocation_id:
            path += f"/invocations/{_quote(invocation_id)}"
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
                raise _failure(response.status, response.read())
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

    def cancel(self) -> int:
        """From another thread: abort every request in flight. Each connection is shut down, so
        the gateway cancels its call (the handler is killed) and each caller gets
        ``RequestCancelled``. Returns how many requests were cancelled."""
        with self._lock:
            busy = list(self._busy)
            for connection in busy:
                self._busy[connection] = True
        for connection in busy:
            sock = connection.sock
            if sock is not None:
                with contextlib.suppress(OSError):  # already closed: the request is over
                    sock.shutdown(socket.SHUT_RDWR)
        return len(busy)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Close the idle kept-alive connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        payload = None if body is None else json.dumps(body).encode()
        _, _, data = self.request(method, path, payload)
        return json.loads(data) if data else None

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
    ) -> Run:
        """Create a Run from `files` or from the file or directory `source`; the Run as it
        stands once Ready or Failed. `origin` (default: the `source` path) is recorded as the
        Run's ``spec.source``. `replicas` > 1: that many Runs serve the function, and the
        answer lists them (docs/protocol.md, "Replicas")."""
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
        return Run(self._json("POST", "/v1/runs", body))

    def files(self, name: str) -> dict[str, Any]:
        """The source the Run `name` was created with: ``{name, runtime, handler, files}``."""
        answer: dict[str, Any] = self._json("GET", f"/v1/runs/{_quote(name)}/files")
        return answer

    def list_runs(self) -> list[Run]:
        return [Run(run) for run in self._json("GET", "/v1/runs")["runs"]]

    def status(self, name: str) -> Run:
        """The Run and, as ``live``, its registration's FunctionStatus (None when it has none)."""
        return Run(self._json("GET", f"/v1/runs/{_quote(name)}"))

    def delete_run(
        self, name: str, *, cancel_in_flight: bool = False, drain_timeout_millis: int = 0
    ) -> None:
        """Unregister and delete: drain the in-flight invocation (at most `drain_timeout_millis`,
        0 for the gateway's default), or cancel it."""
        query = urllib.parse.urlencode(
            {
                "cancelInFlight": "true" if cancel_in_flight else "false",
                "drainTimeoutMs": str(drain_timeout_millis),
            }
        )
        wait = limits.delete_wait_seconds(drain_timeout_millis, hops_below=2)
        self.request("DELETE", f"/v1/runs/{_quote(name)}?{query}", wait=wait)

    # Invocation

    def invoke(
        self,
        name: str,
        payload: Any = None,
        *,
        data: bytes | None = None,
        timeout_millis: int = 0,
        invocation_id: str = "",
        on_log: LogCallback | None = None,
        traceparent: str = "",
    ) -> InvocationResult:
        """Invoke with `payload` encoded as JSON (``jsoncodec.dumps``), or the raw JSON bytes `data`.

        `traceparent` (W3C) traces the call: every hop's spans come back as the result's (or
        the failure's) ``spans``, OTLP encoded (docs/protocol.md, "Tracing").

        `on_log(line)` is given each line the call logs (``{"stream", "text"}``), in order:
        as it is written once the call has run for FOLLOW_AFTER_SECONDS (from another
        thread), else — a quicker call, or when no live stream could be had — from its result
        or failure before this returns or raises (docs/protocol.md, "Live output")."""
        body = data if data is not None else jsoncodec.dumps(payload)
        headers = {}
        if timeout_millis:
            headers[wire.TIMEOUT_HEADER] = str(timeout_millis)
        live = None
        if on_log is not None:
            invocation_id = invocation_id or limits.new_id("inv_")
            live = _LiveFollow(self, name, invocation_id, on_log)
        if invocation_id:
            headers[wire.INVOCATION_ID_HEADER] = invocation_id
        if traceparent:
            headers[wire.TRACEPARENT_HEADER] = traceparent
        started = time.perf_counter()
        try:
            _, reply, output = self.request(
                "POST", f"/v1/runs/{_quote(name)}:invoke", body, headers,
                wait=limits.wait_seconds(timeout_millis, hops_below=2),  # the gateway, runtimed
            )  # fmt: skip
        except HandlerFailed as failed:
            if live is not None:
                live.end(failed.logs)
            raise
        except InvocationTimedOut as timed_out:
            if live is not None:
                logs = timed_out.detail.get("logs")
                live.end(logs if isinstance(logs, list) else [])
            raise
        except BaseException:
            if live is not None:
                live.end([], wait=False)  # it never ran, or was cancelled: nothing more comes
            raise
        logs = _json_header(reply, wire.LOGS_HEADER, [])
        if live is not None:
            live.end(logs)
        return InvocationResult(
            output=output,
            content_type=reply.get("Content-Type", ""),
            outputs=_json_header(reply, wire.OUTPUTS_HEADER, {}),
            invocation_id=reply.get(wire.INVOCATION_ID_HEADER, ""),
            duration=time.perf_counter() - started,
            attempt=int(reply.get(wire.ATTEMPT_HEADER) or 0),
            cold_start=reply.get(wire.COLD_START_HEADER) == "1",
            logs=logs,
            run=reply.get(wire.RUN_HEADER, ""),
            spans=spans_of(reply) if traceparent else b"",
        )

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
        end;
        `on_log(index, line)` is each call's ``invoke(on_log=)``. An interrupt
        (KeyboardInterrupt) cancels every call in flight and is raised; the function stays
        registered."""
        work = list(items)
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        replicas = int(self.status(name).get("spec", {}).get("replicas", 1))
        concurrency = min(concurrency or replicas, replicas)
        results: list[Any] = [None] * len(work)
        if not work:
            return results
        # A client of its own: cancelling it cancels this map's calls and nobody else's.
        calls = Client(self.address, token=self.token, timeout=self.timeout)
        run = _MapRun(calls, name, work, return_exceptions, timeout_millis, on_log)
        threads = [
            threading.Thread(target=run.work, name="map", daemon=True)
            for _ in range(min(concurrency, len(work)))
        ]
        try:
            for thread in threads:
                thread.start()
            shown = -1
            while not run.over.wait(_MAP_PROGRESS_SECONDS) or shown != run.done:
                if progress is not None and (shown != run.done or not run.over.is_set()):
                    shown = run.done
                    progress(shown, len(work))  # also unchanged: the map is alive
                elif run.over.is_set():
                    break
            for thread in threads:
                thread.join()
        except BaseException:
            run.stop()
            for thread in threads:
                thread.join(_FOLLOW_END_SECONDS)
            raise
        finally:
            calls.close()
        failure = run.failure
        if failure is not None:
            raise failure
        return run.results


class _MapRun:
    """One ``Client.map``: its threads each take the next item until none is left or the map
    stops (a failure, an interrupt). The calling thread only looks at how far it is, every
    _MAP_PROGRESS_SECONDS: not once a call, which cost a fifth of a no-op map's rate."""

    def __init__(
        self,
        calls: Client,
        name: str,
        work: list[Any],
        return_exceptions: bool,
        timeout_millis: int,
        on_log: Callable[[int, dict[str, Any]], None] | None,
    ) -> None:
        self._calls = calls
        self._name = name
        self._work = work
        self._return_exceptions = return_exceptions
        self._timeout_millis = timeout_millis
        self._on_log = on_log
        self._lock = threading.Lock()
        self._next = 0
        self._working = 0
        self.results: list[Any] = [None] * len(work)
        self.done = 0
        self.failure: BaseException | None = None
        self.stopped = False  # after a failure or an interrupt: nothing more is sent
        self._stopping = threading.Event()  # wakes the items waiting for a free replica
        self.over = threading.Event()  # every thread is out

    def stop(self) -> None:
        self.stopped = True
        self._stopping.set()
        self._calls.cancel()

    def _invoke(self, index: int) -> Any:
        """Item `index`'s output; while every replica is busy with another caller's calls
        (FunctionBusy: nothing was run), it waits for one, up to the item's timeout."""
        logged = None if self._on_log is None else functools.partial(self._on_log, index)
        timeout = limits.effective_timeout_millis(self._timeout_millis) / 1000
        deadline = time.monotonic() + timeout
        wait = _BUSY_FIRST_WAIT_SECONDS
        while True:
            try:
                return self._calls.invoke(
                    self._name, self._work[index], timeout_millis=self._timeout_millis,
                    on_log=logged,
                ).decoded()  # fmt: skip
            except FunctionBusy as busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    message = f"{busy.message}; waited {timeout:g} s for a free replica"
                    raise FunctionBusy.from_body({**busy.detail, "message": message}, 429) from None
                if self.stopped:
                    raise
                if self._stopping.wait(min(wait, left)):
                    raise
                wait = min(wait * 2, _BUSY_WAIT_CAP_SECONDS)

    def work(self) -> None:
        with self._lock:
            self._working += 1
        try:
            while True:
                with self._lock:
                    if self.stopped or self._next == len(self._work):
                        return
                    index = self._next
                    self._next += 1
                try:
                    result = self._invoke(index)
                except Exception as error:
                    if isinstance(error, GatewayError):
                        error.item = (index, len(self._work))
                    with self._lock:
                        first = not (self._return_exceptions or self.failure is not None)
                        if first:
                            self.failure = error
                        self.results[index] = error
                        self.done += 1
                    if first:
                        self.stop()
                    continue
                with self._lock:
                    self.results[index] = result
                    self.done += 1
        finally:
            with self._lock:
                self._working -= 1
                if not self._working:
                    self.over.set()


def _json_header(reply: http.client.HTTPMessage, name: str, empty: Any) -> Any:
    """A header's JSON value; `empty` (a fresh ``[]`` or ``{}``) when it is absent or empty,
    as most calls' logs and outputs are, without parsing it."""
    text = reply.get(name)
    return json.loads(text) if text and text not in ("[]", "{}") else empty


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def spans_of(headers: http.client.HTTPMessage) -> bytes:
    """A traced call's X-Fn-Spans, decoded from base64; b"" when there are none."""
    value = headers.get(wire.SPANS_HEADER)
    try:
        return base64.b64decode(value, validate=True) if value else b""
    except binascii.Error:
        return b""


def _failure(status: int, data: bytes) -> GatewayError:
    try:
        body = json.loads(data)
    except ValueError:
        body = {"message": data.decode("utf-8", "replace")[:500]}
    return from_response(body, status)


class _Later:
    """One thread that runs each callback FOLLOW_AFTER_SECONDS after it was added: a call that
    answers sooner costs no thread of its own. Every callback has the same delay, so they fall
    due in the order added; the thread wakes at most every _TICK_SECONDS while any wait, not
    once a call."""

    _TICK_SECONDS = 0.02

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: collections.deque[tuple[float, Callable[[], None]]] = collections.deque()
        self._thread: threading.Thread | None = None

    def call_later(self, callback: Callable[[], None]) -> None:
        with self._cond:
            self._due.append((time.monotonic() + FOLLOW_AFTER_SECONDS, callback))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fn-later", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due:
                    self._cond.wait()
                now = time.monotonic()
                ready = []
                while self._due and self._due[0][0] <= now:
                    ready.append(self._due.popleft()[1])
                wait = self._due[0][0] - now if self._due else 0.0
            for callback in ready:
                callback()
            if wait > 0:  # the next is due then, and every one added meanwhile after it
                time.sleep(max(wait, self._TICK_SECONDS))


_LATER = _Later()


class _LiveFollow:
    """Follows one invocation's log lines for `on_log`, once it is due (``Client.invoke``)."""

    def __init__(self, client: Client, name: str, invocation_id: str, on_log: LogCallback):
        self._client = client
        self._name = name
        self._invocation_id = invocation_id
        self._on_log = on_log
        self._lock = threading.Lock()
        self._ended = False
        self._thread: threading.Thread | None = None
        self._connection: http.client.HTTPConnection | None = None
        self._closed = False
        self.shown = 0  # lines given to on_log while the call ran
        self.complete = False  # the stream ended with the invocation
        self.cut = False  # ... after its cap: the last lines were not streamed
        _LATER.call_later(self._start)

    def _start(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._connection = self._client._connect(timeout=None)
            self._thread = threading.Thread(target=self._follow, name="fn-follow", daemon=True)
            self._thread.start()

    def _follow(self) -> None:
        assert self._connection is not None
        path = (
            f"/v1/runs/{_quote(self._name)}/invocations/{_quote(self._invocation_id)}/logs?follow=1"
        )
        try:
            for record in self._client._records(self._connection, path):
                if self._closed:
                    return
                if "stream" in record:
                    self.cut = self.cut or bool(record.get("cut"))
                    self._on_log(record)
                    self.shown += 1
                elif record.get("end"):
                    self.complete = True
        except GatewayError:
            pass  # not found, too many followers, cancelled: the result's lines stand in

    def end(self, logs: list[dict[str, Any]], *, wait: bool = True) -> None:
        """The call is over with `logs` (its result's): take the stream's last lines (for a
        bounded while), then give on_log what the stream did not."""
        with self._lock:
            self._ended = True
            thread, connection = self._thread, self._connection
        if thread is not None:
            thread.join(_FOLLOW_END_SECONDS if wait else 0.2)
            if thread.is_alive() and connection is not None and connection.sock is not None:
                with contextlib.suppress(OSError):
                    connection.sock.shutdown(socket.SHUT_RDWR)
                thread.join()
        self._closed = True  # a stream still connecting gives on_log nothing now
        if self.complete and not self.cut:
            return
        if self.shown and logs:
            self._on_log(
                {"stream": "stderr", "text": "[fnkernel: the call's log, from its result:]"}
            )
        for line in logs:
            self._on_log(line)
