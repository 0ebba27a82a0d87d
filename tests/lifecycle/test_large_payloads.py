"""docs/protocol.md, "Large payloads", through a stack of real processes: a payload or a result
past one message (6 MiB), up to --max-payload-bytes, from the client, the CLI and plain HTTP —
streamed through the gateway and runtimed from another machine, handed over as a file in the
stack's spool on the same one — and nothing of it left behind when the call ends, however it
ends."""

from __future__ import annotations

import errno
import http.client
import io
import json
import socket
import subprocess
import sys
import threading
import tracemalloc
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fnkernel.runtime_server import limits, payloads, wire
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import (
    GatewayError,
    GatewayUnreachable,
    PayloadTooLarge,
    RequestCancelled,
)
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.support import find_token, http_call, spooled, wait_until

pytestmark = pytest.mark.timeout(300)
MIB = 1 << 20
HANDLER = {
    "handler.py": (
        "import time\n"
        "import numpy as np\n"
        "import pandas as pd\n"
        "def handle(event):\n"
        "    if isinstance(event, pd.DataFrame) and 'sleep' in event.columns:\n"
        "        time.sleep(float(event['sleep'].iloc[0]))\n"
        "    if isinstance(event, dict) and 'hold' in event:\n"
        "        print('holding', flush=True)\n"
        "        time.sleep(event['hold'])\n"
        "    if isinstance(event, dict) and 'rss' in event:  # what this worker holds now\n"
        "        status = open('/proc/self/status').read().split('RssAnon:')[1]\n"
        "        return int(status.split()[0]) * 1024\n"
        "    if isinstance(event, dict) and 'mib' in event:\n"
        "        return np.frombuffer(b'\\x07' * (event['mib'] << 20), dtype=np.uint8)\n"
        "    if isinstance(event, (bytes, np.ndarray)):\n"
        "        return {'size': len(event), 'sum': int(np.frombuffer(event, np.uint8).sum())\n"
        "                if isinstance(event, bytes) else int(event.sum())}\n"
        "    return event\n"
    )
}


@pytest.fixture
def stack(stack_factory: Callable[..., Stack]) -> Iterator[Stack]:
    stack = stack_factory({"python": 1})
    client = Client(stack.gateway_address)
    run = client.create_run("big", runtime="python", handler="handler.handle", files=HANDLER,
                            memory_mb=4096)  # fmt: skip
    assert run.phase == "Ready", run.message
    yield stack
    assert spooled(stack.spool) == []  # nothing of any call is left


def mixed_frame(rows: int) -> pd.DataFrame:
    at = pd.date_range("2026-01-01", periods=rows, freq="s", tz="Europe/Paris")
    frame = pd.DataFrame({
        "count": pd.array(np.arange(rows), dtype="Int64"),
        "at": at,
        "grade": pd.Categorical(np.where(np.arange(rows) % 3, "a", "b")),
        "ratio": np.linspace(0, 1, rows),
    })  # fmt: skip
    frame.loc[::7, "count"] = None
    frame.loc[::11, "at"] = pd.NaT
    return frame


@pytest.mark.parametrize("by_reference", [True, False], ids=["same machine", "streamed"])
def test_a_dataframe_past_one_message_comes_back_as_it_went(
    stack: Stack, by_reference: bool
) -> None:
    # Same machine: written once into the spool, read by the worker in place (mapped), the
    # answer mapped likewise; streamed: every byte through the gateway and runtimed, as from
    # another machine.
    frame = mixed_frame(600_000)  # ~20 MiB as Arrow
    client = Client(stack.gateway_address)
    result = client.invoke("big", frame, by_reference=by_reference)
    pd.testing.assert_frame_equal(result.value(), frame)
    assert result.content_type == payloads.ARROW
    assert (result.output == b"") is by_reference  # by reference: nothing in the answer


