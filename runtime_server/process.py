"""Process wiring for long-running servers: signals, the child subreaper, orphan reaping."""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import threading

from adapters.worker import reap_orphans

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Adopt our workers' orphaned grandchildren so they can be reaped (SPEC §3.1)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except OSError:
        return False


def start_reaper(stop: threading.Event, interval: float = 1.0) -> threading.Thread:
    def loop() -> None:
        while not stop.wait(interval):
            reap_orphans()

    thread = threading.Thread(target=loop, name="reaper", daemon=True)
    thread.start()
    return thread


def wait_for_termination() -> int:
    """Block until SIGTERM or SIGINT; returns the signal number.

    A Python handler plus an Event, not sigwait: sigwait would need the signals blocked before
    gRPC starts its threads.
    """
    received: list[int] = []
    done = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        received.append(signum)
        done.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    while not done.wait(0.5):  # wake periodically so the main thread can run the handler
        pass
    return received[0]
