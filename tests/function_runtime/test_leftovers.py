"""docs/protocol.md, "Adapters": nothing a handler starts outlives its registration. A process
that leaves the worker's process group (``setsid()`` and a second fork) is reparented to the
Runtime Server, a child subreaper, which kills it when the registration ends and when the server
stops."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import (
    registrations_pb2,
    registrations_pb2_grpc,
)
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS
from tests.support import Client, ServeProcess, pid_alive, wait_until

# Leaves a process running in a session of its own, no child of the worker's any more.
ESCAPES = {
    "handler.py": """
        import os, signal

        def handle(event):
            read, write = os.pipe()
            child = os.fork()
            if child == 0:
                os.setsid()
                if os.fork() == 0:  # the escaped one: says who it is, then waits to be killed
                    os.write(write, str(os.getpid()).encode())
                    os.close(write)
                    signal.pause()
                os._exit(0)
            os.close(write)
            os.waitpid(child, 0)
            with os.fdopen(read) as escaped:
                return int(escaped.read())
    """
}


@pytest.fixture
def served(
    server_process: Callable[..., ServeProcess], workspace
) -> Iterator[tuple[ServeProcess, Client]]:  # type: ignore[no-untyped-def]
    yield from serving(server_process, workspace, "python")


def serving(
    server_process: Callable[..., ServeProcess], workspace: Path, runtime: str
) -> Iterator[tuple[ServeProcess, Client]]:
    server = server_process("--runtime", runtime)
    channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    yield server, Client(channel, workspace, runtime)
    channel.close()


def escape(rt: Client) -> tuple[object, int]:
    registration = rt.register(ESCAPES).registration
    pid = int(rt.invoke(registration).output)
    assert pid_alive(pid)
    return registration, pid


def test_a_process_that_left_the_workers_group_dies_with_its_registration(
    served: tuple[ServeProcess, Client],
) -> None:
    _, rt = served
    registration, pid = escape(rt)
    second, other = escape(rt)  # another Run's: not this registration's to kill
    rt.unregister(registration)  # type: ignore[arg-type]
    wait_until(lambda: not pid_alive(pid), timeout=5)
    assert pid_alive(other)
    rt.unregister(second)  # type: ignore[arg-type]
    wait_until(lambda: not pid_alive(other), timeout=5)


def test_nothing_a_handler_started_outlives_its_server(
    served: tuple[ServeProcess, Client],
) -> None:
    server, rt = served
    _, pid = escape(rt)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    wait_until(lambda: not pid_alive(pid), timeout=5)


# Hangs as it is imported, having said who it is: a student's loop at module level.
HANGS = {
    "handler.py": (
        "import os, time\n"
        "with open('pid', 'w') as said:\n"
        "    said.write(str(os.getpid()))\n"
        "time.sleep(3600)\n"
        "def handle(event):\n"
        "    return 1\n"
    )
}


def hung_load(
    rt: Client, run_uid: str, files: dict[str, str] = HANGS, handler: str | None = None
) -> tuple[threading.Thread, int]:
    """A RegisterFunction waiting on a handler that never loads, and its worker's pid (the
    handler's file writes it to `pid`)."""
    workdir = rt.workdir(files)

    def register() -> None:
        with contextlib.suppress(grpc.RpcError):  # its server may be killed under it
            rt.register(working_dir=workdir, handler=handler, run_uid=run_uid, timeout=120)

    waiting = threading.Thread(target=register, daemon=True)
    waiting.start()
    said = workdir / "pid"
    wait_until(lambda: said.exists() and said.read_text() != "", timeout=30)
    return waiting, int(said.read_text())


def test_a_handler_that_hangs_as_it_loads_is_stopped_by_an_unregister(
    served: tuple[ServeProcess, Client],
) -> None:
    # docs/protocol.md, "Registration": repeating RegisterFunction returns the current
    # reference without loading again — at once, REGISTERING while the first still waits — so
    # its caller can unregister a load that never ends; that kills its worker, and the first
    # RegisterFunction is answered.
    _, rt = served
    waiting, worker = hung_load(rt, "hangs")
    repeated = rt.register(working_dir=rt.workdir(HANGS), run_uid="hangs", timeout=10)
    assert repeated.state == pb.FUNCTION_REGISTRATION_STATE_REGISTERING
    rt.unregister(repeated.registration, cancel=True)
    wait_until(lambda: not pid_alive(worker), timeout=10)
    waiting.join(10)
    assert not waiting.is_alive()


def test_a_worker_still_loading_leaves_with_its_server(
    served: tuple[ServeProcess, Client],
) -> None:
    # docs/protocol.md, "Adapters": a worker leaves when its server is gone — also one whose
    # handler hangs as it is imported, when nothing reads its request pipe yet.
    server, rt = served
    _, worker = hung_load(rt, "orphaned")
    server.proc.kill()
    server.proc.wait(30)
    wait_until(lambda: not pid_alive(worker), timeout=10)


def test_stop_loading_stops_only_a_load_under_way(served: tuple[ServeProcess, Client]) -> None:
    # docs/protocol.md, "Registration": Registrations/StopLoading unregisters the registration
    # of the Run's attempt only while it loads — its worker killed, the waiting RegisterFunction
    # answered — and touches nothing else: another attempt, a loaded one, no registration.
    _, rt = served
    stub = registrations_pb2_grpc.RegistrationsStub(rt.channel)

    def stop(run_uid: str, attempt: int = 1) -> bool:
        request = registrations_pb2.StopLoadingRequest(
            run_uid=run_uid, registration_attempt=attempt
        )
        return bool(stub.StopLoading(request, timeout=10).stopped)

    waiting, worker = hung_load(rt, "deleted-while-loading")
    assert not stop("deleted-while-loading", attempt=2)  # not the attempt that loads
    assert pid_alive(worker)
    assert stop("deleted-while-loading")
    wait_until(lambda: not pid_alive(worker), timeout=10)
    waiting.join(10)
    assert not waiting.is_alive()
    assert not stop("deleted-while-loading")  # nothing left to stop
    loaded = rt.register({"handler.py": "def handle(event):\n    return 1\n"}, run_uid="loaded")
    assert not stop("loaded")
    assert rt.status(loaded.registration).state == pb.FUNCTION_REGISTRATION_STATE_READY


@pytest.fixture
def bash_served(
    server_process: Callable[..., ServeProcess], workspace: Path
) -> Iterator[tuple[ServeProcess, Client]]:
    yield from serving(server_process, workspace, "bash")


def test_a_bash_worker_still_sourcing_its_file_leaves_with_its_server(
    bash_served: tuple[ServeProcess, Client],
) -> None:
    # The same for a Bash worker whose file hangs as it is sourced (adapters/bash_runner.sh).
    server, rt = bash_served
    hangs = {"handler.sh": "echo $$ > pid\nsleep 3600\nhandler() { :; }\n"}
    _, worker = hung_load(rt, "orphaned-bash", hangs, "handler.handler")
    server.proc.kill()
    server.proc.wait(30)
    wait_until(lambda: not pid_alive(worker), timeout=10)
