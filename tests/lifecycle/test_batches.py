"""docs/protocol.md, "Batches": on the gateway's machine ``NAME.map`` gives each of its threads a
Run of its own (the Run, or one replica each) and sends that Run its items a batch at a time,
over runtimed's ``Batches/InvokeBatch``: each item called in turn as InvokeFunction calls one,
each answer or failure what the gateway would have answered; after a failure the rest are not
called (unless the map returns exceptions); a batch another caller's call refuses goes item by
item through the gateway."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from fnkernel.runtime_server import tokens
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import batches_pb2, batches_pb2_grpc
from fnkernel.runtime_server.client import Client, maps
from fnkernel.runtime_server.client.direct import Direct
from fnkernel.runtime_server.client.errors import (
    GatewayError,
    HandlerFailed,
    InvocationTimedOut,
    RequestCancelled,
)
from fnkernel.runtime_server.client.maps import MapRun
from fnkernel.runtime_server.lifecycle.runtimed.proxy import BatchesProxyServicer, _Later
from fnkernel.runtime_server.lifecycle.stack import Stack
from fnkernel.runtime_server.wire import LOGS_KEY, POD_KEY
from tests.support import wait_until

pytestmark = pytest.mark.timeout(120)
HANDLER = {
    "handler.py": (
        "import os, signal, time\n"
        "def handle(event):\n"
        "    print('item', event['n'])\n"
        "    if event.get('log'):\n"
        "        with open(event['log'], 'a') as log:\n"
        "            log.write(f\"{event['n']}\\n\")\n"
        "    if event.get('kill'):\n"
        "        os.kill(os.getppid(), signal.SIGKILL)  # its Runtime Server\n"
        "    if event.get('fail'):\n"
        "        raise ValueError('no: ' + str(event['n']))\n"
        "    if event.get('mib'):\n"
        "        return bytes(event['mib'] << 20)\n"
        "    time.sleep(event.get('sleep', 0))\n"
        "    if event.get('until'):  # a file the test makes, up to 15 s\n"
        "        deadline = time.monotonic() + 15\n"
        "        while not os.path.exists(event['until']) and time.monotonic() < deadline:\n"
        "            time.sleep(0.01)\n"
        "        return {'n': event['n'], 'released': os.path.exists(event['until'])}\n"
        "    return {'n': event['n'], 'pid': os.getpid()}\n"
    )
}


@pytest.fixture
def stack(stack_factory: Callable[..., Stack]) -> Iterator[Stack]:
    stack = stack_factory({"python": 1})
    client = Client(stack.gateway_address)
    client.create_run("one", runtime="python", handler="handler.handle", files=HANDLER)
    client.create_run("set", runtime="python", handler="handler.handle", files=HANDLER, replicas=2)
    yield stack


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every gateway request a Client of this process makes (a map makes a client of its own)."""
    sent: list[str] = []
    request = Client.request

    def recorded(self: Client, method: str, path: str, *args: Any, **kw: Any) -> Any:
        sent.append(f"{method} {path}")
        return request(self, method, path, *args, **kw)

    monkeypatch.setattr(Client, "request", recorded)
    return sent


def test_a_map_on_the_stacks_machine_sends_batches_to_each_replica(
    stack: Stack, requests: list[str]
) -> None:
    client = Client(stack.gateway_address)
    # 10 ms each: 0.2 s of work a lane, so that neither thread can take every batch before
    # the other has started.
    items = [{"n": n, "sleep": 0.01} for n in range(40)]
    results = client.map("set", items)
    assert [result["n"] for result in results] == list(range(40))
    assert not [sent for sent in requests if ":invoke" in sent]  # no call went to the gateway
    assert "GET /v1/runs/set:route" in requests
    assert len({result["pid"] for result in results}) == 2  # both replicas, a worker each
    # The route names each replica's; the set itself has none (its calls pick a replica).
    route = client._json("GET", "/v1/runs/set:route")
    assert route["route"] is None
    assert [replica["name"] for replica in route["replicas"]] == ["set", "set.1"]