@pytest.mark.parametrize(
    "value",
    [{"s": "x" * limits.SPOOL_FROM_BYTES}, b"\x05" * limits.SPOOL_FROM_BYTES],
    ids=["JSON", "octets"],
)
def test_a_payload_of_128_kib_is_handed_over_as_a_file(stack: Stack, value: object) -> None:
    # docs/protocol.md, "Large payloads": on one machine a client writes a payload of 128 KiB
    # or more into the spool once and sends its name as X-Fn-Input-Ref with an empty body.
    assert limits.SPOOL_FROM_BYTES == 128 << 10
    client = Client(stack.gateway_address)
    client._direct_allowed = lambda: False  # type: ignore[method-assign]  # the HTTP request's shape
    sent: list[tuple[bytes, dict[str, str]]] = []
    request = client.request

    def recorded(method: str, path: str, body: bytes = b"", headers: object = None, **kw: object):
        sent.append((body, dict(headers or {})))  # type: ignore[call-overload]
        return request(method, path, body, headers, **kw)  # type: ignore[arg-type]

    client.request = recorded  # type: ignore[method-assign]
    result = client.invoke("big", value)
    [body] = [body for body, headers in sent if "X-Fn-Input-Ref" in headers]
    assert body == b""
    if isinstance(value, dict):
        assert result.value() == value and result.output == b""  # answered by reference too
    else:
        assert result.value() == {"size": len(value), "sum": 5 * len(value)}


def test_a_1_gib_call_in_and_out(stack: Stack) -> None:
    # docs/protocol.md, "Large payloads": up to 2 GiB by default. In: 1 GiB of bytes streamed
    # through the gateway (from a client that is not on this machine, as far as it lets on);
    # out: 1 GiB as an array, handed back through the spool.
    client = Client(stack.gateway_address)
    data = b"\x01" * (1 << 30)
    assert client.invoke("big", data, by_reference=False).value() == {
        "size": 1 << 30, "sum": 1 << 30,
    }  # fmt: skip
    del data
    array = client.invoke("big", {"mib": 1024}).value()
    assert array.shape == (1 << 30,) and int(array[:: 1 << 20].sum()) == 7 * 1024


def test_an_idle_worker_gives_a_large_frames_memory_back(stack: Stack) -> None:
    # docs/protocol.md, "What a handler sees": the worker converts payloads on Arrow's jemalloc
    # allocator, which hands a freed frame's pages back within its decay (10 s); on pyarrow's
    # default, mimalloc, they stayed resident in the idle worker.
    client = Client(stack.gateway_address)

    def held() -> int:
        return client.invoke("big", {"rss": True}).value()

    client.invoke("big", mixed_frame(1_000)).value()  # pyarrow loaded
    resting = held()
    frame = mixed_frame(4_000_000)  # ~130 MiB as Arrow, by reference both ways
    assert len(client.invoke("big", frame).value()) == len(frame)
    wait_until(lambda: held() < resting + 32 * MIB, timeout=90, interval=0.5)


@pytest.mark.parametrize(
    "env, allocator", [({}, "jemalloc"), ({"ARROW_DEFAULT_MEMORY_POOL": "system"}, "system")]
)
def test_a_handler_converts_on_jemalloc_unless_its_run_names_an_allocator(
    stack: Stack, env: dict[str, str], allocator: str
) -> None:
    # docs/protocol.md, "What a handler sees": the worker's Arrow allocator, and pyarrow's
    # own setting in the Run's env, which the worker leaves to pyarrow.
    client = Client(stack.gateway_address)
    files = {"handler.py": "import pyarrow as pa\n"
             "def handle(frame):\n"
             "    return pa.default_memory_pool().backend_name\n"}  # fmt: skip
    run = client.create_run(
        "pool", runtime="python", handler="handler.handle", files=files, env=env
    )
    assert run.phase == "Ready", run.message
    assert client.invoke("pool", pd.DataFrame({"a": [1, 2]})).value() == allocator


