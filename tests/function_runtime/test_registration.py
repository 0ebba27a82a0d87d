"""docs/protocol.md, "Registration": one test per row of the registration state machine, against a real server."""

from __future__ import annotations

import json
import textwrap
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import grpc
import pytest

from fnkernel.adapters.errors import InvocationCancelled
from fnkernel.adapters.python import PythonAdapter
from fnkernel.runtime_server import wire
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import (
    registrations_pb2,
    registrations_pb2_grpc,
)
from fnkernel.runtime_server.errors import AttemptSuperseded, ShuttingDown
from fnkernel.runtime_server.function_runtime import registry as registry_module
from fnkernel.runtime_server.function_runtime.registry import Registry
from fnkernel.runtime_server.function_runtime.server import RuntimeServer
from tests.support import ECHO_PY, Client, digest, pid_alive, wait_until

REGISTERING = pb.FUNCTION_REGISTRATION_STATE_REGISTERING
READY = pb.FUNCTION_REGISTRATION_STATE_READY
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
DRAINING = pb.FUNCTION_REGISTRATION_STATE_DRAINING
FAILED = pb.FUNCTION_REGISTRATION_STATE_FAILED

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
SLOW = {
    "handler.py": """
        import os, time
        from pathlib import Path

        def handle(event, context):
            Path("pid").write_text(str(os.getpid()))
            time.sleep(event.get("sleep", 0))
            return {"slept": event.get("sleep", 0)}
    """
}

FINISHES_LATE = {
    # A call that leaves a trace if it is allowed to finish: `finished`, after `event` seconds.
    "handler.py": """
        import os, time
        from pathlib import Path

        def handle(event):
            Path("pid").write_text(str(os.getpid()))
            time.sleep(event)
            Path("finished").touch()
    """
}


