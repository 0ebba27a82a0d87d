"""The worker-process supervisor shared by every adapter (docs/protocol.md, "Adapters").

One registration owns one long-lived worker process, started at RegisterFunction so the handler is
imported (Python) or sourced (Bash) once. The supervisor spawns it in its own process group, frames
requests and responses over two private pipes, turns its stdout/stderr into structured log records,
and on cancellation or deadline kills the whole process group and starts a fresh worker in the
background so the registration stays READY.

Wire between supervisor and worker (the worker gets the two fd numbers as its last two arguments):

* request fd (worker reads): adapter-specific frames, each header ending in the call's *nonce*
  (16 random hex digits, new for every call).
* response fd (worker writes): first ``READY\\n``, or ``INITFAIL <errorType> <n>\\n`` followed by an
  n-byte message (no traceback); then adapter-specific responses, each header ending in the
  nonce of the call it answers. A header without this call's nonce — junk, or a frame a handler
  wrote to the worker's descriptor itself — is a corrupt worker: it is killed and replaced, and
  the call fails with CorruptResponse (``WorkerCall.read_header``). Without the nonce, one forged
  frame shifted every later answer by one call: each caller got the previous call's result.
* stdout and stderr: append-only files in the registration's scratch directory. After each call
  the supervisor reads what was appended, one log record per line (with a call queued behind it,
  only up to the sizes its answer gives: the worker may have begun the next call). Reading files after the call,
  rather than pumping pipes with threads, keeps the hot path free of thread wake-ups (docs/architecture.md, "Measured facts the design rests on"
  budgets a whole invoke at ~1.3x a bare gRPC echo); a worker must flush before it responds.

The process and its pipes are ``adapters/workerprocess.py``'s; those files, what one call may
log of them, and how a follower reads them while the call runs ``adapters/calllogs.py``'s;
which children are workers, and what a handler left behind, ``adapters/children.py``'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from fnkernel.adapters.calllogs import LiveLog, LogLine, kept_lines
from fnkernel.adapters.children import kill_orphans
from fnkernel.adapters.errors import (
    WORKER_CRASHED,
    CorruptResponse,
    HandlerError,
    InitError,
    InvalidInput,
    InvocationCancelled,
    InvocationTimeout,
    MemoryLimitExceeded,
    WorkerUnavailable,
    ran_out_of_memory,
)
from fnkernel.adapters.workerprocess import PIPE_SIZE, Worker, WorkerExited, describe_exit

LOG = logging.getLogger("fnkernel.function")
T = TypeVar("T")


@dataclass
class WorkerCall:
    """One invocation in progress on a worker: frame I/O bounded by the invocation deadline."""

    worker: Worker
    invocation_id: str
    deadline: float
    run_uid: str
    # Unguessable, new for every call: the worker echoes it in the answer's header.
    nonce: bytes = field(default_factory=lambda: os.urandom(8).hex().encode())
    traceparent: bytes = b""  # a traced call's W3C context, for the handler
    logs: list[LogLine] = field(default_factory=list)
    # A call queued behind this one (``Behind``): its frame, sent after this one's, whether the
    # worker runs it only if this one answers ok, and its WorkerCall — None once the worker
    # skipped it. Where this call's lines end in the log files, as its answer says.
    then: bytes = b""
    then_if_ok: bool = False
    behind: WorkerCall | None = None
    log_ends: dict[str, int] | None = None
    queued: bool = False  # its frame went to the worker behind the call before it
    logs_final: bool = False  # the worker is gone (its log files may be closed): logs are complete
    live: LiveLog | None = None  # made by its first follower
    _ended: bool = False  # its logs were collected: nobody may start following it now
    _live_lock: threading.Lock = field(default_factory=threading.Lock)

    def live_log(self) -> LiveLog | None:
        """This call's LiveLog, made now if nobody followed it yet; None once it is over."""
        with self._live_lock:
            if self._ended:
                return None
            if self.live is None:
                # With a call queued behind it, the files may already hold that call's first
                # lines once the worker has answered: read no further than before the answer.
                self.live = LiveLog(self.worker.log_files, self._settled)
            return self.live

    def _settled(self) -> bool:
        """Whether the log files hold only this call's lines yet: nothing queued behind it, or
        its answer not yet written (the worker begins the next call once it has answered)."""
        worker = self.worker
        return self.behind is None or not (
            worker.answering or select.select([worker.resp], [], [], 0)[0]
        )

    def send(self, data: bytes | memoryview) -> None:
        self.worker.send(data)

    def read_line(self) -> bytes:
        return self.worker.read_line(self.deadline)

    def read_header(self, fields: int) -> list[bytes]:
        """The answer's header line: its `fields` space-separated fields before the nonce.
        CorruptResponse unless it has exactly those and ends in this call's nonce."""
        line = self.read_line()
        *values, nonce = line.split(b" ")
        if len(values) != fields or nonce != self.nonce:
            shown = line[:60].decode("ascii", "backslashreplace")
            raise CorruptResponse(f"its header was {shown!r}")
        return values

    def read_exact(self, size: int) -> bytes:
        return self.worker.read_exact(size, self.deadline)

    def skip(self, size: int) -> None:
        """Read and drop `size` bytes (an oversized output) to keep the frame stream in step."""
        while size > 0:
            chunk = min(size, PIPE_SIZE)
            self.read_exact(chunk)
            size -= chunk

    def collect_logs(self, *, final: bool = False) -> list[LogLine]:
        """Take what the handler logged so far into this call's logs; returns all of them."""
        if self.logs_final:
            return self.logs
        self.logs_final = final
        with self._live_lock:
            self._ended = True
            live = self.live
        # A call behind it may be running: its lines are where this one's answer says they end.
        ends = None if final or self.behind is None else self.log_ends
        if live is not None:  # before LogFiles.read, which may rotate the files it reads
            live.finish(ends)
        fresh = self.worker.log_files.read(ends)
        self.logs = kept_lines(self.logs + fresh)
        for line in fresh:
            LOG.info(
                line.text,
                extra={
                    "run_uid": self.run_uid,
                    "invocation_id": self.invocation_id,
                    "stream": line.stream,
                },
            )
        return self.logs

    def remaining_millis(self) -> int:
        return max(0, int((self.deadline - time.monotonic()) * 1000))


