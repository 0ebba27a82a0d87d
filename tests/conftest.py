"""Fixtures: real Runtime Servers (in-process on a Unix socket or TCP loopback, or `fnkernel serve`
as a subprocess) and working directories holding real handlers."""

from __future__ import annotations

import http.client
import itertools
import os
import shutil
import textwrap
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from runtime_server._proto.executor.v1 import runtime_pb2 as pb
from runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from runtime_server.daemon import ServeProcess, spawn_serve
from runtime_server.function_runtime.server import RuntimeServer
from runtime_server.lifecycle.stack import Stack
from runtime_server.limits import sha256_digest
from runtime_server.rpc import CHANNEL_OPTIONS
from runtime_server.tokens import find_token

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
    ) -> pb.InvokeFunctionResponse:
        return self.fn.InvokeFunction(
            pb.InvokeFunctionRequest(
                registration=registration,
                invocation_id=invocation_id,
                input=payload,
                content_type="application/json",
                timeout_millis=timeout_millis,
            ),
            timeout=timeout,
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


def _serve(runtime: str, workspace: Path, listen: str) -> Iterator[Client]:
    server = RuntimeServer(runtime, workspace)
    address = server.start(listen)
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        yield Client(channel, workspace, runtime)
    finally:
        channel.close()
        server.stop(drain_seconds=0)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "workspace"
    root.mkdir()
    return root


@pytest.fixture
def python_rt(workspace: Path, tmp_path: Path) -> Iterator[Client]:
    """A python Runtime Server on a Unix socket."""
    yield from _serve("python", workspace, f"unix:{tmp_path}/python.sock")


@pytest.fixture
def bash_rt(workspace: Path, tmp_path: Path) -> Iterator[Client]:
    """A bash Runtime Server on a Unix socket."""
    yield from _serve("bash", workspace, f"unix:{tmp_path}/bash.sock")


@pytest.fixture(params=["unix", "tcp"])
def python_any(request: pytest.FixtureRequest, workspace: Path, tmp_path: Path) -> Iterator[Client]:
    """The python Runtime Server over a Unix socket and over TCP loopback."""
    listen = f"unix:{tmp_path}/py.sock" if request.param == "unix" else "127.0.0.1:0"
    yield from _serve("python", workspace, listen)


@pytest.fixture
def server_process(workspace: Path) -> Iterator[Callable[..., ServeProcess]]:
    """`fnkernel serve` as a real subprocess (args are its flags); killed at teardown."""
    started: list[ServeProcess] = []

    def start(*args: str, listen: str = "127.0.0.1:0") -> ServeProcess:
        assert args[0] == "--runtime", "the first flags name the runtime"
        server = spawn_serve(args[1], workspace, *args[2:], listen=listen)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
        server.proc.wait(10)


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


# The stack: real Runtime Server, runtimed and gateway processes (docs/protocol.md, "Runs").


@pytest.fixture
def stack_factory(tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    """Start `Stack`s (real child processes); all stopped at teardown."""
    started: list[Stack] = []

    def start(
        pods: dict[str, int] | None = None, *, state_dir: Path | None = None, **kw: object
    ) -> Stack:
        kw.setdefault("poll_interval", 0.2)
        stack = Stack(
            state_dir or tmp_path / "state",
            pods or {"python": 1, "bash": 1},
            gateway_listen="127.0.0.1:0",
            **kw,  # type: ignore[arg-type]
        )
        stack.start()
        started.append(stack)
        return stack

    yield start
    for stack in started:
        stack.stop()


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack for the tests that only read or create uniquely named Runs."""
    stack = Stack(
        tmp_path_factory.mktemp("shared") / "state",
        {"python": 1, "bash": 1},
        gateway_listen="127.0.0.1:0",
        poll_interval=0.2,
    )
    stack.start()
    yield stack
    stack.stop()


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


@pytest.fixture(scope="session")
def fnkernel_spec() -> Iterator[Path]:
    """The fnkernel kernelspec, installed under a private prefix that Jupyter is pointed at."""
    from tests.kernels import install_kernelspec

    data = install_kernelspec()
    yield data
    shutil.rmtree(data.parents[1], ignore_errors=True)
