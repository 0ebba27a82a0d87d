"""runtimed (docs/protocol.md, "Runs" and "Registration"): digest, registration, proxy hop, routing
fence, and how registration failures are classified. A real Runtime Server and a real runtimed on
Unix sockets, sharing a real SQLite Run store with the control plane."""

from __future__ import annotations

import json
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fnkernel.runtime_server import limits, tracing
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import (
    registrations_pb2,
    registrations_pb2_grpc,
)
from fnkernel.runtime_server.function_runtime.server import RuntimeServer
from fnkernel.runtime_server.lifecycle.controlplane import ControlPlane, RetryPolicy
from fnkernel.runtime_server.lifecycle.runs import Run, RunSpec, RunStatus, files_digest
from fnkernel.runtime_server.lifecycle.runtimed import UNSUPPORTED, Runtimed
from fnkernel.runtime_server.lifecycle.runtimed.packages import PackageCache
from fnkernel.runtime_server.lifecycle.runtimed.server import registration_request
from fnkernel.runtime_server.lifecycle.secrets import SecretFiles
from fnkernel.runtime_server.lifecycle.sqlite import SqliteRunStore
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS, CancellableCalls
from fnkernel.runtime_server.wire import (
    ATTEMPT_KEY,
    DELETED,
    DELETING,
    ERROR_TYPE_KEY,
    FAILED,
    LOGS_KEY,
    PENDING,
    POD_KEY,
    READY,
    RETRYING,
    SPANS_KEY,
    TIMELINE_KEY,
    TIMELINE_RUNTIMED_KEY,
    TIMELINE_SERVER_KEY,
    parse_timeline_stamps,
)
from tests.support import ECHO_PY, wait_until

POD = "python-0"


@dataclass
class Pod:
    store: SqliteRunStore
    control_plane: ControlPlane
    runtimed: Runtimed
    proxy: pb_grpc.FunctionRuntimeStub
    server: pb_grpc.FunctionRuntimeStub

    def create(self, name: str, files: dict[str, str], handler: str = "handler.handle") -> Run:
        files = {path: textwrap.dedent(text) for path, text in files.items()}
        self.control_plane.create_run(name=name, runtime="python", handler=handler, files=files)
        return self.control_plane.wait_settled(name, timeout=20)

    def invoke(self, run: Run, payload: bytes = b"{}", *, registration_id: str = "", pod=POD):  # type: ignore[no-untyped-def]
        return self.proxy.InvokeFunction(
            pb.InvokeFunctionRequest(
                registration=pb.FunctionRegistration(
                    run_uid=run.uid, registration_id=registration_id
                ),
                input=payload,
                content_type="application/json",
            ),
            metadata=((POD_KEY, pod),),
            timeout=20,
        )


def pod_runtimed(store: SqliteRunStore, server_address: str, workspace: Path) -> Runtimed:
    """The runtimed of pod POD, writing its Runs' files in WORKSPACE/POD (not started)."""
    return Runtimed(
        store,
        pod=POD,
        runtime="python",
        server_address=server_address,
        workspace=workspace / POD,
        packages=PackageCache(workspace.parent / "packages"),
        secrets=SecretFiles(workspace.parent / "secrets"),
        poll_interval=0.2,
    )


def _pod(tmp_path: Path, *, oneshot_only: bool = False) -> Iterator[Pod]:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    server = RuntimeServer("python", workspace, oneshot_only=oneshot_only)
    server_address = server.start(f"unix:{tmp_path}/server.sock")
    store = SqliteRunStore(tmp_path / "runs.db")
    runtimed = pod_runtimed(store, server_address, workspace)
    address = runtimed.start(f"unix:{tmp_path}/runtimed.sock")
    channels = [
        grpc.insecure_channel(a, options=CHANNEL_OPTIONS) for a in (address, server_address)
    ]
    try:
        yield Pod(
            store,
            ControlPlane(store),
            runtimed,
            pb_grpc.FunctionRuntimeStub(channels[0]),
            pb_grpc.FunctionRuntimeStub(channels[1]),
        )
    finally:
        for channel in channels:
            channel.close()
        runtimed.stop(0)
        server.stop(0)


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[Pod]:
    yield from _pod(tmp_path)


def restart_runtimed(pod: Pod) -> tuple[Runtimed, str]:
    """Stop the pod's runtimed (again, if it is already) and start a new one, which knows none
    of its predecessor's registration IDs; the caller stops it."""
    pod.runtimed.stop(0)
    successor = Runtimed(
        pod.store,
        pod=POD,
        runtime="python",
        server_address=pod.runtimed.server_address,
        workspace=pod.runtimed.workspace,
        packages=pod.runtimed.packages,
        secrets=pod.runtimed.secrets,
        poll_interval=0.2,
    )
    return successor, successor.start("unix:" + pod.runtimed.address[5:] + "2")


