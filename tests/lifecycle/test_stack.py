"""The function lifecycle across real processes (docs/protocol.md, "Runs"): a Runtime Server killed under a READY
Run, scale to zero and cold start, restarts that lose nothing, `fnkernel up`, and the client CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.daemon import Prewarmed, serve_args, spawn
from fnkernel.runtime_server.lifecycle.runs import POD_GRACE_SECONDS
from fnkernel.runtime_server.lifecycle.sqlite import STORE_FILE, SqliteRunStore
from fnkernel.runtime_server.lifecycle.stack import Stack
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS
from tests.support import ECHO_PY, SLOW_PY, http_call, pid_alive, read_until_ready, wait_until

ECHO = {name: textwrap.dedent(text) for name, text in ECHO_PY.items()}
StackFactory = Callable[..., Stack]


def server_stub(
    stack: Stack, pod: str = "python-0"
) -> tuple[grpc.Channel, pb_grpc.FunctionRuntimeStub]:
    child = stack.component(f"{pod}-server").child
    assert child is not None
    channel = grpc.insecure_channel(child.address, options=CHANNEL_OPTIONS)
    return channel, pb_grpc.FunctionRuntimeStub(channel)


def phase_and_attempt(client: Client, name: str) -> tuple[str, int]:
    status = client.status(name)["status"]
    return status["phase"], status["attempt"]


def test_killed_runtime_server_is_ready_again_with_attempt_2(stack_factory: StackFactory) -> None:
    # Issue 3: SIGKILL the Runtime Server under a READY Run; within 5 s the Run is READY again
    # with attempt 2, invoking works, and the attempt-1 registration ID is fenced.
    stack = stack_factory({"python": 1})
    client = Client(stack.gateway_address)
    client.create_run("echo", runtime="python", handler="handler.handle", files=ECHO)
    first = client.status("echo")["live"]["registrationId"]
    server = stack.component("python-0-server").child
    assert server is not None
    os.kill(server.pid, signal.SIGKILL)
    wait_until(lambda: phase_and_attempt(client, "echo") == ("Ready", 2), timeout=5)
    result = client.invoke("echo", {"after": "restart"})
    assert result.value()["echo"] == {"after": "restart"}
    assert result.attempt == 2
    second = client.status("echo")["live"]["registrationId"]
    assert second != first
    channel, stub = server_stub(stack)
    stale = pb.FunctionRegistration(run_uid=client.status("echo")["uid"], registration_id=first)
    try:
        for call in (
            lambda: stub.InvokeFunction(pb.InvokeFunctionRequest(registration=stale, input=b"{}"), timeout=5),
            lambda: stub.UnregisterFunction(pb.UnregisterFunctionRequest(registration=stale), timeout=5),
        ):  # fmt: skip
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        channel.close()
    assert client.invoke("echo", {}).attempt == 2  # the new registration was untouched


def test_idle_run_scales_to_zero_and_cold_starts_with_the_same_attempt(
    stack_factory: StackFactory,
) -> None:
    # docs/protocol.md, "Runs": idle timeout = scale to zero; the next invoke re-registers (same attempt).
    stack = stack_factory({"python": 1})
    client = Client(stack.gateway_address)
    client.create_run(
        "sleepy", runtime="python", handler="handler.handle", files=ECHO, idle_timeout_seconds=1
    )
    first = client.status("sleepy")["live"]["registrationId"]
    assert client.invoke("sleepy", {}).cold_start is False
    wait_until(lambda: phase_and_attempt(client, "sleepy") == ("Idle", 1), timeout=10)
    assert client.status("sleepy")["live"] is None  # nothing registered on the server
    status, headers, output = http_call(
        stack.gateway_address, "POST", "/v1/runs/sleepy:invoke", b"[1]"
    )
    assert status == 200 and json.loads(output)["echo"] == [1]
    assert headers["X-Fn-Cold-Start"] == "1"
    assert headers["X-Fn-Attempt"] == "1"
    assert phase_and_attempt(client, "sleepy") == ("Ready", 1)
    assert client.status("sleepy")["live"]["registrationId"] != first
    warm = client.invoke("sleepy", {})
    assert warm.cold_start is False and warm.attempt == 1


def test_restarted_control_plane_and_runtimed_lose_no_run(stack_factory: StackFactory) -> None:
    # Issue 3: restart the control plane and runtimed: every Run keeps its attempt and phase.
    stack = stack_factory({"python": 1})
    client = Client(stack.gateway_address)
    client.create_run("keep", runtime="python", handler="handler.handle", files=ECHO)
    client.create_run(
        "broken", runtime="python", handler="handler.handle", files={"handler.py": "def handle(:\n"}
    )
    before = {run["name"]: run["status"] for run in client.list_runs()}
    registration = client.status("keep")["live"]["registrationId"]
    assert before["keep"]["phase"] == "Ready" and before["broken"]["phase"] == "Failed"
    old = {}
    for name in ("gateway", "python-0-runtimed"):
        child = stack.component(name).child
        assert child is not None
        old[name] = child.pid
        os.kill(child.pid, signal.SIGKILL)

    def restarted() -> bool:
        return all(
            (child := stack.component(name).child) is not None
            and child.pid != pid
            and child.proc.poll() is None
            for name, pid in old.items()
        )

    wait_until(restarted, timeout=20)
    client = Client(stack.gateway_address)
    wait_until(lambda: client.status("keep")["live"] is not None, timeout=10)
    after = {run["name"]: run["status"] for run in client.list_runs()}
    assert after == before
    assert client.invoke("keep", {"x": 1}).value()["echo"] == {"x": 1}
    # The same attempt resumed the same registration: nothing failed.
    assert client.status("keep")["live"]["registrationId"] == registration
    assert phase_and_attempt(client, "keep") == ("Ready", 1)


def test_the_local_provisioner_starts_says_alive_and_stops_a_pod(
    stack_factory: StackFactory,
) -> None:
    # docs/architecture.md, "Seams": a PodProvisioner starts a Runtime Pod (a server and its
    # runtimed), says whether it is alive and where its runtimed listens, and stops it.
    stack = stack_factory({"python": 1})
    provisioner = stack.provisioner
    pod = provisioner.start("bash")
    assert provisioner.pods() == ["python-0", pod] and provisioner.pods("bash") == [pod]
    assert provisioner.alive(pod)
    address = provisioner.address(pod)
    assert address == stack.component(f"{pod}-runtimed").child.address  # type: ignore[union-attr]
    store = SqliteRunStore(stack.state_dir / STORE_FILE)
    try:  # its runtimed reports it to the store, where the scheduler finds it
        wait_until(lambda: (found := store.pod(pod)) is not None and found.alive(), timeout=10)
    finally:
        store.close()
    provisioner.stop(pod)
    assert not provisioner.alive(pod)
    with pytest.raises(KeyError):
        stack.component(f"{pod}-server")  # not supervised any more: nothing restarts it
    assert provisioner.alive("python-0")


def test_reassignment_to_another_pod_when_a_pod_dies(stack_factory: StackFactory) -> None:
    # docs/protocol.md, "Runs": the control plane reassigns on pod death (attempt + 1 on another pod).
    stack = stack_factory({"python": 2})
    client = Client(stack.gateway_address)
    client.create_run("mover", runtime="python", handler="handler.handle", files=ECHO)
    pod = client.status("mover")["status"]["assignedPod"]
    # Stop the whole pod: its supervisor entries are frozen first so nothing restarts it.
    for name in (f"{pod}-runtimed", f"{pod}-server"):
        component = stack.component(name)
        stack.components.remove(component)
        assert component.child is not None
        component.child.proc.kill()
        component.child.proc.wait()
    # Gone once its heartbeat is POD_GRACE_SECONDS old (a pause is not a death), then moved.
    wait_until(
        lambda: phase_and_attempt(client, "mover") == ("Ready", 2), timeout=POD_GRACE_SECONDS + 15
    )
    moved = client.status("mover")["status"]["assignedPod"]
    assert moved != pod
    assert client.invoke("mover", {"y": 2}).value()["echo"] == {"y": 2}


@pytest.mark.parametrize("stop_with", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_fnkernel_up_prints_addresses_and_stops_everything(
    tmp_path: Path, stop_with: signal.Signals
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "up", "--state-dir", str(tmp_path / "s"),
         "--gateway-listen", "127.0.0.1:0", "--pods", "python=1,bash=1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        lines = read_until_ready(proc)
        text = "\n".join(lines)
        pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", text)]
        assert len(pids) == 5  # two servers, two runtimeds, one gateway
        for name in ("python-0-server", "python-0-runtimed", "bash-0-server", "bash-0-runtimed"):
            assert f"{name}: unix:" in text
        gateway = re.search(r"gateway (http://127\.0\.0\.1:\d+)", text)
        assert gateway is not None
        client = Client(gateway.group(1))
        client.create_run("echo", runtime="python", handler="handler.handle", files=ECHO)
        assert client.invoke("echo", 5).value()["echo"] == 5
        proc.send_signal(stop_with)
        code = proc.wait(30)
        if stop_with != signal.SIGKILL:
            assert code == 0
        # No orphans: every component exits (on SIGKILL, through its parent-pid watch).
        wait_until(lambda: not any(pid_alive(pid) for pid in pids), timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_fnkernel_down_stops_the_stack_up_started_in_its_state_dir(tmp_path: Path) -> None:
    # README, "CLI": `fnkernel up &` then `fnkernel down` with the same state dir.
    cli = [sys.executable, "-m", "fnkernel.runtime_server.cli"]
    state = ["--state-dir", str(tmp_path / "s")]
    proc = subprocess.Popen(
        [*cli, "up", *state, "--gateway-listen", "127.0.0.1:0", "--pods", "python=1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", "\n".join(read_until_ready(proc)))]
        down = subprocess.run([*cli, "down", *state], capture_output=True, text=True, timeout=60)
        assert down.returncode == 0, down.stderr
        assert (
            down.stdout
            == f"fnkernel down: stopped the stack of {tmp_path / 's'} (pid {proc.pid})\n"
        )
        assert proc.wait(30) == 0
        assert not any(pid_alive(pid) for pid in pids)  # down waits until every one is gone
        again = subprocess.run([*cli, "down", *state], capture_output=True, text=True, timeout=60)
        assert (again.returncode, again.stderr) == (
            1, f"fnkernel down: no stack is up with the state dir {tmp_path / 's'}\n",
        )  # fmt: skip
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_rejects_a_bad_pods_flag(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "up", "--state-dir", str(tmp_path), "--pods", "ruby=1"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--pods" in result.stderr


# gRPC reads these in a unix: target as URI syntax (docs/architecture.md, "Measured facts the
# design rests on"); "%41" is a valid escape, so it is read as "A".
GRPC_SYNTAX_PATH = "team,a?b#c%41"


def test_a_state_dir_whose_path_grpc_reads_as_syntax_still_serves(
    stack_factory: StackFactory,
) -> None:
    # `fnkernel up --state-dir` takes any directory: the state stays there, and the sockets go
    # where gRPC can name them. A short path, so that its length alone would not move them.
    with tempfile.TemporaryDirectory(prefix=f"{GRPC_SYNTAX_PATH}-") as parent:
        state_dir = Path(parent, "state")
        stack = stack_factory({"python": 1}, state_dir=state_dir)
        client = Client(stack.gateway_address)
        client.create_run("echo", runtime="python", handler="handler.handle", files=ECHO)
        assert client.invoke("echo", 5).value()["echo"] == 5
        assert (state_dir / "runs.db").is_file()
        stack.stop()


@pytest.mark.parametrize("command", ["serve", "runtimed"])
def test_a_socket_path_grpc_cannot_name_is_refused_with_the_reason(
    tmp_path: Path, command: str
) -> None:
    # Bound as given, a "," path listens where no client can reach it: refused before binding.
    listen = f"unix:{tmp_path}/{GRPC_SYNTAX_PATH}.sock"
    args = ["--runtime", "python", "--listen", listen]
    if command == "serve":
        args += ["--workspace-root", str(tmp_path)]
    else:
        args += ["--pod", "p", "--server", "unix:/nonexistent.sock", "--state-dir", str(tmp_path)]
    result = fnkernel(command, *args)
    assert result.returncode == 1, result.stderr
    assert "gRPC cannot name a Unix socket whose path holds , ? # %" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*.sock"))


def fnkernel(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=60,
    )


def test_cli_runs_and_invoke_with_exit_codes(shared_stack: Stack, tmp_path: Path) -> None:
    # docs/protocol.md, "CLI": exit codes 0 ok, 1 function/result failure, 2 usage error.
    gateway = ["--gateway", shared_stack.gateway_address]
    source = tmp_path / "src"
    source.mkdir()
    (source / "handler.py").write_text(
        "def handle(event, context):\n"
        "    if event.get('fail'):\n"
        "        raise RuntimeError('asked to fail')\n"
        "    context.set_output('n', str(event.get('n', 0)))\n"
        "    return {'n': event.get('n', 0)}\n"
    )
    created = fnkernel("runs", "create", "cli-fn", "--runtime", "python", "--source", str(source),
                       "--handler", "handler.handle", "--env", "MODE=sekrit-value", *gateway)  # fmt: skip
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["status"]["phase"] == "Ready"
    listed = fnkernel("runs", "list", *gateway)
    assert listed.returncode == 0 and re.search(r"cli-fn\s+python\s+Ready\s+1", listed.stdout)
    got = fnkernel("runs", "get", "cli-fn", *gateway)
    # docs/protocol.md, "Runs": the env's keys, never its values, to any token holder.
    assert json.loads(got.stdout)["spec"]["env"] == ["MODE"] and "sekrit" not in got.stdout
    ok = fnkernel("invoke", "cli-fn", '{"n": 3}', *gateway)
    assert (ok.returncode, json.loads(ok.stdout)) == (0, {"n": 3})
    assert 'outputs: {"n": "3"}' in ok.stderr
    piped = fnkernel("invoke", "cli-fn", "-", *gateway, stdin='{"n": 4}')
    assert json.loads(piped.stdout) == {"n": 4}
    failed = fnkernel("invoke", "cli-fn", '{"fail": true}', *gateway)
    assert failed.returncode == 1
    assert "HandlerFailed" in failed.stderr and "asked to fail" in failed.stderr
    bad = fnkernel("invoke", "cli-fn", "{not json", *gateway)
    assert bad.returncode == 2 and "not JSON" in bad.stderr
    missing = fnkernel("invoke", "no-such-fn", *gateway)
    assert missing.returncode == 1 and "FunctionNotFound" in missing.stderr
    assert fnkernel("runs", "delete", "cli-fn", *gateway).returncode == 0
    assert fnkernel("runs", "get", "cli-fn", *gateway).returncode == 1


def test_cli_reports_an_unreachable_gateway(tmp_path: Path) -> None:
    result = fnkernel("runs", "list", "--gateway", f"unix:{tmp_path}/nothing.sock")
    assert result.returncode == 1
    assert "cannot reach the gateway" in result.stderr


def test_delete_unregisters_and_removes_the_working_dir(shared_stack: Stack) -> None:
    client = Client(shared_stack.gateway_address)
    created = client.create_run("doomed", runtime="python", handler="handler.handle", files=SLOW_PY)
    # Each pod writes its Runs' files in a workspace of its own: WORKSPACE/POD/RUN_UID.
    pod = created["status"]["assignedPod"]
    working_dir = shared_stack.workspace_root / pod / created["uid"]
    assert working_dir.is_dir()
    client.delete_run("doomed")
    wait_until(lambda: not working_dir.exists(), timeout=10)  # at runtimed's next pass
    assert "doomed" not in [run["name"] for run in client.list_runs()]


def test_runtime_server_kills_neither_exhaust_the_run_nor_answer_404(
    stack_factory: StackFactory,
) -> None:
    # README, "Runs": an attempt that fails because the pod is down is not charged to the Run's
    # retry budget (3), and while the Run is registered again every invoke answers 503 with
    # Retry-After, never 404 ("no such function"). Four kills, waiting for recovery each time.
    stack = stack_factory({"python": 1}, poll_interval=5.0)  # FunctionStatus polls are rare
    client = Client(stack.gateway_address)
    client.create_run("steady", runtime="python", handler="handler.handle", files=ECHO)
    component = stack.component("python-0-server")
    refusals: list[tuple[int, str | None]] = []

    def answered() -> bool:
        status, headers, _ = http_call(
            stack.gateway_address, "POST", "/v1/runs/steady:invoke", b"{}"
        )
        if status != 200:
            refusals.append((status, headers.get("Retry-After")))
        return status == 200

    for _ in range(4):
        server = component.child
        assert server is not None
        os.kill(server.pid, signal.SIGKILL)
        wait_until(lambda: component.child is not server, timeout=10)  # noqa: B023
        wait_until(answered, timeout=15)
    phase, attempt = phase_and_attempt(client, "steady")
    assert phase == "Ready" and attempt >= 2
    assert refusals, "no invoke ever met the restart"
    assert all(status == 503 and retry for status, retry in refusals), set(refusals)
    # The supervisor's back-off starts over once the server has stayed up.
    wait_until(lambda: component.restarts == 0, timeout=15)


def test_delete_with_a_call_in_flight_answers_after_the_call_and_leaves_nothing(
    shared_stack: Stack,
) -> None:
    # README, "HTTP API": DELETE drains the call in flight (at most drainTimeoutMs, 0 to
    # 900000) and answers once the Runtime Server no longer holds the Run's registration.
    client = Client(shared_stack.gateway_address)
    ends_at = {
        "handler.py": "import time\ndef handle(event):\n    time.sleep(event)\n    return time.time()\n"
    }
    run = client.create_run("draining", runtime="python", handler="handler.handle", files=ends_at)
    status, _, body = http_call(
        shared_stack.gateway_address, "DELETE", "/v1/runs/draining?drainTimeoutMs=10000000000000"
    )
    assert status == 400 and "drainTimeoutMs" in json.loads(body)["message"]
    handler_ended: list[float] = []
    slow = threading.Thread(
        target=lambda: handler_ended.append(client.invoke("draining", 1).value())
    )
    slow.start()
    wait_until(lambda: (client.status("draining").get("live") or {}).get("inFlight") == 1)
    client.delete_run("draining", drain_timeout_millis=10_000)
    deleted = time.time()
    slow.join(10)
    assert handler_ended, "the call was not drained"
    assert handler_ended[0] <= deleted  # the handler returned before the 204
    channel, stub = server_stub(shared_stack)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            stub.FunctionStatus(
                pb.FunctionStatusRequest(
                    registration=pb.FunctionRegistration(run_uid=run["uid"], registration_id="x")
                ),
                timeout=5,
            )
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        channel.close()


def test_a_stack_takes_its_first_components_from_prewarmed_processes(
    stack_factory: StackFactory,
) -> None:
    # docs/architecture.md, "The first registration": each component's first start takes the
    # waiting process of its command; it logs where a component started afresh logs, and a
    # restart after its death starts afresh.
    prewarmed = Prewarmed()
    try:
        waiting = prewarmed.pids()
        assert set(waiting) == {"serve", "runtimed", "gateway"}
        assert prewarmed.wait_ready(30)  # each has imported what it needs, and says so
        stack = stack_factory({"python": 1}, prewarmed=prewarmed)
        started = {
            "serve": stack.component("python-0-server").child,
            "runtimed": stack.component("python-0-runtimed").child,
            "gateway": stack.component("gateway").child,
        }
        assert {c: child.pid for c, child in started.items() if child} == waiting
        client = Client(stack.gateway_address)
        client.create_run("echo", runtime="python", handler="handler.handle", files=ECHO)
        assert client.invoke("echo", {"n": 1}).value()["echo"] == {"n": 1}
        log = stack.state_dir / "logs" / "python-0-runtimed.log"
        wait_until(lambda: "attempt 1 READY as reg_" in log.read_text(), timeout=5)
        os.kill(waiting["serve"], signal.SIGKILL)
        wait_until(lambda: phase_and_attempt(client, "echo") == ("Ready", 2), timeout=10)
        server = stack.component("python-0-server").child
        assert server is not None and server.pid != waiting["serve"]
    finally:
        prewarmed.close()


def test_a_prewarmed_process_that_died_is_replaced_by_a_fresh_one(tmp_path: Path) -> None:
    # daemon.spawn: a waiting process that is gone costs a fresh start, never a failed one.
    prewarmed = Prewarmed(["serve"])
    dead = prewarmed.pids()["serve"]
    os.kill(dead, signal.SIGKILL)
    wait_until(lambda: not pid_alive(dead), timeout=5)
    (tmp_path / "ws").mkdir()
    child = spawn(
        serve_args("python", f"unix:{tmp_path}/s.sock", tmp_path / "ws"), prewarmed=prewarmed
    )
    try:
        assert child.pid != dead and "listening on unix:" in child.announced
    finally:
        child.stop()


def test_closing_the_pool_or_losing_its_owner_ends_the_waiting_processes() -> None:
    # A pool not used leaves nothing behind: close() ends its processes, and so does the death
    # of the process that started them (end of their stdin).
    prewarmed = Prewarmed(["runtimed"])
    waiting = prewarmed.pids()["runtimed"]
    prewarmed.close()
    assert not pid_alive(waiting)
    owner = subprocess.Popen(
        [sys.executable, "-c", "from fnkernel.runtime_server.daemon import Prewarmed; "
         "p = Prewarmed(['gateway']); print(p.pids()['gateway'], flush=True); "
         "import signal; signal.pause()"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert owner.stdout is not None
    pid = int(owner.stdout.readline())
    owner.kill()
    owner.wait()
    wait_until(lambda: not pid_alive(pid), timeout=10)


def test_a_create_cut_off_by_a_gateway_crash_can_be_repeated(stack_factory: StackFactory) -> None:
    # The gateway dies while POST /v1/runs waits for the Run to be Ready: its client never learns
    # whether the Run was made. Repeating the same create answers with that Run, not a 409.
    stack = stack_factory({"python": 1})
    files = {"handler.py": "import time\ntime.sleep(2)\ndef handle(event):\n    return event\n"}
    spec = {"name": "cut", "runtime": "python", "handler": "handler.handle", "files": files}
    body = json.dumps(spec).encode()
    gateway = stack.component("gateway").child
    assert gateway is not None
    answers: list[object] = []
    first = threading.Thread(
        target=lambda: answers.append(_answer(stack.gateway_address, body)), daemon=True
    )
    first.start()
    store = SqliteRunStore(stack.state_dir / "runs.db")
    try:
        wait_until(lambda: any(run.name == "cut" for run in store.runs()), timeout=10)
        uid = store.get("cut").uid
    finally:
        store.close()
    os.kill(gateway.pid, signal.SIGKILL)
    first.join(30)
    assert answers and not isinstance(answers[0], tuple), answers  # the answer was lost
    wait_until(lambda: (child := stack.component("gateway").child) is not None
               and child.pid != gateway.pid, timeout=10)  # fmt: skip
    answered = wait_until(
        lambda: isinstance(a := _answer(stack.gateway_address, body), tuple) and a
    )
    status, _, reply = answered  # type: ignore[misc]
    run = json.loads(reply)
    assert status == 201 and (run["uid"], run["status"]["phase"]) == (uid, "Ready")
    assert run["status"]["attempt"] == 1
    assert len(list(stack.workspace_root.glob("*/*"))) == 1  # WORKSPACE/POD/RUN_UID


def _answer(address: str, body: bytes) -> tuple[int, object, bytes] | str:
    """POST /v1/runs: (status, headers, body), or the error that cut it off."""
    try:
        return http_call(address, "POST", "/v1/runs", body)
    except OSError as exc:
        return repr(exc)


KILLS_ITS_SERVER = {
    "handler.py": textwrap.dedent(
        """
        import os, signal

        def handle(event):
            if event.get("kill"):
                os.kill(os.getppid(), signal.SIGKILL)  # its Runtime Server
            return "alive"
        """
    )
}


def _ready_again(client: Client, name: str, attempt: int) -> Callable[[], bool]:
    return lambda: phase_and_attempt(client, name) == ("Ready", attempt)


def test_a_run_whose_calls_keep_killing_its_server_ends_failed_saying_so(
    stack_factory: StackFactory,
) -> None:
    # The pod's deaths are never charged to a Run, so without a bound this Run would take the pod
    # down on every call for ever. A bystander on the same pod is not blamed.
    stack = stack_factory({"python": 1})
    client = Client(stack.gateway_address)
    client.create_run("killer", runtime="python", handler="handler.handle", files=KILLS_ITS_SERVER)
    client.create_run("bystander", runtime="python", handler="handler.handle", files=ECHO)
    for attempt in (2, 3):
        status, _, _ = http_call(
            stack.gateway_address, "POST", "/v1/runs/killer:invoke", b'{"kill": 1}'
        )
        assert status == 503
        wait_until(_ready_again(client, "killer", attempt), timeout=20)
    status, _, body = http_call(
        stack.gateway_address, "POST", "/v1/runs/killer:invoke", b'{"kill": 1}'
    )
    assert status == 503
    # docs/protocol.md, "Errors": what a call cut off means for it, not only gRPC's words.
    assert json.loads(body)["message"].startswith(
        "the call was cut off: a process on its path went away while it was in flight, so it"
        " may have run ("
    )
    wait_until(lambda: client.status("killer")["status"]["phase"] == "Failed", timeout=20)
    message = client.status("killer")["status"]["message"]
    assert "in flight each of the last 3 times its Runtime Server died" in message
    # A death that found the bystander registered lost that registration too (one that found
    # it registering cost nothing): registered again each time, for free, and never Failed.
    # Ready as its Runtime Server says it (live), not only as the store last heard: the last
    # death may not have been seen yet when the store still says Ready.
    wait_until(lambda: _live_ready(client, "bystander"), timeout=20)
    assert 2 <= phase_and_attempt(client, "bystander")[1] <= 4
    assert client.invoke("bystander", {"n": 1}).value()["echo"] == {"n": 1}


def _live_ready(client: Client, name: str) -> bool:
    run = client.status(name)
    return run.phase == "Ready" and run.live is not None and run.live.state == "READY"


def test_a_call_that_succeeds_between_server_deaths_starts_the_count_again(
    stack_factory: StackFactory,
) -> None:
    stack = stack_factory({"python": 1})
    client = Client(stack.gateway_address)
    client.create_run(
        "sometimes", runtime="python", handler="handler.handle", files=KILLS_ITS_SERVER
    )
    for attempt in (2, 3, 4):
        http_call(stack.gateway_address, "POST", "/v1/runs/sometimes:invoke", b'{"kill": 1}')
        wait_until(_ready_again(client, "sometimes", attempt), timeout=20)
        assert client.invoke("sometimes", {}).value() == "alive"
    assert phase_and_attempt(client, "sometimes") == ("Ready", 4)
