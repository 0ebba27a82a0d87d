"""The pod evaluator and its pod cache manager (docs/protocol.md, "Evaluators") with the local backend: every
pod is a real `fnkernel wrapper-server` process, counted in /proc."""

from __future__ import annotations

import os
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fnkernel.runtime_server.errors import EvaluatorSystemError, NotFoundError
from fnkernel.runtime_server.krm.evaluators.base import EvalRequest
from fnkernel.runtime_server.krm.evaluators.pods import (
    LocalBackend,
    PodCacheManager,
    PodEvaluator,
    PodPolicy,
    load_catalog,
    load_warmup,
)
from fnkernel.runtime_server.krm.resources.resourcelist import ResourceList
from tests.kernel.kernels import descendants
from tests.support import pid_alive, wait_until

INPUT = b"apiVersion: config.kubernetes.io/v1\nkind: ResourceList\nitems: []\n"
# Answers with one ConfigMap named after its wrapper server's pid: which pod served the call.
WHO = """#!/bin/sh
cat >/dev/null
sleep "${DELAY:-0}"
printf 'apiVersion: config.kubernetes.io/v1\\nkind: ResourceList\\nitems:\\n- {apiVersion: v1, kind: ConfigMap, metadata: {name: "%s"}}\\n' "$PPID"
"""
IMAGE = "example.com/fn/who"


@pytest.fixture
def who(tmp_path: Path) -> Path:
    path = tmp_path / "who"
    path.write_text(WHO)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def managers() -> Iterator[Callable[..., PodCacheManager]]:
    started: list[PodCacheManager] = []

    def start(backend: LocalBackend, **kwargs: object) -> PodCacheManager:
        manager = PodCacheManager(backend, **kwargs)  # type: ignore[arg-type]
        started.append(manager)
        return manager

    yield start
    for manager in started:
        manager.stop()


