"""Process wiring for long-running servers: signals, the child subreaper, orphan reaping."""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import threading
import time

from adapters.worker import reap_orphans

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except OSError:
        return False


def become_subreaper() -> bool:
    """Adopt our workers' orphaned grandchildren so they can be reaped (SPEC §3.1)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent() -> None:
    """In a child before exec: SIGTERM when the parent dies, so a killed parent leaves no orphans.

    Linux sends it when the *thread* that forked exits: fork from a thread that lives as long
    as the child should.
    """
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_reaper(stop: threading.Event, interval: float = 1.0) -> threading.Thread:
    def loop() -> None:
        while not stop.wait(interval):
            reap_orphans()

    thread = threading.Thread(target=loop, name="reaper", daemon=True)
    thread.start()
    return thread


def wait_for_termination(poll: float = 0.1) -> int:
    """Block until SIGTERM or SIGINT; returns the signal number.

    The handler only appends to a list: it runs in the main thread between bytecodes, possibly
    inside a lock acquire, so taking any lock there (``Event.set()``) can deadlock the very
    thread that must stop the server — which left servers running after SIGTERM. Not sigwait
    either: that needs the signals blocked before gRPC starts its threads.
    """
    received: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        received.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    while not received:
        time.sleep(poll)  # a signal runs the handler at once; the loop sees it within `poll`
    return received[0]
