"""What the tests share besides fixtures: a gRPC test client, raw HTTP, waiting on a condition,
process checks, `fnkernel up` as a user starts it, and the handlers most tests register
(fixtures are in conftest.py)."""

from __future__ import annotations

import contextlib
import http.client
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from fnkernel.runtime_server import payloads
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import (
    logs_pb2,
    logs_pb2_grpc,
    payloads_pb2_grpc,
)
from fnkernel.runtime_server.daemon import Child, serve_args, spawn
from fnkernel.runtime_server.function_runtime.server import RuntimeServer
from fnkernel.runtime_server.function_runtime.spool import Spool
from fnkernel.runtime_server.limits import sha256_digest
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS
from fnkernel.runtime_server.tokens import find_token

ROOT = Path(__file__).resolve().parents[1]


_counter = itertools.count()


def digest(text: str) -> str:
    return sha256_digest(text.encode())


def wait_until(
    predicate: Callable[[], object], timeout: float = 5.0, interval: float = 0.01
) -> object:
    """Poll `predicate` until it is truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def read_until_ready(proc: subprocess.Popen[str]) -> list[str]:
    """The lines `fnkernel up` printed, up to the one that says it is ready."""
    lines = []
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"fnkernel up ended early: {lines}")
        lines.append(line.rstrip())
        if "ready;" in line:
            return lines


@contextlib.contextmanager
def fnkernel_up(state_dir: Path, env: dict[str, str], pods: str = "python=1") -> Iterator[str]:
    """`fnkernel up --state-dir STATE_DIR --pods PODS` in a shell with `env` added, its gateway
    on a free loopback port; its gateway's address while it runs, stopped (SIGTERM) after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "up", "--state-dir", str(state_dir),
         "--gateway-listen", "127.0.0.1:0", "--pods", pods],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, **env},
    )  # fmt: skip
    try:
        found = re.search(r"gateway (http://127\.0\.0\.1:\d+)", "\n".join(read_until_ready(proc)))
        assert found is not None
        yield found.group(1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def spooled(spool: Path) -> list[Path]:
    """The payloads in a stack's or a pod's spool (``--spool``): its files, at any depth, but
    the free ones the next payload is written into (docs/protocol.md, "Pages written again")."""
    return [
        path
        for path in spool.rglob("*")
        if path.is_file() and not path.name.startswith(payloads.FREE_PREFIX)
    ]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Client:
    """Stubs for one server plus helpers that build the requests of docs/protocol.md."""

    channel: grpc.Channel
    workspace: Path
    runtime: str

    def __post_init__(self) -> None:
        self.fn = pb_grpc.FunctionRuntimeStub(self.channel)
        self.runtime_stub = pb_grpc.RuntimeStub(self.channel)
        self.logs = logs_pb2_grpc.InvocationLogsStub(self.channel)
        self.payloads = payloads_pb2_grpc.PayloadsStub(self.channel)

    def follow(
        self, registration: pb.FunctionRegistration, invocation_id: str = "", *, follow: bool = True
    ) -> Any:
        """FollowInvocationLogs (docs/protocol.md, "Live output"): the stream of records."""
        return self.logs.FollowInvocationLogs(
            logs_pb2.FollowInvocationLogsRequest(
                run_uid=registration.run_uid,
                registration_id=registration.registration_id,
                invocation_id=invocation_id,
                follow=follow,
            ),
            timeout=60,
        )

    def workdir(self, files: dict[str, str]) -> Path:
        directory = self.workspace / f"run{next(_counter)}"
        directory.mkdir()
        for name, text in files.items():
            path = directory / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text))
        return directory

    def register(
        self,
        files: dict[str, str] | None = None,
        handler: str | None = None,
        *,
        run_uid: str | None = None,
        attempt: int = 1,
        working_dir: Path | str | None = None,
        env: dict[str, str] | None = None,
        digest_of: str = "v1",
        timeout: float = 30,
    ) -> pb.RegisterFunctionResponse:
        if working_dir is None:
            working_dir = self.workdir(files or {})
        return self.fn.RegisterFunction(
            pb.RegisterFunctionRequest(
                run_uid=run_uid or f"run-{next(_counter)}",
                registration_attempt=attempt,
                working_dir=str(working_dir),
                handler=handler or ("handler.handle" if self.runtime == "python" else "fn.handle"),
                env=env or {},
                idle_timeout_seconds=300,
                registration_digest=digest(digest_of),
            ),
            timeout=timeout,
        )

    def invoke(
        self,
        registration: pb.FunctionRegistration,
        payload: bytes = b"{}",
        *,
        timeout_millis: int = 0,
        invocation_id: str = "",
        timeout: float = 30,
        content_type: str = "application/json",
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> pb.InvokeFunctionResponse:
        return self.fn.InvokeFunction(
            pb.InvokeFunctionRequest(
                registration=registration,
                invocation_id=invocation_id,
                input=payload,
                content_type=content_type,
                timeout_millis=timeout_millis,
            ),
            timeout=timeout,
            metadata=metadata or None,
        )

    def invoke_future(self, registration: pb.FunctionRegistration, payload: bytes = b"{}", **kw):  # type: ignore[no-untyped-def]
        return self.fn.InvokeFunction.future(
            pb.InvokeFunctionRequest(
                registration=registration, input=payload, content_type="application/json", **kw
            ),
            timeout=30,
        )

    def status(self, registration: pb.FunctionRegistration) -> pb.FunctionStatusResponse:
        return self.fn.FunctionStatus(
            pb.FunctionStatusRequest(registration=registration), timeout=10
        )

    def unregister(
        self, registration: pb.FunctionRegistration, *, cancel: bool = False, drain_millis: int = 0
    ) -> pb.UnregisterFunctionResponse:
        return self.fn.UnregisterFunction(
            pb.UnregisterFunctionRequest(
                registration=registration,
                cancel_in_flight=cancel,
                drain_timeout_millis=drain_millis,
            ),
            timeout=30,
        )


@dataclass
class ServeProcess(Child):
    """A ``fnkernel serve`` process the tests started, and the workspace root it serves."""

    workspace_root: Path = field(default_factory=Path)


def spawn_serve(
    runtime: str, workspace_root: Path, *extra: str, listen: str = "127.0.0.1:0"
) -> ServeProcess:
    """Start ``fnkernel serve`` for `runtime` (``daemon.serve_args``), with `extra` flags."""
    child = spawn(serve_args(runtime, listen, workspace_root, *extra))
    return ServeProcess(child.argv, child.proc, child.address, child.announced, workspace_root)


def serve_in_process(
    runtime: str, workspace: Path, listen: str, spool: Spool | None = None
) -> Iterator[Client]:
    server = RuntimeServer(runtime, workspace, spool=spool)
    address = server.start(listen)
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        yield Client(channel, workspace, runtime)
    finally:
        channel.close()
        server.stop(drain_seconds=0)


ECHO_PY = {
    "handler.py": """
        def handle(event, context):
            return {"echo": event, "invocation_id": context.invocation_id}
    """
}


ECHO_SH = {
    "fn.sh": """
    handle() { printf '%s' "$1"; }
"""
}


def http_call(
    address: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    *,
    authenticate: bool = True,
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One raw HTTP request to a gateway: (status, headers, body), whatever the status. Like
    the client library, it sends a body as JSON and the gateway's own token (README,
    "Security") unless `headers` say otherwise or `authenticate` is False."""
    url = urllib.parse.urlsplit(address)
    sent = dict(headers or {})
    if body is not None:
        sent.setdefault("Content-Type", "application/json")
    token = find_token(address) if authenticate else None
    if token is not None:
        sent.setdefault("Authorization", f"Bearer {token}")
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    try:
        connection.request(method, path, body=body, headers=sent)
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


SLOW_PY = {
    "handler.py": textwrap.dedent(
        """
        import time

        def handle(event, context):
            time.sleep(event.get("sleep", 0))
            return {"slept": event.get("sleep", 0)}
        """
    )
}


# docs/protocol.md, "Tracing": the (service, kind) of every span of one call through a stack,
# each the parent of the next.
INVOKE_PATH = [
    ("fnkernel-gateway", "SERVER"),
    ("fnkernel-gateway", "CLIENT"),
    ("fnkernel-runtimed", "SERVER"),
    ("fnkernel-runtimed", "CLIENT"),
    ("fnkernel-runtime-server", "SERVER"),
    ("fnkernel-worker", "SERVER"),
]


def but_kptfile(files: dict[str, str]) -> dict[str, str]:
    """A package's files without the top Kptfile (the one a render writes its status to)."""
    return {path: text for path, text in files.items() if path != "Kptfile"}


# What a handler calls to wait until the test opens its Gate (prepend it to the handler's source).
GATE_WAIT = (
    "def wait_for_gate(path):\n"
    "    import socket\n"
    "    with socket.socket(socket.AF_UNIX) as gate:\n"
    "        gate.connect(path)\n"
    "        gate.recv(1)  # returns once the test has opened the gate\n"
)


class Gate:
    """A Unix socket a handler blocks on (``GATE_WAIT``) until the test opens it: the handler
    waits for an event, not by polling. Connections wait in the backlog until ``open()``, which
    answers them and every later one by closing it; ``str(gate)`` is the path to give."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="gate-", dir="/tmp")  # short: a socket path's limit
        self.path = os.path.join(self._dir, "gate")
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(self.path)
        self._server.listen(64)
        self._opened = False

    def __str__(self) -> str:
        return self.path

    def open(self) -> None:
        if self._opened:
            return
        self._opened = True
        threading.Thread(target=self._answer, daemon=True).start()

    def _answer(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:  # closed
                return
            connection.close()

    def close(self) -> None:
        self._server.close()  # a handler still waiting gets EOF and goes on
        shutil.rmtree(self._dir, ignore_errors=True)
