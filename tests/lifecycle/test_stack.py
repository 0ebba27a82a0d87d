"""The function lifecycle across real processes (docs/protocol.md, "Runs"): a Runtime Server killed under a READY
Run, scale to zero and cold start, restarts that lose nothing, `fnkernel up`, and the client CLI."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
import time
from collections.abc import Callable

import grpc
import pytest

from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.lifecycle.runs import POD_GRACE_SECONDS
from fnkernel.runtime_server.lifecycle.sqlite import STORE_FILE, SqliteRunStore
from fnkernel.runtime_server.lifecycle.stack import Stack
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS
from tests.lifecycle.stack_calls import ECHO, StackFactory, phase_and_attempt
from tests.support import SLOW_PY, http_call, wait_until


def server_stub(
    stack: Stack, pod: str = "python-0"
) -> tuple[grpc.Channel, pb_grpc.FunctionRuntimeStub]:
    child = stack.component(f"{pod}-server").child
    assert child is not None
    channel = grpc.insecure_channel(child.address, options=CHANNEL_OPTIONS)
    return channel, pb_grpc.FunctionRuntimeStub(channel)


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
    # README, "Runs, runtimed and the gateway": an attempt that fails because the pod is down is not charged to the Run's
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
    # docs/protocol.md, "HTTP API": DELETE drains the call in flight (at most drainTimeoutMs, 0 to
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
