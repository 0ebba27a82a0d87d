"""The fnkernel kernel through jupyter_client (docs/protocol.md, "Kernel"): a real kernel process, its embedded
runtime as real child processes, real cells."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import FunctionNotFound
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.kernel.kernels import Kernel, descendants
from tests.support import GATE_WAIT, Gate, pid_alive, wait_until

pytestmark = pytest.mark.usefixtures("fnkernel_spec")

ETL = """%%function etl
def handler(event, context):
    context.set_output("rows", str(len(event["rows"])))
    print("processing", len(event["rows"]), "rows")
    return {"total": sum(event["rows"])}
"""
SLOW = """%%function slow
import time

def handler(event):
    time.sleep(event["s"])
    return event["s"]
"""
GREET_SH = """%%function greet --runtime bash --env GREETING=hello
handler() {
  echo "name=$1" >> "$FUNCTION_OUTPUTS"
  printf '%s, %s' "$GREETING" "$1"
}
"""


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    kernel = Kernel()
    yield kernel
    kernel.shutdown()


def gateway_address(kernel: Kernel) -> str:
    address = kernel.value("get_ipython()._fnkernel_session.runtime.address")
    assert isinstance(address, str) and address
    return address


def registration(kernel: Kernel, name: str) -> dict[str, str]:
    status = kernel.value(f"{name}.status()")
    return {
        "uid": status["uid"],
        "registrationId": status["live"]["registrationId"],
        "phase": status["status"]["phase"],
    }


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


def command_lines(pids: set[int]) -> list[str]:
    return sorted(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ") for pid in pids)


def test_plain_cells_import_no_grpc_and_start_only_the_prewarmed_processes() -> None:
    # docs/protocol.md, "Kernel": a plain cell never pays for the runtime — no grpc in the
    # kernel; at start only the waiting processes of the embedded stack, which serve nothing
    # (docs/architecture.md, "The first registration").
    kernel = Kernel()
    try:
        assert kernel.value("1 + 1") == 2
        assert kernel.value("'grpc' in __import__('sys').modules") is False
        assert kernel.value("'tornado.web' in __import__('sys').modules") is False
        assert kernel.value("'ruamel.yaml' in __import__('sys').modules") is False
        assert kernel.value("'kubernetes' in __import__('sys').modules") is False
        assert kernel.value("'pyarrow' in __import__('sys').modules") is False  # on first use
        waiting = command_lines(descendants(kernel.pid))
        assert [line.split(" -m ", 1)[1].strip() for line in waiting] == [
            "fnkernel.runtime_server.cli.prewarm gateway",
            "fnkernel.runtime_server.cli.prewarm runtimed",
            "fnkernel.runtime_server.cli.prewarm serve",
        ]
    finally:
        kernel.shutdown()


def test_a_kernel_connected_to_a_shared_stack_ends_its_prewarmed_processes(
    stack_factory: Callable[..., Stack],
) -> None:
    # docs/protocol.md, "Kernel": the waiting processes serve only an embedded runtime; a
    # kernel that connects to another stack ends them rather than keep them idle.
    stack = stack_factory({"python": 1})
    kernel = Kernel()
    try:
        assert kernel.value("1 + 1") == 2
        wait_until(lambda: len(descendants(kernel.pid)) == 3, timeout=30)
        assert kernel.run(f"%fn_connect {stack.gateway_address}").ok
        wait_until(lambda: descendants(kernel.pid) == set(), timeout=10)
    finally:
        kernel.shutdown()


def test_without_prewarm_a_plain_kernel_starts_nothing() -> None:
    # README, "Environment": FNKERNEL_PREWARM=0 starts the embedded stack only when needed.
    kernel = Kernel(env={"FNKERNEL_PREWARM": "0"})
    try:
        assert kernel.value("1 + 1") == 2
        assert descendants(kernel.pid) == set()
        assert kernel.run("%%function f\ndef handler(event):\n    return event\n").ok
        assert kernel.value("f(7)") == 7
    finally:
        kernel.shutdown()


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


FAILS = """%%function fails
def handler(event):
    print("about to divide")
    return event / 0
