"""docs/protocol.md, "Limits": what one call may log is bounded in memory, in the server's log and
on disk — the first and last half MiB and 10,000 lines of each stream, with a line saying how
much was dropped — and nothing a call printed is read again by the calls after it. A component's
own log under `fnkernel up` is rotated."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import grpc
import pytest

from fnkernel.adapters.calllogs import CALL_LOG_BYTES, CALL_LOG_LINES
from fnkernel.runtime_server import logs
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server.client import Client as GatewayClient
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS
from fnkernel.runtime_server.wire import LOGS_KEY
from tests.support import Client, ServeProcess, wait_until

LOUD = {
    "handler.py": """
        import os, sys, time

        def handle(event):
            stream = getattr(sys, event.get("stream", "stdout"))
            line = "x" * (event.get("width", 1023)) + "\\n"
            for n in range(event["lines"]):
                stream.write(f"{n:09d} {line}")
            stream.write(event.get("end", "last line\\n"))
            stream.flush()
            if event.get("wait_trimmed"):  # until the reaper freed the middle on disk
                deadline = time.monotonic() + 10
                while os.fstat(stream.fileno()).st_blocks * 512 > 4 << 20:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
                return os.fstat(stream.fileno()).st_blocks * 512
            return "done"
    """
}


def invoke_with_logs(
    rt: Client, registration: pb.FunctionRegistration, event: dict
) -> tuple[object, list[str]]:  # type: ignore[type-arg]
    response, call = rt.fn.InvokeFunction.with_call(
        pb.InvokeFunctionRequest(
            registration=registration,
            input=json.dumps(event).encode(),
            content_type="application/json",
        ),
        timeout=60,
    )
    trailer = json.loads(dict(call.trailing_metadata()).get(LOGS_KEY, "[]"))
    return json.loads(response.output), [line["text"] for line in trailer]


def server_log(
    caplog: pytest.LogCaptureFixture, registration: pb.FunctionRegistration
) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if getattr(record, "run_uid", None) == registration.run_uid
    ]


def test_a_call_that_logs_20_mib_keeps_its_first_and_last_lines_and_says_what_it_dropped(
    python_rt: Client, caplog: pytest.LogCaptureFixture
) -> None:
    registration = python_rt.register(LOUD).registration
    caplog.set_level(logging.INFO, logger="fnkernel.function")
    output, trailer = invoke_with_logs(python_rt, registration, {"lines": 20_000})
    assert output == "done"
    assert trailer[-1] == "last line"  # the caller still sees how the call ended
    logged = server_log(caplog, registration)
    assert logged[0].startswith("000000000 x") and logged[-1] == "last line"
    markers = [text for text in logged if text.startswith("[fnkernel: ")]
    assert (
        len(markers) == 1
        and "of stdout dropped: a call keeps the first and last 512 KiB" in markers[0]
    )
    dropped = int(markers[0].split()[1])
    assert 20_000 * 1034 - CALL_LOG_BYTES <= dropped <= 20_000 * 1034
    assert sum(len(text) + 1 for text in logged) <= CALL_LOG_BYTES + 4096


def test_a_call_of_many_short_lines_keeps_10000_of_them(
    python_rt: Client, caplog: pytest.LogCaptureFixture
) -> None:
    registration = python_rt.register(LOUD).registration
    caplog.set_level(logging.INFO, logger="fnkernel.function")
    invoke_with_logs(python_rt, registration, {"lines": 50_000, "width": 0, "stream": "stderr"})
    logged = server_log(caplog, registration)
    assert len(logged) == CALL_LOG_LINES + 1  # and the line saying so
    assert "(40001 lines) of stderr dropped" in logged[CALL_LOG_LINES // 2]
    assert logged[-1] == "last line"


def test_a_partial_line_left_at_the_end_of_a_call_is_never_read_again(
    python_rt: Client, caplog: pytest.LogCaptureFixture
) -> None:
    # 4 MiB on stderr with no newline at the end: it belongs to that call, not to every later one.
    registration = python_rt.register(LOUD).registration
    caplog.set_level(logging.INFO, logger="fnkernel.function")
    invoke_with_logs(
        python_rt, registration, {"lines": 0, "stream": "stderr", "end": "p" * (4 << 20)}
    )
    first = server_log(caplog, registration)
    assert first[0].startswith("ppp") and first[-1].startswith("ppp")
    caplog.clear()
    for _ in range(3):
        _, later = invoke_with_logs(python_rt, registration, {"lines": 1})
        assert not any(text.startswith("p") for text in later)
    assert not any(text.startswith("p") for text in server_log(caplog, registration))


def peak_rss_mib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return (
        int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1])
        >> 10
    )


@pytest.mark.timeout(120)
def test_300_mb_printed_in_one_call_costs_the_server_neither_memory_nor_disk(
    server_process,
    workspace: Path,  # type: ignore[no-untyped-def]
) -> None:
    # Before: the server read the whole append in one pread (~1 GB of memory) and wrote all of it
    # to its log; the scratch file kept 300 MB on disk.
    server: ServeProcess = server_process("--runtime", "python")
    channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    try:
        rt = Client(channel, workspace, "python")
        registration = rt.register(LOUD).registration
        before = peak_rss_mib(server.pid)
        on_disk, trailer = invoke_with_logs(
            rt, registration, {"lines": 300_000, "wait_trimmed": True}
        )
        assert trailer[-1] == "last line"
        assert isinstance(on_disk, int) and on_disk <= 4 << 20, "the middle was freed on disk"
        assert peak_rss_mib(server.pid) - before < 64
        assert invoke_with_logs(rt, registration, {"lines": 1})[0] == "done"
    finally:
        channel.close()


def test_a_component_log_over_its_limit_moves_to_log_1_and_starts_again(tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    writer = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # the component's
    try:
        os.write(writer, b"old line\n" * 1000)
        assert not logs.rotate(log, limit=1 << 20)  # under the limit: left alone
        assert logs.rotate(log, limit=4096)
        assert (tmp_path / "gateway.log.1").read_bytes() == b"old line\n" * 1000
        assert oct((tmp_path / "gateway.log.1").stat().st_mode & 0o777) == "0o600"
        os.write(writer, b"new line\n")  # O_APPEND: the component writes on, from the start
        assert log.read_bytes() == b"new line\n"
        os.write(writer, b"more\n" * 1000)
        assert logs.rotate(log, limit=4096)  # the older copy is replaced, not kept forever
        assert (tmp_path / "gateway.log.1").read_bytes().startswith(b"new line\nmore\n")
    finally:
        os.close(writer)


def test_fnkernel_ups_supervisor_rotates_each_components_log(
    stack_factory,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    monkeypatch.setattr(logs, "COMPONENT_LOG_BYTES", 64 << 10)
    stack = stack_factory({"python": 1})
    client = GatewayClient(stack.gateway_address)
    files = {"handler.py": "def handle(e):\n    print('y' * 1000)\n    return 1\n"}
    client.create_run("chatty", runtime="python", handler="handler.handle", files=files)
    for _ in range(100):
        client.invoke("chatty", {})
    log = stack.log_dir / "python-0-server.log"
    # 100 calls of a 1000-byte line each are ~130 KiB of the server's log: it rotated.
    wait_until(lambda: (stack.log_dir / "python-0-server.log.1").exists(), timeout=10)
    wait_until(lambda: log.stat().st_size < 64 << 10, timeout=5)
