"""Issue 48's fan-out, measured by benchmarks.peers each round: FAN_ITEMS items of a ~BURN_MS
CPU-bound handler, FAN_WIDTH at a time (as wide as this machine's cores), by ``Client.map`` over
a Run of FAN_WIDTH replicas and by a ``ProcessPoolExecutor(FAN_WIDTH)`` — the peer a notebook
user tries first — with each item's cost above the handler's own work.

Beside them, the map's bound: the same work looped in the handler (LOOPED_HANDLER), so with no
hand-off an item, mapped in one call a replica — as many calls as the map has batches (one a
lane, fed as it runs: docs/protocol.md, "Batches"). What the map takes above it is its items'
hand-offs.
"""

from __future__ import annotations

import concurrent.futures
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.invoke import Target
from fnkernel.runtime_server.client import Client

FAN_ITEMS = 200
FAN_WIDTH = 2
BURN_MS = 5.0
BURN_HANDLER = (
    "import time\n"
    "def handle(event):\n"
    "    started = time.process_time()\n"
    f"    while time.process_time() - started < {BURN_MS / 1000}:\n"
    "        pass\n"
    "    return event\n"
)
# BURN_HANDLER's work for each of `event` items, in the handler's own loop.
LOOPED_HANDLER = (
    "import time\n"
    "def handle(event):\n"
    "    for _ in range(event):\n"
    "        started = time.process_time()\n"
    f"        while time.process_time() - started < {BURN_MS / 1000}:\n"
    "            pass\n"
    "    return event\n"
)
MAP_CASE = f"fnkernel Client.map, {FAN_WIDTH} replicas"
POOL_CASE = f"ProcessPoolExecutor({FAN_WIDTH}).map"
# The map's bound, by its number of calls: one a replica, as the map has one batch a lane.
LOOPED_CASES = {f"  bound: no hand-off an item, {calls} calls": calls for calls in (FAN_WIDTH,)}
# The Runs a stack needs for these cases: name, handler source, replicas.
RUNS = (("burn", BURN_HANDLER, FAN_WIDTH), ("looped", LOOPED_HANDLER, FAN_WIDTH))


def burn(item: int) -> int:
    """The ProcessPoolExecutor's handler: BURN_HANDLER's work (a module function: the pool
    pickles its name)."""
    started = time.process_time()
    while time.process_time() - started < BURN_MS / 1000:
        pass
    return item


class FanOut:
    """The cases on `client`'s stack, where RUNS were created; their times over the rounds."""

    def __init__(self, client: Client) -> None:
        self.pool = concurrent.futures.ProcessPoolExecutor(FAN_WIDTH)
        items = list(range(FAN_ITEMS))
        self.cases: dict[str, tuple[Callable[[], Any], list[int]]] = {
            MAP_CASE: (lambda: client.map("burn", items, concurrency=FAN_WIDTH), items),
            POOL_CASE: (lambda: list(self.pool.map(burn, items)), items),
        }
        for label, calls in LOOPED_CASES.items():
            each = [FAN_ITEMS // calls] * calls
            mapped = functools.partial(client.map, "looped", each, concurrency=FAN_WIDTH)
            self.cases[label] = (mapped, each)
        self.took: dict[str, list[float]] = {}  # seconds for the FAN_ITEMS items, per round

    def round(self, *, warm: bool) -> None:
        """Each case once, in turn (after a call not counted, if `warm`)."""
        for label, (case, answer) in self.cases.items():
            if warm:
                case()
            started = time.perf_counter()
            assert case() == answer, label
            self.took.setdefault(label, []).append(time.perf_counter() - started)

    def report(self) -> tuple[list[Target], list[str]]:
        """Print the cases' medians; the target (map <= the pool) and a note on the bound."""
        print(f"\n== {FAN_ITEMS} items of a ~{BURN_MS:g} ms CPU-bound handler, {FAN_WIDTH} at a "
              "time (s, median of the rounds; per item above the handler's own work)")  # fmt: skip
        took = {label: statistics.median(values) for label, values in self.took.items()}
        for label, seconds in took.items():
            above = seconds * FAN_WIDTH / FAN_ITEMS * 1000 - BURN_MS
            print(f"{label:<58}{seconds:>9.2f} s   {above:6.2f} ms an item above its work")
        if not took:
            return [], []
        pool = took[POOL_CASE]
        targets = [
            Target("map / ProcessPoolExecutor of the same width", took[MAP_CASE] / pool, 1.0)
        ]
        notes = []
        if took[MAP_CASE] > pool:
            bounds = ", ".join(
                f"{took[label] / pool:.2f}x in {calls} calls"
                for label, calls in LOOPED_CASES.items()
            )
            notes.append(
                f"map: with no hand-off an item, the same work takes {bounds} the pool's time; "
                "the map's distance above that is its items' hand-offs"
            )
        return targets, notes

    def close(self) -> None:
        self.pool.shutdown()
