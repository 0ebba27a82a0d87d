"""What a Run's requirements add to its registration (docs/protocol.md, "Requirements"), measured
against a registration without any in the same run (issue 46).

One `Stack` (a python pod) whose runtimed installs from a wheelhouse this benchmark builds
(``fnk-alpha`` at ROUNDS versions, never an index). Each round creates, through the gateway
(``POST /v1/runs``, which answers once the Run is Ready):

* a Run without requirements — the baseline registration;
* a Run with a set no Run had before (``fnk-alpha==N.0``): resolved and installed by uv;
* a second Run with that same set: the cached set, which must add at most 100 ms;

Then, RESTARTS times, with two Runs on the pod — one without requirements, one with a set
installed before — it kills the pod's server and runtimed (SIGKILL: a pod restart, every
registration lost). The supervisor starts both anew, the new runtimed registers each Run again
(for the second, finding the set's lock and environment in the cache), and each answers a call
again. The components export their spans to a collector in this process (tests/otlp.py): the
restarted runtimed's registration span of each Run is what its re-registration took, the same
restart for both. Each kill waits until the pod has been up long enough that its restart is
immediate. Prints the medians and each cached set's cost above the baseline, and the time from
the kill until a call answered. Usage: python -m benchmarks.requirements [--rounds N]
[--restarts N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.invoke import Target, verdicts
from fnkernel.runtime_server import tracing
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import GatewayError
from fnkernel.runtime_server.lifecycle.stack import Stack
from fnkernel.system.waiting import wait_for
from tests.otlp import Collector, collecting
from tests.wheelhouse import build_wheel, offline_index

HANDLER = {"handler.py": "def handle(event):\n    return event\n"}
CACHED_TARGET_MS = 100.0
RESTARTED = {"restarted-none": [], "restarted-cached": ["fnk-alpha==1.0"]}  # Run -> requirements


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--restarts", type=int, default=5)
    args = parser.parse_args()
    with contextlib.ExitStack() as exit_stack:
        root = Path(exit_stack.enter_context(tempfile.TemporaryDirectory(prefix="fnk-bench-req-")))
        wheelhouse = root / "wheelhouse"
        wheelhouse.mkdir()
        for version in range(1, args.rounds + 1):
            build_wheel(wheelhouse, "fnk-alpha", f"{version}.0", [])
        index = offline_index(wheelhouse)
        os.environ.update(index)  # the stack's runtimed inherits it
        collector, endpoint = exit_stack.enter_context(collecting())
        os.environ.update(FNKERNEL_OTLP_ENDPOINT=endpoint, OTEL_BSP_SCHEDULE_DELAY="50")
        stack = Stack(root / "state", {"python": 1}, gateway_listen="127.0.0.1:0",
                      poll_interval=0.2)  # fmt: skip
        stack.start()
        taken: dict[str, list[float]] = {
            "none": [], "new set": [], "cached set": [], "answered after a restart": [],
            **{case: [] for case in RESTARTED},
        }  # fmt: skip
        try:
            client = Client(stack.gateway_address)
            for version in range(1, args.rounds + 1):
                asked = [f"fnk-alpha=={version}.0"]
                for case, name, requirements in (
                    ("none", f"none-{version}", []),
                    ("new set", f"new-{version}", asked),
                    ("cached set", f"cached-{version}", asked),
                ):
                    started = time.perf_counter()
                    run = client.create_run(
                        name, runtime="python", handler="handler.handle", files=HANDLER,
                        requirements=requirements,
                    )  # fmt: skip
                    taken[case].append(time.perf_counter() - started)
                    assert run.phase == "Ready", run.message
            for run in client.list_runs():
                client.delete_run(run.name)
            for case, requirements in RESTARTED.items():
                client.create_run(case, runtime="python", handler="handler.handle",
                                  files=HANDLER, requirements=requirements)  # fmt: skip
            for _ in range(args.restarts):
                answered, registered = _restart_pod(stack, client, collector)
                taken["answered after a restart"].append(answered)
                for case, seconds in registered.items():
                    taken[case].append(seconds)
        finally:
            stack.stop()
    ms = {case: statistics.median(times) * 1000 for case, times in taken.items()}
    restart_cost = ms["restarted-cached"] - ms["restarted-none"]
    print(f"{'registration':<34} {'median ms':>10} {'over none ms':>13}")
    for case in ("none", "new set", "cached set"):
        print(f"{case:<34} {ms[case]:10.1f} {ms[case] - ms['none']:13.1f}")
    print("after a pod restart (runtimed's registration span):")
    print(f"{'  none':<34} {ms['restarted-none']:10.1f}")
    print(f"{'  cached set':<34} {ms['restarted-cached']:10.1f} {restart_cost:13.1f}")
    print(f"{'the pod killed, until both answer':<34} {ms['answered after a restart']:10.1f}")
    return verdicts([
        Target("a cached set's cost above a registration without one",
               ms["cached set"] - ms["none"], CACHED_TARGET_MS, " ms"),
        Target("a cached set's cost to a re-registration after a pod restart", restart_cost,
               CACHED_TARGET_MS, " ms"),
    ])  # fmt: skip


def _restart_pod(
    stack: Stack, client: Client, collector: Collector
) -> tuple[float, dict[str, float]]:
    """Kill the pod's server and runtimed once the supervisor would restart them at once; the
    seconds until every Run of RESTARTED answers a call again, and the seconds the restarted
    runtimed's registration of each took (its span)."""
    parts = [stack.component(f"python-0-{part}") for part in ("server", "runtimed")]
    assert wait_for(lambda: all(part.restarts == 0 for part in parts), timeout=30, interval=0.1)
    for case in RESTARTED:
        assert client.invoke(case, {}).value() == {}
    killed_ns = time.time_ns()
    started = time.perf_counter()
    for part in parts:
        assert part.child is not None
        part.child.proc.kill()
    waiting, deadline = set(RESTARTED), started + 60
    while waiting and time.perf_counter() < deadline:
        for case in sorted(waiting):
            try:
                client.invoke(case, {}, timeout_millis=5000)
                waiting.discard(case)
            except GatewayError:
                time.sleep(0.005)
    if waiting:
        raise TimeoutError(f"{sorted(waiting)} did not answer within 60 s of the pod's restart")
    answered = time.perf_counter() - started

    def registrations() -> dict[str, float] | None:
        found = {}
        for span in collector.snapshot():
            name = span["attributes"].get(tracing.RUN_NAME)
            if (span["service"] == "fnkernel-runtimed" and span["name"].startswith("register ")
                    and name in RESTARTED and span["start"] > killed_ns):  # fmt: skip
                found[name] = (span["end"] - span["start"]) / 1e9
        return found if len(found) == len(RESTARTED) else None

    registered = wait_for(registrations, timeout=10, interval=0.05)
    assert registered is not None, "the restarted runtimed exported no registration span"
    return answered, registered


if __name__ == "__main__":
    raise SystemExit(main())