def test_a_clients_maps_ask_for_their_lanes_once(stack: Stack, requests: list[str]) -> None:
    # docs/protocol.md, "Batches": a client learns a function's lanes from the gateway once,
    # and its maps after keep them.
    client = Client(stack.gateway_address)
    for _ in range(3):
        assert [r["n"] for r in client.map("set", [{"n": n} for n in range(4)])] == [0, 1, 2, 3]
    assert requests.count("GET /v1/runs/set:route") == 1
    assert not [sent for sent in requests if ":invoke" in sent]


def test_a_map_whose_lanes_are_gone_calls_its_items_one_by_one_and_asks_again(
    stack: Stack, requests: list[str]
) -> None:
    # docs/protocol.md, "Batches": a batch refused before it ran (its replica made again
    # since, here) leaves its items to be called one by one — each on the replicas as they are
    # now ("Replicas") — and the next map asks again.
    client = Client(stack.gateway_address)
    items = [{"n": n} for n in range(4)]
    assert [r["n"] for r in client.map("set", items)] == [0, 1, 2, 3]
    other = Client(stack.gateway_address)
    other.delete_run("set")
    other.create_run("set", runtime="python", handler="handler.handle", files=HANDLER, replicas=2)
    asked = requests.count("GET /v1/runs/set:route")
    assert [r["n"] for r in client.map("set", items)] == [0, 1, 2, 3]  # the lanes kept: gone
    assert requests.count("GET /v1/runs/set:route") > asked  # the items' routes, anew
    assert requests.count("POST /v1/runs/set:invoke") == 0  # and called without the gateway
    asked = requests.count("GET /v1/runs/set:route")
    assert [r["n"] for r in client.map("set", items)] == [0, 1, 2, 3]
    assert requests.count("GET /v1/runs/set:route") == asked + 1  # the lanes asked again
    assert requests.count("POST /v1/runs/set:invoke") == 0  # and the map direct again


def test_a_map_calls_without_the_gateway_only_where_its_client_does(
    stack: Stack, requests: list[str]
) -> None:
    # A kernel's client while %fn_trace is on makes every call through the gateway, where the
    # trace shows it; the map's own client follows it.
    class Gatewayed(Client):
        def _direct_allowed(self) -> bool:
            return False

    client = Gatewayed(stack.gateway_address)
    assert [result["n"] for result in client.map("set", [{"n": n} for n in range(6)])] == [
        0, 1, 2, 3, 4, 5]  # fmt: skip
    assert requests.count("POST /v1/runs/set:invoke") == 6
    assert "GET /v1/runs/set:route" not in requests


def test_a_batched_item_shows_its_output_as_it_is_written(
    stack: Stack, tmp_path: Path, requests: list[str]
) -> None:
    # docs/protocol.md, "Live output": the line of the item that runs reaches on_log while it
    # runs — here, it must, for the handler to be released before its 15 s are up.
    release = tmp_path / "release"
    seen: list[tuple[int, str]] = []

    def on_log(index: int, line: dict[str, Any]) -> None:
        seen.append((index, line["text"]))
        if index == 1 and line["text"] == "item 1":
            release.touch()

    items = [{"n": 0}, {"n": 1, "until": str(release)}, {"n": 2}]
    results = Client(stack.gateway_address).map("one", items, on_log=on_log)
    assert [result["n"] for result in results] == [0, 1, 2]
    assert results[1]["released"] is True
    assert seen == [(0, "item 0"), (1, "item 1"), (2, "item 2")]  # each line once, its own item's
    assert not [sent for sent in requests if ":invoke" in sent]  # the items went as a batch


def test_each_items_failure_is_the_one_the_gateway_gives(stack: Stack, tmp_path: Path) -> None:
    client = Client(stack.gateway_address)
    items = [{"n": 0}, {"n": 1, "fail": True}, {"n": 2, "sleep": 5}, {"n": 3}]
    mapped = client.map("one", items, return_exceptions=True, timeout_millis=1000)
    assert mapped[0]["n"] == 0 and mapped[3]["n"] == 3  # the rest went on (return_exceptions)
    through_gateway = Client(stack.gateway_address)
    through_gateway._direct_allowed = lambda: False  # type: ignore[method-assign]
    for index, kind in ((1, HandlerFailed), (2, InvocationTimedOut)):
        failure = mapped[index]
        with pytest.raises(kind) as caught:
            through_gateway.invoke("one", items[index], timeout_millis=1000)
        expected = caught.value
        assert isinstance(failure, kind)
        assert (failure.status, failure.code) == (expected.status, expected.code)
        # Its message names its item, however printed (docs/protocol.md, "Replicas").
        assert str(failure) == f"{expected} (index {index} of 4 items)"
        assert failure.run_uid == expected.run_uid
        assert failure.item == (index, 4)
    handler_failure = mapped[1]
    assert isinstance(handler_failure, HandlerFailed)
    assert handler_failure.error_type == "ValueError"
    assert [line["text"] for line in handler_failure.logs][:1] == ["item 1"]


