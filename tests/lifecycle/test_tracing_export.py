"""docs/protocol.md, "Tracing": with an OTLP endpoint in the environment, every component exports
the spans of every call over OTLP/gRPC — here to a collector this test runs (a test double of a
team's Jaeger or Tempo: OpenTelemetry's own TraceService, recording what it is sent)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import GatewayError
from fnkernel.runtime_server.lifecycle.secrets import SecretFiles
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.otlp import Collector, collecting
from tests.support import INVOKE_PATH, wait_until


@pytest.fixture
def collector() -> Iterator[tuple[Collector, str]]:
    with collecting() as found:
        yield found


@pytest.fixture
def exporting(
    tmp_path: Path, collector: tuple[Collector, str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Collector, Client, Stack]]:
    """A stack whose components export to the collector, a client of its gateway, the stack."""
    received, endpoint = collector
    monkeypatch.setenv("FNKERNEL_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # OpenTelemetry's batch delay, in ms
    stack = Stack(tmp_path / "state", {"python": 1}, gateway_listen="127.0.0.1:0")
    stack.start()
    try:
        yield received, Client(stack.gateway_address), stack
    finally:
        stack.stop()


def test_with_an_otlp_endpoint_every_component_exports_each_calls_spans(
    exporting: tuple[Collector, Client, Stack],
) -> None:
    """A call that carries no traceparent is traced all the same: its trace starts at the
    gateway, every hop's spans reach the collector parented along the path, and the caller,
    who did not ask, gets none back."""
    received, client, _ = exporting
    handler = {"handler.py": "def handle(event):\n    return event\n"}
    client.create_run("echo", runtime="python", handler="handler.handle", files=handler)
    result = client.invoke("echo", {"n": 1})
    assert result.value() == {"n": 1} and result.spans == b""

    def exported() -> list[dict]:
        """The call's spans, once the four processes' six are in (each exports in batches)."""
        spans = list(received.spans)
        roots = [span for span in spans if span["name"] == "POST /v1/runs/{name}:invoke"]
        ours = [span for span in spans if span["traceId"] in {r["traceId"] for r in roots}]
        return ours if len(ours) >= 6 else []

    wait_until(lambda: bool(exported()), timeout=20)
    (root,) = [span for span in exported() if span["parentSpanId"] == ""]
    assert root["parentSpanId"] == ""  # no caller's context: the gateway began the trace
    trace = {span["spanId"]: span for span in exported()}
    path = [(root["service"], root["kind"])]
    span = root
    while children := [s for s in trace.values() if s["parentSpanId"] == span["spanId"]]:
        (span,) = children
        path.append((span["service"], span["kind"]))
    assert path == INVOKE_PATH
    assert span["attributes"]["faas.invocation_id"] == result.invocation_id


def test_a_call_whose_client_hangs_up_is_exported_as_cancelled(
    exporting: tuple[Collector, Client, Stack],
) -> None:
    """A client that goes away cancels its call (docs/protocol.md, "HTTP API"); the gateway's
    span of it still ends, as cancelled, and is exported with the rest."""
    received, client, _ = exporting
    handler = {"handler.py": "import time\ndef handle(event):\n    time.sleep(30)\n"}
    client.create_run("slow", runtime="python", handler="handler.handle", files=handler)
    calling = threading.Thread(target=lambda: _swallow(client, "slow"), daemon=True)
    calling.start()
    wait_until(lambda: (client.status("slow").get("live") or {}).get("inFlight") == 1)
    client.cancel()  # the connection is shut down: the gateway sees its client leave

    def cancelled_span() -> bool:
        return any(
            span["service"] == "fnkernel-gateway"
            and span["kind"] == "SERVER"
            and span["status"] == "CANCELLED: the client went away"
            for span in list(received.spans)
        )

    wait_until(cancelled_span, timeout=20)
    calling.join(10)


def test_a_create_the_gateway_refuses_is_exported_with_its_status_and_why(
    exporting: tuple[Collector, Client, Stack],
) -> None:
    """docs/architecture.md, "One call pipeline per hop": a traced request's span ends as its
    answer is finished, a failure included, with the status code and the failure's code and
    message."""
    received, client, _ = exporting
    with pytest.raises(GatewayError):
        client.create_run("bad", runtime="python", handler="handler.handle", files={}, env={"K": 1})  # type: ignore[dict-item]

    def refused() -> dict | None:
        return next(
            (span for span in list(received.spans) if span["name"] == "POST /v1/runs"), None
        )

    wait_until(refused, timeout=20)
    span = refused()
    assert span is not None
    assert span["attributes"]["http.response.status_code"] == 400
    assert span["attributes"]["http.request.method"] == "POST"
    assert span["status"] == "INVALID_ARGUMENT: env: must be an object of string values"


def test_no_span_holds_a_secrets_value(exporting: tuple[Collector, Client, Stack]) -> None:
    """docs/protocol.md, "Secrets": spans name a Run's secrets at most, never a value — those of
    its registration and of a call whose handler read the value."""
    received, client, stack = exporting
    value = "s3cr3t-Value-8842"
    SecretFiles(stack.state_dir / "secrets").set("warehouse", {"DB_PASSWORD": value})
    handler = {
        "handler.py": "import os\ndef handle(event):\n    return len(os.environ['DB_PASSWORD'])\n"
    }
    run = client.create_run(
        "keyed", runtime="python", handler="handler.handle", files=handler, secrets=["warehouse"]
    )
    assert run.phase == "Ready", run.message
    caller = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    assert client.invoke("keyed", {}, traceparent=caller).value() == len(value)
    wait_until(lambda: any(s["name"] == "handler.handle" for s in list(received.spans)), timeout=20)
    wait_until(
        lambda: any(s["name"] == "load handler.handle" for s in list(received.spans)), timeout=20
    )
    assert value not in json.dumps(list(received.spans))


def _swallow(client: Client, name: str) -> None:
    with contextlib.suppress(GatewayError):
        client.invoke(name, {})


def _trace_under(spans: list[dict], one: dict) -> dict[str, list[dict]]:
    """The spans of `one`'s trace, by parent span ID ("" for the root), each parent's children
    in start order."""
    children: dict[str, list[dict]] = {}
    for span in sorted(spans, key=lambda span: span["start"]):
        if span["traceId"] == one["traceId"]:
            children.setdefault(span["parentSpanId"], []).append(span)
    return children


def _names(spans: list[dict]) -> list[tuple[str, str, str]]:
    return [(span["service"], span["kind"], span["name"]) for span in spans]


def _registration_below(children: dict[str, list[dict]], register: dict, attempt: int) -> None:
    """runtimed's span of one registration: its steps, its RegisterFunction call, the Runtime
    Server's span of that call and the worker's load under it."""
    steps = children[register["spanId"]]
    assert _names(steps)[-2:] == [
        ("fnkernel-runtimed", "CLIENT", "executor.v1.FunctionRuntime/RegisterFunction"),
        ("fnkernel-runtimed", "INTERNAL", "write the Run's status: Ready"),
    ]
    assert ("fnkernel-runtimed", "INTERNAL", "write the Run's files") in _names(steps)
    call = steps[-2]
    assert call["attributes"]["rpc.grpc.status_code"] == 0
    (served,) = children[call["spanId"]]
    assert (served["service"], served["kind"]) == ("fnkernel-runtime-server", "SERVER")
    assert served["attributes"]["rpc.method"] == "RegisterFunction"
    assert served["attributes"]["fnkernel.registration_attempt"] == attempt
    assert served["attributes"]["fnkernel.registration_state"] == "READY"
    registration_id = register["attributes"]["fnkernel.registration_id"]
    assert served["attributes"]["fnkernel.registration_id"] == registration_id
    (load,) = children[served["spanId"]]
    assert _names([load]) == [("fnkernel-worker", "SERVER", "load handler.handle")]
    assert all(span["status"] == "" for span in (register, call, served, load))


def test_a_registration_is_traced_step_by_step_from_its_create_and_its_retry(
    exporting: tuple[Collector, Client, Stack],
) -> None:
    """docs/protocol.md, "Tracing": a create's registration is one trace — the gateway's
    POST /v1/runs and its steps, then runtimed's registration of attempt 1 with a span per step,
    the Runtime Server's RegisterFunction and the worker's load of the handler — and a retry's
    registration (attempt 2, after the Runtime Server was killed) is the trace of the control
    plane's retry."""
    received, client, stack = exporting
    handler = {"handler.py": "def handle(event):\n    return event\n"}
    client.create_run("echo", runtime="python", handler="handler.handle", files=handler)

    def registered(attempt: int, spans: int) -> tuple[dict, dict[str, list[dict]]]:
        """runtimed's span of attempt `attempt` and its trace (_trace_under), once the trace's
        `spans` spans are exported (each process exports in batches of its own)."""

        def found() -> dict | None:
            name = f"register echo attempt {attempt}"
            return next((span for span in list(received.spans) if span["name"] == name), None)

        def whole() -> bool:
            span = found()
            exported = list(received.spans)
            return (
                span is not None and sum(s["traceId"] == span["traceId"] for s in exported) >= spans
            )

        wait_until(whole, timeout=30)
        register = found()
        assert register is not None
        return register, _trace_under(list(received.spans), register)

    # the gateway's 3, runtimed's 4, the server's, the worker's
    register, children = registered(1, spans=9)
    (root,) = children[""]
    assert _names([root]) == [("fnkernel-gateway", "SERVER", "POST /v1/runs")]
    assert root["attributes"]["http.response.status_code"] == 201
    assert root["attributes"]["fnkernel.run_phase"] == "Ready"
    # runtimed's registration starts once the Run is stored, beside the gateway's wait for it
    assert sorted(_names(children[root["spanId"]])) == [
        ("fnkernel-gateway", "INTERNAL", "create the Run"),
        ("fnkernel-gateway", "INTERNAL", "wait for its registration"),
        ("fnkernel-runtimed", "INTERNAL", "register echo attempt 1"),
    ]
    _registration_below(children, register, attempt=1)

    server = stack.component("python-0-server").child
    assert server is not None
    os.kill(server.pid, signal.SIGKILL)  # the Run is registered again: attempt 2
    # the control plane's, runtimed's 4, the server's, the worker's
    register, children = registered(2, spans=7)
    (retry,) = children[""]
    assert _names([retry]) == [("fnkernel-controller", "INTERNAL", "retry echo attempt 2")]
    assert retry["attributes"]["fnkernel.registration_attempt"] == 2
    assert children[retry["spanId"]] == [register]
    _registration_below(children, register, attempt=2)


