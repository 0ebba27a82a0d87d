"""docs/protocol.md, "Registration": one test per row of the registration state machine, against a real server."""

from __future__ import annotations

import json
import threading
import time
from functools import partial
from pathlib import Path

import grpc
import pytest

from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import (
    registrations_pb2,
    registrations_pb2_grpc,
)
from tests.function_runtime.registrations import FAILED, FINISHES_LATE, READY, SLOW
from tests.function_runtime.statuses import code_of, refused
from tests.support import ECHO_PY, Client, pid_alive, wait_until

FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
DRAINING = pb.FUNCTION_REGISTRATION_STATE_DRAINING

COUNTING = {
    # Appends a line each time the module is imported: proves "no re-initialisation".
    "handler.py": """
        from pathlib import Path
        with Path("imports.log").open("a") as log:
            log.write("imported\\n")

        def handle(event):
            return event
    """
}


def test_new_run_uid_registers_ready_with_new_opaque_id(python_any: Client) -> None:
    # docs/protocol.md, "Registration" row 1: new run_uid → READY, new opaque registration_id (reg_
    # + 26 chars).
    first = python_any.register(ECHO_PY)
    second = python_any.register(ECHO_PY)
    assert first.state == READY
    assert first.registration.registration_id.startswith("reg_")
    assert len(first.registration.registration_id) == len("reg_") + 26
    assert first.registration.registration_id != second.registration.registration_id


def test_same_attempt_same_digest_returns_current_reference_without_reinitialising(
    python_rt: Client,
) -> None:
    # docs/protocol.md, "Registration" row 2: the current reference; nothing is loaded again.
    wd = python_rt.workdir(COUNTING)
    first = python_rt.register(working_dir=wd, run_uid="idem")
    again = python_rt.register(working_dir=wd, run_uid="idem")
    assert again.registration == first.registration
    assert again.state == READY
    assert (wd / "imports.log").read_text().count("imported") == 1


def test_same_attempt_other_digest_is_already_exists_and_replaces_nothing(
    python_rt: Client,
) -> None:
    # docs/protocol.md, "Registration" row 3.
    wd = python_rt.workdir(ECHO_PY)
    first = python_rt.register(working_dir=wd, run_uid="dig", digest_of="one")
    refused(
        lambda: python_rt.register(working_dir=wd, run_uid="dig", digest_of="two"),
        grpc.StatusCode.ALREADY_EXISTS,
        "run dig attempt 1",
        "registration_digest",
    )
    assert python_rt.status(first.registration).state == READY
    assert json.loads(python_rt.invoke(first.registration, b'{"a": 1}').output)["echo"] == {"a": 1}


def test_higher_attempt_supersedes_and_stale_id_cannot_invoke(python_rt: Client) -> None:
    # docs/protocol.md, "Registration" row 4 and the InvokeFunction/UnregisterFunction stale-ID
    # rows.
    wd = python_rt.workdir(ECHO_PY)
    old = python_rt.register(working_dir=wd, run_uid="sup", attempt=1)
    new = python_rt.register(working_dir=wd, run_uid="sup", attempt=2)
    assert new.registration.registration_id != old.registration.registration_id
    stale = old.registration.registration_id
    for call in (python_rt.invoke, python_rt.unregister, python_rt.status):
        refused(
            partial(call, old.registration), grpc.StatusCode.FAILED_PRECONDITION, stale, "stale"
        )
    assert python_rt.status(new.registration).state == READY
    assert json.loads(python_rt.invoke(new.registration, b"7").output)["echo"] == 7


