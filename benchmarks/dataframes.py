"""DataFrames in and out beside the peers a data engineer would try (issue 47, section 4), in one
run, interleaved: a pandas DataFrame of mixed dtypes (int64, float64 with NaN, a time zone's
timestamps, a categorical, text with nulls) of about 1 MiB, 64 MiB and 512 MiB as Arrow, sent to
a handler that returns it, and the DataFrame back in the caller:

* **fnkernel** ``Client.invoke(df).value()`` — what ``NAME(df)`` does — on a stack of this
  machine: the frame written once into the stack's spool, mapped by the worker, the result
  handed back the same way (docs/protocol.md, "Large payloads");
* **fnkernel, streamed**: ``Client.invoke(df, by_reference=False)``, every byte through the
  gateway and runtimed, as a caller on another machine sends it;
* **Ray's actor call**, ``ray.get(actor.f.remote(df))``;
* **a ProcessPoolExecutor** of one process in the notebook (pickle through a pipe).

Each case's calls are taken in turn, round after round; the median of each, its ratio to Ray's
actor call. Then **memory**: one call of about 1 GiB through the spool path and one streamed,
with each stack
process's peak resident memory reset before it (``/proc/PID/clear_refs``) and read after
(``VmHWM``), and the spool's own size at the end; what each took above its resting size, in
payloads.

Targets (issue 47): fnkernel <= Ray's actor call at 1 MiB and up. Not part of ``make bench``
(Ray is an optional extra): ``make bench-peers`` runs it after benchmarks.peers.
Usage: python -m benchmarks.dataframes [--rounds N] [--sizes MIB ...] [--memory-mib N]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from benchmarks.invoke import Target, verdicts
from fnkernel.runtime_server import payloads
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.lifecycle.stack import Stack

MIB = 1 << 20
SIZES_MIB = (1, 64, 512)
HANDLER = {"handler.py": "def handle(frame):\n    return frame\n"}
RAY_CASE = "Ray actor call"


def frame_of(mib: int) -> pd.DataFrame:
    """A mixed-dtype frame of about `mib` MiB as Arrow (~37 bytes a row)."""
    rows = max(1, mib * MIB // 37)
    count = np.arange(rows, dtype=np.int64)
    ratio = np.linspace(0.0, 1.0, rows)
    ratio[::13] = np.nan
    note = np.where(count % 5 == 0, None, "ok")
    return pd.DataFrame({
        "count": count,
        "ratio": ratio,
        "at": pd.date_range("2026-01-01", periods=rows, freq="s", tz="Europe/Paris"),
        "grade": pd.Categorical.from_codes(count % 3, ["a", "b", "c"]),
        "note": note,
    })  # fmt: skip


def echo(frame: Any) -> Any:
    """The ProcessPoolExecutor's handler (a module function: the pool pickles its name)."""
    return frame


def start_ray(object_store_bytes: int) -> Any:
    try:
        import ray
    except ImportError:
        return None
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR,
             log_to_driver=False, object_store_memory=object_store_bytes)  # fmt: skip
    return ray


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES_MIB), metavar="MIB")
    parser.add_argument("--memory-mib", type=int, default=1024)
    args = parser.parse_args()
    largest = max(args.sizes)
    ray = start_ray(max(2 << 30, 4 * largest * MIB))
    pool = concurrent.futures.ProcessPoolExecutor(1)
    targets: list[Target] = []
    with tempfile.TemporaryDirectory(prefix="fnk-bench-df-") as tmp:
        stack = Stack(Path(tmp) / "state", {"python": 1}, gateway_listen="127.0.0.1:0",
                      max_payload_bytes=max(2 << 30, 2 * args.memory_mib * MIB))  # fmt: skip
        stack.start()
        try:
            client = Client(stack.gateway_address)
            run = client.create_run("echo", runtime="python", handler="handler.handle",
                                    files=HANDLER, memory_mb=16_384)  # fmt: skip
            assert run.phase == "Ready", run.message
            cases: dict[str, Callable[[Any], Any]] = {
                "fnkernel NAME(df), same machine": lambda df: client.invoke("echo", df).value(),
                "fnkernel, streamed (another machine)": lambda df: client.invoke(
                    "echo", df, by_reference=False
                ).value(),
                "ProcessPoolExecutor(1)": lambda df: pool.submit(echo, df).result(),
            }
            if ray is not None:
                actor = ray.remote(Echo).remote()
                cases[RAY_CASE] = lambda df: ray.get(actor.handle.remote(df))
            else:
                print("Ray is not installed (pip install -e '.[peers]'): left out")
            for mib in args.sizes:
                targets += _size(mib, cases, args.rounds)
            for by_reference in (True, False):
                _memory(stack, client, args.memory_mib, by_reference)
        finally:
            stack.stop()
            pool.shutdown()
    return verdicts(targets)


