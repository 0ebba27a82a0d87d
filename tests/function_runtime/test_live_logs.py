"""Live output (docs/protocol.md, "Live output"): FollowInvocationLogs on a real Runtime Server.

Each test names the sentence of the doc it checks. The handlers wait on a Gate the test opens,
so "while it runs" is a condition the test holds, not a timing.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from fnkernel.adapters.calllogs import LIVE_LOG_BYTES
from fnkernel.runtime_server.limits import MAX_LOG_FOLLOWERS
from tests.support import GATE_WAIT, Client, Gate

pytestmark = pytest.mark.timeout(60)

# Prints, logs, then waits on the Gate the payload names before its last line.
WAITS = {
    "handler.py": GATE_WAIT
    + """
import logging

def handle(event, context):
    print("first line")
    logging.getLogger("etl").warning("a log record")
    wait_for_gate(event["go"])
    print("last line, no newline", end="")
    return "done"
"""
}


def _registration(rt: Client, files: dict[str, str]):  # type: ignore[no-untyped-def]
    return rt.register(files).registration


def _lines(records) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return [(r.stream, r.text) for r in records if r.stream]


def test_lines_arrive_while_the_call_runs_and_the_stream_ends_with_it(
    python_rt: Client, gate: Callable[[], Gate]
) -> None:
    """ "A handler's prints and log lines appear while it runs … the stream ends when the
    invocation does; the result still carries the whole log." """
    reg = _registration(python_rt, WAITS)
    go = gate()
    call = python_rt.invoke_future(reg, b'{"go": "%s"}' % str(go).encode(), invocation_id="inv-1")
    records = python_rt.follow(reg, "inv-1")
    head = next(records)
    assert (head.invocation_id, head.running, head.stream) == ("inv-1", True, "")
    seen = []
    for record in records:  # the handler is still waiting: these came while it ran
        seen.append((record.stream, record.text))
        if len(seen) == 2:
            break
    assert sorted(seen) == [("stderr", "WARNING etl: a log record"), ("stdout", "first line")]
    assert not call.done()
    go.open()
    rest = _lines(records)  # ends: the invocation is over
    assert rest == [("stdout", "last line, no newline")]
    assert call.result(timeout=30).output == b'"done"'


def test_an_invocation_that_is_over_gives_its_result_lines(
    python_rt: Client, gate: Callable[[], Gate]
) -> None:
    """ "A follower that comes when it is over gets its result's lines." (the last invocation)"""
    reg = _registration(python_rt, WAITS)
    go = gate()
    go.open()
    python_rt.invoke(reg, b'{"go": "%s"}' % str(go).encode(), invocation_id="inv-2")
    for invocation_id in ("inv-2", ""):  # by its ID, and as the last one
        records = list(python_rt.follow(reg, invocation_id, follow=False))
        assert (records[0].invocation_id, records[0].running) == ("inv-2", False)
        assert ("stdout", "first line") in _lines(records)


def test_an_unknown_invocation_is_not_found(python_rt: Client) -> None:
    """ "NOT_FOUND: neither in flight nor the last one." """
    reg = _registration(python_rt, WAITS)
    with pytest.raises(grpc.RpcError) as caught:
        list(python_rt.follow(reg, "never-sent", follow=False))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "never-sent" in caught.value.details()
    # No invocation named, and none made yet: it says so in words, not "any invocation".
    with pytest.raises(grpc.RpcError) as caught:
        list(python_rt.follow(reg, "", follow=False))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert caught.value.details().endswith(
        "has not been called since it registered: no call is in flight, and there is no last one"
    )


def test_an_invocation_over_before_the_last_is_answered_at_once(
    python_rt: Client, gate: Callable[[], Gate]
) -> None:
    """ "One that ended before the last one (a batch's answers come late) is over: NOT_FOUND
    at once, saying its lines are in its result, where a follower would wait for an
    invocation that has not started." """
    reg = _registration(python_rt, WAITS)
    go = gate()
    go.open()
    for invocation_id in ("inv-a", "inv-b"):
        python_rt.invoke(reg, b'{"go": "%s"}' % str(go).encode(), invocation_id=invocation_id)
    with pytest.raises(grpc.RpcError) as caught:
        list(python_rt.follow(reg, "inv-a"))  # following: it would wait for it to start
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "inv-a" in caught.value.details() and "it is over" in caught.value.details()


def test_the_stream_stops_at_its_cap_and_says_so(
    python_rt: Client, gate: Callable[[], Gate]
) -> None:
    """ "A per-invocation cap on streamed bytes (say so when it cuts)." """
    reg = _registration(
        python_rt,
        {
            "handler.py": GATE_WAIT
            + f"""
def handle(event, context):
    wait_for_gate(event["go"])
    for i in range({LIVE_LOG_BYTES // 50 + 100}):
        print(f"{{i:08d}}" + "x" * 41)
    return "ok"
"""
        },
    )
    go = gate()
    call = python_rt.invoke_future(reg, b'{"go": "%s"}' % str(go).encode(), invocation_id="loud")
    stream = python_rt.follow(reg, "loud")
    records = [next(stream)]
    go.open()
    records += list(stream)
    assert call.result(timeout=30).output == b'"ok"'  # the handler was never held back
    cut = [r for r in records if r.cut]
    assert len(cut) == 1 and cut[0] is records[-1], "the cut is said once, as the last line"
    assert f"{LIVE_LOG_BYTES >> 10} KiB" in cut[0].text
    streamed = sum(len(r.text) + 1 for r in records[1:-1])
    assert 0 < streamed <= LIVE_LOG_BYTES


def test_a_reader_that_never_reads_does_not_hold_the_handler(python_rt: Client) -> None:
    """ "A slow or absent reader never slows or blocks the handler." """
    reg = _registration(
        python_rt,
        {
            "handler.py": """
                def handle(event, context):
                    for i in range(20000):
                        print("y" * 60)
                    return "ok"
            """
        },
    )
    call = python_rt.invoke_future(reg, invocation_id="unread")
    stalled = python_rt.follow(reg, "unread")  # never read from
    try:
        assert call.result(timeout=30).output == b'"ok"'
    finally:
        stalled.cancel()


def test_followers_are_bounded(python_rt: Client, gate: Callable[[], Gate]) -> None:
    """ "At most MAX_LOG_FOLLOWERS streams at once; another is RESOURCE_EXHAUSTED." """
    reg = _registration(python_rt, WAITS)
    go = gate()
    call = python_rt.invoke_future(reg, b'{"go": "%s"}' % str(go).encode(), invocation_id="busy")
    streams = [python_rt.follow(reg, "busy") for _ in range(MAX_LOG_FOLLOWERS)]
    for stream in streams:
        assert next(stream).running
    with pytest.raises(grpc.RpcError) as caught:
        next(python_rt.follow(reg, "busy"))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    go.open()
    for stream in streams:
        assert ("stdout", "last line, no newline") in _lines(stream)
    call.result(timeout=30)
    assert next(python_rt.follow(reg, "busy")).invocation_id == "busy"  # the slots are back
