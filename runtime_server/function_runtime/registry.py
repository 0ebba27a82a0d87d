"""The FunctionRuntime state machine: registrations, fencing and limits (docs/protocol.md, "Registration").

Plain Python with no gRPC in it; ``runtime_server.function_runtime.servicer`` translates requests and errors. One
lock guards the map from Run UID to its current registration, so a stale registration ID can never
change, invoke or remove a newer registration: every operation compares the ID under that lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from fnkernel.adapters import Adapter, FunctionSpec, HandlerResult, Transfer
from fnkernel.adapters.base import QUEUED_MAX_BYTES, NextCall
from fnkernel.adapters.calllogs import LIVE_POLL_SECONDS, LogLine
from fnkernel.adapters.errors import (
    INITIALIZATION_ERROR,
    OUTPUT_TOO_LARGE,
    WORKER_START_FAILED,
    AdapterError,
    HandlerError,
    InitError,
    InvocationTimeout,
)
from fnkernel.runtime_server import limits, tracing
from fnkernel.runtime_server.errors import (
    AttemptSuperseded,
    DigestConflict,
    InvalidField,
    InvocationInFlight,
    InvocationNotFound,
    RegistrationNotFound,
    RegistrationNotReady,
    ShuttingDown,
    StaleRegistration,
)
from fnkernel.runtime_server.function_runtime.registration import (
    DRAINING,
    FAILED,
    READY,
    REGISTERING,
    InvocationOutcome,
    Registration,
    RegistrationView,
    state_name,
)
from fnkernel.runtime_server.function_runtime.spool import Spool, new_name
from fnkernel.runtime_server.wire import INPUT_REF_KEY

LOG = logging.getLogger("fnkernel.runtime")
_DISPATCH_POLL_SECONDS = 0.005  # a follower of a call accepted but not yet at its worker
_MAX_TOMBSTONES = 10_000
_CANCEL_SETTLE_SECONDS = 5.0  # how long unregister waits for a killed call to unwind


class Registry:
    """Every registration of one Runtime Server, which serves one built-in runtime (docs/protocol.md, "Services")."""

    def __init__(
        self,
        adapter_cls: type[Adapter],
        workspace_root: Path,
        *,
        register_wait: float = limits.REGISTER_LOAD_SECONDS,
        spool: Spool | None = None,
    ) -> None:
        """`spool`: where payloads past one message wait (docs/protocol.md, "Large payloads");
        None: this server takes none."""
        self.adapter_cls = adapter_cls
        self.workspace_root = workspace_root
        self.spool = spool
        self._register_wait = register_wait
        self._lock = threading.Condition()
        self._current: dict[str, Registration] = {}
        # Highest attempt seen per Run UID whose registration was removed: a delayed RegisterFunction
        # for an older attempt must still be refused after an unregister.
        self._tombstones: OrderedDict[str, int] = OrderedDict()
        self._shutting_down = False

    # RegisterFunction

    def register(
        self,
        *,
        run_uid: str,
        registration_attempt: int,
        working_dir: str,
        handler: str,
        env: Mapping[str, str],
        idle_timeout_seconds: int,
        registration_digest: str,
        memory_mb: int = 0,
        hop: tracing.Hop | tracing.Untraced = tracing.UNTRACED,
    ) -> RegistrationView:
        """`hop`: the call's spans, to which the worker's load is added (docs/protocol.md,
        "Tracing")."""
        limits.check_run_uid(run_uid)
        limits.check_registration_attempt(registration_attempt)
        directory = limits.resolve_working_dir(working_dir, self.workspace_root)
        limits.check_handler(self.adapter_cls, handler, directory)
        env = limits.check_env(env)
        limits.check_idle_timeout(idle_timeout_seconds)  # runtimed acts on it; we only bound it
        limits.check_digest(registration_digest)
        memory_mb = limits.check_memory_mb(memory_mb)

        superseded: Registration | None = None
        with self._lock:
            if self._shutting_down:
                raise ShuttingDown("the Runtime Server is shutting down")
            current = self._current.get(run_uid)
            if current is not None and registration_attempt == current.attempt:
                if registration_digest != current.digest:
                    # docs/protocol.md, "Registration": same run_uid, same attempt, other digest → ALREADY_EXISTS.
                    raise DigestConflict(
                        f"run {run_uid} attempt {registration_attempt} is already registered "
                        "with a different registration_digest"
                    )
                # docs/protocol.md, "Registration": idempotent; the current reference, no
                # re-initialisation — at once, REGISTERING while it loads: its caller (runtimed
                # deleting the Run) may need the ID to unregister a load that never ends.
                return RegistrationView.of(current)
            else:
                newest = (
                    current.attempt if current is not None else self._tombstones.get(run_uid, 0)
                )
                if registration_attempt < newest:
                    raise AttemptSuperseded(
                        f"registration_attempt {registration_attempt} is older than attempt "
                        f"{newest} already seen for run {run_uid}"
                    )
                superseded = current  # docs/protocol.md, "Registration": a higher attempt supersedes the old registration
                reg = self._new_registration(
                    run_uid,
                    registration_attempt,
                    registration_digest,
                    directory,
                    handler,
                    env,
                    memory_mb,
                )
                if superseded is not None:
                    superseded.state = DRAINING
                    hop.set(tracing.SUPERSEDED, superseded.registration_id)
                self._current[run_uid] = reg
                hop.delegate(
                    "worker", f"load {handler}", {tracing.RUNTIME: self.adapter_cls.runtime}
                )
                # Loads beside the superseded worker's teardown; _load takes the lock only at its end.
                threading.Thread(target=self._load, args=(reg, hop), daemon=True).start()
        if superseded is not None:
            LOG.info(
                "attempt %d supersedes %s",
                registration_attempt,
                superseded.registration_id,
                extra={"run_uid": run_uid},
            )
            self._release(superseded, cancel=True)
        # RegisterFunction answers READY (docs/protocol.md, "Registration"): wait (bounded) for
        # the import.
        reg.loaded.wait(self._register_wait)
        with self._lock:
            return RegistrationView.of(reg)

    def _new_registration(
        self,
        run_uid: str,
        attempt: int,
        digest: str,
        working_dir: Path,
        handler: str,
        env: dict[str, str],
        memory_mb: int,
    ) -> Registration:
        spool = self.spool.directory if self.spool is not None else None
        spec = FunctionSpec(run_uid, working_dir, handler, env, memory_mb, spool)
        registration_id = limits.new_id("reg_")
        adapter = self.adapter_cls(
            spec,
            # One message's, and never past the spool's bound, so that a result's bound is one
            # whichever way it travels (docs/protocol.md, "Limits").
            max_output_bytes=min(limits.MAX_PAYLOAD_BYTES, self.spool.max_bytes)
            if self.spool is not None
            else limits.MAX_PAYLOAD_BYTES,
            on_fatal=lambda exc: self._fail(run_uid, registration_id, exc),
        )
        return Registration(run_uid, registration_id, attempt, digest, spec, adapter)

    def _load(self, reg: Registration, hop: tracing.Hop | tracing.Untraced) -> None:
        """Start the worker (import / source once); READY or FAILED with a bounded fatal_error."""
        try:
            reg.adapter.start()
        except InitError as exc:
            self._fail(reg.run_uid, reg.registration_id, exc)
        except AdapterError:
            pass  # closed while loading: it was superseded or unregistered
        except OSError as exc:  # the OS would not start the worker (EAGAIN, ENOMEM, EMFILE, …)
            LOG.warning("starting a worker for %s: %s", reg.spec.handler, exc)
            failure = InitError(WORKER_START_FAILED, f"the worker could not be started: {exc}")
            self._fail(reg.run_uid, reg.registration_id, failure)
        except Exception as exc:  # never leave a registration REGISTERING forever
            LOG.exception("loading %s failed", reg.spec.handler, extra={"run_uid": reg.run_uid})
            self._fail(reg.run_uid, reg.registration_id, InitError(INITIALIZATION_ERROR, str(exc)))
        else:
            with self._lock:
                if reg.state == REGISTERING:
                    reg.state = READY
                    reg.last_activity_unix_nano = time.time_ns()
            if reg.state != READY:
                reg.adapter.close()
        finally:
            hop.delegated(reg.fatal_error)  # set by _fail, in this thread, if it failed
            reg.loaded.set()

    def _fail(self, run_uid: str, registration_id: str, exc: InitError) -> None:
        """docs/protocol.md, "Registration": a permanent initialisation failure leaves the registration FAILED."""
        with self._lock:
            reg = self._current.get(run_uid)
            if reg is None or reg.registration_id != registration_id:
                return
            reg.state = FAILED
            reg.fatal_error = limits.bounded(str(exc))
        LOG.warning("registration failed: %s", exc, extra={"run_uid": run_uid})
        reg.adapter.close()

    # FunctionStatus

    def status(self, *, run_uid: str, registration_id: str) -> RegistrationView:
        limits.check_run_uid(run_uid)
        limits.check_registration_id(registration_id)
        with self._lock:
            return RegistrationView.of(self._lookup(run_uid, registration_id))

    def _lookup(self, run_uid: str, registration_id: str) -> Registration:
        """The current registration for `run_uid`, fenced by `registration_id` (lock held)."""
        reg = self._current.get(run_uid)
        if reg is None:
            raise RegistrationNotFound(f"no registration has run_uid {run_uid}")
        if reg.registration_id != registration_id:
            raise StaleRegistration(
                f"registration_id {registration_id} is stale; run {run_uid} has a newer registration"
            )
        return reg

    # InvokeFunction

    def invoke(
        self,
        *,
        run_uid: str,
        registration_id: str,
        invocation_id: str,
        input: bytes,
        content_type: str,
        timeout_millis: int,
        deadline: float | None = None,
        on_dispatch: Callable[[Callable[[], object]], None] | None = None,
        hop: tracing.Hop | tracing.Untraced = tracing.UNTRACED,
        input_ref: str = "",
        output_from: int = 0,
        then: NextCall | None = None,
    ) -> InvocationOutcome:
        """Run one invocation. `deadline` (monotonic) is the caller's own, if it has one.

        `on_dispatch(cancel)` is called once the call is accepted, with a function that cancels
        it, so the caller can cancel it if its client goes away. `hop`: a traced call's spans,
        to which the worker's is added (docs/protocol.md, "Tracing"). `input_ref`: the spooled
        payload that is the input, removed when the call ends; `output_from`: the size from
        which the output is spooled, for the caller to take (0: never; docs/protocol.md, "Large
        payloads"). `then`: the call the caller invokes next, to queue behind this one where the
        adapter can (docs/protocol.md, "Batches"); the caller then invokes it, or cancels it
        with ``cancel_queued``. Its `timeout` is the call's `timeout_millis`, its fields are
        checked here, and it is not queued unless they pass.
        """
        limits.check_run_uid(run_uid)
        limits.check_registration_id(registration_id)
        invocation_id = limits.check_invocation_id(invocation_id)
        limits.check_input(input)
        limits.check_content_type(content_type)
        timeout = limits.effective_timeout_millis(timeout_millis) / 1000
        began = time.monotonic()
        effective_deadline = began + timeout
        if deadline is not None:
            effective_deadline = min(effective_deadline, deadline)
        with self._lock:
            if self._shutting_down:
                raise ShuttingDown("the Runtime Server is shutting down")
            reg = self._lookup(run_uid, registration_id)
            if reg.state != READY:
                detail = f": {reg.fatal_error}" if reg.fatal_error else ""
                raise RegistrationNotReady(
                    f"run {run_uid} is {state_name(reg.state)}, not READY{detail}"
                )
            adapter = reg.adapter
            media = limits.check_content_type(content_type, adapter.content_types, adapter.runtime)
            if reg.in_flight:
                raise InvocationInFlight(
                    f"run {run_uid} already has invocation {reg.invocation_id} in flight"
                )
            reg.in_flight = 1
            reg.invocation_id = invocation_id
            reg.last_activity_unix_nano = time.time_ns()
            self._lock.notify_all()  # a follower may be waiting for it
        logs: tuple[LogLine, ...] = ()
        failure = ""  # for the worker's span
        transfer = Transfer()
        result: HandlerResult | None = None
        try:
            transfer, input = self._transfer(adapter, input, input_ref, output_from)
            if on_dispatch is not None:
                on_dispatch(
                    lambda: self._cancel_invocation(run_uid, registration_id, invocation_id)
                )
            then = self._queueable(then, adapter, deadline)
            traceparent = ""
            if hop is not tracing.UNTRACED:  # not even its attributes on the untraced hot path
                traceparent = hop.delegate("worker", reg.spec.handler, {
                    "faas.trigger": "other",  # OpenTelemetry's FaaS span conventions
                    "faas.invocation_id": invocation_id,
                    tracing.RUNTIME: reg.adapter.runtime,
                })  # fmt: skip
            result = adapter.invoke(
                invocation_id, input, effective_deadline, traceparent, media, transfer, then
            )
            logs = result.logs
        except InvocationTimeout as exc:  # how long it had, which its caller can raise
            logs = exc.logs
            seconds = round(effective_deadline - began, 2)
            timed_out = InvocationTimeout(f"{exc} of {seconds:g} s")
            timed_out.logs, failure = logs, limits.bounded(str(timed_out))
            raise timed_out from None
        except AdapterError as exc:
            logs, failure = getattr(exc, "logs", ()), limits.bounded(str(exc))
            raise
        finally:
            # The input is the call's (an input's name only: never another call's result); the
            # output the caller's, but for what a worker that failed mid-call may have begun.
            if self.spool is not None and input_ref.startswith("in-"):
                self.spool.remove(input_ref)
            if self.spool is not None and transfer.output and result is None:
                self.spool.remove(transfer.output)
            hop.delegated(failure)
            with self._lock:
                reg.in_flight = 0
                reg.invocation_id = ""
                if reg.last_invocation_id:
                    reg.ended.append(reg.last_invocation_id)
                reg.last_invocation_id, reg.last_logs = invocation_id, logs
                reg.last_activity_unix_nano = time.time_ns()
                self._lock.notify_all()
        problem = limits.outputs_problem(result.outputs)
        error_type = "InvalidOutputs"
        if self.spool is not None and result.spooled > self.spool.max_bytes:
            error_type = OUTPUT_TOO_LARGE
            # As the adapter says it of a result past its bound inline: the same either way.
            problem = (
                f"the handler returned {result.spooled} bytes; the limit is {self.spool.max_bytes}"
            )
        if problem is not None:
            if result.spooled >= 0 and self.spool is not None:
                self.spool.remove(transfer.output)
            raise HandlerError(error_type, problem, result.logs)
        return InvocationOutcome(
            invocation_id, result, transfer.output if result.spooled >= 0 else ""
        )

    @staticmethod
    def _queueable(
        then: NextCall | None, adapter: Adapter, deadline: float | None
    ) -> NextCall | None:
        """`then` as the adapter takes it, if it can be queued: the adapter queues calls, and
        its fields pass the checks its own invoke will make."""
        if then is None or not adapter.queues_calls or len(then.payload) > QUEUED_MAX_BYTES:
            return None
        if not then.invocation_id:  # it is given one as it is invoked: not known yet
            return None
        try:
            invocation_id = limits.check_invocation_id(then.invocation_id)
            media = limits.check_content_type(
                then.content_type, adapter.content_types, adapter.runtime
            )
            timeout = limits.effective_timeout_millis(int(then.timeout * 1000)) / 1000
        except InvalidField:
            return None
        if deadline is not None:
            timeout = min(timeout, deadline - time.monotonic())
        return NextCall(invocation_id, then.payload, media, timeout, then.only_after_ok)

    def cancel_queued(self, run_uid: str, registration_id: str, invocation_id: str) -> None:
        """The call queued behind another as `invoke`'s `then` will not be invoked: cancel it
        (the worker may have begun it)."""
        with self._lock:
            reg = self._current.get(run_uid)
            if reg is None or reg.registration_id != registration_id:
                return
            if reg.invocation_id != invocation_id:
                reg.adapter.cancel(invocation_id)

    def _transfer(
        self, adapter: Adapter, input: bytes, input_ref: str, output_from: int
    ) -> tuple[Transfer, bytes]:
        """Where the call's input and output pass (``Transfer``), and its inline input: a
        spooled input is read into the frame for an adapter that takes no files."""
        if not input_ref and not output_from:
            return Transfer(), input
        if self.spool is None:
            raise InvalidField(INPUT_REF_KEY, "this Runtime Server keeps no spool of payloads")
        name_in = ""
        if input_ref:
            if input:
                raise InvalidField("input", f"must be empty when {INPUT_REF_KEY} names it")
            self.spool.path(input_ref, INPUT_REF_KEY)  # a payload's name, or refused so
            if not input_ref.startswith("in-"):  # another call's result is not an input
                raise InvalidField(
                    INPUT_REF_KEY, f"{input_ref} is an output's name, not an input's"
                )
            path, _ = self.spool.existing(input_ref, INPUT_REF_KEY)
            if adapter.takes_files:
                name_in = input_ref
            else:
                # Its frame carries it (bash's): one message's bound, whatever the spool's.
                inline = (
                    ' for this runtime, which takes its input inline (docs/protocol.md, "Limits")'
                )
                input = limits.check_input(path.read_bytes(), inline)
        takes = output_from > 0 and adapter.takes_files
        return Transfer(name_in, new_name("out") if takes else "", output_from), input

    def _cancel_invocation(self, run_uid: str, registration_id: str, invocation_id: str) -> None:
        """Cancel `invocation_id` if it is still the one in flight (a client went away)."""
        with self._lock:
            reg = self._current.get(run_uid)
            if reg is None or reg.registration_id != registration_id:
                return
            if reg.invocation_id == invocation_id:
                reg.adapter.cancel(invocation_id)

    # Live output (fnkernel's own: docs/protocol.md, "Live output")

    def follow(
        self,
        *,
        run_uid: str,
        registration_id: str,
        invocation_id: str,
        wait: float = limits.FOLLOW_WAIT_SECONDS,
        caller_there: Callable[[], bool] = lambda: True,
    ) -> tuple[str, bool, Iterator[list[LogLine]]]:
        """Follow one invocation's log lines: (its id, whether it is in flight, batches of lines).

        `invocation_id` empty: the call in flight, else the last one. Otherwise that call,
        waiting up to `wait` for it to start (a client follows a call it has just sent). The
        batches end when the call does — an empty one every LIVE_POLL_SECONDS while it prints
        nothing, so the caller can see its own client leave; a call that is over gives its
        result's lines at once. `caller_there()` ends the wait early when it turns false.
        """
        limits.check_run_uid(run_uid)
        limits.check_registration_id(registration_id)
        if invocation_id:
            limits.check_invocation_id(invocation_id)
        with self._lock:
            reg = self._lookup(run_uid, registration_id)
            if invocation_id:
                deadline = time.monotonic() + wait
                while (
                    invocation_id not in (reg.invocation_id, reg.last_invocation_id)
                    and invocation_id not in reg.ended
                    and (left := deadline - time.monotonic()) > 0
                    and caller_there()
                ):
                    self._lock.wait(min(left, LIVE_POLL_SECONDS))
            else:
                invocation_id = reg.invocation_id or reg.last_invocation_id
            if not invocation_id or invocation_id not in (
                reg.invocation_id,
                reg.last_invocation_id,
            ):
                if not invocation_id:
                    raise InvocationNotFound(
                        f"run {run_uid} has not been called since it registered: no call is "
                        "in flight, and there is no last one"
                    )
                over = "; it is over, and its lines are in its result" if (
                    invocation_id in reg.ended
                ) else ""  # fmt: skip
                raise InvocationNotFound(
                    f"run {run_uid} has {invocation_id} neither in flight nor as its last one{over}"
                )
            running = reg.invocation_id == invocation_id
        live = reg.adapter.follow(invocation_id) if running else None
        while running and live is None:  # accepted, not yet handed to its worker: a moment
            with self._lock:
                self._lock.wait(_DISPATCH_POLL_SECONDS)
                running = reg.invocation_id == invocation_id
            live = reg.adapter.follow(invocation_id) if running else None
        if live is None:
            return invocation_id, False, iter([list(self._ended_logs(reg, invocation_id))])

        def batches() -> Iterator[list[LogLine]]:
            index, done = 0, False
            while not done:
                lines, done = live.after(index)
                index += len(lines)
                yield lines

        return invocation_id, True, batches()

    def _ended_logs(self, reg: Registration, invocation_id: str) -> tuple[LogLine, ...]:
        """The lines of `invocation_id` once it is over (it may be ending just now)."""
        with self._lock:
            self._lock.wait_for(lambda: reg.invocation_id != invocation_id, timeout=5.0)
            return reg.last_logs if reg.last_invocation_id == invocation_id else ()

    # UnregisterFunction

    def unregister(
        self,
        *,
        run_uid: str,
        registration_id: str,
        cancel_in_flight: bool,
        drain_timeout_millis: int,
    ) -> None:
        limits.check_run_uid(run_uid)
        limits.check_registration_id(registration_id)
        limits.check_drain_timeout(drain_timeout_millis)
        with self._lock:
            reg = self._current.get(run_uid)
            if reg is None:
                return  # docs/protocol.md: unregistering an absent registration succeeds
            if reg.registration_id != registration_id:
                raise StaleRegistration(
                    f"registration_id {registration_id} is stale; the newer registration of run "
                    f"{run_uid} is untouched"
                )
            reg.state = DRAINING  # docs/protocol.md: first DRAINING, rejecting new invokes
            why = "its function was unregistered with cancel_in_flight"
            try:
                if not cancel_in_flight:
                    # docs/protocol.md: wait no longer than drain_timeout_millis for the active invocation.
                    self._lock.wait_for(lambda: reg.in_flight == 0, drain_timeout_millis / 1000)
                    why = (
                        f"its function was unregistered, and the drain of {drain_timeout_millis} "
                        "ms ran out"
                    )
            finally:
                # Whatever happened while draining, a DRAINING registration never stays behind.
                if self._current.get(run_uid) is reg:
                    del self._current[run_uid]
                    self._remember(run_uid, reg.attempt)
        self._release(reg, cancel=True, why=why)

    def stop_loading(self, *, run_uid: str, registration_attempt: int) -> bool:
        """Unregister, cancelling, the registration of `run_uid`'s `registration_attempt` if it
        is still loading (fnkernel.v1alpha1.Registrations/StopLoading: for a Run deleted while
        runtimed's RegisterFunction waits on a load that may never end). Whether one was."""
        limits.check_run_uid(run_uid)
        with self._lock:
            reg = self._current.get(run_uid)
            if reg is None or reg.attempt != registration_attempt or reg.state != REGISTERING:
                return False
            reg.state = DRAINING
            del self._current[run_uid]
            self._remember(run_uid, reg.attempt)
        self._release(reg, cancel=True, why="its function was deleted while it loaded")
        return True

    def _release(self, reg: Registration, *, cancel: bool, why: str = "") -> None:
        """Cancel what is in flight on `reg` (its caller told `why`), wait for it to unwind, and
        stop its worker."""
        if cancel:
            reg.adapter.cancel(why=why)
        with self._lock:
            self._lock.wait_for(lambda: reg.in_flight == 0, _CANCEL_SETTLE_SECONDS)
        reg.adapter.close()

    def _remember(self, run_uid: str, attempt: int) -> None:
        self._tombstones[run_uid] = max(attempt, self._tombstones.get(run_uid, 0))
        self._tombstones.move_to_end(run_uid)
        while len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    # Shutdown

    def shutdown(self) -> None:
        """Refuse new work, cancel what is still in flight and stop every worker.

        The drain happens before, in RuntimeServer.stop: gRPC's own graceful stop lets the
        calls in flight finish for the drain time; what outlives it is cancelled here."""
        with self._lock:
            self._shutting_down = True
            registrations = list(self._current.values())
            self._current.clear()
            for reg in registrations:
                reg.state = DRAINING  # a load that finishes now closes its worker
        for reg in registrations:
            self._release(reg, cancel=True)