KPTFILE = """\
apiVersion: kpt.dev/v1
kind: Kptfile
metadata:
  name: app
pipeline:
  mutators:
    - image: set-namespace:v0.4.1
      configMap: {namespace: prod}
    - image: example.com/fn/missing
"""
CONFIG_MAP = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: cm\ndata: {a: b}\n"


def test_a_render_exports_a_span_per_pipeline_step_in_the_callers_trace(
    collector: tuple[Collector, str], tmp_path: Path
) -> None:
    """docs/protocol.md, "Tracing": with an OTLP endpoint, `fnkernel render` exports a span of
    the render, in the trace of the TRACEPARENT in its environment, and under it one span per
    pipeline step, naming the evaluator that served it — a step no evaluator has fails there."""
    received, endpoint = collector
    (tmp_path / "Kptfile").write_text(KPTFILE)
    (tmp_path / "cm.yaml").write_text(CONFIG_MAP)
    caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    env = {**os.environ, "FNKERNEL_OTLP_ENDPOINT": endpoint, "TRACEPARENT": caller}
    done = subprocess.run(
        [sys.executable, "-m", "fnkernel.runtime_server.cli", "render", str(tmp_path)],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 1 and "example.com/fn/missing not found" in done.stderr
    spans = list(received.spans)  # exported as the process exits
    (render,) = [span for span in spans if span["name"] == "fn render"]
    assert (render["service"], render["traceId"]) == ("fnkernel-krm", caller.split("-")[1])
    assert render["parentSpanId"] == caller.split("-")[2]
    assert "not found" in render["status"]
    first, second = _trace_under(spans, render)[render["spanId"]]
    assert first["name"] == "ghcr.io/kptdev/krm-functions-catalog/set-namespace:v0.4.1"
    assert first["attributes"]["fnkernel.krm_evaluator"] == "builtin"
    assert first["attributes"]["fnkernel.krm_stage"] == "mutator"
    assert first["attributes"]["fnkernel.krm_inputs"] == 2  # the ConfigMap and the Kptfile
    assert first["status"] == ""
    assert second["name"] == "example.com/fn/missing"
    assert second["attributes"]["fnkernel.krm_skipped"] == ["builtin"]
    assert "not found" in second["status"]
