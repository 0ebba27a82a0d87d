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
* **a ProcessPoolExecutor** of one process in the notebook (pickle through a pipe);
* **the conversions alone**: the frame to Arrow and back twice in this process, no call — what
  any path that carries it as Arrow IPC does (the caller writes it, the worker reads it, and the
  result the same way back), so the floor under fnkernel's figure that no transport removes.

fnkernel's call and Ray's are taken head to head, round after round, which goes first
alternating; then the other cases in turn; the median of each, its ratio to Ray's actor call.
Then **memory**: one call of about 1 GiB through the spool path and one streamed, with each
stack process's peak resident memory reset before it (``/proc/PID/clear_refs``) and read after
(``VmHWM``): what each took above its resting size, in payloads. And the **whole
stack at once**, sampled every millisecond or so through the call: every stack process's
anonymous memory above resting plus the spool's files (tmpfs: memory, counted once however many
processes map them; free files too), and the caller's own above resting, beside it — the peak
of each sum, in payloads. Each on a fresh stack of its own, so nothing the earlier calls left
(a process's retained memory, the spool's free files) hides in "resting".

Targets (issue 47): fnkernel <= Ray's actor call at 1 MiB and up; the stack at once <= 2
payloads on the same machine. Not part of ``make bench`` (Ray is an optional extra):
``make bench-peers`` runs it after benchmarks.peers.
Usage: python -m benchmarks.dataframes [--rounds N] [--sizes MIB ...] [--memory-mib N]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from benchmarks.invoke import Target, verdicts
from benchmarks.peer_parts import start_ray
from benchmarks.processes import stack_processes, status_bytes
from fnkernel.adapters import _dataframes
from fnkernel.runtime_server import payloads
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.lifecycle.stack import Stack

