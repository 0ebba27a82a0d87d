"""A registration over its life, past the rows of docs/protocol.md's "Registration" table: the
caller's deadline, a worker that cannot restart, superseded generations that fail or are
cancelled late, bounded waits; and the Registry's own memory of removed Runs' attempts, its load
failures and its shutdown. Against a real server or a real Registry."""

from __future__ import annotations

import json
import textwrap
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import grpc
import pytest

from fnkernel.adapters.errors import InvocationCancelled
from fnkernel.adapters.python import PythonAdapter
from fnkernel.runtime_server import wire
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server.errors import AttemptSuperseded, ShuttingDown
from fnkernel.runtime_server.function_runtime import registry as registry_module
from fnkernel.runtime_server.function_runtime.registry import Registry
from fnkernel.runtime_server.function_runtime.server import RuntimeServer
from tests.function_runtime.registrations import FAILED, FINISHES_LATE, READY, SLOW
from tests.function_runtime.statuses import code_of
from tests.support import Client, digest, pid_alive, wait_until

REGISTERING = pb.FUNCTION_REGISTRATION_STATE_REGISTERING


def test_the_caller_deadline_is_the_handler_deadline(python_rt: Client) -> None:
    # docs/protocol.md, "Registration": timeout_millis (30 s by default) is bounded by the
    # caller's own deadline, which the handler sees in its context; without one, the default.
    wd = python_rt.workdir(
        {"handler.py": "def handle(event, context):\n    return context.remaining_millis()\n"}
    )
    reg = python_rt.register(working_dir=wd)
    bounded = int(python_rt.invoke(reg.registration, timeout=2).output)
    assert 0 < bounded <= 2100  # gRPC rounds a deadline up when it encodes it
    request = pb.InvokeFunctionRequest(
        registration=reg.registration, input=b"{}", content_type="application/json"
    )
    unbounded = int(python_rt.fn.InvokeFunction(request).output)  # no gRPC deadline at all
    assert 25_000 < unbounded <= 30_000


def test_a_ready_registration_whose_worker_cannot_restart_becomes_failed(
    python_rt: Client,
) -> None:
    # docs/protocol.md, "Registration": a permanent load failure leaves the registration FAILED
    # with its fatal_error — also when it happens to the fresh worker of a READY registration.
    wd = python_rt.workdir(
        {
            "handler.py": (
                "import os\n"
                "if os.path.exists('broken'):\n"
                "    raise ImportError('the handler broke')\n"
                "def handle(event):\n"
                "    open('broken', 'w').close()\n"
                "    os._exit(3)\n"
            )
        }
    )
    reg = python_rt.register(working_dir=wd)
    assert reg.state == READY
    assert code_of(lambda: python_rt.invoke(reg.registration)) == grpc.StatusCode.UNKNOWN
    status = wait_until(
        lambda: (s := python_rt.status(reg.registration)).state == FAILED and s, timeout=10
    )
    assert "the handler broke" in status.fatal_error  # type: ignore[union-attr]
    assert code_of(lambda: python_rt.invoke(reg.registration)) == (
        grpc.StatusCode.FAILED_PRECONDITION
    )


def test_a_superseded_generation_failing_later_leaves_the_newer_one_ready(
    python_rt: Client,
) -> None:
    # docs/protocol.md, "Registration": a stale registration can change nothing — not even by
    # failing. Attempt 1's worker is still loading (slowly, then failing) when attempt 2
    # replaces it; attempt 2 stays READY.
    wd = python_rt.workdir(
        {
            "handler.py": (
                "import os, time\n"
                "if os.environ['GENERATION'] == '1':\n"
                "    open('loading', 'w').close()\n"
                "    time.sleep(1)\n"
                "    raise ImportError('the first generation fails late')\n"
                "def handle(event):\n"
                "    return os.environ['GENERATION']\n"
            )
        }
    )
    first = threading.Thread(
        target=lambda: python_rt.register(
            working_dir=wd, run_uid="late", attempt=1, env={"GENERATION": "1"}, timeout=30
        )
    )
    first.start()
    wait_until(lambda: (wd / "loading").exists(), timeout=10)  # attempt 1 is mid-import
    newer = python_rt.register(
        working_dir=wd, run_uid="late", attempt=2, env={"GENERATION": "2"}, digest_of="v2"
    )
    assert newer.state == READY
    first.join(30)  # attempt 1's load has failed by now
    assert python_rt.status(newer.registration).state == READY
    assert python_rt.invoke(newer.registration).output == b'"2"'


