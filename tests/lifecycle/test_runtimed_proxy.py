"""runtimed's proxy hop (docs/protocol.md, "Proxy hop", "Timeline", "Tracing" and "Call streams";
docs/architecture.md, "The proxy hop"): the registration ID it fills in, the caller's deadline it
passes on, the IDs and methods it refuses from outside, the routing fence, what it relays back
(errors, trailers, clock readings, spans), a 5 MiB payload, its pool of channels; each call made
both ways a caller reaches runtimed. A real Runtime Server and a real runtimed on Unix sockets,
sharing a real SQLite Run store with the control plane."""

from __future__ import annotations

import json
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fnkernel.runtime_server import tracing
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server.rpc import CancellableCalls
from fnkernel.runtime_server.wire import (
    ATTEMPT_KEY,
    COLD_START_KEY,
    ERROR_TYPE_KEY,
    IDLE,
    LOGS_KEY,
    POD_KEY,
    READY,
    SPANS_KEY,
    TIMELINE_KEY,
    TIMELINE_RUNTIMED_KEY,
    TIMELINE_SERVER_KEY,
    call_streams_target,
    parse_timeline_stamps,
)
from tests.lifecycle.pods import CALLS, POD, Pod, StreamedInvoke
from tests.support import ECHO_PY, wait_until

# Each as a unary RPC (the gateway's call) and as a message of runtimed's call streams on its
# event loop (a caller on this machine's: docs/protocol.md, "Call streams"): the same relay.
EITHER_WAY = pytest.mark.parametrize("pod", CALLS, indirect=True)


@EITHER_WAY
def test_proxy_hop_fills_in_the_active_registration_id(pod: Pod) -> None:
    # docs/protocol.md, "Runs": InvokeFunction with an empty registration_id is resolved to the
    # private active one.
    run = pod.create("echo", ECHO_PY)
    assert (run.status.phase, run.status.attempt) == (READY, 1)
    response = pod.invoke(run, b'{"x": 1}')
    assert b'"echo":{"x":1}' in response.output
    assert response.registration.run_uid == run.uid
    assert response.registration.registration_id.startswith("reg_")
    status = pod.proxy.FunctionStatus(
        pb.FunctionStatusRequest(registration=pb.FunctionRegistration(run_uid=run.uid)),
        metadata=((POD_KEY, POD),),
        timeout=5,
    )
    assert status.registration.registration_id == response.registration.registration_id


@EITHER_WAY
def test_the_proxy_hop_passes_the_callers_deadline_on_or_the_30_s_default(pod: Pod) -> None:
    # docs/protocol.md, "Runs": runtimed bounds timeout_millis by its caller's deadline; a caller
    # without one gets the default of docs/protocol.md, "Limits" (30 s), never unbounded work.
    run = pod.create(
        "deadline",
        {"handler.py": "def handle(event, context):\n    return context.remaining_millis()\n"},
    )
    request = pb.InvokeFunctionRequest(
        registration=pb.FunctionRegistration(run_uid=run.uid), content_type="application/json"
    )
    routed = ((POD_KEY, POD),)
    assert 0 < int(pod.invoke_function(request, metadata=routed, timeout=2).output) <= 2100
    unbounded = int(pod.invoke_function(request, metadata=routed).output)  # no deadline
    assert 25_000 < unbounded <= 30_000


@EITHER_WAY
def test_a_registration_id_from_outside_is_invalid_argument(pod: Pod) -> None:
    run = pod.create("echo", ECHO_PY)
    active = pod.invoke(run).registration.registration_id
    with pytest.raises(grpc.RpcError) as caught:
        pod.invoke(run, registration_id=active)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "registration_id" in caught.value.details()


@pytest.mark.parametrize("method", ["RegisterFunction", "UnregisterFunction"])
def test_register_and_unregister_from_outside_are_permission_denied(pod: Pod, method: str) -> None:
    request = (
        pb.RegisterFunctionRequest(run_uid="r", registration_attempt=1)
        if method == "RegisterFunction"
        else pb.UnregisterFunctionRequest(registration=pb.FunctionRegistration(run_uid="r"))
    )
    with pytest.raises(grpc.RpcError) as caught:
        getattr(pod.proxy, method)(request, timeout=5)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED


@EITHER_WAY
def test_routing_fence_rejects_a_call_routed_for_another_pod(pod: Pod) -> None:
    run = pod.create("echo", ECHO_PY)
    with pytest.raises(grpc.RpcError) as caught:
        pod.invoke(run, pod="python-7")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "python-7" in caught.value.details()


@EITHER_WAY
def test_routing_fence_rejects_a_run_assigned_elsewhere(pod: Pod) -> None:
    # docs/protocol.md, "Runs": a Run assigned elsewhere gets FAILED_PRECONDITION, even when routed
    # "here".
    run = pod.create("echo", ECHO_PY)
    moved = pod.store.update(run, assigned_pod="python-1")
    assert moved is not None
    with pytest.raises(grpc.RpcError) as caught:
        pod.invoke(moved)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "assigned to pod python-1" in caught.value.details()


@EITHER_WAY
def test_the_proxy_hop_relays_a_handler_error_with_its_trailers(pod: Pod) -> None:
    # docs/protocol.md, "Proxy hop": runtimed passes the Runtime Server's status on unchanged,
    # UNKNOWN with the fn-error-type and fn-logs-bin trailers of a handler error included.
    failing = {
        "handler.py": "def handle(event):\n    print('before')\n    raise ValueError('no')\n"
    }
    run = pod.create("failing", failing)
    with pytest.raises(grpc.RpcError) as caught:
        pod.invoke(run)
    assert caught.value.code() == grpc.StatusCode.UNKNOWN
    assert (caught.value.details() or "").startswith("handler error: ValueError: no")
    trailers = dict(caught.value.trailing_metadata())  # type: ignore[attr-defined]
    assert trailers[ERROR_TYPE_KEY] == "ValueError"
    logs = json.loads(trailers[LOGS_KEY])
    assert {"stream": "stdout", "text": "before"} in logs


@EITHER_WAY
def test_the_proxy_hop_relays_a_calls_deadline_with_what_the_handler_wrote(pod: Pod) -> None:
    # docs/protocol.md, "Proxy hop": the server's status passes on unchanged — here
    # DEADLINE_EXCEEDED ("Errors": with what the handler wrote until then in fn-logs-bin),
    # never turned into another code by the hop.
    slow = {
        "handler.py": "import time\ndef handle(event):\n    print('started')\n    time.sleep(60)\n"
    }
    run = pod.create("slow", slow)
    request = pb.InvokeFunctionRequest(
        registration=pb.FunctionRegistration(run_uid=run.uid), input=b"{}", timeout_millis=300
    )
    with pytest.raises(grpc.RpcError) as caught:
        pod.invoke_function(request, metadata=((POD_KEY, POD),), timeout=30)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    trailers = dict(caught.value.trailing_metadata())  # type: ignore[attr-defined]
    assert {"stream": "stdout", "text": "started"} in json.loads(trailers[LOGS_KEY])
    # the message is the server's own, as the server gives it to a caller of its own — once
    # the worker killed at the deadline is replaced (a busy machine loads it past 0.3 s, and
    # until then the server's timeout is its wait for a worker, not the handler's)
    active = pod.runtimed.active(run)
    assert active is not None
    request.registration.registration_id = active.registration_id

    def servers_own() -> str | None:
        with pytest.raises(grpc.RpcError) as direct:
            pod.server.InvokeFunction(request, timeout=30)
        assert direct.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        details = direct.value.details() or ""
        return None if details.startswith("no worker became ready") else details

    assert caught.value.details() == wait_until(servers_own, timeout=30)


