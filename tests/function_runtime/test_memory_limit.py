"""docs/protocol.md, "Limits": a memory limit per registration (``memory_mb``, Lambda's MemorySize
as the model): a default, a range, and when a handler needs more, a call that fails naming the
limit, a fresh worker, and a registration that stays READY."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pyarrow as pa
import pytest

from fnkernel.adapters.errors import MEMORY_LIMIT_EXCEEDED
from fnkernel.runtime_server import limits, payloads
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server.wire import ERROR_TYPE_KEY
from tests.support import Client, digest

HUNGRY_PY = {
    "handler.py": """
        import os

        def handle(event):
            if event.get("mib"):
                hoard = bytearray(event["mib"] << 20)  # touched, not only reserved
                return len(hoard)
            return os.getpid()
    """
}
HUNGRY_SH = {
    "fn.sh": """
        handle() {
            if [ "$1" = big ]; then
                local hoard
                hoard=$(head -c 200000000 /dev/zero | tr '\\0' a)
                printf '%s' "${#hoard}"
            else
                printf '%s' "$$"
            fi
        }
    """
}


def register(rt: Client, files: dict[str, str], memory_mb: int) -> pb.FunctionRegistration:
    workdir = rt.workdir(files)
    response = rt.fn.RegisterFunction(
        pb.RegisterFunctionRequest(
            run_uid=f"mem-{memory_mb}-{workdir.name}",
            registration_attempt=1,
            working_dir=str(workdir),
            handler="handler.handle" if rt.runtime == "python" else "fn.handle",
            idle_timeout_seconds=300,
            registration_digest=digest(workdir.name),
            memory_mb=memory_mb,
        ),
        timeout=30,
    )
    assert response.state == pb.FUNCTION_REGISTRATION_STATE_READY
    return response.registration


def exceeded(rt: Client, registration: pb.FunctionRegistration, payload: bytes) -> str:
    with pytest.raises(grpc.RpcError) as failed:
        rt.invoke(registration, payload)
    error = failed.value
    assert error.code() == grpc.StatusCode.UNKNOWN, error.details()
    assert dict(error.trailing_metadata())[ERROR_TYPE_KEY] == MEMORY_LIMIT_EXCEEDED  # type: ignore[attr-defined]
    return str(error.details())


def test_a_python_handler_over_its_memory_fails_naming_it_and_gets_a_fresh_worker(
    python_rt: Client,
) -> None:
    registration = register(python_rt, HUNGRY_PY, 128)
    before = int(python_rt.invoke(registration, b"{}").output)
    assert int(python_rt.invoke(registration, b'{"mib": 32}').output) == 32 << 20  # under it
    message = exceeded(python_rt, registration, b'{"mib": 512}')
    assert "needed more than its 128 MiB of memory (memoryMb); its worker was restarted" in message
    assert python_rt.status(registration).state == pb.FUNCTION_REGISTRATION_STATE_READY
    assert int(python_rt.invoke(registration, b"{}").output) != before  # a fresh worker


def test_a_payload_too_large_to_read_within_the_memory_is_memory_limit_exceeded(
    python_rt: Client,
) -> None:
    # README, "The kernel": give a function of large frames room for its payload, "or its call
    # fails with MemoryLimitExceeded, saying how to give it more" — reading the payload too,
    # not an INVALID_ARGUMENT blaming the stream. A compressed Arrow stream of 320 MB of zeros
    # is a few KiB on the wire.
    registration = register(python_rt, HUNGRY_PY, 256)
    zeros = pa.table({"x": np.zeros(40_000_000, dtype=np.int64)})
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_stream(sink, zeros.schema, options=options) as writer:
        writer.write_table(zeros)
    data = sink.getvalue().to_pybytes()
    assert len(data) < limits.MAX_PAYLOAD_BYTES
    with pytest.raises(grpc.RpcError) as failed:
        python_rt.invoke(registration, data, content_type=payloads.ARROW)
    error = failed.value
    assert error.code() == grpc.StatusCode.UNKNOWN, error.details()
    assert dict(error.trailing_metadata())[ERROR_TYPE_KEY] == MEMORY_LIMIT_EXCEEDED  # type: ignore[attr-defined]
    assert "give it more with %%function NAME --memory MIB" in str(error.details())
    assert python_rt.status(registration).state == pb.FUNCTION_REGISTRATION_STATE_READY


LISTS_PY = {
    "handler.py": """
        def handle(event):
            return {"rows": [index * event["step"] for index in range(event["n"])]}
    """
}


def test_a_json_result_within_the_memory_comes_back_and_one_past_it_is_memory_limit_exceeded(
    python_rt: Client,
) -> None:
    # docs/protocol.md, "Limits": a handler that needs more fails its call naming the limit. A
    # result of 800,000 numbers (a 5.4 MB text) fits in 128 MiB; orjson alone would reserve
    # 256 MiB of address space to write it, and crash the worker when it cannot (SIGSEGV:
    # "the worker process ended mid-call"). Two million floats, whose text and its pieces do
    # not fit beside them, fail naming the limit.
    registration = register(python_rt, LISTS_PY, 128)
    answer = python_rt.invoke(registration, b'{"n": 800000, "step": 1}')
    assert json.loads(answer.output)["rows"][-1] == 799_999
    message = exceeded(python_rt, registration, b'{"n": 2000000, "step": 0.1}')
    assert "needed more than its 128 MiB of memory (memoryMb)" in message
    assert python_rt.status(registration).state == pb.FUNCTION_REGISTRATION_STATE_READY


def test_a_bash_handler_over_its_memory_fails_naming_it(bash_rt: Client) -> None:
    registration = register(bash_rt, HUNGRY_SH, 64)
    assert bash_rt.invoke(registration, b"small").output.isdigit()
    assert "its 64 MiB of memory" in exceeded(bash_rt, registration, b"big")
    assert bash_rt.invoke(registration, b"small").output.isdigit()  # a fresh worker serves


def test_the_default_limit_holds_a_handler_that_would_take_2_gib(python_rt: Client) -> None:
    registration = register(python_rt, HUNGRY_PY, 0)
    message = exceeded(python_rt, registration, json.dumps({"mib": 2048}).encode())
    assert f"its {limits.DEFAULT_MEMORY_MB} MiB" in message


@pytest.mark.parametrize("memory_mb", [1, limits.MIN_MEMORY_MB - 1, limits.MAX_MEMORY_MB + 1, -5])
def test_a_memory_limit_out_of_range_is_invalid_argument_naming_it(
    python_rt: Client, memory_mb: int
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        register(python_rt, HUNGRY_PY, memory_mb)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("memory_mb: must be 0 (the default, 1024) or 64")


@pytest.mark.parametrize("memory_mb", [limits.MIN_MEMORY_MB, limits.MAX_MEMORY_MB])
def test_each_end_of_the_range_is_a_limit_the_server_takes(
    python_rt: Client, memory_mb: int
) -> None:
    # docs/protocol.md, "Limits": memory_mb is 64 to 16384 MiB, both ends included.
    registration = register(python_rt, HUNGRY_PY, memory_mb)
    assert python_rt.invoke(registration, b"{}").output.isdigit()


def test_a_payload_whose_package_cannot_load_within_the_memory_is_memory_limit_exceeded(
    python_rt: Client,
) -> None:
    # docs/protocol.md, "Limits": a handler of 64 MiB sent a small DataFrame cannot import
    # pandas (numpy's OpenBLAS exits when it cannot allocate; pandas' C modules fail without
    # saying why): the call fails naming the limit and how to give more, not "the worker
    # process ended mid-call", and the worker that served JSON before serves it again.
    registration = register(python_rt, HUNGRY_PY, limits.MIN_MEMORY_MB)
    before = int(python_rt.invoke(registration, b"{}").output)
    data, media = payloads.encode(pa.table({"x": np.arange(1000)}).to_pandas())
    with pytest.raises(grpc.RpcError) as failed:
        python_rt.invoke(registration, data, content_type=media)
    assert dict(failed.value.trailing_metadata())[ERROR_TYPE_KEY] == MEMORY_LIMIT_EXCEEDED  # type: ignore[attr-defined]
    assert f"needed more than its {limits.MIN_MEMORY_MB} MiB" in str(failed.value.details())
    assert python_rt.status(registration).state == pb.FUNCTION_REGISTRATION_STATE_READY
    assert int(python_rt.invoke(registration, b"{}").output) != before  # a fresh worker


@pytest.mark.parametrize(
    ("first_line", "says"),
    [
        # numpy's OpenBLAS exits as it loads, here; a module of pandas may fail first elsewhere
        (
            "import pandas",
            (" (it said: OpenBLAS error: Memory allocation", " at handler.py line 1; "),
        ),
        ("hoard = bytearray(512 << 20)", (" at handler.py line 1; ",)),
    ],
    ids=["its import of pandas", "its own allocation"],
)
def test_a_handler_that_cannot_load_within_its_memory_fails_naming_it(
    python_rt: Client, first_line: str, says: tuple[str, ...]
) -> None:
    # The same import in the handler's module, or a module that allocates more than the limit
    # as it loads: its registration fails naming the limit, and the line or what the process
    # said as it died — not "ImportModuleError: <frozen importlib._bootstrap_external> line
    # 729: MemoryError:", nor "the handler exited while loading (exit status 1)".
    source = f"{first_line}\n\ndef handle(event):\n    return 1\n"
    workdir = python_rt.workdir({"handler.py": source})
    response = python_rt.fn.RegisterFunction(
        pb.RegisterFunctionRequest(
            run_uid=f"mem-load-{workdir.name}", registration_attempt=1,
            working_dir=str(workdir), handler="handler.handle", idle_timeout_seconds=300,
            registration_digest=digest(workdir.name), memory_mb=limits.MIN_MEMORY_MB,
        ),
        timeout=60,
    )  # fmt: skip
    assert response.state == pb.FUNCTION_REGISTRATION_STATE_FAILED
    fatal = python_rt.status(response.registration).fatal_error
    assert fatal.startswith(
        f"{MEMORY_LIMIT_EXCEEDED}: loading the handler needed more than its "
        f"{limits.MIN_MEMORY_MB} MiB of memory (memoryMb) "
    ), fatal
    assert any(said in fatal for said in says), fatal
    assert fatal.endswith("give it more with %%function NAME --memory MIB, or the Run's memoryMb "
                          "(fnkernel runs create --memory MIB)")  # fmt: skip