def test_an_interrupt_while_a_large_result_is_read_says_the_call_was_over(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/protocol.md, "Kernel": an interrupt as a large result is read from the spool comes
    # after the handler returned — the kernel must not say it was killed: the client marks it.
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(payloads, "decode_file", interrupted)
    with pytest.raises(KeyboardInterrupt) as caught:
        Client(stack.gateway_address).invoke("big", {"mib": 1})
    assert getattr(caught.value, "answered", False) is True


def test_a_cancelled_large_call_leaves_no_shared_memory(stack: Stack) -> None:
    # docs/protocol.md, "Large payloads": the input is removed when the call ends, however it
    # ends — here cancelled by its client (a kernel interrupt) while the handler runs.
    caller = Client(stack.gateway_address)
    failure: list[BaseException] = []

    def call() -> None:
        try:
            caller.invoke("big", pd.DataFrame({"sleep": 60.0, "pad": np.zeros(MIB // 2)}))
        except BaseException as exc:
            failure.append(exc)

    # Handed over through the spool: the client finds it on this machine. (Waiting to see the
    # file there raced the worker, which takes it from its name as soon as it reads it; with
    # the conversions ~2 ms faster the wait missed it once in CI.)
    assert caller.local_spool() is not None
    thread = threading.Thread(target=call)
    thread.start()
    gateway = Client(stack.gateway_address)
    wait_until(lambda: (gateway.status("big")["live"] or {}).get("inFlight") == 1, timeout=30)
    caller.cancel()
    thread.join(30)
    assert isinstance(failure[0], RequestCancelled)
    wait_until(lambda: not spooled(stack.spool), timeout=30)


def test_plain_http_streams_a_large_body_and_answer(stack: Stack) -> None:
    # Any HTTP client: a 20 MiB octet body in, a 20 MiB Arrow answer out, whole.
    body = bytes(range(256)) * (80 * 1024)
    status, headers, answer = http_call(
        stack.gateway_address, "POST", "/v1/runs/big:invoke", body,
        {"Content-Type": payloads.OCTET},
    )  # fmt: skip
    assert status == 200 and answer == b'{"size":20971520,"sum":2673868800}'
    status, headers, answer = http_call(
        stack.gateway_address, "POST", "/v1/runs/big:invoke", b'{"mib": 20}'
    )
    assert (status, headers["Content-Type"], int(headers["Content-Length"])) == (
        200, payloads.ARROW, len(answer),
    )  # fmt: skip
    assert payloads.decode(answer, payloads.ARROW).shape == (20 * MIB,)


def test_a_spooled_result_the_caller_will_not_take_is_removed(stack: Stack) -> None:
    # docs/protocol.md, "Nothing is left behind": an output is removed when the caller will not
    # take it — refused by its Accept (406), whether the gateway was to send it or to name it —
    # and not left in the spool's memory for the sweep, ten minutes on. The fixture checks.
    for by_reference in ({}, {wire.OUTPUT_REF_FROM_HEADER: "1"}):
        status, _, answer = http_call(
            stack.gateway_address, "POST", "/v1/runs/big:invoke", b'{"mib": 7}',
            {"Accept": payloads.JSON, **by_reference},
        )  # fmt: skip
        assert status == 406, answer
        wait_until(lambda: not spooled(stack.spool), timeout=10)


def test_a_large_body_whose_call_is_refused_leaves_nothing(stack: Stack) -> None:
    # docs/protocol.md, "Nothing is left behind": a body the gateway streamed into the spool is
    # removed when its call is refused before it runs (the Run busy with another call: 429),
    # not left in the spool's memory for the sweep, ten minutes on; and a header that is wrong
    # is refused before the body is taken at all.
    client = Client(stack.gateway_address)
    holding = threading.Event()
    held: list[BaseException] = []

    def hold() -> None:
        try:
            client.invoke("big", {"hold": 60}, on_log=lambda line: holding.set())
        except BaseException as error:  # cancelled below
            held.append(error)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(30)
        body = bytes(7 * MIB)
        status, _, answer = http_call(
            stack.gateway_address, "POST", "/v1/runs/big:invoke", body,
            {"Content-Type": payloads.OCTET},
        )  # fmt: skip
        assert status == 429, answer
        wait_until(lambda: not spooled(stack.spool), timeout=10)
        # As curl sends a large body: the headers first, asking whether to go on.
        status_line = _asked_first(stack, body, {wire.TIMEOUT_HEADER: "abc"})
        assert status_line.startswith(b"HTTP/1.1 400"), status_line
        wait_until(lambda: not spooled(stack.spool), timeout=10)
    finally:
        client.cancel()
        holder.join(30)
    assert isinstance(held[0], RequestCancelled)


def _asked_first(stack: Stack, body: bytes, headers: dict[str, str]) -> bytes:
    """POST `body` to big:invoke with `headers`, as curl does a large body (Expect:
    100-continue, the body sent once the gateway says to go on): the answer's status line."""
    url = urllib.parse.urlsplit(stack.gateway_address)
    sent = {
        "Host": url.netloc,
        "Authorization": f"Bearer {find_token(url.geturl())}",
        "Content-Type": payloads.OCTET,
        "Content-Length": str(len(body)),
        "Expect": "100-continue",
        **headers,
    }
    request = "POST /v1/runs/big:invoke HTTP/1.1\r\n"
    request += "".join(f"{name}: {value}\r\n" for name, value in sent.items()) + "\r\n"
    with socket.create_connection((url.hostname or "", url.port or 80), timeout=60) as sock:
        sock.sendall(request.encode())
        answer = sock.makefile("rb")
        status_line = answer.readline()
        if b" 100 " in status_line:
            while answer.readline() not in (b"\r\n", b""):
                pass
            sock.sendall(body)
            status_line = answer.readline()
        return status_line


def test_a_caller_gone_in_the_middle_of_a_spooled_result_leaves_nothing(stack: Stack) -> None:
    # docs/protocol.md, "Nothing is left behind": gone in the middle of its body.
    url = urllib.parse.urlsplit(stack.gateway_address)
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    headers = {"Content-Type": payloads.JSON, "Authorization": f"Bearer {find_token(url.geturl())}"}
    connection.request("POST", "/v1/runs/big:invoke", b'{"mib": 40}', headers)
    response = connection.getresponse()
    assert response.status == 200 and len(response.read(MIB)) == MIB
    response.close()  # gone, 39 MiB unread
    connection.close()
    wait_until(lambda: not spooled(stack.spool), timeout=30)


def test_the_cli_sends_and_writes_a_large_payload(stack: Stack, tmp_path: Path) -> None:
    data, content_type = payloads.encode(mixed_frame(300_000))
    assert len(data) > 6 * MIB
    out = tmp_path / "back.arrows"
    done = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "invoke", "big", "-",
         "--content-type", content_type, "--output", str(out),
         "--gateway", stack.gateway_address],
        input=data, capture_output=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    pd.testing.assert_frame_equal(
        payloads.decode(out.read_bytes(), payloads.ARROW), mixed_frame(300_000)
    )


# The CLI, reporting at exit the most memory it held at once (its mm's high-water mark: a
# child's ru_maxrss would count its parent's pages as they were at the fork).
_PEAK_REPORTED = (
    "import atexit, runpy, sys\n"
    "where = sys.argv.pop(1)\n"
    "def report():\n"
    "    peak = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
    "    open(where, 'w').write(peak.split()[1])\n"
    "atexit.register(report)\n"
    "runpy.run_module('fnkernel.runtime_server.cli', run_name='__main__')\n"
)


def _cli_invoke(stack: Stack, args: list[str], stdin: object, peak: Path) -> tuple[int, bytes, int]:
    """`fnkernel invoke big ARGS` with `stdin` (a file, or DEVNULL): its exit code, its stderr,
    and the most memory it held at once (bytes)."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_REPORTED, str(peak), "invoke", "big", *args,
         "--gateway", stack.gateway_address],
        stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120,
    )  # fmt: skip
    return done.returncode, done.stderr, int(peak.read_text()) * 1024


def test_the_cli_on_the_stacks_machine_holds_neither_payload_nor_result_whole(
    stack: Stack, tmp_path: Path
) -> None:
    # docs/protocol.md, "Large payloads": on the stack's machine the CLI writes a payload from
    # its stdin into the spool, and a result from the spool to --output, a MiB at a time — the
    # worker maps the one and writes the other, and the CLI holds neither whole.
    size = 96 * MIB
    peak_file = tmp_path / "peak"
    _, _, resting = _cli_invoke(stack, ['{"small": 1}'], subprocess.DEVNULL, peak_file)
    payload = tmp_path / "in.bin"
    payload.write_bytes(b"\x03" * size)
    with payload.open("rb") as stdin:
        code, stderr, peak = _cli_invoke(
            stack, ["-", "--content-type", payloads.OCTET], stdin, peak_file
        )
    assert code == 0, stderr
    assert peak - resting < 8 * MIB, (peak - resting) / MIB  # a MiB at a time
    out = tmp_path / "out.arrows"
    code, stderr, peak = _cli_invoke(stack, ['{"mib": 96}', "--output", str(out)],
                                     subprocess.DEVNULL, peak_file)  # fmt: skip
    assert code == 0, stderr
    assert peak - resting < 8 * MIB, (peak - resting) / MIB
    assert f"({out.stat().st_size} bytes)".encode() in stderr
    array = payloads.decode(out.read_bytes(), payloads.ARROW)
    assert array.shape == (size,) and int(array[::MIB].sum()) == 7 * 96


def test_a_file_in_and_a_file_out_from_the_client(stack: Stack, tmp_path: Path) -> None:
    # Client.invoke: `data` a binary file, read into the spool; `write_to` an open file the
    # result's bytes go to as they came; the result then holds none of them.
    client = Client(stack.gateway_address)
    payload = tmp_path / "in.bin"
    payload.write_bytes(b"\x02" * (3 * MIB))
    with payload.open("rb") as data:
        assert client.invoke("big", data=data, content_type=payloads.OCTET).value() == {
            "size": 3 * MIB, "sum": 6 * MIB,
        }  # fmt: skip
    with (tmp_path / "out.arrows").open("wb") as sink:
        result = client.invoke("big", {"mib": 3}, write_to=sink)
    assert result.output == b"" and result.written == (tmp_path / "out.arrows").stat().st_size
    assert payloads.decode((tmp_path / "out.arrows").read_bytes(), result.content_type).shape == (
        3 * MIB,
    )
    with pytest.raises(payloads.PayloadError, match="written to a file"):
        result.value()
    small = io.BytesIO()
    assert client.invoke("big", {"x": 1}, write_to=small).written == len(small.getvalue()) > 0
    assert json.loads(small.getvalue()) == {"x": 1}


def test_a_file_for_another_machine_is_read_as_it_is_sent(stack: Stack, tmp_path: Path) -> None:
    # docs/protocol.md, "Large payloads": `data=` a regular file goes to a gateway on another
    # machine (not by reference: every byte in the request) as it is read, never held whole;
    # refused at once (413, Expect: 100-continue), none of it is read past its first bytes.
    client = Client(stack.gateway_address)
    source = tmp_path / "in.bin"
    source.write_bytes(b"\x03" * (64 * MIB))
    tracemalloc.start()
    try:
        with source.open("rb") as data:
            result = client.invoke(
                "big", data=data, content_type=payloads.OCTET, by_reference=False
            )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.value() == {"size": 64 * MIB, "sum": 3 * 64 * MIB}
    assert peak < 8 * MIB, f"{peak} bytes held at once"
    past = tmp_path / "past.bin"  # sparse: past the stack's 2 GiB bound, on no disk
    with past.open("wb") as sparse:
        sparse.truncate(limits.DEFAULT_MAX_SPOOLED_BYTES + MIB)
    with past.open("rb") as data:
        with pytest.raises(PayloadTooLarge, match="at most"):
            client.invoke("big", data=data, content_type=payloads.OCTET, by_reference=False)
        assert data.tell() <= limits.SPOOL_FROM_BYTES


def test_a_result_for_write_to_from_another_machine_is_written_as_it_comes(
    stack: Stack, tmp_path: Path
) -> None:
    # README, "Client library": `write_to=` an open binary file the result's bytes are written
    # to as they came, "and not held" — also as a caller on another machine gets it (not by
    # reference: every byte in the gateway's answer, streamed), the CLI's --output's way.
    client = Client(stack.gateway_address)
    out = tmp_path / "out.arrows"
    tracemalloc.start()
    try:
        with out.open("wb") as sink:
            result = client.invoke("big", {"mib": 64}, write_to=sink, by_reference=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.written == out.stat().st_size > 64 * MIB
    assert peak < 8 * MIB, f"{peak} bytes held at once"
    assert payloads.decode(out.read_bytes(), result.content_type).shape == (64 * MIB,)

    class Full:  # a sink that stops taking bytes: its error, not the call's
        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left on device") as refused:
        client.invoke("big", {"mib": 16}, write_to=Full(), by_reference=False)
    assert not isinstance(refused.value, GatewayError)
    assert client.invoke("big", {"x": 1}).value() == {"x": 1}  # the client is as before
    # Its caller gone mid-body, the result is removed ("Nothing is left behind"), once the
    # gateway has seen the connection close.
    wait_until(lambda: not spooled(stack.spool), timeout=30)


def test_a_file_for_a_gateway_not_there_is_not_read_whole_and_it_is_asked_again(
    tmp_path: Path,
) -> None:
    # README, "Client library": `data=` a binary file goes to the spool a MiB at a time; with
    # no gateway answering, the call fails as unreachable having read no more than it needed
    # to know the payload is large — and once a gateway is there, its spool is used: nothing
    # was concluded from the failure.
    source = tmp_path / "in.bin"
    source.write_bytes(b"\x01" * (8 * MIB))
    address = f"unix:{tmp_path}/gateway.sock"
    client = Client(address)
    with source.open("rb") as data:
        with pytest.raises(GatewayUnreachable):
            client.invoke("big", data=data, content_type=payloads.OCTET)
        assert data.tell() <= limits.SPOOL_FROM_BYTES
    stack = Stack(tmp_path / "state", {"python": 1}, gateway_listen=address, poll_interval=0.2)
    stack.start()
    try:
        client.create_run("big", runtime="python", handler="handler.handle", files=HANDLER)
        assert client.local_spool() is not None
        with source.open("rb") as data:
            assert client.invoke("big", data=data, content_type=payloads.OCTET).value() == {
                "size": 8 * MIB, "sum": 8 * MIB,
            }  # fmt: skip
    finally:
        client.close()
        stack.stop()
