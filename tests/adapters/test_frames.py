"""adapters/worker.py: every answer a worker sends proves which call it answers (the call's nonce).
An answer that does not — junk, or a frame the handler wrote to the worker's own response pipe —
makes the worker corrupt: it is killed and replaced, that call fails with CorruptResponse, and no
caller ever gets another call's answer."""

from __future__ import annotations

import json

import grpc
import pytest

from fnkernel.adapters.errors import CORRUPT_RESPONSE
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server.wire import ERROR_TYPE_KEY
from tests.support import Client

# A handler that finds the worker's response pipe without being told (the write end of a pipe
# among its descriptors) and writes `forge` there before it returns its own answer.
FORGER = {
    "handler.py": """
        import fcntl, inspect, json, os, sys

        def response_pipe():
            for name in os.listdir("/proc/self/fd"):
                fd = int(name)
                try:
                    target = os.readlink(f"/proc/self/fd/{fd}")
                    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
                except OSError:
                    continue
                if target.startswith("pipe:") and flags & os.O_ACCMODE == os.O_WRONLY:
                    return fd

        def own_nonce():
            frame = inspect.currentframe()
            while "nonce" not in frame.f_locals:
                frame = frame.f_back
            return frame.f_locals["nonce"]

        def handle(event):
            forge = event.get("forge")
            if forge == "argv":
                return sys.argv
            if forge == "own-nonce":
                os.write(response_pipe(), b"ok 0 9 json inline -1 -1 %s\\n\\"forged!\\"" % own_nonce())
            elif forge:
                os.write(response_pipe(), forge.encode())
            return {"n": event["n"]}
    """
}


def call(rt: Client, registration: pb.FunctionRegistration, **event: object) -> object:
    return json.loads(rt.invoke(registration, json.dumps(event).encode()).output)


def corrupt(rt: Client, registration: pb.FunctionRegistration, **event: object) -> str:
    with pytest.raises(grpc.RpcError) as failed:
        rt.invoke(registration, json.dumps(event).encode())
    error = failed.value
    assert error.code() == grpc.StatusCode.UNKNOWN, error.details()
    assert dict(error.trailing_metadata())[ERROR_TYPE_KEY] == CORRUPT_RESPONSE  # type: ignore[attr-defined]
    return str(error.details())


def test_the_handler_sees_no_descriptor_numbers_in_its_argv(python_rt: Client) -> None:
    registration = python_rt.register(FORGER).registration
    argv = call(python_rt, registration, forge="argv", n=0)
    assert isinstance(argv, list) and not any(arg.isdigit() for arg in argv[1:]), argv


@pytest.mark.parametrize(
    "forged",
    [
        "ok 0 2\n{}",  # a whole answer as the frames looked before the nonce
        "ok 0 2 0123456789abcdef\n{}",  # a guessed nonce
        "garbage\n",
        "ok 9999999 1 x\n",
    ],
)
def test_a_forged_answer_fails_its_own_call_and_never_shifts_the_next(
    python_rt: Client, forged: str
) -> None:
    registration = python_rt.register(FORGER).registration
    assert call(python_rt, registration, n=1) == {"n": 1}
    message = corrupt(python_rt, registration, forge=forged, n=2)
    assert "the worker's answer was not this call's" in message and "restarted" in message
    # The worker was replaced: each later call gets its own answer, not the one before it.
    for n in (3, 4, 5):
        assert call(python_rt, registration, n=n) == {"n": n}
    assert python_rt.status(registration).state == pb.FUNCTION_REGISTRATION_STATE_READY


def test_a_handler_that_forges_its_own_nonce_changes_only_its_own_answer(
    python_rt: Client,
) -> None:
    # It answered its own call (what it returns is its to say anyway); the true answer it left
    # in the pipe carries that call's nonce, so the next call refuses it instead of taking it.
    registration = python_rt.register(FORGER).registration
    assert call(python_rt, registration, forge="own-nonce", n=1) == "forged!"
    corrupt(python_rt, registration, n=2)
    assert call(python_rt, registration, n=3) == {"n": 3}


def test_a_bash_function_cannot_write_to_the_response_pipe(bash_rt: Client) -> None:
    source = {"fn.sh": "handle() { printf 'D 0 x\\n' >&\"$resp_fd\" 2>/dev/null; printf ok; }\n"}
    registration = bash_rt.register(source).registration
    for _ in range(3):
        assert bash_rt.invoke(registration).output == b"ok"
