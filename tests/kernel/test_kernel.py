"""The fnkernel kernel through jupyter_client (docs/protocol.md, "Kernel"): a real kernel process, its embedded
runtime as real child processes, real cells."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import FunctionNotFound
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.kernel.cells import ETL, GREET_SH, SLOW, gateway_address, registration
from tests.kernel.kernels import Kernel, descendants
from tests.support import pid_alive, wait_until

pytestmark = pytest.mark.usefixtures("fnkernel_spec")


def test_fnkernel_install_writes_the_kernelspec(tmp_path: Path) -> None:
    # docs/protocol.md, "Kernel": kernelspec name fnkernel, display name "Python 3 (fnkernel)"; the issue: an
    # interrupt is a message, so the kernel can cancel the invocation itself.
    done = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "install", "--prefix", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    spec = json.loads((tmp_path / "share/jupyter/kernels/fnkernel/kernel.json").read_text())
    assert spec["display_name"] == "Python 3 (fnkernel)"
    assert spec["interrupt_mode"] == "message"
    assert spec["argv"][-4:] == ["-m", "fnkernel.kernel", "-f", "{connection_file}"]
    assert "installed kernelspec fnkernel" in done.stdout
    # The launcher tile's logo, in the sizes and the SVG JupyterLab looks for.
    installed = tmp_path / "share/jupyter/kernels/fnkernel"
    for logo, size in (("logo-32x32.png", 32), ("logo-64x64.png", 64)):
        png = (installed / logo).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        assert struct.unpack(">II", png[16:24]) == (size, size)
    assert (installed / "logo-svg.svg").read_text().startswith("<svg")
    # ipykernel's debugger works in FnKernel when debugpy is there (it is, in the dev install).
    assert spec["metadata"]["debugger"] is True


def test_function_cell_registers_and_binds_a_callable(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": %%function registers the cell body; NAME(payload) returns the decoded output.
    cell = kernel.run(ETL)
    assert cell.ok, cell.error
    cards = cell.texts()
    assert cards[0].startswith("etl: runtime python")
    assert "state READY" in cards[-1] and "attempt 1" in cards[-1]
    assert "registration reg_" in cards[-1] and "digest sha256:" in cards[-1]
    # registration progress updates the card in place (one display_id)
    updates = [m for m in cell.messages if m["msg_type"] == "update_display_data"]
    display_ids = {m["content"]["transient"]["display_id"] for m in updates}
    assert len(display_ids) == 1 and len(updates) >= 2
    # Once the pod is up, the card says the handler is loading (not still "starting a pod").
    assert any("(loading the handler)" in text for text in cards)
    # A log keeps outputs, not updates: the final state is an output of its own, in place
    # of the card (issue: papermill --log-output showed "state registering" only).
    outputs = [m["msg_type"] for m in cell.messages if m["msg_type"] != "update_display_data"]
    assert outputs[-2:] == ["clear_output", "display_data"]
    assert "state READY" in cell.texts("display_data")[-1]
    assert kernel.value('etl({"rows": [1, 2, 3]})') == {"total": 6}


def test_invoke_returns_a_result_object(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": NAME.invoke(...) → output, outputs, invocation_id, duration, logs.
    kernel.run(ETL)
    result = kernel.value(
        "(lambda r: {'output': r.output, 'outputs': r.outputs, 'id': r.invocation_id, "
        "'duration': r.duration, 'logs': r.logs})"
        "(etl.invoke({'rows': [4, 5]}, timeout=5, invocation_id='inv-test-1'))"
    )
    assert result["output"] == {"total": 9}
    assert result["outputs"] == {"rows": "2"}
    assert result["id"] == "inv-test-1"
    assert 0 < result["duration"] < 5
    assert {"stream": "stdout", "text": "processing 2 rows"} in result["logs"]


def test_invoke_magic_displays_output_outputs_and_timing(kernel: Kernel) -> None:
    kernel.run(ETL)
    cell = kernel.run('%invoke etl {"rows": [1, 1]}')
    assert cell.ok, cell.error
    text = cell.texts()[-1]
    assert text.startswith("etl → {")
    assert '"total": 2' in text
    assert "outputs: rows=2" in text
    assert " ms" in text and "invocation inv_" in text
    assert "<table>" in cell.htmls()[-1]
    # The handler's print is the cell's stream output, not part of the result.
    assert cell.stdout == "processing 2 rows\n"
    assert "processing" not in text


@pytest.mark.parametrize(
    "code", ['etl({"rows": [1]})', 'etl.invoke({"rows": [1]})', '%invoke etl {"rows": [1]}']
)
def test_a_handlers_prints_are_the_cells_stream_output(kernel: Kernel, code: str) -> None:
    # docs/protocol.md, "Kernel": a handler's stdout and stderr are the cell's stream output, as a
    # local call's would be, however the function is called.
    kernel.run(ETL)
    kernel.run(
        "%%function noisy\nimport sys\ndef handler(event):\n"
        "    print('to stdout')\n    print('to stderr', file=sys.stderr)\n    return 1\n"
    )
    cell = kernel.run(code.replace("etl", "noisy").replace('{"rows": [1]}', "0"))
    assert cell.ok, cell.error
    assert cell.stdout == "to stdout\n"
    assert cell.stderr == "to stderr\n"


def test_a_big_result_shows_its_first_lines_as_text_and_scrolls_in_html(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": 20 lines of text, then how many more; HTML scrolls.
    kernel.run("%%function many\ndef handler(event):\n    return list(range(event))\n")
    cell = kernel.run("%invoke many 300")
    text = cell.texts()[-1]
    assert "… 282 more lines" in text
    assert len(text.splitlines()) <= 22
    assert "class='fnk-scroll'" in cell.htmls()[-1]


def test_rerunning_an_unchanged_cell_keeps_the_run_and_registration(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": re-running with identical source is idempotent.
    kernel.run(ETL)
    before = registration(kernel, "etl")
    cell = kernel.run(ETL)
    assert cell.ok, cell.error
    assert "(unchanged)" in cell.texts()[-1]
    assert registration(kernel, "etl") == before


def test_an_edited_cell_replaces_the_run(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": with changed source the old Run is unregistered and a new Run registered.
    kernel.run(ETL)
    before = registration(kernel, "etl")
    cell = kernel.run(ETL.replace('{"total": sum(event["rows"])}', '{"max": max(event["rows"])}'))
    assert cell.ok, cell.error
    after = registration(kernel, "etl")
    assert after["uid"] != before["uid"]
    assert after["registrationId"] != before["registrationId"]
    assert kernel.value('etl({"rows": [3, 9]})') == {"max": 9}
    uids = [run["uid"] for run in Client(gateway_address(kernel)).list_runs()]
    assert before["uid"] not in uids and after["uid"] in uids
    kernel.run(ETL)  # back to the original for the other tests


def test_bash_function_with_env_and_outputs(kernel: Kernel) -> None:
    cell = kernel.run(GREET_SH)
    assert cell.ok, cell.error
    assert "runtime bash" in cell.texts()[-1]
    # The payload reaches "$1" as its JSON text; output that is not JSON comes back as text.
    result = kernel.value("(lambda r: [r.output, r.outputs])(greet.invoke('ada'))")
    assert result == ['hello, "ada"', {"name": '"ada"'}]


def test_interrupt_cancels_the_invocation_and_the_function_stays_usable(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": interrupting during an invocation cancels it (the handler is killed), raises
    # KeyboardInterrupt in the cell, and the function stays registered and usable.
    assert kernel.run(SLOW).ok
    gateway = Client(gateway_address(kernel))
    # The call would run 600 s, and end at its 30 s deadline: only the interrupt ends it within
    # the 10 s the cell is given.
    msg_id = kernel.send('slow({"s": 600})')
    wait_until(lambda: (gateway.status("slow")["live"] or {}).get("inFlight") == 1, timeout=10)
    kernel.manager.interrupt_kernel()
    cell = kernel.collect(msg_id, timeout=10)
    assert cell.error is not None
    assert cell.error["ename"] == "InvocationInterrupted"  # a KeyboardInterrupt subclass
    assert cell.error["traceback"] == [
        "KeyboardInterrupt: invocation of slow cancelled; the handler was killed and slow "
        "stays registered"
    ]
    assert kernel.value('slow({"s": 0})') == 0  # not FunctionBusy: the handler is gone


def test_timeout_flag_bounds_each_invocation(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": --timeout S is the invocation timeout; past it the handler is stopped and the
    # function stays usable.
    assert kernel.run(SLOW.replace("%%function slow", "%%function bounded --timeout 0.3")).ok
    cell = kernel.run('bounded({"s": 5})')
    assert cell.error is not None and cell.error["ename"] == "InvocationTimedOut"
    assert cell.error["traceback"][0].endswith("(DEADLINE_EXCEEDED)")
    # It says the limit and how to change it (issue: errors as a user of plain Python expects).
    assert "bounded timed out after 0.3 s; give it more with %%function bounded --timeout S " \
        "or bounded.invoke(payload, timeout=S)" in cell.error["traceback"][0]  # fmt: skip
    # Usable: the next call waits for the worker that replaces the stopped one, and that wait
    # counts in its deadline — so it is given one a restart fits in on a busy machine (with
    # 0.3 s, a CI run's restart took longer).
    assert kernel.value('bounded.invoke({"s": 0}, timeout=30).output') == 0
    assert kernel.value('bounded.invoke({"s": 0.5}, timeout=3).output') == 0.5
    # A map's says how to give its items more, and which item ran out of it.
    cell = kernel.run('bounded.map([{"s": 0}, {"s": 5}])')
    assert cell.error is not None and cell.error["ename"] == "InvocationTimedOut"
    assert "give it more with %%function bounded --timeout S or bounded.map(items, timeout=S)" \
        " (DEADLINE_EXCEEDED) (index 1 of 2 items)" in cell.error["traceback"][0]  # fmt: skip


def test_a_handler_that_cannot_load_fails_the_registration(kernel: Kernel) -> None:
    cell = kernel.run("%%function broken\ndef handler(event:\n    return 1\n")
    assert cell.error is not None and cell.error["ename"] == "RegistrationFailed"
    [line] = cell.error["traceback"]
    # The file's line 1 is the cell's line 2 (docs/protocol.md, "Kernel").
    assert line.startswith(
        'RegistrationFailed: "broken" did not register: UserCodeSyntaxError: cell line 2'
    )
    assert "state Failed" in cell.texts()[-1]
    fixed = kernel.run("%%function broken\ndef handler(event):\n    return 1\n")
    assert fixed.ok, fixed.error
    assert kernel.value("broken()") == 1
    # bash's own words for where ("broken_sh.sh: line 3") are told as the cell's line too.
    cell = kernel.run("%%function broken_sh --runtime bash\nhandler() {\n  if then fi\n}\n")
    assert cell.error is not None and cell.error["ename"] == "RegistrationFailed"
    [line] = cell.error["traceback"]
    assert "UserCodeSyntaxError: cell line 3: syntax error" in line, line


def test_every_magic_answers_help_with_its_usage(kernel: Kernel) -> None:
    # README, "Magics": each magic's first line is its usage; `--help` (or `-h`) prints it, as
    # `%function --help` prints its flags — never a call of a function named "--help".
    for magic, usage in [
        ("invoke", "%invoke NAME [JSON]"),
        ("use", "%use NAME"),
        ("functions", "%functions [--all] [NAME...]"),
        ("fn_connect", "%fn_connect URL"),
        ("krm", "%krm render DIR [--dry-run]"),
        ("fn_trace", "%fn_trace on|off|show"),
        ("fn_debug", "%fn_debug"),
    ]:
        for flag in ("--help", "-h", "render --help", "show -h", "waterfall --help"):
            cell = kernel.run(f"%{magic} {flag}")
            assert cell.ok, (magic, cell.error)
            assert cell.stdout.startswith(usage), (magic, cell.stdout)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("%%function etl --runtime ruby", "argument --runtime: invalid choice: 'ruby'"),
        ("%%function etl --idle-timeout soon", "argument --idle-timeout: 'soon' is not a number"),
        ("%%function etl --env =x", "argument --env: '=x' is not KEY=VALUE"),
        ("%%function etl --env NOVALUE", "'NOVALUE' is not set in this kernel's environment"),
        ("%%function etl --colour red", "unrecognized arguments: --colour red"),
        ("%%function my-fn", "NAME 'my-fn' must be a Python identifier"),
        ("%%function", "the following arguments are required: name"),
        # --include takes every path after it, NAME too: where NAME goes is said.
        (
            "%%function --include helpers.py etl",
            "the following arguments are required: name; "
            "give them before the flags: a flag of several values (--include) takes every word "
            "after it",
        ),
    ],
)
def test_bad_flags_raise_a_one_line_usage_error(kernel: Kernel, line: str, message: str) -> None:
    # docs/protocol.md, "Kernel" / issue: bad flags raise IPython's UsageError with a one-line message.
    cell = kernel.run(f"{line}\ndef handler(event):\n    return 1\n")
    assert not cell.ok
    assert cell.reply["content"]["ename"] == "UsageError"
    text = cell.stderr.strip()
    assert text.startswith("UsageError: %%function: ")
    assert message in text
    assert "\n" not in text


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("%%function class", "class is a Python keyword: a cell could not call it"),
        (
            "%%function print",
            "print is a Python builtin: the function would stand in for print in every later cell",
        ),
        (
            "%%function sum --runtime bash",
            "sum is a Python builtin: the function would stand in for sum in every later cell",
        ),
        (
            "%%function csv",
            "csv is a module of Python's standard library: the cell's file "
            "csv.py would hide it from the handler",
        ),
        ("%%function polars --requirements polars", "polars is a package it requires"),
    ],
)
def test_a_name_the_handler_could_not_live_with_is_refused(
    kernel: Kernel, line: str, message: str
) -> None:
    # README, "What a handler sees": the cell is its Run's NAME.py, first on the handler's
    # import path — so it would stand in for a module of that name, in every library too.
    cell = kernel.run(f"{line}\ndef handler(event):\n    return 1\n")
    assert cell.reply["content"]["ename"] == "UsageError"
    assert message in cell.stderr and "name the function otherwise" in cell.stderr


def test_functions_table_lists_live_state(kernel: Kernel) -> None:
    kernel.run(ETL)
    text = kernel.run("%functions").result
    header, *rows = text.splitlines()
    assert header.split()[:4] == ["name", "runtime", "phase", "state"]
    etl = next(row for row in rows if row.startswith("etl "))
    assert "Ready" in etl and "READY" in etl and "reg_" in etl
    assert "embedded runtime at unix:" in text
    only = kernel.run("%functions etl").result
    assert [r.split()[0] for r in only.splitlines()[1:-1]] == ["etl"]
    # A name no function has is said so, not "no functions registered" beside etl.
    assert kernel.run("%functions nosuch").result.startswith("no function named nosuch (")
    both = kernel.run("%functions etl nosuch").result.splitlines()
    assert both[1].startswith("etl ") and both[-2] == "no function named nosuch"


def test_completion_offers_registered_names(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": after %invoke and %functions, the registered names alone,
    # typed as functions; a failed one is left out.
    kernel.run(ETL)
    kernel.run("%%function eviltwin\ndef handler(event:\n    pass\n")  # fails to load
    for code in ("%invoke e", "%functions e", "%functions etl e"):
        reply = kernel.request("complete", code=code, cursor_pos=len(code))
        assert reply["matches"] == ["etl"], reply
        types = reply["metadata"]["_jupyter_types_experimental"]
        assert [(t["text"], t["type"]) for t in types] == [("etl", "function")]
    # Past %invoke's NAME comes the payload: no names there.
    code = "%invoke etl e"
    assert "etl" not in kernel.request("complete", code=code, cursor_pos=len(code))["matches"]
    # A function of replicas is one name, not one a Run (etl2.1 is etl2's replica).
    assert kernel.run("%%function etl2 --replicas 2\ndef handler(event):\n    return 2\n").ok
    reply = kernel.request("complete", code="%invoke e", cursor_pos=len("%invoke e"))
    assert reply["matches"] == ["etl", "etl2"], reply


def test_inspection_shows_source_runtime_and_status(kernel: Kernel) -> None:
    # Issue: NAME? shows the function's handler source, runtime and status.
    kernel.run(ETL)
    reply = kernel.request("inspect", code="etl", cursor_pos=3, detail_level=0)
    text = reply["data"]["text/plain"]
    assert "python function 'etl', handler etl.handler" in text
    assert "state READY" in text
    assert 'context.set_output("rows", str(len(event["rows"])))' in text


def test_unregister_removes_the_function(kernel: Kernel) -> None:
    kernel.run(SLOW.replace("%%function slow", "%%function temp"))
    assert kernel.value("temp.unregister(cancel=True, drain_timeout=1)") is None
    names = [run["name"] for run in Client(gateway_address(kernel)).list_runs()]
    assert "temp" not in names
    cell = kernel.run("temp(1)")
    assert cell.error is not None and cell.error["ename"] == "FunctionNotFound"
    # Once more is no error: as the protocol's unregister of an absent registration succeeds.
    assert kernel.value("temp.unregister()") is None


def test_an_interrupted_registration_leaves_nothing_registered(
    kernel: Kernel, tmp_path: Path
) -> None:
    # docs/protocol.md, "Kernel": interrupting a %%function cell while its handler loads ends
    # it in one line and deletes the half-made Run — its worker killed, not left to load on —
    # so running the cell again starts afresh.
    said = tmp_path / "pid"
    slow_load = (
        "%%function loads_slowly\nimport os, time\n"
        f"open({str(said)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(30)\ndef handler(event):\n    return 1\n"
    )
    kernel.run("1")  # the embedded runtime is up (other tests started it)
    gateway = Client(gateway_address(kernel))
    msg_id = kernel.send(slow_load)

    def pending() -> bool:
        try:
            return bool(gateway.status("loads_slowly").phase == "Pending")
        except FunctionNotFound:
            return False

    wait_until(pending, timeout=20)
    wait_until(lambda: said.exists() and said.read_text() != "", timeout=20)  # mid-import
    kernel.manager.interrupt_kernel()
    cell = kernel.collect(msg_id, timeout=20)
    assert cell.error is not None
    assert cell.error["traceback"] == [
        "KeyboardInterrupt: registration of loads_slowly interrupted; nothing is registered"
    ]
    assert "state interrupted" in cell.texts()[-1]
    wait_until(lambda: "loads_slowly" not in [run.name for run in gateway.list_runs()], timeout=10)
    wait_until(lambda: not pid_alive(int(said.read_text())), timeout=10)
    again = kernel.run(slow_load.replace("time.sleep(30)", "time.sleep(0)"))
    assert again.ok, again.error
    assert kernel.value("loads_slowly(None)") == 1


def test_fnkernel_runtime_points_the_kernel_at_an_existing_gateway(
    stack_factory: Callable[..., Stack],
) -> None:
    # docs/protocol.md, "Kernel": it connects to $FNKERNEL_RUNTIME when set, instead of an embedded runtime.
    stack = stack_factory()
    kernel = Kernel(env={"FNKERNEL_RUNTIME": stack.gateway_address})
    try:
        assert kernel.run(ETL).ok
        assert descendants(kernel.pid) == set()  # nothing embedded was started
        assert Client(stack.gateway_address).invoke("etl", {"rows": [5]}).value() == {"total": 5}
        text = kernel.run("%functions").result
        assert f"gateway at {stack.gateway_address}" in text
        # The stack is chosen at the first function: a later %env naming another is refused at
        # the next %%function in one line, not ignored while the cell registers elsewhere.
        assert kernel.run("%env FNKERNEL_RUNTIME=http://127.0.0.1:9").ok
        cell = kernel.run(GREET_SH)
        assert cell.error is not None and cell.error["ename"] == "StackChosen"
        [line] = cell.error["traceback"]
        assert "FNKERNEL_RUNTIME is http://127.0.0.1:9, but this kernel already uses" in line
        assert "refused" in cell.texts()[-1]  # the card says it did not register
        assert kernel.value('etl({"rows": [2]})') == {"total": 2}  # its functions still work
    finally:
        kernel.shutdown()
