"""docs/protocol.md, "Live output": an invocation's log lines while it runs, streamed as NDJSON
by the gateway (relayed by runtimed from the Runtime Server), and ``Client.invoke(on_log=)``.
Against a real stack. The handlers wait on a Gate that only a line seen live opens, so a line
that did not arrive while the call ran fails the test (the call times out)."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import FunctionNotFound, InvalidRequest
from fnkernel.runtime_server.lifecycle.stack import Stack
from fnkernel.runtime_server.tokens import find_token
from tests.support import GATE_WAIT, Gate, wait_until

pytestmark = pytest.mark.timeout(120)

# Prints its payload's "say", then waits on the Gate "go" before its last line.
WAITS = {
    "handler.py": GATE_WAIT + "def handle(event, context):\n"
    "    print('started', event['say'])\n"
    "    wait_for_gate(event['go'])\n"
    "    print('finished', event['say'])\n"
    "    return event['say']\n"
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    started = Stack(tmp_path_factory.mktemp("live") / "state", {"python": 2},
                    gateway_listen="127.0.0.1:0", poll_interval=0.2)  # fmt: skip
    started.start()
    yield started  # type: ignore[misc]
    started.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Client:
    client = Client(stack.gateway_address)
    client.create_run("waits", runtime="python", handler="handler.handle", files=WAITS)
    client.create_run("pair", runtime="python", handler="handler.handle", files=WAITS,
                      replicas=2)  # fmt: skip
    return client


def _get(stack: Stack, path: str) -> tuple[int, str, list[dict]]:
    host, port = stack.gateway_address.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    token = find_token(stack.gateway_address)
    connection.request("GET", path, headers={"Authorization": f"Bearer {token}"})
    response = connection.getresponse()
    body = response.read().decode()
    records = [json.loads(line) for line in body.splitlines()] if response.status == 200 else []
    return response.status, response.headers.get("Content-Type", ""), records or [json.loads(body)]


def test_on_log_sees_each_line_while_the_call_runs(
    client: Client, gate: Callable[[], Gate]
) -> None:
    """ "A handler's prints appear while it runs … in the order written; the result still
    carries the whole log." """
    go = gate()
    seen: list[dict] = []

    def on_log(line: dict) -> None:
        seen.append(line)
        if line["text"] == "started live":
            go.open()  # only a line that came while it ran lets it finish

    result = client.invoke("waits", {"say": "live", "go": str(go)}, on_log=on_log,
                           timeout_millis=20_000)  # fmt: skip
    assert result.decoded() == "live"
    assert [line["text"] for line in seen] == ["started live", "finished live"]
    assert [line["text"] for line in result.logs] == ["started live", "finished live"]


def test_a_quick_call_gives_on_log_its_lines_from_the_result(
    client: Client, gate: Callable[[], Gate]
) -> None:
    """A call that answers before it is followed: on_log gets the result's lines, once."""
    go = gate()
    go.open()
    seen: list[str] = []
    client.invoke(
        "waits", {"say": "quick", "go": str(go)}, on_log=lambda line: seen.append(line["text"])
    )
    assert seen == ["started quick", "finished quick"]


# Prints 300 rows of 1 KiB (past the live cap of 256 KiB), waits on the Gate "go", then two
# more: the last lines a follower of the cut stream can have only from the call's log.
PAST_THE_CAP = {
    "handler.py": GATE_WAIT + "def handle(event, context):\n"
    "    for i in range(300):\n"
    "        print(f'row {i:03d}', 'x' * 1016, flush=True)\n"
    "    wait_for_gate(event['go'])\n"
    "    print('after the cap 1')\n"
    "    print('after the cap 2')\n"
    "    return 300\n"
}


def test_lines_past_the_live_cap_come_once_from_the_calls_log(
    client: Client, gate: Callable[[], Gate]
) -> None:
    """ "A call's stream carries at most 256 KiB. Then one line says … the call's last lines
    come with its result": the client asks the server for the call's log once it is over and
    gives on_log every line the stream did not — each row once, in order."""
    client.create_run("chatty", runtime="python", handler="handler.handle", files=PAST_THE_CAP)
    go = gate()
    seen: list[dict] = []

    def on_log(line: dict) -> None:
        seen.append(line)
        if line.get("cut"):
            go.open()  # the cap's line came live: only now does the handler go on

    assert (
        client.invoke("chatty", {"go": str(go)}, on_log=on_log, timeout_millis=30_000).decoded()
        == 300
    )
    texts = [line["text"] for line in seen]
    rows = [text.split()[1] for text in texts if text.startswith("row ")]
    assert rows == [f"{i:03d}" for i in range(300)]  # each once, in order
    assert texts[-2:] == ["after the cap 1", "after the cap 2"]
    cap = texts.index(next(line["text"] for line in seen if line.get("cut")))
    assert (
        0 < cap < len(texts) - 2
        and texts[cap + 1] == "[fnkernel: the call's log, from its result:]"
    )
    client.delete_run("chatty")


