"""docs/protocol.md, "Calling runtimed directly": on the gateway's machine the client calls a
Run on its pod's runtimed, over the Unix socket the gateway names (``GET /v1/runs/NAME:route``),
and answers and fails exactly as through the gateway; a replica set's calls each go to a replica
the client picks as the gateway would ("Replicas"); a traced call and a stack that exports its
spans go through the gateway; a route that no longer leads to the Run is learnt again, the call
made through the gateway."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.direct import Direct
from fnkernel.runtime_server.client.errors import (
    FunctionBusy,
    GatewayError,
    HandlerFailed,
    InvocationTimedOut,
    RequestCancelled,
    UnsupportedMediaType,
)
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.support import wait_until

pytestmark = pytest.mark.timeout(120)
HANDLER = {
    "handler.py": (
        "import os, time\n"
        "def handle(event):\n"
        "    print('got', event, flush=True)\n"
        "    if event.get('fail'):\n"
        "        raise ValueError('no: ' + event['fail'])\n"
        "    time.sleep(event.get('sleep', 0))\n"
        "    deadline = time.monotonic() + 30\n"
        "    while event.get('until') and not os.path.exists(event['until']):\n"
        "        if time.monotonic() > deadline:\n"
        "            raise TimeoutError(event['until'])\n"
        "        time.sleep(0.01)\n"
        "    return {'echo': event}\n"
    )
}


class Recorded(Client):
    """A client that keeps the gateway requests it makes."""

    def __init__(self, address: str, *, direct: bool = True) -> None:
        super().__init__(address)
        self.sent: list[str] = []
        self.direct = direct

    def _direct_allowed(self) -> bool:
        return self.direct

    def request(self, method: str, path: str, *args: Any, **kw: Any) -> Any:
        self.sent.append(f"{method} {path}")
        return super().request(method, path, *args, **kw)


@pytest.fixture
def stack(stack_factory: Callable[..., Stack]) -> Iterator[Stack]:
    stack = stack_factory({"python": 1})
    Client(stack.gateway_address).create_run(
        "echo", runtime="python", handler="handler.handle", files=HANDLER
    )
    yield stack


def test_a_call_on_the_gateways_machine_goes_to_runtimed_without_the_gateway(stack: Stack) -> None:
    client = Recorded(stack.gateway_address)
    first = client.invoke("echo", {"n": 1})
    assert "GET /v1/runs/echo:route" in client.sent
    client.sent.clear()
    result = client.invoke("echo", {"n": 2}, invocation_id="inv-direct-2")
    assert client.sent == []  # not one request to the gateway
    assert result.decoded() == {"echo": {"n": 2}} and result.invocation_id == "inv-direct-2"
    assert result.attempt == first.attempt >= 1
    assert [line["text"] for line in result.logs] == ["got {'n': 2}"]
    status = Client(stack.gateway_address).status("echo")  # the gateway sees what ran
    assert status["live"]["lastActivityUnixNano"] > 0


@pytest.mark.parametrize(
    "event, error",
    [({"fail": "bad row"}, HandlerFailed), ({"sleep": 5}, InvocationTimedOut)],
    ids=["handler error", "timeout"],
)
def test_a_failure_without_the_gateway_is_the_gateways_failure(
    stack: Stack, event: dict[str, Any], error: type[GatewayError]
) -> None:
    failures = []
    for direct in (True, False):
        client = Recorded(stack.gateway_address, direct=direct)
        client.invoke("echo", {})  # the route is learnt
        client.sent.clear()
        with pytest.raises(error) as caught:
            client.invoke("echo", event, timeout_millis=1000)
        assert any(":invoke" in sent for sent in client.sent) is not direct
        failures.append(caught.value)
    direct_failure, gateway_failure = failures
    assert (direct_failure.status, direct_failure.code) == (
        gateway_failure.status,
        gateway_failure.code,
    )
    assert str(direct_failure) == str(gateway_failure)
    assert direct_failure.run_uid == gateway_failure.run_uid
    if isinstance(direct_failure, HandlerFailed):
        assert isinstance(gateway_failure, HandlerFailed)
        assert direct_failure.error_type == gateway_failure.error_type == "ValueError"
        assert [line["text"] for line in direct_failure.logs][:1] == ["got {'fail': 'bad row'}"]


def test_a_content_type_the_gateway_refuses_is_refused_alike_without_it(stack: Stack) -> None:
    # docs/protocol.md, "Calling runtimed directly": each error is the same class, status, code
    # and message either way — also the gateway's own refusal of a body's type (415), which the
    # Runtime Server would have answered otherwise (400 naming content_type).
    failures = []
    for direct in (True, False):
        client = Recorded(stack.gateway_address, direct=direct)
        client.invoke("echo", {})  # the route is learnt
        with pytest.raises(UnsupportedMediaType) as caught:
            client.invoke("echo", data=b"a,b\n", content_type="text/csv")
        failures.append(caught.value)
    direct_failure, gateway_failure = failures
    assert (direct_failure.status, direct_failure.code) == (415, "UNSUPPORTED_MEDIA_TYPE")
    assert (gateway_failure.status, gateway_failure.code) == (415, "UNSUPPORTED_MEDIA_TYPE")
    assert str(direct_failure) == str(gateway_failure)


def test_a_replaced_run_is_found_again_through_the_gateway(stack: Stack) -> None:
    client = Recorded(stack.gateway_address)
    client.invoke("echo", {"n": 1})
    old_uid = client._routes["echo"][0].run_uid
    manager = Client(stack.gateway_address)
    manager.delete_run("echo")
    manager.create_run("echo", runtime="python", handler="handler.handle", files=HANDLER)
    client.sent.clear()
    assert client.invoke("echo", {"n": 2}).decoded() == {"echo": {"n": 2}}
    assert "POST /v1/runs/echo:invoke" in client.sent  # the old route led nowhere: it never ran
    client.sent.clear()
    assert client.invoke("echo", {"n": 3}).decoded() == {"echo": {"n": 3}}
    assert client.sent == ["GET /v1/runs/echo:route"]  # learnt again, and called directly
    assert client._routes["echo"][0].run_uid != old_uid


def test_a_cancelled_direct_call_stops_its_handler_and_says_so_as_through_the_gateway(
    stack: Stack,
) -> None:
    # docs/protocol.md, "Calling runtimed directly": each error is the same class, status, code
    # and message either way — a cancelled call's too.
    said = []
    gateway = Client(stack.gateway_address)
    for direct in (True, False):
        client = Recorded(stack.gateway_address, direct=direct)
        client.invoke("echo", {})
        failure: list[BaseException] = []

        def call(client: Client = client, failure: list[BaseException] = failure) -> None:
            try:
                client.invoke("echo", {"sleep": 60})
            except BaseException as exc:
                failure.append(exc)

        thread = threading.Thread(target=call)
        thread.start()
        wait_until(lambda: (gateway.status("echo")["live"] or {}).get("inFlight") == 1, timeout=30)
        assert client.cancel() == 1
        thread.join(30)
        assert isinstance(failure[0], RequestCancelled)
        said.append(str(failure[0]))
        wait_until(lambda: (gateway.status("echo")["live"] or {}).get("inFlight") == 0, timeout=30)
        assert client.invoke("echo", {"n": 3}).decoded() == {"echo": {"n": 3}}
    assert said == ["the call to echo was cancelled (CANCELLED)"] * 2


def test_a_replica_sets_calls_go_to_its_replicas_in_turn_and_a_traced_call_through_the_gateway(
    stack: Stack,
) -> None:
    # docs/protocol.md, "Replicas": a call goes to the free replica with the fewest calls in
    # flight, round robin among equals; a client on the stack's machine picks it itself, and
    # names it in X-Fn-Run as the gateway does.
    client = Recorded(stack.gateway_address)
    client.create_run("set", runtime="python", handler="handler.handle", files=HANDLER, replicas=2)
    assert client._json("GET", "/v1/runs/set:route")["route"] is None
    client.sent.clear()
    served = [client.invoke("set", {"n": n}).run for n in range(4)]
    assert served == ["set", "set.1", "set", "set.1"]
    assert client.sent.count("GET /v1/runs/set:route") == 1  # asked once
    assert not [sent for sent in client.sent if sent.startswith("POST")]  # none by the gateway
    client.invoke("echo", {})
    client.sent.clear()
    traced = client.invoke("echo", {}, traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    assert client.sent == ["POST /v1/runs/echo:invoke"] and traced.spans


def _held(stack: Stack, name: str, release: Path) -> threading.Thread:
    """Another caller's call of `name` (a client of its own), running until `release` exists."""
    other = Client(stack.gateway_address)
    thread = threading.Thread(
        target=lambda: other.invoke(name, {"until": str(release)}), daemon=True
    )
    thread.start()
    return thread


