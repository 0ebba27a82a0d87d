"""README, "The protocol itself" (``runtime_server()`` in a cell): an interrupt cancels its
call, and ``rt.try_call`` prints an expected failure in one line and returns it. A request
that cannot be the method's message, or a method FunctionRuntime lacks, is such a failure
too, said before anything is sent — as grpc's INVALID_ARGUMENT and UNIMPLEMENTED would be —
not a protobuf traceback."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from fnkernel.kernel.protocol import FunctionRuntimeClient
from fnkernel.kernel.trace import Trace
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.client.errors import GatewayError
from tests.kernel.kernels import Kernel
from tests.support import wait_until


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


@pytest.mark.usefixtures("fnkernel_spec")  # a real kernel
def test_interrupt_cancels_a_function_runtime_call_from_the_protocol_client(
    kernel: Kernel,
) -> None:
    # Issue: the sync stub's .future(), cancelled from the interrupt_request override; the
    # server then kills the handler, and the client waits until it has (its own FunctionStatus
    # polls, shown by `%fn_trace show --all` only), so the registration takes the next call.
    setup = kernel.run(
        "import base64, hashlib, json\n"
        "from fnkernel.kernel.protocol import runtime_server\n"
        "rt = runtime_server('python')\n"
        'src = \'import time\\ndef handle(e):\\n    time.sleep(e["s"])\\n    return e["s"]\\n\'\n'
        "ref = rt.RegisterFunction({'runUid': 'tour-slow', 'registrationAttempt': 1,\n"
        "    'workingDir': rt.workdir({'h.py': src}), 'handler': 'h.handle',\n"
        "    'registrationDigest': 'sha256:' + hashlib.sha256(src.encode()).hexdigest()})\n"
        "ref = ref['registration']\n"
        "def call(s):\n"
        "    reply = rt.InvokeFunction({'registration': ref,\n"
        "        'input': base64.b64encode(json.dumps({'s': s}).encode()).decode()})\n"
        "    return json.loads(base64.b64decode(reply['output']))\n"
    )
    assert setup.ok, setup.error
    address = kernel.value("rt.address")
    reference = kernel.value("ref")
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.FunctionRuntimeStub(channel)
    status_request = pb.FunctionStatusRequest(
        registration=pb.FunctionRegistration(
            run_uid=reference["runUid"], registration_id=reference["registrationId"]
        )
    )
    try:
        assert kernel.run("%fn_trace on").ok
        msg_id = kernel.send("call(600)")  # its deadline is 30 s: only the interrupt ends it
        wait_until(lambda: stub.FunctionStatus(status_request, timeout=5).in_flight == 1, 10)
        kernel.manager.interrupt_kernel()
        cell = kernel.collect(msg_id, timeout=10)
        assert cell.error is not None and cell.error["ename"] == "InvocationInterrupted"
        assert cell.error["traceback"] == ["KeyboardInterrupt: InvokeFunction cancelled"]
        calls = kernel.value(
            "[(c.method, c.status, c.internal, int((c.response or {}).get('inFlight', 0)))"
            " for c in rt.trace.calls()]"
        )
        cancelled, *polls = calls
        assert cancelled == ["FunctionRuntime/InvokeFunction", "CANCELLED", False, 0]
        assert polls and all(p[:3] == ["FunctionRuntime/FunctionStatus", "OK", True] for p in polls)
        assert polls[-1][3] == 0
        assert kernel.value("call(0)") == 0
    finally:
        channel.close()