def test_an_item_that_cannot_be_sent_fails_by_its_own_index_and_the_rest_are_called(
    stack: Stack, tmp_path: Path
) -> None:
    # docs/protocol.md, "Batches": a batch carries the items up to one it cannot (not JSON
    # here); that one is called by itself, and fails as its own call would, before anything
    # is sent (README, "Client library": a TypeError naming the part), naming its item as a
    # map's failure does ("Replicas"). The items around it are called as ever.
    log = tmp_path / "called.txt"
    items: list[Any] = [{"n": n, "log": str(log)} for n in range(8)]
    items[5] = {"n": 5, "log": str(log), "set": {1, 2}}
    mapped = Client(stack.gateway_address).map("one", items, return_exceptions=True)
    unsent = mapped[5]
    assert type(unsent) is TypeError and unsent.item == (5, 8)  # type: ignore[attr-defined]
    assert str(unsent) == (
        'payload["set"]: set (convert it: sorted(x) or list(x)) (index 5 of 8 items)'
    )
    assert [result["n"] for index, result in enumerate(mapped) if index != 5] == [
        0, 1, 2, 3, 4, 6, 7]  # fmt: skip
    assert sorted(log.read_text().split()) == ["0", "1", "2", "3", "4", "6", "7"]
    with pytest.raises(TypeError, match=r"\(index 5 of 8 items\)$"):
        Client(stack.gateway_address).map("one", items)


def test_after_a_failure_the_rest_of_the_batch_is_never_called(
    stack: Stack, tmp_path: Path
) -> None:
    log = tmp_path / "called.txt"
    items = [{"n": n, "log": str(log), "fail": n == 1} for n in range(12)]
    with pytest.raises(HandlerFailed, match="no: 1") as caught:
        Client(stack.gateway_address).map("one", items)
    assert caught.value.item == (1, 12)
    assert str(caught.value).endswith("handler error: ValueError: no: 1 (index 1 of 12 items)")
    assert log.read_text().split() == ["0", "1"]


def test_answers_that_end_together_past_one_messages_bound_each_come_once(
    stack: Stack, tmp_path: Path
) -> None:
    # docs/protocol.md, "Batches": answers that end within 100 ms of the last message go in one
    # message, but never past what one message may carry (16 MiB): results of 5 MiB each.
    log = tmp_path / "called.txt"
    items = [{"n": n, "log": str(log), "mib": 5} for n in range(24)]  # batches of 6
    results = Client(stack.gateway_address).map("one", items)
    assert [len(result) for result in results] == [5 << 20] * 24
    assert log.read_text().split() == [str(n) for n in range(24)]  # each called once, in turn


def test_a_batch_cut_off_after_its_items_ran_calls_none_of_them_again(
    stack: Stack, tmp_path: Path, requests: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/protocol.md, "Batches": answers are held up to 100 ms, and the worker has the next
    # item queued, so when a batch breaks off (item 5 kills its Runtime Server) the items after
    # the last answer may have run: each fails as a call cut off does, none is called again.
    monkeypatch.setattr(maps, "BATCH_SHARE", 1)  # the lane's share in one batch
    log = tmp_path / "called.txt"
    items = [{"n": n, "log": str(log), "kill": n == 5} for n in range(40)]
    results = Client(stack.gateway_address).map("one", items, return_exceptions=True)
    assert not [sent for sent in requests if ":invoke" in sent]  # none called one by one
    called = [int(n) for n in log.read_text().split()]
    assert called in ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6])  # 6 was queued in the worker
    answered = [n for n, result in enumerate(results) if not isinstance(result, Exception)]
    assert answered == list(range(len(answered))) and len(answered) < 6
    assert [result["n"] for result in results[: len(answered)]] == answered
    for index, failure in enumerate(results[len(answered) :], len(answered)):
        assert isinstance(failure, GatewayError), failure
        assert (failure.status, failure.code, failure.item) == (503, "UNAVAILABLE", (index, 40))
        assert failure.message.startswith("the call was cut off: a process on its path went away")
        assert "so it may have run (" in failure.message


