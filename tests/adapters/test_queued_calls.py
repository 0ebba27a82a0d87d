"""docs/protocol.md, "Batches": a batch's next item is queued behind the one running, so the
worker begins it as soon as it has answered. Each item is still its own call: its lines are its
own, an item after a failure is never run, one after a worker that died runs on the next worker,
and a queued item that is not the next one called — another caller's call came first, or it was
cancelled — goes with the worker that holds it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fnkernel.adapters._payloads import CODES
from fnkernel.adapters.base import FunctionSpec, NextCall
from fnkernel.adapters.errors import HandlerError, InvocationTimeout
from fnkernel.adapters.python import WORKER_SCRIPT, PythonAdapter
from fnkernel.system.procfs import proc_stat
from tests.support import pid_alive, wait_until

pytestmark = pytest.mark.timeout(60)
JSON = "application/json"
HANDLER = """
import os, time

def handle(event):
    n = event["n"]
    print("begin", n, flush=True)
    if event.get("mark"):  # a file naming the worker that began it
        with open(event["mark"], "w") as mark:
            mark.write(str(os.getpid()))
    time.sleep(event.get("sleep", 0))
    if event.get("fail"):
        raise ValueError(f"no: {n}")
    print("end", n, flush=True)
    return {"n": n, "pid": os.getpid(), **({"pad": event["pad"]} if "pad" in event else {})}