def test_higher_attempt_cancels_the_superseded_in_flight_invocation(python_rt: Client) -> None:
    # docs/protocol.md, "Registration" row 4: "old registration superseded (drained/cancelled)".
    # Cancelled, not left to finish: the old call would write `finished` after 1.5 s.
    wd = python_rt.workdir(FINISHES_LATE)
    old = python_rt.register(working_dir=wd, run_uid="sup2", attempt=1)
    future = python_rt.invoke_future(old.registration, b"1.5")
    pid = int(wait_until(lambda: (wd / "pid").exists() and (wd / "pid").read_text()))
    new = python_rt.register(working_dir=wd, run_uid="sup2", attempt=2)
    assert new.state == READY
    with pytest.raises(grpc.RpcError) as err:
        future.result(timeout=10)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    wait_until(lambda: not pid_alive(pid))
    assert not (wd / "finished").exists()


def test_lower_attempt_is_failed_precondition(python_rt: Client) -> None:
    # docs/protocol.md, "Registration" row 5, also after the newer registration was unregistered.
    wd = python_rt.workdir(ECHO_PY)
    newer = python_rt.register(working_dir=wd, run_uid="low", attempt=3)
    refused(
        lambda: python_rt.register(working_dir=wd, run_uid="low", attempt=2),
        grpc.StatusCode.FAILED_PRECONDITION,
        "registration_attempt 2 is older than attempt 3",
    )
    python_rt.unregister(newer.registration)
    refused(
        lambda: python_rt.register(working_dir=wd, run_uid="low", attempt=1),
        grpc.StatusCode.FAILED_PRECONDITION,
        "registration_attempt 1 is older than attempt 3",
    )
    # The same attempt may register again after an unregister (scale to zero) and gets a new ID.
    again = python_rt.register(working_dir=wd, run_uid="low", attempt=3)
    assert again.registration.registration_id != newer.registration.registration_id


def test_status_of_unknown_run_uid_is_not_found(python_rt: Client) -> None:
    # docs/protocol.md, "Registration" row 6.
    ref = pb.FunctionRegistration(run_uid="nobody", registration_id="reg_x")
    refused(lambda: python_rt.status(ref), grpc.StatusCode.NOT_FOUND, "run_uid nobody")


def test_status_of_current_id_reports_state_in_flight_and_last_activity(python_rt: Client) -> None:
    # docs/protocol.md, "Registration" row 7; docs/protocol.md: last_activity is set at READY and
    # when an invocation starts/completes.
    wd = python_rt.workdir(SLOW)
    before = time.time_ns()
    reg = python_rt.register(working_dir=wd)
    ready = python_rt.status(reg.registration)
    assert ready.state == READY and ready.in_flight == 0 and ready.fatal_error == ""
    assert ready.last_activity_unix_nano >= before
    future = python_rt.invoke_future(reg.registration, b'{"sleep": 0.5}')
    busy = wait_until(lambda: (s := python_rt.status(reg.registration)).in_flight == 1 and s)
    assert busy.last_activity_unix_nano > ready.last_activity_unix_nano
    future.result(timeout=10)
    done = python_rt.status(reg.registration)
    assert done.in_flight == 0 and done.last_activity_unix_nano > busy.last_activity_unix_nano


def test_status_of_stale_id_is_failed_precondition(python_rt: Client) -> None:
    # docs/protocol.md, "Registration" row 8.
    wd = python_rt.workdir(ECHO_PY)
    reg = python_rt.register(working_dir=wd, run_uid="st")
    stale = pb.FunctionRegistration(
        run_uid="st", registration_id=reg.registration.registration_id + "0"
    )
    assert code_of(lambda: python_rt.status(stale)) == grpc.StatusCode.FAILED_PRECONDITION