def test_unregister_returns_when_the_drained_call_ends_not_at_the_drain_timeout(
    python_rt: Client,
) -> None:
    # docs/protocol.md, "Registration": the drain waits for the call in flight *at most*
    # drain_timeout_millis; it ends as soon as the call does (0.3 s here, against 60 s).
    reg = python_rt.register(working_dir=python_rt.workdir(SLOW))
    future = python_rt.invoke_future(reg.registration, b'{"sleep": 0.3}')
    wait_until(lambda: python_rt.status(reg.registration).in_flight == 1)
    started = time.monotonic()
    python_rt.unregister(reg.registration, drain_millis=60_000)
    assert time.monotonic() - started < 30
    assert json.loads(future.result(timeout=10).output) == {"slept": 0.3}


def test_a_late_cancel_of_a_stale_generation_spares_the_newer_generations_call(
    workspace: Path,
) -> None:
    # docs/protocol.md, "Registration": a stale registration can change nothing. A client that
    # goes away cancels its call through the registry — here, late: after a higher attempt
    # replaced its registration and a new call with the *same* invocation_id (clients choose
    # them; retries reuse them) is in flight on the newer one. That call must run on.
    registry = Registry(PythonAdapter, workspace)
    wd = workspace / "gen"
    wd.mkdir()
    (wd / "h.py").write_text(
        "import time\ndef handle(event):\n    time.sleep(event)\n    return event\n"
    )
    args = {"working_dir": str(wd), "handler": "h.handle", "env": {}, "idle_timeout_seconds": 60}
    first = registry.register(
        run_uid="gen", registration_attempt=1, registration_digest=digest("1"), **args
    )
    late_cancels: list[Callable[[], object]] = []

    def invoke(registration_id: str, seconds: float, **kw: object) -> object:
        try:
            return registry.invoke(
                run_uid="gen",
                registration_id=registration_id,
                invocation_id="retry-1",
                input=str(seconds).encode(),
                content_type="application/json",
                timeout_millis=30_000,
                **kw,  # type: ignore[arg-type]
            )
        except Exception as exc:
            return exc

    try:
        old_call = threading.Thread(
            target=lambda: invoke(first.registration_id, 30, on_dispatch=late_cancels.append)
        )
        old_call.start()
        wait_until(lambda: late_cancels)
        second = registry.register(
            run_uid="gen", registration_attempt=2, registration_digest=digest("2"), **args
        )
        old_call.join(10)
        results: list[object] = []
        new_call = threading.Thread(
            target=lambda: results.append(invoke(second.registration_id, 1))
        )
        new_call.start()
        wait_until(
            lambda: registry.status(run_uid="gen", registration_id=second.registration_id).in_flight
        )
        late_cancels[0]()  # the first generation's client goes away now
        new_call.join(15)
        assert results and not isinstance(results[0], Exception), results
        assert results[0].result.output == b"1"  # type: ignore[attr-defined]
    finally:
        registry.shutdown()