def test_runtimed_registers_each_run_with_its_specs_digest(pod: Pod) -> None:
    # docs/protocol.md: the registration_digest is the SHA-256 of the canonical registration
    # inputs (RunSpec.digest), never the working directory's path: two Runs of one spec, each in
    # a working dir of its own, register with one digest; another handler, another digest.
    files = {"handler.py": "def handle(e):\n    return e\n\ndef other(e):\n    return 1\n"}
    first, second = pod.create("first", files), pod.create("second", files)
    third = pod.create("third", files, handler="handler.other")
    assert {first.status.phase, second.status.phase, third.status.phase} == {READY}
    for run in (first, second, third):
        active = pod.runtimed.active(run)
        assert active is not None and active.digest == run.spec.digest()
        # The server holds that digest: the same attempt and digest is the registration it has
        # (idempotent), the same attempt with another digest is refused.
        request = registration_request(run, pod.runtimed.working_dir(run.uid))
        again = pod.server.RegisterFunction(request, timeout=20)
        assert again.registration.registration_id == active.registration_id
        request.registration_digest = limits.sha256_digest(b"another spec")
        with pytest.raises(grpc.RpcError) as caught:
            pod.server.RegisterFunction(request, timeout=20)
        assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert pod.runtimed.working_dir(first.uid) != pod.runtimed.working_dir(second.uid)
    assert first.spec.digest() == second.spec.digest() != third.spec.digest()


def test_proxy_hop_fills_in_the_active_registration_id(pod: Pod) -> None:
    # docs/protocol.md, "Runs": InvokeFunction with an empty registration_id is resolved to the
    # private active one.
    run = pod.create("echo", ECHO_PY)
    assert (run.status.phase, run.status.attempt) == (READY, 1)
    response = pod.invoke(run, b'{"x": 1}')
    assert b'"echo":{"x":1}' in response.output
    assert response.registration.run_uid == run.uid
    assert response.registration.registration_id.startswith("reg_")
    status = pod.proxy.FunctionStatus(
        pb.FunctionStatusRequest(registration=pb.FunctionRegistration(run_uid=run.uid)),
        metadata=((POD_KEY, POD),),
        timeout=5,
    )
    assert status.registration.registration_id == response.registration.registration_id


@pytest.mark.slow  # it waits seconds on purpose (tests/conftest.py)
def test_a_run_is_not_polled_while_its_calls_succeed_and_polled_again_after(pod: Pod) -> None:
    # docs/architecture.md, "The proxy hop": a proxied call that succeeded shows what a
    # FunctionStatus poll would (READY, and active within the interval), so runtimed polls a Run
    # only in an interval without one; the cadence stays bounded (poll_interval 0.2 s here).
    run = pod.create("busy", ECHO_PY)
    polls: list[str] = []
    statuses = pod.runtimed.server.registrations.FunctionStatuses

    def counted(
        request: registrations_pb2.FunctionStatusesRequest, **kwargs: object
    ) -> registrations_pb2.FunctionStatusesResponse:
        polls.extend(one.registration.run_uid for one in request.requests)
        return statuses(request, **kwargs)

    pod.runtimed.server.registrations.FunctionStatuses = counted  # type: ignore[method-assign]
    calling = time.monotonic() + 1.5  # seven poll intervals
    for _ in range(10_000):  # bounded in count as well as time
        pod.invoke(run)
        if time.monotonic() > calling:
            break
    assert len(polls) <= 1  # at most a pass that came before the first call ended
    polled = len(polls)
    wait_until(lambda: len(polls) >= polled + 2, timeout=10)  # no calls: polled again


def test_the_poll_asks_every_runs_status_in_one_round_trip(pod: Pod) -> None:
    # docs/architecture.md, "Idle": a FunctionStatus round trip a Run and a second cost an idle
    # pod CPU in proportion to its Runs; the poll asks them all at once.
    runs = {pod.create(f"quiet-{n}", ECHO_PY).uid for n in range(3)}
    rounds: list[set[str]] = []
    statuses = pod.runtimed.server.registrations.FunctionStatuses

    def counted(
        request: registrations_pb2.FunctionStatusesRequest, **kwargs: object
    ) -> registrations_pb2.FunctionStatusesResponse:
        rounds.append({one.registration.run_uid for one in request.requests})
        return statuses(request, **kwargs)

    pod.runtimed.server.registrations.FunctionStatuses = counted  # type: ignore[method-assign]
    wait_until(lambda: any(asked == runs for asked in rounds), timeout=10)


