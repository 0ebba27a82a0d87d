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
  the supervisor reads what was appended, one log record per line. Reading files after the call,
  rather than pumping pipes with threads, keeps the hot path free of thread wake-ups (docs/architecture.md, "Measured facts the design rests on"
  budgets a whole invoke at ~1.3x a bare gRPC echo); a worker must flush before it responds.

While a call runs, whoever follows it (docs/protocol.md, "Live output") reads the same files with
``LiveLog``: only then, and on the follower's thread, so a call nobody follows costs nothing more
and the handler never waits for a reader.

What one call may log is bounded (docs/protocol.md, "Limits"): of each stream, the first and the
last half MiB and at most 10,000 lines are kept — read in two bounded reads, never the whole
file — with one line between them saying how much was dropped. On disk, ``trim_logs`` (the
server's reaper, every second) frees what lies between those halves while the call runs, so a
call that prints without end takes its 1 MiB plus what it wrote in the last second.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import logging
import os
import select
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from fnkernel.adapters.errors import (
    INITIALIZATION_ERROR,
    INITIALIZATION_TIMEOUT,
    WORKER_CRASHED,
    WORKER_KILLED,
    CorruptResponse,
    HandlerError,
    InitError,
    InvalidInput,
    InvocationCancelled,
    InvocationTimeout,
    WorkerUnavailable,
)
from fnkernel.system.procfs import proc_stat

LOG = logging.getLogger("fnkernel.function")
T = TypeVar("T")
STREAMS = ("stdout", "stderr")
_PIPE_SIZE = 1 << 20  # fewer wakeups for multi-MiB payloads; best effort (F_SETPIPE_SZ)
# A read allocates all it asks for: 1 MiB cost ~15 us a call, 64 KiB under 1 us. So a read asks
# for what the frame still needs, at least this much and at most _PIPE_SIZE.
_MIN_READ = 1 << 16
_F_SETPIPE_SZ = 1031
_MAX_LOG_LINES = 256  # per call, the last ones, kept for the caller's trailer
_MAX_LOG_LINE = 4096
_ROTATE_LOG_BYTES = 8 << 20
CALL_LOG_BYTES = 1 << 20  # of each stream, per call: what goes to the server log and memory
CALL_LOG_LINES = 10_000  # of each stream, per call
# What one call's live stream carries, both streams together: a quarter of what a call keeps of
# each stream, so it never reaches what trim_logs frees while the call runs.
LIVE_LOG_BYTES = 256 << 10
LIVE_POLL_SECONDS = 0.05  # how often a follower looks for new lines
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_BLOCK = 4096

RUN_UID_ENV = "FNKERNEL_RUN_UID"  # in every worker's environment, and so its descendants'
# Every worker pid this process spawned and has not yet waited for. The orphan reaper must never
# reap these: their Popen objects own their exit status.
_spawn_lock = threading.Lock()
_live_pids: set[int] = set()
_live_workers: weakref.WeakSet[Worker] = weakref.WeakSet()  # whose log files trim_logs bounds


@dataclass(frozen=True)
class LogLine:
    stream: str
    text: str
    cut: bool = False  # the line saying a live stream stops here (LiveLog)


def _log_line(stream: str, raw: bytes) -> LogLine:
    return LogLine(stream, raw[:_MAX_LOG_LINE].decode("utf-8", "replace"))


class LiveLog:
    """One call's log lines as its handler writes them, for those who follow the call.

    Made by the first follower (``WorkerCall.live_log``); the reads are the followers', every
    LIVE_POLL_SECONDS at most, and once the call's own as it ends (``finish``: the last lines,
    an unterminated one included, before the log files may be rotated). The lines are kept in
    order of reading — within a stream, as written — up to LIVE_LOG_BYTES, where one line says
    that the stream stops there.
    """

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._positions = dict(worker.log_offsets)  # where this call's lines begin
        self._partial = dict.fromkeys(STREAMS, b"")
        self._read_bytes = 0
        self._cond = threading.Condition()
        self.lines: list[LogLine] = []
        self.cut = False  # LIVE_LOG_BYTES reached: no more lines will come
        self.done = False  # the call is over: no more lines will come

    def after(self, index: int, wait: float = LIVE_POLL_SECONDS) -> tuple[list[LogLine], bool]:
        """The lines from `index` on, waiting up to `wait` for some, and whether they are the
        last (the call is over)."""
        with self._cond:
            if not self.done and len(self.lines) <= index:
                self._read(final=False)
                if len(self.lines) <= index and wait > 0:
                    self._cond.wait(wait)  # finish() wakes it
                    if not self.done:
                        self._read(final=False)
            return self.lines[index:], self.done

    def finish(self) -> None:
        """The call is over: read what is left, and wake the followers."""
        with self._cond:
            if not self.done:
                self._read(final=True)
                self.done = True
                self._cond.notify_all()

    def _read(self, *, final: bool) -> None:
        if self.cut:
            return
        worker = self._worker
        with worker._logs_lock:
            if worker._logs_closed:
                return
            for stream, fd in worker.logs.items():
                position = self._positions[stream]
                size = os.lseek(fd, 0, os.SEEK_END)
                budget = LIVE_LOG_BYTES - self._read_bytes
                if size > position and budget <= 0:
                    self._stop_here()
                    return
                wanted = min(size - position, budget)
                chunk = os.pread(fd, wanted, position) if wanted > 0 else b""
                position = self._positions[stream] = position + len(chunk)
                self._read_bytes += len(chunk)
                *complete, partial = (self._partial[stream] + chunk).split(b"\n")
                self.lines += [_log_line(stream, raw) for raw in complete]
                if position < size:  # the budget ran out within this read
                    self._stop_here()
                    return
                if final and partial:  # the call is over: its last line has no newline
                    self.lines.append(_log_line(stream, partial))
                    partial = b""
                self._partial[stream] = partial

    def _stop_here(self) -> None:
        self.cut = True
        self.lines.append(
            LogLine(
                "stderr",
                f"[fnkernel: live output stops after {LIVE_LOG_BYTES >> 10} KiB; "
                "the call's last lines come with its result]",
                cut=True,
            )
        )


class _WorkerExited(Exception):
    """The worker died (killed by us, or crashed): its process exited, or its response pipe
    reached EOF."""


class Worker:
    """One live worker process with its two frame pipes and two log files."""

    def __init__(
        self, argv: Sequence[str], cwd: Path, env: Mapping[str, str], scratch: Path
    ) -> None:
        req_r, self.req = os.pipe()
        self.resp, resp_w = os.pipe()
        for fd in (req_r, resp_w):
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_SIZE)
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
        self.logs = {
            stream: os.open(scratch / f"worker.{stream}", flags, 0o600) for stream in STREAMS
        }
        self.log_offsets = dict.fromkeys(STREAMS, 0)  # what read_logs has read
        self._logs_lock = threading.Lock()  # trim_logs never touches a descriptor reap closed
        self._logs_closed = False
        try:
            with _spawn_lock:
                self.proc = subprocess.Popen(
                    [*argv, str(req_r), str(resp_w)],
                    cwd=cwd,
                    env=dict(env),
                    stdin=subprocess.DEVNULL,
                    stdout=self.logs["stdout"],
                    stderr=self.logs["stderr"],
                    pass_fds=(req_r, resp_w),
                    start_new_session=True,  # its own process group: killpg reaches the handler's children
                )
                _live_pids.add(self.proc.pid)
                _live_workers.add(self)
        finally:
            os.close(req_r)
            os.close(resp_w)
        # The worker's exit is seen on its pidfd, not only as EOF on the response pipe: a child
        # the handler left running keeps the pipe open after the worker itself is gone.
        self.pidfd = os.pidfd_open(self.proc.pid)
        self._buf = bytearray()

    # Frame I/O. Reads honour the deadline; a worker that dies gives EOF (_WorkerExited).

    def send(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        try:
            while view:
                written = os.write(self.req, view)
                view = view[written:]
        except OSError as exc:  # EPIPE: it is gone
            raise _WorkerExited() from exc

    def _fill(self, deadline: float, wanted: int = 0) -> None:
        """Read what the worker has written (`wanted`: the bytes the frame still needs)."""
        remaining = deadline - time.monotonic()
        ready = select.select([self.resp, self.pidfd], [], [], max(0.0, remaining))[0]
        if self.resp not in ready:
            if not ready:
                raise TimeoutError
            # It exited. Everything it wrote before is in the pipe already: take that first.
            if not select.select([self.resp], [], [], 0)[0]:
                raise _WorkerExited()
        chunk = os.read(self.resp, min(max(wanted, _MIN_READ), _PIPE_SIZE))
        if not chunk:
            raise _WorkerExited()
        self._buf += chunk

    def read_line(self, deadline: float) -> bytes:
        while (end := self._buf.find(b"\n")) < 0:
            self._fill(deadline)
        line = bytes(self._buf[:end])
        del self._buf[: end + 1]
        return line

    def read_exact(self, size: int, deadline: float) -> bytes:
        while len(self._buf) < size:
            self._fill(deadline, size - len(self._buf))
        data = bytes(self._buf[:size])
        del self._buf[:size]
        return data

    def wait_ready(self, deadline: float) -> None:
        """Read the start-up handshake; raise InitError if the handler could not be loaded."""
        try:
            line = self.read_line(deadline)
            if line == b"READY":
                return
            kind, *rest = line.split(b" ")
            if kind == b"INITFAIL" and len(rest) == 2:
                message = self.read_exact(int(rest[1]), deadline)
                raise InitError(rest[0].decode(), message.decode("utf-8", "replace").strip())
            raise InitError(INITIALIZATION_ERROR, f"unexpected worker handshake {line[:80]!r}")
        except TimeoutError:
            self.kill()
            raise InitError(
                INITIALIZATION_TIMEOUT, "the handler did not finish loading in time"
            ) from None
        except _WorkerExited:
            code = self.proc.wait()
            # Killed by a signal is the platform's doing (OOM killer, an operator): runtimed
            # retries WorkerKilled; an exit status is the handler's own and is final.
            error_type = WORKER_KILLED if code < 0 else INITIALIZATION_ERROR
            raise InitError(
                error_type, f"the handler exited while loading ({describe_exit(code)})"
            ) from None

    def read_logs(self) -> list[LogLine]:
        """The lines appended to stdout/stderr since the last read, bounded (module docstring).
        Everything appended counts as read, a last line without its newline included: the call
        it belongs to is over, and a partial line left behind would be read again by every
        later call."""
        lines: list[LogLine] = []
        for stream, fd in self.logs.items():
            offset = self.log_offsets[stream]
            # The file's size: a quarter of what os.fstat costs, and this runs twice a call. The
            # worker's writes are O_APPEND and ours are preads, so the offset moved is no one's.
            size = os.lseek(fd, 0, os.SEEK_END)
            if size <= offset:
                continue
            lines += _bounded_lines(stream, fd, offset, size)
            self.log_offsets[stream] = size
            if size > _ROTATE_LOG_BYTES:
                os.ftruncate(fd, 0)  # O_APPEND: the worker's next write lands at offset 0
                self.log_offsets[stream] = 0
        return lines

    def trim_logs(self) -> None:
        """Free on disk what a call in progress appended beyond what ``read_logs`` will keep of
        it: the middle, between its first and last half MiB (a hole: the file keeps its size)."""
        half = CALL_LOG_BYTES // 2
        with self._logs_lock:
            if self._logs_closed:
                return
            for stream, fd in self.logs.items():
                offset = self.log_offsets[stream]
                size = os.lseek(fd, 0, os.SEEK_END)
                start = -(-(offset + half) // _BLOCK) * _BLOCK
                end = (size - half) // _BLOCK * _BLOCK
                if end - start >= CALL_LOG_BYTES:  # not for every block: once it is worth it
                    _punch_hole(fd, start, end - start)

    def kill(self) -> None:
        """SIGKILL the worker's process group: the worker and everything its handler started."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def reap(self) -> None:
        """Kill, wait for the exit status and release the pipes and log files."""
        self.kill()
        self.proc.wait()
        with _spawn_lock:
            _live_pids.discard(self.proc.pid)
        with self._logs_lock:
            self._logs_closed = True
            for fd in (self.req, self.resp, self.pidfd, *self.logs.values()):
                with contextlib.suppress(OSError):
                    os.close(fd)


def _bounded_lines(stream: str, fd: int, offset: int, size: int) -> list[LogLine]:
    """The lines of `fd` between `offset` and `size`, keeping the first and the last half of
    CALL_LOG_BYTES and of CALL_LOG_LINES, and between them one line saying what was dropped."""
    appended = size - offset
    half = CALL_LOG_BYTES // 2
    if appended <= CALL_LOG_BYTES:
        head, tail = os.pread(fd, appended, offset), b""
    else:  # two bounded reads, cut at the line ends nearest the middle
        head, tail = os.pread(fd, half, offset), os.pread(fd, half, size - half)
        head = head[: head.rfind(b"\n") + 1] or head
        start = tail.find(b"\n") + 1
        tail = tail[start:] if 0 < start < len(tail) else tail
    dropped = appended - len(head) - len(tail)
    first, last = head.splitlines(), tail.splitlines()
    lines_dropped = len(first) + len(last) - CALL_LOG_LINES
    if lines_dropped > 0:
        every = first + last
        keep = CALL_LOG_LINES // 2
        dropped += sum(len(raw) + 1 for raw in every[keep:-keep])
        first, last = every[:keep], every[-keep:]
    lines = [_log_line(stream, raw) for raw in first]
    if dropped:
        what = f"{dropped} bytes" + (f" ({lines_dropped} lines)" if lines_dropped > 0 else "")
        limit = f"the first and last {half >> 10} KiB and {CALL_LOG_LINES} lines of each stream"
        lines.append(
            LogLine(stream, f"[fnkernel: {what} of {stream} dropped: a call keeps {limit}]")
        )
    lines += [_log_line(stream, raw) for raw in last]
    return lines


def _punch_hole(fd: int, offset: int, length: int) -> None:
    """Deallocate a range of `fd` (``fallocate(PUNCH_HOLE)``); on a file system that cannot,
    nothing happens, and the call's logs stay bounded in memory only."""
    libc = _libc()
    if libc is not None:
        libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    except (OSError, AttributeError):
        return None
    return libc


def trim_logs() -> None:
    """``Worker.trim_logs`` for every live worker of this process (the reaper calls it)."""
    for worker in list(_live_workers):
        with contextlib.suppress(OSError):
            worker.trim_logs()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit status {code}"


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
                self.live = LiveLog(self.worker)
            return self.live

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
            chunk = min(size, _PIPE_SIZE)
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
        if live is not None:  # before read_logs, which may rotate the files it reads
            live.finish()
        fresh = self.worker.read_logs()
        self.logs = (self.logs + fresh)[-_MAX_LOG_LINES:]  # the caller's trailer keeps the last
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


class WorkerSupervisor:
    """Keeps exactly one ready worker for a registration and runs one call at a time on it."""

    def __init__(
        self,
        *,
        argv: Sequence[str],
        cwd: Path,
        env: Mapping[str, str],
        run_uid: str,
        scratch: Path,
        init_timeout: float = 60.0,
        on_fatal: Callable[[InitError], None] | None = None,
    ) -> None:
        self._argv = list(argv)
        self._cwd = cwd
        self._env = dict(env)
        self._run_uid = run_uid
        self._scratch = scratch
        self._init_timeout = init_timeout
        self._on_fatal = on_fatal
        self._lock = threading.Condition()
        self._worker: Worker | None = None
        self._current: WorkerCall | None = None
        self._cancelled = False
        self._cancel_pending: str | None = None
        self._closed = False
        self._fatal: InitError | None = None

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
        worker = Worker(self._argv, self._cwd, self._env, self._scratch)
        try:
            worker.wait_ready(time.monotonic() + self._init_timeout)
        except InitError:
            self._log_init(worker)
            worker.reap()
            raise
        self._log_init(worker)
        return worker

    def _log_init(self, worker: Worker) -> None:
        """What the handler printed while loading goes to the server log, without an invocation."""
        for line in worker.read_logs():
            LOG.info(line.text, extra={"run_uid": self._run_uid, "stream": line.stream})

    def close(self) -> None:
        """Kill the worker (and any call on it); idempotent."""
        with self._lock:
            self._closed = True
            worker, self._worker = self._worker, None
            current = self._current
            self._lock.notify_all()
        if current is not None:
            self._cancelled = True
            current.worker.kill()
        if worker is not None:
            worker.reap()
        kill_orphans(self._run_uid)  # what its handler left running outside its process group

    def cancel(self, invocation_id: str | None = None) -> bool:
        """Kill the call in flight (docs/protocol.md, "Adapters": within 100 ms); returns whether one was killed.

        With an `invocation_id`, only that call is cancelled; if it has not reached the worker yet
        it is remembered and refused when it arrives (a client may cancel before dispatch).
        """
        with self._lock:
            current = self._current
            if current is None or (invocation_id and current.invocation_id != invocation_id):
                self._cancel_pending = invocation_id
                return False
            self._cancelled = True
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
    ) -> tuple[T, WorkerCall]:
        """Run `exchange` (one request/response) on the ready worker; translate its death, the
        deadline and cancellation. Returns its result and the WorkerCall, whose logs are complete.

        A worker that exits mid-call (not cancelled) is replaced; `ended(call, exit code)` then
        makes the call's result or raises its HandlerError (default: WorkerCrashed).
        """
        call = self._begin(invocation_id, deadline)
        call.traceparent = traceparent.encode()
        worker = call.worker
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
        except _WorkerExited:
            # EOF also comes from a worker that exec'd the handler's last command (which closed
            # the frame pipes): it is still the call, so it gets the rest of the deadline.
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(max(0.0, deadline - time.monotonic()))
            timed_out = worker.proc.poll() is None
            cancelled = self._cancelled
            self._replace(worker, call)
            if cancelled:
                cut_off = InvocationCancelled("the invocation was cancelled")
                cut_off.logs = tuple(call.logs)  # what the handler wrote until then
                raise cut_off from None
            if timed_out:
                raise _timed_out(call) from None
            code = worker.proc.wait()
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
                self._lock.notify_all()
        call.collect_logs()
        return result, call

    def _begin(self, invocation_id: str, deadline: float) -> WorkerCall:
        """Claim the ready worker for one call (waiting, bounded, for a replacement to load)."""
        with self._lock:
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
                raise InvocationCancelled("the invocation was cancelled")
            self._cancelled = False
            self._current = WorkerCall(self._worker, invocation_id, deadline, self._run_uid)
            return self._current

    def _replace(self, old: Worker, call: WorkerCall) -> None:
        """Kill `old` now and bring up a fresh worker in the background (docs/protocol.md, "Adapters")."""
        old.kill()
        with contextlib.suppress(OSError):
            call.collect_logs(final=True)
        with self._lock:
            if self._worker is old:
                self._worker = None
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


def reap_orphans() -> int:
    """Reap zombie children this process did not spawn itself (docs/architecture.md, "Measured facts the design rests on").

    The Runtime Server is a child subreaper, so a handler's killed grandchildren are reparented to
    it. Only our own children are looked at, not all of /proc: this runs every second beside the
    calls. Returns how many were reaped.
    """
    reaped = 0
    with _spawn_lock:
        for pid in _children():
            if pid in _live_pids:
                continue
            try:
                fields = proc_stat(pid)
            except OSError:
                continue
            if fields and fields[0] == "Z":
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                    reaped += 1
    return reaped


def kill_orphans(run_uid: str | None = None) -> int:
    """SIGKILL what handlers left behind by leaving their worker's process group (``setsid()``
    and a second fork): in a Runtime Server, a child subreaper, such a process is reparented to
    us, and it is our child but no worker of ours. With `run_uid`, only those whose environment
    names that Run (``FNKERNEL_RUN_UID``, which every worker's descendants inherit): a
    registration's end. Without, every such child: for a ``fnkernel serve`` process that is
    stopping, whose children are its workers and nothing else. Rounds repeat while killing one
    brings its own children to us (at most 5). Returns how many were killed."""
    killed = 0
    for _ in range(5):
        with _spawn_lock:
            left = [pid for pid in _children() if pid not in _live_pids and _left_by(pid, run_uid)]
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        if not left:
            break
        time.sleep(0.01)  # their children, if any, are reparented to us meanwhile
    # Not reaped here: in a Runtime Server the reaper does it within a second, and in any other
    # process (an in-process server, in the tests) a child's exit status is its Popen's.
    return killed


def _left_by(pid: int, run_uid: str | None) -> bool:
    """Whether child `pid` (not a worker) is a handler's leftover for `run_uid` (None: any)."""
    try:
        if proc_stat(pid)[0] in ("Z", "X"):
            return False  # gone already: the reaper's
        if run_uid is None:
            return True
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (OSError, IndexError):
        return False
    return f"{RUN_UID_ENV}={run_uid}".encode() in environ


def _children() -> set[int]:
    """This process's children: those of each of its threads (``/proc/self/task/*/children``),
    or, where the kernel does not list them, every process whose parent we are."""
    found: set[int] = set()
    listed = False
    for task in os.scandir("/proc/self/task"):
        try:
            found.update(int(pid) for pid in Path(task.path, "children").read_text().split())
            listed = True
        except OSError:
            continue
    if listed:
        return found
    me = str(os.getpid())
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if proc_stat(entry.name)[1:2] == [me]:
                    found.add(int(entry.name))
    return found


def _timed_out(call: WorkerCall) -> InvocationTimeout:
    """The deadline passed: what the handler wrote until then goes with the error (its worker
    was replaced, which collected them)."""
    exc = InvocationTimeout("the handler exceeded its deadline")
    exc.logs = tuple(call.logs)
    return exc