def test_a_call_passes_a_replica_busy_with_another_callers_call_to_the_next(
    stack: Stack, tmp_path: Path
) -> None:
    client = Recorded(stack.gateway_address)
    client.create_run("set", runtime="python", handler="handler.handle", files=HANDLER, replicas=2)
    client.invoke("set", {})
    release = tmp_path / "release"
    held = _held(stack, "set.1", release)  # replica 1, called by its own name
    gateway = Client(stack.gateway_address)
    wait_until(lambda: (gateway.status("set.1")["live"] or {}).get("inFlight") == 1, timeout=30)
    client.sent.clear()
    assert [client.invoke("set", {"n": n}).run for n in range(3)] == ["set"] * 3
    assert client.sent == []
    release.touch()
    held.join(30)


def test_a_call_goes_first_to_the_replica_with_fewest_of_the_clients_calls_in_flight(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/protocol.md, "Replicas": the free replica with the fewest calls in flight — the
    # client's own, counted: it does not try first the replica its own call holds.
    client = Recorded(stack.gateway_address)
    client.create_run("set", runtime="python", handler="handler.handle", files=HANDLER, replicas=2)
    client.invoke("set", {})  # replica 0; the next call's turn is replica 1
    tried: list[str] = []
    invoke = Direct.invoke

    def recorded(self: Direct, route: Any, *args: Any) -> Any:
        tried.append(route.name)
        return invoke(self, route, *args)

    monkeypatch.setattr(Direct, "invoke", recorded)
    release = tmp_path / "release"
    holder = threading.Thread(
        target=lambda: client.invoke("set", {"until": str(release)}), daemon=True
    )
    holder.start()  # on replica 1, its turn
    wait_until(lambda: tried == ["set.1"], timeout=30)
    assert [client.invoke("set", {"n": n}).run for n in range(3)] == ["set"] * 3
    assert tried == ["set.1", "set", "set", "set"]  # never replica 1 first, though its turn came
    release.touch()
    holder.join(30)


def test_when_every_replica_is_busy_the_gateway_answers_so(stack: Stack, tmp_path: Path) -> None:
    client = Recorded(stack.gateway_address)
    client.create_run("set", runtime="python", handler="handler.handle", files=HANDLER, replicas=2)
    client.invoke("set", {})
    release = tmp_path / "release"
    holders = [_held(stack, "set", release), _held(stack, "set.1", release)]
    gateway = Client(stack.gateway_address)
    for name in ("set", "set.1"):
        wait_until(
            lambda n=name: (gateway.status(n)["live"] or {}).get("inFlight") == 1, timeout=30
        )
    client.sent.clear()
    with pytest.raises(FunctionBusy) as busy:
        client.invoke("set", {})
    assert client.sent == ["POST /v1/runs/set:invoke"]  # each replica refused it: the gateway's 429
    assert 'every replica of "set" is busy' in str(busy.value)
    release.touch()
    for holder in holders:
        holder.join(30)


def test_a_call_a_client_sent_to_a_replica_is_followed_there(stack: Stack, tmp_path: Path) -> None:
    # docs/protocol.md, "Live output": the lines of a call on replica 1, as it prints them.
    client = Recorded(stack.gateway_address)
    client.create_run("set", runtime="python", handler="handler.handle", files=HANDLER, replicas=2)
    client.invoke("set", {})  # on replica 0: the next goes to replica 1
    release = tmp_path / "release"
    lines: list[str] = []
    results: list[Any] = []
    thread = threading.Thread(
        target=lambda: results.append(
            client.invoke("set", {"until": str(release)}, on_log=lambda r: lines.append(r["text"]))
        ),
        daemon=True,
    )
    thread.start()
    wait_until(lambda: lines, timeout=30)  # while it runs: followed on the replica it runs on
    release.touch()
    thread.join(30)
    assert results[0].run == "set.1" and lines == [f"got {{'until': '{release}'}}"]


def test_a_program_that_never_closes_its_client_still_exits(stack: Stack) -> None:
    # A script's client, dropped unclosed at the interpreter's end after a direct call: closing
    # its channels then waited on grpc's threads, which run no more by then — the process
    # never exited.
    script = textwrap.dedent(
        f"""
        from fnkernel.runtime_server.client import Client

        class Counted(Client):
            sent = []

            def request(self, method, path, *args, **kwargs):
                self.sent.append(path)
                return super().request(method, path, *args, **kwargs)

        client = Counted({stack.gateway_address!r})
        assert client.invoke("echo", {{"n": 1}}).value() == {{"echo": {{"n": 1}}}}
        assert not [path for path in client.sent if path.endswith(":invoke")], client.sent
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