def test_a_batch_refused_by_another_callers_call_waits_for_it_item_by_item(
    stack: Stack, tmp_path: Path
) -> None:
    log = tmp_path / "called.txt"
    other = Client(stack.gateway_address)
    held: list[Any] = []
    holding = threading.Thread(
        target=lambda: held.append(other.invoke("one", {"n": -1, "sleep": 1.0, "log": str(log)}))
    )
    holding.start()
    wait_until(lambda: (other.status("one")["live"] or {}).get("inFlight") == 1, timeout=30)
    items = [{"n": n, "log": str(log)} for n in range(5)]
    results = Client(stack.gateway_address).map("one", items)
    holding.join(30)
    assert [result["n"] for result in results] == list(range(5))
    assert held[0].decoded()["n"] == -1  # the other caller's call was never disturbed
    assert log.read_text().split() == ["-1", "0", "1", "2", "3", "4"]  # each item called once


def test_the_first_failure_cancels_what_the_other_lane_runs(stack: Stack) -> None:
    client = Client(stack.gateway_address)
    # Two items, two lanes: a batch of one each. The first sleeps past the test's timeout,
    # unless the second's failure cancels it.
    with pytest.raises(HandlerFailed, match="no: 1"):
        client.map("set", [{"n": 0, "sleep": 600}, {"n": 1, "fail": True}])
    wait_until(
        lambda: all(
            (client.status(name)["live"] or {}).get("inFlight") == 0 for name in ("set", "set.1")
        ),
        timeout=30,
    )
    assert client.invoke("set.1", {"n": 5}).decoded()["n"] == 5


def test_runtimed_fences_a_batch_as_it_fences_an_invoke(stack: Stack) -> None:
    client = Client(stack.gateway_address)
    route = client._json("GET", "/v1/runs/one:route")["route"]
    channel = grpc.insecure_channel(route["runtimed"])
    stub = batches_pb2_grpc.BatchesStub(channel)
    items = [
        batches_pb2.BatchItem(
            invocation_id=f"inv-b{n}", input=body, content_type="application/json"
        )
        for n, body in enumerate([b'{"n": 0}', b'{"n": 1, "fail": true}', b'{"n": 2}'])
    ]
    request = batches_pb2.InvokeBatchRequest(run_uid=route["runUid"], items=items)
    pod = ((POD_KEY, route["pod"]),)

    def answers(**kw: Any) -> list[batches_pb2.BatchAnswer]:
        asked = batches_pb2.InvokeBatchRequest()
        asked.CopyFrom(request)
        for key, value in kw.items():
            setattr(asked, key, value)
        sent = iter([asked])
        return [a for m in stub.InvokeBatch(sent, timeout=30, metadata=pod) for a in m.answers]

    stopped = answers()
    assert [(a.index, a.code) for a in stopped] == [(0, 0), (1, grpc.StatusCode.UNKNOWN.value[0])]
    assert b"item 1" in stopped[1].trailers[LOGS_KEY]
    assert [a.index for a in answers(go_on=True)] == [0, 1, 2]
    with pytest.raises(grpc.RpcError) as elsewhere:
        list(stub.InvokeBatch(iter([request]), timeout=30, metadata=((POD_KEY, "python-9"),)))
    assert elsewhere.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as filled:
        answers(registration_id="reg_x")
    assert filled.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "registration_id" in (filled.value.details() or "")
    channel.close()


class _CutAfterTheLastAnswer:
    """A test double of a map's calls (``maps.Calls``): each batch answers every item, then
    ends as cancelled — the map's cancel came after its last answer."""

    class Answer:
        def __init__(self, value: Any) -> None:
            self.value = value

        def decoded(self) -> Any:
            return self.value

    class Batch:
        def __init__(self, items: Any) -> None:
            self.items = list(items)

        def answers(self) -> Iterator[tuple[int, Any]]:
            for offset, (_, data, _) in enumerate(self.items):
                yield offset, _CutAfterTheLastAnswer.Answer(data)
            raise RequestCancelled("the batch to fn was cancelled", code="CANCELLED")

        def more(self, items: Any, refill_at: int, *, last: bool = False) -> None:
            self.items += items

        def done(self) -> None:
            pass

        def close(self) -> None:
            pass

    def batch(self, lane: Any, items: Any, **kw: Any) -> Batch:
        return self.Batch(items)

    def cancel(self) -> int:
        return 0