def test_function_statuses_answers_each_request_as_function_status_would(
    python_rt: Client,
) -> None:
    # docs/protocol.md, "Registration": runtimed's poll asks fnkernel.v1alpha1.Registrations
    # for several registrations in one round trip; each answer is FunctionStatus's own, its
    # response or the status it fails with, in the requests' order.
    ready = python_rt.register(working_dir=python_rt.workdir(ECHO_PY), run_uid="ok").registration
    unknown = pb.FunctionRegistration(run_uid="nobody", registration_id="reg_x")
    stale = pb.FunctionRegistration(run_uid="ok", registration_id=ready.registration_id + "0")
    stub = registrations_pb2_grpc.RegistrationsStub(python_rt.channel)
    asked = [pb.FunctionStatusRequest(registration=ref) for ref in (unknown, ready, stale)]
    answers = stub.FunctionStatuses(
        registrations_pb2.FunctionStatusesRequest(requests=asked), timeout=10
    ).answers
    assert len(answers) == 3
    for request, answer in zip(asked, answers, strict=True):
        try:
            alone = python_rt.fn.FunctionStatus(request, timeout=10)
        except grpc.RpcError as err:
            assert (answer.code, answer.message) == (err.code().value[0], err.details())
            assert not answer.HasField("status")
        else:
            assert answer.code == 0
            assert answer.status.registration == alone.registration
            assert (answer.status.state, answer.status.in_flight) == (alone.state, alone.in_flight)
    assert [answer.code for answer in answers] == [
        grpc.StatusCode.NOT_FOUND.value[0],
        0,
        grpc.StatusCode.FAILED_PRECONDITION.value[0],
    ]
    assert answers[1].status.state == READY


def test_invoke_while_draining_is_failed_precondition(python_rt: Client) -> None:
    # docs/protocol.md, "Registration" row 10 (DRAINING): unregister first moves the registration to
    # DRAINING.
    wd = python_rt.workdir(SLOW)
    reg = python_rt.register(working_dir=wd)
    future = python_rt.invoke_future(reg.registration, b'{"sleep": 1}')
    wait_until(lambda: python_rt.status(reg.registration).in_flight == 1)
    unregistering = threading.Thread(
        target=python_rt.unregister, args=(reg.registration,), kwargs={"drain_millis": 10_000}
    )
    unregistering.start()
    wait_until(lambda: python_rt.status(reg.registration).state == DRAINING)
    draining = refused(lambda: python_rt.invoke(reg.registration), FAILED_PRECONDITION)
    assert draining == f"run {reg.registration.run_uid} is DRAINING, not READY"
    assert json.loads(future.result(timeout=10).output) == {"slept": 1}  # drained, not cancelled
    unregistering.join(10)
    assert code_of(lambda: python_rt.status(reg.registration)) == grpc.StatusCode.NOT_FOUND


def test_invoke_of_failed_registration_is_failed_precondition(python_rt: Client) -> None:
    # docs/protocol.md, "Registration" row 10 (FAILED); the current ID can still read state and
    # fatal_error.
    reg = python_rt.register({"handler.py": "def handle(:\n"})
    assert reg.state == FAILED
    status = python_rt.status(reg.registration)
    assert status.state == FAILED and "SyntaxError" in status.fatal_error
    # The refusal says why: the state, and the load failure itself.
    refused(
        lambda: python_rt.invoke(reg.registration),
        grpc.StatusCode.FAILED_PRECONDITION,
        f"is FAILED, not READY: {status.fatal_error}",
    )


def test_second_concurrent_invoke_is_resource_exhausted(python_rt: Client) -> None:
    # docs/protocol.md, "Registration" row 11; docs/protocol.md: one in-flight invocation per
    # function Run, no queueing.
    reg = python_rt.register(SLOW)
    future = python_rt.invoke_future(reg.registration, b'{"sleep": 1}', invocation_id="first")
    wait_until(lambda: python_rt.status(reg.registration).in_flight == 1)
    refused(
        lambda: python_rt.invoke(reg.registration),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "invocation first in flight",
    )
    assert json.loads(future.result(timeout=10).output) == {"slept": 1}


def test_timeout_is_deadline_exceeded_and_registration_stays_ready(python_rt: Client) -> None:
    # docs/protocol.md, "Registration" row 12; docs/protocol.md: DeadlineExceeded affects only this
    # invocation.
    wd = python_rt.workdir(SLOW)
    reg = python_rt.register(working_dir=wd)
    with pytest.raises(grpc.RpcError) as timed_out:
        python_rt.invoke(reg.registration, b'{"sleep": 600}', timeout_millis=300)
    assert timed_out.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # It says how long it had, which the caller can then raise.
    assert "the handler exceeded its deadline of 0.3 s" in (timed_out.value.details() or "")
    pid = int((wd / "pid").read_text())
    wait_until(lambda: not pid_alive(pid))  # the handler's process was killed
    assert python_rt.status(reg.registration).state == READY
    assert json.loads(python_rt.invoke(reg.registration, b'{"sleep": 0}').output) == {"slept": 0}