def code_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def refused(call, code: grpc.StatusCode, *words: str) -> str:  # type: ignore[no-untyped-def]
    """`call` fails with `code`, its message naming each of `words` (docs/protocol.md,
    "Errors": every failure names its field or cause); returns the message."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    details = err.value.details() or ""
    assert err.value.code() == code, details
    for word in words:
        assert word in details, (word, details)
    return details


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
    # README, "Limits": drain_timeout_millis is 0 to 900,000 (no call outlives 900 s). Beyond
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


def test_the_caller_deadline_is_the_handler_deadline(python_rt: Client) -> None:
    # docs/protocol.md, "Registration": timeout_millis (30 s by default) is bounded by the
    # caller's own deadline, which the handler sees in its context; without one, the default.
    wd = python_rt.workdir(
        {"handler.py": "def handle(event, context):\n    return context.remaining_millis()\n"}
    )
    reg = python_rt.register(working_dir=wd)
    bounded = int(python_rt.invoke(reg.registration, timeout=2).output)
    assert 0 < bounded <= 2100  # gRPC rounds a deadline up when it encodes it
    request = pb.InvokeFunctionRequest(
        registration=reg.registration, input=b"{}", content_type="application/json"
    )
    unbounded = int(python_rt.fn.InvokeFunction(request).output)  # no gRPC deadline at all
    assert 25_000 < unbounded <= 30_000


def test_a_ready_registration_whose_worker_cannot_restart_becomes_failed(
    python_rt: Client,
) -> None:
    # docs/protocol.md, "Registration": a permanent load failure leaves the registration FAILED
    # with its fatal_error — also when it happens to the fresh worker of a READY registration.
    wd = python_rt.workdir(
        {
            "handler.py": (
                "import os\n"
                "if os.path.exists('broken'):\n"
                "    raise ImportError('the handler broke')\n"
                "def handle(event):\n"
                "    open('broken', 'w').close()\n"
                "    os._exit(3)\n"
            )
        }
    )
    reg = python_rt.register(working_dir=wd)
    assert reg.state == READY
    assert code_of(lambda: python_rt.invoke(reg.registration)) == grpc.StatusCode.UNKNOWN
    status = wait_until(
        lambda: (s := python_rt.status(reg.registration)).state == FAILED and s, timeout=10
    )
    assert "the handler broke" in status.fatal_error  # type: ignore[union-attr]
    assert code_of(lambda: python_rt.invoke(reg.registration)) == (
        grpc.StatusCode.FAILED_PRECONDITION
    )


def test_a_superseded_generation_failing_later_leaves_the_newer_one_ready(
    python_rt: Client,
) -> None:
    # docs/protocol.md, "Registration": a stale registration can change nothing — not even by
    # failing. Attempt 1's worker is still loading (slowly, then failing) when attempt 2
    # replaces it; attempt 2 stays READY.
    wd = python_rt.workdir(
        {
            "handler.py": (
                "import os, time\n"
                "if os.environ['GENERATION'] == '1':\n"
                "    open('loading', 'w').close()\n"
                "    time.sleep(1)\n"
                "    raise ImportError('the first generation fails late')\n"
                "def handle(event):\n"
                "    return os.environ['GENERATION']\n"
            )
        }
    )
    first = threading.Thread(
        target=lambda: python_rt.register(
            working_dir=wd, run_uid="late", attempt=1, env={"GENERATION": "1"}, timeout=30
        )
    )
    first.start()
    wait_until(lambda: (wd / "loading").exists(), timeout=10)  # attempt 1 is mid-import
    newer = python_rt.register(
        working_dir=wd, run_uid="late", attempt=2, env={"GENERATION": "2"}, digest_of="v2"
    )
    assert newer.state == READY
    first.join(30)  # attempt 1's load has failed by now
    assert python_rt.status(newer.registration).state == READY
    assert python_rt.invoke(newer.registration).output == b'"2"'


def test_unregister_returns_when_the_drained_call_ends_not_at_the_drain_timeout(
    python_rt: Client,
) -> None:
    # docs/protocol.md, "Registration": the drain waits for the call in flight *at most*
    # drain_timeout_millis; it ends as soon as the call does (0.3 s here, against 60 s).
    reg = python_rt.register(working_dir=python_rt.workdir(SLOW))
    future = python_rt.invoke_future(reg.registration, b'{"sleep": 0.3}')
    wait_until(lambda: python_rt.status(reg.registration).in_flight == 1)
    started = time.monotonic()
    python_rt.unregister(reg.registration, drain_millis=60_000)
    assert time.monotonic() - started < 30
    assert json.loads(future.result(timeout=10).output) == {"slept": 0.3}


def test_a_late_cancel_of_a_stale_generation_spares_the_newer_generations_call(
    workspace: Path,
) -> None:
    # docs/protocol.md, "Registration": a stale registration can change nothing. A client that
    # goes away cancels its call through the registry — here, late: after a higher attempt
    # replaced its registration and a new call with the *same* invocation_id (clients choose
    # them; retries reuse them) is in flight on the newer one. That call must run on.
    registry = Registry(PythonAdapter, workspace)
    wd = workspace / "gen"
    wd.mkdir()
    (wd / "h.py").write_text(
        "import time\ndef handle(event):\n    time.sleep(event)\n    return event\n"
    )
    args = {"working_dir": str(wd), "handler": "h.handle", "env": {}, "idle_timeout_seconds": 60}
    first = registry.register(
        run_uid="gen", registration_attempt=1, registration_digest=digest("1"), **args
    )
    late_cancels: list[Callable[[], object]] = []

    def invoke(registration_id: str, seconds: float, **kw: object) -> object:
        try:
            return registry.invoke(
                run_uid="gen",
                registration_id=registration_id,
                invocation_id="retry-1",
                input=str(seconds).encode(),
                content_type="application/json",
                timeout_millis=30_000,
                **kw,  # type: ignore[arg-type]
            )
        except Exception as exc:
            return exc

    try:
        old_call = threading.Thread(
            target=lambda: invoke(first.registration_id, 30, on_dispatch=late_cancels.append)
        )
        old_call.start()
        wait_until(lambda: late_cancels)
        second = registry.register(
            run_uid="gen", registration_attempt=2, registration_digest=digest("2"), **args
        )
        old_call.join(10)
        results: list[object] = []
        new_call = threading.Thread(
            target=lambda: results.append(invoke(second.registration_id, 1))
        )
        new_call.start()
        wait_until(
            lambda: registry.status(run_uid="gen", registration_id=second.registration_id).in_flight
        )
        late_cancels[0]()  # the first generation's client goes away now
        new_call.join(15)
        assert results and not isinstance(results[0], Exception), results
        assert results[0].result.output == b"1"  # type: ignore[attr-defined]
    finally:
        registry.shutdown()


def test_outputs_over_their_bounds_end_the_call_as_a_handler_error_named_invalid_outputs(
    python_rt: Client,
) -> None:
    # docs/protocol.md, "Limits", outputs row: beyond the bounds, handler error `InvalidOutputs`,
    # with the call's logs; the registration stays READY.
    reg = python_rt.register(
        {
            "handler.py": """
                def handle(event, context):
                    print("setting", event, "outputs")
                    for i in range(event):
                        context.set_output(f"k{i}", "v")
                    return "done"
            """
        }
    )
    with pytest.raises(grpc.RpcError) as err:
        python_rt.invoke(reg.registration, b"33")
    trailers = dict(err.value.trailing_metadata() or ())
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert err.value.details() == "handler error: InvalidOutputs: 33 outputs; at most 32"
    assert trailers[wire.ERROR_TYPE_KEY] == "InvalidOutputs"
    assert json.loads(trailers[wire.LOGS_KEY]) == [
        {"stream": "stdout", "text": "setting 33 outputs"}
    ]
    assert python_rt.invoke(reg.registration, b"32").output == b'"done"'


def test_register_answers_when_its_bounded_wait_ends_and_the_load_goes_on(
    workspace: Path,
) -> None:
    # docs/protocol.md, "Registration": RegisterFunction waits, bounded, for the handler to load;
    # past the bound it answers REGISTERING and FunctionStatus tells the outcome later.
    registry = Registry(PythonAdapter, workspace, register_wait=0.2)
    wd = _workdir(
        workspace,
        "slowload",
        {
            "h.py": "import time\nfrom pathlib import Path\nwhile not Path('go').exists():\n"
            "    time.sleep(0.01)\ndef handle(event):\n    return event\n"
        },
    )
    try:
        view = registry.register(
            run_uid="slowload",
            registration_attempt=1,
            working_dir=str(wd),
            handler="h.handle",
            env={},
            idle_timeout_seconds=0,
            registration_digest=digest("s"),
        )
        assert view.state == REGISTERING
        (wd / "go").touch()
        status = partial(registry.status, run_uid="slowload", registration_id=view.registration_id)
        wait_until(lambda: status().state == READY, timeout=20)
    finally:
        registry.shutdown()


IDENTITY = {"h.py": "def handle(event):\n    return event\n"}


def _workdir(workspace: Path, name: str, files: dict[str, str]) -> Path:
    """A working directory for a Registry driven in this process."""
    wd = workspace / name
    wd.mkdir()
    for file, text in files.items():
        (wd / file).write_text(textwrap.dedent(text))
    return wd


def _invoke(registry: Registry, run_uid: str, registration_id: str, payload: bytes) -> object:
    return registry.invoke(
        run_uid=run_uid,
        registration_id=registration_id,
        invocation_id="",
        input=payload,
        content_type="",
        timeout_millis=0,
    )


def _register(
    registry: Registry, wd: Path, run_uid: str, attempt: int, handler: str = "h.handle"
) -> str:
    return registry.register(
        run_uid=run_uid,
        registration_attempt=attempt,
        working_dir=str(wd),
        handler=handler,
        env={},
        idle_timeout_seconds=0,
        registration_digest=digest(str(attempt)),
    ).registration_id


def test_the_server_remembers_the_attempts_of_its_most_recently_removed_runs(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/protocol.md, "Registration": a lower attempt is refused also after an unregister. The
    # server remembers this for its last 10,000 removed runs (2 here); the oldest is forgotten.
    monkeypatch.setattr(registry_module, "_MAX_TOMBSTONES", 2)
    registry = Registry(PythonAdapter, workspace)
    wd = _workdir(workspace, "tomb", IDENTITY)
    try:
        for run_uid in ("a", "b", "c"):
            registration_id = _register(registry, wd, run_uid, 2)
            registry.unregister(
                run_uid=run_uid,
                registration_id=registration_id,
                cancel_in_flight=False,
                drain_timeout_millis=0,
            )
        for remembered in ("b", "c"):
            with pytest.raises(AttemptSuperseded, match="older than attempt 2"):
                _register(registry, wd, remembered, 1)
        assert _register(registry, wd, "a", 1)  # forgotten: the oldest of the three
    finally:
        registry.shutdown()


class _SpawnFails(PythonAdapter):
    """A worker that cannot be spawned at all, as when the process runs out of file
    descriptors: an error no adapter names."""

    def start(self) -> None:
        raise OSError(24, "Too many open files")


class _LoadBreaks(PythonAdapter):
    """A load that fails in a way nobody planned for: a bug, not the OS."""

    def start(self) -> None:
        raise RuntimeError("unplanned")


@pytest.mark.parametrize(
    ("adapter", "fatal_error"),
    [
        # docs/architecture.md, "Retries": the OS refusing a worker is the platform's failure,
        # which runtimed retries (WorkerStartFailed), not the handler's.
        (
            _SpawnFails,
            "WorkerStartFailed: the worker could not be started: [Errno 24] Too many open files",
        ),
        (_LoadBreaks, "InitializationError: unplanned"),
    ],
)
def test_an_unexpected_error_while_loading_leaves_the_registration_failed(
    workspace: Path, adapter: type[PythonAdapter], fatal_error: str
) -> None:
    # docs/protocol.md, "Registration": the answer is READY or FAILED — never REGISTERING
    # forever, also when the load fails in a way nobody planned for.
    registry = Registry(adapter, workspace)
    wd = _workdir(workspace, "nofds", IDENTITY)
    try:
        registration_id = _register(registry, wd, "nofds", 1)
        view = registry.status(run_uid="nofds", registration_id=registration_id)
        assert view.state == FAILED
        assert view.fatal_error == fatal_error
    finally:
        registry.shutdown()


def test_after_shutdown_nothing_new_is_accepted(workspace: Path) -> None:
    # docs/protocol.md, "Services": a stopping server starts no new worker, whatever reaches it
    # late (gRPC's graceful stop may leave a slow request running past it).
    registry = Registry(PythonAdapter, workspace)
    wd = _workdir(workspace, "late", IDENTITY)
    registration_id = _register(registry, wd, "late", 1)
    registry.shutdown()
    with pytest.raises(ShuttingDown, match="shutting down"):
        _register(registry, wd, "late2", 1)
    with pytest.raises(ShuttingDown, match="shutting down"):
        _invoke(registry, "late", registration_id, b"1")


def test_shutdown_cancels_the_call_in_flight_rather_than_letting_it_finish(
    workspace: Path,
) -> None:
    # docs/protocol.md, "Services": what outlives the drain is cancelled, not waited for.
    registry = Registry(PythonAdapter, workspace)
    wd = _workdir(workspace, "cut", FINISHES_LATE)
    registration_id = _register(registry, wd, "cut", 1, handler="handler.handle")
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            _invoke(registry, "cut", registration_id, b"1.5")
        except BaseException as exc:
            outcome.append(exc)

    calling = threading.Thread(target=call)
    calling.start()
    pid = int(wait_until(lambda: (wd / "pid").exists() and (wd / "pid").read_text()))
    registry.shutdown()
    calling.join(10)
    assert not pid_alive(pid)
    assert not (wd / "finished").exists()
    assert [type(exc) for exc in outcome] == [InvocationCancelled]


def test_stop_cancels_what_outlives_the_drain_and_stops_every_worker(workspace: Path) -> None:
    # docs/protocol.md, "Services": stopping lets calls in flight finish for the drain time, then
    # cancels them and stops the workers — it does not wait for a 60 s call.
    server = RuntimeServer("python", workspace)
    channel = grpc.insecure_channel(server.start(f"unix:{workspace}/stop.sock"))
    client = Client(channel, workspace, "python")
    try:
        wd = client.workdir(SLOW)
        reg = client.register(working_dir=wd)
        future = client.invoke_future(reg.registration, b'{"sleep": 60}')
        pid = int(wait_until(lambda: (wd / "pid").exists() and (wd / "pid").read_text()))
        started = time.monotonic()
        server.stop(drain_seconds=0.2)
        assert time.monotonic() - started < 4  # the cancel settles within 100 ms, not 5 s
        assert not pid_alive(pid)
        with pytest.raises(grpc.RpcError):
            future.result(timeout=5)
    finally:
        channel.close()