def test_a_batch_cancelled_after_its_last_answer_leaves_every_answer_and_no_failure() -> None:
    # docs/protocol.md, "Batches": cancelling a lane's batch cancels the item in flight. After
    # the last answer none is: the map keeps every answer, and its thread ends cleanly (it
    # died of an IndexError, printed under the cell, when the cancel came then).
    run = MapRun(_CutAfterTheLastAnswer(), "fn", [1, 2, 3], False, 0, None)  # type: ignore[arg-type]
    run.lanes(1)
    run.work(lane=SimpleNamespace(name="fn"))  # a lane: the Run it calls
    assert run.failure is None
    assert run.results == [b"1", b"2", b"3"] and run.done == 3
    assert run.over.is_set()


class _Sent:
    """A caller's side of a batch, sent message by message (the Batches stream's requests)."""

    def __init__(self) -> None:
        self._messages: queue.SimpleQueue[batches_pb2.InvokeBatchRequest | None] = (
            queue.SimpleQueue()
        )

    def send(self, **fields: Any) -> None:
        self._messages.put(batches_pb2.InvokeBatchRequest(**fields))

    def close(self) -> None:
        self._messages.put(None)

    def __iter__(self) -> Iterator[batches_pb2.InvokeBatchRequest]:
        while (message := self._messages.get()) is not None:
            yield message


def _items(*numbers: int) -> list[batches_pb2.BatchItem]:
    return [
        batches_pb2.BatchItem(
            invocation_id=f"inv-f{n}",
            input=f'{{"n": {n}}}'.encode(),
            content_type="application/json",
        )
        for n in numbers
    ]


@pytest.fixture
def runtimed(stack: Stack) -> Iterator[tuple[batches_pb2_grpc.BatchesStub, dict[str, str]]]:
    """The Batches stub of the Run "one"'s runtimed, and that Run's route."""
    route = Client(stack.gateway_address)._json("GET", "/v1/runs/one:route")["route"]
    channel = grpc.insecure_channel(route["runtimed"])
    yield batches_pb2_grpc.BatchesStub(channel), route
    channel.close()


def test_a_batchs_later_messages_carry_more_items_numbered_on(
    runtimed: tuple[batches_pb2_grpc.BatchesStub, dict[str, str]],
) -> None:
    # proto/fnkernel/v1alpha1/batches.proto: each later message carries more items, numbered on
    # from those before; the stream ends once the caller closed its side and each was answered.
    stub, route = runtimed
    sent = _Sent()
    sent.send(run_uid=route["runUid"], items=_items(0, 1))
    answers = stub.InvokeBatch(iter(sent), timeout=30, metadata=((POD_KEY, route["pod"]),))
    got: list[batches_pb2.BatchAnswer] = []
    for message in answers:
        got += message.answers
        if len(got) == 2:  # the first two answered: two more, and nothing after them
            sent.send(items=_items(2, 3))
            sent.close()
    assert [answer.index for answer in got] == [0, 1, 2, 3]
    assert [json.loads(answer.output)["n"] for answer in got] == [0, 1, 2, 3]
    assert answers.code() == grpc.StatusCode.OK


def test_a_batch_sent_last_ends_once_its_items_are_answered(
    runtimed: tuple[batches_pb2_grpc.BatchesStub, dict[str, str]],
) -> None:
    # proto/fnkernel/v1alpha1/batches.proto: after a message with `last` nothing is sent, and
    # the batch ends once its items are answered, though the caller never closes its side.
    stub, route = runtimed
    fed, alone = _Sent(), _Sent()  # neither closed until the end
    fed.send(run_uid=route["runUid"], items=_items(0, 1), refill_at=1)
    fed.send(items=_items(2), last=True)
    answers = stub.InvokeBatch(iter(fed), timeout=30, metadata=((POD_KEY, route["pod"]),))
    assert [a.index for m in answers for a in m.answers] == [0, 1, 2]
    assert answers.code() == grpc.StatusCode.OK
    alone.send(run_uid=route["runUid"], items=_items(3), last=True)
    answers = stub.InvokeBatch(iter(alone), timeout=30, metadata=((POD_KEY, route["pod"]),))
    assert [json.loads(a.output)["n"] for m in answers for a in m.answers] == [3]
    fed.close()
    alone.close()