def test_a_poll_the_server_answered_stands_in_for_its_health_check(pod: Pod) -> None:
    # docs/architecture.md, "Idle": each round trip to the server costs both processes CPU
    # and wake-ups; while the poll is answered, the heartbeat does not ask again.
    pod.create("watched", ECHO_PY)
    checks: list[float] = []
    polls: list[float] = []
    check = pod.runtimed.heart._health.Check
    statuses = pod.runtimed.server.registrations.FunctionStatuses

    def counted_check(*args: object, **kwargs: object) -> object:
        checks.append(time.monotonic())
        return check(*args, **kwargs)

    def counted_poll(*args: object, **kwargs: object) -> object:
        polls.append(time.monotonic())
        return statuses(*args, **kwargs)

    pod.runtimed.heart._health.Check = counted_check  # type: ignore[method-assign]
    pod.runtimed.server.registrations.FunctionStatuses = counted_poll  # type: ignore[method-assign]
    wait_until(lambda: len(polls) >= 6, timeout=10)  # six poll intervals (0.2 s here)
    assert len(checks) <= 1, checks  # at most one before the first poll was answered
    expires = pod.store.pods()[0].expires
    wait_until(lambda: pod.store.pods()[0].expires > expires)  # the heartbeat still written
    assert pod.store.pods()[0].healthy


def test_a_server_without_fnkernels_registrations_is_polled_a_run_at_a_time(pod: Pod) -> None:
    # docs/protocol.md, "Registration": a Runtime Server that serves the seed's FunctionRuntime
    # alone answers Registrations UNIMPLEMENTED, and runtimed polls it with FunctionStatus.
    # runtimed's own socket is such a server: it does not serve Registrations.
    run = pod.create("plain", ECHO_PY).uid
    channel = grpc.insecure_channel(pod.runtimed.address, options=CHANNEL_OPTIONS)
    pod.runtimed.server.registrations = registrations_pb2_grpc.RegistrationsStub(channel)
    polls: list[str] = []
    status = pod.runtimed.server_stub.FunctionStatus

    def counted(request: pb.FunctionStatusRequest, **kwargs: object) -> pb.FunctionStatusResponse:
        polls.append(request.registration.run_uid)
        return status(request, **kwargs)

    pod.runtimed.server_stub.FunctionStatus = counted  # type: ignore[method-assign]
    try:
        wait_until(lambda: polls.count(run) >= 2, timeout=10)
    finally:
        channel.close()


def test_a_quiet_store_is_read_once_a_poll_interval_not_every_tick(pod: Pod) -> None:
    # docs/architecture.md, "The first registration": runtimed reconciles within a wake-up of a
    # write to the store, and otherwise once a poll interval (0.2 s here), not every tick
    # (0.05 s): each pass reads every Run of the pod.
    pod.create("quiet", ECHO_PY)
    passes: list[float] = []
    reconcile = pod.runtimed.reconcile

    def counted() -> None:
        passes.append(time.monotonic())
        reconcile()

    pod.runtimed.reconcile = counted  # type: ignore[method-assign]
    wait_until(lambda: len(passes) >= 4, timeout=10)
    # Three intervals between four passes: >= 0.6 s at one a poll interval, 0.15 s at one a tick.
    assert passes[-1] - passes[0] >= 0.5


def test_the_proxy_hop_passes_the_callers_deadline_on_or_the_30_s_default(pod: Pod) -> None:
    # docs/protocol.md, "Runs": runtimed bounds timeout_millis by its caller's deadline; a caller
    # without one gets the default of docs/protocol.md, "Limits" (30 s), never unbounded work.
    run = pod.create(
        "deadline",
        {"handler.py": "def handle(event, context):\n    return context.remaining_millis()\n"},
    )
    request = pb.InvokeFunctionRequest(
        registration=pb.FunctionRegistration(run_uid=run.uid), content_type="application/json"
    )
    routed = ((POD_KEY, POD),)
    assert 0 < int(pod.proxy.InvokeFunction(request, metadata=routed, timeout=2).output) <= 2100
    unbounded = int(pod.proxy.InvokeFunction(request, metadata=routed).output)  # no deadline
    assert 25_000 < unbounded <= 30_000


def test_a_registration_id_from_outside_is_invalid_argument(pod: Pod) -> None:
    run = pod.create("echo", ECHO_PY)
    active = pod.invoke(run).registration.registration_id
    with pytest.raises(grpc.RpcError) as caught:
        pod.invoke(run, registration_id=active)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "registration_id" in caught.value.details()


