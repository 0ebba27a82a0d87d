"""Component processes started ahead of need (docs/architecture.md, "The first registration")."""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from fnkernel.runtime_server.daemon.announce import wait_or_kill
from fnkernel.runtime_server.daemon.server import PARENT_ENV

READY_LINE = "fnkernel prewarm: ready"  # a prewarmed process has imported what it needs


class Prewarmed:
    """Component processes started ahead of need, one per command (docs/architecture.md, "The
    first registration"): each has imported what ``fnkernel COMMAND`` imports and waits for its
    command line (``runtime_server.cli.prewarm``). ``spawn`` takes one when it can, so a component
    starts in tens of milliseconds rather than hundreds.

    They are started as ``spawn(die_with_parent=True)`` starts a component: their own session,
    and the parent's pid to watch once they run. Closing the pool ends those not taken.
    """

    def __init__(
        self, commands: Sequence[str] = ("serve", "runtimed", "gateway"), *, refill: bool = False
    ) -> None:
        """`refill`: each process taken is replaced at once by a new one, so that every start
        of the command (a pod backend's) is a fast one, not only the first."""
        self._refill = refill
        self._lock = threading.RLock()  # also held while a ready line is read
        self._procs: dict[str, subprocess.Popen[str]] = {}
        self._ready: set[int] = set()  # pids whose ready line was read
        for command in commands:
            self._procs[command] = self._launch(command)

    @staticmethod
    def _launch(command: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "fnkernel.runtime_server.cli.prewarm", command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, PARENT_ENV: str(os.getpid())},
            start_new_session=True,
        )

    def pids(self) -> dict[str, int]:
        """The waiting processes, by command."""
        with self._lock:
            return {command: proc.pid for command, proc in self._procs.items()}

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every waiting process has imported what it needs; False on `timeout`."""
        deadline = time.monotonic() + timeout
        with self._lock:
            for proc in self._procs.values():
                if not self._read_ready(proc, deadline):
                    return False
        return True

    def _read_ready(self, proc: subprocess.Popen[str], deadline: float) -> bool:
        """Read `proc`'s ready line (lock held), by `deadline`; False if it did not come."""
        if proc.pid in self._ready:
            return True
        assert proc.stdout is not None
        remaining = max(0.0, deadline - time.monotonic())
        if not select.select([proc.stdout], [], [], remaining)[0]:
            return False
        if proc.stdout.readline().strip() != READY_LINE:
            return False
        self._ready.add(proc.pid)
        return True

    def take(self, command: str) -> subprocess.Popen[str] | None:
        """The waiting process for `command` once it is ready, if there is one and it is
        alive; else None (and a caller starts a fresh process)."""
        with self._lock:
            proc = self._procs.pop(command, None)
            if proc is not None and self._refill:
                self._procs[command] = self._launch(command)
            if proc is not None and not self._read_ready(proc, time.monotonic() + 60):
                discard(proc)
                return None
            if proc is not None:
                self._ready.discard(proc.pid)
        return proc

    def close(self) -> None:
        with self._lock:
            procs, self._procs = list(self._procs.values()), {}
            self._refill = False
        for proc in procs:
            discard(proc)


def discard(proc: subprocess.Popen[str]) -> None:
    """End a prewarmed process that was not used: end of stdin makes it exit."""
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    wait_or_kill(proc, 5)
