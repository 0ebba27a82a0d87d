"""README, "The protocol client": ``rt.try_call`` prints an expected failure in one line and
returns it. A request that cannot be the method's message, or a method FunctionRuntime lacks,
is such a failure too, said before anything is sent — as grpc's INVALID_ARGUMENT and
UNIMPLEMENTED would be — not a protobuf traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from fnkernel.kernel.protocol import FunctionRuntimeClient
from fnkernel.kernel.trace import Trace
from fnkernel.runtime_server.client.errors import GatewayError


@pytest.mark.parametrize(
    ("method", "request_", "code", "says"),
    [
        ("RegisterFunction", {"runUID": "x", "registrationAttempt": 1}, "INVALID_ARGUMENT",
         'RegisterFunction: the request is no RegisterFunctionRequest: Message type '
         '"executor.v1.RegisterFunctionRequest" has no field named "runUID"'),
        ("RegisterFunction", {"runUid": "x", "registrationAttempt": "one"}, "INVALID_ARGUMENT",
         "registrationAttempt"),
        ("InvokeFunction", {"input": "not base64!!"}, "INVALID_ARGUMENT", "input"),
        ("InvokeFunction", {"input": {"a": 1}}, "INVALID_ARGUMENT", "InvokeFunctionRequest"),
        ("NoSuchMethod", {}, "UNIMPLEMENTED", "FunctionRuntime has no method 'NoSuchMethod'; "
         "one of RegisterFunction, InvokeFunction, FunctionStatus, UnregisterFunction"),
    ],
    ids=["misspelled field", "wrong type", "input not base64", "input not bytes", "no method"],
)  # fmt: skip
def test_a_call_that_cannot_be_made_is_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    method: str,
    request_: dict,
    code: str,
    says: str,
) -> None:
    rt = FunctionRuntimeClient(f"unix:{tmp_path}/nothing.sock", Trace())  # nothing listens
    try:
        error = rt.try_call(method, request_, timeout=5)
    finally:
        rt.close()
    printed = capsys.readouterr().out
    assert isinstance(error, GatewayError) and error.code == code  # not UNAVAILABLE: unsent
    assert says in error.message
    assert printed.count("\n") == 1 and printed.startswith(f"{method} → {code}: ")
    assert not printed.startswith(f"{method} → {code}: {method}:")  # named once