def test_client_deadline_also_bounds_the_invocation(python_rt: Client) -> None:
    # docs/protocol.md: timeout_millis is bounded by the caller's deadline; the handler is killed.
    wd = python_rt.workdir(SLOW)
    reg = python_rt.register(working_dir=wd)
    assert (
        code_of(lambda: python_rt.invoke(reg.registration, b'{"sleep": 30}', timeout=0.5))
        == grpc.StatusCode.DEADLINE_EXCEEDED
    )
    pid = int(wait_until(lambda: (wd / "pid").exists() and (wd / "pid").read_text()))
    wait_until(lambda: not pid_alive(pid))
    wait_until(lambda: python_rt.status(reg.registration).in_flight == 0)
    assert json.loads(python_rt.invoke(reg.registration, b'{"sleep": 0}').output) == {"slept": 0}


def test_client_cancel_kills_the_handler_and_registration_stays_usable(python_rt: Client) -> None:
    # docs/protocol.md, "Adapters": client cancel kills the worker's process group; a fresh worker
    # keeps it READY.
    wd = python_rt.workdir(SLOW)
    reg = python_rt.register(working_dir=wd)
    future = python_rt.invoke_future(reg.registration, b'{"sleep": 30}')
    pid = int(wait_until(lambda: (wd / "pid").exists() and (wd / "pid").read_text()))
    future.cancel()
    wait_until(lambda: not pid_alive(pid), timeout=2)
    wait_until(lambda: python_rt.status(reg.registration).in_flight == 0)
    assert python_rt.status(reg.registration).state == READY
    assert json.loads(python_rt.invoke(reg.registration, b'{"sleep": 0}').output) == {"slept": 0}


def test_unregister_of_absent_run_uid_succeeds(python_rt: Client) -> None:
    # docs/protocol.md, "Registration" row 13: OK, and the reference is answered as given.
    absent = pb.FunctionRegistration(run_uid="absent", registration_id="reg_none")
    assert python_rt.unregister(absent).registration == absent
    assert code_of(lambda: python_rt.status(absent)) == grpc.StatusCode.NOT_FOUND


def test_unregister_with_stale_id_leaves_the_newer_registration_untouched(
    python_rt: Client,
) -> None:
    # docs/protocol.md, "Registration" row 14.
    wd = python_rt.workdir(ECHO_PY)
    old = python_rt.register(working_dir=wd, run_uid="keep", attempt=1)
    new = python_rt.register(working_dir=wd, run_uid="keep", attempt=2)
    refused(
        lambda: python_rt.unregister(old.registration, cancel=True),
        grpc.StatusCode.FAILED_PRECONDITION,
        old.registration.registration_id,
        "stale",
    )
    assert python_rt.status(new.registration).state == READY
    assert json.loads(python_rt.invoke(new.registration, b'"hi"').output)["echo"] == "hi"


def test_unregister_with_cancel_in_flight_returns_promptly_and_kills_the_handler(
    python_rt: Client,
) -> None:
    # docs/protocol.md: with cancel_in_flight=true, it cancels immediately, then releases local
    # state.
    wd = python_rt.workdir(SLOW)
    reg = python_rt.register(working_dir=wd)
    # A drain would let the 600 s call run: CANCELLED is the cancel's.
    future = python_rt.invoke_future(reg.registration, b'{"sleep": 600}')
    pid = int(wait_until(lambda: (wd / "pid").exists() and (wd / "pid").read_text()))
    python_rt.unregister(reg.registration, cancel=True, drain_millis=600_000)
    with pytest.raises(grpc.RpcError) as err:
        future.result(timeout=5)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    # Its caller is told why, not only that it was cancelled.
    assert err.value.details() == (
        "the invocation was cancelled: its function was unregistered with cancel_in_flight"
    )
    wait_until(lambda: not pid_alive(pid), timeout=2)
    assert code_of(lambda: python_rt.status(reg.registration)) == grpc.StatusCode.NOT_FOUND


