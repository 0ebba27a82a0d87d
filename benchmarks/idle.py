"""What a stack nobody calls costs (docs/architecture.md, "Idle"), against the floor chain's
three processes (benchmarks.throughput: a tornado relay, a grpc.aio relay, a gRPC echo), idle
in the same run.

One `Stack` (one python pod, the gateway): its CPU a second and its wake-ups a second, process
by process, counted from every thread's ``/proc/PID/task/TID/schedstat`` over a quiet window
that begins SETTLE_SECONDS after the last change (runtimed's loop wakes every 5 ms for 10 s
after one), with one Run and then with RUNS Runs (runtimed asks its server for every READY
Run's status once a second). The floor chain's processes are counted over the same window.

Reported, not judged: the stack's CPU a second against the floor chain's, and the growth from
one Run to RUNS. Usage: python -m benchmarks.idle [--seconds S] [--runs N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.processes import stack_processes
from benchmarks.throughput import floor_chain
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.daemon import Child
from fnkernel.runtime_server.lifecycle.stack import Stack

SETTLE_SECONDS = 12.0  # past runtimed's 10 s of 5 ms wake-ups after a change
RUNS = 50
ECHO = "def handle(event):\n    return event\n"


def task_counts(pid: int) -> tuple[int, int]:
    """CPU nanoseconds and wake-ups (times scheduled in) of every thread of `pid`, so far."""
    cpu = wakes = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0, 0
    for task in tasks:
        try:
            fields = Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()
        except OSError:
            continue  # ended meanwhile
        cpu, wakes = cpu + int(fields[0]), wakes + int(fields[2])
    return cpu, wakes


def quiet(processes: dict[str, int], seconds: float) -> dict[str, tuple[float, float]]:
    """Each process's CPU (ms) and wake-ups a second over `seconds` of doing nothing."""
    before = {name: task_counts(pid) for name, pid in processes.items()}
    started = time.perf_counter()
    time.sleep(seconds)  # the window itself: nothing is asked of anyone
    took = time.perf_counter() - started
    counted = {}
    for name, pid in processes.items():
        cpu, wakes = task_counts(pid)
        counted[name] = ((cpu - before[name][0]) / 1e6 / took, (wakes - before[name][1]) / took)
    return counted


def report(title: str, counted: dict[str, tuple[float, float]]) -> float:
    print(f"\n{title} (CPU ms a second, wake-ups a second)")
    for name, (cpu, wakes) in counted.items():
        print(f"  {name:<40}{cpu:>8.2f}{wakes:>8.0f}")
    total = sum(cpu for cpu, _ in counted.values())
    print(f"  {'all of them':<40}{total:>8.2f}{sum(w for _, w in counted.values()):>8.0f}")
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="each quiet window")
    parser.add_argument("--runs", type=int, default=RUNS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fnkernel-idle-") as tmp:
        children: list[Child] = []
        stack = Stack(Path(tmp) / "state", {"python": 1}, gateway_listen="127.0.0.1:0")
        stack.start()
        try:
            echo, proxy, front = floor_chain(tmp)
            children += (echo, proxy, front)
            floor = {
                "floor chain: tornado relay": front.pid,
                "floor chain: grpc.aio relay": proxy.pid,
                "floor chain: gRPC echo": echo.pid,
            }
            client = Client(stack.gateway_address, token=stack.token)
            totals, created = [], 0
            for count in (1, args.runs):
                while created < count:
                    client.create_run(
                        f"idle{created}", runtime="python", handler="handler.handle",
                        files={"handler.py": ECHO},
                    )  # fmt: skip
                    created += 1
                client.invoke("idle0", 1)  # one call, then nothing
                time.sleep(SETTLE_SECONDS)  # the window begins once the loops are quiet
                processes = {
                    name: pid
                    for name, pid in stack_processes(stack).items()
                    if "-worker" not in name  # a worker waits on its pipe: no wake-ups
                }
                counted = quiet({**processes, **floor}, args.seconds)
                stack_only = {name: counted[name] for name in processes}
                totals.append(report(f"the stack, idle, {count} Run(s)", stack_only))
                floor_total = report(
                    "the floor chain, idle, same window", {name: counted[name] for name in floor}
                )
                print(f"  the stack / the floor chain: {totals[-1] / max(floor_total, 1e-3):.2f}x")
            print(
                f"\nfrom 1 Run to {args.runs}: {totals[0]:.2f} → {totals[1]:.2f} ms of CPU a "
                f"second ({(totals[1] - totals[0]) / (args.runs - 1) * 1000:.0f} µs a second a Run)"
            )
        finally:
            stack.stop()
            for child in children:
                child.stop(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