def test_answers_go_at_once_when_refill_at_or_fewer_items_are_left(
    runtimed: tuple[batches_pb2_grpc.BatchesStub, dict[str, str]], tmp_path: Path
) -> None:
    # proto/fnkernel/v1alpha1/batches.proto: answers that end within 100 ms of the last sent go
    # together, but at once when refill_at or fewer items sent are left unanswered, for the
    # caller to send more then (once: the next waits for its time again). Item 0 ends at once,
    # 1 once the test has read 0's answer, 2 50 ms after it, 3 once the test has read three.
    stub, route = runtimed
    begin, release = tmp_path / "begin", tmp_path / "release"
    events = [
        {"n": 0},
        {"n": 1, "until": str(begin)},
        {"n": 2, "sleep": 0.05},
        {"n": 3, "until": str(release)},
    ]
    items = [
        batches_pb2.BatchItem(
            invocation_id=f"inv-r{n}",
            input=json.dumps(event).encode(),
            content_type="application/json",
        )
        for n, event in enumerate(events)
    ]
    sent = _Sent()
    sent.send(run_uid=route["runUid"], items=items, refill_at=2)
    messages = []
    for message in stub.InvokeBatch(iter(sent), timeout=30, metadata=((POD_KEY, route["pod"]),)):
        messages.append([answer.index for answer in message.answers])
        answered = sum(map(len, messages))
        if answered == 1:
            begin.touch()
        elif answered == 3:
            release.touch()
        elif answered == 4:
            sent.close()  # the caller has nothing more: the stream ends
    # Without refill_at, 1 would wait for 2 (both within 100 ms of 0's message): [1, 2].
    assert messages == [[0], [1], [2], [3]]


