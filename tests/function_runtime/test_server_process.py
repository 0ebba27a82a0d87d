"""`fnkernel serve` as a real process (SIGTERM drain, --oneshot-only, Execute, CLI usage), and the
services every Runtime Server assembles (health)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from tests.support import ECHO_PY, ECHO_SH, Client, ServeProcess, pid_alive, wait_until


def client_for(server: ServeProcess, runtime: str) -> Client:
    return Client(grpc.insecure_channel(server.address), server.workspace_root, runtime)


def test_oneshot_only_server_answers_unimplemented_for_every_function_runtime_method(
    server_process: Callable[..., ServeProcess],
) -> None:
    # docs/protocol.md, "Services": a Runtime without function mode registers Runtime alone; docs/protocol.md: runtimed receives
    # Unimplemented and there is no fallback through Execute.
    client = client_for(server_process("--runtime", "python", "--oneshot-only"), "python")
    ref = pb.FunctionRegistration(run_uid="r", registration_id="reg_x")
    calls = [
        lambda: client.register(ECHO_PY),
        lambda: client.status(ref),
        lambda: client.invoke(ref),
        lambda: client.unregister(ref),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # Execute still works on it.
    response = client.runtime_stub.Execute(
        pb.ExecuteRequest(
            run_uid="one",
            working_dir=str(client.workdir(ECHO_PY)),
            handler="handler.handle",
            input=b"5",
        ),
        timeout=30,
    )
    assert response.exit_code == 0 and json.loads(response.output)["echo"] == 5


def test_health_service_reports_serving(bash_rt: Client) -> None:
    # docs/protocol.md, "Services": grpc.health.v1, for the server ("") and each service.
    health = health_pb2_grpc.HealthStub(bash_rt.channel)
    for service in ("", "executor.v1.FunctionRuntime", "executor.v1.Runtime"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_serve_listens_on_a_unix_socket(
    server_process: Callable[..., ServeProcess], tmp_path: Path
) -> None:
    server = server_process("--runtime", "bash", listen=f"unix:{tmp_path}/rt.sock")
    assert server.address == f"unix:{tmp_path}/rt.sock"
    client = client_for(server, "bash")
    reg = client.register(ECHO_SH)
    assert client.invoke(reg.registration, b"over unix").output == b"over unix"


def test_sigterm_drains_the_in_flight_invocation_and_exits_0(
    server_process: Callable[..., ServeProcess],
) -> None:
    server = server_process("--runtime", "python")
    client = client_for(server, "python")
    wd = client.workdir(
        {
            "handler.py": "import os, time\ndef handle(e):\n    open('pid', 'w').write(str(os.getpid()))\n    time.sleep(e)\n    return 'drained'\n"
        }
    )
    reg = client.register(working_dir=wd)
    future = client.invoke_future(reg.registration, b"1.0")
    worker = int(wait_until(lambda: (wd / "pid").exists() and (wd / "pid").read_text()))
    server.proc.send_signal(signal.SIGTERM)
    assert future.result(timeout=10).output == b'"drained"'
    assert server.proc.wait(timeout=15) == 0
    wait_until(lambda: not pid_alive(worker), timeout=5)


def test_sigterm_drain_is_bounded(server_process: Callable[..., ServeProcess]) -> None:
    server = server_process("--runtime", "python", "--drain-timeout", "0.5")
    client = client_for(server, "python")
    wd = client.workdir({"handler.py": "import time\ndef handle(e):\n    time.sleep(60)\n"})
    reg = client.register(working_dir=wd)
    future = client.invoke_future(reg.registration, b"{}")
    wait_until(lambda: client.status(reg.registration).in_flight == 1)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=15) == 0  # the drain's 0.5 s, not the call's 60 s
    with pytest.raises(grpc.RpcError):
        future.result(timeout=5)


@pytest.mark.parametrize("runtime", ["python", "bash"])
def test_execute_runs_the_handler_once_without_registration(
    runtime: str, python_rt: Client, bash_rt: Client
) -> None:
    # docs/protocol.md, "Services": Execute uses the same adapters, once, without registration.
    client = python_rt if runtime == "python" else bash_rt
    files, handler = (ECHO_PY, "handler.handle") if runtime == "python" else (ECHO_SH, "fn.handle")
    response = client.runtime_stub.Execute(
        pb.ExecuteRequest(
            run_uid="once", working_dir=str(client.workdir(files)), handler=handler, input=b'"x"'
        ),
        timeout=30,
    )
    assert response.exit_code == 0
    assert b'"x"' in response.output


def test_execute_reports_a_failing_handler_through_exit_code(python_rt: Client) -> None:
    response = python_rt.runtime_stub.Execute(
        pb.ExecuteRequest(
            run_uid="once",
            working_dir=str(
                python_rt.workdir({"handler.py": "def handle(e):\n    raise KeyError('id')\n"})
            ),
            handler="handler.handle",
        ),
        timeout=30,
    )
    assert response.exit_code == 1
    assert json.loads(response.output) == {"errorType": "KeyError", "errorMessage": "'id'"}


@pytest.mark.parametrize(
    "source",
    [
        "import time\ndef handle(e):\n    time.sleep(30)\n",
        # docs/protocol.md, "Errors": Execute's timeout counts loading too; past it, the call
        # is late (as a loaded handler past its timeout is), not a handler that failed to load.
        "import time\ntime.sleep(30)\ndef handle(e):\n    pass\n",
    ],
    ids=["running", "loading"],
)
def test_execute_timeout_is_deadline_exceeded(python_rt: Client, source: str) -> None:
    wd = python_rt.workdir({"handler.py": source})
    with pytest.raises(grpc.RpcError) as err:
        python_rt.runtime_stub.Execute(
            pb.ExecuteRequest(
                run_uid="once", working_dir=str(wd), handler="handler.handle", timeout_millis=300
            ),
            timeout=30,
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_usage_errors_exit_2() -> None:
    # docs/protocol.md, "CLI": exit code 2 on a usage error; --help everywhere.
    assert run_cli("serve").returncode == 2
    assert run_cli("serve", "--runtime", "cobol").returncode == 2
    assert (
        run_cli("serve", "--runtime", "python", "--workspace-root", "/no/such/dir").returncode == 2
    )
    assert run_cli("serve", "--help").returncode == 0
    assert run_cli("--help").returncode == 0


def test_runtimed_on_kubernetes_is_told_its_workspace() -> None:
    # docs/kubernetes.md: a Runtime Pod's workspace is a volume of the pod, which its manifest
    # names; one machine's default (STATE_DIR/workspace/POD) is no place in a container.
    done = run_cli(
        "runtimed", "--store", "kubernetes", "--pod", "p", "--runtime", "python",
        "--server", "unix:/nonexistent.sock",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--workspace" in done.stderr and "own volume" in done.stderr


def test_scratch_dirs_of_a_killed_server_are_removed_by_the_next_server(
    server_process: Callable[..., ServeProcess],
) -> None:
    # A SIGKILLed server cannot clean up; the next one removes what it left (system/private.py),
    # never the scratch dirs of a server that is still running.
    killed, live = server_process("--runtime", "bash"), server_process("--runtime", "bash")
    for server in (killed, live):
        client_for(server, "bash").register(ECHO_SH)

    def scratch(server: ServeProcess) -> list[Path]:
        return list(Path(tempfile.gettempdir()).glob(f"fnkernel-bash-{server.proc.pid}-*"))

    left, kept = scratch(killed), scratch(live)
    assert len(left) == 1 and len(kept) == 1
    killed.proc.kill()
    killed.proc.wait(10)
    assert left[0].exists()
    server_process("--runtime", "bash")
    assert not left[0].exists()
    assert kept[0].exists()


ORPHANING_PY = {
    "handler.py": """
        import subprocess, time
        def handle(event):
            subprocess.Popen(["sleep", "60"])  # never waited for: killed with the worker
            time.sleep(60)
        """
}


def server_zombies(server: ServeProcess) -> list[int]:
    """Zombie children of the server process."""
    zombies = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if fields[0] == "Z" and fields[1] == str(server.pid):
                zombies.append(int(entry.name))
    return zombies


def test_a_killed_handlers_children_are_reaped_by_the_server(
    server_process: Callable[..., ServeProcess],
) -> None:
    # docs/architecture.md, "Measured facts the design rests on": the Runtime Server is a child
    # subreaper; the grandchildren a killed handler leaves are reparented to it and reaped.
    server = server_process("--runtime", "python")
    client = client_for(server, "python")
    registration = client.register(ORPHANING_PY).registration
    with pytest.raises(grpc.RpcError) as err:
        client.invoke(registration, timeout_millis=500)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: not server_zombies(server), timeout=10)