"""


def test_a_handler_error_shows_its_traceback_and_a_line_naming_the_exception_and_cell_line(
    kernel: Kernel,
) -> None:
    # docs/protocol.md, "Kernel": the handler's own traceback as IPython shows a local error —
    # its frames only, with the cell's line numbers (the %%function line is cell line 1, so
    # `return event / 0` is cell line 4) — then the exception and the cell line; what a
    # headless log (nbconvert, papermill) prints too. The handler's prints come first.
    assert kernel.run(FAILS).ok
    cell = kernel.run("fails(1)")
    assert cell.error is not None
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in cell.error["traceback"]]
    assert lines[-1] == "ZeroDivisionError: division by zero (fails, cell line 4)"
    assert "Cell fails, line 4, in handler" in lines
    assert "---->  4     return event / 0" in lines
    assert not [line for line in lines if "fnkernel" in line or "_worker" in line]  # no platform
    assert cell.stdout == "about to divide\n"
    assert "Traceback" not in cell.stderr
    # Still a HandlerFailed, for code that catches one.
    assert kernel.run("from fnkernel.runtime_server.client.errors import HandlerFailed").ok
    assert kernel.value("isinstance(__import__('sys').last_value, HandlerFailed)") is True


def test_a_function_past_its_memory_limit_fails_in_one_line_naming_it(kernel: Kernel) -> None:
    # docs/protocol.md, "Limits": --memory MIB is the Run's memoryMb; past it the call fails
    # naming the limit and the function stays registered.
    hog = (
        "%%function hog --memory 100\ndef handler(event):\n    return len(bytearray(event << 20))\n"
    )
    assert kernel.run(hog).ok
    assert kernel.value("hog(10)") == 10 << 20
    cell = kernel.run("hog(400)")
    assert cell.error is not None
    [line] = cell.error["traceback"]
    assert line.startswith("MemoryLimitExceeded: the handler needed more than its 100 MiB"), line
    assert kernel.value("hog(1)") == 1 << 20
    assert kernel.value("hog.status()['spec']['memoryMb']") == 100


def test_fn_debug_shows_the_handlers_traceback_in_cell_lines_then_the_request(
    kernel: Kernel,
) -> None:
    # docs/protocol.md, "Kernel": %fn_debug shows the traceback as IPython shows one — the
    # cell's line numbers with context — then the request's detail, without JSON escapes.
    assert kernel.run(FAILS).ok
    kernel.run("fails(2)")
    cell = kernel.run("%fn_debug")
    # Coloured as IPython colours a traceback in the terminal (text/plain); plain in HTML.
    assert "\x1b[0;31mZeroDivisionError" in cell.result
    assert "\x1b[" not in cell.htmls()[-1]
    text = re.sub(r"\x1b\[[0-9;]*m", "", cell.result)
    assert "ZeroDivisionError                         Traceback (most recent call last)" in text
    assert "Cell fails, line 4, in handler" in text
    assert "---->  4     return event / 0" in text
    assert '       3     print("about to divide")' in text
    assert text.index("Traceback (most recent") < text.index("HTTP status: 502")
    assert '\\"' not in text and "\\n" not in text
    assert '"logs"' not in text


def test_a_payload_that_is_not_json_fails_in_one_line_naming_its_type(kernel: Kernel) -> None:
    kernel.run(ETL)
    # docs/protocol.md, "JSON encodings": the error names the path inside the value.
    cell = kernel.run('etl({"rows": [1, {2, 3}]})')
    assert cell.error is not None
    assert cell.error["traceback"] == [
        'PayloadNotJSON: the payload of etl is not JSON: payload["rows"][1]: set '
        "(convert it: sorted(x) or list(x))"
    ]
    # An Arrow kind ("Content types") that Arrow cannot hold says so, not that it is not JSON.
    cell = kernel.run('import pandas\netl(pandas.DataFrame([[1, 2]], columns=["a", "a"]))')
    assert cell.error is not None
    assert cell.error["traceback"] == [
        "PayloadNotArrow: the payload of etl cannot be sent: payload: this pandas.DataFrame "
        "cannot be written as Arrow: Duplicate column names found: ['a', 'a']"
    ]


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


def test_a_busy_function_fails_with_one_readable_line(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": errors are short, readable messages (the error class, the field, the cause).
    assert kernel.run(SLOW).ok
    cell = kernel.run(
        "import threading\n"
        "first = threading.Thread(target=slow, args=({'s': 2},))\n"
        "first.start()\n"
        "import time\n"
        "while not slow.status()['live']['inFlight']:\n"
        "    time.sleep(0.01)\n"
        "try:\n"
        "    slow({'s': 0})\n"
        "finally:\n"
        "    first.join()\n"
    )
    assert cell.error is not None
    assert cell.error["ename"] == "FunctionBusy"
    [line] = cell.error["traceback"]
    assert line.startswith('FunctionBusy: "slow" already has invocation inv_')
    assert line.endswith("in flight (RESOURCE_EXHAUSTED)")


def test_fn_debug_shows_the_full_last_error(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": the full detail is available with %fn_debug.
    cell = kernel.run('%invoke missing {"a": 1}')
    assert cell.error is not None and cell.error["ename"] == "FunctionNotFound"
    assert cell.error["traceback"] == ["FunctionNotFound: no run named 'missing' (NOT_FOUND)"]
    text = kernel.run("%fn_debug").result
    assert text.startswith("fn_debug: last error (FunctionNotFound)")
    assert "HTTP status: 404   code: NOT_FOUND" in text
    assert '"message": "no run named \'missing\'"' in text


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


def test_fn_trace_records_each_gateway_call(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": %fn_trace on records every call the kernel makes (method, request with the JSON
    # payload decoded, status, latency); %fn_trace show renders them as a table.
    kernel.run(ETL)
    assert kernel.run("%fn_trace on").ok
    kernel.run('etl({"rows": [7]})')
    kernel.run("%invoke missing")
    kernel.run("%fn_trace off")
    table = kernel.run("%fn_trace show")
    text = table.result
    lines = text.splitlines()
    assert lines[0].split() == ["#", "method", "status", "latency", "request"]
    # (The first traced call loads OpenTelemetry in every hop: past 50 ms, its live log is
    # followed too, and that stream is a call of the kernel's as well.)
    invoked = next(i for i, line in enumerate(lines) if "POST /v1/runs/etl:invoke" in line)
    assert " 200 " in lines[invoked]
    assert '{"rows": [7]}' in lines[invoked] and " ms " in lines[invoked]
    # The follow stream of the invoke's live log is a call of its own, recorded when it ends:
    # before or after the next call's line, as the two raced.
    (missing,) = [line for line in lines[invoked + 1 :] if "GET /v1/runs/missing" in line]
    assert "404 NOT_FOUND" in missing
    assert "<table class='fn-trace'>" in table.htmls()[-1]


def test_fn_trace_waterfall_draws_every_hop_of_the_last_traced_call(kernel: Kernel) -> None:
    """docs/protocol.md, "Tracing": while %fn_trace is on, each invocation carries a W3C
    traceparent; %fn_trace waterfall [INVOCATION] draws its spans — the kernel's, then every
    hop's, each nested under its caller — with the hops' attributes in the text form and on
    hover in HTML, and a failed call's failure where it happened."""
    kernel.run(ETL)
    assert kernel.run("%fn_trace on").ok
    kernel.run('etl({"rows": [7]})')
    first = kernel.run("%fn_trace waterfall")
    lines = first.result.splitlines()
    assert lines[0].startswith("trace ") and lines[0].endswith(" ms") and "7 spans" in lines[0]
    labels = [line.split("|")[0].rstrip() for line in lines if "|" in line]
    assert labels == [
        "kernel client: POST /v1/runs/{name}:invoke",
        "  gateway server: POST /v1/runs/{name}:invoke",
        "    gateway client: FunctionRuntime/InvokeFunction",
        "      runtimed server: FunctionRuntime/InvokeFunction",
        "        runtimed client: FunctionRuntime/InvokeFunction",
        "          runtime-server server: FunctionRuntime/InvokeFunction",
        "            worker server: etl.handler",  # the module %%function wrote
    ]
    assert "registration_id=reg_" in first.result and "fence=passed" in first.result
    html = first.htmls()[-1]
    assert html.count("class='fnk-wf-row'") == 7 and "rpc.system = grpc" in html
    invocation_id = next(
        word.removeprefix("invocation_id=")
        for word in first.result.split()
        if word.startswith("invocation_id=inv_")
    )
    kernel.run("%%function traced_failure\ndef handler(event):\n    raise ValueError('no rows')\n")
    kernel.run("traced_failure({})")
    failed = kernel.run("%fn_trace waterfall").result
    assert "failed: " in failed and "error_type=HandlerError" in failed
    again = kernel.run(f"%fn_trace waterfall {invocation_id}").result
    assert "failed: " not in again and f"invocation_id={invocation_id}" in again
    kernel.run("%fn_trace off")
    missing = kernel.run("%fn_trace waterfall inv_none")
    assert not missing.ok and "no traced invocation inv_none" in missing.stderr