@pytest.mark.parametrize("method", ["RegisterFunction", "UnregisterFunction"])
def test_register_and_unregister_from_outside_are_permission_denied(pod: Pod, method: str) -> None:
    request = (
        pb.RegisterFunctionRequest(run_uid="r", registration_attempt=1)
        if method == "RegisterFunction"
        else pb.UnregisterFunctionRequest(registration=pb.FunctionRegistration(run_uid="r"))
    )
    with pytest.raises(grpc.RpcError) as caught:
        getattr(pod.proxy, method)(request, timeout=5)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_routing_fence_rejects_a_call_routed_for_another_pod(pod: Pod) -> None:
    run = pod.create("echo", ECHO_PY)
    with pytest.raises(grpc.RpcError) as caught:
        pod.invoke(run, pod="python-7")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "python-7" in caught.value.details()


def test_routing_fence_rejects_a_run_assigned_elsewhere(pod: Pod) -> None:
    # docs/protocol.md, "Runs": a Run assigned elsewhere gets FAILED_PRECONDITION, even when routed
    # "here".
    run = pod.create("echo", ECHO_PY)
    moved = pod.store.update(run, assigned_pod="python-1")
    assert moved is not None
    with pytest.raises(grpc.RpcError) as caught:
        pod.invoke(moved)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "assigned to pod python-1" in caught.value.details()


