"""runtimed: the agent of one Runtime Pod, colocated with its Runtime Server (docs/protocol.md, "Runs").

It is the only caller of RegisterFunction and UnregisterFunction. Its loop reconciles the Runs the
control plane assigned to this pod: it registers each (its spec's digest is the registration
digest; an uncertain RPC is repeated with the *same* attempt, which is idempotent), polls
FunctionStatus at a bounded cadence for health and the idle timeout, and reports what happened in
the Run's status.

Its own FunctionRuntime port is the **proxy hop**: InvokeFunction and FunctionStatus arrive with a
run_uid and an empty registration_id; runtimed fills in the private active ID and calls the
colocated server. The caller names the pod it routed to in ``x-fn-pod`` (routing fence).

It shares nothing with the control plane but the Run store: it reads each Run's files from the
store and writes them into a workspace of its own (one directory a Run, kept while the Run is
assigned here), which is where its Runtime Server loads them from.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from pathlib import Path

import grpc

from fnkernel.runtime_server import callstream, tracing, wire
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server._proto.fnkernel.v1alpha1 import (
    batches_pb2_grpc,
    logs_pb2_grpc,
    payloads_pb2_grpc,
    registrations_pb2_grpc,
)
from fnkernel.runtime_server.errors import (
    RequirementsFailed,
    RoutedElsewhere,
    RunFilesMissing,
    RunNotFound,
    RunNotReady,
    SecretNotFound,
)
from fnkernel.runtime_server.function_runtime.registration import FAILED as REG_FAILED
from fnkernel.runtime_server.function_runtime.registration import READY as REG_READY
from fnkernel.runtime_server.lifecycle.retries import Step, Verdict, decide
from fnkernel.runtime_server.lifecycle.runs import Run, RunStore
from fnkernel.runtime_server.lifecycle.runtimed.failures import RunFailures
from fnkernel.runtime_server.lifecycle.runtimed.health import Heartbeat
from fnkernel.runtime_server.lifecycle.runtimed.packages import (
    Environment,
    PackageCache,
    throttled,
)
from fnkernel.runtime_server.lifecycle.runtimed.proxy import proxy_ports
from fnkernel.runtime_server.lifecycle.runtimed.server import (
    Active,
    ServerRegistrations,
    StatusRefused,
    registration_request,
)
from fnkernel.runtime_server.lifecycle.runtimed.streams import StreamRelay
from fnkernel.runtime_server.lifecycle.runtimed.workspace import Workspace
from fnkernel.runtime_server.lifecycle.secrets import (
    Secrets,
    rotated_secret,
    secret_versions,
    secrets_set_again,
)
from fnkernel.runtime_server.pipeline import Pipeline
from fnkernel.runtime_server.rpc import (
    CHANNEL_OPTIONS,
    STREAM_CHANNEL_OPTIONS,
    CancellableCalls,
    listen_on,
)
from fnkernel.runtime_server.wire import DELETED, DELETING, FAILED, IDLE, PENDING, READY, RETRYING

LOG = logging.getLogger("fnkernel.runtimed")
_WAKE_SECONDS = 0.005  # how often the loop asks the store whether anything changed, when busy
_BUSY_SECONDS = 10.0  # busy: this long after the last change (then every tick: idle CPU)


class Runtimed(RunFailures):
    def __init__(
        self,
        store: RunStore,
        *,
        pod: str,
        runtime: str,
        server_address: str,
        workspace: Path,
        packages: PackageCache,
        secrets: Secrets,
        poll_interval: float = 1.0,
        tick: float = 0.05,
    ) -> None:
        """`workspace`: the directory of this pod's Runs' files, inside its server's workspace
        root (one directory a Run, ``working_dir``). `packages`: the node's cache of the Runs'
        requirements."""
        self.packages, self.secrets = packages, secrets
        self.store = store
        self.pod = pod
        self.runtime = runtime
        self.server_address = server_address
        self.workspace = workspace.resolve()
        self._files = Workspace(self.workspace)
        self.poll_interval = poll_interval
        self.tick = tick
        self.address = ""
        self._channel = grpc.insecure_channel(server_address, options=CHANNEL_OPTIONS)
        self.server_stub = pb_grpc.FunctionRuntimeStub(self._channel)
        self.server = ServerRegistrations(
            self.server_stub, registrations_pb2_grpc.RegistrationsStub(self._channel)
        )
        self.logs_stub = logs_pb2_grpc.InvocationLogsStub(self._channel)
        self.payloads_stub = payloads_pb2_grpc.PayloadsStub(self._channel)
        self._batches_channel = grpc.insecure_channel(
            server_address, options=STREAM_CHANNEL_OPTIONS
        )
        self.batches_stub = batches_pb2_grpc.BatchesStub(self._batches_channel)
        self.heart = Heartbeat(self._channel, store, pod, runtime, poll_interval)
        self.calls = CancellableCalls(server_address, callstream.Invoke)  # proxied
        self._lock = threading.Lock()
        self._active: dict[str, Active] = {}
        self._runs: dict[str, Run] = {}  # this pod's Runs as of the last reconcile pass
        # Per Run: registration, scale to zero, delete and the proxy's slow path never interleave.
        self._run_locks: dict[str, threading.RLock] = {}
        self._busy: set[str] = set()  # Runs with a registration or delete job queued or running
        self._stopping: set[str] = set()  # deleted Runs whose load is being stopped
        # Runs whose proxied call succeeded since the last poll, with the registration it used:
        # that call showed what a FunctionStatus poll would (docs/architecture.md, "The proxy hop").
        self._served: dict[str, Active] = {}
        # Runs whose proxied call broke off (UNAVAILABLE) with the registration and invocation:
        # if that registration turns out lost, the server died while the call ran.
        self._cut_off: dict[str, tuple[Active, str]] = {}
        self._workers = futures.ThreadPoolExecutor(8, thread_name_prefix="register")
        self._stop = threading.Event()
        self._loop_thread: threading.Thread | None = None
        self._grpc: grpc.Server | None = None
        self._pipeline: Pipeline | None = None
        self._streams: StreamRelay | None = None  # "Call streams", on an event loop

    # Lifecycle

    def start(self, listen: str) -> str:
        self._grpc, self.heart.servicer, self._pipeline, proxy = proxy_ports(self)
        self.address = listen_on(self._grpc, listen)
        self._grpc.start()
        streams_at = wire.call_streams_target(self.address)
        if streams_at is not None:  # its callers on this machine: the call streams on a loop
            relay = StreamRelay(proxy, self._pipeline, self.server_address)
            try:
                relay.start(streams_at)
            except RuntimeError as exc:  # its callers make their calls on the port above
                LOG.warning("call streams not served at %s: %s", streams_at, exc)
            else:
                self._streams = relay
        self._heartbeat()
        self._loop_thread = threading.Thread(target=self._loop, name="runtimed", daemon=True)
        self._loop_thread.start()
        return self.address

    def stop(self, grace: float = 5.0) -> None:
        self._stop.set()
        if self._streams is not None:
            self._streams.refuse(grace)
        if self._grpc is not None and self._pipeline is not None:
            self._pipeline.stop(self._grpc, grace)  # the calls on either port given `grace`
        if self._streams is not None:
            self._streams.close()
        if self._loop_thread is not None:
            self._loop_thread.join(5)
        self._workers.shutdown(wait=False, cancel_futures=True)
        self.calls.close()
        self._channel.close()
        self._batches_channel.close()

    def _loop(self) -> None:
        """Reconcile within a wake-up of any write to the store — a new Run is registered at
        once (docs/architecture.md, "The first registration") — and once a poll interval
        regardless: reading every Run of the pod each tick cost CPU in proportion to the Runs
        (0.8 ms a pass for 50). The wake-ups are 5 ms apart for a while after a change, a tick
        apart once all is quiet (idle CPU); a server that did not answer its last health check
        is checked again every tick. The heartbeat is written every HEARTBEAT_SECONDS,
        whatever the poll interval."""
        next_poll = next_pass = next_reconcile = last_change = 0.0
        version = None
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                seen = self.store.version()
                changed = seen != version
                if changed:
                    last_change = now
                if changed or now >= next_pass:
                    version, next_pass = seen, now + self.tick
                    if changed or now >= next_reconcile:
                        next_reconcile = now + self.poll_interval
                        self.reconcile()
                    if now >= next_poll:
                        next_poll = time.monotonic() + self.poll_interval
                        self.poll()
                    if now >= self.heart.next_beat or not self.heart.healthy:
                        # A poll the server answered is its health check (docs/
                        # architecture.md, "Idle"): one round trip a second, not two.
                        self._heartbeat(answered=self.server.answered)
            except Exception:
                LOG.exception("runtimed pass failed")
                next_reconcile = 0.0  # the next pass, a tick later, tries again
            self._stop.wait(_WAKE_SECONDS if now - last_change < _BUSY_SECONDS else self.tick)

    def _heartbeat(self, *, now: bool = False, answered: float = -math.inf) -> None:
        self.heart.beat(self.address, now=now, answered=answered)

    # Reconcile: make the server match the Runs assigned to this pod

    def working_dir(self, uid: str) -> Path:
        """Where the files of Run `uid` are while it is assigned to this pod."""
        return self._files.working_dir(uid)

    def reconcile(self) -> None:
        mine = {run.uid: run for run in self.store.runs(pod=self.pod)}
        with self._lock:
            self._runs = mine
            gone = [uid for uid in self._active if uid not in mine]
        for uid in gone:  # reassigned elsewhere or removed: free the server's state
            self._unregister(uid, cancel=True)
        self._remove_files(keep=mine)
        for run in mine.values():
            if run.status.phase == PENDING:
                self._submit(run, self._register)
            elif run.status.phase == DELETING and not self._submit(run, self._delete):
                self._stop_loading(run)  # its registration is under way: maybe a hung load
            elif run.status.phase in (FAILED, RETRYING) and run.uid in self._active:
                self._unregister(run.uid, cancel=True)
        with self._lock:  # what the registrations use stays in the cache
            self.packages.keep([active.packages for active in self._active.values()])

    def _remove_files(self, keep: Mapping[str, Run]) -> None:
        """Remove the files of every Run no longer here: reassigned elsewhere or deleted, and
        no longer registered or being registered (a staging directory too, once its job ended)."""
        with self._lock:
            held = set(self._active) | self._busy
        self._files.remove_all_but(set(keep) | held)

    def _submit(self, run: Run, action: Callable[[Run], object]) -> bool:
        """Run `action(run)` on the worker pool unless a job for this Run is already queued."""
        with self._lock:
            if run.uid in self._busy:
                return False
            self._busy.add(run.uid)

        def job() -> None:
            try:
                action(run)
            except Exception:
                LOG.exception("run %s: background job failed", run.name)
            finally:
                with self._lock:
                    self._busy.discard(run.uid)

        self._workers.submit(job)
        return True

    def _stop_loading(self, run: Run) -> None:
        """A deleted Run's registration still loading stopped, beside the job that waits for
        it (one at a time)."""
        with self._lock:
            if run.uid in self._stopping:
                return
            self._stopping.add(run.uid)

        def stop() -> None:
            try:
                self.server.stop_loading(run)
            finally:
                with self._lock:
                    self._stopping.discard(run.uid)

        self._workers.submit(stop)

    def _run_lock(self, uid: str) -> threading.RLock:
        with self._lock:
            return self._run_locks.setdefault(uid, threading.RLock())

    def _register(self, run: Run, *, expect_phase: str = PENDING) -> Active | None:
        """RegisterFunction for the Run's current attempt; write the outcome to its status."""
        with self._run_lock(run.uid):
            current = self.store.get_uid(run.uid)
            if (
                current is None
                or current.status.phase != expect_phase
                or current.status.assigned_pod != self.pod
            ):
                return None
            run = current
            # docs/protocol.md, "Tracing": a span per step, in the trace of whoever asked for
            # this attempt (the Run's traceparent), exported only.
            title = f"register {run.name} attempt {run.status.attempt}"
            hop = tracing.recorded("runtimed", run.status.traceparent or None, title, {
                tracing.RUN_NAME: run.name,
                tracing.RUN_UID: run.uid,
                tracing.REGISTRATION_ATTEMPT: run.status.attempt,
                "fnkernel.pod": self.pod,
            }, kind="INTERNAL")  # fmt: skip
            try:
                active = self._register_steps(run, expect_phase, hop)
            except Exception as exc:
                hop.finish({}, error=tracing.why(exc))
                raise
            hop.finish({}, error="" if active is not None else "not READY")
            return active

    def _register_steps(
        self, run: Run, expect_phase: str, hop: tracing.Hop | tracing.Untraced
    ) -> Active | None:
        """_register's steps, each one span of `hop`: the Run's files written from the store
        (a directory that exists is kept: the handler may have written into it), its
        requirements installed, the RegisterFunction call, its status written."""
        doing = "write the run's files"
        try:
            with hop.step("write the Run's files"):
                working_dir = self._files.materialize(run.uid, lambda: self.store.files(run.uid))
            environment = None
            if run.spec.requirements:
                doing = "install the requirements"
                with hop.step("install its requirements"):
                    environment = self._environment(run, expect_phase)
            doing = "read its secrets"
            secrets = [self.secrets.get(name) for name in run.spec.secrets]
        except RunNotFound:
            return None  # deleted meanwhile
        except SecretNotFound as exc:  # failed until the secret is set again (``poll``)
            self._failed(run, str(exc), secret_versions(self.secrets, run.spec.secrets))
            return None
        except (RunFilesMissing, RequirementsFailed) as exc:  # no retry helps
            self._failed(run, str(exc))
            return None
        except OSError as exc:  # the pod's disk, not the handler: a charged retry
            self._infrastructure_failure(run, f"cannot {doing}: {exc}")
            return None
        request = registration_request(run, working_dir, environment, secrets)
        try:
            response = self.server.register_repeating(request, hop)
        except grpc.RpcError as err:
            verdict = decide(Step.REGISTER, err.code())
            self._registration_failed(run, verdict, err.code(), err.details() or "")
            return None
        active = Active(
            response.registration.registration_id,
            run.status.attempt,
            request.registration_digest,
            environment.digest if environment is not None else "",
        )
        hop.set(tracing.REGISTRATION_ID, active.registration_id)
        if response.state == REG_READY:
            with self._lock:
                self._active[run.uid] = active
            with hop.step("write the Run's status: Ready"):
                versions = {secret.name: secret.version for secret in secrets}
                self.store.update(run, expect_phase=expect_phase, phase=READY, message="", secret_versions=versions)  # fmt: skip
            attempt = run.status.attempt
            LOG.info("run %s attempt %d READY as %s", run.name, attempt, active.registration_id)
            return active
        if response.state == REG_FAILED:
            self._fatal(run, self.server.fatal_error(run.uid, active))
        # Still REGISTERING (a very slow import): the next pass repeats the same attempt.
        return None

    def _environment(self, run: Run, expect_phase: str) -> Environment:
        """The Run's requirements installed on this node (``PackageCache``), uv's lines its
        status message meanwhile. RequirementsFailed with uv's words if they cannot be."""
        report = throttled(lambda line: self.store.update(run, expect_phase=expect_phase, message=line))  # fmt: skip
        return self.packages.environment(run.spec.requirements, report)

    # Poll: health and idle timeout, at a bounded cadence

    def poll(self) -> None:
        with self._lock:
            ready = [run for run in self._runs.values() if run.status.phase == READY]
            failed = [run for run in self._runs.values() if run.status.phase == FAILED]
        for run in failed:  # for a secret that did not exist (docs/protocol.md, "Secrets")
            if why := secrets_set_again(self.secrets, run.status.secret_versions):
                self._infrastructure_failure(run, f"{why}: registering again", charged=False)
        seen: dict[str, str | None] = {}  # each secret read once a poll
        polled: list[tuple[Run, Active]] = []
        for run in ready:
            active = self.active(run)
            if rotated := rotated_secret(
                self.secrets, run.status.secret_versions, seen
            ):  # docs/protocol.md, "Secrets": its registration has an old version
                self._infrastructure_failure(run, f"{rotated}: registering again", charged=False)
            elif active is None:  # runtimed restarted: the same attempt and digest return it
                self._submit(run, lambda r: self._register(r, expect_phase=READY))
            elif self._served.pop(run.uid, None) != active:  # none ran on it since: poll it
                polled.append((run, active))
        if not polled:
            return
        # One round trip for all of them (docs/architecture.md, "Idle").
        answers = self.server.statuses([(run.uid, active) for run, active in polled])
        for (run, active), answer in zip(polled, answers, strict=True):
            self._polled(run, active, answer)

    def served(self, run: Run, active: Active) -> None:
        """A proxied call on `active` succeeded: the next poll of the Run can be skipped, and
        its count of server deaths starts again (``registration_lost``)."""
        self._served[run.uid] = active
        self._cut_off.pop(run.uid, None)
        if run.status.server_deaths:
            self.store.update(run, server_deaths=0)

    def _polled(
        self, run: Run, active: Active, status: pb.FunctionStatusResponse | StatusRefused
    ) -> None:
        """What the poll's FunctionStatus of `run`'s registration `active` says to do."""
        if isinstance(status, StatusRefused):
            verdict = decide(Step.STATUS, status.code)
            message = f"FunctionStatus: {status.code.name}: {status.details}"
            if verdict is Verdict.WAIT:
                # No answer (the server is paused, busy or restarting) says nothing about the
                # registration: it is kept, and the next poll asks again. A server that really
                # went away lost it, and says so (NOT_FOUND) once it is back.
                LOG.debug("run %s: FunctionStatus: %s; polling again", run.name, status.code.name)
            elif verdict is Verdict.RETRY_FREE:
                # NOT_FOUND: the server restarted and lost it; FAILED_PRECONDITION: it holds
                # another. Either way the pod failed, not the function (registration_lost).
                self.registration_lost(run, active, message)
            else:
                self._infrastructure_failure(run, message)
            return
        if status.state == REG_FAILED:
            self._fatal(run, status.fatal_error)
        elif status.state == REG_READY and status.in_flight == 0:
            idle_ns = time.time_ns() - status.last_activity_unix_nano
            if idle_ns > run.spec.idle_timeout_seconds * 1_000_000_000:
                self._scale_to_zero(run)

    def _scale_to_zero(self, run: Run) -> None:
        """Idle timeout: unregister (drain) and mark the Run Idle; the next invoke re-registers."""
        with self._run_lock(run.uid):
            # Forget the ID first: from here a proxied invoke takes the slow path and waits on
            # the run lock, then finds the Run Idle and cold-starts it.
            with self._lock:
                active = self._active.pop(run.uid, None)
            if not self.store.update(
                run, expect_phase=READY, phase=IDLE, message="idle: scaled to zero"
            ):
                if active is not None:
                    with self._lock:
                        self._active.setdefault(run.uid, active)
                return
            if active is not None:
                self.server.unregister(run.uid, active, cancel=False)
            LOG.info("run %s idle after %ss: unregistered", run.name, run.spec.idle_timeout_seconds)

    def _unregister(self, uid: str, *, cancel: bool, drain_millis: int = 0) -> bool:
        """Unregister the Run's active registration; True once the server no longer holds it.
        On failure the registration stays known here, so a later pass tries again."""
        with self._lock:
            active = self._active.pop(uid, None)
        if active is None:
            return True
        if self.server.unregister(uid, active, cancel=cancel, drain_millis=drain_millis):
            return True
        with self._lock:
            self._active.setdefault(uid, active)
        return False

    def _delete(self, run: Run) -> None:
        """Deletion converges: the Run becomes Deleted only once the server no longer holds its
        registration; until then it stays Deleting and the next pass tries again."""
        with self._run_lock(run.uid):
            with self._lock:
                known = run.uid in self._active
            if not known:
                try:
                    environment = self.packages.registered_with(run.spec.requirements)
                    held = self.server.held(run, self.working_dir(run.uid), environment)
                except grpc.RpcError as err:
                    LOG.warning("deleting %s: %s; will retry", run.name, err.details())
                    return
                if held is not None:
                    with self._lock:
                        self._active.setdefault(run.uid, held)
            # docs/protocol.md, "Runs": a bounded drain, unless the delete asked to cancel the in-flight call
            if not self._unregister(
                run.uid,
                cancel=run.status.cancel_in_flight,
                drain_millis=run.status.drain_timeout_millis,
            ):
                return
            self.store.update(run, expect_phase=DELETING, phase=DELETED, message="unregistered")

    # Proxy hop

    def fenced_run(self, run_uid: str, routed_to: str | None) -> Run:
        """The Run behind a proxied call, if the caller routed it here and it is assigned here.

        Read from the store on every call (``get_uid_fresh``: the row again only if anything
        was written since it was last read): the fence must see a reassignment at once, not a
        tick later.
        """
        if routed_to is not None and routed_to != self.pod:
            raise RoutedElsewhere(f"this is pod {self.pod}, not {routed_to}")
        run = self.store.get_uid_fresh(run_uid)
        if run is None:
            raise RunNotFound(f"no run has uid {run_uid}")
        if run.status.assigned_pod != self.pod:
            raise RoutedElsewhere(
                f"run {run.name} is assigned to pod {run.status.assigned_pod or '(none)'}, "
                f"not {self.pod}"
            )
        return run

    def active(self, run: Run) -> Active | None:
        with self._lock:
            active = self._active.get(run.uid)
        return active if active is not None and active.attempt == run.status.attempt else None

    def ready(self, run_uid: str, routed_to: str | None) -> tuple[Run, Active] | None:
        """The Run behind a proxied invoke (fenced) and its active registration if it is READY:
        ``resolve``'s fast path, which waits for nothing; else None."""
        run = self.fenced_run(run_uid, routed_to)
        active = self.active(run)
        return (run, active) if active is not None and run.status.phase == READY else None

    def resolve(
        self, run_uid: str, routed_to: str | None, *, fast: bool = True
    ) -> tuple[Run, Active, bool]:
        """The Run and its active registration for a proxied invoke; True if it had to be
        registered first (a cold start after scale to zero)."""
        found = self.ready(run_uid, routed_to)  # the routing fence, every time
        if fast and found is not None:
            return *found, False
        with self._run_lock(run_uid):  # after any scale to zero or registration in progress
            run = self.fenced_run(run_uid, None)
            active = self.active(run)
            if active is not None and run.status.phase == READY:
                return run, active, False
            if run.status.phase in (READY, IDLE):
                # Idle: re-register on demand with the same attempt (no failure occurred).
                # Ready with no ID: runtimed restarted; the same attempt returns the current one.
                registered = self._register(run, expect_phase=run.status.phase)
                if registered is not None:
                    return run, registered, run.status.phase == IDLE
                run = self.store.get_uid(run_uid) or run
        detail = f": {run.status.message}" if run.status.message else ""
        raise RunNotReady(
            f"run {run.name} is {run.status.phase} (attempt {run.status.attempt}){detail}"
        )
