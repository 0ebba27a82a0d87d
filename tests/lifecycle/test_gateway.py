"""The HTTP gateway (docs/protocol.md, "Runs") and its error mapping (docs/protocol.md, "Errors"), through real processes: every row
is produced by a real request to `fnkernel gateway` → runtimed → Runtime Server."""

from __future__ import annotations

import datetime
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fnkernel.runtime_server import payloads
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import (
    FunctionBusy,
    FunctionExists,
    FunctionNotFound,
    HandlerFailed,
    InvalidRequest,
    PayloadTooLarge,
    RequestCancelled,
)
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.lifecycle.gateway_calls import (
    FAILING_PY,
    create,
    invoke,
)
from tests.support import ECHO_PY, SLOW_PY, http_call, spooled, wait_until

# What a 413 names as setting the bound (docs/protocol.md, "Large payloads").
BOUND_SET_BY = (
    "(the gateway's --max-payload-bytes; a kernel's own runtime: FNKERNEL_MAX_PAYLOAD_BYTES)"
)

BASH_FN = {
    "fn.sh": ('handle() {\n  echo "seen=yes" >> "$FUNCTION_OUTPUTS"\n  printf \'%s\' "$1"\n}\n')
}


def in_background(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    return thread, result


def wait_in_flight(stack: Stack, name: str) -> None:
    client = Client(stack.gateway_address)
    wait_until(lambda: (client.status(name).get("live") or {}).get("inFlight") == 1, timeout=10)


def test_create_returns_201_once_ready_and_invoke_returns_output(shared_stack: Stack) -> None:
    status, _, body = http_call(
        shared_stack.gateway_address,
        "POST",
        "/v1/runs",
        json.dumps(
            {"name": "hello", "runtime": "python", "handler": "handler.handle", "files": SLOW_PY}
        ).encode(),
    )
    assert status == 201
    run = json.loads(body)
    assert run["status"]["phase"] == "Ready" and run["status"]["attempt"] == 1
    status, headers, output = invoke(
        shared_stack, "hello", b'{"sleep": 0}', {"X-Invocation-Id": "trace-42"}
    )
    assert status == 200
    assert json.loads(output) == {"slept": 0}
    assert headers["X-Invocation-Id"] == "trace-42"
    assert json.loads(headers["X-Fn-Outputs"]) == {}


def test_bash_function_outputs_come_back_in_a_header(shared_stack: Stack) -> None:
    name = create(shared_stack, BASH_FN, runtime="bash")
    status, headers, output = invoke(shared_stack, name, b'{"q": "$(touch x)"}')
    assert status == 200
    assert output == b'{"q": "$(touch x)"}'
    assert json.loads(headers["X-Fn-Outputs"]) == {"seen": "yes"}
    assert headers["X-Invocation-Id"].startswith("inv_")


def test_get_shows_the_run_and_its_live_function_status(shared_stack: Stack) -> None:
    name = create(shared_stack, SLOW_PY)
    status, _, body = http_call(shared_stack.gateway_address, "GET", f"/v1/runs/{name}")
    assert status == 200
    run = json.loads(body)
    assert run["live"]["state"] == "READY"
    assert run["live"]["registrationId"].startswith("reg_")
    assert run["live"]["registrationDigest"].startswith("sha256:")
    assert run["live"]["registrationAttempt"] == 1
    listed = json.loads(http_call(shared_stack.gateway_address, "GET", "/v1/runs")[2])
    assert name in [r["name"] for r in listed["runs"]]


@pytest.mark.slow  # it waits seconds on purpose (tests/conftest.py)
def test_second_concurrent_invoke_is_429_with_retry_after(shared_stack: Stack) -> None:
    # docs/protocol.md, "Errors": RESOURCE_EXHAUSTED → 429 + Retry-After: 1.
    name = create(shared_stack, SLOW_PY)
    first, result = in_background(lambda: invoke(shared_stack, name, b'{"sleep": 2}'))
    wait_in_flight(shared_stack, name)
    status, headers, body = invoke(shared_stack, name)
    assert status == 429
    assert headers["Retry-After"] == "1"
    error = json.loads(body)
    assert error["code"] == "RESOURCE_EXHAUSTED"
    assert error["runUid"] and error["invocationId"]
    first.join(10)
    assert result[0][0] == 200  # type: ignore[index]
    # In the gateway's log as information: a map waiting for a free replica asks every few
    # milliseconds, and each answer was a warning.
    logged = [json.loads(line) for line in (shared_stack.log_dir / "gateway.log").read_text()
              .splitlines() if f"429 POST /v1/runs/{name}:invoke" in line]  # fmt: skip
    assert logged and {entry["level"] for entry in logged} == {"info"}


@pytest.mark.slow  # it waits seconds on purpose (tests/conftest.py)
def test_draining_run_is_503_with_retry_after(shared_stack: Stack) -> None:
    # docs/protocol.md, "Errors": FAILED_PRECONDITION (draining) → 503 + Retry-After: 1.
    name = create(shared_stack, SLOW_PY)
    slow, slow_result = in_background(lambda: invoke(shared_stack, name, b'{"sleep": 2}'))
    wait_in_flight(shared_stack, name)
    client = Client(shared_stack.gateway_address)
    deleting, _ = in_background(lambda: client.delete_run(name))
    wait_until(lambda: client.status(name)["status"]["phase"] in ("Deleting", "Deleted"))
    status, headers, body = invoke(shared_stack, name)
    assert status == 503
    assert headers["Retry-After"] == "1"
    assert json.loads(body)["code"] == "FAILED_PRECONDITION"
    slow.join(10)
    deleting.join(10)
    assert slow_result[0][0] == 200  # type: ignore[index]  # the drain let it finish


def test_delete_with_cancel_in_flight_stops_the_invocation_at_once(shared_stack: Stack) -> None:
    # docs/protocol.md: UnregisterFunction with cancel_in_flight cancels the in-flight invocation; the
    # gateway passes it through as DELETE ?cancelInFlight=true (NAME.unregister(cancel=True)).
    name = create(shared_stack, SLOW_PY)
    # A drain would wait for the 600 s call up to 600 s: the delete returns only if it cancels.
    body = b'{"sleep": 600}'
    slow, slow_result = in_background(
        lambda: invoke(shared_stack, name, body, {"X-Timeout-Ms": "600000"})
    )
    wait_in_flight(shared_stack, name)
    Client(shared_stack.gateway_address).delete_run(
        name, cancel_in_flight=True, drain_timeout_millis=600_000
    )
    slow.join(10)
    assert slow_result[0][0] == 503  # type: ignore[index]  # CANCELLED → 503 (docs/protocol.md, "Errors")


def test_delete_rejects_a_bad_drain_timeout(shared_stack: Stack) -> None:
    name = create(shared_stack, SLOW_PY)
    status, _, body = http_call(
        shared_stack.gateway_address, "DELETE", f"/v1/runs/{name}?drainTimeoutMs=soon"
    )
    assert status == 400
    assert "drainTimeoutMs" in json.loads(body)["message"]


def test_client_hanging_up_cancels_the_invocation(shared_stack: Stack) -> None:
    # An interrupted notebook cell closes its connection: the gateway cancels the gRPC call and
    # the handler is killed, so the function is free again at once (not after the 30 s sleep).
    name = create(shared_stack, SLOW_PY)
    client = Client(shared_stack.gateway_address)
    connection = client._connect()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {client.token}"}
    connection.request("POST", f"/v1/runs/{name}:invoke", body=b'{"sleep": 30}', headers=headers)
    wait_in_flight(shared_stack, name)
    connection.close()
    wait_until(lambda: not client.status(name)["live"]["inFlight"], timeout=5)
    assert client.invoke(name, {"sleep": 0}).value() == {"slept": 0}


def test_client_cancel_aborts_the_request_in_flight(shared_stack: Stack) -> None:
    # Client.cancel (the kernel's interrupt) raises RequestCancelled in the caller and, through
    # the closed connection, kills the handler: the next invoke succeeds at once.
    name = create(shared_stack, SLOW_PY)
    client = Client(shared_stack.gateway_address)

    def call() -> object:
        try:
            return client.invoke(name, {"sleep": 30})
        except RequestCancelled as exc:
            return exc

    slow, result = in_background(call)
    wait_in_flight(shared_stack, name)
    assert client.cancel() == 1
    slow.join(2)
    assert isinstance(result[0], RequestCancelled)
    wait_until(lambda: not client.status(name)["live"]["inFlight"], timeout=5)
    assert client.invoke(name, {"sleep": 0}).value() == {"slept": 0}


def test_client_cancel_reaches_a_call_still_converting_its_payload(
    shared_stack: Stack, tmp_path: Path
) -> None:
    # README, "Client library": cancel() from another thread cancels the calls this client makes — one
    # still converting a large payload too, which is then never sent (it ran to its end).
    name = create(shared_stack, {"handler.py": MARKS})
    client = Client(shared_stack.gateway_address)
    converting, go_on = threading.Event(), threading.Event()

    class Held(datetime.datetime):  # its conversion to JSON waits to be let go
        def isoformat(self, *args: Any, **kwargs: Any) -> str:
            converting.set()
            go_on.wait(30)
            return super().isoformat(*args, **kwargs)

    mark = tmp_path / "ran"

    def call() -> object:
        try:
            return client.invoke(name, {"mark": str(mark), "at": Held(2026, 12, 6)})
        except RequestCancelled as exc:
            return exc

    held, result = in_background(call)
    assert converting.wait(30)
    assert client.cancel() == 1
    go_on.set()
    held.join(30)
    assert isinstance(result[0], RequestCancelled), result
    assert "cancelled before it was sent" in str(result[0]) and result[0].unsent  # type: ignore[attr-defined]
    assert client.invoke(name, {"mark": str(tmp_path / "next")}).value() == "marked"
    assert not mark.exists()  # never called


MARKS = "def handle(event):\n    open(event['mark'], 'w').close()\n    return 'marked'\n"


def test_invocation_past_its_timeout_is_504_and_the_next_succeeds(shared_stack: Stack) -> None:
    name = create(shared_stack, SLOW_PY)
    status, _, body = invoke(shared_stack, name, b'{"sleep": 5}', {"X-Timeout-Ms": "300"})
    assert status == 504
    answer = json.loads(body)
    assert answer["code"] == "DEADLINE_EXCEEDED"
    # docs/protocol.md, "Errors": and how to give it more.
    assert (
        answer["hint"]
        == "give it more with the X-Timeout-Ms header, in milliseconds (at most 900000)"
    )
    assert invoke(shared_stack, name, b'{"sleep": 0}')[0] == 200


@pytest.mark.parametrize("traced", [None, False, True], ids=["client", "kernel", "kernel-traced"])
def test_a_call_longer_than_the_clients_read_timeout_waits_for_its_own_timeout(
    shared_stack: Stack, traced: bool | None
) -> None:
    # docs/protocol.md, "Limits": each hop waits as long as the call's own timeout allows, so
    # a `%%function --timeout 600` call is not cut at the client's read timeout (300 s); nor is
    # a delete that drains. The kernel's client (traced or not) as the library's.
    from fnkernel.kernel.connection import TracedClient
    from fnkernel.kernel.trace import Trace

    name = create(shared_stack, SLOW_PY)
    client = Client(shared_stack.gateway_address)
    if traced is not None:
        client = TracedClient(shared_stack.gateway_address, Trace())
        client.trace.on = traced
    client.timeout = 0.5
    assert client.invoke(name, {"sleep": 1}, timeout_millis=10_000).value() == {"slept": 1}
    slow, _ = in_background(lambda: client.invoke(name, {"sleep": 1}, timeout_millis=10_000))
    wait_in_flight(shared_stack, name)
    client.delete_run(name, drain_timeout_millis=10_000)  # waits for the call to end
    slow.join(10)
    with pytest.raises(FunctionNotFound):
        client.status(name)


def test_handler_error_is_502_with_type_message_and_invocation_id(shared_stack: Stack) -> None:
    name = create(shared_stack, FAILING_PY)
    status, _, body = invoke(shared_stack, name, b'{"id": 7}', {"X-Invocation-Id": "inv-7"})
    assert status == 502
    error = json.loads(body)
    assert error["errorType"] == "ValueError"
    assert error["errorMessage"] == "bad order 7"
    assert error["invocationId"] == "inv-7"
    assert error["code"] == "UNKNOWN"
    assert any("about to fail" in line["text"] for line in error["logs"])
    with pytest.raises(HandlerFailed) as caught:
        Client(shared_stack.gateway_address).invoke(name, {"id": 8})
    assert caught.value.error_type == "ValueError" and "bad order 8" in str(caught.value)


def test_unknown_run_is_404(shared_stack: Stack) -> None:
    status, _, body = invoke(shared_stack, "no-such-function")
    assert status == 404
    assert json.loads(body)["code"] == "NOT_FOUND"
    assert http_call(shared_stack.gateway_address, "GET", "/v1/runs/no-such-function")[0] == 404
    assert http_call(shared_stack.gateway_address, "DELETE", "/v1/runs/no-such-function")[0] == 404


# docs/protocol.md, "Errors": every answer of the gateway is the JSON error body, also for what
# tornado answers by itself (an unknown path, a method the path does not take).
@pytest.mark.parametrize(
    ("method", "path", "status", "code", "allow"),
    [
        ("GET", "/no/such/path", 404, "NOT_FOUND", None),
        ("GET", "/v1/runs/a/b", 404, "NOT_FOUND", None),
        ("POST", "/", 404, "NOT_FOUND", None),
        ("PUT", "/v1/runs", 405, "METHOD_NOT_ALLOWED", "GET, POST, OPTIONS"),
        ("DELETE", "/v1/runs", 405, "METHOD_NOT_ALLOWED", "GET, POST, OPTIONS"),
        ("GET", "/v1/runs/x:invoke", 405, "METHOD_NOT_ALLOWED", "POST, OPTIONS"),
        ("PATCH", "/v1/runs/x", 405, "METHOD_NOT_ALLOWED", "GET, DELETE, OPTIONS"),
    ],
)
def test_tornados_own_answers_are_the_documented_json(
    shared_stack: Stack, method: str, path: str, status: int, code: str, allow: str | None
) -> None:
    # With a JSON body, and with none at all: a method the path does not take is 405 either
    # way, not 415 for the body's type.
    for headers, sent in (({"Content-Type": "application/json"}, b"{}"), ({}, None)):
        got, answer_headers, body = http_call(
            shared_stack.gateway_address, method, path, sent, headers
        )
        assert got == status, body
        assert answer_headers["Content-Type"] == "application/json"
        error = json.loads(body)
        assert error["code"] == code and error["message"], error
        assert answer_headers.get("Allow") == allow
        if status == 405:
            assert method in error["message"] and path in error["message"]


def test_an_unknown_path_still_wants_the_token(shared_stack: Stack) -> None:
    # README, "Security": the checks come before any lookup, so without the token a caller
    # learns nothing about which paths exist.
    assert shared_stack.token
    for path in ("/no/such/path", "/v1/runs/a/b"):
        status, _, body = http_call(shared_stack.gateway_address, "GET", path, authenticate=False)
        assert status == 401 and json.loads(body)["code"] == "UNAUTHENTICATED"


@pytest.mark.parametrize(
    ("body", "headers", "field"),
    [
        (b"{not json", {}, "input"),
        (b"{}", {"X-Timeout-Ms": "soon"}, "X-Timeout-Ms"),
        (b"{}", {"X-Invocation-Id": "x" * 129}, "invocation_id"),
    ],
)
def test_bad_invoke_request_is_400_naming_the_field(
    shared_stack: Stack, body: bytes, headers: dict[str, str], field: str
) -> None:
    name = create(shared_stack, SLOW_PY)
    status, _, reply = invoke(shared_stack, name, body, headers)
    assert status == 400
    error = json.loads(reply)
    assert error["code"] == "INVALID_ARGUMENT"
    assert field in error["message"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"handler": "../x.handle"}, "handler"),
        ({"name": "no spaces"}, "name"),
        ({"runtime": "cobol"}, "runtime"),
        ({"files": {"../escape.py": "x = 1"}}, "files"),
        ({"env": {"1BAD": "v"}}, "env"),
        # A misspelt field is refused, not left to its default (docs/protocol.md, "HTTP API").
        ({"memoryMB": 4096, "replica": 3}, "memoryMB: is not a field of a Run; its fields: "),
        # A field is named as the request spells it (the API's JSON, not the gRPC message's).
        ({"idleTimeoutSeconds": -1}, "idleTimeoutSeconds: must be 0 to 86400, got -1"),
    ],
)
def test_bad_create_request_is_400_naming_the_field(
    shared_stack: Stack, change: dict[str, object], field: str
) -> None:
    body = {
        "name": "bad-create",
        "runtime": "python",
        "handler": "handler.handle",
        "files": SLOW_PY,
    }
    body.update(change)
    status, _, reply = http_call(
        shared_stack.gateway_address, "POST", "/v1/runs", json.dumps(body).encode()
    )
    assert status == 400, reply
    assert field in json.loads(reply)["message"]