# Prints 40,000 short lines: past what a call keeps of a stream (10,000 lines: its first and
# last 5,000, the middle dropped), and past the live cap (256 KiB) well into that middle.
LONG = {
    "handler.py": GATE_WAIT + "import sys\n\ndef handle(event):\n"
    "    print('following', file=sys.stderr, flush=True)  # stdout is the lines alone\n"
    "    wait_for_gate(event['go'])\n"
    "    for i in range(40_000):\n"
    "        print(f'line {i:05d}')\n"
    "    return 'done'\n"
}


def test_a_call_past_what_a_stream_keeps_still_ends_with_its_last_lines(
    client: Client, gate: Callable[[], Gate]
) -> None:
    """docs/protocol.md, "Live output": once the stream is cut, on_log gets "what the stream
    did not" from the call's log — whose middle is one line saying how many were dropped
    (the first and last 5,000 lines are kept). The live stream reached past the first 5,000
    into that middle; its last lines are the call's last lines, each once, in order (they
    were all taken for shown, and only the cut line and the notes came after)."""
    client.create_run("long", runtime="python", handler="handler.handle", files=LONG)
    go = gate()
    seen: list[str] = []

    def on_log(line: dict) -> None:
        seen.append(line["text"])
        if line["text"] == "following":
            go.open()  # it came live: the lines that follow are followed as they come

    assert client.invoke("long", {"go": str(go)}, on_log=on_log).decoded() == "done"
    assert seen.index("[fnkernel: the call's log, from its result:]") > 5_000  # live past 5,000
    numbers = [int(text.split()[1]) for text in seen if text.startswith("line ")]
    assert numbers == sorted(set(numbers)), "each line once, in order"
    assert numbers[-5_000:] == list(range(35_000, 40_000))  # the call's last lines
    assert numbers[:5_000] == list(range(5_000))
    dropped = [text for text in seen if "of stdout dropped" in text]
    assert dropped == [
        f"[fnkernel: {sum(len(f'line {i:05d}') + 1 for i in range(5_000, 35_000))} bytes "
        "(30000 lines) of stdout dropped: a call keeps the first and last 512 KiB and 10000 "
        "lines of each stream]"
    ]
    client.delete_run("long")


def test_the_gateway_streams_ndjson_and_ends_with_the_call(
    stack: Stack, client: Client, gate: Callable[[], Gate]
) -> None:
    """ "GET /v1/runs/{name}/invocations/{id}/logs?follow=1 as NDJSON … the stream ends when
    the invocation does." """
    go = gate()
    answer: list[object] = []
    call = threading.Thread(target=lambda: answer.append(client.invoke(
        "waits", {"say": "ndjson", "go": str(go)}, invocation_id="inv-ndjson")))  # fmt: skip
    call.start()
    records = client.follow_logs("waits", "inv-ndjson")
    head = next(records)
    assert head == {"invocationId": "inv-ndjson", "run": "waits", "running": True}
    assert next(records) == {"stream": "stdout", "text": "started ndjson"}
    assert not answer, "the call is still running"
    # A look without follow at the call still running: its lines so far, and no end record,
    # which says the call is over.
    status, _, snapshot = _get(stack, "/v1/runs/waits/invocations/inv-ndjson/logs?follow=0")
    assert status == 200 and snapshot[0]["running"] is True
    assert snapshot[1:] == [{"stream": "stdout", "text": "started ndjson"}]
    go.open()
    assert list(records) == [{"stream": "stdout", "text": "finished ndjson"}, {"end": True}]
    call.join(30)
    status, content_type, raw = _get(stack, "/v1/runs/waits/invocations/inv-ndjson/logs")
    assert (status, content_type) == (200, "application/x-ndjson")
    assert raw[0]["running"] is False and raw[-1] == {"end": True}
    # The function's last invocation, unnamed:
    assert _get(stack, "/v1/runs/waits/logs")[2][0]["invocationId"] == "inv-ndjson"


def test_bad_follows_are_refused_naming_what_is_wrong(stack: Stack, client: Client) -> None:
    """4xx naming the field or the thing not found; never a 500."""
    status, _, body = _get(stack, "/v1/runs/waits/logs?follow=maybe")
    assert status == 400 and "follow" in body[0]["message"]
    status, _, body = _get(stack, "/v1/runs/nosuch/logs")
    assert status == 404 and body[0]["code"] == "NOT_FOUND"
    status, _, body = _get(stack, "/v1/runs/waits/invocations/never-sent/logs")
    assert status == 404 and "never-sent" in body[0]["message"]
    with pytest.raises(FunctionNotFound):
        next(client.follow_logs("waits", "never-sent", follow=False))
    with pytest.raises(InvalidRequest):
        next(client.follow_logs("waits", "x" * 200, follow=False))