def test_runtimed_writes_each_runs_files_in_its_own_workspace(pod: Pod) -> None:
    # docs/architecture.md, "Seams": the pod learns a Run's files from the store alone and
    # writes them where its server loads them; once the Run is assigned elsewhere they go.
    files = {"handler.py": ECHO_PY["handler.py"], "lib/data.txt": "x\n"}
    run = pod.create("echo", files)
    assert run.status.phase == READY
    working_dir = pod.runtimed.working_dir(run.uid)
    assert working_dir.parent == pod.runtimed.workspace
    written = {
        path.relative_to(working_dir).as_posix(): path.read_text()
        for path in working_dir.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert written == {name: textwrap.dedent(text) for name, text in files.items()}
    assert [p.name for p in pod.runtimed.workspace.iterdir()] == [run.uid]  # no staging left
    assert pod.store.update(run, assigned_pod="python-1") is not None
    wait_until(lambda: not working_dir.exists(), timeout=10)


def test_files_that_cannot_be_written_fail_the_attempt_charged(pod: Pod) -> None:
    # The pod's disk, not the handler: the retry engine tries again (docs/architecture.md,
    # "Retries"), and the message says what could not be written.
    workspace = pod.runtimed.workspace
    if workspace.exists():
        workspace.rmdir()
    workspace.write_text("a file where the workspace should be\n")  # root ignores modes
    try:
        pod.control_plane.create_run(
            name="echo", runtime="python", handler="handler.handle", files=ECHO_PY
        )
        wait_until(lambda: pod.store.get("echo").status.phase == RETRYING, timeout=10)
        run = pod.store.get("echo")
        assert run.status.message.startswith("cannot write the run's files: ")
        assert run.status.uncharged_attempts == 0
    finally:
        workspace.unlink()


def test_unknown_run_uid_is_not_found(pod: Pod) -> None:
    ghost = Run(
        uid="no-such-run", name="ghost", spec=RunSpec("python", "h.f", files_digest({})),
        status=RunStatus(phase=READY, attempt=1),
    )  # fmt: skip
    with pytest.raises(grpc.RpcError) as caught:
        pod.invoke(ghost)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_syntax_error_fails_the_run_without_retry(pod: Pod) -> None:
    # Issue 3: user-code init failures → Failed with the fatal_error as message, no retry.
    run = pod.create("broken", {"handler.py": "def handle(event:\n    return 1\n"})
    assert run.status.phase == FAILED
    assert run.status.attempt == 1
    assert run.status.message.startswith("UserCodeSyntaxError:")
    assert "handler.py" in run.status.message and "line 1" in run.status.message
    assert len(run.status.message.encode()) <= 1024


def test_missing_function_fails_the_run_with_its_name(pod: Pod) -> None:
    run = pod.create("nofn", {"handler.py": "def other(event):\n    return 1\n"})
    assert (run.status.phase, run.status.attempt) == (FAILED, 1)
    assert "HandlerNotFound" in run.status.message and "handle" in run.status.message


def test_unimplemented_is_permanent_and_never_falls_back(tmp_path: Path) -> None:
    # docs/protocol.md: UNIMPLEMENTED from a pod without FunctionRuntime is a permanent failure.
    for pod in _pod(tmp_path, oneshot_only=True):
        run = pod.create("echo", ECHO_PY)
        assert (run.status.phase, run.status.attempt, run.status.message) == (
            FAILED,
            1,
            UNSUPPORTED,
        )


def test_restarted_runtimed_keeps_the_attempt_and_registration(pod: Pod) -> None:
    # docs/protocol.md: repeating RegisterFunction for the same attempt is idempotent and does not
    # change Run status: a new runtimed resumes the registration its predecessor made.
    run = pod.create("echo", ECHO_PY)
    before = pod.invoke(run).registration.registration_id
    # The handler may write into its working dir; the digest was fixed at first registration.
    (pod.runtimed.working_dir(run.uid) / "cache.json").write_text("{}")
    successor, address = restart_runtimed(pod)
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        pod.proxy = pb_grpc.FunctionRuntimeStub(channel)
        after = pod.invoke(run).registration.registration_id
        assert after == before
        current = pod.store.get("echo")
        assert (current.status.phase, current.status.attempt) == (READY, 1)
    finally:
        channel.close()
        successor.stop(0)


def test_runtimed_unregisters_a_run_deleted_from_the_store(pod: Pod) -> None:
    run = pod.create("echo", ECHO_PY)
    registration = pod.invoke(run).registration
    pod.control_plane.delete_run("echo")
    # Its files go once the Run is gone from the store (runtimed's next pass).
    wait_until(lambda: not pod.runtimed.working_dir(run.uid).exists(), timeout=10)

    def gone() -> bool:
        try:
            pod.server.FunctionStatus(
                pb.FunctionStatusRequest(registration=registration), timeout=5
            )
        except grpc.RpcError as err:
            return err.code() == grpc.StatusCode.NOT_FOUND
        return False

    wait_until(gone)


def test_worker_killed_by_a_signal_is_retried_then_bounded(pod: Pod) -> None:
    # Issue 3: a worker killed by a signal is an infrastructure failure → retry with attempt + 1,
    # bounded by the policy (max attempts 3); then Failed, saying why.
    pod.control_plane.policy = RetryPolicy(max_attempts=3, base_backoff=0.05, max_backoff=0.1)
    pod.control_plane.start()
    try:
        files = {"handler.py": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"}
        pod.control_plane.create_run(
            name="doomed", runtime="python", handler="handler.handle", files=files
        )
        wait_until(lambda: pod.store.get("doomed").status.phase == FAILED, timeout=20)
    finally:
        pod.control_plane.stop()
    run = pod.store.get("doomed")
    assert run.status.attempt == 3
    assert run.status.message.startswith("gave up after 3 registration attempts: WorkerKilled:")
    assert "SIGKILL" in run.status.message


def test_a_delete_converges_even_after_runtimed_forgot_the_registration(pod: Pod) -> None:
    # README, "Runs": a Run becomes Deleted only once its Runtime Server no longer holds the
    # registration. A restarted runtimed knows no registration ID: it must find the one the
    # server holds (the same attempt and digest return it) and unregister it.
    run = pod.create("echo", ECHO_PY)
    registration = pod.invoke(run).registration
    pod.runtimed.stop(0)
    current = pod.store.get("echo")
    assert pod.store.update(current, phase=DELETING, message="delete requested")
    successor, _ = restart_runtimed(pod)
    try:
        wait_until(lambda: pod.store.get("echo").status.phase == DELETED, timeout=10)
        with pytest.raises(grpc.RpcError) as caught:
            pod.server.FunctionStatus(
                pb.FunctionStatusRequest(registration=registration), timeout=5
            )
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        successor.stop(0)


def test_a_registration_the_server_lost_is_503_and_registered_again_free_of_charge(
    pod: Pod,
) -> None:
    # The server lost the registration (it restarted): the Run exists, so the proxy answers
    # UNAVAILABLE (503 at the gateway), never NOT_FOUND, and the retry is not charged.
    run = pod.create("echo", ECHO_PY)
    registration = pod.invoke(run).registration
    pod.server.UnregisterFunction(
        pb.UnregisterFunctionRequest(registration=registration), timeout=5
    )
    with pytest.raises(grpc.RpcError) as caught:
        pod.invoke(run)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
    pod.control_plane.start()
    try:
        wait_until(lambda: pod.store.get("echo").status.phase == READY, timeout=10)
    finally:
        pod.control_plane.stop()
    again = pod.store.get("echo")
    assert (again.status.attempt, again.status.uncharged_attempts, again.charged_attempts) == (
        2,
        1,
        1,
    )
    assert b'"echo"' in pod.invoke(again).output


@pytest.mark.slow  # it waits seconds on purpose (tests/conftest.py)
def test_a_register_the_server_does_not_answer_repeats_the_same_attempt_until_it_does(
    tmp_path: Path,
) -> None:
    # docs/architecture.md, "Retries": no answer (the server is down or paused) says nothing was
    # registered, so nothing is superseded: the Run stays Pending at attempt 1, and the same
    # attempt registers once the server answers.
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    store = SqliteRunStore(tmp_path / "runs.db")
    listen = f"unix:{tmp_path}/server.sock"
    first = RuntimeServer("python", workspace)
    first.start(listen)
    runtimed = pod_runtimed(store, listen, workspace)
    runtimed.start(f"unix:{tmp_path}/runtimed.sock")
    first.stop(0)  # answered once, gone now: for a while the pod may be paused, not dead
    server = RuntimeServer("python", workspace)
    try:
        plane = ControlPlane(store)
        files = {path: textwrap.dedent(text) for path, text in ECHO_PY.items()}
        plane.create_run(name="echo", runtime="python", handler="handler.handle", files=files)
        # For 3 s, pass after pass tries RegisterFunction (three times each) and finds no server.
        run = plane.wait_settled("echo", timeout=3)
        assert (run.status.phase, run.status.attempt, run.status.uncharged_attempts) == (
            PENDING,
            1,
            0,
        )
        server.start(listen)
        run = plane.wait_settled("echo", timeout=20)
        assert (run.status.phase, run.status.attempt) == (READY, 1)
    finally:
        runtimed.stop(0)
        server.stop(0)


def test_the_proxy_hop_relays_a_handler_error_with_its_trailers(pod: Pod) -> None:
    # docs/protocol.md, "Proxy hop": runtimed passes the Runtime Server's status on unchanged,
    # UNKNOWN with the fn-error-type and fn-logs-bin trailers of a handler error included.
    failing = {
        "handler.py": "def handle(event):\n    print('before')\n    raise ValueError('no')\n"
    }
    run = pod.create("failing", failing)
    with pytest.raises(grpc.RpcError) as caught:
        pod.invoke(run)
    assert caught.value.code() == grpc.StatusCode.UNKNOWN
    assert (caught.value.details() or "").startswith("handler error: ValueError: no")
    trailers = dict(caught.value.trailing_metadata())  # type: ignore[attr-defined]
    assert trailers[ERROR_TYPE_KEY] == "ValueError"
    logs = json.loads(trailers[LOGS_KEY])
    assert {"stream": "stdout", "text": "before"} in logs


def test_the_proxy_hop_relays_a_calls_deadline_with_what_the_handler_wrote(pod: Pod) -> None:
    # docs/protocol.md, "Proxy hop": the server's status passes on unchanged — here
    # DEADLINE_EXCEEDED ("Errors": with what the handler wrote until then in fn-logs-bin),
    # never turned into another code by the hop.
    slow = {
        "handler.py": "import time\ndef handle(event):\n    print('started')\n    time.sleep(60)\n"
    }
    run = pod.create("slow", slow)
    request = pb.InvokeFunctionRequest(
        registration=pb.FunctionRegistration(run_uid=run.uid), input=b"{}", timeout_millis=300
    )
    with pytest.raises(grpc.RpcError) as caught:
        pod.proxy.InvokeFunction(request, metadata=((POD_KEY, POD),), timeout=30)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    trailers = dict(caught.value.trailing_metadata())  # type: ignore[attr-defined]
    assert {"stream": "stdout", "text": "started"} in json.loads(trailers[LOGS_KEY])
    # the message is the server's own, as the server gives it to a caller of its own
    active = pod.runtimed.active(run)
    assert active is not None
    request.registration.registration_id = active.registration_id
    with pytest.raises(grpc.RpcError) as direct:
        pod.server.InvokeFunction(request, timeout=30)
    assert direct.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert caught.value.details() == direct.value.details()


def test_the_proxy_hop_answers_each_hops_clock_readings_when_asked(pod: Pod) -> None:
    # docs/protocol.md, "Timeline": with x-fn-timeline: 1, runtimed answers fn-timeline-runtimed
    # (received, called, answered) beside the server's fn-timeline-server (received, answered),
    # monotonic readings in the order the call went; a call that does not ask gets neither.
    run = pod.create("echo", ECHO_PY)
    request = pb.InvokeFunctionRequest(
        registration=pb.FunctionRegistration(run_uid=run.uid), input=b"{}"
    )
    before = time.monotonic_ns()
    _, call = pod.proxy.InvokeFunction.with_call(
        request, metadata=((POD_KEY, POD), (TIMELINE_KEY, "1")), timeout=20
    )
    after = time.monotonic_ns()
    trailers = dict(call.trailing_metadata())
    runtimed = parse_timeline_stamps(trailers[TIMELINE_RUNTIMED_KEY])
    server = parse_timeline_stamps(trailers[TIMELINE_SERVER_KEY])
    assert list(runtimed) == ["received", "called", "answered"]
    assert list(server) == ["received", "answered"]
    readings = [
        before,
        runtimed["received"],
        runtimed["called"],
        server["received"],
        server["answered"],
        runtimed["answered"],
        after,
    ]
    assert readings == sorted(readings)
    _, plain = pod.proxy.InvokeFunction.with_call(request, metadata=((POD_KEY, POD),), timeout=20)
    names = {name for name, _ in plain.trailing_metadata()}
    assert not names & {TIMELINE_RUNTIMED_KEY, TIMELINE_SERVER_KEY, SPANS_KEY}
    assert ATTEMPT_KEY in names
    # "Tracing" too: a traced call asking for the timeline gets both, beside the hop's own
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    asked = ((POD_KEY, POD), (TIMELINE_KEY, "1"), ("traceparent", traceparent))
    _, traced = pod.proxy.InvokeFunction.with_call(request, metadata=asked, timeout=20)
    names = {name for name, _ in traced.trailing_metadata()}
    assert {TIMELINE_RUNTIMED_KEY, TIMELINE_SERVER_KEY, SPANS_KEY, ATTEMPT_KEY} <= names


def test_an_in_memory_exporter_gets_a_registrations_and_a_calls_spans_parented_along_the_path(
    pod: Pod,
) -> None:
    """docs/protocol.md, "Tracing": with OpenTelemetry's in-memory exporter given to the
    components (tracing.exporting_to), a registration's spans — runtimed's, a span per step, the
    Runtime Server's RegisterFunction and the worker's load — and a call's — runtimed's server
    and client spans, the Runtime Server's, the worker's — reach it, each the child of the span
    that asked for it, the call's in the caller's trace, with OpenTelemetry's attributes."""
    exporter = InMemorySpanExporter()
    with tracing.exporting_to(SimpleSpanProcessor(exporter)):
        run = pod.create("echo", ECHO_PY)
        trace_id, caller = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        request = pb.InvokeFunctionRequest(
            registration=pb.FunctionRegistration(run_uid=run.uid), input=b"{}"
        )
        answer = pod.proxy.InvokeFunction(
            request,
            metadata=((POD_KEY, POD), ("traceparent", f"00-{trace_id}-{caller}-01")),
            timeout=20,
        )
    spans = {span.context.span_id: span for span in exporter.get_finished_spans()}

    def path_to(span: ReadableSpan) -> list[tuple[str, str, str]]:
        """(service, kind, name) of `span` and each of its parents in this process, root first."""
        path = []
        while span is not None:
            service = str(span.resource.attributes["service.name"])
            path.insert(0, (service, span.kind.name, span.name))
            span = spans.get(span.parent.span_id) if span.parent else None  # type: ignore[assignment]
        return path

    (load,) = [span for span in spans.values() if span.name == "load handler.handle"]
    assert path_to(load) == [
        ("fnkernel-runtimed", "INTERNAL", "register echo attempt 1"),
        ("fnkernel-runtimed", "CLIENT", "executor.v1.FunctionRuntime/RegisterFunction"),
        ("fnkernel-runtime-server", "SERVER", "executor.v1.FunctionRuntime/RegisterFunction"),
        ("fnkernel-worker", "SERVER", "load handler.handle"),
    ]
    (register,) = [span for span in spans.values() if span.name == "register echo attempt 1"]
    steps = [
        span.name
        for span in spans.values()
        if span.parent and span.parent.span_id == register.context.span_id
    ]
    assert "write the Run's files" in steps and "write the Run's status: Ready" in steps
    (handled,) = [span for span in spans.values() if span.name == "handler.handle"]
    assert path_to(handled) == [
        ("fnkernel-runtimed", "SERVER", "executor.v1.FunctionRuntime/InvokeFunction"),
        ("fnkernel-runtimed", "CLIENT", "executor.v1.FunctionRuntime/InvokeFunction"),
        ("fnkernel-runtime-server", "SERVER", "executor.v1.FunctionRuntime/InvokeFunction"),
        ("fnkernel-worker", "SERVER", "handler.handle"),
    ]
    # the worker's span on OpenTelemetry's FaaS conventions (docs/protocol.md, "Tracing")
    assert handled.attributes is not None
    assert handled.attributes["faas.trigger"] == "other"
    assert handled.attributes["faas.invocation_id"] == answer.invocation_id
    assert handled.attributes["fnkernel.runtime"] == "python"
    root = spans[handled.parent.span_id]  # type: ignore[union-attr]
    while root.parent and root.parent.span_id in spans:
        root = spans[root.parent.span_id]
    assert root.parent is not None and f"{root.parent.span_id:016x}" == caller
    assert f"{handled.context.trace_id:032x}" == trace_id
    server = spans[handled.parent.span_id]  # type: ignore[union-attr]
    assert server.attributes is not None and root.attributes is not None
    assert server.attributes["rpc.system"] == "grpc"
    assert server.attributes["rpc.grpc.status_code"] == 0
    assert server.attributes["fnkernel.fence"] == "passed"
    assert (
        root.attributes["fnkernel.registration_id"] == server.attributes["fnkernel.registration_id"]
    )
    assert root.attributes["fnkernel.registration_attempt"] == 1
    assert not tracing.exporting()  # the block over, nothing more is recorded


def test_a_traced_call_the_routing_fence_refuses_shows_the_refusal_at_runtimed(pod: Pod) -> None:
    """docs/protocol.md, "Tracing": a traced call routed to another pod is refused at runtimed's
    routing fence; the spans it hands back say so there, and nothing was called beyond it."""
    run = pod.create("echo", ECHO_PY)
    request = pb.InvokeFunctionRequest(registration=pb.FunctionRegistration(run_uid=run.uid))
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with pytest.raises(grpc.RpcError) as caught:
        pod.proxy.InvokeFunction(
            request, metadata=((POD_KEY, "python-9"), ("traceparent", traceparent)), timeout=20
        )
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    spans = tracing.decode(dict(caught.value.trailing_metadata())[SPANS_KEY])
    assert [(span["service"], span["kind"]) for span in spans] == [("fnkernel-runtimed", "SERVER")]
    (refused,) = spans
    assert refused["attributes"]["fnkernel.fence"] == "refused: RoutedElsewhere"
    assert refused["attributes"]["rpc.grpc.status_code"] == 9  # FAILED_PRECONDITION
    assert refused["status"].startswith("FAILED_PRECONDITION: this is pod python-0, not python-9")


def test_a_5_mib_payload_crosses_the_proxy_hop_both_ways(pod: Pod) -> None:
    # docs/protocol.md, "Limits": payloads up to 6 MiB on every hop — above grpc's default
    # 4 MiB, so each channel runtimed calls the server on must carry our message limits.
    run = pod.create("echo", ECHO_PY)
    text = "x" * (5 * 1024 * 1024)
    response = pod.invoke(run, json.dumps(text).encode())
    assert json.loads(response.output)["echo"] == text


def test_calls_beyond_the_idle_pool_close_their_channel_and_still_answer(tmp_path: Path) -> None:
    # docs/architecture.md, "The proxy hop": each proxied call takes a channel of its own from a
    # pool, which keeps a bounded number idle; a channel there is no room for is closed once its
    # call has answered. One call more than the pool keeps is in flight at once here.
    count = CancellableCalls._MAX_IDLE + 1
    held = threading.Semaphore(0)
    release = threading.Event()

    def hold(request: bytes, context: grpc.ServicerContext) -> bytes:
        held.release()
        release.wait(30)
        return request

    calls = CancellableCalls(f"unix:{tmp_path}/upstream.sock", lambda c: c.unary_unary("/t.T/Hold"))

    def relay(request: bytes, context: grpc.ServicerContext) -> bytes:
        answer: bytes = calls.call(lambda stub: stub(request, timeout=30), context)
        return answer

    servers = []
    for name, behaviour in (("upstream", hold), ("front", relay)):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=count + 8))
        handler = grpc.unary_unary_rpc_method_handler(behaviour)
        method = "Hold" if name == "upstream" else "Relay"
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("t.T", {method: handler}),)
        )
        server.add_insecure_port(f"unix:{tmp_path}/{name}.sock")
        server.start()
        servers.append(server)
    channel = grpc.insecure_channel(f"unix:{tmp_path}/front.sock")
    front = channel.unary_unary("/t.T/Relay")
    try:
        with futures.ThreadPoolExecutor(count) as clients:
            answers = [clients.submit(front, b"%d" % i, timeout=30) for i in range(count)]
            for _ in range(count):  # all in flight together, so each took a channel of its own
                assert held.acquire(timeout=30)
            release.set()
            assert [answer.result() for answer in answers] == [b"%d" % i for i in range(count)]
        assert front(b"after", timeout=30) == b"after"  # the pool serves the next call
    finally:
        release.set()
        channel.close()
        for server in servers:
            server.stop(0)
        calls.close()
