"""The children of a process that runs workers (docs/architecture.md, "What one call may log";
"Measured facts the design rests on"): which are workers, and what handlers left behind.

A Runtime Server is a child subreaper, so a handler's killed grandchildren are reparented to
it: ``reap_orphans`` reaps the zombies among them, ``kill_orphans`` kills the live ones a
registration's handler left outside its worker's process group. Neither ever touches a worker,
whose exit status its Popen owns.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from fnkernel.system.procfs import proc_stat

RUN_UID_ENV = "FNKERNEL_RUN_UID"  # in every worker's environment, and so its descendants'
# Every worker pid this process spawned and has not yet waited for. The orphan reaper must never
# reap these: their Popen objects own their exit status.
spawn_lock = threading.Lock()
worker_pids: set[int] = set()


def spawn_limited(argv: list[str], memory_bytes: int, **options: Any) -> subprocess.Popen[bytes]:
    """Start `argv` (``subprocess.Popen`` with `options`), held with everything it starts to
    `memory_bytes` of data (RLIMIT_DATA; 0: no bound) — the one way a handler's process is
    bounded (docs/protocol.md, "Limits"). The bound is set on it by its pid as soon as it
    exists, not by a ``preexec_fn``, which runs Python between fork and exec, where gRPC's fork
    handlers can crash the child: what it maps before that (its interpreter's first
    milliseconds, never the handler) is not counted, and counts against the bound after."""
    proc: subprocess.Popen[bytes] = subprocess.Popen(argv, **options)
    if memory_bytes:
        with contextlib.suppress(ProcessLookupError):  # it is gone already: nothing to bound
            resource.prlimit(proc.pid, resource.RLIMIT_DATA, (memory_bytes, memory_bytes))
    return proc


def reap_orphans() -> int:
    """Reap zombie children this process did not spawn itself (docs/architecture.md, "Measured facts the design rests on").

    The Runtime Server is a child subreaper, so a handler's killed grandchildren are reparented to
    it. Only our own children are looked at, not all of /proc: this runs every second beside the
    calls. Returns how many were reaped.
    """
    reaped = 0
    with spawn_lock:
        for pid in _children():
            if pid in worker_pids:
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
        with spawn_lock:
            left = [pid for pid in _children() if pid not in worker_pids and _left_by(pid, run_uid)]
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