def test_fn_trace_shows_the_calls_cells_caused_and_all_with_all(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": a registration's own status polls are the kernel's, not the
    # user's: `show` leaves them out (and says so), `show --all` has them.
    assert kernel.run("%fn_trace on").ok
    kernel.run(SLOW.replace("%%function slow", "%%function traced"))
    kernel.run("%fn_trace off")
    shown = kernel.run("%fn_trace show").result
    every = kernel.run("%fn_trace show --all").result
    assert "POST /v1/runs " in shown and "GET /v1/runs/traced" not in shown
    assert "status polls of the kernel's own not shown (%fn_trace show --all)" in shown
    assert "GET /v1/runs/traced" in every and "404 NOT_FOUND" in every


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


def _children_of_a_kernel_with_functions() -> tuple[Kernel, set[int]]:
    kernel = Kernel()
    assert kernel.run(ETL).ok
    assert kernel.run(GREET_SH).ok
    assert kernel.value('etl({"rows": [1]})') == {"total": 1}
    children = descendants(kernel.pid)
    # the gateway, and a Runtime Server and a runtimed for each runtime used (plus workers)
    assert len(children) >= 5, children
    return kernel, children


def _cmdline(pid: int) -> str:
    """The command line and state of `pid`, to say what outlived the kernel."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        return f"{cmdline} [state {state}]"
    except OSError:
        return "?"


def test_kernel_shutdown_leaves_no_child_process() -> None:
    kernel, children = _children_of_a_kernel_with_functions()
    kernel.shutdown()
    wait_until(lambda: not any(pid_alive(pid) for pid in children), timeout=10)


def test_sigkill_of_the_kernel_leaves_no_child_process_after_5s() -> None:
    # docs/protocol.md, "Kernel": the children also exit on their own if the kernel dies.
    kernel, children = _children_of_a_kernel_with_functions()
    state_dir = Path(kernel.value("str(get_ipython()._fnkernel_session.runtime._stack.state_dir)"))
    os.kill(kernel.pid, signal.SIGKILL)
    try:
        wait_until(lambda: not any(pid_alive(pid) for pid in children), timeout=5)
    except AssertionError:
        left = {pid: _cmdline(pid) for pid in children if pid_alive(pid)}
        raise AssertionError(f"still running 5 s after the kernel was killed: {left}") from None
    kernel.client.stop_channels()
    kernel.manager.cleanup_resources()
    # Nor does its state dir outlive the next kernel's embedded runtime (system/private.py).
    assert state_dir.exists()
    successor = Kernel()
    try:
        assert successor.run(ETL).ok
        assert not state_dir.exists()
    finally:
        successor.shutdown()


def test_magics_load_into_a_stock_ipykernel() -> None:
    # docs/protocol.md, "Kernel": the same magics load into any ipykernel with %load_ext fnkernel.kernel.
    kernel = Kernel("python3")
    try:
        assert kernel.value("'grpc' in __import__('sys').modules") is False
        assert kernel.run("%load_ext fnkernel.kernel").ok
        cell = kernel.run(ETL)
        assert cell.ok, cell.error
        assert kernel.value('etl({"rows": [2, 2]})') == {"total": 4}
    finally:
        kernel.shutdown()


def test_an_interrupt_in_a_stock_ipykernel_ends_the_call_in_one_line() -> None:
    # docs/protocol.md, "Kernel": there the interrupt is SIGINT, which lands inside the HTTP
    # read; the call is cancelled all the same, in one line, and the function stays usable.
    kernel = Kernel("python3")
    try:
        assert kernel.run("%load_ext fnkernel.kernel").ok
        assert kernel.run(SLOW).ok
        gateway = Client(gateway_address(kernel))
        msg_id = kernel.send('slow({"s": 30})')
        wait_until(lambda: (gateway.status("slow")["live"] or {}).get("inFlight") == 1, timeout=10)
        kernel.manager.interrupt_kernel()
        cell = kernel.collect(msg_id, timeout=10)
        assert cell.error is not None
        assert cell.error["traceback"] == [
            "KeyboardInterrupt: invocation of slow cancelled; the handler was killed and slow "
            "stays registered"
        ]
        assert kernel.value('slow({"s": 0})') == 0
    finally:
        kernel.shutdown()


def test_an_interrupted_registration_leaves_nothing_registered(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": interrupting a %%function cell while its handler loads ends
    # it in one line and deletes the half-made Run, so running the cell again starts afresh.
    slow_load = (
        "%%function loads_slowly\nimport time\ntime.sleep(30)\ndef handler(event):\n    return 1\n"
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
    kernel.manager.interrupt_kernel()
    cell = kernel.collect(msg_id, timeout=20)
    assert cell.error is not None
    assert cell.error["traceback"] == [
        "KeyboardInterrupt: registration of loads_slowly interrupted; nothing is registered"
    ]
    assert "state interrupted" in cell.texts()[-1]
    wait_until(lambda: "loads_slowly" not in [run.name for run in gateway.list_runs()], timeout=10)
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
    finally:
        kernel.shutdown()


def test_interrupt_cancels_a_function_runtime_call_from_the_protocol_client(
    kernel: Kernel,
) -> None:
    # Issue: the sync stub's .future(), cancelled from the interrupt_request override; the
    # server then kills the handler, and the client waits until it has (its own FunctionStatus
    # polls, shown by `%fn_trace show --all` only), so the registration takes the next call.
    setup = kernel.run(
        "import base64, hashlib, json\n"
        "from fnkernel.kernel.protocol import runtime_server\n"
        "rt = runtime_server('python')\n"
        'src = \'import time\\ndef handle(e):\\n    time.sleep(e["s"])\\n    return e["s"]\\n\'\n'
        "ref = rt.RegisterFunction({'runUid': 'tour-slow', 'registrationAttempt': 1,\n"
        "    'workingDir': rt.workdir({'h.py': src}), 'handler': 'h.handle',\n"
        "    'registrationDigest': 'sha256:' + hashlib.sha256(src.encode()).hexdigest()})\n"
        "ref = ref['registration']\n"
        "def call(s):\n"
        "    reply = rt.InvokeFunction({'registration': ref,\n"
        "        'input': base64.b64encode(json.dumps({'s': s}).encode()).decode()})\n"
        "    return json.loads(base64.b64decode(reply['output']))\n"
    )
    assert setup.ok, setup.error
    address = kernel.value("rt.address")
    reference = kernel.value("ref")
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.FunctionRuntimeStub(channel)
    status_request = pb.FunctionStatusRequest(
        registration=pb.FunctionRegistration(
            run_uid=reference["runUid"], registration_id=reference["registrationId"]
        )
    )
    try:
        assert kernel.run("%fn_trace on").ok
        msg_id = kernel.send("call(600)")  # its deadline is 30 s: only the interrupt ends it
        wait_until(lambda: stub.FunctionStatus(status_request, timeout=5).in_flight == 1, 10)
        kernel.manager.interrupt_kernel()
        cell = kernel.collect(msg_id, timeout=10)
        assert cell.error is not None and cell.error["ename"] == "InvocationInterrupted"
        assert cell.error["traceback"] == ["KeyboardInterrupt: InvokeFunction cancelled"]
        calls = kernel.value(
            "[(c.method, c.status, c.internal, int((c.response or {}).get('inFlight', 0)))"
            " for c in rt.trace.calls()]"
        )
        cancelled, *polls = calls
        assert cancelled == ["FunctionRuntime/InvokeFunction", "CANCELLED", False, 0]
        assert polls and all(p[:3] == ["FunctionRuntime/FunctionStatus", "OK", True] for p in polls)
        assert polls[-1][3] == 0
        assert kernel.value("call(0)") == 0
    finally:
        channel.close()


PACKAGE_CELL = """%%krm render
apiVersion: kpt.dev/v1
kind: Kptfile
metadata: {name: shop}
pipeline:
  mutators:
  - image: set-namespace:v0.4.1
    configMap: {namespace: prod}
  - image: fn://stamp
---
apiVersion: v1
kind: ConfigMap
metadata: {name: cart, namespace: dev} # the cart settings
data: {size: "3"}
"""
STAMP = """%%function stamp --krm
def handler(resource_list):
    for item in resource_list["items"]:
        item["metadata"].setdefault("labels", {})["stamped"] = "yes"
    return resource_list
"""


def test_krm_render_cell_runs_builtin_and_notebook_functions_step_by_step(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel" and "Pipelines": %%krm render (the body is a package) and fn://NAME from %%function --krm.
    assert kernel.run(STAMP).ok
    cell = kernel.run(PACKAGE_CELL)
    assert cell.ok, cell.error
    text = cell.result
    lines = text.splitlines()
    assert lines[0] == "render shop: 2 step(s)"
    assert lines[1].startswith(
        "[1] mutator ghcr.io/kptdev/krm-functions-catalog/set-namespace:v0.4.1"
    )
    # The evaluator once, the step's outcome apart from it (docs/protocol.md, "Kernel").
    assert " · builtin · " in lines[1] and lines[1].endswith(" · ok (2 info)")
    assert lines[1].count("builtin") == 1
    assert any(line.startswith("[2] mutator fn://stamp · builtin · ") for line in lines)
    assert "    -metadata: {name: cart, namespace: dev} # the cart settings" in text
    assert "    +metadata: {name: cart, namespace: prod} # the cart settings" in text
    assert "ConfigMap  prod       cart" in text  # the output resources table
    html = cell.htmls()[-1]
    assert "<details" in html and "fn://stamp" in html


FILES_CELL = """%%krm render
apiVersion: kpt.dev/v1
kind: Kptfile
metadata: {name: shop}
pipeline:
  mutators:
  - image: set-namespace
    configPath: ns.yaml
---
# file: ns.yaml
apiVersion: v1
kind: ConfigMap
metadata: {name: ns, annotations: {config.kubernetes.io/local-config: "true"}}
data: {namespace: prod}
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: db-settings
  annotations: {config.kubernetes.io/path: db/settings.yaml}
---
apiVersion: v1
kind: Service
metadata: {name: web}
"""


def test_a_krm_render_cell_names_files_and_shows_its_tree(kernel: Kernel) -> None:
    """docs/protocol.md, "Kernel": a document says its file by its path annotation or a
    `# file: NAME` line; the others go to resources.yaml; the result shows the file tree."""
    cell = kernel.run(FILES_CELL)
    assert cell.ok, cell.error  # configPath: ns.yaml is found
    text = cell.result
    tree = text.split("files:\n")[1].split("\n\n")[0].splitlines()
    assert tree == [
        "  Kptfile (changed)",
        "  db/",
        "    settings.yaml (changed)",
        "  ns.yaml",  # the function config, local config: left alone
        "  resources.yaml (changed)",
    ]
    assert "ConfigMap  prod       db-settings" in text
    assert "config.kubernetes.io/path" not in text  # it said where; it is not written
    outside = kernel.run(FILES_CELL.replace("# file: ns.yaml", "# file: ../ns.yaml"))
    assert outside.reply["content"]["ename"] == "UsageError"
    assert "document 2 names '../ns.yaml', outside the package" in outside.stderr


def test_krm_export_writes_the_notebook_function_for_kpt(kernel: Kernel, tmp_path: Path) -> None:
    """docs/krm.md, "A notebook function kpt can run": ``%krm export NAME -o PATH`` writes the
    function as one executable that needs no fnkernel (run here by a bare interpreter)."""
    assert kernel.run(STAMP).ok
    out = tmp_path / "stamp.pyz"
    cell = kernel.run(f"%krm export stamp -o {out}")
    assert cell.ok, cell.error
    assert cell.stdout.startswith(f"exported stamp to {out}: run it as `kpt fn eval --exec {out}`")
    rl = b"apiVersion: config.kubernetes.io/v1\nkind: ResourceList\nitems:\n- {apiVersion: v1, kind: ConfigMap, metadata: {name: c}}\n"
    done = subprocess.run([sys.executable, "-I", "-S", str(out)], input=rl, capture_output=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert b"labels: {stamped: yes}" in done.stdout
    missing = kernel.run(f"%krm export nothing -o {tmp_path / 'n.pyz'}")
    assert missing.reply["content"]["ename"] == "UsageError"


def test_krm_eval_cell_with_key_values(kernel: Kernel) -> None:
    cell = kernel.run(
        "%%krm eval set-annotations -- owner=data-team\n"
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: api}\nspec: {template: {spec: {}}}\n"
    )
    assert cell.ok, cell.error
    assert "+metadata: {name: api, annotations: {owner: data-team}}" in cell.result
    assert "Deployment" in cell.result.split("output resources:")[1]


def test_a_failing_krm_step_shows_its_results_and_raises_one_line(kernel: Kernel) -> None:
    cell = kernel.run(
        "%%krm render\napiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: bad}\n"
        "pipeline:\n  validators:\n  - image: set-namespace\n    configMap: {}\n---\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n"
    )
    assert cell.error is not None and cell.error["ename"] == "PipelineFailed"
    [line] = cell.error["traceback"]
    assert "`data.namespace` should not be empty" in line
    # No gateway is involved in a render: the line names no gateway status (docs/protocol.md,
    # "Kernel": the gateway's errors end with their gRPC code).
    assert line.startswith("PipelineFailed: ") and not line.endswith(")"), line
    shown = cell.texts("display_data")[-1]
    assert "[error] v1/ConfigMap/function-input: `data.namespace` should not be empty" in shown
    # Said once in the view (its result), then once as the cell's error line.
    assert shown.count("should not be empty") == 1


def test_krm_render_of_a_directory_names_the_files_changed_or_would_with_dry_run(
    kernel: Kernel, tmp_path: Path
) -> None:
    # docs/protocol.md, "Kernel": as the CLI does, the view ends with the files changed; with
    # --dry-run nothing is written and it says what would change.
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "Kptfile").write_text(
        "apiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: pkg}\npipeline:\n"
        "  mutators:\n  - image: set-labels\n    configMap: {app: shop}\n"
    )
    resources = package / "cm.yaml"
    resources.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n")
    dry = kernel.run(f"%krm render {package} --dry-run")
    assert dry.ok, dry.error
    assert "dry run, nothing written; would change: " in dry.result and "cm.yaml" in dry.result
    assert "app: shop" not in resources.read_text()
    done = kernel.run(f"%krm render {package}")
    assert done.ok, done.error
    assert "files changed: " in done.result and "cm.yaml" in done.result
    assert "app: shop" in resources.read_text()


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("%krm", "expected `render DIR`"),
        ("%krm render", "expected exactly one DIR"),
        ("%krm render a b", "expected exactly one DIR"),
        (
            "%%krm render\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n",
            "exactly one Kptfile",
        ),
        ("%%krm eval set-labels app=web\n{}\n", "put key=value pairs after --"),
        ("%krm render /no/such/dir", "is not a directory"),
    ],
)
def test_krm_usage_errors_are_one_line(kernel: Kernel, code: str, message: str) -> None:
    cell = kernel.run(code)
    assert cell.reply["content"]["ename"] == "UsageError"
    assert message in cell.stderr and "\n" not in cell.stderr.strip()


def test_krm_exec_steps_need_allow_exec_in_the_notebook_too(kernel: Kernel) -> None:
    # docs/protocol.md, "Pipelines": `exec` needs --allow-exec; in the kernel, kernel.krm.configure(allow_exec=True).
    cell = kernel.run(
        "%%krm render\napiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: x}\n"
        "pipeline:\n  mutators:\n  - exec: /bin/cat\n---\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n"
    )
    assert cell.error is not None and cell.error["ename"] == "PipelineFailed"
    assert "must run with `--allow-exec` option" in cell.error["traceback"][0]
    assert kernel.run("from fnkernel.kernel import krm; krm.configure(allow_exec=True)").ok
    cell = kernel.run(
        "%%krm render\napiVersion: kpt.dev/v1\nkind: Kptfile\nmetadata: {name: x}\n"
        "pipeline:\n  mutators:\n  - exec: /bin/cat\n---\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n"
    )
    assert cell.ok, cell.error
    assert "[1] mutator exec: /bin/cat · exec · " in cell.result
    assert kernel.run("krm.configure()").ok  # back to the default for the other tests


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
    # %functions: one row for the function, with its replicas.
    rows = kernel.run("%functions square").result.splitlines()
    assert [row.split()[0] for row in rows[1:-1]] == ["square"]
    assert "2 (2 ready, 0 busy)" in rows[1] and rows[1].rstrip().endswith("this kernel")


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


RAISES = """%%function raises
def handler(event):
    if event == "key":
        raise KeyError("missing")
    if event == "zero":
        return 1 / 0
    if event == "os":
        raise OSError(2, "no such file")
    class Mine(Exception):
        pass
    raise Mine("its own")
"""


def test_a_handlers_builtin_exception_is_caught_by_its_own_type(kernel: Kernel) -> None:
    # Issue: errors as a user of plain Python expects — `except KeyError` catches a handler's
    # KeyError, and `except HandlerFailed` every handler failure (as Ray's RayTaskError).
    assert kernel.run(RAISES).ok
    setup = kernel.run(
        "from fnkernel.runtime_server.client.errors import HandlerFailed\n"
        "def caught(payload):\n"
        "    try:\n"
        "        raises(payload)\n"
        "    except KeyError as exc:\n"
        "        return ['KeyError', isinstance(exc, HandlerFailed), str(exc)]\n"
        "    except ArithmeticError as exc:\n"
        "        return ['ArithmeticError', isinstance(exc, ZeroDivisionError), str(exc)]\n"
        "    except OSError as exc:\n"
        "        return ['OSError', isinstance(exc, FileNotFoundError), exc.error_type]\n"
        "    except HandlerFailed as exc:\n"
        "        return ['HandlerFailed', isinstance(exc, Exception), exc.error_type]\n"
    )
    assert setup.ok, setup.error
    key = kernel.value("caught('key')")
    assert key[:2] == ["KeyError", True] and not key[2].startswith('"')
    assert kernel.value("caught('zero')")[:2] == ["ArithmeticError", True]
    assert kernel.value("caught('os')") == ["OSError", True, "FileNotFoundError"]
    assert kernel.value("caught('mine')") == ["HandlerFailed", True, "Mine"]  # not ours to mix
    # Uncaught, it ends in the line naming it, as every handler failure does.
    cell = kernel.run("raises('key')")
    assert cell.error is not None and cell.error["ename"] == "HandlerFailedInCell"
    assert cell.error["traceback"][-1].startswith("KeyError: ")
    assert "(raises, cell line 4)" in cell.error["traceback"][-1]


def test_a_shared_stack_chosen_at_first_use_and_a_function_used_from_another_kernel(
    stack_factory: Callable[..., Stack],
) -> None:
    # Issue: functions shared between notebooks. The stack is chosen when the first function
    # needs it, from the environment as it is then; `%use` binds another notebook's function,
    # which that kernel never deletes; `%functions --all` marks whose each is.
    stack = stack_factory({"python": 1})
    owner, user = Kernel(), Kernel()
    try:
        assert owner.run(f"%env FNKERNEL_RUNTIME={stack.gateway_address}").ok
        cell = owner.run(ETL)
        assert cell.ok, cell.error
        assert f"on gateway {stack.gateway_address}" in cell.texts()[-1]
        gateway = Client(stack.gateway_address)
        assert [run.name for run in gateway.list_runs()] == ["etl"]  # not an embedded runtime
        gateway.create_run("other", runtime="python", handler="handler.handle",
                           files={"handler.py": "def handle(event):\n    return 'other'\n"})  # fmt: skip
        assert user.run(f"%fn_connect {stack.gateway_address}").ok
        used = user.run("%use etl")
        assert used.ok, used.error
        assert "used: not this kernel's" in used.result
        assert user.value('etl({"rows": [2, 3]})') == {"total": 5}
        refused = user.run("etl.unregister()")
        assert refused.error is not None and refused.error["ename"] == "NotOwned"
        mine = user.run("%functions").result.splitlines()
        assert [row.split()[0] for row in mine[1:-1]] == ["etl"] and "used here" in mine[1]
        every = {
            row.split()[0]: row for row in user.run("%functions --all").result.splitlines()[1:-1]
        }
        assert set(every) == {"etl", "other"} and "used here" in every["etl"]
        assert "this kernel" in owner.run("%functions --all").result
        assert (
            user.value("__import__('fnkernel.kernel', fromlist=['get']).get('other')(None)")
            == "other"
        )
        late = user.run("%fn_connect http://127.0.0.1:1")
        assert "UsageError: %fn_connect: this kernel already uses the gateway" in late.stderr
        assert "restart the kernel to use another stack" in late.stderr
        user.shutdown()
        assert gateway.status("etl").phase == "Ready"  # the user's shutdown left it alone
    finally:
        owner.shutdown()


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


WAITS = f"""%%function waits --replicas 2
{GATE_WAIT}
def handler(event):
    print("started", event["say"])
    wait_for_gate(event["go"])
    print("finished", event["say"])
    return event["say"]
"""


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


def test_after_a_restart_an_embedded_runtimes_function_says_why_it_is_gone() -> None:
    # Issue: after a kernel restart, calling a function of the old kernel was a bare NameError;
    # it says that an embedded runtime's functions end with their kernel, and how to keep them.
    kernel = Kernel()  # its own: it is restarted
    try:
        assert kernel.run("%%function gone\ndef handler(event):\n    return 1\n").ok
        kernel.manager.restart_kernel(now=False)
        kernel.client.wait_for_ready(timeout=60)
        cell = kernel.run("gone(None)")
        assert cell.error is not None and cell.error["ename"] == "NameError"
        shown = "\n".join(cell.error["traceback"])
        assert "gone was a function of this notebook's previous kernel" in shown
        assert "%fn_connect URL" in shown and "%use gone" in shown
        other = kernel.run("never_defined")
        assert other.error is not None and other.error["ename"] == "NameError"
        assert "previous kernel" not in "\n".join(other.error["traceback"])
    finally:
        kernel.shutdown()


def test_fn_trace_records_a_followed_calls_log_stream(
    kernel: Kernel, gate: Callable[[], Gate]
) -> None:
    # docs/protocol.md, "Kernel": %fn_trace records every call the cells cause, so a long
    # call's log stream ("Live output") too, beside its invoke.
    assert kernel.run(WAITS).ok
    go = gate()
    assert kernel.run("%fn_trace on").ok
    msg_id = kernel.send(f"waits({json.dumps({'say': 'traced', 'go': str(go)})})")
    kernel.wait_for_output(msg_id, "started traced")
    go.open()
    assert kernel.collect(msg_id).ok
    kernel.run("%fn_trace off")
    rows = kernel.run("%fn_trace show").result.splitlines()
    assert any("POST /v1/runs/waits:invoke" in row for row in rows)
    streams = [row for row in rows if "/logs?follow=1" in row]
    assert len(streams) == 1 and "GET /v1/runs/waits/invocations/inv_" in streams[0]
    assert " 200 " in streams[0]
