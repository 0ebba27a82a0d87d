"""docs/protocol.md, "Large payloads", at the Runtime Server: a payload past one message waits in
the node's spool. An input streamed in by PutPayload (or written there by a caller on the same
machine) is named by ``x-fn-input-ref``, and is gone once its call ends, however it ends. An
output from the size ``x-fn-output-ref-from`` asks for is spooled, named in the trailer, and
TakePayload streams it out once and removes it. The seed's unary call keeps its meaning."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from fnkernel.runtime_server import payloads
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import payloads_pb2
from fnkernel.runtime_server.function_runtime.server import RuntimeServer
from fnkernel.runtime_server.function_runtime.spool import (
    CHUNK_BYTES,
    SPOOL_GRACE_SECONDS,
    Spool,
    new_name,
)
from fnkernel.runtime_server.wire import INPUT_REF_KEY, OUTPUT_REF_FROM_KEY, OUTPUT_REF_KEY
from tests.function_runtime.statuses import rejected
from tests.support import ECHO_SH, Client, serve_in_process, spooled, wait_until

MIB = 1 << 20
HANDLER = {
    "handler.py": """
        import time

        def handle(event):
            if isinstance(event, dict) and "sleep" in event:
                time.sleep(event["sleep"])
            if isinstance(event, dict) and "mib" in event:
                return b"x" * (event["mib"] << 20)
            return event
    """
}


@pytest.fixture
def spool(tmp_path: Path) -> Spool:
    return Spool(tmp_path / "spool", 256 * MIB)


@pytest.fixture
def python_spooled(workspace: Path, tmp_path: Path, spool: Spool) -> Iterator[Client]:
    yield from serve_in_process("python", workspace, f"unix:{tmp_path}/py.sock", spool)


def put(rt: Client, data: bytes, size: int | None = None) -> str:
    def chunks() -> Iterator[payloads_pb2.PayloadChunk]:
        for start in range(0, max(len(data), 1), CHUNK_BYTES):
            first = start == 0
            yield payloads_pb2.PayloadChunk(
                size=len(data) if size is None or not first else size,
                data=data[start : start + CHUNK_BYTES],
            )

    return str(rt.payloads.PutPayload(chunks(), timeout=60).name)


def take(rt: Client, name: str) -> bytes:
    return b"".join(
        chunk.data
        for chunk in rt.payloads.TakePayload(payloads_pb2.PayloadRef(name=name), timeout=60)
    )


def output_ref(response_call: object) -> tuple[str, int]:
    trailers = dict(response_call.trailing_metadata())  # type: ignore[attr-defined]
    name, size = trailers[OUTPUT_REF_KEY].split()
    return name, int(size)


def test_a_dataframe_past_one_message_goes_in_and_out_through_the_spool(
    python_spooled: Client, spool: Spool
) -> None:
    registration = python_spooled.register(HANDLER).registration
    frame = pd.DataFrame({"x": np.arange(2_000_000, dtype=np.int64), "y": 1.5})  # ~32 MiB
    data, content_type = payloads.encode(frame)
    assert len(data) > 16 * MIB  # past what one message may carry at all
    name = put(python_spooled, data)
    response, call = python_spooled.fn.InvokeFunction.with_call(
        _request(registration, content_type),
        metadata=((INPUT_REF_KEY, name), (OUTPUT_REF_FROM_KEY, str(MIB))),
        timeout=60,
    )
    assert response.output == b"" and response.content_type == payloads.ARROW
    out, size = output_ref(call)
    assert not (spool.directory / name).exists()  # the input went with its call
    assert (spool.directory / out).stat().st_size == size
    pd.testing.assert_frame_equal(payloads.decode(take(python_spooled, out), payloads.ARROW), frame)
    assert spooled(spool.directory) == []  # taken once, and gone


def test_a_spooled_output_of_octets_is_written_into_the_pages_its_input_left(
    python_spooled: Client, spool: Spool
) -> None:
    # docs/protocol.md, "Pages written again": the input, read, is kept as a free file, and the
    # worker writes its result there as it writes any payload file (0600, cut to size).
    registration = python_spooled.register(HANDLER).registration
    name = put(python_spooled, json.dumps({"mib": 2, "pad": "x" * (3 * MIB)}).encode())
    inode = (spool.directory / name).stat().st_ino
    response, call = python_spooled.fn.InvokeFunction.with_call(
        _request(registration, payloads.JSON),
        metadata=((INPUT_REF_KEY, name), (OUTPUT_REF_FROM_KEY, str(MIB))),
        timeout=60,
    )
    assert response.content_type == payloads.OCTET
    out, size = output_ref(call)
    written = (spool.directory / out).stat()
    assert size == 2 * MIB
    assert (written.st_ino, written.st_size, written.st_mode & 0o777) == (inode, size, 0o600)
    assert take(python_spooled, out) == b"x" * (2 * MIB)


def test_a_spooled_arrow_input_is_a_view_of_the_file_not_a_copy(python_spooled: Client) -> None:
    # docs/protocol.md, "Large payloads": the worker maps a spooled Arrow stream; the Table it
    # reads is its 32 MiB where the spool's file is mapped, in no memory of its own.
    source = {
        "handler.py": """
            def mapped_from(address):
                with open("/proc/self/maps") as maps:
                    for line in maps:
                        span, *fields = line.split(None, 5)
                        path = fields[4].strip() if len(fields) == 5 else ""
                        start, end = (int(n, 16) for n in span.split("-"))
                        if start <= address < end:  # removed from the spool, still mapped
                            return path.removesuffix(" (deleted)").rsplit("/", 1)[-1]
                return ""

            def handle(table):
                data = table.column("x").chunks[0].buffers()[1]
                return {"rows": table.num_rows, "mapped from": mapped_from(data.address)}
        """
    }
    registration = python_spooled.register(source).registration
    table = pa.table({"x": np.arange(4_000_000, dtype=np.int64)})
    data, content_type = payloads.encode(table)
    name = put(python_spooled, data)
    answer = python_spooled.invoke(
        registration, b"", content_type=content_type, metadata=((INPUT_REF_KEY, name),)
    )
    assert json.loads(answer.output) == {"rows": 4_000_000, "mapped from": name}


def test_an_output_under_the_size_asked_for_is_answered_inline(python_spooled: Client) -> None:
    registration = python_spooled.register(HANDLER).registration
    response, call = python_spooled.fn.InvokeFunction.with_call(
        _request(registration, payloads.JSON, b'{"mib": 0}'),
        metadata=((OUTPUT_REF_FROM_KEY, str(MIB)),),
        timeout=60,
    )
    assert OUTPUT_REF_KEY not in dict(call.trailing_metadata())
    assert response.content_type == payloads.OCTET and response.output == b""
    # without the metadata: the seed's call, inline, its 6 MiB bound as ever
    with pytest.raises(grpc.RpcError) as too_large:
        python_spooled.invoke(registration, b'{"mib": 7}')
    assert "OutputTooLarge" in (too_large.value.details() or "")


def test_a_cancelled_call_leaves_nothing_in_the_spool(python_spooled: Client, spool: Spool) -> None:
    registration = python_spooled.register(HANDLER).registration
    name = put(python_spooled, b'{"sleep": 60}')
    future = python_spooled.fn.InvokeFunction.future(
        _request(registration, payloads.JSON),
        metadata=((INPUT_REF_KEY, name), (OUTPUT_REF_FROM_KEY, "1")),
        timeout=60,
    )
    wait_until(lambda: python_spooled.status(registration).in_flight, timeout=10)
    future.cancel()
    wait_until(lambda: not python_spooled.status(registration).in_flight, timeout=10)
    assert spooled(spool.directory) == []


def test_what_nobody_claimed_is_swept_with_no_call_of_the_servers(spool: Spool) -> None:
    # docs/protocol.md, "Nothing is left behind": removed once 10 minutes old, each Runtime
    # Server looking every minute — not only when a PutPayload comes, as a caller on the same
    # machine writes and takes its payloads as files (here: every 10 ms).
    unclaimed, fresh = spool.path(new_name("out")), spool.path(new_name("in"))
    unclaimed.write_bytes(b"a result nobody took")
    fresh.write_bytes(b"an input about to be called")
    aged = time.time() - SPOOL_GRACE_SECONDS - 1
    os.utime(unclaimed, (aged, aged))
    _swept(spool, unclaimed, fresh)


def _swept(spool: Spool, gone: Path, kept: Path) -> None:
    """`spool` swept every 10 ms until `gone` is, `kept` not."""
    stop = threading.Event()
    sweeper = spool.start_sweeping(stop, every=0.01)
    try:
        wait_until(lambda: not gone.exists(), timeout=10)
        assert kept.exists()
    finally:
        stop.set()
        sweeper.join(10)


def test_a_free_file_unused_for_a_minute_is_swept_with_no_payload_written(spool: Spool) -> None:
    # docs/protocol.md, "Pages written again": a free file is kept at most a minute unused,
    # also by a spool nothing is written to or read from (its sweep's): an idle kernel kept
    # a 1 GB call's pages in memory until the next large call.
    now = time.monotonic_ns()
    stale = spool.directory / f"{payloads.FREE_PREFIX}5-{now - 61 * 10**9}-old"
    fresh = spool.directory / f"{payloads.FREE_PREFIX}5-{now}-new"
    for path in (stale, fresh):
        path.write_bytes(b"pages")
    _swept(spool, stale, fresh)


def test_a_stopping_server_drops_its_spools_free_files(workspace: Path, spool: Spool) -> None:
    # docs/protocol.md, "Pages written again": free files are a cache of the stack's; a server
    # that stops (its kernel killed: it stops with its parent) takes them with it, rather than
    # leave a 1 GB call's pages in memory until the next stack starts.
    free = spool.directory / f"{payloads.FREE_PREFIX}5-{time.monotonic_ns()}-kept"
    server = RuntimeServer("python", workspace, spool=spool)
    server.start("unix:" + str(spool.directory.parent / "stop.sock"))
    free.write_bytes(b"pages")
    server.stop(drain_seconds=0)
    assert not free.exists()


@pytest.mark.parametrize("ends", ["timed out", "worker killed"])
def test_a_call_that_ends_badly_leaves_nothing_in_the_spool(
    python_spooled: Client, spool: Spool, ends: str
) -> None:
    # docs/protocol.md, "Large payloads": however the call ends — past its deadline, or its
    # worker gone mid-call — neither its input nor an output is left.
    source = {
        "handler.py": """
            import os, time

            def handle(event):
                if event == b"die":
                    os._exit(3)
                time.sleep(60)
        """
    }
    registration = python_spooled.register(source).registration
    name = put(python_spooled, b"die" if ends == "worker killed" else b"wait")
    with pytest.raises(grpc.RpcError) as ended:
        python_spooled.invoke(
            registration,
            b"",
            content_type=payloads.OCTET,
            timeout_millis=500,
            metadata=((INPUT_REF_KEY, name), (OUTPUT_REF_FROM_KEY, "1")),
        )
    expected = "DEADLINE_EXCEEDED" if ends == "timed out" else "UNKNOWN"
    assert ended.value.code().name == expected, ended.value.details()
    assert spooled(spool.directory) == []


def test_what_the_spool_refuses_is_named(python_spooled: Client, spool: Spool) -> None:
    registration = python_spooled.register(HANDLER).registration
    rejected(
        lambda: python_spooled.invoke(registration, b"", metadata=((INPUT_REF_KEY, "../etc"),)),
        INPUT_REF_KEY,
        "is not a spooled payload's name",
    )
    rejected(
        lambda: python_spooled.invoke(
            registration, b"", metadata=((INPUT_REF_KEY, "in-" + "a" * 22),)
        ),
        INPUT_REF_KEY,
        "no spooled payload",
    )
    # docs/protocol.md, "Pages written again": a free file is an earlier payload's pages, never
    # a payload a caller may name.
    free = spool.directory / ("free-" + "b" * 22)
    free.write_bytes(b'{"earlier": "payload"}')
    rejected(
        lambda: python_spooled.invoke(registration, b"", metadata=((INPUT_REF_KEY, free.name),)),
        INPUT_REF_KEY,
        "is not a spooled payload's name",
    )
    free.unlink()
    # Nor is another call's result, which only its own caller takes.
    result = spool.directory / ("out-" + "c" * 22)
    result.write_bytes(b'{"another": "result"}')
    rejected(
        lambda: python_spooled.invoke(registration, b"", metadata=((INPUT_REF_KEY, result.name),)),
        INPUT_REF_KEY,
        "is an output's name, not an input's",
    )
    assert result.read_bytes() == b'{"another": "result"}'  # neither read nor taken
    result.unlink()
    with pytest.raises(grpc.RpcError) as short:
        put(python_spooled, b"abc", size=10)
    assert short.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "3 bytes, not the 10 the size said" in (short.value.details() or "")
    with pytest.raises(grpc.RpcError) as large:
        put(python_spooled, b"abc", size=spool.max_bytes + 1)
    assert large.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert spooled(spool.directory) == []


@pytest.fixture
def bash_spooled(workspace: Path, tmp_path: Path, spool: Spool) -> Iterator[Client]:
    yield from serve_in_process("bash", workspace, f"unix:{tmp_path}/sh.sock", spool)


def test_a_bash_function_takes_a_spooled_input_of_one_message_and_names_its_bound_past_it(
    bash_spooled: Client, spool: Spool
) -> None:
    # docs/protocol.md, "Large payloads": the bash runtime takes its input inline, a spooled one
    # read into its frame — so one message's 6 MiB bounds it, whatever the spool's bound, and
    # the refusal says so.
    registration = bash_spooled.register(ECHO_SH, handler="fn.handle").registration
    inline = json.dumps("x" * (MIB - 2)).encode()  # one MiB, spooled all the same
    name = put(bash_spooled, inline)
    answer = bash_spooled.invoke(registration, b"", metadata=((INPUT_REF_KEY, name),))
    assert answer.output == inline  # its $1: the payload as it came
    past = json.dumps("x" * (7 * MIB)).encode()
    name = put(bash_spooled, past)
    rejected(
        lambda: bash_spooled.invoke(registration, b"", metadata=((INPUT_REF_KEY, name),)),
        "input",
        f"{len(past)} bytes; at most {6 * MIB} for this runtime, which takes its input inline",
    )
    assert spooled(spool.directory) == []  # neither input stays


def _request(registration: object, content_type: str, data: bytes = b"") -> object:
    from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb

    return pb.InvokeFunctionRequest(
        registration=registration,
        input=data,
        content_type=content_type,  # type: ignore[arg-type]
    )