def test_creating_an_existing_name_with_another_spec_is_409(shared_stack: Stack) -> None:
    name = create(shared_stack, SLOW_PY)
    with pytest.raises(FunctionExists) as caught:
        Client(shared_stack.gateway_address).create_run(
            name, runtime="python", handler="handler.handle", files=ECHO_PY
        )
    assert caught.value.status == 409 and caught.value.code == "ALREADY_EXISTS"


def test_a_create_repeated_with_the_same_spec_answers_with_the_existing_run(
    shared_stack: Stack,
) -> None:
    name = create(shared_stack, SLOW_PY)
    uid = Client(shared_stack.gateway_address).status(name)["uid"]
    again = Client(shared_stack.gateway_address).create_run(
        name, runtime="python", handler="handler.handle", files=SLOW_PY
    )
    assert (again["uid"], again["status"]["phase"], again["status"]["attempt"]) == (uid, "Ready", 1)


def test_body_over_the_payload_bound_is_413_without_calling_anything(
    stack_factory: Callable[..., Stack],
) -> None:
    # docs/protocol.md, "Large payloads": past --max-payload-bytes, 413 naming it, for a Run
    # that does not exist: the body was refused before any lookup or call.
    # The client library asks first (Expect: 100-continue), so it reads the answer instead of
    # a connection the gateway closed on a body it did not want.
    stack = stack_factory({"python": 1}, max_payload_bytes=8 << 20)
    # A caller on the same machine, who would hand it over as a file, is refused alike.
    for by_reference in (False, True):
        with pytest.raises(PayloadTooLarge) as refused:
            Client(stack.gateway_address).invoke(
                "no-such-function", data=b"0" * ((8 << 20) + 1), by_reference=by_reference
            )
        assert refused.value.status == 413
        # The gateway's names the request's body; the client's, the function's payload.
        what = "the payload of no-such-function" if by_reference else "request body"
        assert f"{what} is 8388609 bytes; at most 8388608 {BOUND_SET_BY}" in (str(refused.value))
    assert spooled(stack.spool) == []


