"""Process wiring for long-running servers: signals, the child subreaper, orphan reaping."""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import threading
from collections.abc import Callable

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


def wait_for_termination(on_signal: Callable[[int], None] | None = None) -> int:
    """Block until SIGTERM or SIGINT; returns the signal number."""
    received = threading.Event()
    signum_box: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        signum_box.append(signum)
        received.set()
        if on_signal is not None:
            on_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    while not received.wait(0.5):
        pass
    return signum_box[0]