def test_only_a_batchs_first_message_names_its_run(
    runtimed: tuple[batches_pb2_grpc.BatchesStub, dict[str, str]],
) -> None:
    stub, route = runtimed
    sent = _Sent()
    sent.send(run_uid=route["runUid"], items=_items(0))
    sent.send(run_uid=route["runUid"], items=_items(1))
    sent.close()
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.InvokeBatch(iter(sent), timeout=30, metadata=((POD_KEY, route["pod"]),)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "run_uid" in (refused.value.details() or "")


def test_a_lanes_items_go_as_one_batch_fed_as_its_run_gets_through_them(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/protocol.md, "Batches": a lane keeps its Run busy with one batch, sent more items as
    # it gets through them, not a batch after a batch.
    opened: list[int] = []
    invoke_batch = Direct.invoke_batch

    def counted(self: Direct, *args: Any, **kw: Any) -> Any:
        opened.append(len(args[1]))
        return invoke_batch(self, *args, **kw)

    monkeypatch.setattr(Direct, "invoke_batch", counted)
    log = tmp_path / "called.txt"
    items = [{"n": n, "sleep": 0.005, "log": str(log)} for n in range(80)]
    results = Client(stack.gateway_address).map("set", items)
    assert [result["n"] for result in results] == list(range(80))
    assert sorted(int(n) for n in log.read_text().split()) == list(range(80))  # each once
    assert len(opened) == 2 and sum(opened) < 80  # a batch a lane, sent more as it ran


def test_a_refused_try_upstream_takes_none_of_the_messages_the_next_must_send() -> None:
    # docs/protocol.md, "Batches": runtimed makes a batch refused before its first call again,
    # once, with what the caller sent so far. The refused try's sender reads from its view
    # until that view ends, and must have taken no message from the caller.
    sent = _Sent()
    later = _Later(iter(sent))
    first_try: list[Any] = []
    sender = threading.Thread(target=lambda: first_try.extend(later.view()), daemon=True)
    sender.start()
    sent.send(items=_items(1))
    second = later.view()  # the second try begins: the first's view ends
    sender.join(10)
    assert not sender.is_alive() and first_try == []
    sent.send(items=_items(2))
    sent.close()
    later.settle()  # the second try's first answer
    assert [message.items[0].invocation_id for message in second] == ["inv-f1", "inv-f2"]


class _RefusedOnce:
    """A test double of the Runtime Server's Batches as runtimed calls it: the first batch is
    refused before its first call (FAILED_PRECONDITION, as a registration drained for idling
    refuses it); the next answers each item of each message as the message comes."""

    class Refused(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.FAILED_PRECONDITION

        def details(self) -> str:
            return "drained for idling"

        def trailing_metadata(self) -> tuple[()]:
            return ()

    class Answers:  # a call's answers, as grpc's stream call gives them
        def __init__(self, sent: Iterator[batches_pb2.InvokeBatchRequest]) -> None:
            self._sent = sent

        def cancel(self) -> None:
            pass

        def __iter__(self) -> Iterator[batches_pb2.BatchAnswers]:
            index = 0
            for message in self._sent:
                for item in message.items:
                    answer = batches_pb2.BatchAnswer(index=index, invocation_id=item.invocation_id)
                    yield batches_pb2.BatchAnswers(answers=[answer])
                    index += 1
                if message.last:
                    return

    def __init__(self) -> None:
        self.tries = 0

    def InvokeBatch(self, sent: Iterator[Any], timeout: float | None = None) -> Answers:
        self.tries += 1
        if self.tries == 1:
            raise self.Refused()
        return self.Answers(sent)


def test_a_batch_made_again_sends_on_what_its_caller_sends_after() -> None:
    # docs/protocol.md, "Batches": a batch refused before its first call is made again, once,
    # and the server sent what the caller sent so far — and what it sends on once answered, as
    # a map's lane does, sending more as answers come.
    upstream = _RefusedOnce()
    registration = (SimpleNamespace(uid="uid"), SimpleNamespace(registration_id="reg_1"), False)
    runtimed = SimpleNamespace(
        resolve=lambda *_, **__: registration, served=lambda *_: None, batches_stub=upstream
    )
    context = SimpleNamespace(
        invocation_metadata=lambda: (), time_remaining=lambda: None, add_callback=lambda _: True
    )
    sent = _Sent()
    sent.send(run_uid="uid", items=_items(0))
    got: list[str] = []

    def relayed() -> None:
        relay = BatchesProxyServicer(runtimed)  # type: ignore[arg-type]
        for message in relay.InvokeBatch(iter(sent), context):  # type: ignore[arg-type]
            got.extend(answer.invocation_id for answer in message.answers)
            if len(got) == 1:
                sent.send(items=_items(1), last=True)

    relay = threading.Thread(target=relayed, daemon=True)
    relay.start()
    wait_until(lambda: got == ["inv-f0", "inv-f1"], timeout=10)
    relay.join(10)
    assert upstream.tries == 2 and not relay.is_alive()
    sent.close()


def test_a_clients_maps_share_its_channels_to_runtimed(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/architecture.md, "A map's items on busy cores": a map's own client (cancelling it
    # cancels that map's calls only) sends its batches on its client's channels, opened once.
    opened: list[str] = []
    insecure_channel = grpc.insecure_channel

    def counted(target: str, *args: Any, **kw: Any) -> grpc.Channel:
        opened.append(target)
        return insecure_channel(target, *args, **kw)

    monkeypatch.setattr(grpc, "insecure_channel", counted)
    client = Client(stack.gateway_address)
    for _ in range(3):
        assert [r["n"] for r in client.map("set", [{"n": n} for n in range(4)])] == [0, 1, 2, 3]
    assert len(opened) == 1  # the two replicas' runtimed: one channel, for every map


def test_a_maps_own_client_reads_no_gateway_file(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/architecture.md, "A map's items on busy cores": a map's own client is its client's,
    # at the same address, and takes what that client read in the gateway's file (its token,
    # its spool) rather than reading the runtime dir again for every map.
    client = Client(stack.gateway_address)  # its token found in the gateway file
    looked: list[str] = []
    find_gateway = tokens.find_gateway

    def counted(address: str) -> dict[str, object] | None:
        looked.append(address)
        return find_gateway(address)

    monkeypatch.setattr(tokens, "find_gateway", counted)
    for _ in range(2):
        assert [r["n"] for r in client.map("set", [{"n": n} for n in range(4)])] == [0, 1, 2, 3]
    assert looked == []
