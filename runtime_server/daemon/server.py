"""The wiring of a long-running component: the child subreaper, the parent watch, the orphan
reaper, and waiting for the signal that stops it."""

from __future__ import annotations

import ctypes
import math
import os
import select
import signal
import threading

from fnkernel.adapters.calllogs import trim_logs
from fnkernel.adapters.children import reap_orphans
from fnkernel.system.waiting import wait_for

_PR_SET_CHILD_SUBREAPER = 36
PARENT_ENV = "FNKERNEL_PARENT_PID"  # set by spawn(die_with_parent=True)
# glibc's mallopt parameters, and what keep_freed_memory sets them to.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 16 << 20  # above the 6 MiB payload and each of its copies
TRIM_THRESHOLD_BYTES = 32 << 20  # what a 6 MiB call's copies take at once, with room
# The gateway holds more of a 6 MiB call at once (tornado's chunks, the body, the request, the
# answer, its write) than 32 MiB: kept, that call's timeline went from 119 to 86 ms.
GATEWAY_TRIM_THRESHOLD_BYTES = 64 << 20


def _libc() -> ctypes.CDLL:
    # The C library this process already has loaded (find_library would run ldconfig).
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> bool:
    try:
        return bool(_libc().prctl(option, value, 0, 0, 0) == 0)
    except OSError:
        return False


def keep_freed_memory(trim_threshold: int = TRIM_THRESHOLD_BYTES) -> bool:
    """In a component a payload passes through: glibc's malloc serves blocks up to 16 MiB from
    its heap and keeps up to `trim_threshold` bytes of what is freed (docs/architecture.md, "A
    payload's bytes").

    By default a block past 128 KiB is mapped for itself and unmapped when freed, and glibc's
    own raised thresholds still hand the heap back once a call's copies (the body, its protobuf
    message, that message serialized) have been freed together: each call faults its pages in
    afresh, ~740 faults and 2.4 ms to build and serialize one 1 MiB message here. Kept, the
    same pages serve the next call. At rest a process holds up to `trim_threshold` more after
    a large payload. False where the C library has no mallopt (musl): nothing changes there.
    """
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        and mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
    )


def become_subreaper() -> bool:
    """Adopt our workers' orphaned grandchildren so they can be reaped (docs/architecture.md, "Measured facts the design rests on")."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def watch_parent(interval: float = 0.25) -> threading.Thread | None:
    """In a component started with ``spawn(die_with_parent=True)``: SIGTERM ourselves
    (an orderly stop) once the parent that started us is gone — killed, even with SIGKILL.

    A parent-pid watch rather than ``PR_SET_PDEATHSIG``: that needs a ``preexec_fn``, which runs
    Python between fork and exec, where gRPC's fork handlers can crash the child of a process
    with gRPC threads. The variable is removed from our environment so that nothing we start
    inherits it.

    The watch waits on a pidfd of the parent, which becomes readable when it exits: no wake-up
    until then (docs/architecture.md, "Idle"). Where there is none (a kernel before Linux 5.3),
    it asks for our parent's pid every `interval` seconds.
    """
    expected = os.environ.pop(PARENT_ENV, "")
    if not expected.isdigit():
        return None
    parent = int(expected)
    try:
        # Opened before the check below: if the pid was already another process's, we have
        # been reparented by then, and the check sees it.
        parent_fd: int | None = os.pidfd_open(parent)
    except (AttributeError, OSError):  # none here, or the parent is gone already
        parent_fd = None

    def watch() -> None:
        if parent_fd is not None:
            select.select([parent_fd], [], [])  # readable once the parent has exited
        else:
            wait_for(lambda: os.getppid() != parent, timeout=math.inf, interval=interval)
        os.kill(os.getpid(), signal.SIGTERM)

    if os.getppid() != parent:  # gone before we even started
        os.kill(os.getpid(), signal.SIGTERM)
    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def start_reaper(stop: threading.Event, interval: float = 1.0) -> threading.Thread:
    """Once a second, in a Runtime Server: reap the orphans its workers left, and free on disk
    what calls in progress logged beyond what they keep (``adapters.calllogs.trim_logs``)."""

    def loop() -> None:
        while not stop.wait(interval):
            reap_orphans()
            trim_logs()

    thread = threading.Thread(target=loop, name="reaper", daemon=True)
    thread.start()
    return thread


def wait_for_termination() -> int:
    """Block until SIGTERM or SIGINT; returns the signal number.

    The main thread blocks on a pipe that the interpreter's C-level handler writes each caught
    signal's number to (``signal.set_wakeup_fd``): it wakes for a signal and not before
    (docs/architecture.md, "Idle"), and the byte it reads says which. The Python-level handler
    does nothing: it runs in the main thread between bytecodes, possibly inside a lock acquire,
    so taking any lock there (``Event.set()``) can deadlock the very thread that must stop the
    server — which once left servers running after SIGTERM. Not sigwait either: that needs the
    signals blocked before gRPC starts its threads.
    """
    stops = (signal.SIGTERM, signal.SIGINT)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)  # as set_wakeup_fd requires
    previous = signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    try:
        for sig in stops:
            signal.signal(sig, lambda _signum, _frame: None)
        while True:
            for signum in os.read(wake_read, 64):  # retried after an interrupt (PEP 475)
                if signum in stops:
                    return signal.Signals(signum)
    finally:
        signal.set_wakeup_fd(previous)
        os.close(wake_read)
        os.close(wake_write)
