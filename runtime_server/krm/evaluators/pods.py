"""The pod evaluator and its pod cache manager (docs/protocol.md, "Evaluators").

The manager is the single owner of the image → pods map: one thread reads a request queue and
answers each caller through its own reply slot, so no lock guards the map. Per image it keeps up
to ``maxParallelPods`` pods, each with a load counter; a call takes the least-loaded pod
(round-robin among ties) and starts another when every pod has ``preferredMaxQueueLength`` calls
and the cap allows. Callers that arrive while a pod starts wait on its waitlist and are all
answered — or all failed — when it is ready: one pod per burst, never two. Use extends a pod's
TTL; a periodic GC stops idle pods past it and has their health checked on a thread of its own
(a check takes up to 2 s a pod, and acquires go on meanwhile); a pod that failed its check and is
still idle is evicted then. A pod found dead at acquire, or that answers a call UNAVAILABLE, is
evicted at once and the call retried once on a fresh pod. Starting and stopping pods is the backend's job (``PodBackend``): the
local backend runs each pod as a ``fnkernel wrapper-server`` child on a loopback port.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fnkernel.runtime_server.daemon import Child, Prewarmed, spawn, wrapper_server_args
from fnkernel.runtime_server.errors import DeadlineExceeded, EvaluatorSystemError, NotFoundError
from fnkernel.runtime_server.krm.evaluators.base import EvalRequest, EvalResponse, split_image
from fnkernel.runtime_server.krm.evaluators.server import RemoteEvaluator
from fnkernel.runtime_server.krm.resources import resourcelist
from fnkernel.system.waiting import attempts

LOG = logging.getLogger("fnkernel.pods")
DEFAULT_TTL = 30 * 60.0
DEFAULT_GC_INTERVAL = 60.0


@dataclass(frozen=True)
class PodPolicy:
    """Per-image cache settings (the warm-up YAML's fields)."""

    ttl: float = DEFAULT_TTL
    max_parallel_pods: int = 1
    preferred_max_queue_length: int = 10


class PodHandle(Protocol):
    @property
    def address(self) -> str: ...

    def alive(self) -> bool: ...


class PodBackend(Protocol):
    """Starts and stops function pods; the local backend and, later, a Kubernetes one."""

    def knows(self, image: str) -> bool: ...

    def start(self, image: str) -> PodHandle: ...

    def healthy(self, pod: PodHandle) -> bool: ...

    def stop(self, pod: PodHandle) -> None: ...

    def close(self) -> None: ...


def load_catalog(path: Path) -> dict[str, list[str]]:
    """The local image catalog: ``{image: [argv...]}``."""
    document: Any = resourcelist.load(path.read_text())
    if not isinstance(document, dict):
        raise ValueError(f"{path}: expected a mapping of image to entrypoint argv")
    catalog = {}
    for image, argv in document.items():
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"{path}: {image}: the entrypoint must be a non-empty list of strings")
        catalog[str(image)] = [str(a) for a in argv]
    return catalog


def load_warmup(path: Path) -> dict[str, PodPolicy]:
    """The warm-up list: ``[{image, timeToLive, maxParallelPods, preferredMaxQueueLength}]``;
    ``timeToLive`` in seconds or with a unit (``90s``, ``30m``, ``1h``)."""
    document: Any = resourcelist.load(path.read_text())
    if not isinstance(document, list):
        raise ValueError(f"{path}: expected a list of {{image, timeToLive, ...}} entries")
    policies = {}
    for entry in document:
        if not isinstance(entry, dict) or not entry.get("image"):
            raise ValueError(f"{path}: every entry needs an image")
        policies[str(entry["image"])] = PodPolicy(
            ttl=_seconds(entry.get("timeToLive", DEFAULT_TTL)),
            max_parallel_pods=int(entry.get("maxParallelPods", 1)),
            preferred_max_queue_length=int(entry.get("preferredMaxQueueLength", 10)),
        )
    return policies


def _seconds(value: Any) -> float:
    text = str(value).strip()
    units = {"s": 1, "m": 60, "h": 3600}
    if text and text[-1] in units:
        return float(text[:-1]) * units[text[-1]]
    return float(text)


@dataclass
class LocalPod:
    image: str
    child: Child

    @property
    def address(self) -> str:
        return self.child.address

    @property
    def pid(self) -> int:
        return self.child.pid

    def alive(self) -> bool:
        return self.child.proc.poll() is None