def test_a_replica_sets_call_is_followed_on_the_replica_serving_it(
    client: Client, gate: Callable[[], Gate]
) -> None:
    """Replicas: each call's lines, from whichever replica the gateway chose."""
    gos = {say: gate() for say in ("one", "two")}
    seen: dict[str, list[str]] = {"one": [], "two": []}

    def call(say: str) -> None:
        def on_log(line: dict) -> None:
            seen[say].append(line["text"])
            gos[say].open()

        client.invoke("pair", {"say": say, "go": str(gos[say])}, on_log=on_log,
                      timeout_millis=20_000)  # fmt: skip

    threads = [threading.Thread(target=call, args=(say,)) for say in gos]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert seen == {say: [f"started {say}", f"finished {say}"] for say in gos}


def test_a_cancelled_call_keeps_what_it_printed_as_the_last_invocation(
    stack: Stack, client: Client, gate: Callable[[], Gate]
) -> None:
    """Output printed before an interrupt is kept: the cancelled call is the function's last
    invocation, with the lines it wrote until it was killed."""
    caller = Client(stack.gateway_address)
    answer: list[object] = []

    def call() -> None:
        try:
            caller.invoke("waits", {"say": "cut", "go": str(gate())},
                          invocation_id="inv-cut")  # fmt: skip
        except Exception as exc:
            answer.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    records = client.follow_logs("waits", "inv-cut")
    assert next(records)["running"] and next(records)["text"] == "started cut"
    caller.cancel()
    thread.join(30)
    assert type(answer[0]).__name__ == "RequestCancelled"
    assert list(records)[-1] == {"end": True}
    kept = list(client.follow_logs("waits", "inv-cut", follow=False))
    assert kept[0]["running"] is False
    assert {"stream": "stdout", "text": "started cut"} in kept


CLI = [sys.executable, "-m", "fnkernel.runtime_server.cli"]


def test_cli_invoke_follow_and_logs(stack: Stack, client: Client, gate: Callable[[], Gate]) -> None:
    """README, "CLI": ``fnkernel invoke --follow`` prints the handler's lines on stderr as they
    come (the output stays stdout's); ``fnkernel logs NAME [-f]`` the call in flight, else the
    last one."""
    go = gate()
    payload = json.dumps({"say": "cli", "go": str(go)})
    gateway = ["--gateway", stack.gateway_address]
    invoke = subprocess.Popen([*CLI, "invoke", "waits", payload, "--follow", *gateway],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert invoke.stderr is not None
        assert invoke.stderr.readline() == "started cli\n"  # while the handler waits for go
        following = subprocess.Popen([*CLI, "logs", "waits", "-f", *gateway],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        assert following.stdout is not None
        assert following.stdout.readline() == "started cli\n"
        go.open()
        out, err = invoke.communicate(timeout=60)
        followed, head = following.communicate(timeout=60)
    finally:
        invoke.kill()
    assert (invoke.returncode, out, err) == (0, '"cli"\n', "finished cli\n")
    assert followed == "finished cli\n" and "(running)" in head
    last = subprocess.run([*CLI, "logs", "waits", *gateway], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert last.returncode == 0 and last.stdout == "started cli\nfinished cli\n"
    assert "(over)" in last.stderr


def test_cli_ctrl_c_cancels_the_call_in_one_line(
    stack: Stack, client: Client, gate: Callable[[], Gate]
) -> None:
    """README, "CLI": Ctrl-C ends a command with one line and exit status 130, no traceback;
    an invoke's call is cancelled, and the function stays registered."""
    go = gate()  # never opened: the handler waits until the call is cancelled
    payload = json.dumps({"say": "interrupted", "go": str(go)})
    invoke = subprocess.Popen([*CLI, "invoke", "waits", payload, "--follow", "--gateway",
                               stack.gateway_address],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert invoke.stderr is not None
        assert invoke.stderr.readline() == "started interrupted\n"
        invoke.send_signal(signal.SIGINT)
        out, err = invoke.communicate(timeout=60)
    finally:
        invoke.kill()
    assert (invoke.returncode, out, err) == (130, "", "fnkernel: interrupted\n")
    wait_until(lambda: not (client.status("waits")["live"] or {}).get("inFlight"), timeout=30)
    opened = gate()
    opened.open()
    assert client.invoke("waits", {"say": "again", "go": str(opened)}).value() == "again"


def test_cli_timeout_says_how_long_the_call_had_and_how_to_give_more(
    stack: Stack, client: Client, gate: Callable[[], Gate]
) -> None:
    go = gate()  # never opened: the handler waits past its deadline
    payload = json.dumps({"say": "late", "go": str(go)})
    done = subprocess.run([*CLI, "invoke", "waits", payload, "--timeout-ms", "300", "--gateway",
                           stack.gateway_address], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1, done.stderr
    said = re.search(r"InvocationTimedOut: the handler exceeded its deadline of ([\d.]+) s; "
                     r"give it more with --timeout-ms MS", done.stderr)  # fmt: skip
    assert said is not None and float(said[1]) <= 0.3, done.stderr