def test_unregister_waits_no_longer_than_drain_timeout_then_cancels(python_rt: Client) -> None:
    # docs/protocol.md: with cancel_in_flight=false it waits no longer than drain_timeout_millis;
    # docs/protocol.md, "Limits": after the timeout the in-flight call is cancelled.
    wd = python_rt.workdir(SLOW)
    reg = python_rt.register(working_dir=wd)
    future = python_rt.invoke_future(reg.registration, b'{"sleep": 30}')
    pid = int(wait_until(lambda: (wd / "pid").exists() and (wd / "pid").read_text()))
    started = time.monotonic()
    python_rt.unregister(reg.registration, drain_millis=400)
    assert time.monotonic() - started >= 0.4  # it waited the drain: then it cancelled
    with pytest.raises(grpc.RpcError) as err:
        future.result(timeout=5)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert err.value.details() == (
        "the invocation was cancelled: its function was unregistered, and the drain of 400 ms "
        "ran out"
    )
    wait_until(lambda: not pid_alive(pid), timeout=2)


def test_registration_working_dir_symlink_outside_workspace_is_invalid(
    python_rt: Client, tmp_path: Path
) -> None:
    # docs/protocol.md, "Limits": working_dir must be inside --workspace-root after resolving
    # symlinks.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "handler.py").write_text("def handle(e): return e\n")
    link = python_rt.workspace / "link"
    link.symlink_to(outside)
    assert code_of(lambda: python_rt.register(working_dir=link)) == grpc.StatusCode.INVALID_ARGUMENT


def test_a_handler_module_that_is_a_symlink_out_of_its_working_dir_is_invalid(
    python_rt: Client, tmp_path: Path
) -> None:
    # docs/protocol.md, "Limits": the handler's module must resolve inside the working dir — a
    # symlink in it to a file elsewhere is refused before anything is loaded.
    outside = tmp_path / "elsewhere.py"
    outside.write_text("def handle(e): return e\n")
    working = python_rt.workspace / "linked"
    working.mkdir()
    (working / "handler.py").symlink_to(outside)
    with pytest.raises(grpc.RpcError) as refused:
        python_rt.register(working_dir=working)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "resolves outside the working directory" in (refused.value.details() or "")


@pytest.mark.parametrize("drain_millis", [2**63 - 1, 10**13, 900_001])
def test_a_drain_over_the_maximum_is_invalid_and_leaves_the_registration_ready(
    python_rt: Client, drain_millis: int
) -> None:
    # README, "Configuration and limits": drain_timeout_millis is 0 to 900,000 (no call outlives 900 s). Beyond
    # it, INVALID_ARGUMENT before anything changes: never a registration stuck DRAINING.
    reg = python_rt.register(working_dir=python_rt.workdir(SLOW))
    future = python_rt.invoke_future(reg.registration, b'{"sleep": 0.5}')
    wait_until(lambda: python_rt.status(reg.registration).in_flight == 1)
    with pytest.raises(grpc.RpcError) as caught:
        python_rt.unregister(reg.registration, drain_millis=drain_millis)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "drain_timeout_millis" in (caught.value.details() or "")
    assert python_rt.status(reg.registration).state == READY
    assert json.loads(future.result(timeout=10).output) == {"slept": 0.5}
    assert json.loads(python_rt.invoke(reg.registration, b'{"sleep": 0}').output) == {"slept": 0}
    python_rt.unregister(reg.registration, drain_millis=900_000)  # the maximum itself is fine
    assert code_of(lambda: python_rt.status(reg.registration)) == grpc.StatusCode.NOT_FOUND