class LocalBackend:
    """Each pod is a ``fnkernel wrapper-server`` child process on a loopback port.

    One such process always waits, prewarmed (``daemon.Prewarmed``, refilled as it is taken):
    a pod then starts in tens of milliseconds rather than the few hundred its imports take
    (docs/architecture.md, "The first registration")."""

    def __init__(self, catalog: Mapping[str, Sequence[str]], *, prewarm: bool = True) -> None:
        self.catalog = {image: list(argv) for image, argv in catalog.items()}
        self._prewarmed = Prewarmed(["wrapper-server"], refill=True) if prewarm else None

    def entrypoint(self, image: str) -> list[str] | None:
        if image in self.catalog:
            return self.catalog[image]
        name, _ = split_image(image)
        return self.catalog.get(name)

    def knows(self, image: str) -> bool:
        return self.entrypoint(image) is not None

    def start(self, image: str) -> LocalPod:
        argv = self.entrypoint(image)
        if argv is None:
            raise NotFoundError(f"{image} is not in the image catalog")
        try:
            child = spawn(
                wrapper_server_args(argv), die_with_parent=True, prewarmed=self._prewarmed
            )
        except RuntimeError as exc:
            raise EvaluatorSystemError(f"pod for {image} did not start: {exc}") from None
        return LocalPod(image, child)

    def healthy(self, pod: PodHandle) -> bool:
        if not pod.alive():
            return False
        try:
            with grpc.insecure_channel(pod.address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2
                )
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def stop(self, pod: PodHandle) -> None:
        assert isinstance(pod, LocalPod)
        pod.child.stop(5)

    def wait_ready(self, timeout: float) -> bool:
        """Whether the waiting process has imported what it needs (waits up to `timeout`)."""
        return self._prewarmed is not None and self._prewarmed.wait_ready(timeout)

    def waiting(self) -> int | None:
        """The pid of the process the next pod start takes, if one waits."""
        if self._prewarmed is None:
            return None
        return self._prewarmed.pids().get("wrapper-server")

    def close(self) -> None:
        """End the waiting process (the pods are stopped one by one, by ``stop``)."""
        if self._prewarmed is not None:
            self._prewarmed.close()


@dataclass(eq=False)
class _Pod:
    handle: PodHandle
    load: int = 0
    expires: float = 0.0
    serial: int = 0
    client: RemoteEvaluator | None = None


@dataclass(eq=False)
class _Starting:
    serial: int
    waiters: list[queue.Queue[Any]] = field(default_factory=list)


@dataclass
class _Image:
    policy: PodPolicy
    pods: list[_Pod] = field(default_factory=list)
    starting: list[_Starting] = field(default_factory=list)
    turn: int = 0  # round-robin among equally loaded pods