"""


@pytest.fixture
def adapter(tmp_path: Path) -> Iterator[PythonAdapter]:
    (tmp_path / "handler.py").write_text(HANDLER)
    adapter = PythonAdapter(
        FunctionSpec("run-queued", tmp_path, "handler.handle"), max_output_bytes=1 << 20
    )
    adapter.start()
    yield adapter
    adapter.close()


def _event(n: int, **more: object) -> bytes:
    return json.dumps({"n": n, **more}).encode()


def _next(n: int, *, only_after_ok: bool = True, **more: object) -> NextCall:
    return NextCall(f"inv-{n}", _event(n, **more), JSON, 10.0, only_after_ok)


def _invoke(adapter: PythonAdapter, n: int, then: NextCall | None = None, **more: object) -> dict:
    result = adapter.invoke(f"inv-{n}", _event(n, **more), time.monotonic() + 10, then=then)
    return {"output": json.loads(result.output), "logs": [line.text for line in result.logs]}


def test_each_queued_items_lines_are_its_own(adapter: PythonAdapter) -> None:
    # Each item begins on the worker as the one before it answers, and prints at once: read to
    # the files' end, an answer would take the next item's first line.
    items = 40
    for n in range(items):
        then = _next(n + 1) if n + 1 < items else None
        answer = _invoke(adapter, n, then)
        assert answer["logs"] == [f"begin {n}", f"end {n}"]
        assert answer["output"]["n"] == n


def test_an_item_after_a_failure_is_never_run(adapter: PythonAdapter, tmp_path: Path) -> None:
    mark = tmp_path / "ran"
    with pytest.raises(HandlerError, match="no: 0"):
        _invoke(adapter, 0, _next(1, mark=str(mark)), fail=True)
    # The worker skipped it: nothing of it ran, and the worker stays.
    pid = _invoke(adapter, 2)["output"]["pid"]
    assert not mark.exists()
    assert _invoke(adapter, 1, mark=str(mark))["output"]["pid"] == pid
    assert mark.read_text() == str(pid)  # it ran when it was called


def test_unless_asked_to_an_item_after_a_failure_runs(adapter: PythonAdapter) -> None:
    with pytest.raises(HandlerError, match="no: 0"):
        _invoke(adapter, 0, _next(1, only_after_ok=False), fail=True)
    assert _invoke(adapter, 1) == {
        "output": {"n": 1, "pid": _pid(adapter)},
        "logs": ["begin 1", "end 1"],
    }


def test_an_item_behind_a_timed_out_one_runs_on_the_next_worker(adapter: PythonAdapter) -> None:
    first = _pid(adapter)
    with pytest.raises(InvocationTimeout):
        adapter.invoke("inv-0", _event(0, sleep=30), time.monotonic() + 0.5, then=_next(1))
    answer = _invoke(adapter, 1)
    assert answer["output"]["pid"] != first
    assert answer["logs"] == ["begin 1", "end 1"]


def test_another_call_before_the_queued_one_replaces_the_worker_that_holds_it(
    adapter: PythonAdapter, tmp_path: Path
) -> None:
    mark = tmp_path / "begun"
    _invoke(adapter, 0, _next(1, mark=str(mark), sleep=30))
    wait_until(mark.exists, timeout=10)  # the worker began it as it answered item 0
    holder = int(mark.read_text())
    other = _invoke(adapter, 7)
    assert other["output"]["pid"] != holder and other["logs"] == ["begin 7", "end 7"]
    wait_until(lambda: not pid_alive(holder), timeout=10)


def test_cancelling_the_queued_item_kills_the_worker_that_began_it(
    adapter: PythonAdapter, tmp_path: Path
) -> None:
    mark = tmp_path / "begun"
    _invoke(adapter, 0, _next(1, mark=str(mark), sleep=30))
    wait_until(mark.exists, timeout=10)
    holder = int(mark.read_text())
    assert adapter.cancel("inv-1")
    wait_until(lambda: not pid_alive(holder), timeout=10)
    assert _invoke(adapter, 2)["output"]["pid"] not in (holder, os.getpid())


def _pid(adapter: PythonAdapter) -> int:
    return int(_invoke(adapter, 99)["output"]["pid"])


def test_an_item_behind_an_answer_refused_as_too_large_is_cancelled_where_it_runs(
    tmp_path: Path,
) -> None:
    # The worker answered ok, so it began the next item; the server refuses the answer (past
    # the output limit), and the batch that stops there cancels the item it had queued.
    (tmp_path / "handler.py").write_text(HANDLER)
    small = PythonAdapter(
        FunctionSpec("run-small", tmp_path, "handler.handle"), max_output_bytes=64
    )
    small.start()
    try:
        mark = tmp_path / "begun"
        with pytest.raises(HandlerError, match="limit is 64"):
            _invoke(small, 0, _next(1, mark=str(mark), sleep=30), pad="x" * 100)
        wait_until(mark.exists, timeout=10)
        holder = int(mark.read_text())
        assert small.cancel("inv-1")
        wait_until(lambda: not pid_alive(holder), timeout=10)
        assert _invoke(small, 2)["output"]["n"] == 2
    finally:
        small.close()


def test_a_worker_whose_server_is_gone_runs_no_frame_it_reads(tmp_path: Path) -> None:
    # docs/protocol.md, "Batches": a frame still in the pipe when the Runtime Server died (an
    # item queued behind the last) is not run. A shell stands for the server here: the worker
    # is its child; the test holds the two frame pipes, so the worker can read a frame and
    # answer it after the shell is gone, as after a server killed just after an answer.
    (tmp_path / "handler.py").write_text(HANDLER)
    request_r, request_w = os.pipe()
    answer_r, answer_w = os.pipe()
    worker = [sys.executable, "-P", str(WORKER_SCRIPT), "run-orphan", "handler", "handle"]
    shell = subprocess.Popen(
        ["sh", "-c", '"$@" & echo $!; read _', "sh", *worker, str(request_r), str(answer_w)],
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        pass_fds=(request_r, answer_w),
    )
    os.close(request_r)
    os.close(answer_w)
    assert shell.stdin is not None and shell.stdout is not None
    pid = int(shell.stdout.readline())
    try:
        with os.fdopen(answer_r, "rb") as answers:
            assert answers.readline() == b"READY\n"
            shell.stdin.close()  # the shell, its "server", ends
            shell.wait(10)
            wait_until(lambda: proc_stat(pid)[1] != str(shell.pid), timeout=10)
            mark = tmp_path / "ran"
            event = _event(0, mark=str(mark))
            # A request frame (adapters/base.py, ``request_frame``): ID and input lengths, time
            # left, no trace, the input's type, nothing spooled, no condition, a nonce; the ID.
            header = b"5 %d 10000 - %s - - 0 - nonce\ninv-0" % (len(event), CODES[JSON])
            os.write(request_w, header + event)
            assert answers.readline() == b""  # it ended, unanswered: no one would read it
            assert not mark.exists()
    finally:
        os.close(request_w)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
