"""docs/architecture.md, "Retries": the verdict on every way a registration step can fail, as the
table there states it, over every gRPC status code and every load-failure type."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from fnkernel import adapters
from fnkernel.runtime_server.lifecycle.retries import LOAD_FAILURES, Step, Verdict, decide

C = grpc.StatusCode
FATAL, CHARGED, FREE, WAIT = (
    Verdict.FATAL,
    Verdict.RETRY_CHARGED,
    Verdict.RETRY_FREE,
    Verdict.WAIT,
)

# The docs' table, one row per code: (RegisterFunction, FunctionStatus).
BY_CODE: dict[grpc.StatusCode, tuple[Verdict, Verdict]] = {
    C.UNAVAILABLE: (WAIT, WAIT),
    C.DEADLINE_EXCEEDED: (WAIT, WAIT),
    C.CANCELLED: (WAIT, WAIT),
    C.INVALID_ARGUMENT: (FATAL, CHARGED),
    C.ALREADY_EXISTS: (FATAL, CHARGED),
    C.UNIMPLEMENTED: (FATAL, CHARGED),
    C.OUT_OF_RANGE: (FATAL, CHARGED),
    C.PERMISSION_DENIED: (FATAL, CHARGED),
    C.UNAUTHENTICATED: (FATAL, CHARGED),
    C.NOT_FOUND: (FREE, FREE),
    C.FAILED_PRECONDITION: (FREE, FREE),
    C.ABORTED: (FREE, FREE),
    C.UNKNOWN: (CHARGED, CHARGED),
    C.INTERNAL: (CHARGED, CHARGED),
    C.RESOURCE_EXHAUSTED: (CHARGED, CHARGED),
    C.DATA_LOSS: (CHARGED, CHARGED),
}
BY_LOAD_FAILURE = {
    "UserCodeSyntaxError": FATAL,
    "ImportModuleError": FATAL,
    "HandlerNotFound": FATAL,
    "InitializationError": FATAL,
    "InitializationTimeout": FATAL,
    "MemoryLimitExceeded": FATAL,  # loading needs more than memoryMb: until it is given more
    "WorkerKilled": CHARGED,
    "WorkerStartFailed": CHARGED,
}


def test_the_table_covers_every_status_code_but_ok() -> None:
    assert set(BY_CODE) == set(grpc.StatusCode) - {C.OK}


@pytest.mark.parametrize("code", sorted(BY_CODE, key=lambda code: code.name))
def test_a_failed_rpc(code: grpc.StatusCode) -> None:
    register, status = BY_CODE[code]
    assert decide(Step.REGISTER, code) is register
    assert decide(Step.STATUS, code) is status


@pytest.mark.parametrize("error_type", sorted(BY_LOAD_FAILURE))
def test_a_failed_load(error_type: str) -> None:
    assert decide(Step.LOAD, error_type) is BY_LOAD_FAILURE[error_type]


def test_a_load_failure_type_nobody_lists_is_the_handlers() -> None:
    assert decide(Step.LOAD, "SomethingNew") is FATAL


def test_a_pod_out_of_grace_is_retried_free() -> None:
    assert decide(Step.POD) is FREE


def test_ok_and_a_wrong_kind_of_error_are_refused() -> None:
    with pytest.raises(ValueError, match="OK"):
        decide(Step.REGISTER, C.OK)
    with pytest.raises(TypeError):
        decide(Step.LOAD, C.INTERNAL)
    with pytest.raises(TypeError):
        decide(Step.STATUS, "WorkerKilled")


def test_every_type_a_worker_reports_is_in_the_table() -> None:
    # The workers spell their types themselves (they import nothing of ours): every INITFAIL
    # type in their sources is one the table decides.
    home = Path(adapters.__file__).parent
    python_worker = (home / "_python_worker.py").read_text()
    bash_runner = (home / "bash_runner.sh").read_text()
    reported = set(re.findall(r'\(\s*"([A-Z]\w+)",', python_worker))
    reported |= set(re.findall(r"initfail (\w+)", bash_runner))
    assert reported, "no INITFAIL type found in the workers' sources"
    assert reported <= LOAD_FAILURES
    assert set(BY_LOAD_FAILURE) == LOAD_FAILURES
