"""docs/protocol.md, "Content types", through a stack of real processes (client → gateway →
runtimed → Runtime Server → worker): a DataFrame in and a DataFrame out from the client, a map
over DataFrames, any HTTP client with Content-Type and Accept, and the CLI."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from fnkernel.runtime_server import payloads, wire
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import InvalidRequest
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.support import http_call

TOTALS = {
    "handler.py": (
        "import pandas as pd\n"
        "def handle(event):\n"
        "    if isinstance(event, pd.DataFrame):\n"
        "        return event.groupby('grade', observed=True)['count'].sum().to_frame()\n"
        "    return {'kind': type(event).__name__}\n"
    )
}


def frame(grades: str) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "grade": pd.Categorical(list(grades), categories=["a", "b", "c"]),
            "count": pd.array([1, None, *range(len(grades) - 2)], dtype="Int64"),
            "at": pd.date_range("2024-01-01", periods=len(grades), tz="UTC"),
        }
    )


@pytest.fixture(scope="module")
def totals(shared_stack: Stack) -> Client:
    client = Client(shared_stack.gateway_address)
    run = client.create_run("totals", runtime="python", handler="handler.handle", files=TOTALS)
    assert run.phase == "Ready", run.message
    return client


def test_a_dataframe_in_a_dataframe_out_through_every_hop(totals: Client) -> None:
    sent = frame("abca")
    result = totals.invoke("totals", sent)
    assert result.content_type == payloads.ARROW
    expected = sent.groupby("grade", observed=True)["count"].sum().to_frame()
    pd.testing.assert_frame_equal(result.value(), expected)
    assert totals.invoke("totals", np.arange(4)).value() == {"kind": "ndarray"}


def test_a_map_over_dataframes_gives_a_dataframe_each(totals: Client) -> None:
    parts = [frame("aab"), frame("bcc"), frame("abc")]
    results = totals.map("totals", parts)
    for part, result in zip(parts, results, strict=True):
        pd.testing.assert_frame_equal(
            result, part.groupby("grade", observed=True)["count"].sum().to_frame()
        )
    # A frame is one item: mapped over, it would call once per column label; it is refused,
    # saying how to give its parts, before anything is called.
    with pytest.raises(TypeError, match=r"a pandas\.DataFrame is one item: map over its parts"):
        totals.map("totals", frame("abc"))
    with pytest.raises(TypeError, match=r"a pyarrow\.Table is one item: .*to_batches"):
        totals.map("totals", pa.table({"a": [1, 2]}))


def test_any_http_client_sends_and_accepts_arrow(totals: Client, shared_stack: Stack) -> None:
    # An Arrow stream from any writer (no fnkernel metadata: the handler gets a pyarrow Table,
    # which this handler names), and a frame's Arrow answer, read with pyarrow alone.
    table = pa.table({"grade": ["a"], "count": [1]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    address, path = shared_stack.gateway_address, "/v1/runs/totals:invoke"
    status, headers, body = http_call(address, "POST", path, sink.getvalue().to_pybytes(),
                                      {"Content-Type": payloads.ARROW})  # fmt: skip
    assert (status, headers["Content-Type"], body) == (200, payloads.JSON, b'{"kind":"Table"}')
    data, content_type = payloads.encode(frame("ab"))
    status, headers, body = http_call(
        address, "POST", path, data, {"Content-Type": content_type, "Accept": payloads.ARROW}
    )
    assert (status, headers["Content-Type"]) == (200, payloads.ARROW)
    # the frame's columns, then its index (pyarrow's pandas metadata says which it is)
    assert pa.ipc.open_stream(body).read_all().column_names == ["count", "grade"]


def test_what_http_cannot_send_or_accept_is_refused_naming_it(
    totals: Client, shared_stack: Stack
) -> None:
    address, path = shared_stack.gateway_address, "/v1/runs/totals:invoke"
    status, _, body = http_call(address, "POST", path, b"a,b\n", {"Content-Type": "text/csv"})
    assert status == 415 and b"application/vnd.apache.arrow.stream" in body
    # JSON is UTF-8 (RFC 8259): another charset is refused by name, not read as UTF-8 and then
    # refused as JSON that does not decode; utf-8 named is fine.
    latin = {"Content-Type": "application/json; charset=iso-8859-1"}
    status, _, body = http_call(address, "POST", path, '"café"'.encode("latin-1"), latin)
    assert status == 415 and b"charset='iso-8859-1'" in body, body
    named = {"Content-Type": 'application/json; charset="UTF-8"'}
    status, _, body = http_call(address, "POST", path, b'"x"', named)
    assert status == 200, body
    # The call ran, and its answer was a type the caller said it does not take.
    data, content_type = payloads.encode(frame("ab"))
    status, headers, body = http_call(
        address, "POST", path, data, {"Content-Type": content_type, "Accept": "application/json"}
    )
    assert status == 406 and b"the function returned application/vnd.apache.arrow.stream" in body
    refused = json.loads(body)  # which call ran, as a failed call's answer says
    assert refused["invocationId"].startswith("inv_") and refused["runUid"]
    assert headers[wire.INVOCATION_ID_HEADER] == refused["invocationId"]
    status, _, _ = http_call(address, "POST", path, data,
                             {"Content-Type": content_type, "Accept": "*/*;q=0.5"})  # fmt: skip
    assert status == 200
    # The most specific range decides (RFC 9110, section 12.5.1): its own type at q=0 is refused
    # though */* would take it.
    refusing = f"{content_type};q=0, */*"
    status, _, _ = http_call(address, "POST", path, data,
                             {"Content-Type": content_type, "Accept": refusing})  # fmt: skip
    assert status == 406
    # A body must say its type: a browser sends one without it to another origin unasked.
    status, _, body = http_call(address, "POST", path, data, {"Content-Type": ""})
    assert status == 415 and b"got ''" in body
    # A create's body is JSON and nothing else.
    status, _, _ = http_call(address, "POST", "/v1/runs", data, {"Content-Type": content_type})
    assert status == 415
    # The bash runtime takes JSON only: 400 naming the field.
    totals.create_run("echo-sh", runtime="bash", handler="fn.handle",
                      files={"fn.sh": "handle() { printf '%s' \"$1\"; }\n"})  # fmt: skip
    with pytest.raises(InvalidRequest, match=r"content_type: .* the bash runtime takes"):
        totals.invoke("echo-sh", frame("ab"))


def test_the_cli_sends_a_stream_from_stdin_and_writes_the_answer_whole(
    totals: Client, shared_stack: Stack, tmp_path: Path
) -> None:
    data, content_type = payloads.encode(frame("abc"))

    def invoke(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "fnkernel.runtime_server.cli", "invoke", "totals", *args,
             "--gateway", shared_stack.gateway_address],
            input=data, capture_output=True, timeout=60,
        )  # fmt: skip

    out = tmp_path / "totals.arrows"
    done = invoke("-", "--content-type", content_type, "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stderr.decode().startswith("content type: application/vnd.apache.arrow.stream")
    back = payloads.decode(out.read_bytes(), payloads.ARROW)
    assert list(back.index.astype(str)) == ["a", "b", "c"]
    assert [p.name for p in tmp_path.iterdir()] == ["totals.arrows"]  # no part file left
    # Whole or not at all, and nothing else touched: a file of the name the result is staged
    # under is the user's; a link's file is replaced, the link kept; a file keeps its mode;
    # and what is not a file (a FIFO another process reads) is written to, not replaced.
    (tmp_path / "totals.arrows.part").write_bytes(b"mine")
    out.chmod(0o640)
    (tmp_path / "link.arrows").symlink_to(out.name)
    linked = invoke("-", "--content-type", content_type, "--output", str(tmp_path / "link.arrows"))
    assert linked.returncode == 0, linked.stderr
    assert (tmp_path / "link.arrows").is_symlink() and out.stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "totals.arrows.part").read_bytes() == b"mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "link.arrows", "totals.arrows", "totals.arrows.part"
    ]  # fmt: skip
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    read: list[bytes] = []
    reader = threading.Thread(target=lambda: read.append(fifo.read_bytes()))
    reader.start()
    done = invoke("-", "--content-type", content_type, "--output", str(fifo))
    reader.join(60)
    assert done.returncode == 0, done.stderr
    assert fifo.is_fifo() and read == [out.read_bytes()]
    piped = invoke("-", "--content-type", content_type)  # to a pipe: the bytes themselves
    assert piped.returncode == 0 and piped.stdout == out.read_bytes()
    refused = invoke("{}", "--content-type", content_type)
    assert refused.returncode == 2 and b"give the payload on stdin" in refused.stderr
    refused = invoke("-")  # a stream, not said to be one: how to say so
    assert refused.returncode == 2 and b"payload is not JSON" in refused.stderr
    assert f"--content-type {content_type} or".encode() in refused.stderr
    # Where the result cannot be written is said before the call runs, not after.
    nowhere = tmp_path / "missing" / "totals.arrows"
    refused = invoke("-", "--content-type", content_type, "--output", str(nowhere))
    assert refused.returncode == 2 and b"no such directory" in refused.stderr
    assert b"content type:" not in refused.stderr  # no answer came: nothing was called


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"payload": {"a": 1}, "content_type": payloads.ARROW}, "content_type says what data= is"),
        ({"payload": {"a": 1}, "data": b"{}"}, "a payload or data=, not both"),
        ({"data": '{"a": 1}'}, "data= is bytes or a binary file, not str"),
    ],
    ids=["content_type-without-data", "both", "data-as-text"],
)
def test_arguments_that_contradict_each_other_are_a_type_error_before_anything_is_sent(
    totals: Client, arguments: dict, says: str
) -> None:
    # README, "Client library": a payload is sent as its kind says; data= is raw bytes of content_type.
    # Given both, or a content_type for a payload, nothing is sent rather than one ignored;
    # data= given text, as it is given no bytes.
    payload = arguments.pop("payload", None)
    with pytest.raises(TypeError, match=says):
        totals.invoke("totals", payload, **arguments)


def test_a_file_given_with_a_payload_is_refused_before_it_is_read(totals: Client) -> None:
    # data= a file and a payload: refused as data= bytes is, the file left unread (stdin, say).
    data = io.BytesIO(b'{"a": 1}')
    with pytest.raises(TypeError, match="a payload or data=, not both"):
        totals.invoke("totals", {"a": 1}, data=data)
    assert data.tell() == 0