@dataclass(frozen=True)
class Behind:
    """The call to queue behind one about to run (adapters/base.py, ``NextCall``): its
    invocation id, its timeout from when it begins, its request frame given its WorkerCall,
    and whether the worker runs it only if the call before it answers ok."""

    invocation_id: str
    timeout: float
    frame: Callable[[WorkerCall], bytes]
    only_after_ok: bool


class WorkerSupervisor:
    """Keeps exactly one ready worker for a registration and runs one call at a time on it.

    A call may be queued behind the one running (``run``'s `behind`): its frame waits in the
    worker's request pipe, and the worker begins it as soon as it has answered. It is then the
    next call begun; any other call, or a cancel of it, kills the worker that holds it."""

    def __init__(
        self,
        *,
        argv: Sequence[str],
        cwd: Path,
        env: Mapping[str, str],
        run_uid: str,
        scratch: Path,
        memory_bytes: int = 0,
        init_timeout: float = 60.0,
        on_fatal: Callable[[InitError], None] | None = None,
    ) -> None:
        self._argv = list(argv)
        self._cwd = cwd
        self._env = dict(env)
        self._run_uid = run_uid
        self._scratch = scratch
        self._memory_bytes = memory_bytes
        self._init_timeout = init_timeout
        self._on_fatal = on_fatal
        self._lock = threading.Condition()
        self._worker: Worker | None = None
        self._current: WorkerCall | None = None
        self._queued: WorkerCall | None = None  # its frame is in the worker's pipe
        self._cancelled = False
        self._cancel_pending: str | None = None
        self._cancel_why = ""  # what cancelled the call in flight, for its caller
        self._closed = False
        self._fatal: InitError | None = None
        self._loading: set[Worker] = set()  # workers spawned, not yet READY

    # Life cycle

    def start(self) -> None:
        """Spawn the first worker and wait for its handshake; raise InitError on failure."""
        worker = self._spawn()
        with self._lock:
            if self._closed:
                worker.reap()
                raise InvocationCancelled("the registration was closed while it was loading")
            self._worker = worker
            self._lock.notify_all()

    def _spawn(self) -> Worker:
        worker = Worker(self._argv, self._cwd, self._env, self._scratch, self._memory_bytes)
        with self._lock:
            self._loading.add(worker)  # close() kills it: a load can hang for good
            closed = self._closed
        try:
            if closed:
                worker.kill()
            worker.wait_ready(time.monotonic() + self._init_timeout)
        except InitError:
            self._log_init(worker)
            worker.reap()
            raise
        finally:
            with self._lock:
                self._loading.discard(worker)
        self._log_init(worker)
        return worker

    def _log_init(self, worker: Worker) -> None:
        """What the handler printed while loading goes to the server log, without an invocation."""
        for line in worker.log_files.read():
            LOG.info(line.text, extra={"run_uid": self._run_uid, "stream": line.stream})

    def close(self) -> None:
        """Kill the worker (and any call on it); idempotent."""
        with self._lock:
            self._closed = True
            worker, self._worker = self._worker, None
            current, self._queued = self._current, None
            loading = list(self._loading)
            self._lock.notify_all()
        for each in loading:  # its _spawn reaps it, seeing it exit
            each.kill()
        if current is not None:
            self._cancelled = True
            current.worker.kill()
        if worker is not None:
            worker.reap()
        kill_orphans(self._run_uid)  # what its handler left running outside its process group

    def cancel(self, invocation_id: str | None = None, *, why: str = "") -> bool:
        """Kill the call in flight (docs/protocol.md, "Adapters": within 100 ms); returns whether one was killed.
        Its caller is told it was cancelled, and `why` if given.

        With an `invocation_id`, only that call is cancelled; if it has not reached the worker yet
        it is remembered and refused when it arrives (a client may cancel before dispatch).
        """
        with self._lock:
            current, queued = self._current, self._queued
            if current is None and queued and invocation_id in (None, queued.invocation_id):
                self._drop(queued)  # the worker has begun it, or will as it reads its frame
                return True
            if current is None or (invocation_id and current.invocation_id != invocation_id):
                self._cancel_pending = invocation_id
                return False
            self._cancelled, self._cancel_why = True, why
        current.worker.kill()
        return True

    def follow(self, invocation_id: str) -> LiveLog | None:
        """The LiveLog of `invocation_id` while it is the call in flight; None otherwise."""
        with self._lock:
            current = self._current
        if current is None or current.invocation_id != invocation_id:
            return None
        return current.live_log()

    # Invocations

    def run(
        self,
        invocation_id: str,
        deadline: float,
        exchange: Callable[[WorkerCall], T],
        ended: Callable[[WorkerCall, int], T] | None = None,
        *,
        traceparent: str = "",
        behind: Behind | None = None,
    ) -> tuple[T, WorkerCall]:
        """Run `exchange` (one request/response) on the ready worker; translate its death, the
        deadline and cancellation. Returns its result and the WorkerCall, whose logs are complete.

        A worker that exits mid-call (not cancelled) is replaced; `ended(call, exit code)` then
        makes the call's result or raises its HandlerError (default: WorkerCrashed).
        `behind`: a call to queue behind this one (class docstring), unless the log files are
        due to be rotated (they are read only to this call's end while one is queued).
        """
        call = self._begin(invocation_id, deadline)
        call.traceparent = traceparent.encode()
        worker = call.worker
        queued = None
        if behind is not None and worker.log_files.below_rotation():
            timeout = time.monotonic() + behind.timeout
            queued = WorkerCall(worker, behind.invocation_id, timeout, self._run_uid, queued=True)
            call.then, call.then_if_ok = behind.frame(queued), behind.only_after_ok
            call.behind = queued
            with self._lock:
                self._queued = queued
        try:
            result = exchange(call)
        except (HandlerError, InvalidInput) as exc:
            # A complete response that reports a failure: the worker is fine, unless the failure
            # says otherwise (CorruptResponse: its frames are out of step; MemoryLimitExceeded).
            if isinstance(exc, HandlerError) and exc.spoils_worker:
                self._replace(worker, call)
            exc.logs = tuple(call.collect_logs())
            raise
        except TimeoutError:
            self._replace(worker, call)
            raise _timed_out(call) from None
        except WorkerExited:
            # EOF also comes from a worker that exec'd the handler's last command (which closed
            # the frame pipes): it is still the call, so it gets the rest of the deadline.
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(max(0.0, deadline - time.monotonic()))
            timed_out = worker.proc.poll() is None
            cancelled = self._cancelled
            self._replace(worker, call)
            if cancelled:
                why = f": {self._cancel_why}" if self._cancel_why else ""
                cut_off = InvocationCancelled(f"the invocation was cancelled{why}")
                cut_off.logs = tuple(call.logs)  # what the handler wrote until then
                raise cut_off from None
            if timed_out:
                raise _timed_out(call) from None
            code = worker.proc.wait()
            stderr = [line.text for line in call.logs if line.stream == "stderr"]
            if worker.memory_bytes and code > 0 and ran_out_of_memory(stderr):
                # A native library that exits when an allocation fails (numpy's OpenBLAS).
                ran_out = MemoryLimitExceeded(worker.memory_bytes >> 20)
                ran_out.logs = tuple(call.logs)
                raise ran_out from None
            if ended is None:
                raise HandlerError(
                    WORKER_CRASHED,
                    f"the worker process ended mid-call ({describe_exit(code)})",
                    tuple(call.logs),
                ) from None
            try:
                return ended(call, code), call  # its logs were collected by _replace
            except HandlerError as exc:
                exc.logs = tuple(call.logs)
                raise exc from None
        except BaseException:
            self._replace(worker, call)  # the frame stream may be out of step: never reuse it
            raise
        finally:
            with self._lock:
                self._current = None
                if queued is not None and call.behind is None and self._queued is queued:
                    self._queued = None  # the worker skipped it (``WorkerCall.behind``)
                # A cancel that came as the call ended (its answer read, or its failure) killed
                # the worker all the same, maybe after this: it serves no other call.
                killed = self._cancelled and self._worker is worker
                self._lock.notify_all()
            if killed:
                self._replace(worker, call)
        call.collect_logs()
        return result, call

    def _begin(self, invocation_id: str, deadline: float) -> WorkerCall:
        """Claim the ready worker for one call (waiting, bounded, for a replacement to load):
        the call queued behind the last, if it is that one."""
        with self._lock:
            queued, self._queued = self._queued, None
            if queued is not None and (
                queued.invocation_id != invocation_id or queued.worker is not self._worker
            ):
                self._drop(queued)  # another call comes first
                queued = None
            if self._worker is None and not self._closed and self._fatal is None:
                self._lock.wait_for(
                    lambda: self._worker is not None or self._closed or self._fatal is not None,
                    timeout=max(0.0, deadline - time.monotonic()),
                )
            if self._closed:
                raise InvocationCancelled("the registration is being removed")
            if self._fatal is not None:
                raise WorkerUnavailable(f"the worker could not be restarted: {self._fatal}")
            if self._worker is None:
                raise InvocationTimeout("no worker became ready before the deadline")
            assert self._current is None, "the registry allows one call in flight"
            pending, self._cancel_pending = self._cancel_pending, None
            if pending is not None and pending == invocation_id:
                if queued is not None:
                    self._drop(queued)  # cancelled while its frame waited: it goes with it
                raise InvocationCancelled("the invocation was cancelled")
            self._cancelled, self._cancel_why = False, ""
            self._worker.answering = False
            if queued is not None:
                queued.deadline = deadline  # its own, from now
                self._current = queued
            else:
                self._current = WorkerCall(self._worker, invocation_id, deadline, self._run_uid)
            return self._current

    def _drop(self, queued: WorkerCall) -> None:
        """With the lock held: kill the worker holding `queued`, a call queued behind another
        that will not be the next one begun, and bring up a fresh one."""
        old = queued.worker
        old.kill()
        if self._worker is old:
            self._worker = None
            threading.Thread(target=self._respawn, args=(old,), daemon=True).start()

    def _replace(self, old: Worker, call: WorkerCall) -> None:
        """Kill `old` now and bring up a fresh worker in the background (docs/protocol.md, "Adapters")."""
        old.kill()
        with contextlib.suppress(OSError):
            call.collect_logs(final=True)
        with self._lock:
            if self._worker is old:
                self._worker = None
            if self._queued is not None and self._queued.worker is old:
                self._queued = None  # its frame went with the worker: it is sent afresh
        threading.Thread(target=self._respawn, args=(old,), daemon=True).start()

    def _respawn(self, old: Worker) -> None:
        old.reap()
        with self._lock:
            if self._closed:
                return
        try:
            worker = self._spawn()
        except InitError as exc:
            with self._lock:
                self._fatal = exc
                self._lock.notify_all()
            if self._on_fatal is not None:
                self._on_fatal(exc)
            return
        except OSError:
            with self._lock:
                if self._closed:
                    return  # closed meanwhile: its scratch dir (the log files) is gone
            raise
        with self._lock:
            if not self._closed:
                self._worker = worker
                self._lock.notify_all()
                return
        worker.reap()


def _timed_out(call: WorkerCall) -> InvocationTimeout:
    """The deadline passed: what the handler wrote until then goes with the error (its worker
    was replaced, which collected them)."""
    exc = InvocationTimeout("the handler exceeded its deadline")
    exc.logs = tuple(call.logs)
    return exc
