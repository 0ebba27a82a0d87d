"""A call through the gateway that asks where its time went (docs/protocol.md, "Timeline") or is
traced (docs/protocol.md, "Tracing"): each hop's clock readings and spans, parented along the
path, the context a handler and its processes see, and where a failed call failed. Through real
processes: `fnkernel gateway` → runtimed → Runtime Server."""

from __future__ import annotations

import base64
import itertools
import json
import time

from fnkernel.runtime_server import tracing
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.lifecycle.gateway_calls import FAILING_PY, create, invoke
from tests.support import INVOKE_PATH

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"


def traced(stack: Stack, name: str, body: bytes = b"{}") -> tuple[int, list[dict], bytes]:
    status, headers, answer = invoke(stack, name, body, {"traceparent": TRACEPARENT})
    return status, tracing.decode(base64.b64decode(headers["X-Fn-Spans"])), answer


def test_a_call_asking_for_the_timeline_gets_each_hops_clock_readings_in_order(
    shared_stack: Stack,
) -> None:
    # docs/protocol.md, "Timeline": X-Fn-Timeline: 1 asks every hop for its monotonic clock
    # readings; the answer lists them per hop, and one call's readings follow its path.
    name = create(shared_stack, {"handler.py": "def handle(event):\n    return event\n"})
    before = time.monotonic_ns()
    status, headers, _ = invoke(shared_stack, name, headers={"X-Fn-Timeline": "1"})
    after = time.monotonic_ns()
    assert status == 200
    hops = json.loads(headers["X-Fn-Timeline"])
    gateway, runtimed, server = hops["gateway"], hops["runtimed"], hops["server"]
    path = [
        before,
        gateway["received"],
        gateway["body"],
        gateway["called"],
        runtimed["received"],
        runtimed["called"],
        server["received"],
        server["answered"],
        runtimed["answered"],
        gateway["answered"],
        after,
    ]
    assert path == sorted(path), hops
    status, headers, _ = invoke(shared_stack, name)
    assert status == 200 and "X-Fn-Timeline" not in headers  # only when asked for


# OpenTelemetry's rpc.service: the gRPC service's full name, as the proto declares it.
SERVICE_NAME = runtime_pb2.DESCRIPTOR.services_by_name["FunctionRuntime"].full_name


HANDS_ON_ITS_CONTEXT_PY = """\
import subprocess
import sys

CHILD = "import os; print(os.environ.get('TRACEPARENT', ''))"

def handle(event, context):
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
    return [context.traceparent, child.stdout.strip()]
"""


def hop_spans(spans: list[dict]) -> dict[tuple[str, str], dict]:
    by_hop = {(span["service"], span["kind"]): span for span in spans}
    assert len(by_hop) == len(spans), spans  # one span per hop and kind
    return by_hop


