"""docs/protocol.md, "Limits" and "Large payloads": a payload's bound (--max-payload-bytes) is
one, whichever way the payload travels. Past it, an invoke's body is 413 naming the flag before
anything is called — with a Content-Length or without (chunked), from the client library as
from any HTTP client — and a result is the handler error OutputTooLarge, inline or spooled."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import HandlerFailed, PayloadTooLarge
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.support import spooled

# What a 413 names as setting the bound (docs/protocol.md, "Large payloads").
BOUND_SET_BY = (
    "(the gateway's --max-payload-bytes; a kernel's own runtime: FNKERNEL_MAX_PAYLOAD_BYTES)"
)

BOUND = 1_000_000  # below one message (6 MiB): the bound, not the message, is what refuses
SIZER = {
    "handler.py": (
        "def handle(event):\n"
        "    if isinstance(event, dict):\n"
        "        return b'x' * event['size']\n"
        "    return {'len': len(event)}\n"
    )
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(
        tmp_path_factory.mktemp("bounds") / "state",
        {"python": 1},
        gateway_listen="127.0.0.1:0",
        poll_interval=0.2,
        max_payload_bytes=BOUND,
    )
    stack.start()
    Client(stack.gateway_address, token=stack.token).create_run(
        "sizer", runtime="python", handler="handler.handle", files=SIZER
    )
    yield stack
    stack.stop()


def _chunked(stack: Stack, size: int, *, chunk: int = 1 << 16) -> tuple[int, dict]:
    """POST a body of `size` bytes without a Content-Length (Transfer-Encoding: chunked)."""
    url = urllib.parse.urlsplit(stack.gateway_address)
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    parts = (b"0" * min(chunk, size - start) for start in range(0, size, chunk))
    headers = {
        "Content-Type": "application/octet-stream",
        "Authorization": f"Bearer {stack.token}",
    }
    try:
        connection.request("POST", "/v1/runs/sizer:invoke", body=parts, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_a_body_past_a_bound_below_one_message_is_413_from_the_client(stack: Stack) -> None:
    # The client sends a body of one message whole (no Expect: 100-continue): the gateway
    # reads and drops it, then answers, so the caller sees the 413, not a broken pipe.
    client = Client(stack.gateway_address, token=stack.token)
    size = 5_000_000  # more than the sockets' buffers hold: the gateway must read it
    with pytest.raises(PayloadTooLarge) as refused:
        client.invoke("sizer", b"0" * size, by_reference=False)
    assert refused.value.status == 413
    assert f"{size} bytes; at most {BOUND} {BOUND_SET_BY}" in str(refused.value)
    assert client.invoke("sizer", b"0" * 10, by_reference=False).value() == {"len": 10}


def test_a_body_past_the_transports_16_mib_is_413_to_a_client_that_sends_it_whole(
    stack: Stack,
) -> None:
    # http.client sends the whole body before it reads a byte of the answer: it reads the 413
    # only if the gateway reads the body (and drops it) first, however large.
    url = urllib.parse.urlsplit(stack.gateway_address)
    size = 20 << 20
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    headers = {"Content-Type": "application/octet-stream", "Authorization": f"Bearer {stack.token}"}
    try:
        connection.request("POST", "/v1/runs/sizer:invoke", body=b"0" * size, headers=headers)
        response = connection.getresponse()
        status, body = response.status, json.loads(response.read())
    finally:
        connection.close()
    assert status == 413, body
    assert body["message"].endswith(f"{size} bytes; at most {BOUND} {BOUND_SET_BY}")


def test_a_chunked_body_past_the_transports_16_mib_is_413_too(stack: Stack) -> None:
    status, body = _chunked(stack, 20 << 20, chunk=1 << 20)
    assert status == 413, body
    assert body["code"] == "PAYLOAD_TOO_LARGE"


def test_a_chunked_body_past_the_bound_is_413_naming_it(stack: Stack) -> None:
    status, body = _chunked(stack, 2 * BOUND)
    assert status == 413, body
    assert body["code"] == "PAYLOAD_TOO_LARGE"
    assert body["message"].endswith(f"at most {BOUND} {BOUND_SET_BY}")
    assert _chunked(stack, BOUND) == (200, {"len": BOUND})


def test_a_chunked_body_past_one_message_says_it_needs_a_length(
    stack_factory: Callable[..., Stack],
) -> None:
    # Under a bound past one message, a body past one message is streamed to the spool: only
    # when it says its length. A chunked one is read whole, up to one message.
    roomy = stack_factory({"python": 1}, max_payload_bytes=8 << 20)
    Client(roomy.gateway_address, token=roomy.token).create_run(
        "sizer", runtime="python", handler="handler.handle", files=SIZER
    )
    status, body = _chunked(roomy, 7_000_000)
    assert status == 413, body
    assert "at most 6291456 without a Content-Length" in body["message"]


def test_a_result_past_the_bound_is_output_too_large_either_way(stack: Stack) -> None:
    # docs/protocol.md, "Limits": a result past the bound is OutputTooLarge naming the limit,
    # in the same words whether it came inline or through the spool.
    client = Client(stack.gateway_address, token=stack.token)
    messages = []
    for by_reference in (False, True):
        with pytest.raises(HandlerFailed) as refused:
            client.invoke("sizer", {"size": 2 * BOUND}, by_reference=by_reference)
        assert refused.value.detail["errorType"] == "OutputTooLarge"
        assert f"returned {2 * BOUND} bytes; the limit is {BOUND}" in str(refused.value)
        messages.append(refused.value.error_message)
        small = client.invoke("sizer", {"size": BOUND}, by_reference=by_reference).value()
        assert small == b"x" * BOUND
    inline, spooled = messages
    assert inline == spooled


@pytest.mark.parametrize("command", ["up", "gateway", "serve"])
def test_a_bound_of_no_bytes_is_a_usage_error(command: str) -> None:
    # docs/protocol.md, "Large payloads": the bound is one for every process of a stack. 0 was
    # the default to some of them (`fnkernel up` left it out of the gateway's flags) and no
    # payload at all to others: refused, naming the flag, before anything starts.
    done = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", command, "--max-payload-bytes", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "argument --max-payload-bytes: must be at least 1 byte" in done.stderr


def test_a_stream_from_the_clis_stdin_is_refused_once_past_the_bound(
    stack: Stack, tmp_path: Path
) -> None:
    # docs/protocol.md, "Large payloads": on the stack's machine the CLI copies its stdin into
    # the spool a MiB at a time; a pipe's length is not known before it ends, so the copy stops
    # once past the bound — the 413's words ("more than" the bound: what is known of its
    # size), nothing left in the spool, nothing called. A file's size is known: it is named.
    size = 3 * BOUND
    command = [sys.executable, "-m", "fnkernel.runtime_server.cli", "invoke", "sizer", "-",
               "--content-type", "application/octet-stream", "--gateway", stack.gateway_address]  # fmt: skip
    done = subprocess.run(command, input=b"0" * size, capture_output=True, timeout=60)
    assert done.returncode == 2, done.stderr  # README, "CLI": the input refused is a usage error
    said = f"the payload of sizer is more than {BOUND} bytes; at most {BOUND} {BOUND_SET_BY}"
    assert said.encode() in done.stderr
    assert spooled(stack.spool) == []
    payload = tmp_path / "payload.bin"
    payload.write_bytes(b"0" * size)
    with payload.open("rb") as stdin:
        done = subprocess.run(command, stdin=stdin, capture_output=True, timeout=60)
    assert done.returncode == 2, done.stderr
    said = f"the payload of sizer is {size} bytes; at most {BOUND} {BOUND_SET_BY}"
    assert said.encode() in done.stderr
    assert spooled(stack.spool) == []
    client = Client(stack.gateway_address, token=stack.token)
    assert client.invoke("sizer", b"0" * BOUND).value() == {"len": BOUND}  # the bound's own


def test_an_output_that_cannot_be_written_is_a_usage_error_saying_whether_it_ran(
    stack: Stack,
) -> None:
    # docs/protocol.md, "Content types": a device is written to as it is, never replaced; one
    # that refuses the bytes (a full disk) is a usage error saying the call ran. A file that
    # cannot even be made is said before the call, which is then not made.
    def invoke(output: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fnkernel.runtime_server.cli", "invoke", "sizer",
             json.dumps({"size": BOUND}), "--output", output,
             "--gateway", stack.gateway_address],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    done = invoke("/dev/full")
    assert done.returncode == 2, done.stderr
    assert "--output /dev/full: the result ran but cannot be written: " in done.stderr
    assert "No space left on device" in done.stderr and Path("/dev/full").is_char_device()
    assert spooled(stack.spool) == []  # the spooled result was taken all the same
    done = invoke("/proc/version")  # no file can be staged beside it
    assert done.returncode == 2, done.stderr
    assert "--output /proc/version: cannot be written, so nothing was called: " in done.stderr
