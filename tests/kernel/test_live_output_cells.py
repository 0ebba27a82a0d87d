"""A handler's prints in the cell as they come (docs/protocol.md, "Live output"), and what it
printed before a timeout or an interrupt. A real kernel through jupyter_client."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tests.kernel.cells import WAITS
from tests.kernel.kernels import Kernel
from tests.support import Gate

pytestmark = pytest.mark.usefixtures("fnkernel_spec")


def test_what_a_handler_printed_before_its_timeout_is_shown(kernel: Kernel) -> None:
    # Issue: output printed before a timeout was lost; it is the cell's output, then the error.
    code = (
        "%%function steps --timeout 0.5\nimport time\ndef handler(event):\n"
        '    print("step 1 done", flush=True)\n    time.sleep(5)\n    return 1\n'
    )
    assert kernel.run(code).ok
    cell = kernel.run("steps(None)")
    assert cell.error is not None and cell.error["ename"] == "InvocationTimedOut"
    assert cell.stdout == "step 1 done\n"
    assert kernel.value("steps.invoke(None, timeout=10).output") == 1  # the worker was replaced


@pytest.mark.parametrize("call", ["waits(P)", "waits.invoke(P)", "%invoke waits P"])
def test_a_long_calls_prints_appear_in_the_cell_while_it_runs(
    kernel: Kernel, gate: Callable[[], Gate], call: str
) -> None:
    # docs/protocol.md, "Live output": a handler's prints are the cell's output as they are
    # written, for NAME(), .invoke() and %invoke; each once, in order, when the call is over.
    assert kernel.run(WAITS).ok
    go = gate()
    msg_id = kernel.send(call.replace("P", json.dumps({"say": "live", "go": str(go)})))
    kernel.wait_for_output(msg_id, "started live")  # the handler waits for go: it is running
    go.open()
    cell = kernel.collect(msg_id)
    assert cell.ok, cell.error
    assert cell.stdout == "started live\nfinished live\n"


def test_what_a_handler_printed_before_an_interrupt_stays_in_the_cell(kernel: Kernel) -> None:
    # Issue: output printed before an interrupt was lost; it stays the cell's output.
    code = (
        "%%function chatty\nimport time\ndef handler(event):\n"
        '    print("step 1 done")\n    time.sleep(30)\n    return 1\n'
    )
    assert kernel.run(code).ok
    msg_id = kernel.send("chatty(None)")
    kernel.wait_for_output(msg_id, "step 1 done")
    kernel.manager.interrupt_kernel()
    cell = kernel.collect(msg_id, timeout=15)
    assert cell.error is not None and cell.error["ename"] == "InvocationInterrupted"
    assert cell.stdout == "step 1 done\n"


def test_every_line_a_quick_call_printed_is_in_the_cell_once(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": a handler's stdout and stderr are the cell's output, each
    # line once — also a call too quick to be followed whose log is past what its answer
    # carries (the last 4 KiB): the rest is asked of its server. A line is at most 4 KiB.
    code = (
        "%%function table\ndef handler(event):\n"
        "    for i in range(event['n']):\n        print(f'row {i:04d}', 'x' * event['w'])\n"
        "    return event['n']\n"
    )
    assert kernel.run(code).ok
    cell = kernel.run('table({"n": 100, "w": 100})')
    assert cell.ok, cell.error
    assert cell.stdout.splitlines() == [f"row {i:04d} " + "x" * 100 for i in range(100)]
    wide = kernel.run('table({"n": 3, "w": 5000})')
    assert wide.ok, wide.error
    assert [line[:8] for line in wide.stdout.splitlines()] == ["row 0000", "row 0001", "row 0002"]
    assert all(len(line.encode()) == 4096 for line in wide.stdout.splitlines())
    assert "[fnkernel" not in cell.stderr + wide.stderr
