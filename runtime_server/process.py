"""Process wiring for long-running servers: signals, the child subreaper, orphan reaping."""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import threading

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