@EITHER_WAY
def test_the_proxy_hop_answers_each_hops_clock_readings_when_asked(pod: Pod) -> None:
    # docs/protocol.md, "Timeline": with x-fn-timeline: 1, runtimed answers fn-timeline-runtimed
    # (received, called, answered) beside the server's fn-timeline-server (received, answered),
    # monotonic readings in the order the call went; a call that does not ask gets neither.
    run = pod.create("echo", ECHO_PY)
    request = pb.InvokeFunctionRequest(
        registration=pb.FunctionRegistration(run_uid=run.uid), input=b"{}"
    )
    before = time.monotonic_ns()
    _, call = pod.invoke_function.with_call(
        request, metadata=((POD_KEY, POD), (TIMELINE_KEY, "1")), timeout=20
    )
    after = time.monotonic_ns()
    trailers = dict(call.trailing_metadata())
    runtimed = parse_timeline_stamps(trailers[TIMELINE_RUNTIMED_KEY])
    server = parse_timeline_stamps(trailers[TIMELINE_SERVER_KEY])
    assert list(runtimed) == ["received", "called", "answered"]
    assert list(server) == ["received", "answered"]
    readings = [
        before,
        runtimed["received"],
        runtimed["called"],
        server["received"],
        server["answered"],
        runtimed["answered"],
        after,
    ]
    assert readings == sorted(readings)
    _, plain = pod.invoke_function.with_call(request, metadata=((POD_KEY, POD),), timeout=20)
    names = {name for name, _ in plain.trailing_metadata()}
    assert not names & {TIMELINE_RUNTIMED_KEY, TIMELINE_SERVER_KEY, SPANS_KEY}
    assert ATTEMPT_KEY in names
    # "Tracing" too: a traced call asking for the timeline gets both, beside the hop's own
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    asked = ((POD_KEY, POD), (TIMELINE_KEY, "1"), ("traceparent", traceparent))
    _, traced = pod.invoke_function.with_call(request, metadata=asked, timeout=20)
    names = {name for name, _ in traced.trailing_metadata()}
    assert {TIMELINE_RUNTIMED_KEY, TIMELINE_SERVER_KEY, SPANS_KEY, ATTEMPT_KEY} <= names


@EITHER_WAY
def test_an_in_memory_exporter_gets_a_registrations_and_a_calls_spans_parented_along_the_path(
    pod: Pod,
) -> None:
    """docs/protocol.md, "Tracing": with OpenTelemetry's in-memory exporter given to the
    components (tracing.exporting_to), a registration's spans — runtimed's, a span per step, the
    Runtime Server's RegisterFunction and the worker's load — and a call's — runtimed's server
    and client spans, the Runtime Server's, the worker's — reach it, each the child of the span
    that asked for it, the call's in the caller's trace, with OpenTelemetry's attributes."""
    exporter = InMemorySpanExporter()
    with tracing.exporting_to(SimpleSpanProcessor(exporter)):
        run = pod.create("echo", ECHO_PY)
        trace_id, caller = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        request = pb.InvokeFunctionRequest(
            registration=pb.FunctionRegistration(run_uid=run.uid), input=b"{}"
        )
        answer = pod.invoke_function(
            request,
            metadata=((POD_KEY, POD), ("traceparent", f"00-{trace_id}-{caller}-01")),
            timeout=20,
        )
    spans = {span.context.span_id: span for span in exporter.get_finished_spans()}

    def path_to(span: ReadableSpan) -> list[tuple[str, str, str]]:
        """(service, kind, name) of `span` and each of its parents in this process, root first."""
        path = []
        while span is not None:
            service = str(span.resource.attributes["service.name"])
            path.insert(0, (service, span.kind.name, span.name))
            span = spans.get(span.parent.span_id) if span.parent else None  # type: ignore[assignment]
        return path

    (load,) = [span for span in spans.values() if span.name == "load handler.handle"]
    assert path_to(load) == [
        ("fnkernel-runtimed", "INTERNAL", "register echo attempt 1"),
        ("fnkernel-runtimed", "CLIENT", "executor.v1.FunctionRuntime/RegisterFunction"),
        ("fnkernel-runtime-server", "SERVER", "executor.v1.FunctionRuntime/RegisterFunction"),
        ("fnkernel-worker", "SERVER", "load handler.handle"),
    ]
    (register,) = [span for span in spans.values() if span.name == "register echo attempt 1"]
    steps = [
        span.name
        for span in spans.values()
        if span.parent and span.parent.span_id == register.context.span_id
    ]
    assert "write the Run's files" in steps and "write the Run's status: Ready" in steps
    (handled,) = [span for span in spans.values() if span.name == "handler.handle"]
    assert path_to(handled) == [
        ("fnkernel-runtimed", "SERVER", "executor.v1.FunctionRuntime/InvokeFunction"),
        ("fnkernel-runtimed", "CLIENT", "executor.v1.FunctionRuntime/InvokeFunction"),
        ("fnkernel-runtime-server", "SERVER", "executor.v1.FunctionRuntime/InvokeFunction"),
        ("fnkernel-worker", "SERVER", "handler.handle"),
    ]
    # the worker's span on OpenTelemetry's FaaS conventions (docs/protocol.md, "Tracing")
    assert handled.attributes is not None
    assert handled.attributes["faas.trigger"] == "other"
    assert handled.attributes["faas.invocation_id"] == answer.invocation_id
    assert handled.attributes["fnkernel.runtime"] == "python"
    root = spans[handled.parent.span_id]  # type: ignore[union-attr]
    while root.parent and root.parent.span_id in spans:
        root = spans[root.parent.span_id]
    assert root.parent is not None and f"{root.parent.span_id:016x}" == caller
    assert f"{handled.context.trace_id:032x}" == trace_id
    server = spans[handled.parent.span_id]  # type: ignore[union-attr]
    assert server.attributes is not None and root.attributes is not None
    assert server.attributes["rpc.system"] == "grpc"
    assert server.attributes["rpc.grpc.status_code"] == 0
    assert server.attributes["fnkernel.fence"] == "passed"
    assert (
        root.attributes["fnkernel.registration_id"] == server.attributes["fnkernel.registration_id"]
    )
    assert root.attributes["fnkernel.registration_attempt"] == 1
    assert not tracing.exporting()  # the block over, nothing more is recorded