def test_a_bound_under_a_spooled_payloads_size_holds_for_a_call_made_directly(
    stack_factory: Callable[..., Stack],
) -> None:
    # docs/protocol.md, "Limits": never past --max-payload-bytes, whichever way it travels —
    # a body under the size the spool takes, sent to runtimed directly, as through the gateway.
    stack = stack_factory({"python": 1}, max_payload_bytes=100_000)
    client = Client(stack.gateway_address)
    client.create_run("echo", runtime="python", handler="handler.handle",
                      files={"handler.py": "def handle(event):\n    return len(event)\n"})  # fmt: skip
    fits = client.invoke("echo", data=b"0" * 100_000, content_type=payloads.OCTET)
    assert fits.value() == 100_000
    for by_reference in (True, False):
        with pytest.raises(PayloadTooLarge) as refused:
            client.invoke("echo", data=b"0" * 100_001, content_type=payloads.OCTET,
                          by_reference=by_reference)  # fmt: skip
        assert refused.value.status == 413
        assert f"100001 bytes; at most 100000 {BOUND_SET_BY}" in str(refused.value)


def test_body_of_exactly_6_mib_round_trips(shared_stack: Stack) -> None:
    name = create(shared_stack, {"handler.py": "def handle(event):\n    return event\n"})
    payload = json.dumps("x" * (6 * 1024 * 1024 - 2)).encode()
    assert len(payload) == 6 * 1024 * 1024
    status, _, output = invoke(shared_stack, name, payload)
    assert status == 200 and output == payload