MIB = 1 << 20
SIZES_MIB = (1, 64, 512)
HANDLER = {"handler.py": "def handle(frame):\n    return frame\n"}
RAY_CASE = "Ray actor call"
OURS_CASE = "fnkernel NAME(df), same machine"
FLOOR_CASE = "the conversions alone (no call)"
SPOOL_PART = "the spool's files"


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
        stack, client = _echo_stack(Path(tmp) / "state", args.memory_mib)
        try:
            cases: dict[str, Callable[[Any], Any]] = {
                FLOOR_CASE: lambda df: _converted(_converted(df)),
                OURS_CASE: lambda df: client.invoke("echo", df).value(),
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
        finally:
            stack.stop()
            pool.shutdown()
        for n, by_reference in enumerate((True, False)):
            # A stack of its own: nothing of the calls above kept by its processes or spool.
            stack, client = _echo_stack(Path(tmp) / f"memory-{n}", args.memory_mib)
            try:
                targets += _memory(stack, client, args.memory_mib, by_reference)
            finally:
                stack.stop()
    return verdicts(targets)


def _echo_stack(state: Path, memory_mib: int) -> tuple[Stack, Client]:
    stack = Stack(state, {"python": 1}, gateway_listen="127.0.0.1:0",
                  max_payload_bytes=max(2 << 30, 2 * memory_mib * MIB))  # fmt: skip
    stack.start()
    client = Client(stack.gateway_address)
    run = client.create_run("echo", runtime="python", handler="handler.handle",
                            files=HANDLER, memory_mb=16_384)  # fmt: skip
    assert run.phase == "Ready", run.message
    return stack, client


def _converted(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` to Arrow and back as the codec converts it (its threads too), without the
    IPC stream's bytes: the conversions alone."""
    return _dataframes.to_frame(payloads.arrow_table(frame))


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
    # The target's two head to head first, which goes first alternating, nothing else between
    # them; then the rest in turn. Taken all in one rotation, each case always followed the
    # same other (ours the conversions alone, which warm the very code it runs; Ray's the
    # pool): at 1 MiB 1.15x Ray so, 1.16-1.23x head to head (docs/architecture.md,
    # "DataFrames beside the peers").
    pair = [case for case in (OURS_CASE, RAY_CASE) if case in cases]
    rest = [case for case in cases if case not in pair]
    turns = [pair if turn % 2 == 0 else pair[::-1] for turn in range(rounds)]
    turns += [rest[turn % len(rest) :] + rest[: turn % len(rest)] for turn in range(rounds)]
    for order in turns:
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
    ours = statistics.median(taken[OURS_CASE]) * 1000
    floor = statistics.median(taken[FLOOR_CASE]) * 1000
    print(f"  fnkernel above the conversions alone: {ours - floor:.1f} ms")
    if not ray_ms:
        return []
    return [Target(f"{mib} MiB frame, fnkernel / Ray's actor call", ours / ray_ms, 1.0)]


def _memory(stack: Stack, client: Client, mib: int, by_reference: bool) -> list[Target]:
    """One call of about `mib` MiB, through the spool (`by_reference`) or streamed; what each
    process of the stack took above its resting size at its peak, in payloads; and the peak of
    the whole stack's at any one moment, sampled: on the same machine, issue 47's target."""
    frame = frame_of(mib)
    size = len(payloads.encode(frame)[0])
    client.invoke("echo", frame_of(1)).value()  # the worker is up
    processes = stack_processes(stack)
    resting = {name: status_bytes(pid, "VmRSS") for name, pid in processes.items()}
    for pid in processes.values():
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset the peak (VmHWM) to now
    sampler = _Sampler(processes, stack.spool)
    with sampler:
        back = client.invoke("echo", frame, by_reference=by_reference).value()
    assert len(back) == len(frame)
    how = "same machine" if by_reference else "streamed"
    print(f"\nmemory of one {size / MIB:.0f} MiB call ({how}): peak above resting")
    for name, pid in processes.items():
        grew = status_bytes(pid, "VmHWM") - resting[name]
        print(f"  {name:<24} {grew / MIB:9.1f} MiB  {grew / size:5.2f} payloads")
    stack_peak, caller_peak = sampler.peaks()
    print(f"  {'the stack at once':<24} {stack_peak / MIB:9.1f} MiB  {stack_peak / size:5.3f} "
          f"payloads (its processes and its spool; {sampler.samples} samples)")  # fmt: skip
    print(f"  {'the caller':<24} {caller_peak / MIB:9.1f} MiB  {caller_peak / size:5.2f} "
          f"payloads (beside the frame it sent)")  # fmt: skip
    held = ", ".join(f"{part} {grew / MIB:.1f}" for part, grew in sampler.at_peak.items() if grew)
    print(f"  at the stack's peak, above resting (MiB): {held}; the payload {size / MIB:.1f}")
    if not by_reference:
        return []
    label = f"{size / MIB:.0f} MiB call, the stack's memory at once (same machine)"
    return [Target(label, stack_peak / size, 2.0, " payloads")]


class _Sampler:
    """The stack's memory above resting, sampled on a thread while the block runs: its
    processes' anonymous memory and its spool's files; and this process's (the caller's)."""

    def __init__(self, processes: dict[str, int], spool: Path) -> None:
        self.processes = processes
        self.spool = spool
        # At rest: the processes' anonymous memory, and the spool's files (the warm-up call's
        # free ones), so that only what the call adds is counted.
        self.resting = self._parts()
        self.caller_resting = status_bytes(os.getpid(), "RssAnon")
        self.stack_peak = self.caller_peak = 0
        self.at_peak: dict[str, int] = {}  # each part, above resting, at the stack's peak
        self.samples = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> None:
        self._thread.start()

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join(timeout=10)

    def peaks(self) -> tuple[int, int]:
        return self.stack_peak, self.caller_peak

    def _run(self) -> None:
        while not self._done.wait(0.001):
            parts = self._parts()
            grew = {part: held - self.resting[part] for part, held in parts.items()}
            if sum(grew.values()) > self.stack_peak:
                self.stack_peak, self.at_peak = sum(grew.values()), grew
            caller = status_bytes(os.getpid(), "RssAnon") - self.caller_resting
            self.caller_peak = max(self.caller_peak, caller)
            self.samples += 1

    def _parts(self) -> dict[str, int]:
        """Each process's anonymous memory, and what the spool's files hold (tmpfs: memory),
        free ones too."""
        parts = {name: status_bytes(pid, "RssAnon") for name, pid in self.processes.items()}
        parts[SPOOL_PART] = 0
        for path in self.spool.rglob("*"):
            try:
                parts[SPOOL_PART] += path.lstat().st_blocks * 512
            except FileNotFoundError:
                continue
        return parts


if __name__ == "__main__":
    raise SystemExit(main())