@EITHER_WAY
def test_a_traced_call_the_routing_fence_refuses_shows_the_refusal_at_runtimed(pod: Pod) -> None:
    """docs/protocol.md, "Tracing": a traced call routed to another pod is refused at runtimed's
    routing fence; the spans it hands back say so there, and nothing was called beyond it."""
    run = pod.create("echo", ECHO_PY)
    request = pb.InvokeFunctionRequest(registration=pb.FunctionRegistration(run_uid=run.uid))
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with pytest.raises(grpc.RpcError) as caught:
        pod.invoke_function(
            request, metadata=((POD_KEY, "python-9"), ("traceparent", traceparent)), timeout=20
        )
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    spans = tracing.decode(dict(caught.value.trailing_metadata())[SPANS_KEY])
    assert [(span["service"], span["kind"]) for span in spans] == [("fnkernel-runtimed", "SERVER")]
    (refused,) = spans
    assert refused["attributes"]["fnkernel.fence"] == "refused: RoutedElsewhere"
    assert refused["attributes"]["rpc.grpc.status_code"] == 9  # FAILED_PRECONDITION
    assert refused["status"].startswith("FAILED_PRECONDITION: this is pod python-0, not python-9")


@EITHER_WAY
def test_a_5_mib_payload_crosses_the_proxy_hop_both_ways(pod: Pod) -> None:
    # docs/protocol.md, "Limits": payloads up to 6 MiB on every hop — above grpc's default
    # 4 MiB, so each channel runtimed calls the server on must carry our message limits.
    run = pod.create("echo", ECHO_PY)
    text = "x" * (5 * 1024 * 1024)
    response = pod.invoke(run, json.dumps(text).encode())
    assert json.loads(response.output)["echo"] == text


@EITHER_WAY
def test_a_call_to_a_run_scaled_to_zero_registers_it_again_and_says_cold_start(pod: Pod) -> None:
    # docs/protocol.md, "Runs": an Idle Run's next invoke registers it again, the same attempt,
    # and its answer says so (x-fn-cold-start); on the call streams that registration waits on
    # a thread, never on the loop, which answers other calls meanwhile.
    run = pod.create("sleepy", ECHO_PY, idle_timeout_seconds=1)
    wait_until(lambda: pod.store.get("sleepy").status.phase == IDLE, timeout=20)
    response, call = pod.invoke_function.with_call(
        pb.InvokeFunctionRequest(
            registration=pb.FunctionRegistration(run_uid=run.uid), input=b"[1]"
        ),
        metadata=((POD_KEY, POD),),
        timeout=20,
    )
    assert json.loads(response.output)["echo"] == [1]
    trailers = dict(call.trailing_metadata())
    assert (trailers[COLD_START_KEY], trailers[ATTEMPT_KEY]) == ("1", "1")
    assert pod.store.get("sleepy").status.phase == READY