def wrapper_pids() -> set[int]:
    pids = set()
    for pid in descendants(os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"wrapper-server" in cmdline and pid_alive(pid):
            pids.add(pid)
    return pids


def served_by(evaluator: PodEvaluator, image: str = IMAGE) -> int:
    response = evaluator.evaluate(EvalRequest(INPUT, image), time.monotonic() + 30)
    return int(ResourceList.parse(response.resource_list).items[0]["metadata"]["name"])


def in_parallel(calls: int, fn: Callable[[], int]) -> list[int]:
    results: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        try:
            value = fn()
        except BaseException as exc:
            with lock:
                errors.append(exc)
            return
        with lock:
            results.append(value)

    threads = [threading.Thread(target=run) for _ in range(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


def test_a_burst_for_a_cold_image_starts_exactly_one_pod(
    who: Path, managers: Callable[..., PodCacheManager]
) -> None:
    # docs/protocol.md waitlist: "Single pod creation serves all waiters".
    before = wrapper_pids()
    # Counted by command line: without the waiting process, which would look like a pod.
    evaluator = PodEvaluator(managers(LocalBackend({IMAGE: [str(who)]}, prewarm=False)))
    served = in_parallel(20, lambda: served_by(evaluator))
    assert len(served) == 20
    started = wrapper_pids() - before
    assert len(started) == 1, started
    assert set(served) == started


def test_load_spreads_over_max_parallel_pods(
    who: Path, managers: Callable[..., PodCacheManager]
) -> None:
    backend = LocalBackend({IMAGE: ["env", "DELAY=0.5", str(who)]})
    policy = PodPolicy(max_parallel_pods=2, preferred_max_queue_length=1)
    evaluator = PodEvaluator(managers(backend, default_policy=policy))
    served = in_parallel(6, lambda: served_by(evaluator))
    assert len(set(served)) == 2, served  # both pods took calls, and no third was started
    assert all(served.count(pid) >= 2 for pid in set(served)), served


def test_an_idle_pod_past_its_ttl_is_reaped(
    who: Path, managers: Callable[..., PodCacheManager]
) -> None:
    manager = managers(
        LocalBackend({IMAGE: [str(who)]}), default_policy=PodPolicy(ttl=1), gc_interval=0.2
    )
    pid = served_by(PodEvaluator(manager))
    assert pid_alive(pid)
    wait_until(lambda: not manager.snapshot().get(IMAGE), timeout=10)
    wait_until(lambda: not pid_alive(pid), timeout=10)


def test_a_killed_pod_is_evicted_and_the_call_succeeds_on_a_fresh_one(
    who: Path, managers: Callable[..., PodCacheManager]
) -> None:
    manager = managers(LocalBackend({IMAGE: [str(who)]}))
    evaluator = PodEvaluator(manager)
    first = served_by(evaluator)
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: not pid_alive(first))
    second = served_by(evaluator)
    assert second != first
    assert len(manager.snapshot()[IMAGE]) == 1  # the dead pod was evicted


@pytest.mark.slow  # it waits seconds on purpose (tests/conftest.py)
def test_an_unhealthy_idle_pod_is_evicted(
    who: Path, managers: Callable[..., PodCacheManager]
) -> None:
    # docs/protocol.md, "Evaluators": a pod whose health check fails is evicted at once (here: it stops answering).
    manager = managers(LocalBackend({IMAGE: [str(who)]}), gc_interval=0.2)
    evaluator = PodEvaluator(manager)
    frozen = served_by(evaluator)
    os.kill(frozen, signal.SIGSTOP)
    try:
        wait_until(lambda: not manager.snapshot().get(IMAGE), timeout=15)
    finally:
        if pid_alive(frozen):
            os.kill(frozen, signal.SIGCONT)
    assert served_by(evaluator) != frozen


class _HangingHealthChecks(LocalBackend):
    """Test double: the local backend, whose health checks hang until released — as a check
    of a pod that stopped answering takes its whole timeout."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.release = threading.Event()
        self.checking = threading.Event()

    def healthy(self, pod: Any) -> bool:
        self.checking.set()
        self.release.wait(60)
        return super().healthy(pod)


def test_a_health_check_does_not_hold_up_an_acquire(
    who: Path, managers: Callable[..., PodCacheManager]
) -> None:
    # docs/architecture.md, "Pod eviction": the GC pass's health checks run off the owner
    # thread; a call arriving meanwhile is served.
    backend = _HangingHealthChecks({IMAGE: [str(who)]})
    manager = managers(backend, gc_interval=0.2)
    evaluator = PodEvaluator(manager)
    first = served_by(evaluator)
    try:
        assert backend.checking.wait(10), "the GC pass never checked the idle pod"
        deadline = time.monotonic() + 30
        pod = manager.acquire(IMAGE, deadline)  # DeadlineExceeded if the owner thread hangs
        manager.release(IMAGE, pod)
        assert served_by(evaluator) == first
    finally:
        backend.release.set()


def test_a_pod_that_dies_mid_call_is_replaced_and_the_call_retried(
    tmp_path: Path, who: Path, managers: Callable[..., PodCacheManager]
) -> None:
    # The first pod's function kills its own wrapper server (UNAVAILABLE): evicted, retried once.
    marker = tmp_path / "killed-once"
    killer = tmp_path / "killer"
    killer.write_text(
        f'#!/bin/sh\nif [ ! -e {marker} ]; then touch {marker}; kill -9 "$PPID"; sleep 5; fi\n'
        f"exec {who}\n"
    )
    killer.chmod(0o755)
    evaluator = PodEvaluator(managers(LocalBackend({IMAGE: [str(killer)]})))
    pid = served_by(evaluator)
    assert marker.exists() and pid_alive(pid)


def test_warm_up_starts_pods_before_the_first_request(
    tmp_path: Path, who: Path, managers: Callable[..., PodCacheManager]
) -> None:
    config = tmp_path / "warmup.yaml"
    config.write_text(
        f"- image: {IMAGE}\n  timeToLive: 30m\n  maxParallelPods: 2\n  preferredMaxQueueLength: 4\n"
    )
    policies = load_warmup(config)
    assert policies[IMAGE] == PodPolicy(ttl=1800, max_parallel_pods=2, preferred_max_queue_length=4)
    before = wrapper_pids()
    manager = managers(LocalBackend({IMAGE: [str(who)]}, prewarm=False), policies=policies)
    manager.warm_up(list(policies))
    wait_until(lambda: manager.snapshot().get(IMAGE), timeout=10)
    [warm] = wrapper_pids() - before
    assert served_by(PodEvaluator(manager)) == warm  # the first request uses the warm pod


def test_an_image_without_a_pod_entrypoint_is_not_found(
    tmp_path: Path, managers: Callable[..., PodCacheManager]
) -> None:
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(f"{IMAGE}: [/bin/cat]\n")
    evaluator = PodEvaluator(managers(LocalBackend(load_catalog(catalog))))
    with pytest.raises(NotFoundError):
        evaluator.evaluate(EvalRequest(INPUT, "example.com/fn/other"))


def test_fnkernel_evaluator_serves_builtin_exec_and_pod(tmp_path: Path, who: Path) -> None:
    # docs/protocol.md, "Evaluators": the chain builtin → exec → pod behind one FunctionEvaluator; each response says
    # which evaluator served it, and warm-up pods start with the server.
    from fnkernel.runtime_server.daemon import spawn
    from fnkernel.runtime_server.krm.evaluators.server import RemoteEvaluator

    functions = tmp_path / "functions"
    functions.mkdir()
    (functions / "identity").write_text("#!/bin/sh\ncat\n")
    (functions / "identity").chmod(0o755)
    store = tmp_path / "functions.yaml"
    store.write_text("- {image: example.com/fn/identity, path: identity}\n")
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(f"{IMAGE}: [{who}]\n")
    warmup = tmp_path / "warmup.yaml"
    warmup.write_text(f"- image: {IMAGE}\n  timeToLive: 60s\n")
    before = wrapper_pids()
    child = spawn(
        [
            "evaluator",
            "--listen",
            "127.0.0.1:0",
            "--functions",
            str(functions),
            "--function-config",
            str(store),
            "--image-catalog",
            str(catalog),
            "--pod-cache-config",
            str(warmup),
        ]
    )
    remote = RemoteEvaluator(child.address)
    try:
        assert "chain builtin → exec → pod" in child.announced
        wait_until(lambda: wrapper_pids() - before, timeout=10)  # warm before any request
        labelled = INPUT + b"functionConfig: {apiVersion: v1, kind: ConfigMap, data: {a: b}}\n"
        served = {
            image: remote.evaluate(EvalRequest(labelled, image)).evaluator
            for image in ("set-labels", "example.com/fn/identity", IMAGE)
        }
        assert served == {
            "set-labels": "builtin",
            "example.com/fn/identity": "exec",
            IMAGE: "pod",
        }
    finally:
        remote.close()
        assert child.stop(15) == 0
    wait_until(lambda: not (wrapper_pids() - before), timeout=10)  # pods stop with the server


class FailingBackend(LocalBackend):
    """A backend whose pods never come up (an image that cannot start), counting the attempts.
    Each start fails once `fail` is set (at once, if it is set already)."""

    def __init__(self) -> None:
        super().__init__({IMAGE: ["/bin/cat"]})
        self.starts = 0
        self.fail = threading.Event()

    def start(self, image: str) -> Any:
        self.starts += 1
        self.fail.wait(30)
        raise EvaluatorSystemError(f"pod for {image} did not start: image pull failed")


def test_a_pod_that_fails_to_start_fails_every_waiter_once(
    managers: Callable[..., PodCacheManager],
) -> None:
    # docs/protocol.md waitlist: "Pod creation errors sent to all waiters"; the next request retries.
    backend = FailingBackend()
    manager = managers(backend)
    evaluator = PodEvaluator(manager)
    failures: list[BaseException] = []

    def call() -> None:
        try:
            evaluator.evaluate(EvalRequest(INPUT, IMAGE), time.monotonic() + 10)
        except EvaluatorSystemError as exc:
            failures.append(exc)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for thread in threads:
        thread.start()
    wait_until(lambda: manager.waiting(IMAGE) == 8, timeout=10)  # the whole burst waits
    backend.fail.set()
    for thread in threads:
        thread.join(30)
    assert len(failures) == 8 and backend.starts == 1
    assert all("image pull failed" in str(f) for f in failures)
    call()
    assert backend.starts == 2  # the waitlist was cleared: a new request tries again


def test_a_cold_pod_is_the_waiting_process_and_another_waits_after_it(
    who: Path, managers: Callable[..., PodCacheManager]
) -> None:
    # docs/architecture.md, "The first registration": the local backend keeps one prewarmed
    # wrapper-server process waiting; a cold pod takes it, and a new one waits for the next.
    backend = LocalBackend({IMAGE: [str(who)]})
    waiting = backend.waiting()
    assert waiting is not None
    evaluator = PodEvaluator(managers(backend))
    assert served_by(evaluator) == waiting
    after = backend.waiting()
    assert after is not None and after != waiting and pid_alive(after)
    backend.close()
    wait_until(lambda: not pid_alive(after), timeout=10)
