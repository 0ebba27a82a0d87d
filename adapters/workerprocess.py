"""One worker process and its frame pipes (``adapters/worker.py`` has the wire between them
and the supervisor): started in a process group of its own with its memory bounded, read and
written under a deadline, its start-up handshake read, killed with everything its handler
started, and reaped.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from fnkernel.adapters.calllogs import LogFiles
from fnkernel.adapters.children import spawn_limited, spawn_lock, worker_pids
from fnkernel.adapters.errors import (
    INITIALIZATION_ERROR,
    INITIALIZATION_TIMEOUT,
    MEMORY_LIMIT_EXCEEDED,
    WORKER_KILLED,
    InitError,
    loading_out_of_memory,
    ran_out_of_memory,
)

PIPE_SIZE = 1 << 20  # fewer wakeups for multi-MiB payloads; best effort (F_SETPIPE_SZ)
# A read allocates all it asks for: 1 MiB cost ~15 us a call, 64 KiB under 1 us. So a read asks
# for what the frame still needs, at least this much and at most PIPE_SIZE.
_MIN_READ = 1 << 16
_F_SETPIPE_SZ = 1031


class WorkerExited(Exception):
    """The worker died (killed by us, or crashed): its process exited, or its response pipe
    reached EOF."""


class Worker:
    """One live worker process with its two frame pipes and two log files."""

    def __init__(
        self,
        argv: Sequence[str],
        cwd: Path,
        env: Mapping[str, str],
        scratch: Path,
        memory_bytes: int = 0,
    ) -> None:
        """`memory_bytes`: what it and everything it starts may take (``spawn_limited``)."""
        self.memory_bytes = memory_bytes
        req_r, self.req = os.pipe()
        self.resp, resp_w = os.pipe()
        for fd in (req_r, resp_w):
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_SIZE)
        self.log_files = LogFiles(scratch)
        try:
            with spawn_lock:
                self.proc = spawn_limited(
                    [*argv, str(req_r), str(resp_w)],
                    memory_bytes,
                    cwd=cwd,
                    env=dict(env),
                    stdin=subprocess.DEVNULL,
                    stdout=self.log_files.fds["stdout"],
                    stderr=self.log_files.fds["stderr"],
                    pass_fds=(req_r, resp_w),
                    start_new_session=True,  # its own process group: killpg reaches the handler's children
                )
                worker_pids.add(self.proc.pid)
        finally:
            os.close(req_r)
            os.close(resp_w)
        # The worker's exit is seen on its pidfd, not only as EOF on the response pipe: a child
        # the handler left running keeps the pipe open after the worker itself is gone.
        self.pidfd = os.pidfd_open(self.proc.pid)
        self._buf = bytearray()
        # Set as the supervisor begins to read a call's answer (``WorkerCall.live_log``).
        self.answering = False

    # Frame I/O. Reads honour the deadline; a worker that dies gives EOF (WorkerExited).

    def send(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        try:
            while view:
                written = os.write(self.req, view)
                view = view[written:]
        except OSError as exc:  # EPIPE: it is gone
            raise WorkerExited() from exc

    def _fill(self, deadline: float, wanted: int = 0) -> None:
        """Read what the worker has written (`wanted`: the bytes the frame still needs)."""
        remaining = deadline - time.monotonic()
        ready = select.select([self.resp, self.pidfd], [], [], max(0.0, remaining))[0]
        if self.resp not in ready:
            if not ready:
                raise TimeoutError
            # It exited. Everything it wrote before is in the pipe already: take that first.
            if not select.select([self.resp], [], [], 0)[0]:
                raise WorkerExited()
        self.answering = True
        chunk = os.read(self.resp, min(max(wanted, _MIN_READ), PIPE_SIZE))
        if not chunk:
            raise WorkerExited()
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
                error_type = rest[0].decode()
                message = self.read_exact(int(rest[1]), deadline).decode("utf-8", "replace")
                if error_type == MEMORY_LIMIT_EXCEEDED and self.memory_bytes:  # where it was
                    raise loading_out_of_memory(self.memory_bytes >> 20, f"at {message.strip()}")
                raise InitError(error_type, message.strip())
            raise InitError(INITIALIZATION_ERROR, f"unexpected worker handshake {line[:80]!r}")
        except TimeoutError:
            self.kill()
            raise InitError(
                INITIALIZATION_TIMEOUT, "the handler did not finish loading in time"
            ) from None
        except WorkerExited:
            code = self.proc.wait()
            if self.memory_bytes and code > 0:  # a native library that exits when it runs out
                stderr = [line.text for line in self.log_files.read() if line.stream == "stderr"]
                if said := ran_out_of_memory(stderr):
                    raise loading_out_of_memory(
                        self.memory_bytes >> 20, f"(it said: {said})"
                    ) from None
            # Killed by a signal is the platform's doing (OOM killer, an operator): runtimed
            # retries WorkerKilled; an exit status is the handler's own and is final.
            error_type = WORKER_KILLED if code < 0 else INITIALIZATION_ERROR
            raise InitError(
                error_type, f"the handler exited while loading ({describe_exit(code)})"
            ) from None

    def kill(self) -> None:
        """SIGKILL the worker's process group: the worker and everything its handler started."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def reap(self) -> None:
        """Kill, wait for the exit status and release the pipes and log files."""
        self.kill()
        self.proc.wait()
        with spawn_lock:
            worker_pids.discard(self.proc.pid)
        for fd in (self.req, self.resp, self.pidfd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.log_files.close()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit status {code}"