def test_invalid_request_from_the_client_library_is_typed(shared_stack: Stack) -> None:
    # A value HTTP cannot carry is refused before it is sent, naming the header: sent, the
    # gateway's server answered 400 and closed, and the close could beat the answer. An
    # invocation ID the gateway would refuse is named as the caller gave it (README, "Client
    # library").
    with pytest.raises(InvalidRequest) as caught:
        Client(shared_stack.gateway_address).invoke("whatever", data=b"{}", traceparent="\x01")
    assert caught.value.status == 400 and "traceparent holds a control character" in str(
        caught.value
    )
    with pytest.raises(InvalidRequest) as caught:
        Client(shared_stack.gateway_address).invoke("whatever", data=b"{}", invocation_id="\x01")
    assert caught.value.status == 400 and str(caught.value).startswith("invocation_id: ")
    with pytest.raises(InvalidRequest) as caught:  # a value the gateway itself refuses
        Client(shared_stack.gateway_address).invoke("whatever", data=b"{}", invocation_id="x" * 300)
    assert caught.value.status == 400


@pytest.mark.slow  # it waits seconds on purpose (tests/conftest.py)
def test_client_busy_error_names_the_code(shared_stack: Stack) -> None:
    name = create(shared_stack, SLOW_PY)
    first, _ = in_background(lambda: invoke(shared_stack, name, b'{"sleep": 2}'))
    wait_in_flight(shared_stack, name)
    with pytest.raises(FunctionBusy) as caught:
        Client(shared_stack.gateway_address).invoke(name, {})
    assert "RESOURCE_EXHAUSTED" in str(caught.value)
    first.join(10)