def test_outputs_over_their_bounds_end_the_call_as_a_handler_error_named_invalid_outputs(
    python_rt: Client,
) -> None:
    # docs/protocol.md, "Limits", outputs row: beyond the bounds, handler error `InvalidOutputs`,
    # with the call's logs; the registration stays READY.
    reg = python_rt.register(
        {
            "handler.py": """
                def handle(event, context):
                    print("setting", event, "outputs")
                    for i in range(event):
                        context.set_output(f"k{i}", "v")
                    return "done"
            """
        }
    )
    with pytest.raises(grpc.RpcError) as err:
        python_rt.invoke(reg.registration, b"33")
    trailers = dict(err.value.trailing_metadata() or ())
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert err.value.details() == "handler error: InvalidOutputs: 33 outputs; at most 32"
    assert trailers[wire.ERROR_TYPE_KEY] == "InvalidOutputs"
    assert json.loads(trailers[wire.LOGS_KEY]) == [
        {"stream": "stdout", "text": "setting 33 outputs"}
    ]
    assert python_rt.invoke(reg.registration, b"32").output == b'"done"'


def test_register_answers_when_its_bounded_wait_ends_and_the_load_goes_on(
    workspace: Path,
) -> None:
    # docs/protocol.md, "Registration": RegisterFunction waits, bounded, for the handler to load;
    # past the bound it answers REGISTERING and FunctionStatus tells the outcome later.
    registry = Registry(PythonAdapter, workspace, register_wait=0.2)
    wd = _workdir(
        workspace,
        "slowload",
        {
            "h.py": "import time\nfrom pathlib import Path\nwhile not Path('go').exists():\n"
            "    time.sleep(0.01)\ndef handle(event):\n    return event\n"
        },
    )
    try:
        view = registry.register(
            run_uid="slowload",
            registration_attempt=1,
            working_dir=str(wd),
            handler="h.handle",
            env={},
            idle_timeout_seconds=0,
            registration_digest=digest("s"),
        )
        assert view.state == REGISTERING
        (wd / "go").touch()
        status = partial(registry.status, run_uid="slowload", registration_id=view.registration_id)
        wait_until(lambda: status().state == READY, timeout=20)
    finally:
        registry.shutdown()


IDENTITY = {"h.py": "def handle(event):\n    return event\n"}


def _workdir(workspace: Path, name: str, files: dict[str, str]) -> Path:
    """A working directory for a Registry driven in this process."""
    wd = workspace / name
    wd.mkdir()
    for file, text in files.items():
        (wd / file).write_text(textwrap.dedent(text))
    return wd


def _invoke(registry: Registry, run_uid: str, registration_id: str, payload: bytes) -> object:
    return registry.invoke(
        run_uid=run_uid,
        registration_id=registration_id,
        invocation_id="",
        input=payload,
        content_type="",
        timeout_millis=0,
    )


def _register(
    registry: Registry, wd: Path, run_uid: str, attempt: int, handler: str = "h.handle"
) -> str:
    return registry.register(
        run_uid=run_uid,
        registration_attempt=attempt,
        working_dir=str(wd),
        handler=handler,
        env={},
        idle_timeout_seconds=0,
        registration_digest=digest(str(attempt)),
    ).registration_id


