"""What /proc says about a process (stdlib only: the client library uses it at kernel start)."""

from __future__ import annotations

import os
from pathlib import Path


def proc_stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name: [state, ppid, ...].

    OSError if there is no such process.
    """
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def running(pid: int) -> bool:
    """Running: not gone and not a zombie (a killed process its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # somebody else's process
    try:
        state = proc_stat(pid)[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")