def test_a_runs_memory_limit_is_its_spec_and_a_handler_past_it_is_502_naming_it(
    shared_stack: Stack,
) -> None:
    hungry = {"handler.py": "def handle(event):\n    return len(bytearray(event << 20))\n"}
    name = create(shared_stack, hungry, memory_mb=200)
    assert Client(shared_stack.gateway_address).status(name)["spec"]["memoryMb"] == 200
    status, _, body = invoke(shared_stack, name, b"100")
    assert (status, body) == (200, str(100 << 20).encode())
    status, _, body = invoke(shared_stack, name, b"400")
    failure = json.loads(body)
    assert status == 502 and failure["errorType"] == "MemoryLimitExceeded", failure
    assert "its 200 MiB of memory (memoryMb)" in failure["errorMessage"]
    status, _, _ = invoke(shared_stack, name, b"1")  # the Run stays Ready, on a fresh worker
    assert status == 200
    assert Client(shared_stack.gateway_address).status(name)["status"]["phase"] == "Ready"


@pytest.mark.parametrize("memory", [32, 10**6, "1024", True])
def test_a_memory_limit_out_of_range_is_400_naming_memory_mb(
    shared_stack: Stack, memory: object
) -> None:
    body = {"name": "mem", "runtime": "python", "handler": "handler.handle",
            "files": SLOW_PY, "memoryMb": memory}  # fmt: skip
    status, _, reply = http_call(
        shared_stack.gateway_address, "POST", "/v1/runs", json.dumps(body).encode()
    )
    assert status == 400, reply
    assert json.loads(reply)["message"].startswith("memoryMb: ")