def test_the_server_remembers_the_attempts_of_its_most_recently_removed_runs(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/protocol.md, "Registration": a lower attempt is refused also after an unregister. The
    # server remembers this for its last 10,000 removed runs (2 here); the oldest is forgotten.
    monkeypatch.setattr(registry_module, "_MAX_TOMBSTONES", 2)
    registry = Registry(PythonAdapter, workspace)
    wd = _workdir(workspace, "tomb", IDENTITY)
    try:
        for run_uid in ("a", "b", "c"):
            registration_id = _register(registry, wd, run_uid, 2)
            registry.unregister(
                run_uid=run_uid,
                registration_id=registration_id,
                cancel_in_flight=False,
                drain_timeout_millis=0,
            )
        for remembered in ("b", "c"):
            with pytest.raises(AttemptSuperseded, match="older than attempt 2"):
                _register(registry, wd, remembered, 1)
        assert _register(registry, wd, "a", 1)  # forgotten: the oldest of the three
    finally:
        registry.shutdown()


class _SpawnFails(PythonAdapter):
    """A worker that cannot be spawned at all, as when the process runs out of file
    descriptors: an error no adapter names."""

    def start(self) -> None:
        raise OSError(24, "Too many open files")


class _LoadBreaks(PythonAdapter):
    """A load that fails in a way nobody planned for: a bug, not the OS."""

    def start(self) -> None:
        raise RuntimeError("unplanned")


@pytest.mark.parametrize(
    ("adapter", "fatal_error"),
    [
        # docs/architecture.md, "Retries": the OS refusing a worker is the platform's failure,
        # which runtimed retries (WorkerStartFailed), not the handler's.
        (
            _SpawnFails,
            "WorkerStartFailed: the worker could not be started: [Errno 24] Too many open files",
        ),
        (_LoadBreaks, "InitializationError: unplanned"),
    ],
)
def test_an_unexpected_error_while_loading_leaves_the_registration_failed(
    workspace: Path, adapter: type[PythonAdapter], fatal_error: str
) -> None:
    # docs/protocol.md, "Registration": the answer is READY or FAILED — never REGISTERING
    # forever, also when the load fails in a way nobody planned for.
    registry = Registry(adapter, workspace)
    wd = _workdir(workspace, "nofds", IDENTITY)
    try:
        registration_id = _register(registry, wd, "nofds", 1)
        view = registry.status(run_uid="nofds", registration_id=registration_id)
        assert view.state == FAILED
        assert view.fatal_error == fatal_error
    finally:
        registry.shutdown()


def test_after_shutdown_nothing_new_is_accepted(workspace: Path) -> None:
    # docs/protocol.md, "Services": a stopping server starts no new worker, whatever reaches it
    # late (gRPC's graceful stop may leave a slow request running past it).
    registry = Registry(PythonAdapter, workspace)
    wd = _workdir(workspace, "late", IDENTITY)
    registration_id = _register(registry, wd, "late", 1)
    registry.shutdown()
    with pytest.raises(ShuttingDown, match="shutting down"):
        _register(registry, wd, "late2", 1)
    with pytest.raises(ShuttingDown, match="shutting down"):
        _invoke(registry, "late", registration_id, b"1")


def test_shutdown_cancels_the_call_in_flight_rather_than_letting_it_finish(
    workspace: Path,
) -> None:
    # docs/protocol.md, "Services": what outlives the drain is cancelled, not waited for.
    registry = Registry(PythonAdapter, workspace)
    wd = _workdir(workspace, "cut", FINISHES_LATE)
    registration_id = _register(registry, wd, "cut", 1, handler="handler.handle")
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            _invoke(registry, "cut", registration_id, b"1.5")
        except BaseException as exc:
            outcome.append(exc)

    calling = threading.Thread(target=call)
    calling.start()
    pid = int(wait_until(lambda: (wd / "pid").exists() and (wd / "pid").read_text()))
    registry.shutdown()
    calling.join(10)
    assert not pid_alive(pid)
    assert not (wd / "finished").exists()
    assert [type(exc) for exc in outcome] == [InvocationCancelled]


def test_stop_cancels_what_outlives_the_drain_and_stops_every_worker(workspace: Path) -> None:
    # docs/protocol.md, "Services": stopping lets calls in flight finish for the drain time, then
    # cancels them and stops the workers — it does not wait for a 60 s call.
    server = RuntimeServer("python", workspace)
    channel = grpc.insecure_channel(server.start(f"unix:{workspace}/stop.sock"))
    client = Client(channel, workspace, "python")
    try:
        wd = client.workdir(SLOW)
        reg = client.register(working_dir=wd)
        future = client.invoke_future(reg.registration, b'{"sleep": 60}')
        pid = int(wait_until(lambda: (wd / "pid").exists() and (wd / "pid").read_text()))
        started = time.monotonic()
        server.stop(drain_seconds=0.2)
        assert time.monotonic() - started < 4  # the cancel settles within 100 ms, not 5 s
        assert not pid_alive(pid)
        with pytest.raises(grpc.RpcError):
            future.result(timeout=5)
    finally:
        channel.close()
