"""docs/protocol.md, "Replicas": one function served by N Runs of the same spec, each with its
own uid, attempt and fence; a call goes to a free replica (least in flight, round robin among
equals), 429 only when every one is busy; ``Client.map`` and ``fnkernel invoke --map`` call it
once per item. Against a real stack (gateway, runtimeds, Runtime Servers, workers)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import (
    FunctionExists,
    GatewayError,
    HandlerFailed,
    InvalidRequest,
    RequestCancelled,
)
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.support import GATE_WAIT, SLOW_PY, Gate, http_call, wait_until

StackFactory = Callable[..., Stack]
FAILS_ON_3 = {
    "handler.py": "import time\n"
    "def handle(event, context):\n"
    "    time.sleep(event.get('sleep', 0))\n"
    "    if event['n'] == 3:\n"
    "        raise ValueError('three')\n"
    "    return event['n'] * 10\n"
}
# Returns its item's n, once the gate its item names (if any) is open, or after `busy`
# seconds of work.
GATED = {
    "handler.py": GATE_WAIT + "import time\n"
    "def handle(event):\n"
    "    if event.get('gate'):\n"
    "        wait_for_gate(event['gate'])\n"
    "    end = time.monotonic() + event.get('busy', 0)\n"
    "    while time.monotonic() < end:\n"
    "        pass\n"
    "    return event['n']\n"
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    started = Stack(tmp_path_factory.mktemp("replicas") / "state", {"python": 2},
                    gateway_listen="127.0.0.1:0", poll_interval=0.2)  # fmt: skip
    started.start()
    yield started  # type: ignore[misc]
    started.stop()


def test_a_function_of_three_replicas_is_three_runs_spread_over_the_pods(stack: Stack) -> None:
    client = Client(stack.gateway_address)
    created = client.create_run("spread", runtime="python", handler="handler.handle",
                                files=SLOW_PY, replicas=3)  # fmt: skip
    assert created["spec"]["replicas"] == 3
    replicas = created["replicas"]
    assert [r["name"] for r in replicas] == ["spread", "spread.1", "spread.2"]
    assert len({r["uid"] for r in replicas}) == 3
    assert all(r["phase"] == "Ready" and r["attempt"] == 1 for r in replicas)
    pods = sorted(r["assignedPod"] for r in replicas)
    assert pods in (["python-0", "python-0", "python-1"], ["python-0", "python-1", "python-1"])
    listed = {run.name: run for run in client.list_runs()}
    assert listed["spread.2"]["spec"]["replicaOf"] == "spread"
    # Calls one after another go round the replicas.
    served = [client.invoke("spread", {}).run for _ in range(3)]
    assert sorted(served) == ["spread", "spread.1", "spread.2"]
    # A replica is not deleted on its own: the set would serve on, one short, its spec saying
    # three (docs/protocol.md, "Replicas": the function's name deletes them all).
    with pytest.raises(InvalidRequest, match=r"^name: spread\.1 is a replica of spread: "):
        client.delete_run("spread.1")
    assert len(client.status("spread")["replicas"]) == 3
    client.delete_run("spread")
    assert not [run for run in client.list_runs() if run.name.startswith("spread")]


@pytest.mark.slow  # it waits seconds on purpose (tests/conftest.py)
def test_a_call_goes_to_a_free_replica_and_is_429_only_when_all_are_busy(stack: Stack) -> None:
    client = Client(stack.gateway_address)
    client.create_run("busy", runtime="python", handler="handler.handle", files=SLOW_PY,
                      replicas=2)  # fmt: skip
    answers: list[object] = []

    def call() -> None:
        try:
            answers.append(client.invoke("busy", {"sleep": 2}).run)
        except GatewayError as exc:
            answers.append(exc)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    wait_until(lambda: sum(r["inFlight"] for r in client.status("busy")["replicas"]) == 2,
               timeout=10)  # fmt: skip
    status, headers, body = http_call(stack.gateway_address, "POST", "/v1/runs/busy:invoke", b"{}")
    assert status == 429 and headers["Retry-After"] == "1"
    assert 'every replica of "busy" is busy' in json.loads(body)["message"]
    for thread in threads:
        thread.join(30)
    assert sorted(answers) == ["busy", "busy.1"]  # type: ignore[type-var]
    # Busy with calls this gateway did not make (a map's batches go to runtimed directly):
    # each replica refuses it in turn, and the answer names the function, not its last replica.
    mapped = threading.Thread(target=lambda: client.map("busy", [{"sleep": 2}] * 2))
    mapped.start()
    wait_until(lambda: sum(r["inFlight"] for r in client.status("busy")["replicas"]) == 2,
               timeout=10)  # fmt: skip
    status, headers, body = http_call(stack.gateway_address, "POST", "/v1/runs/busy:invoke", b"{}")
    assert status == 429 and headers["Retry-After"] == "1"
    assert json.loads(body)["message"].startswith('every replica of "busy" is busy'), body
    mapped.join(30)
    client.delete_run("busy")


def test_one_replica_is_a_run_as_it_always_was(stack: Stack) -> None:
    client = Client(stack.gateway_address)
    created = client.create_run("single", runtime="python", handler="handler.handle",
                                files=SLOW_PY)  # fmt: skip
    assert "replicas" not in created and "replicas" not in created["spec"]
    assert client.invoke("single", {}).run == ""  # no X-Fn-Run
    client.delete_run("single")


def test_creates_are_checked_and_repeatable(stack: Stack) -> None:
    client = Client(stack.gateway_address)
    for replicas in (0, 65):
        with pytest.raises(InvalidRequest, match="replicas: must be 1 to 64"):
            client.create_run("bad", runtime="python", handler="handler.handle", files=SLOW_PY,
                              replicas=replicas)  # fmt: skip
    first = client.create_run("again", runtime="python", handler="handler.handle", files=SLOW_PY,
                              replicas=2)  # fmt: skip
    repeat = client.create_run("again", runtime="python", handler="handler.handle", files=SLOW_PY,
                               replicas=2)  # fmt: skip
    assert [r["uid"] for r in repeat["replicas"]] == [r["uid"] for r in first["replicas"]]
    with pytest.raises(FunctionExists):  # another replica count is another spec
        client.create_run("again", runtime="python", handler="handler.handle", files=SLOW_PY,
                          replicas=3)  # fmt: skip
    client.delete_run("again")


def test_map_returns_results_in_input_order_with_progress(stack: Stack) -> None:
    client = Client(stack.gateway_address)
    client.create_run("m", runtime="python", handler="handler.handle", files=FAILS_ON_3,
                      replicas=2)  # fmt: skip
    seen: list[tuple[int, int]] = []
    items = [{"n": n, "sleep": 0.05 * (n % 3)} for n in (0, 1, 2, 4, 5, 6, 7)]
    assert client.map("m", items, progress=lambda d, t: seen.append((d, t))) == [
        0, 10, 20, 40, 50, 60, 70]  # fmt: skip
    assert seen[-1] == (7, 7) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    # return_exceptions: each failure in its item's place, as asyncio.gather returns them.
    mixed = client.map("m", [{"n": 2}, {"n": 3}, {"n": 4}], return_exceptions=True)
    assert mixed[0] == 20 and mixed[2] == 40
    assert isinstance(mixed[1], HandlerFailed) and "three" in str(mixed[1])
    # The first failure is raised, and items not yet sent are never sent.
    calls_before = len(seen)
    with pytest.raises(HandlerFailed, match="three"):
        client.map("m", [{"n": 3}] + [{"n": 1, "sleep": 0.2}] * 20, concurrency=1,
                   progress=lambda d, t: seen.append((d, t)))  # fmt: skip
    assert len(seen) - calls_before == 1  # the failure, and nothing after it
    assert client.map("m", []) == []
    # A timeout that is not a count of milliseconds is refused before anything is called, as
    # the gateway refuses its header (400, naming it), not left to a map's threads.
    for refused in (lambda: client.map("m", [{"n": 1}], timeout_millis=-5),
                    lambda: client.invoke("m", {"n": 1}, timeout_millis=-5)):  # fmt: skip
        with pytest.raises(InvalidRequest, match="timeout_millis: must be a count"):
            refused()
    # So is an invocation ID the gateway would refuse ("Limits"), by its name, not the header's.
    with pytest.raises(
        InvalidRequest, match=r"^invocation_id: must be printable ASCII, got 'a\\x01b'"
    ):
        client.invoke("m", {"n": 1}, invocation_id="a\x01b")
    client.delete_run("m")


def test_map_hands_each_result_on_in_order_while_it_runs(
    stack: Stack, gate: Callable[[], Gate]
) -> None:
    # docs/protocol.md, "Replicas": `on_result(index, result)` gets each item's result in input
    # order as soon as it and every item before it are done, while the map runs; an exception
    # it raises stops the map as an interrupt does, the items not yet sent never sent.
    client = Client(stack.gateway_address)
    client.create_run("mo", runtime="python", handler="handler.handle", files=GATED)
    first, rest = gate(), gate()  # `rest` stays shut
    handed: list[tuple[int, object]] = []

    def on_result(index: int, result: object) -> None:
        handed.append((index, result))
        if index == 1:
            first.open()  # item 2 waits for this: it runs only once item 1 came out

    # Twelve items on one replica: batches of three ("Batches"), so item 1's answer comes
    # from the batch that goes on to run item 2, which waits for it; item 1 answers a moment
    # after item 0's answer was sent, within the time the server gathers answers in.
    items = [{"n": 0}, {"n": 1, "busy": 0.02}, {"n": 2, "gate": str(first)},
             *({"n": n} for n in range(3, 12))]  # fmt: skip
    # Bounded: were results handed on only at the end, item 2 would fail as timed out.
    assert client.map("mo", items, on_result=on_result, timeout_millis=30_000) == list(range(12))
    assert handed == [(n, n) for n in range(12)]

    class Enough(Exception):
        pass

    def stop_at_first(index: int, result: object) -> None:
        raise Enough

    many = [{"n": 0}, {"n": 1, "gate": str(rest)}] + [{"n": n} for n in range(2, 40)]
    with pytest.raises(Enough):
        client.map("mo", many, on_result=stop_at_first, timeout_millis=30_000)
    # Item 1 was cancelled, its gate still shut: the one replica is soon free for another call.
    wait_until(lambda: client.status("mo")["live"]["inFlight"] == 0, timeout=20)
    assert client.invoke("mo", {"n": 7}).decoded() == 7
    client.delete_run("mo")


def test_cancel_from_another_thread_stops_a_map(stack: Stack, gate: Callable[[], Gate]) -> None:
    # README, "Client library": cancel() aborts every request in flight — a map's too: its
    # calls in flight are cancelled, the items not yet sent never sent, and the map raises.
    client = Client(stack.gateway_address)
    client.create_run("mc", runtime="python", handler="handler.handle", files=GATED)
    shut = gate()  # never opened: item 1 runs until it is cancelled
    items = [{"n": 0}, {"n": 1, "gate": str(shut)}, *({"n": n} for n in range(2, 30))]
    cancelled: list[int] = []

    def on_result(index: int, result: object) -> None:
        if index == 0:  # item 1 is running (or about to): cancel from another thread
            threading.Thread(target=lambda: cancelled.append(client.cancel())).start()

    with pytest.raises(RequestCancelled, match="the map of mc was cancelled"):
        client.map("mc", items, on_result=on_result, timeout_millis=30_000)
    assert cancelled and cancelled[0] >= 1
    wait_until(lambda: client.status("mc")["live"]["inFlight"] == 0, timeout=20)
    assert client.invoke("mc", {"n": 7}).decoded() == 7  # the function serves on
    client.delete_run("mc")


def test_invoke_map_from_the_cli_prints_a_line_per_item_in_order(
    stack: Stack, tmp_path: Path
) -> None:
    client = Client(stack.gateway_address)
    source = tmp_path / "handler.py"
    source.write_text(FAILS_ON_3["handler.py"])
    cli = [sys.executable, "-m", "fnkernel.runtime_server.cli"]
    created = subprocess.run(
        [*cli, "runs", "create", "cm", "--runtime", "python", "--source", str(source),
         "--handler", "handler.handle", "--replicas", "2", "--gateway", stack.gateway_address],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    lines = tmp_path / "items.jsonl"
    lines.write_text("".join(json.dumps({"n": n}) + "\n" for n in (1, 3, 2)))
    mapped = subprocess.run(
        [*cli, "invoke", "cm", "--map", str(lines), "--gateway", stack.gateway_address],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert mapped.returncode == 1  # one call failed
    out = [json.loads(line) for line in mapped.stdout.splitlines()]
    assert out[0] == 10 and out[2] == 20 and out[1]["error"]["code"] == "UNKNOWN"
    assert "3/3 done" in mapped.stderr and "1 of 3 calls failed" in mapped.stderr
    assert mapped.stdout.splitlines()[1].startswith('{"error":{"code":"UNKNOWN"')  # compact
    # A file that is not text lines of JSON is a usage error naming the file and the line.
    binary = tmp_path / "items.bin"
    binary.write_bytes(b'{"n": 1}\n\xff\xfe\x00\n')
    refused = subprocess.run(
        [*cli, "invoke", "cm", "--map", str(binary), "--gateway", stack.gateway_address],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert f"--map {binary}: line 2 is not JSON" in refused.stderr
    assert "Traceback" not in refused.stderr
    # A blank line between items would put every later result on another line than its item.
    gap = tmp_path / "gap.jsonl"
    gap.write_text('{"n": 1}\n\n{"n": 2}\n\n')
    refused = subprocess.run(
        [*cli, "invoke", "cm", "--map", str(gap), "--gateway", stack.gateway_address],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and f"--map {gap}: line 2 is empty" in refused.stderr
    assert client.status("cm")["spec"]["replicas"] == 2
    client.delete_run("cm")


def test_invoke_map_from_the_cli_writes_each_line_as_it_comes_and_stops_with_its_reader(
    stack: Stack, tmp_path: Path, gate: Callable[[], Gate]
) -> None:
    # docs/protocol.md, "Replicas": the CLI's map writes each item's line as soon as the lines
    # before it are written; a reader that stops reading (`| head -1`) stops the map: exit
    # 141, quietly, the call in flight cancelled and the items after it never sent.
    client = Client(stack.gateway_address)
    client.create_run("cs", runtime="python", handler="handler.handle", files=GATED)
    after_close, never = gate(), gate()
    lines = tmp_path / "items.jsonl"
    items = [{"n": 0}, {"n": 1, "gate": str(after_close)}, {"n": 2, "gate": str(never)}]
    lines.write_text("".join(json.dumps(item) + "\n" for item in [*items, *[{"n": 3}] * 20]))
    command = [sys.executable, "-m", "fnkernel.runtime_server.cli", "invoke", "cs", "--map",
               str(lines), "--timeout-ms", "60000", "--gateway", stack.gateway_address]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as mapped:
        assert mapped.stdout is not None and mapped.stderr is not None
        assert mapped.stdout.readline() == b"0\n"  # before item 1 has run
        mapped.stdout.close()  # as `| head -1` does
        after_close.open()  # item 1's line now finds no reader
        errors = mapped.stderr.read().decode()
        assert mapped.wait(timeout=60) == 141, errors
    assert "Broken pipe" not in errors and "Traceback" not in errors
    # Item 2 was cancelled with its gate still shut: the one replica soon serves another call.
    wait_until(lambda: client.status("cs")["live"]["inFlight"] == 0, timeout=20)
    assert client.invoke("cs", {"n": 9}).decoded() == 9
    client.delete_run("cs")
