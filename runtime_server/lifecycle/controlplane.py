"""The control plane (docs/protocol.md, "Runs"): Run creation and deletion, the scheduler and the retry engine.

It writes Runs to the store and reads what each pod's runtimed reports back; it never calls a
Runtime Server (registration is runtimed's job, docs/protocol.md) and writes no file: a Run's
files go into the store with it, and the pod's runtimed writes them where its server reads them. In the embedded default it runs inside
the gateway process, on a background thread, with its loop ticking every `tick` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import PurePosixPath

from fnkernel.adapters import runtimes
from fnkernel.runtime_server import limits, tracing
from fnkernel.runtime_server.errors import (
    InvalidField,
    NoRuntimePod,
    RunAlreadyExists,
    RunFilesMissing,
    RunNotFound,
)
from fnkernel.runtime_server.lifecycle.retries import Step, Verdict, decide
from fnkernel.runtime_server.lifecycle.runs import (
    Run,
    RunSpec,
    RunStatus,
    RunStore,
    files_digest,
    replica_name,
    replica_names,
)
from fnkernel.runtime_server.lifecycle.secrets import check_secret_names
from fnkernel.runtime_server.limits import check_handler
from fnkernel.runtime_server.wire import (
    DELETED,
    DELETING,
    FAILED,
    IDLE,
    NEW,
    PENDING,
    READY,
    RETRYING,
)
from fnkernel.system.waiting import Backoff, wait_for

LOG = logging.getLogger("fnkernel.controlplane")
MAX_FILES = 1000
MAX_REPLICAS = 64  # Runs a function may have (docs/protocol.md, "Replicas")
MAX_NAME_BYTES = 255  # one path component (NAME_MAX)
MAX_PATH_BYTES = 1024
CREATE_SECONDS = 60.0  # see ControlPlane.__init__
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,62}")


@dataclass(frozen=True)
class RetryPolicy:
    """docs/protocol.md, "Runs" retry engine: at most `max_attempts` registrations, exponential backoff with a cap."""

    max_attempts: int = 3
    base_backoff: float = 0.2
    max_backoff: float = 5.0

    def backoff(self, attempt: int) -> float:
        return Backoff(self.base_backoff, self.max_backoff).delay(attempt)


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise InvalidField("name", "must match ^[A-Za-z_][A-Za-z0-9_-]{0,62}$")
    return name


def check_files(files: Mapping[str, str]) -> dict[PurePosixPath, str]:
    """Relative paths that stay inside the working dir, text content, bounded in count and size."""
    if not files:
        raise InvalidField("files", "must name at least one file")
    if len(files) > MAX_FILES:
        raise InvalidField("files", f"{len(files)} files; at most {MAX_FILES}")
    checked: dict[PurePosixPath, str] = {}
    total = 0
    for name, text in files.items():
        path = PurePosixPath(name)
        shown = name if len(name) <= 80 else name[:80] + "..."
        if (
            not path.parts
            or str(path) != name  # ".", "./a", "a//b", "a/": one spelling per file
            or "\0" in name
            or path.is_absolute()
            or ".." in path.parts
        ):
            raise InvalidField("files", f"{shown!r} must be a relative path to a file in the run")
        if len(name.encode()) > MAX_PATH_BYTES or any(
            len(part.encode()) > MAX_NAME_BYTES for part in path.parts
        ):
            raise InvalidField(
                "files",
                f"{shown!r} is too long: at most {MAX_NAME_BYTES} bytes a name, "
                f"{MAX_PATH_BYTES} a path",
            )
        if not isinstance(text, str):
            raise InvalidField("files", f"content of {shown!r} must be text")
        total += len(text.encode())
        checked[path] = text
    directories = {parent for path in checked for parent in path.parents}
    for path in checked:
        if path in directories:
            raise InvalidField("files", f"{str(path)!r} is both a file and a directory")
    if total > limits.MAX_PAYLOAD_BYTES:
        raise InvalidField("files", f"{total} bytes in all; at most {limits.MAX_PAYLOAD_BYTES}")
    return checked


def checked_spec(
    name: str, spec: RunSpec, files: Mapping[str, str]
) -> tuple[RunSpec, dict[str, str]]:
    """Every rule a Run's spec and files must meet, as InvalidField naming the field: the one
    check of a create, whether it comes through ``create_run`` or is found in the store
    (``NEW``). The spec with its defaults spelled out and its files' digest, and the files."""
    check_name(name)
    try:
        adapter = runtimes.runtime(spec.runtime).adapter()
    except runtimes.UnknownRuntime as exc:
        raise InvalidField("runtime", str(exc)) from None
    checked = {str(path): text for path, text in check_files(files).items()}
    # The runtime's handler rules by the handler's text: the files are text under relative
    # paths (none is a symlink), and the controller and gateway write nothing to disk, which a
    # read-only container has none of (docs/kubernetes.md, "What each container may write").
    check_handler(adapter, spec.handler, None)
    return replace(
        spec,
        env=limits.check_env(spec.env),
        idle_timeout_seconds=limits.check_idle_timeout(
            spec.idle_timeout_seconds, "idleTimeoutSeconds"
        )
        or limits.DEFAULT_IDLE_TIMEOUT_SECONDS,
        memory_mb=limits.check_memory_mb(spec.memory_mb, "memoryMb"),
        requirements=limits.check_requirements(spec.requirements, spec.runtime),
        secrets=check_secret_names(spec.secrets),
        files_sha256=files_digest(checked),
    ), checked


