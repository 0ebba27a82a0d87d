"""The processes of a stack, and what they spend, read from /proc: for benchmarks that count
memory (benchmarks.dataframes) or CPU per call (benchmarks.peers) process by process."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from fnkernel.runtime_server.lifecycle.stack import Stack

_TICKS = os.sysconf("SC_CLK_TCK")


def stack_processes(stack: Stack) -> dict[str, int]:
    """Each component of `stack` (the gateway, each pod's runtimed and server) by name, and the
    workers of each server (``NAME-worker``, ``NAME-worker-2``, …): their pids."""
    processes = {
        component.name: component.child.pid
        for component in stack.components
        if component.child is not None
    }
    for name, pid in list(processes.items()):
        if name.endswith("-server"):
            for number, worker in enumerate(children_of(pid), start=1):
                processes[f"{name}-worker" + (f"-{number}" if number > 1 else "")] = worker
    return processes


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def status_bytes(pid: int, field: str) -> int:
    """A size field of /proc/PID/status (VmRSS, VmHWM, RssAnon, …) in bytes; 0 if it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """The CPU time `pid` has used, user and system; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime


def cpu_per_call(case: Callable[[], float], pids: dict[str, int]) -> tuple[float, dict[str, float]]:
    """Run `case`, which returns its calls a second, and count the CPU each process spent a
    call (us): this one (the callers') and each of `pids`, a stack's workers summed as one."""
    processes = {"client (this process)": os.getpid(), **pids}
    before = {name: cpu_seconds(pid) for name, pid in processes.items()}
    started = time.perf_counter()
    rate = case()
    calls = rate * (time.perf_counter() - started)
    spent: dict[str, float] = {}
    for name, pid in processes.items():
        label = name.partition("-worker")[0] + "'s workers" if "-worker" in name else name
        spent[label] = spent.get(label, 0.0) + (cpu_seconds(pid) - before[name]) / calls * 1e6
    return rate, spent