def test_runtimed_stopping_waits_for_a_call_on_its_streams_and_takes_no_new_stream(
    pod: Pod,
) -> None:
    # docs/protocol.md, "Call streams": in flight is the call, not the stream — runtimed's stop
    # waits for a call on its call streams as for an RPC, within its grace, and turns away what
    # comes after it began.
    gate = {
        "handler.py": (
            "import os, time\n"
            "def handle(event):\n"
            "    open('started', 'w').close()\n"
            "    for _ in range(600):\n"
            "        if os.path.exists('go'):\n"
            "            return 'done'\n"
            "        time.sleep(0.05)\n"
        )
    }
    run = pod.create("gate", gate)
    working = pod.runtimed.working_dir(run.uid)
    streams_at = call_streams_target(pod.runtimed.address)
    assert streams_at is not None
    channels = [grpc.insecure_channel(streams_at) for _ in range(2)]
    held, late = (StreamedInvoke(channel) for channel in channels)
    request = pb.InvokeFunctionRequest(registration=pb.FunctionRegistration(run_uid=run.uid))
    answered: list[bytes] = []
    try:
        calling = threading.Thread(
            target=lambda: answered.append(
                held(request, metadata=((POD_KEY, POD),), timeout=30).output
            )
        )
        calling.start()
        wait_until(lambda: (working / "started").exists(), timeout=10)
        stopping = threading.Thread(target=lambda: pod.runtimed.stop(30))
        stopping.start()

        def turned_away() -> bool:
            try:
                late(request, metadata=((POD_KEY, POD),), timeout=5)
            except grpc.RpcError as err:
                return err.code() == grpc.StatusCode.UNAVAILABLE
            return False

        wait_until(turned_away, timeout=10)
        assert stopping.is_alive() and not answered  # still waiting for the call
        (working / "go").touch()
        calling.join(20)
        assert answered == [b'"done"']
        wait_until(lambda: not stopping.is_alive(), timeout=20)
    finally:
        (working / "go").touch()
        for channel in channels:
            channel.close()


def test_calls_beyond_the_idle_pool_close_their_channel_and_still_answer(tmp_path: Path) -> None:
    # docs/architecture.md, "The proxy hop": each proxied call takes a channel of its own from a
    # pool, which keeps a bounded number idle; a channel there is no room for is closed once its
    # call has answered. One call more than the pool keeps is in flight at once here.
    count = CancellableCalls._MAX_IDLE + 1
    held = threading.Semaphore(0)
    release = threading.Event()

    def hold(request: bytes, context: grpc.ServicerContext) -> bytes:
        held.release()
        release.wait(30)
        return request

    calls = CancellableCalls(f"unix:{tmp_path}/upstream.sock", lambda c: c.unary_unary("/t.T/Hold"))

    def relay(request: bytes, context: grpc.ServicerContext) -> bytes:
        answer: bytes = calls.call(lambda stub: stub(request, timeout=30), context)
        return answer

    servers = []
    for name, behaviour in (("upstream", hold), ("front", relay)):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=count + 8))
        handler = grpc.unary_unary_rpc_method_handler(behaviour)
        method = "Hold" if name == "upstream" else "Relay"
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("t.T", {method: handler}),)
        )
        server.add_insecure_port(f"unix:{tmp_path}/{name}.sock")
        server.start()
        servers.append(server)
    channel = grpc.insecure_channel(f"unix:{tmp_path}/front.sock")
    front = channel.unary_unary("/t.T/Relay")
    try:
        with futures.ThreadPoolExecutor(count) as clients:
            answers = [clients.submit(front, b"%d" % i, timeout=30) for i in range(count)]
            for _ in range(count):  # all in flight together, so each took a channel of its own
                assert held.acquire(timeout=30)
            release.set()
            assert [answer.result() for answer in answers] == [b"%d" % i for i in range(count)]
        assert front(b"after", timeout=30) == b"after"  # the pool serves the next call
    finally:
        release.set()
        channel.close()
        for server in servers:
            server.stop(0)
        calls.close()