def test_a_call_meant_for_a_replaced_run_is_404_and_not_made(shared_stack: Stack) -> None:
    # docs/protocol.md, "Ownership": X-Fn-Run-Uid names the Run a call is meant for; another
    # Run of the name (the first deleted, this one made since) is not called: 404 naming both.
    client = Client(shared_stack.gateway_address)
    first = client.create_run("meant", runtime="python", handler="handler.handle", files=SLOW_PY)
    assert client.invoke("meant", {}, run_uid=first.uid).decoded() == {"slept": 0}
    client.delete_run("meant")
    again = client.create_run("meant", runtime="python", handler="handler.handle", files=SLOW_PY)
    activity = client.status("meant")["live"]["lastActivityUnixNano"]
    for by_reference in (True, False):  # directly on this machine, and through the gateway
        with pytest.raises(FunctionNotFound, match=f"not the Run this call was meant for "
                                                   rf"\({first.uid}\).*\({again.uid}\)"):  # fmt: skip
            client.invoke("meant", {}, run_uid=first.uid, by_reference=by_reference)
    with pytest.raises(FunctionNotFound, match="not the Run this call was meant for"):
        client.map("meant", [{}, {}], run_uid=first.uid)
    status, _, reply = http_call(
        shared_stack.gateway_address, "POST", "/v1/runs/meant:invoke", b"{}",
        {"Content-Type": "application/json", "X-Fn-Run-Uid": first.uid},
    )  # fmt: skip
    assert status == 404 and json.loads(reply)["code"] == "NOT_FOUND"
    assert client.status("meant")["live"]["lastActivityUnixNano"] == activity  # never called
    assert client.invoke("meant", {}, run_uid=again.uid).decoded() == {"slept": 0}
    client.delete_run("meant")


def test_a_failed_runs_invoke_names_it_and_asks_nobody_to_come_back(
    shared_stack: Stack,
) -> None:
    # docs/protocol.md, "Errors": every 503 says when to come back — but a Failed Run's: it is
    # terminal until made again, and a client that honours Retry-After would ask for ever.
    client = Client(shared_stack.gateway_address)
    run = client.create_run("broken-fn", runtime="python", handler="handler.handle",
                            files={"handler.py": "def handle(event:\n"})  # fmt: skip
    assert run.phase == "Failed"
    status, headers, body = http_call(
        shared_stack.gateway_address, "POST", "/v1/runs/broken-fn:invoke", b"{}"
    )
    failure = json.loads(body)
    assert status == 503 and failure["code"] == "FAILED_PRECONDITION"
    assert "Retry-After" not in headers and failure["runUid"] == run.uid
    assert failure["message"].endswith("; the Run stays Failed until it is made again")
    client.delete_run("broken-fn")
