"""grpc's I/O engine, measured (issue 48; docs/architecture.md, "grpc's I/O engine"): the same
calls with every process on grpc's legacy poller, what fnkernel's processes run on
(runtime_server.grpc_engine), and on its EventEngine, grpc's default for Python, interleaved in
one run.

For each engine, every process of a case on it, the caller too (a process of its own):

* the floor without an HTTP hop — a blocking gRPC call to a thread-pool relay, on to a bare gRPC
  echo (benchmarks.peers' FLOOR_NO_HTTP);
* a bare gRPC echo;
* fnkernel's ``Client.invoke`` of a Run that returns its event, on a stack of its own.

The callers are asked for a batch of calls in turn, the order turned each round; p50 of each
case, and the legacy poller's figure as a multiple of the EventEngine's.
Usage: python -m benchmarks.engines [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from benchmarks.invoke import ECHO_METHOD, PY_HANDLER, bench_server
from benchmarks.throughput import relay
from fnkernel.runtime_server import grpc_engine
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.daemon import Child
from fnkernel.runtime_server.lifecycle.stack import Stack
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS

# An engine's name, and GRPC_EXPERIMENTS for its processes (None: as fnkernel chooses).
ENGINES: dict[str, str | None] = {
    "legacy poller (fnkernel's)": None,
    "EventEngine (grpc's default)": "",
}
CASES = ("floor without the HTTP hop", "bare gRPC echo", "fnkernel Client.invoke")
BATCH = 100  # calls a caller makes when asked
VALUE = {"s": "x" * 8}  # 16 bytes of JSON, benchmarks.peers' small payload


@contextmanager
def engine_environment(experiments: str | None) -> Iterator[None]:
    """The processes started inside run on the engine `experiments` names."""
    before = os.environ.pop(grpc_engine.EXPERIMENTS_ENV, None)
    if experiments is not None:
        os.environ[grpc_engine.EXPERIMENTS_ENV] = experiments
    try:
        yield
    finally:
        os.environ.pop(grpc_engine.EXPERIMENTS_ENV, None)
        if before is not None:
            os.environ[grpc_engine.EXPERIMENTS_ENV] = before


def caller(chain: str, echo: str, gateway: str) -> None:
    """A caller process: the gateway's token its first line on stdin (never in argv: ``ps``
    shows that); then for each case named on stdin, BATCH calls, their seconds on stdout."""
    token = sys.stdin.readline().strip() or None
    body = json.dumps(VALUE, separators=(",", ":")).encode()
    client = Client(gateway, token=token)
    no_http = grpc.insecure_channel(chain, options=CHANNEL_OPTIONS).unary_unary(ECHO_METHOD)
    bare = grpc.insecure_channel(echo, options=CHANNEL_OPTIONS).unary_unary(ECHO_METHOD)
    calls: dict[str, Callable[[], Any]] = {
        CASES[0]: lambda: json.loads(no_http(body, timeout=60)),
        CASES[1]: lambda: bare(body, timeout=60),
        CASES[2]: lambda: client.invoke("echo", VALUE).decoded(),
    }
    for call in calls.values():
        for _ in range(200):  # warm-up
            call()
    print("ready", flush=True)
    for line in sys.stdin:
        call = calls[line.strip()]
        seconds = []
        for _ in range(BATCH):
            started = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - started)
        print(json.dumps(seconds), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--caller", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.caller:
        caller(*args.caller)
        return 0
    with tempfile.TemporaryDirectory(prefix="fnkernel-engines-") as tmp:
        children: list[Child] = []
        stacks: list[Stack] = []
        callers: dict[str, subprocess.Popen[str]] = {}
        try:
            for number, (engine, experiments) in enumerate(ENGINES.items()):
                with engine_environment(experiments):
                    echo = bench_server("--echo-server", f"unix:{tmp}/echo{number}.sock")
                    children.append(echo)
                    chain = relay("sync", f"unix:{tmp}/relay{number}.sock", echo.address)
                    children.append(chain)
                    stack = Stack(Path(tmp) / f"stack{number}", {"python": 1},
                                  gateway_listen="127.0.0.1:0")  # fmt: skip
                    stacks.append(stack)
                    stack.start()
                    Client(stack.gateway_address, token=stack.token).create_run(
                        "echo", runtime="python", handler="handler.handle",
                        files={"handler.py": PY_HANDLER})  # fmt: skip
                    argv = [sys.executable, "-m", "benchmarks.engines", "--caller", chain.address,
                            echo.address, stack.gateway_address]  # fmt: skip
                    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               text=True)  # fmt: skip
                    callers[engine] = process
                    assert process.stdin is not None
                    process.stdin.write(f"{stack.token or ''}\n")
                    process.stdin.flush()
            for process in callers.values():
                assert process.stdout is not None
                if process.stdout.readline().strip() != "ready":
                    raise RuntimeError("a caller did not start")
            samples = measure(callers, args.rounds)
        finally:
            for process in callers.values():
                process.kill()
                process.wait()
            for stack in stacks:
                stack.stop()
            for child in children:
                child.stop(10)
    report(samples)
    return 0


def measure(
    callers: dict[str, subprocess.Popen[str]], rounds: int
) -> dict[tuple[str, str], list[float]]:
    """Each (engine, case)'s seconds a call, over `rounds` of one batch each, in turn."""
    keys = [(engine, case) for case in CASES for engine in callers]
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    for number in range(rounds):
        turn = number % len(keys)
        for engine, case in keys[turn:] + keys[:turn]:
            process = callers[engine]
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write(case + "\n")
            process.stdin.flush()
            samples[engine, case] += json.loads(process.stdout.readline())
    return samples


def report(samples: dict[tuple[str, str], list[float]]) -> None:
    legacy, event_engine = ENGINES
    print(f"\ngrpc's I/O engine, p50 ms ({len(next(iter(samples.values())))} calls a case)")
    print(f"{'case':32s} {legacy:>28s} {event_engine:>30s} {'ratio':>7s}")
    for case in CASES:
        ours, theirs = (statistics.median(samples[engine, case]) * 1e3 for engine in ENGINES)
        print(f"{case:32s} {ours:28.3f} {theirs:30.3f} {ours / theirs:6.2f}x")


if __name__ == "__main__":
    sys.exit(main())
