"""``Client.map`` over replicas (docs/protocol.md, "Replicas"), against what it should beat or
match, measured in the same run.

One `Stack` (two python pods, as this machine has two cores):

* a 10 ms handler (``time.sleep(0.01)``) created with 1, 2 and 4 replicas: ``map`` over
  ITEMS items of each, against the same calls in a row (``Client.invoke`` in a loop);
* a no-op handler with 10 replicas: ``map`` with 10 in flight, against the throughput
  benchmark's load generator (benchmarks.throughput: asyncio, 10 kept-alive connections, one
  call at a time each) calling the same function.

Targets: 2 replicas >= 1.8x the rate of the calls in a row; the no-op map >= 0.9x the load
generator's invokes/s. The floors under them: threads of this process on raw kept-alive
http.client connections (no client library, no map) — 2 on the 2 replicas, 10 on the no-op's
10 — what calling from threads costs here.
Usage: python -m benchmarks.map [--items N]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from benchmarks.invoke import PAYLOAD, Target, verdicts
from benchmarks.throughput import load
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.lifecycle.stack import Stack

SLEEPY = "import time\ndef handle(event):\n    time.sleep(0.01)\n    return event\n"
NOOP = "def handle(event):\n    return event\n"
SPEEDUP_TARGET = 1.8  # 2 replicas, x the calls in a row
NOOP_TARGET = 0.9  # x the load generator's invokes/s
NOOP_REPLICAS = 10


def rate(calls: int, started: float) -> float:
    return calls / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=4.0, help="the load generator's time")
    args = parser.parse_args()
    items = [{"i": i} for i in range(args.items)]
    with tempfile.TemporaryDirectory(prefix="fnkernel-bench-") as tmp:
        stack = Stack(Path(tmp) / "state", {"python": 2}, gateway_listen="127.0.0.1:0")
        stack.start()
        try:
            client = Client(stack.gateway_address, token=stack.token)
            for replicas in (1, 2, 4):
                client.create_run(f"sleepy{replicas}", runtime="python", handler="handler.handle",
                                  files={"handler.py": SLEEPY}, replicas=replicas)  # fmt: skip
            client.create_run("noop", runtime="python", handler="handler.handle",
                              files={"handler.py": NOOP}, replicas=NOOP_REPLICAS)  # fmt: skip
            client.map("noop", items[:200])  # warm: connections, every replica once
            started = time.perf_counter()
            for item in items:
                client.invoke("sleepy1", item)
            in_a_row = rate(len(items), started)
            mapped = {}
            for replicas in (1, 2, 4):
                started = time.perf_counter()
                assert client.map(f"sleepy{replicas}", items) == items
                mapped[replicas] = rate(len(items), started)
            started = time.perf_counter()
            noop_items = items * 2
            client.map("noop", noop_items)
            noop_map = rate(len(noop_items), started)
            # The same function, 10 connections: the gateway gives each call a free replica.
            paths = ["/v1/runs/noop:invoke"] * NOOP_REPLICAS
            generator, _ = asyncio.run(
                load(stack.gateway_address, stack.token, paths, PAYLOAD, args.seconds)
            )
            threads = _threaded(stack, "noop", NOOP_REPLICAS, len(noop_items))
            two_threads = _threaded(stack, "sleepy2", 2, len(items))
        finally:
            stack.stop()
    print(f"{args.items} items; 10 ms handler; two python pods")
    print(f"{'case':<46}{'calls/s':>10}{'ratio':>9}")
    print(f"{'calls in a row (Client.invoke)':<46}{in_a_row:>10.0f}")
    for replicas, value in mapped.items():
        print(f"{f'map, {replicas} replica(s)':<46}{value:>10.0f}{value / in_a_row:>8.2f}x")
    floor_2 = "2 replicas: 2 threads, raw http.client (floor)"
    print(f"{floor_2:<46}{two_threads:>10.0f}{two_threads / in_a_row:>8.2f}x")
    print(f"{'no-op: load generator, 10 connections':<46}{generator:>10.0f}")
    floor = "no-op: 10 threads, raw http.client (floor)"
    print(f"{floor:<46}{threads:>10.0f}{threads / generator:>8.2f}x")
    noop = f"no-op: map, {NOOP_REPLICAS} replicas"
    print(f"{noop:<46}{noop_map:>10.0f}{noop_map / generator:>8.2f}x")
    print(f"no-op map / the threads' floor: {noop_map / threads:.2f}x (what map adds to threads)")
    return verdicts(
        [
            Target("map over 2 replicas / calls in a row", mapped[2] / in_a_row, SPEEDUP_TARGET,
                   at_least=True),
            Target("no-op map / the load generator's invokes/s", noop_map / generator,
                   NOOP_TARGET, at_least=True),
        ]
    )  # fmt: skip


def _threaded(stack: Stack, name: str, count: int, calls: int) -> float:
    """The floor of calling `name` from threads of this process: `count` threads, each on a
    kept-alive http.client connection of its own, `calls` in all — no client library, no map."""
    url = urlsplit(stack.gateway_address)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {stack.token}"}
    share = calls // count

    def worker() -> None:
        connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
        for _ in range(share):
            connection.request("POST", f"/v1/runs/{name}:invoke", PAYLOAD, headers)
            answer = connection.getresponse()
            answer.read()
            assert answer.status == 200, answer.status
        connection.close()

    workers = [threading.Thread(target=worker) for _ in range(count)]
    started = time.perf_counter()
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    return rate(share * count, started)


if __name__ == "__main__":
    raise SystemExit(main())