class PodCacheManager:
    """The single owner of the image → pods map (see the module docstring)."""

    def __init__(
        self,
        backend: PodBackend,
        policies: Mapping[str, PodPolicy] | None = None,
        *,
        default_policy: PodPolicy | None = None,
        gc_interval: float = DEFAULT_GC_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.policies = dict(policies or {})
        self.default_policy = default_policy or PodPolicy()
        self.gc_interval = gc_interval
        self.clock = clock
        self._images: dict[str, _Image] = {}
        self._requests: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._serials = itertools.count(1)
        self._checking = False  # a GC pass's health checks are running
        self._thread = threading.Thread(target=self._run, name="pod-cache", daemon=True)
        self._thread.start()

    # The callers' side: post a request, wait on the reply slot.

    def acquire(self, image: str, deadline: float | None = None) -> _Pod:
        slot: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._requests.put(("acquire", (image, slot)))
        timeout = None if deadline is None else max(0.0, deadline - self.clock())
        try:
            answer = slot.get(timeout=timeout)
        except queue.Empty:
            # Too late: if a pod is assigned after all, give the slot back.
            self._requests.put(("abandon", slot))
            raise DeadlineExceeded(f"no pod for {image} before the deadline") from None
        if isinstance(answer, BaseException):
            raise answer
        pod: _Pod = answer
        return pod

    def release(self, image: str, pod: _Pod) -> None:
        self._requests.put(("release", (image, pod)))

    def evict(self, image: str, pod: _Pod) -> None:
        self._requests.put(("evict", (image, pod)))

    def warm_up(self, images: Sequence[str]) -> None:
        """Start one pod per image in the background."""
        for image in images:
            self._requests.put(("warm", image))

    def snapshot(self) -> dict[str, list[tuple[str, int]]]:
        """image → [(pod address, load)] as the manager sees it now."""
        slot: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._requests.put(("snapshot", slot))
        result: dict[str, list[tuple[str, int]]] = slot.get(timeout=10)
        return result

    def waiting(self, image: str) -> int:
        """How many callers wait on the waitlists of `image`'s starting pods, now."""
        slot: queue.Queue[int] = queue.Queue(maxsize=1)
        self._requests.put(("waiting", (image, slot)))
        return slot.get(timeout=10)

    def stop(self) -> None:
        self._requests.put(("stop", None))
        self._thread.join(30)

    # The owner thread

    def _run(self) -> None:
        next_gc = self.clock() + self.gc_interval
        while True:
            try:
                kind, payload = self._requests.get(timeout=max(0.01, next_gc - self.clock()))
            except queue.Empty:
                kind, payload = "gc", None
            if self.clock() >= next_gc:
                self._gc()
                next_gc = self.clock() + self.gc_interval
            if kind == "stop":
                self._stop_all()
                return
            handler = getattr(self, f"_on_{kind}", None)
            if handler is not None:
                handler(payload)

    def _image(self, image: str) -> _Image:
        state = self._images.get(image)
        if state is None:
            policy = self.policies.get(image) or self.policies.get(split_image(image)[0])
            state = self._images[image] = _Image(policy or self.default_policy)
        return state

    def _on_acquire(self, payload: tuple[str, queue.Queue[Any]]) -> None:
        image, slot = payload
        state = self._image(image)
        for pod in [p for p in state.pods if not p.handle.alive()]:
            self._drop(image, state, pod)  # died since it was last used: evict at once
        policy = state.policy
        # A starting pod counts with its waitlist as its load, so one burst fills it first.
        loads: list[tuple[int, _Pod | _Starting]] = [(p.load, p) for p in state.pods]
        loads += [(len(s.waiters), s) for s in state.starting]
        least = min((load for load, _ in loads), default=None)
        room = len(state.pods) + len(state.starting) < policy.max_parallel_pods
        if (least is None or least >= policy.preferred_max_queue_length) and room:
            self._start_pod(image, state).waiters.append(slot)
            return
        if least is None:
            slot.put(EvaluatorSystemError(f"no pod can be started for {image}"))
            return
        ready = [p for load, p in loads if load == least and isinstance(p, _Pod)]
        if ready:
            pod = ready[state.turn % len(ready)]  # round-robin among the least loaded
            state.turn += 1
            self._assign(image, pod, slot)
            return
        starting = next(s for load, s in loads if load == least and isinstance(s, _Starting))
        starting.waiters.append(slot)

    def _assign(self, image: str, pod: _Pod, slot: queue.Queue[Any]) -> None:
        pod.load += 1
        pod.expires = self.clock() + self._image(image).policy.ttl
        slot.put(pod)

    def _start_pod(self, image: str, state: _Image) -> _Starting:
        starting = _Starting(next(self._serials))
        state.starting.append(starting)

        def start() -> None:
            try:
                handle: PodHandle | BaseException = self.backend.start(image)
            except BaseException as exc:  # every waiter must get an answer
                handle = exc
            self._requests.put(("started", (image, starting, handle)))

        threading.Thread(target=start, name=f"start {image}", daemon=True).start()
        return starting

    def _on_started(self, payload: tuple[str, _Starting, Any]) -> None:
        image, starting, handle = payload
        state = self._image(image)
        state.starting.remove(starting)
        if isinstance(handle, BaseException):
            LOG.warning("pod for %s did not start: %s", image, handle)
            error = (
                handle
                if isinstance(handle, NotFoundError | EvaluatorSystemError)
                else EvaluatorSystemError(f"pod for {image} did not start: {handle}")
            )
            for slot in starting.waiters:
                slot.put(error)
            return
        pod = _Pod(handle, serial=starting.serial, client=RemoteEvaluator(handle.address, "pod"))
        pod.expires = self.clock() + state.policy.ttl
        state.pods.append(pod)
        LOG.info("pod %d for %s ready at %s", pod.serial, image, handle.address)
        for slot in starting.waiters:
            self._assign(image, pod, slot)

    def _on_release(self, payload: tuple[str, _Pod]) -> None:
        image, pod = payload
        pod.load = max(0, pod.load - 1)
        pod.expires = self.clock() + self._image(image).policy.ttl

    def _on_abandon(self, slot: queue.Queue[Any]) -> None:
        try:
            answer = slot.get_nowait()
        except queue.Empty:
            for state in self._images.values():
                for starting in state.starting:
                    if slot in starting.waiters:
                        starting.waiters.remove(slot)
            return
        if isinstance(answer, _Pod):
            answer.load = max(0, answer.load - 1)

    def _on_evict(self, payload: tuple[str, _Pod]) -> None:
        image, pod = payload
        state = self._image(image)
        if pod in state.pods:
            self._drop(image, state, pod)

    def _on_warm(self, image: str) -> None:
        state = self._image(image)
        if not state.pods and not state.starting:
            self._start_pod(image, state)

    def _on_snapshot(self, slot: queue.Queue[Any]) -> None:
        slot.put(
            {
                image: [(p.handle.address, p.load) for p in state.pods]
                for image, state in self._images.items()
            }
        )

    def _on_waiting(self, payload: tuple[str, queue.Queue[int]]) -> None:
        image, slot = payload
        state = self._images.get(image)
        slot.put(sum(len(s.waiters) for s in state.starting) if state is not None else 0)

    def _drop(self, image: str, state: _Image, pod: _Pod) -> None:
        state.pods.remove(pod)
        LOG.info("pod %d for %s evicted", pod.serial, image)
        if pod.client is not None:
            pod.client.close()
        threading.Thread(
            target=self.backend.stop, args=(pod.handle,), name="stop pod", daemon=True
        ).start()

    def _gc(self) -> None:
        """Stop idle pods past their TTL; have the other idle pods' health checked off this
        thread (``_on_unhealthy`` hears of each that fails)."""
        now = self.clock()
        idle: list[tuple[str, _Pod]] = []
        for image, state in self._images.items():
            for pod in [p for p in state.pods if p.load == 0]:
                if pod.expires <= now:
                    LOG.info("pod %d for %s idle past its TTL", pod.serial, image)
                    self._drop(image, state, pod)
                else:
                    idle.append((image, pod))
        if idle and not self._checking:
            self._checking = True

            def check() -> None:
                try:
                    for image, pod in idle:
                        if not self.backend.healthy(pod.handle):
                            self._requests.put(("unhealthy", (image, pod)))
                finally:
                    self._requests.put(("checked", None))

            threading.Thread(target=check, name="pod health", daemon=True).start()

    def _on_unhealthy(self, payload: tuple[str, _Pod]) -> None:
        image, pod = payload
        state = self._image(image)
        if pod in state.pods and pod.load == 0:  # a pod in use answers for itself
            LOG.warning("pod %d for %s failed its health check", pod.serial, image)
            self._drop(image, state, pod)

    def _on_checked(self, _: None) -> None:
        self._checking = False

    def _stop_all(self) -> None:
        for state in self._images.values():
            for pod in state.pods:
                if pod.client is not None:
                    pod.client.close()
                self.backend.stop(pod.handle)
            state.pods.clear()
        self.backend.close()


class PodEvaluator:
    name = "pod"

    def __init__(self, manager: PodCacheManager) -> None:
        self.manager = manager

    def evaluate(self, request: EvalRequest, deadline: float | None = None) -> EvalResponse:
        if not self.manager.backend.knows(request.image):
            raise NotFoundError(f"{request.image} has no pod image")
        for attempt in attempts(2):  # the second on a fresh pod
            pod = self.manager.acquire(request.image, deadline)
            assert pod.client is not None
            try:
                response = pod.client.evaluate(request, deadline)
            except EvaluatorSystemError:
                # UNAVAILABLE: the pod died or cannot serve. Evict it; retry once on a fresh pod.
                self.manager.evict(request.image, pod)
                if attempt.last:
                    raise
                continue
            finally:
                self.manager.release(request.image, pod)
            return EvalResponse(response.resource_list, response.log, self.name)
        raise AssertionError("unreachable")
