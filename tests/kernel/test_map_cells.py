"""NAME.map in the kernel (docs/protocol.md, "Replicas", "Kernel" and "Live output"): one call
an item, its bar, an interrupt or a restart mid-map. A real kernel through jupyter_client."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.kernel.cells import SLOW, WAITS, gateway_address
from tests.kernel.kernels import Kernel
from tests.support import Gate, wait_until

pytestmark = pytest.mark.usefixtures("fnkernel_spec")


SQUARE = """%%function square --replicas 2
import time

def handler(event):
    time.sleep(0.02)
    if event == 13:
        raise KeyError("thirteen")
    return event * event
"""


def test_map_calls_a_function_of_replicas_once_per_item_with_progress(kernel: Kernel) -> None:
    # docs/protocol.md, "Replicas": NAME.map returns the outputs in input order, shows a bar
    # updated in place, and says the end in one line of text for a log.
    assert kernel.run(SQUARE).ok
    status = kernel.value("square.status()")
    assert [r["name"] for r in status["replicas"]] == ["square", "square.1"]
    cell = kernel.run("squares = square.map(range(12))")
    assert cell.ok, cell.error
    assert kernel.value("squares") == [n * n for n in range(12)]
    texts = cell.texts()
    assert texts[0] == "square.map: 0/12 running"
    assert len(texts) <= 12 // 2 + 2  # updated in place, not once per item
    # The end: the bar, full and green, is HTML only; its one line of text is the log's.
    assert "<progress max='12' value='12'" in cell.htmls()[-1]
    assert "fnk-edge-ok" in cell.htmls()[-1] and texts[-1] == ""
    assert cell.stdout.strip().endswith("square.map: 12/12 done")
    assert cell.stdout.count("square.map: 12/12 done") == 1
    # A failure: the handler's own, with its cell line, after the calls in flight are cancelled.
    failed = kernel.run("square.map([1, 13, 2])")
    assert not failed.ok and failed.error is not None
    assert failed.error["ename"] == "HandlerFailedInCell" and "thirteen" in failed.error["evalue"]
    mixed = kernel.value("[repr(r) if isinstance(r, Exception) else r "
                         "for r in square.map([1, 13, 2], return_exceptions=True)]")  # fmt: skip
    assert mixed[0] == 1 and mixed[2] == 4 and "thirteen" in mixed[1]
    assert kernel.value("square(3)") == 9  # still registered, both replicas free
    # A timeout a call cannot take is one line naming it, before anything is called.
    for call in ("square.map([1, 2], timeout=-5)", "square.invoke(2, timeout=-1)"):
        refused = kernel.run(call)
        assert refused.error is not None and refused.error["ename"] == "BadArgument", call
        assert refused.error["traceback"] == [
            f"ValueError: {call.split('(')[0]}: timeout must be seconds above 0 (or None, for "
            f"--timeout's), got {call.rsplit('=', 1)[1].rstrip(')')}"
        ]
    # A DataFrame is one value, not items (it iterates its column labels): one line saying how
    # to give its parts, not a traceback through the kernel's modules.
    one = kernel.run("import pandas as pd\nsquare.map(pd.DataFrame({'a': [1, 2]}))")
    assert one.error is not None and one.error["ename"] == "MapItemsNotGiven"
    assert one.error["traceback"] == [
        "TypeError: square.map takes its items, a call each, and a pandas.DataFrame is one "
        "item: map over its parts or rows ([frame.iloc[i:i + rows] for i in range(0, "
        "len(frame), rows)] or frame.to_dict('records'))"
    ]
    # A groupby gives (key, part) pairs, which cannot travel: how to map over its parts.
    grouped = kernel.run("square.map(pd.DataFrame({'a': [1, 2], 'k': [0, 0]}).groupby('k'))")
    assert grouped.error is not None and grouped.error["traceback"] == [
        "TypeError: square.map takes its items, a call each, and a pandas DataFrameGroupBy gives "
        "(key, part) pairs: map over its parts ([part for _, part in grouped])"
    ]
    # %functions: one row for the function, with its replicas.
    rows = kernel.run("%functions square").result.splitlines()
    assert [row.split()[0] for row in rows[1:-1]] == ["square"]
    assert "2 (2 ready, 0 busy)" in rows[1] and rows[1].rstrip().endswith("this kernel")


def test_a_maps_item_that_cannot_be_sent_fails_in_one_line_naming_it(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": a payload that is not JSON, or of an Arrow kind Arrow cannot
    # hold, fails in one line naming where in it — a map's item as a call's, naming its item
    # too — and the bar ends, saying so; with return_exceptions, it is in its item's place.
    assert kernel.run(SQUARE).ok
    cell = kernel.run("square.map([1] * 5 + [{'s': {1, 2}}] + [2] * 5)")
    assert cell.error is not None and cell.error["ename"] == "PayloadNotJSON", cell.error
    assert cell.error["traceback"] == [
        'PayloadNotJSON: the payload of square is not JSON: payload["s"]: set (convert it: '
        "sorted(x) or list(x)) (index 5 of 11 items)"
    ]
    assert "square.map: " in cell.stdout and " running" not in cell.stdout.splitlines()[-1]
    assert "fnk-edge-error" in cell.htmls()[-1] or "fnk-edge-cancelled" in cell.htmls()[-1]
    frames = kernel.run(
        "import pandas as pd\n"
        "square.map([pd.DataFrame({'a': [1]}), pd.DataFrame([[1, 2]], columns=['a', 'a'])])"
    )
    assert frames.error is not None and frames.error["ename"] == "PayloadNotArrow"
    assert frames.error["traceback"] == [
        "PayloadNotArrow: the payload of square cannot be sent: payload: this pandas.DataFrame "
        "cannot be written as Arrow: Duplicate column names found: ['a', 'a'] (index 1 of 2 "
        "items)"
    ]
    kept = kernel.value(
        "[type(r).__name__ for r in square.map([3, {4}, 5], return_exceptions=True)]"
    )
    assert kept == ["int", "PayloadNotJSON", "int"]


def test_a_map_of_a_used_function_runs_the_one_version_it_began_on(
    stack_factory: Callable[..., Stack], tmp_path: Path
) -> None:
    # docs/protocol.md, "Ownership": a %use binding follows the name from one call to the
    # next; one map runs one version: its items after the Run it began on was replaced (its
    # owner edited the cell) are not called — 404, "not the Run this call was meant for" —
    # never run by the new version beside the old one's results.
    stack = stack_factory({"python": 1})
    client = Client(stack.gateway_address)
    half = tmp_path / "half"
    version = (
        "import pathlib, time\ndef handle(event):\n    if event == 5:\n"
        f"        pathlib.Path({str(half)!r}).touch()\n    time.sleep(0.05)\n    return 'VERSION'\n"
    )
    client.create_run("clean", runtime="python", handler="handler.handle",
                      files={"handler.py": version.replace("VERSION", "v1")})  # fmt: skip
    kernel = Kernel()
    try:
        assert kernel.run(f"%fn_connect {stack.gateway_address}").ok
        assert kernel.run("%use clean").ok
        mapped: list[Any] = []
        mapping = threading.Thread(target=lambda: mapped.append(kernel.run(
            "results = clean.map(range(40), return_exceptions=True)\n"
            "kinds = [r if isinstance(r, str) else type(r).__name__ for r in results]"
        )))  # fmt: skip
        mapping.start()
        try:
            wait_until(half.exists, timeout=60)
            client.delete_run("clean")  # its owner's edit: the Run replaced by another
            client.create_run("clean", runtime="python", handler="handler.handle",
                              files={"handler.py": version.replace("VERSION", "v2")})  # fmt: skip
        finally:
            mapping.join(timeout=120)
        assert mapped and mapped[0].ok, mapped and mapped[0].error
        kinds = kernel.value("kinds")
        assert "v2" not in kinds and kinds[:5] == ["v1"] * 5, kinds
        assert "FunctionNotFound" in kinds, kinds
        assert kernel.value("clean(0)") == "v2"  # the next call follows the name
    finally:
        kernel.shutdown()


def test_interrupting_a_map_cancels_every_call_and_keeps_every_replica(kernel: Kernel) -> None:
    # docs/protocol.md, "Replicas": an interrupt cancels every call in flight (the handlers are
    # killed); the function and its replicas stay registered, free for the next call.
    assert kernel.run(SLOW.replace("%%function slow", "%%function slow --replicas 2")).ok
    gateway = Client(gateway_address(kernel))

    def busy() -> int:
        return sum(r["inFlight"] for r in gateway.status("slow")["replicas"])

    msg_id = kernel.send('slow.map([{"s": 10}] * 6)')
    wait_until(lambda: busy() == 2, timeout=10)
    kernel.manager.interrupt_kernel()
    cell = kernel.collect(msg_id, timeout=15)
    assert cell.error is not None and cell.error["ename"] == "InvocationInterrupted"
    assert "map of slow cancelled" in cell.error["evalue"]
    # The bar ends grey, "cancelled", not "running"; its one line says so once.
    assert "fnk-edge-muted" in cell.htmls()[-1] and "0/6 cancelled" in cell.htmls()[-1]
    assert cell.stdout.count("slow.map: 0/6 cancelled") == 1
    # Once the cell has ended, no server holds a call any more: the next calls are not busy.
    assert busy() == 0
    assert all(not (gateway.status(n).live or {}).get("inFlight") for n in ("slow", "slow.1"))
    replicas = gateway.status("slow")["replicas"]
    assert [(r["name"], r["phase"]) for r in replicas] == [("slow", "Ready"), ("slow.1", "Ready")]
    assert kernel.value('slow.map([{"s": 0}, {"s": 0}])') == [0, 0]


def test_a_kernel_restarted_mid_map_ends_the_bar_as_cancelled() -> None:
    # docs/protocol.md, "Kernel": the kernel's shutdown mid-map (a restart by a client that
    # still listens, as nbclient does) ends the bar, grey "cancelled", before the kernel goes.
    kernel = Kernel()
    try:
        assert kernel.run(SLOW).ok
        gateway = Client(gateway_address(kernel))
        msg_id = kernel.send('slow.map([{"s": 20}] * 3)')
        wait_until(lambda: (gateway.status("slow").live or {}).get("inFlight"), timeout=10)
        kernel.manager.restart_kernel(now=False)
        updates = []
        while not any("cancelled" in html for html in updates):
            message = kernel.client.get_iopub_msg(timeout=10)
            if message["msg_type"] == "update_display_data":
                assert message["parent_header"].get("msg_id") == msg_id
                updates.append(message["content"]["data"].get("text/html", ""))
        assert "fnk-edge-muted" in updates[-1] and "slow.map: 0/3 cancelled" in updates[-1]
    finally:
        kernel.shutdown()


def test_a_maps_lines_are_marked_with_their_item_as_they_come(
    kernel: Kernel, gate: Callable[[], Gate]
) -> None:
    # docs/protocol.md, "Live output": in map, each line is marked with its item.
    assert kernel.run(WAITS).ok
    go = gate()
    items = [{"say": say, "go": str(go)} for say in ("a", "b")]
    msg_id = kernel.send(f"waits.map({items!r})")
    kernel.wait_for_output(msg_id, "[1] started b")
    go.open()
    cell = kernel.collect(msg_id)
    assert cell.ok, cell.error
    lines = cell.stdout.splitlines()
    assert sorted(lines[:-1]) == ["[0] finished a", "[0] started a", "[1] finished b",
                                  "[1] started b"]  # fmt: skip
    assert lines[-1] == "waits.map: 2/2 done"
