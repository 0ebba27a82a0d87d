"""docs/architecture.md, "Retries": a pause is not a death. A component stopped for up to 5 s (a GC
pause, a busy CPU, a VM's stolen time; here SIGSTOP, then SIGCONT) costs no attempt and kills no
call, idle or with a call in flight: the Run stays Ready on the same registration, and the call
in flight answers, late."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import pytest

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.lifecycle.runs import POD_GRACE_SECONDS
from fnkernel.runtime_server.lifecycle.sqlite import SqliteRunStore
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.support import SLOW_PY, http_call, wait_until

pytestmark = pytest.mark.slow  # each pause lasts 5 s on purpose (tests/conftest.py)

PAUSE_SECONDS = 5.0  # the longest pause the design promises to ride out
COMPONENTS = ["gateway", "python-0-runtimed", "python-0-server"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack, polled five times a second (more polls fall into each pause than by default)."""
    stack = Stack(
        tmp_path_factory.mktemp("pauses") / "state",
        {"python": 1},
        gateway_listen="127.0.0.1:0",
        poll_interval=0.2,
    )
    stack.start()
    Client(stack.gateway_address).create_run(
        "slow", runtime="python", handler="handler.handle", files=SLOW_PY
    )
    yield stack
    stack.stop()


class Watch:
    """Reads the Run from the store every 20 ms, from before a pause until `stop`: every phase and
    attempt it had meanwhile, so that a Retrying that was put right again is still seen."""

    def __init__(self, store_path: Path, name: str) -> None:
        self.seen: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._store = SqliteRunStore(store_path)
        self._name = name
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        deadline = time.monotonic() + 60  # bounded, whatever happens to the test
        while not self._stop.wait(0.02) and time.monotonic() < deadline:
            run = self._store.get(self._name)
            self.seen.add((run.status.phase, run.status.attempt))

    def stop(self) -> set[tuple[str, int]]:
        self._stop.set()
        self._thread.join(5)
        self._store.close()
        return self.seen


def paused(pid: int, seconds: float) -> threading.Timer:
    """SIGSTOP `pid` now and SIGCONT it `seconds` later; the timer, to wait on with ``join``."""
    os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
    resume.start()
    return resume


def invoke(stack: Stack, sleep: float) -> tuple[int, dict[str, str], bytes]:
    status, headers, body = http_call(
        stack.gateway_address, "POST", "/v1/runs/slow:invoke", json.dumps({"sleep": sleep}).encode()
    )
    return status, dict(headers), body


def heartbeat_after(stack: Stack, moment: float) -> Callable[[], bool]:
    """True once the pod's runtimed has written a heartbeat after `moment` (time.time())."""

    def written() -> bool:
        store = SqliteRunStore(stack.state_dir / "runs.db")
        try:
            pod = store.pod("python-0")
            return pod is not None and pod.expires - POD_GRACE_SECONDS > moment
        finally:
            store.close()

    return written


def registration_id(stack: Stack) -> str:
    return str(Client(stack.gateway_address).status("slow")["live"]["registrationId"])


@pytest.mark.parametrize("component", COMPONENTS)
def test_a_5_s_pause_of_an_idle_component_costs_no_attempt(stack: Stack, component: str) -> None:
    before = registration_id(stack)
    child = stack.component(component).child
    assert child is not None
    watch = Watch(stack.state_dir / "runs.db", "slow")
    paused(child.pid, PAUSE_SECONDS).join()
    resumed = time.time()
    # Everything has looked again since: a heartbeat and a poll after the pause, then a call.
    wait_until(heartbeat_after(stack, resumed + 0.5), timeout=10)
    status, headers, _ = invoke(stack, 0)
    seen = watch.stop()
    assert status == 200 and headers["X-Fn-Attempt"] == "1"
    assert seen == {("Ready", 1)}
    assert stack.component(component).child is child, "the supervisor saw no death either"
    assert registration_id(stack) == before


@pytest.mark.parametrize("component", COMPONENTS)
def test_a_5_s_pause_during_a_call_makes_it_late_not_lost(stack: Stack, component: str) -> None:
    before = registration_id(stack)
    child = stack.component(component).child
    assert child is not None
    watch = Watch(stack.state_dir / "runs.db", "slow")
    with futures.ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        call = pool.submit(invoke, stack, 2.0)
        # The call reaches the handler first (its registration is in flight), then the pause.
        wait_until(lambda: Client(stack.gateway_address).status("slow")["live"]["inFlight"], 5)
        resume = paused(child.pid, PAUSE_SECONDS)
        status, headers, body = call.result(timeout=60)
        resume.join()
    seen = watch.stop()
    assert (status, json.loads(body)) == (200, {"slept": 2.0}), body
    assert headers["X-Fn-Attempt"] == "1"
    assert time.monotonic() - started >= PAUSE_SECONDS  # it was late, as it had to be
    assert seen == {("Ready", 1)}
    assert registration_id(stack) == before


def test_a_delete_its_server_does_not_answer_says_so(stack: Stack) -> None:
    # README, "Runs, runtimed and the gateway": DELETE is 204 once unregistered. A server stopped past the delete's wait:
    # the Run is removed all the same (its name free again), and the answer says the server
    # still held it — 202, where it was 204 as if unregistered; once the server answers,
    # runtimed unregisters it, and the pod serves on.
    client = Client(stack.gateway_address)
    client.create_run("doomed", runtime="python", handler="handler.handle", files=SLOW_PY)
    server = stack.component("python-0-server").child
    assert server is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        status, _, body = http_call(
            stack.gateway_address, "DELETE", "/v1/runs/doomed?drainTimeoutMs=1"
        )
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert status == 202, body
    assert json.loads(body)["message"].startswith("removed from the store, but its Runtime Server")
    assert "doomed" not in [run.name for run in client.list_runs()]
    assert client.invoke("slow", {"sleep": 0}).decoded() == {"slept": 0}  # the pod serves on


def test_a_call_its_pod_never_answers_says_so_not_that_the_handler_ran_out_of_time(
    stack: Stack,
) -> None:
    # docs/protocol.md, "Errors": a deadline that passed with no answer from a process on the
    # path is not the handler's timeout: the 504 says the path did not answer and that the call
    # may have run — not "give it more" time, which was never the handler's to use.
    runtimed = stack.component("python-0-runtimed").child
    assert runtimed is not None
    os.kill(runtimed.pid, signal.SIGSTOP)
    try:
        status, _, body = http_call(
            stack.gateway_address, "POST", "/v1/runs/slow:invoke", b'{"sleep": 0}',
            {"Content-Type": "application/json", "X-Timeout-Ms": "200"},
        )  # fmt: skip
    finally:
        os.kill(runtimed.pid, signal.SIGCONT)
    failure = json.loads(body)
    assert status == 504 and failure["code"] == "DEADLINE_EXCEEDED", failure
    assert failure["message"].startswith("no answer within the call's timeout and the hops' slack")
    assert "may have run" in failure["message"] and "hint" not in failure
    wait_until(lambda: invoke(stack, 0)[0] == 200, timeout=30)  # and it serves again