def test_a_traced_call_hands_back_every_hops_spans_parented_along_its_path(
    shared_stack: Stack,
) -> None:
    """docs/protocol.md, "Tracing": a call with a W3C traceparent gets back every hop's spans —
    the gateway's HTTP server span, each hop's RPC client and server spans, the worker's — in
    the caller's trace, each the child of the span that called it, with OpenTelemetry's
    attributes; the registration ID appears at runtimed, which fills it in; the handler reads
    the worker's span context, and a process it starts finds it in $TRACEPARENT."""
    name = create(shared_stack, {"handler.py": HANDS_ON_ITS_CONTEXT_PY})
    status, spans, answer = traced(shared_stack, name)
    assert status == 200
    by_hop = hop_spans(spans)
    path = INVOKE_PATH
    assert sorted(by_hop) == sorted(path)
    parent = CALLER_SPAN
    for hop in path:
        span = by_hop[hop]
        assert (span["traceId"], span["parentSpanId"]) == (TRACE_ID, parent), hop
        assert span["status"] == "", hop
        parent = span["spanId"]
    for outer, inner in itertools.pairwise(path):  # one clock: each nests in its caller
        assert by_hop[outer]["start"] <= by_hop[inner]["start"] <= by_hop[inner]["end"]
        assert by_hop[inner]["end"] <= by_hop[outer]["end"]
    gateway = by_hop[path[0]]
    assert gateway["name"] == "POST /v1/runs/{name}:invoke"
    assert gateway["attributes"]["http.request.method"] == "POST"
    assert gateway["attributes"]["http.response.status_code"] == 200
    for hop in path[1:-1]:
        attributes = by_hop[hop]["attributes"]
        assert by_hop[hop]["name"] == f"{SERVICE_NAME}/InvokeFunction"
        assert attributes["rpc.system"] == "grpc"
        assert attributes["rpc.service"] == SERVICE_NAME
        assert attributes["rpc.method"] == "InvokeFunction"
        assert attributes["rpc.grpc.status_code"] == 0
    received = by_hop[("fnkernel-runtimed", "SERVER")]["attributes"]
    server = by_hop[("fnkernel-runtime-server", "SERVER")]["attributes"]
    assert received["fnkernel.fence"] == "passed" and server["fnkernel.fence"] == "passed"
    assert received["fnkernel.registration_id"] == server["fnkernel.registration_id"]
    assert server["fnkernel.registration_id"].startswith("reg_")
    assert received["fnkernel.registration_attempt"] == 1
    assert received["fnkernel.run_uid"] == server["fnkernel.run_uid"] != ""
    assert server["fnkernel.invocation_id"].startswith("inv_")
    worker = by_hop[("fnkernel-worker", "SERVER")]
    assert worker["name"] == "handler.handle"  # FaaS spans are named for the function
    assert worker["attributes"]["faas.trigger"] == "other"
    assert worker["attributes"]["faas.invocation_id"] == server["fnkernel.invocation_id"]
    worker_context = f"00-{TRACE_ID}-{worker['spanId']}-01"
    assert json.loads(answer) == [worker_context, worker_context]
    status, headers, answer = invoke(shared_stack, name)
    assert status == 200 and "X-Fn-Spans" not in headers  # only a traced call
    assert json.loads(answer) == ["", ""]


def test_a_bash_function_reads_a_traced_calls_context_in_traceparent(shared_stack: Stack) -> None:
    """docs/protocol.md, "Tracing": a Bash function sees the worker's span context in
    $TRACEPARENT, OpenTelemetry's environment carrier; empty when the call is not traced."""
    name = create(
        shared_stack, {"fn.sh": 'handle() { printf "[%s]" "$TRACEPARENT"; }\n'}, runtime="bash"
    )
    status, spans, answer = traced(shared_stack, name)
    assert status == 200
    worker = hop_spans(spans)[("fnkernel-worker", "SERVER")]
    assert answer == f"[00-{TRACE_ID}-{worker['spanId']}-01]".encode()
    assert worker["attributes"]["fnkernel.runtime"] == "bash"
    assert invoke(shared_stack, name)[2] == b"[]"


def test_a_traced_call_that_fails_shows_where_it_failed(shared_stack: Stack) -> None:
    """docs/protocol.md, "Tracing": a failed call's spans come back with its error answer;
    the hop that failed, and each hop it failed through, carry the error status."""
    name = create(shared_stack, FAILING_PY)
    status, spans, _ = traced(shared_stack, name, b'{"id": 7}')
    assert status == 502
    by_hop = hop_spans(spans)
    server = by_hop[("fnkernel-runtime-server", "SERVER")]
    assert server["status"] == "UNKNOWN: ValueError: bad order 7"
    assert server["attributes"]["fnkernel.error_type"] == "HandlerError"
    assert server["attributes"]["fnkernel.fence"] == "passed"  # it ran, and failed
    worker = by_hop[("fnkernel-worker", "SERVER")]
    assert worker["status"] == "ValueError: bad order 7"  # where it failed: in the handler
    for hop in [("fnkernel-runtimed", kind) for kind in ("SERVER", "CLIENT")] + [
        ("fnkernel-gateway", "CLIENT")
    ]:
        assert by_hop[hop]["attributes"]["rpc.grpc.status_code"] == 2, hop  # UNKNOWN
        assert by_hop[hop]["status"], hop
    gateway = by_hop[("fnkernel-gateway", "SERVER")]
    assert gateway["attributes"]["http.response.status_code"] == 502
    assert "bad order 7" in gateway["status"]
