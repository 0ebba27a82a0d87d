"""%fn_trace in the kernel (docs/protocol.md, "Kernel" and "Tracing"): each gateway call a cell
makes, its hops' waterfall, a followed call's log stream. A real kernel through jupyter_client."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest

from tests.kernel.cells import ETL, SLOW, WAITS
from tests.kernel.kernels import Kernel
from tests.support import Gate

pytestmark = pytest.mark.usefixtures("fnkernel_spec")


def test_fn_trace_records_each_gateway_call(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": %fn_trace on records every call the kernel makes (method, request with the JSON
    # payload decoded, status, latency); %fn_trace show renders them as a table.
    kernel.run(ETL)
    assert kernel.run("%fn_trace on").ok
    kernel.run('etl({"rows": [7]})')
    kernel.run("%invoke missing")
    mapped = kernel.run('etl.map([{"rows": [1]}, {"rows": [2]}])')  # a map's calls too
    assert mapped.ok, mapped.error
    kernel.run("%fn_trace off")
    table = kernel.run("%fn_trace show")
    text = table.result
    lines = text.splitlines()
    invokes = [line for line in lines if "POST /v1/runs/etl:invoke" in line]
    assert len(invokes) == 3 and all(" 200 " in line for line in invokes)
    for item in ('{"rows": [1]}', '{"rows": [2]}'):  # each item of the map, as its own call
        assert sum(line.endswith(item) for line in invokes) == 1, invokes
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
    hop's, each nested under its caller — with the hops' attributes under each bar (every
    attribute on hover in HTML), and a failed call's failure where it happened."""
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
    assert html.count("fence=passed") == first.result.count("fence=passed") > 0  # on the screen
    invocation_id = next(
        word.removeprefix("invocation_id=")
        for word in first.result.split()
        if word.startswith("invocation_id=inv_")
    )
    kernel.run("%%function traced_failure\ndef handler(event):\n    raise ValueError('no rows')\n")
    kernel.run("traced_failure({})")
    failed = kernel.run("%fn_trace waterfall").result
    assert "failed: " in failed and "error_type=HandlerError" in failed
    # Every hop names the failure's gRPC code by its name, as the server's own span does.
    reasons = {
        line.split("failed: ", 1)[1].split()[0]
        for line in failed.splitlines()
        if "failed: " in line
    }
    assert "gRPC" not in reasons and "UNKNOWN" in reasons, failed
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


def test_fn_trace_shows_env_keys_never_their_values(kernel: Kernel) -> None:
    # README, "What a handler sees": env values are never shown; `--env KEY` exists so that a
    # key set with %env is not written in the notebook — and a trace is kept in it.
    assert kernel.run("%fn_trace on").ok
    kernel.run("%env KEY=s3cr3t-v")
    # A cell of a real size: its files are shown by their sizes, so the env is in the row.
    body = "".join(f"# step {n}: a comment of a real cell's length\n" for n in range(20))
    made = kernel.run(f"%%function k --env KEY\n{body}def handler(e):\n    return 1\n")
    assert made.ok, made.stderr
    shown = kernel.run("%fn_trace show")
    (created,) = [line for line in shown.result.splitlines() if "POST /v1/runs " in line]
    assert re.search(r'"files": \{"k\.py": "\(\d+ characters\)"\}', created), created
    assert '"env": {"KEY": "(hidden)"}' in created  # its place in the request, within the cut
    assert "s3cr3t-v" not in shown.result + shown.htmls()[-1]


def test_fn_trace_names_a_binary_payload_and_never_writes_its_bytes(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": the request with its JSON payload decoded; a payload of
    # another content type (a DataFrame's Arrow stream) is named with its size, its bytes
    # never written into the notebook.
    kernel.run(ETL)
    assert kernel.run("import pandas as pd\nframe = pd.DataFrame({'a': [1, 2]})").ok
    assert kernel.run("%fn_trace on").ok
    kernel.run("etl(frame)")  # the handler's failure is not what is looked at
    kernel.run("%fn_trace off")
    text = kernel.run("%fn_trace show").result
    [invoke] = [line for line in text.splitlines() if "POST /v1/runs/etl:invoke" in line]
    assert invoke.endswith(" bytes)") and "(application/vnd.apache.arrow.stream, " in invoke
    assert "\x00" not in text and "fnkernel.kind" not in text, invoke


def test_fn_trace_shows_each_payload_as_sent_and_a_failed_create_as_failed(kernel: Kernel) -> None:
    # docs/protocol.md, "Kernel": the request column is the payload as JSON, as it was sent — a
    # string quoted, a null one `null` — and a create whose Run failed to register is not a
    # plain 201.
    kernel.run("%%function say\ndef handler(event):\n    return event\n")
    assert kernel.run("%fn_trace on").ok
    assert kernel.run('say("Ada")').ok
    assert kernel.run("say()").ok
    broken = kernel.run("%%function broken\ndef handler(event)\n    return 1\n")
    assert broken.error is not None
    kernel.run("%fn_trace off")
    lines = kernel.run("%fn_trace show").result.splitlines()
    invokes = [line for line in lines if "POST /v1/runs/say:invoke" in line]
    assert [line.rsplit("  ", 1)[-1] for line in invokes] == ['"Ada"', "null"], invokes
    [created] = [line for line in lines if "POST /v1/runs " in f"{line} " and "broken" in line]
    assert " 201 (Run Failed) " in created, created


def test_the_waterfall_of_an_interrupted_call_says_it_was_cancelled(
    kernel: Kernel, gate: Callable[[], Gate]
) -> None:
    # docs/protocol.md, "Tracing": the kernel's span of a call that had no answer says why, as
    # %fn_trace show names it (CANCELLED for an interrupt), not an HTTP status of 0.
    assert kernel.run(WAITS).ok
    go = gate()
    assert kernel.run("%fn_trace on").ok
    msg_id = kernel.send(f"waits({json.dumps({'say': 'stopped', 'go': str(go)})})")
    kernel.wait_for_output(msg_id, "started stopped")
    kernel.manager.interrupt_kernel()
    assert kernel.collect(msg_id).error is not None
    drawn = kernel.run("%fn_trace waterfall").result
    kernel.run("%fn_trace off")
    assert "failed: CANCELLED" in drawn and "HTTP 0" not in drawn, drawn
    assert "http.response.status_code=0" not in drawn
