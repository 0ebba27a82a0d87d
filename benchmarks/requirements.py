"""What a Run's requirements add to its registration (docs/protocol.md, "Requirements"), measured
against a registration without any in the same run (issue 46).

One `Stack` (a python pod) whose runtimed installs from a wheelhouse this benchmark builds
(``fnk-alpha`` at ROUNDS versions, never an index). Each round creates, through the gateway
(``POST /v1/runs``, which answers once the Run is Ready):

* a Run without requirements — the baseline registration;
* a Run with a set no Run had before (``fnk-alpha==N.0``): resolved and installed by uv;
* a second Run with that same set: the cached set, which must add at most 100 ms;

and times the cache's answer for the set as a restarted runtimed gets it (a new
``PackageCache`` on the same directory: its lock read back, its environment found), the part a
re-registration after a pod restart adds. Prints the medians and the cached set's cost above the
baseline. Usage: python -m benchmarks.requirements [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.invoke import Target, verdicts
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.lifecycle.runtimed.packages import PackageCache
from fnkernel.runtime_server.lifecycle.stack import Stack
from fnkernel.runtime_server.lifecycle.topology import PACKAGES_DIR
from tests.wheelhouse import build_wheel, offline_index

HANDLER = {"handler.py": "def handle(event):\n    return event\n"}
CACHED_TARGET_MS = 100.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fnk-bench-req-") as tmp:
        root = Path(tmp)
        wheelhouse = root / "wheelhouse"
        wheelhouse.mkdir()
        for version in range(1, args.rounds + 1):
            build_wheel(wheelhouse, "fnk-alpha", f"{version}.0", [])
        index = offline_index(wheelhouse)
        os.environ.update(index)  # the stack's runtimed inherits it
        stack = Stack(root / "state", {"python": 1}, gateway_listen="127.0.0.1:0")
        stack.start()
        taken: dict[str, list[float]] = {"none": [], "new set": [], "cached set": [], "restart": []}
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
                restarted = PackageCache(root / "state" / PACKAGES_DIR, environ=index)
                started = time.perf_counter()
                restarted.environment(asked)
                taken["restart"].append(time.perf_counter() - started)
        finally:
            stack.stop()
    ms = {case: statistics.median(times) * 1000 for case, times in taken.items()}
    print(f"{'registration':<34} {'median ms':>10} {'over none ms':>13}")
    for case in ("none", "new set", "cached set"):
        print(f"{case:<34} {ms[case]:10.1f} {ms[case] - ms['none']:13.1f}")
    print(f"{'the set, to a restarted runtimed':<34} {ms['restart']:10.2f}")
    return verdicts([
        Target("a cached set's cost above a registration without one",
               ms["cached set"] - ms["none"], CACHED_TARGET_MS, " ms"),
        Target("a cached set, to a restarted runtimed", ms["restart"], CACHED_TARGET_MS, " ms"),
    ])  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