def _asking(what: str, run: Run, attempt: int, pod: str) -> tracing.Hop | tracing.Untraced:
    """The span of the control plane's asking for a registration of `run` (an admission, a
    retry): a trace of its own, which runtimed's spans of that registration join
    (docs/protocol.md, "Tracing"); recorded only where the control plane exports."""
    return tracing.recorded("controller", None, f"{what} {run.name} attempt {attempt}", {
        tracing.RUN_NAME: run.name,
        tracing.RUN_UID: run.uid,
        tracing.REGISTRATION_ATTEMPT: attempt,
        "fnkernel.pod": pod,
    }, kind="INTERNAL")  # fmt: skip


class ControlPlane:
    def __init__(
        self,
        store: RunStore,
        *,
        policy: RetryPolicy | None = None,
        tick: float = 0.1,
        create_seconds: float = CREATE_SECONDS,
    ) -> None:
        """`create_seconds`: how long a Run found without its files is given for the create
        that made it to write them, before it is failed (docs/kubernetes.md, "Reads")."""
        self.store = store
        self.policy = policy or RetryPolicy()
        self.tick = tick
        self.create_seconds = create_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # Runs

    def create_run(
        self,
        *,
        name: str,
        runtime: str,
        handler: str,
        files: Mapping[str, str],
        env: Mapping[str, str] | None = None,
        idle_timeout_seconds: int = 0,
        source: str = "",
        memory_mb: int = 0,
        replicas: int = 1,
        requirements: Sequence[str] = (),
        secrets: Sequence[str] = (),
        traceparent: str = "",
    ) -> Run:
        """Validate, assign a pod, and store the Run with its files; phase Pending. With
        `replicas` N > 1, N Runs of the spec serve the function (docs/protocol.md, "Replicas"),
        each assigned to the least-loaded pod in turn; replica 0, named `name`, is returned.

        Idempotent: a Run of that name created with the same spec (runtime, handler, files, env,
        idle timeout, memory, replicas, requirements, secrets) is returned as it is — a client that lost the answer to its
        create (the gateway crashed) can repeat it, and a repeat creates the replicas a crash
        left uncreated. Another spec under a taken name is RunAlreadyExists. A create that
        fails removes the replicas it made. `traceparent`: the traced create's context, for
        runtimed's spans of the registrations (docs/protocol.md, "Tracing")."""
        if (
            not isinstance(replicas, int)
            or isinstance(replicas, bool)
            or not 1 <= replicas <= MAX_REPLICAS
        ):
            raise InvalidField("replicas", f"must be 1 to {MAX_REPLICAS}, got {replicas!r}")
        asked = RunSpec(
            runtime=runtime,
            handler=handler,
            files_sha256="",
            env=env or {},
            idle_timeout_seconds=idle_timeout_seconds,
            memory_mb=memory_mb,
            replicas=replicas,
            requirements=tuple(requirements),
            secrets=tuple(secrets),
        )
        spec, checked = checked_spec(name, asked, files)
        spec = replace(spec, source=source or f"{len(checked)} file(s)")
        made: list[Run] = []  # by this call: removed again if a later replica fails
        first: Run | None = None
        try:
            for replica in range(replicas):
                run, created = self._create_replica(
                    replica_name(name, replica),
                    replace(spec, replica_of=name if replica else ""),
                    checked,
                    traceparent,
                )
                first = first or run
                if created:
                    made.append(run)
        except BaseException:
            for run in made:
                self.store.delete(run.uid)
            raise
        assert first is not None
        return first

    def _create_replica(
        self, name: str, spec: RunSpec, files: Mapping[str, str], traceparent: str
    ) -> tuple[Run, bool]:
        """One replica: the one a same create made already, else a new one (True)."""
        existing = self._created_as(name, spec)
        if existing is not None:
            return existing, False
        pod = self.schedule(spec.runtime)
        if not pod:
            raise NoRuntimePod(f"no live Runtime Pod serves the {spec.runtime} runtime")
        run = Run(
            uid=str(uuid.uuid4()),
            name=name,
            spec=spec,
            # docs/protocol.md: the initial registration is attempt 1
            status=RunStatus(phase=PENDING, attempt=1, assigned_pod=pod, traceparent=traceparent),
            created_at=time.time(),
        )
        try:
            run = self.store.insert(run, files)
        except RunAlreadyExists:
            existing = self._created_as(name, spec)  # the same create, made meanwhile
            if existing is None:
                raise
            return existing, False
        LOG.info("run %s (%s) created on %s", name, run.uid, pod)
        return run, True

    def replicas_of(self, run: Run) -> list[Run]:
        """The Runs of `run`'s replica set, in replica order (those that exist); `run` alone if
        it is one Run."""
        if run.spec.replicas == 1:
            return [run]
        found = []
        for name in replica_names(run):
            with contextlib.suppress(RunNotFound):
                found.append(self.store.get(name))
        return found

    def _created_as(self, name: str, spec: RunSpec) -> Run | None:
        """The live Run named `name` if it was created with `spec` (the same digest); None if
        there is none; RunAlreadyExists if the name is taken by another spec, or by a Run going
        away."""
        try:
            run = self.store.get(name)
        except RunNotFound:
            return None
        if run.spec.digest() != spec.digest() or run.status.phase in (DELETING, DELETED):
            raise RunAlreadyExists(f"a run named {name!r} already exists")
        return run

    def wait_settled(self, name: str, timeout: float, poll: float = 0.005) -> Run:
        """The Run once it is Ready or Failed — and every replica of its set too — or as it
        stands after `timeout` seconds. It is read again only when the store changed
        (``RunStore.version``)."""
        deadline = time.monotonic() + timeout
        first = self._settled(name, deadline, poll)
        if not first.spec.replica_of:
            for replica in replica_names(first)[1:]:
                with contextlib.suppress(RunNotFound):
                    self._settled(replica, deadline, poll)
        return first

    def _settled(self, name: str, deadline: float, poll: float) -> Run:
        last: list[tuple[int, Run]] = []  # the store's version and the Run read at it, once

        def settled() -> Run | None:
            version = self.store.version()
            if last and last[0][0] == version:
                return None  # nothing written since: the Run is as it was
            run = self.store.get(name)
            last[:] = [(version, run)]
            return run if run.status.phase in (READY, FAILED) else None

        return wait_for(settled, timeout=deadline - time.monotonic(), interval=poll) or last[0][1]

    def delete_run(
        self, name: str, *, cancel_in_flight: bool = False, drain_timeout_millis: int = 0
    ) -> bool:
        """Ask the pod's runtimed to unregister — cancelling the in-flight invocation, or
        draining it for at most `drain_timeout_millis` (0: runtimed's default) — then remove
        it from the store. A function's replicas go together: every one is asked first, then
        each awaited. Whether each was unregistered within the wait: one its server still held
        (a server that does not answer) is removed all the same, so that its name can be taken again, and its runtimed
        unregisters it once the server answers (docs/protocol.md, "Runs")."""
        limits.check_drain_timeout(drain_timeout_millis, "drainTimeoutMs")
        run = self.store.get(name)
        if run.spec.replica_of:  # one of a set: the set would serve on, a replica short
            raise InvalidField(
                "name",
                f"{name} is a replica of {run.spec.replica_of}: delete {run.spec.replica_of}, "
                "and its replicas go with it",
            )
        targets = self.replicas_of(run)
        asked = [
            self._ask_delete(target, cancel_in_flight, drain_timeout_millis) for target in targets
        ]
        # Beyond the drain: runtimed's tick and the Unregister round trip.
        deadline = time.monotonic() + limits.delete_wait_seconds(drain_timeout_millis, hops_below=1)
        return all([self._await_unregistered(target, deadline) for target in asked])

    def _ask_delete(self, run: Run, cancel_in_flight: bool, drain_timeout_millis: int) -> Run:
        # The write is fenced on attempt and pod: if the retry engine moved the Run meanwhile,
        # read it again and repeat.
        while run.status.phase not in (DELETING, DELETED):
            if self.store.update(
                run,
                phase=DELETING,
                message="delete requested",
                cancel_in_flight=cancel_in_flight,
                drain_timeout_millis=drain_timeout_millis,
            ):
                break
            run = self.store.get(run.name)
        return run

    def _await_unregistered(self, run: Run, deadline: float) -> bool:
        """Wait until `run` is unregistered (at most until `deadline`), and remove it; whether
        it was."""

        def over() -> str:
            current = self.store.get_uid(run.uid)
            if current is None:
                return "removed"
            pod = self.store.pod(current.status.assigned_pod)
            if current.status.phase == DELETED or pod is None or not pod.alive():
                return "unregistered"  # or nothing left to drain on a pod that is gone
            return ""

        seen = wait_for(over, timeout=deadline - time.monotonic(), interval=0.02)
        if seen != "removed":
            self._remove(run)
        if not seen:
            LOG.warning("run %s (%s): removed while its server still held it", run.name, run.uid)
        return bool(seen)

    def _remove(self, run: Run) -> None:
        self.store.delete(run.uid)
        LOG.info("run %s (%s) deleted", run.name, run.uid)

    # Scheduler

    def schedule(self, runtime: str, *, avoid: str = "") -> str:
        """The least-loaded live pod of `runtime` (ties by name), preferring any pod but `avoid`."""
        load = self.store.load_by_pod()
        live = [pod for pod in self.store.pods(runtime) if pod.alive()]
        others = [pod for pod in live if pod.name != avoid] or live
        if not others:
            return ""
        return min(others, key=lambda pod: (load.get(pod.name, 0), pod.name)).name

    # Retry engine

    def reconcile(self) -> float:
        """One pass: retry or fail Runs in Retrying, rescue Runs on dead pods, finish deletes.

        Returns when (``time.time()``) the passing of time alone can next give a pass work: the
        soonest a live pod's heartbeat runs out or a retry's backoff ends; now, if this pass
        wrote anything. Everything else a pass acts on comes from a write to the store."""
        now = time.time()
        pods = {pod.name: pod for pod in self.store.pods()}
        due = min((pod.expires for pod in pods.values() if pod.alive(now)), default=math.inf)
        for run in self.store.runs():
            pod_name = run.status.assigned_pod
            pod = pods.get(pod_name)
            pod_alive = pod is not None and pod.alive(now)
            if run.status.phase == NEW and not run.delete_requested:
                due = min(due, self._admit(run))
            elif run.delete_requested and run.status.phase not in (DELETING, DELETED):
                # Deleted in the store itself (kubectl delete): unregister it, as delete_run does.
                self.store.update(run, phase=DELETING, message="delete requested")
                due = now
            elif run.status.phase == DELETED or (run.status.phase == DELETING and not pod_alive):
                self._remove(run)
                due = now
            elif run.status.phase == RETRYING:
                due = min(due, self._retry(run, pod_alive, now))
            elif run.status.phase in (PENDING, READY) and not pod_alive:
                # docs/protocol.md, "Runs": a Runtime Pod that dies moves its Runs to retry —
                # one whose record is gone too (on Kubernetes, a deleted pod's object).
                why = f"pod {pod_name} {'stopped' if pod is not None else 'is gone'}"
                if self.store.update(
                    run,
                    phase=RETRYING,
                    message=why,
                    failed_at=now,
                    uncharged_attempts=run.status.uncharged_attempts
                    + int(decide(Step.POD) is Verdict.RETRY_FREE),
                ):
                    LOG.warning(
                        "run %s: %s (no heartbeat); it is retried on a live pod", run.name, why
                    )
                due = now
            elif run.status.phase == IDLE and not pod_alive:
                # No registration exists, so nothing failed: move it without a new attempt.
                target = self.schedule(run.spec.runtime, avoid=run.status.assigned_pod)
                if target and target != run.status.assigned_pod:
                    if self.store.update(run, assigned_pod=target):
                        LOG.info(
                            "run %s (idle): pod %s stopped; now on %s", run.name, pod_name, target
                        )
                    due = now
        return due

    def _admit(self, run: Run) -> float:
        """A Run found in the store with no status (created there directly, ``NEW``): checked
        as ``create_run`` checks a create, then assigned (Pending, attempt 1) or Failed, naming
        the field. Returns when it is next due: never, while no pod serves its runtime (a pod's
        arrival is a write)."""
        try:
            files = self.store.files(run.uid)
        except RunNotFound:
            return math.inf
        except RunFilesMissing as exc:
            # A create writes the Run, then its files (on Kubernetes): give it time to finish.
            due = run.created_at + self.create_seconds
            if time.time() < due:
                return due
            self.store.update(run, expect_phase=NEW, phase=FAILED, message=str(exc))
            return time.time()
        try:
            checked_spec(run.name, run.spec, files)
        except InvalidField as exc:
            self.store.update(run, expect_phase=NEW, phase=FAILED, message=str(exc))
            return time.time()
        pod = self.schedule(run.spec.runtime)
        if not pod:
            message = f"waiting for a live Runtime Pod of the {run.spec.runtime} runtime"
            if run.status.message != message:
                self.store.update(run, expect_phase=NEW, message=message)
            return math.inf
        hop = _asking("admit", run, 1, pod)
        with tracing.finishing(hop):
            admitted = self.store.update(
                run, expect_phase=NEW, phase=PENDING, attempt=1, assigned_pod=pod,
                message="", traceparent=hop.traceparent,
            )  # fmt: skip
        if admitted is not None:
            LOG.info("run %s (%s) admitted on %s", run.name, run.uid, pod)
        return time.time()

    def _retry(self, run: Run, pod_alive: bool, now: float) -> float:
        """Fail a Retrying Run out of budget, or register it again once its backoff is over;
        returns when it is next due (``reconcile``)."""
        # Only failures charged to the Run spend its budget: with its pod down or restarting,
        # a Run waits and retries for free (README, "Runs, runtimed and the gateway").
        if run.charged_attempts >= self.policy.max_attempts:
            self.store.update(
                run,
                phase=FAILED,
                message=limits.bounded(
                    f"gave up after {run.charged_attempts} registration attempts: "
                    f"{run.status.message}"
                ),
            )
            return now
        backoff_ends = run.status.failed_at + self.policy.backoff(max(1, run.charged_attempts))
        if now < backoff_ends:
            return backoff_ends
        # Same pod if it is healthy, else reassignment (docs/protocol.md: the retry engine advances the
        # attempt before the scheduler assigns or reassigns a Runtime Pod).
        target = (
            run.status.assigned_pod
            if pod_alive
            else self.schedule(run.spec.runtime, avoid=run.status.assigned_pod)
        )
        if not target:
            # No live pod yet: the same attempt, once a pod's heartbeat (a write) says one is.
            return math.inf
        hop = _asking("retry", run, run.status.attempt + 1, target)
        hop.set("fnkernel.retrying_after", run.status.message)  # the last attempt's failure
        with tracing.finishing(hop):
            updated = self.store.update(
                run,
                expect_phase=RETRYING,
                phase=PENDING,
                attempt=run.status.attempt + 1,
                assigned_pod=target,
                traceparent=hop.traceparent,  # "" when not exporting: not the last attempt's
            )
        if updated is not None:
            LOG.info(
                "run %s: attempt %d on %s after %s",
                run.name,
                updated.status.attempt,
                target,
                run.status.message,
            )
        return now

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="control-plane", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        """A pass in the tick after another connection writes to the store, and when the last
        pass said time alone would give one work — not every tick: a pass reads every Run and
        pod, CPU in proportion to the Runs (docs/architecture.md, "The control plane's pass")."""
        version: int | None = None
        due = 0.0
        while not self._stop.wait(self.tick):
            try:
                seen = self.store.version()
                if seen == version and time.time() < due:
                    continue
                version = seen
                due = self.reconcile()
            except Exception:
                LOG.exception("control plane pass failed")
                due = 0.0  # the next tick tries again
