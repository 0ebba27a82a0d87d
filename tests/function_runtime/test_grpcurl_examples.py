"""docs/protocol.md, "Services": the three grpcurl examples, in order, against
`fnkernel serve`, through server reflection only (no .proto files, no generated stubs)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from tests.reflection_client import ReflectionClient
from tests.support import Client, ServeProcess, digest

FR = "executor.v1.FunctionRuntime"

# The request bodies of the grpcurl calls (docs/protocol.md, "Services"), character for character.
SEED_REGISTER = """{
     "runUid": "2b5d...",
     "registrationAttempt": 1,
     "workingDir": "/workspace/runs/2b5d",
     "handler": "handler.handle",
     "idleTimeoutSeconds": 300,
     "registrationDigest": "sha256:..."
   }"""
SEED_INVOKE = """{
     "registration": {
       "runUid": "2b5d...",
       "registrationId": "reg_01J..."
     },
     "invocationId": "01J...",
     "contentType": "application/json",
     "input": "eyJjb21tYW5kIjoic3RhdHVzIn0="
   }"""
HANDLER = """
def handle(event, context):
    if event == {"command": "status"}:
        return {"status": "ok", "invocation": context.invocation_id}
    return {"unknown": event}
"""


@pytest.fixture
def example_server(server_process: Callable[..., ServeProcess]) -> tuple[ReflectionClient, Path]:
    server = server_process("--runtime", "python")
    workdir = server.workspace_root / "runs" / "2b5d"
    workdir.mkdir(parents=True)
    (workdir / "handler.py").write_text(HANDLER)
    return ReflectionClient(grpc.insecure_channel(server.address)), workdir


def fill(body: str, **values: str) -> str:
    """Replace the elided placeholders ("...") with real values, keeping its shape."""
    for placeholder, value in values.items():
        body = body.replace(placeholder, value)
    return body


def test_reflection_lists_the_services_under_v1_and_v1alpha(python_rt: Client) -> None:
    # docs/protocol.md, "Services": every server registers reflection, v1 and v1alpha (here the
    # Runtime Server `fnkernel serve` assembles, in this process).
    for version in ("v1", "v1alpha"):
        services = ReflectionClient(python_rt.channel, version).list_services()
        assert {"executor.v1.Runtime", FR, "grpc.health.v1.Health"} <= set(services)
        assert {
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= set(services)


def test_the_verbatim_example_request_is_answered_with_a_field_named_error(
    example_server: tuple[ReflectionClient, Path],
) -> None:
    # Its "/workspace/..." path and "sha256:..." digest are placeholders; the server names the
    # field.
    client, _ = example_server
    code, details, _ = client.call(f"{FR}/RegisterFunction", SEED_REGISTER)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("working_dir:")


def test_the_example_calls_in_order(example_server: tuple[ReflectionClient, Path]) -> None:
    client, workdir = example_server
    real_digest = digest("canonical registration inputs")

    # 1. runtimed A registers the function: READY with a server-generated opaque registration ID.
    register = fill(
        SEED_REGISTER, **{"/workspace/runs/2b5d": str(workdir), "sha256:...": real_digest}
    )
    code, _, first = client.call(f"{FR}/RegisterFunction", register)
    assert code == grpc.StatusCode.OK and first is not None
    assert first["state"] == "FUNCTION_REGISTRATION_STATE_READY"
    assert first["registration"]["runUid"] == "2b5d..."
    reg_id = first["registration"]["registrationId"]
    assert reg_id.startswith("reg_") and len(reg_id) == 30

    # 2. A gateway request: invocation ID assigned, payload {"command":"status"} as base64 bytes.
    assert base64.b64decode("eyJjb21tYW5kIjoic3RhdHVzIn0=") == b'{"command":"status"}'
    invoke = fill(SEED_INVOKE, **{"reg_01J...": reg_id})
    code, _, result = client.call(f"{FR}/InvokeFunction", invoke)
    assert code == grpc.StatusCode.OK and result is not None
    assert result["invocationId"] == "01J..."
    assert json.loads(base64.b64decode(result["output"])) == {
        "status": "ok",
        "invocation": "01J...",
    }
    # Another call gets another invocation ID but uses the same registration ID.
    code, _, again = client.call(
        f"{FR}/InvokeFunction", invoke.replace('"invocationId": "01J...",', "")
    )
    assert code == grpc.StatusCode.OK and again is not None and again["invocationId"] != "01J..."

    # 3. The retry engine advances to attempt 2: a new registration ID supersedes reg_01J...
    code, _, second = client.call(
        f"{FR}/RegisterFunction",
        register.replace('"registrationAttempt": 1', '"registrationAttempt": 2'),
    )
    assert code == grpc.StatusCode.OK and second is not None
    new_id = second["registration"]["registrationId"]
    assert new_id != reg_id
    code, _, _ = client.call(f"{FR}/InvokeFunction", invoke)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    stale = json.dumps({"registration": {"runUid": "2b5d...", "registrationId": reg_id}})
    code, _, _ = client.call(f"{FR}/UnregisterFunction", stale)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    # ...and it cannot affect the new registration.
    current = json.dumps({"registration": {"runUid": "2b5d...", "registrationId": new_id}})
    code, _, status = client.call(f"{FR}/FunctionStatus", current)
    assert code == grpc.StatusCode.OK and status is not None
    assert status["state"] == "FUNCTION_REGISTRATION_STATE_READY"
    code, _, result = client.call(
        f"{FR}/InvokeFunction", fill(SEED_INVOKE, **{"reg_01J...": new_id})
    )
    assert code == grpc.StatusCode.OK