class Echo:
    """Ray's actor (made remote in main, so importing this module needs no Ray)."""

    def handle(self, frame: Any) -> Any:
        return frame


def _size(mib: int, cases: dict[str, Callable[[Any], Any]], rounds: int) -> list[Target]:
    frame = frame_of(mib)
    size = len(payloads.encode(frame)[0])
    taken: dict[str, list[float]] = {case: [] for case in cases}
    for case, call in cases.items():  # warm: imports, the first map, Ray's actor
        back = call(frame)
        if mib <= 64:  # the whole comparison of a larger one takes minutes
            pd.testing.assert_frame_equal(back, frame)
        assert len(back) == len(frame) and back.dtypes.equals(frame.dtypes), case
    for turn in range(rounds):
        order = list(cases)[turn % len(cases) :] + list(cases)[: turn % len(cases)]
        for case in order:
            started = time.perf_counter()
            cases[case](frame)
            taken[case].append(time.perf_counter() - started)
    print(f"\n{mib} MiB frame ({size / MIB:.1f} MiB as Arrow, {len(frame):,} rows), "
          f"median of {rounds}")  # fmt: skip
    ray_ms = statistics.median(taken[RAY_CASE]) * 1000 if RAY_CASE in taken else 0.0
    for case, samples in taken.items():
        ms = statistics.median(samples) * 1000
        against = f"{ms / ray_ms:6.2f}x Ray" if ray_ms else ""
        print(f"  {case:<40} {ms:10.1f} ms {against}")
    if not ray_ms:
        return []
    ours = statistics.median(taken["fnkernel NAME(df), same machine"]) * 1000
    return [Target(f"{mib} MiB frame, fnkernel / Ray's actor call", ours / ray_ms, 1.0)]


def _memory(stack: Stack, client: Client, mib: int, by_reference: bool) -> None:
    """One call of about `mib` MiB, through the spool (`by_reference`) or streamed; what each
    process of the stack took above its resting size at its peak, in payloads."""
    frame = frame_of(mib)
    size = len(payloads.encode(frame)[0])
    client.invoke("echo", frame_of(1)).value()  # the worker is up
    processes = {
        component.name: component.child.pid
        for component in stack.components
        if component.child is not None
    }
    server = processes["python-0-server"]
    for pid in _children(server):
        processes["worker"] = pid
    resting = {name: _status(pid, "VmRSS") for name, pid in processes.items()}
    for pid in processes.values():
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset the peak (VmHWM) to now
    back = client.invoke("echo", frame, by_reference=by_reference).value()
    assert len(back) == len(frame)
    how = "same machine" if by_reference else "streamed"
    print(f"\nmemory of one {size / MIB:.0f} MiB call ({how}): peak above resting")
    for name, pid in processes.items():
        grew = _status(pid, "VmHWM") - resting[name]
        print(f"  {name:<24} {grew / MIB:9.1f} MiB  {grew / size:5.2f} payloads")


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def _children(pid: int) -> list[int]:
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


if __name__ == "__main__":
    raise SystemExit(main())
