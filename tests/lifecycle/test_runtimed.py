"""runtimed (docs/protocol.md, "Runs" and "Registration"): the digest it registers with, its poll,
the Runs' files, how registration failures are classified, restarts, deletes and lost
registrations (the proxy hop: test_runtimed_proxy.py). A real Runtime Server and a real runtimed
on Unix sockets, sharing a real SQLite Run store with the control plane."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import grpc
import pytest

from fnkernel.runtime_server import limits
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import (
    registrations_pb2,
    registrations_pb2_grpc,
)
from fnkernel.runtime_server.function_runtime.server import RuntimeServer
from fnkernel.runtime_server.lifecycle.controlplane import ControlPlane, RetryPolicy
from fnkernel.runtime_server.lifecycle.runs import Run, RunSpec, RunStatus, files_digest
from fnkernel.runtime_server.lifecycle.runtimed import Runtimed
from fnkernel.runtime_server.lifecycle.runtimed.failures import UNSUPPORTED
from fnkernel.runtime_server.lifecycle.runtimed.server import registration_request
from fnkernel.runtime_server.lifecycle.sqlite import SqliteRunStore
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS
from fnkernel.runtime_server.wire import (
    DELETED,
    DELETING,
    FAILED,
    PENDING,
    READY,
    RETRYING,
)
from tests.lifecycle.pods import CALLS, POD, Pod, pod_of, pod_runtimed
from tests.support import ECHO_PY, wait_until


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


@pytest.mark.parametrize("pod", CALLS, indirect=True)  # as either caller calls
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
    for pod in pod_of(tmp_path, oneshot_only=True):
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
    # README, "Runs, runtimed and the gateway": a Run becomes Deleted only once its Runtime Server no longer holds the
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


@pytest.mark.parametrize("pod", CALLS, indirect=True)  # as either caller calls
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
