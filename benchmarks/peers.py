"""fnkernel beside the peers a user would pick instead, interleaved in one run (issue 30).

Not part of `make bench`: the peers are optional extras (``pip install -e '.[peers]'``; `make
bench-peers` installs them). A peer that is not installed is left out, and the report says so.

* **Python driver**, one caller, a Python value in and a Python value out (``{"s": "x…"}``, its
  compact JSON the payload's size): ``Client.invoke(...).decoded()`` on a Run that returns its
  event; the same request as raw ``http.client`` to the same gateway (encoded as the client
  encodes, decoded with the standard library's json); the same Run called on runtimed's
  FunctionRuntime directly, over its Unix socket with grpc's blocking stub, as the gateway calls
  it — the alternative for a caller on the stack's own machine (issue 48), our runtimed,
  Runtime Server and worker without the gateway; Ray's actor method and task
  (``ray.get(f.remote(v))``);
  and the *floor chain*: raw HTTP to a bare tornado server that relays the body over grpc.aio to
  a bare grpc.aio relay and on to a bare gRPC echo (benchmarks.throughput's) — as many hops as
  gateway → runtimed → Runtime Server, none of our code, no worker. Beside it, issue 48's
  alternative floor chains, made of other parts: its HTTP hop on uvloop's event loop; grpc's
  blocking call from a thread pool on both hops (tornado's and the relay's); its HTTP hop on
  granian (an HTTP server in Rust, relaying with grpc.aio); no HTTP hop at all (a blocking
  gRPC call from Python to the thread-pool relay), what a caller on the stack's machine calling
  runtimed directly would stand on; and the same without HTTP, each call a message of a stream
  already open on both hops, as fnkernel's calls go (docs/architecture.md, "Call streams"),
  through a thread-pool relay as runtimed's and through a grpc.aio one. The report names the
  least of them. And the **design's floor**: our path's processes with bare parts in them and
  none of our code — a call stream through a grpc.aio relay (runtimed) to a grpcio server (the
  Runtime Server) that hands each message over pipes to a worker of the stream's own, which
  reads the value and writes it again (msgspec and orjson, as our worker): what the process
  count the design fixes (SPEC: a Runtime Pod is runtimed and a Runtime Server; a handler runs
  in a worker) costs here before any code of ours.
* **HTTP**, one client (raw ``http.client``, the body's bytes in and out, the same code for
  every server): fnkernel's gateway, Jupyter Kernel Gateway in notebook-http mode (a notebook
  whose ``# POST /echo`` cell prints the body back), and a bare tornado echo.
* **Bare hops** (the bytes there and back): a bare gRPC echo on a Unix socket, and a pipe to a
  process. *The bare hops summed* — the tornado echo, the gRPC echo twice, the pipe — is the
  least the seed's path can cost with these frameworks (HTTP, two gRPC hops, the worker), before
  any JSON is decoded: the floor a latency target is judged against.
* **10 in flight** (small payload): ``Client.invoke`` from 10 threads on 10 Runs; ``Client.map``
  over a Run with 10 replicas (the kernel's ``NAME.map`` calls it); Ray's 10 outstanding tasks
  and 10 actors; raw ``http.client`` from 10 threads on the same Runs and on the floor chain (its
  floor); the floor without the HTTP hop from 10 threads, a blocking gRPC call on a channel each
  or a call on a stream each through either relay (the floors under ``Client.invoke``'s direct
  calls), and the design's floor from 10 threads (a worker each, as the 10 Runs'); and over HTTP, benchmarks.throughput's asyncio load generator (10 kept-alive
  connections) on the gateway's 10 Runs, on Kernel Gateway's kernel pool, on the floor chain and
  on the tornado echo. Issue 48's multiplexed alternative to 10 HTTP/1.1 connections: the floor
  chain on granian from 10 threads, and the same 10 calls at a time on one HTTP/2 connection
  (httpx); with the CPU each process spends a call.

* **Fan-out** (issue 48): 200 items of a ~5 ms CPU-bound handler, two at a time, by
  ``Client.map`` over a Run of two replicas and by a ``ProcessPoolExecutor(2)`` — the peer a
  notebook user tries first — with each item's cost above the handler's own work, and the
  map's bound with no hand-off an item (``benchmarks.fanout``).

The latency cases of a section are called in batches, the cases in turn and their order turned
each batch, over rounds: a slow stretch of this noisy machine falls on all of them, and none
always follows the same one. (Called call by call in turn, each call found the processes it
needs asleep and their caches cold: in one run every case took about twice its time in a loop,
fnkernel's and Ray's alike.) Warm-up calls are not counted; p50 and p99 of every case, and each
ratio.

Targets (issue 30): Python 100 KB and 1 MiB <= Ray's actor call; small <= 1.5x Ray's actor
call; 10 in flight >= Ray tasks' calls/s; ``Client.invoke`` <= 1.05x the raw request at every
size (judged on the two called call by call in turn on the same Run: the median of the pairs'
ratios, ``Bench.paired``); HTTP >= 4x ahead of Kernel Gateway in latency (every size) and in throughput. Where the
bare hops summed are already past a latency target, the report says so: that target is below
what this path can reach here.
Usage: python -m benchmarks.peers [--rounds N] [--seconds S] [--sizes SIZE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from benchmarks import fanout
from benchmarks.invoke import (
    ECHO_METHOD,
    PY_HANDLER,
    PipeEcho,
    Target,
    ratio,
    row,
    verdicts,
)
from benchmarks.peer_parts import (
    FLOOR_DESIGN,
    FLOOR_DESIGN_THREADS,
    IN_FLIGHT,
    KernelGateway,
    NoHttpFloor,
    RawHttp,
    payload_of,
    ray_cases,
    start_peers,
    threaded,
)
from benchmarks.processes import cpu_per_call, stack_processes
from benchmarks.throughput import drive, floor_chain, load, relay
from fnkernel.runtime_server import payloads
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.daemon import Child, start
from fnkernel.runtime_server.lifecycle.stack import Stack
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS
from fnkernel.runtime_server.wire import POD_KEY

SIZES = {"small": 16, "100 KB": 100_000, "1 MiB": 1 << 20, "6 MiB": 6 << 20}
# Calls per case per round at each size (the large ones take long on the slow peers).
CALLS = {"small": 300, "100 KB": 150, "1 MiB": 30, "6 MiB": 6}
BATCHES = 3  # each case's calls of a round, in this many batches
# Client.invoke and the raw request, call by call in turn: pairs per round (Bench.paired).
PAIRS = {"small": 300, "100 KB": 150, "1 MiB": 40, "6 MiB": 20}
WARMUP = {"small": 30, "100 KB": 10, "1 MiB": 3, "6 MiB": 1}
CASE_SECONDS = 60.0  # a bound on each case's time per round, as well as the count
TARGETS = {"small": 1.5, "100 KB": 1.0, "1 MiB": 1.0}  # x Ray's actor call
CLIENT_TARGET = 1.05  # x the raw request
KG_AHEAD = 4.0  # x Kernel Gateway
CLIENT_CASE = "fnkernel Client.invoke"
RAW_CASE = "raw HTTP to the gateway"
RUNTIMED_CASE = "no gateway: gRPC to runtimed (an alternative)"
FLOOR_CHAIN = "floor chain (HTTP → gRPC relay → gRPC echo)"
# Issue 48's alternative floor chains: the same hops made of other parts, none of our code.
FLOOR_UVLOOP = "floor chain, its HTTP hop on uvloop"
FLOOR_THREADS = "floor chain, blocking gRPC from threads, both hops"
FLOOR_NO_HTTP = "floor without the HTTP hop (gRPC → relay → echo)"
FLOOR_GRANIAN = "floor chain, its HTTP hop on granian (Rust)"
TORNADO = "tornado echo (floor)"
GRPC_ECHO = "gRPC echo"
PIPE = "pipe to a process"
CLIENT_THREADS = f"fnkernel Client.invoke, {IN_FLIGHT} threads on {IN_FLIGHT} Runs"
CHAIN_THREADS = f"floor chain, {IN_FLIGHT} threads (raw http.client)"
NO_HTTP_THREADS = f"floor without the HTTP hop, {IN_FLIGHT} threads (blocking gRPC)"
GRANIAN_THREADS = f"floor chain on granian, {IN_FLIGHT} threads (raw http.client)"
GRANIAN_H2 = f"floor chain on granian, one HTTP/2 connection, {IN_FLIGHT} streams (httpx)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="each 10-in-flight case, a round"
    )
    parser.add_argument("--sizes", nargs="*", choices=list(SIZES), default=list(SIZES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fnkernel-peers-") as tmp:
        root = Path(tmp)
        children: list[Child] = []
        closers: list[Callable[[], None]] = []
        stack = Stack(root / "state", {"python": 1}, gateway_listen="127.0.0.1:0")
        stack.start()
        try:
            echo, proxy, front = floor_chain(tmp)
            children += (echo, proxy, front)
            bare = NoHttpFloor(tmp, echo)
            children += bare.children
            closers.append(bare.close)
            alternatives = {
                FLOOR_UVLOOP: relay("http-uvloop", "-", proxy.address),
                FLOOR_THREADS: relay("http-threads", "-", bare.relay.address),
            }
            if importlib.util.find_spec("granian") is None:
                print("granian is not installed: left out (pip install -e '.[peers]')")
            else:
                alternatives[FLOOR_GRANIAN] = relay("http-granian", "-", proxy.address)
            children += alternatives.values()
            http_echo = start([sys.executable, "-m", "benchmarks.gateway", "--http-echo"])
            children.append(http_echo)
            pipe, kernel_gateway, ray = start_peers(root, closers)
            bench = Bench(
                stack, front.address, echo.address, http_echo.address, pipe, kernel_gateway, ray
            )
            closers.append(bench.fan_out.close)
            bench.alternatives = {
                label: RawHttp(child.address, "/") for label, child in alternatives.items()
            }
            bench.chain_processes = {
                "floor chain: tornado relay (grpc.aio)": front.pid,
                "floor chain: grpc.aio relay": proxy.pid,
                "floor chain: gRPC echo": echo.pid,
            }
            if FLOOR_GRANIAN in alternatives:
                bench.on_granian(alternatives[FLOOR_GRANIAN], proxy.pid, echo.pid)
            bench.bare = bare
            for number in range(args.rounds):
                print(f"round {number + 1} of {args.rounds}", flush=True)
                bench.round(args.sizes, args.seconds, warm=number == 0)
        finally:
            for close in reversed(closers):
                close()
            stack.stop()
            for child in children:
                child.stop(10)
    return bench.report(args.sizes)


class Bench:
    """The cases, their samples over the rounds, and the report."""

    def __init__(
        self,
        stack: Stack,
        chain: str,
        grpc_echo: str,
        http_echo: str,
        pipe: PipeEcho,
        kernel_gateway: KernelGateway | None,
        ray: Any,
    ) -> None:
        self.stack = stack
        self.client = Client(stack.gateway_address, token=stack.token)
        self.runs = [f"echo{i}" for i in range(IN_FLIGHT)]
        runs = [(run, PY_HANDLER, 1) for run in self.runs]
        runs += [("echo-set", PY_HANDLER, IN_FLIGHT), *fanout.RUNS]
        for name, source, replicas in runs:
            self.client.create_run(name, runtime="python", handler="handler.handle",
                                   files={"handler.py": source}, replicas=replicas)  # fmt: skip
        self.fan_out = fanout.FanOut(self.client)  # issue 48's map beside the pool
        # Issue 48's alternative for a caller on the stack's machine: runtimed's FunctionRuntime
        # on its Unix socket, as the gateway calls it (the Run's UID, its pod for the fence).
        status = self.client.status("echo0")
        runtimed = stack.component("python-0-runtimed").child
        assert runtimed is not None
        self.runtimed_call = pb_grpc.FunctionRuntimeStub(
            grpc.insecure_channel(runtimed.address, options=CHANNEL_OPTIONS)
        ).InvokeFunction
        self.runtimed_run = pb.FunctionRegistration(run_uid=status["uid"])
        self.runtimed_pod = ((POD_KEY, "python-0"),)
        self.raw = RawHttp(stack.gateway_address, "/v1/runs/echo0:invoke", stack.token)
        self.chain = RawHttp(chain, "/")
        # The 10 threads' connections: one each, on its Run, and on the floor chain.
        self.raw_threads = [
            RawHttp(stack.gateway_address, f"/v1/runs/{run}:invoke", stack.token)
            for run in self.runs
        ]
        self.chain_threads = [RawHttp(chain, "/") for _ in range(IN_FLIGHT)]
        channel = grpc.insecure_channel(grpc_echo, options=CHANNEL_OPTIONS)
        self.grpc_echo = channel.unary_unary(ECHO_METHOD)
        self.pipe = pipe
        self.http = {
            "fnkernel gateway": self.raw,
            TORNADO: RawHttp(http_echo, "/"),
        }
        self.http_addresses = {
            "fnkernel gateway": (stack.gateway_address, stack.token, [
                f"/v1/runs/{run}:invoke" for run in self.runs]),
            TORNADO: (http_echo, None, ["/"] * IN_FLIGHT),
            "floor chain": (chain, None, ["/"] * IN_FLIGHT),
        }  # fmt: skip
        if kernel_gateway is not None:
            self.http["Jupyter Kernel Gateway"] = RawHttp(kernel_gateway.address, "/echo")
            self.http_addresses["Jupyter Kernel Gateway"] = (
                kernel_gateway.address, None, ["/echo"] * IN_FLIGHT)  # fmt: skip
        self.ray_calls: dict[str, Callable[[Any], Any]] = {}
        self.ray_outstanding: Callable[[int, float], float] | None = None
        if ray is not None:
            self.ray_calls, self.ray_outstanding = ray_cases(ray)
        self.latency: dict[tuple[str, str, str], list[float]] = {}  # (section, size, case): ms
        self.rates: dict[str, list[float]] = {}  # 10 in flight: calls/s per round
        self.pair_ratios: dict[str, list[float]] = {}  # size: Client / raw, pair by pair
        self._batches = 0  # so far: where the next batch's order of the cases starts
        # CPU µs per call of each process, per round: Client.invoke and the floor chain from
        # IN_FLIGHT threads. The floor chain's processes are set by main.
        self.cpu: dict[str, dict[str, list[float]]] = {}
        self.chain_processes: dict[str, int] = {}
        # Issue 48's alternative floor chains (set by main): over HTTP, and without it.
        self.alternatives: dict[str, RawHttp] = {}
        # The same from IN_FLIGHT threads: the floor under the Client's calls on this machine,
        # which skip the HTTP hop (docs/protocol.md, "Calling runtimed directly").
        self.bare: NoHttpFloor | None = None
        # The floor chain with its HTTP hop on granian, from 10 threads and multiplexed: its
        # address and processes (``on_granian``).
        self.granian = ""
        self.granian_processes: dict[str, int] = {}

    def on_granian(self, front: Child, relay_pid: int, echo_pid: int) -> None:
        """Measure the floor chain on granian (`front`) with IN_FLIGHT calls in flight too."""
        self.granian = front.address
        self.granian_processes = {
            "floor chain: granian relay (grpc.aio)": front.pid,
            "floor chain: grpc.aio relay": relay_pid,
            "floor chain: gRPC echo": echo_pid,
        }
        self.http_addresses["floor chain on granian"] = (front.address, None, ["/"] * IN_FLIGHT)

    def python_cases(self, value: Any) -> dict[str, Callable[[], Any]]:
        """A Python value in, a Python value out."""
        client, raw, chain = self.client, self.raw, self.chain
        cases: dict[str, Callable[[], Any]] = {
            CLIENT_CASE: lambda: client.invoke("echo0", value).decoded(),
            RAW_CASE: lambda: json.loads(raw.post(payloads.dumps(value))),
            RUNTIMED_CASE: lambda: self._runtimed(value),
        }
        for label, call in self.ray_calls.items():
            cases[label] = lambda call=call: call(value)  # type: ignore[misc]
        cases[FLOOR_CHAIN] = lambda: json.loads(chain.post(payloads.dumps(value)))
        for label, other in self.alternatives.items():
            cases[label] = lambda other=other: json.loads(other.post(payloads.dumps(value)))  # type: ignore[misc]
        if (bare := self.bare) is not None:
            unary = bare.call
            cases[FLOOR_NO_HTTP] = lambda: json.loads(unary(payloads.dumps(value), timeout=120))
            for floor in (*bare.streams, bare.design):
                streamed = floor.callers[0]
                cases[floor.latency] = lambda s=streamed: json.loads(s.call(payloads.dumps(value)))  # type: ignore[misc]
        return cases

    def _runtimed(self, value: Any) -> Any:
        request = pb.InvokeFunctionRequest(
            registration=self.runtimed_run, input=payloads.dumps(value), content_type=payloads.JSON
        )
        response = self.runtimed_call(request, timeout=120, metadata=self.runtimed_pod)
        return json.loads(response.output)

    def bare_cases(self, body: bytes) -> dict[str, Callable[[], Any]]:
        echo, pipe = self.grpc_echo, self.pipe
        return {GRPC_ECHO: lambda: echo(body, timeout=120), PIPE: lambda: pipe.call(body)}

    def http_cases(self, body: bytes) -> dict[str, Callable[[], Any]]:
        """The body's bytes in, the answer's bytes out (decoded once, to check it)."""
        return {
            label: (lambda c=connection: c.post(body)) for label, connection in self.http.items()
        }

    def round(self, sizes: list[str], seconds: float, *, warm: bool) -> None:
        for size in sizes:
            value = payload_of(SIZES[size])
            body = payloads.dumps(value)
            sections = {
                "python": self.python_cases(value),
                "http": self.http_cases(body),
                "bare": self.bare_cases(body),
            }
            for section, cases in sections.items():
                if warm:  # and check each answer once: the same value back
                    for label, call in cases.items():
                        answer = call()
                        got = json.loads(answer) if isinstance(answer, bytes) else answer
                        assert got == value, f"{label} answered something else at {size}"
                        for _ in range(WARMUP[size]):
                            call()
                # In batches, the cases in turn, the order turned by one each batch: a slow
                # stretch falls on every case, and none always follows the same one.
                labels = list(cases)
                budget = time.monotonic() + CASE_SECONDS * len(cases)
                for batch in range(BATCHES):
                    turn = (self._batches + batch) % len(labels)
                    for label in labels[turn:] + labels[:turn]:
                        samples = self.latency.setdefault((section, size, label), [])
                        call = cases[label]
                        for _ in range(max(1, CALLS[size] // BATCHES)):
                            started = time.perf_counter()
                            call()
                            samples.append((time.perf_counter() - started) * 1000)
                    if time.monotonic() > budget:
                        break
            self.paired(size, sections["python"])
        self._batches += BATCHES
        self.in_flight(seconds)
        self.fan_out.round(warm=warm)

    def paired(self, size: str, cases: dict[str, Callable[[], Any]]) -> None:
        """Client.invoke and the same raw request, call by call in turn (A B, then B A) on the
        same Run: the two differ only in the client's own code, so a slow stretch falls on both
        alike; the batches of the Python section are minutes apart from Ray's cases and drift
        more than the 5% the target allows. The Client / raw target is judged on these: the
        median of each pair's ratio."""
        labels = [CLIENT_CASE, RAW_CASE]
        budget = time.monotonic() + CASE_SECONDS
        for turn in range(PAIRS[size]):
            took = {}
            for label in labels if turn % 2 == 0 else labels[::-1]:
                started = time.perf_counter()
                cases[label]()
                took[label] = (time.perf_counter() - started) * 1000
                self.latency.setdefault(("paired", size, label), []).append(took[label])
            self.pair_ratios.setdefault(size, []).append(took[CLIENT_CASE] / took[RAW_CASE])
            if time.monotonic() > budget:
                break

    def in_flight(self, seconds: float) -> None:
        small = payload_of(SIZES["small"])
        client = self.client

        body = payloads.dumps(small)
        raw, chain = self.raw_threads, self.chain_threads

        def mapped() -> float:
            items = [small] * max(200, int(seconds * 400))
            started = time.perf_counter()
            client.map("echo-set", items, concurrency=IN_FLIGHT)
            return len(items) / (time.perf_counter() - started)

        cases: dict[str, Callable[[], float]] = {
            CLIENT_THREADS: lambda: self._counted(
                CLIENT_THREADS,
                lambda: threaded(
                    lambda slot: client.invoke(self.runs[slot], small).decoded(), seconds
                ),
                stack_processes(self.stack),
            ),
            f"fnkernel Client.map, {IN_FLIGHT} replicas": mapped,
            f"raw http.client, {IN_FLIGHT} threads on the {IN_FLIGHT} Runs": lambda: threaded(
                lambda slot: json.loads(raw[slot].post(payloads.dumps(small))), seconds
            ),
            CHAIN_THREADS: lambda: self._counted(
                CHAIN_THREADS,
                lambda: threaded(
                    lambda slot: json.loads(chain[slot].post(payloads.dumps(small))), seconds
                ),
                self.chain_processes,
            ),
        }
        if (bare := self.bare) is not None:
            unary = bare.threads
            floors = [
                (NO_HTTP_THREADS, lambda slot: unary[slot](body, timeout=120), bare.processes),
                *((floor.threads, lambda slot, c=floor.callers[1:]: c[slot].call(body),
                   floor.processes) for floor in (*bare.streams, bare.design)),
            ]  # fmt: skip
            for label, call, processes in floors:
                cases[label] = lambda label=label, call=call, processes=processes: self._counted(  # type: ignore[misc]
                    label, lambda: threaded(lambda slot: json.loads(call(slot)), seconds), processes
                )
        if self.granian:
            cases.update(self._on_granian(body, seconds))
        outstanding = self.ray_outstanding
        if outstanding is not None:
            cases[f"Ray tasks, {IN_FLIGHT} outstanding"] = lambda: outstanding(0, seconds)
            cases[f"Ray actors, {IN_FLIGHT} (one call each)"] = lambda: outstanding(1, seconds)
        for label, (address, token, paths) in self.http_addresses.items():
            cases[f"HTTP: {label}, {IN_FLIGHT} connections"] = (
                lambda address=address, token=token, paths=paths: asyncio.run(
                    load(address, token, paths, body, seconds)
                )[0]
            )
        for label, case in cases.items():
            self.rates.setdefault(label, []).append(case())

    def _on_granian(self, body: bytes, seconds: float) -> dict[str, Callable[[], float]]:
        """The floor chain on granian from IN_FLIGHT threads (a kept-alive HTTP/1.1 connection
        each), and multiplexed: IN_FLIGHT calls on one HTTP/2 connection at a time (httpx, the
        maintained Python client that speaks HTTP/2) — each with the CPU it spends a call."""
        threads = [RawHttp(self.granian, "/") for _ in range(IN_FLIGHT)]
        cases: dict[str, Callable[[], float]] = {
            GRANIAN_THREADS: lambda: self._counted(
                GRANIAN_THREADS,
                lambda: threaded(lambda slot: json.loads(threads[slot].post(body)), seconds),
                self.granian_processes,
            )
        }
        try:
            import httpx
        except ImportError:
            print("httpx is not installed: HTTP/2 left out (pip install -e '.[peers]')")
            return cases

        async def multiplexed() -> float:
            url = f"http://{self.granian}/"
            async with httpx.AsyncClient(http1=False, http2=True, timeout=120) as connection:
                await connection.post(url, content=body)  # its connection made
                calls = [lambda: connection.post(url, content=body)] * IN_FLIGHT
                return (await drive(calls, IN_FLIGHT, seconds))[0]

        cases[GRANIAN_H2] = lambda: self._counted(
            GRANIAN_H2, lambda: asyncio.run(multiplexed()), self.granian_processes
        )
        return cases

    def _counted(self, case_label: str, case: Callable[[], float], pids: dict[str, int]) -> float:
        """Run `case` (calls/s), and keep the CPU each process spent a call (``cpu_per_call``)."""
        rate, spent = cpu_per_call(case, pids)
        for label, micros in spent.items():
            self.cpu.setdefault(case_label, {}).setdefault(label, []).append(micros)
        return rate

    def report(self, sizes: list[str]) -> int:
        targets: list[Target] = []
        notes: list[str] = []
        print("\n== Python driver: a value in, a value out (p50 / p99 ms; x Ray's actor call)")
        for size in sizes:
            actor = self._p50("python", size, "Ray actor call")
            print(f"-- {size}")
            self._rows("python", size, actor)
            floor = self.floor(size)
            print(f"{'the bare hops summed (floor)':<48}{floor:>9.2f}{'':>9}" + ratio(floor, actor))
            ours = self._p50("python", size, CLIENT_CASE)
            self._rows("paired", size, self._p50("paired", size, RAW_CASE), "paired, ")
            paired = statistics.median(self.pair_ratios[size])
            targets.append(Target(f"Client.invoke / raw request (paired), {size}", paired,
                                  CLIENT_TARGET))  # fmt: skip
            if actor and size in TARGETS:
                targets.append(Target(f"Python {size} / Ray actor call", ours / actor,
                                      TARGETS[size]))  # fmt: skip
                chain = self._p50("python", size, FLOOR_CHAIN)
                streamed = [floor.latency for floor in self.bare.streams] if self.bare else []
                chains = {
                    label: self._p50("python", size, label)
                    for label in (FLOOR_CHAIN, *self.alternatives, FLOOR_NO_HTTP, *streamed)
                    if self._p50("python", size, label)
                }
                lowest = min(chains, key=chains.__getitem__)
                notes.append(
                    f"Python {size}: the least floor chain measured is {lowest!r}, "
                    f"{chains[lowest] / actor:.2f}x Ray's actor call; fnkernel is "
                    f"{ours / chains[lowest]:.2f}x it"
                )  # fmt: skip
                if design := self._p50("python", size, FLOOR_DESIGN):
                    past = design / actor > TARGETS[size]
                    notes.append(
                        f"Python {size}: the floor of the design's processes ({FLOOR_DESIGN}) is "
                        f"{design / actor:.2f}x Ray's actor call"
                        + (f", past the target ({TARGETS[size]:g}x)" if past else "")
                        + f"; fnkernel is {ours / design:.2f}x it"
                    )
                for what, least in (
                    ("the bare hops summed are {}x Ray's actor call by themselves", floor),
                    ("the floor chain (no code of ours, no worker) is {}x Ray's actor call", chain),
                ):
                    if least / actor > TARGETS[size]:
                        notes.append(
                            f"Python {size}: {what.format(f'{least / actor:.2f}')} "
                            f"(target {TARGETS[size]:g}x); fnkernel is "
                            f"{ours / least:.2f}x that floor"
                        )  # fmt: skip
        print("\n== HTTP, one client: bytes in, bytes out (p50 / p99 ms; x fnkernel's gateway)")
        for size in sizes:
            ours = self._p50("http", size, "fnkernel gateway")
            print(f"-- {size}")
            self._rows("http", size, ours)
            kernel_gateway = self._p50("http", size, "Jupyter Kernel Gateway")
            if kernel_gateway:
                targets.append(Target(f"HTTP {size}: Kernel Gateway / fnkernel",
                                      kernel_gateway / ours, KG_AHEAD, at_least=True))  # fmt: skip
        print("\n== Bare hops: bytes there and back (p50 / p99 ms)")
        for size in sizes:
            print(f"-- {size}")
            self._rows("bare", size, 0.0)
        print(
            f"\n== {IN_FLIGHT} in flight, small payload (calls/s, mean of the rounds; x Ray tasks)"
        )
        rates = {label: statistics.mean(values) for label, values in self.rates.items()}
        tasks = rates.get(f"Ray tasks, {IN_FLIGHT} outstanding", 0.0)
        for label, value in rates.items():
            print(f"{label:<58}{value:>9.0f}" + ratio(value, tasks))
        threads = rates[CLIENT_THREADS]
        for case_label, processes in self.cpu.items():
            print(f"\nCPU per call, {case_label} (µs, mean of the rounds)")
            total = 0.0
            for label, values in processes.items():
                total += statistics.mean(values)
                print(f"  {label:<40}{statistics.mean(values):>9.0f}")
            print(f"  {'all of them':<40}{total:>9.0f}  (two cores: at most "
                  f"{2e6 / total:,.0f} calls/s)")  # fmt: skip
        if tasks:
            targets.append(Target(f"{IN_FLIGHT} in flight: Client / Ray tasks", threads / tasks, 1.0,
                                  at_least=True))  # fmt: skip
            direct = [NO_HTTP_THREADS, *(f.threads for f in self.bare.streams)] if self.bare else []
            if best := max(
                (label for label in direct if label in rates), key=rates.__getitem__, default=""
            ):
                notes.append(
                    f"{IN_FLIGHT} in flight: the best floor under the Client's direct calls (no "
                    f"HTTP hop, no worker) is {best!r}, {rates[best] / tasks:.2f}x Ray tasks' "
                    f"calls/s; fnkernel's Client is {threads / rates[best]:.2f}x it"
                )
            if design := rates.get(FLOOR_DESIGN_THREADS):
                notes.append(
                    f"{IN_FLIGHT} in flight: the floor of the design's processes "
                    f"({FLOOR_DESIGN_THREADS}) is {design / tasks:.2f}x Ray tasks' calls/s"
                    + (", short of the target" if design < tasks else "")
                    + f"; fnkernel's Client is {threads / design:.2f}x it"
                )
            if rates[CHAIN_THREADS] < tasks:
                notes.append(
                    f"{IN_FLIGHT} in flight: the floor chain from {IN_FLIGHT} threads, with no worker, "
                    f"is {rates[CHAIN_THREADS] / tasks:.2f}x Ray tasks' calls/s by itself; "
                    f"fnkernel's Client is {threads / rates[CHAIN_THREADS]:.2f}x that floor"
                )
        fanned, fan_notes = self.fan_out.report()
        targets += fanned
        notes += fan_notes
        kg_rate = rates.get(f"HTTP: Jupyter Kernel Gateway, {IN_FLIGHT} connections")
        if kg_rate:
            ours_rate = rates[f"HTTP: fnkernel gateway, {IN_FLIGHT} connections"]
            targets.append(Target("HTTP throughput: fnkernel / Kernel Gateway",
                                  ours_rate / kg_rate, KG_AHEAD, at_least=True))  # fmt: skip
        print()
        for note in notes:
            print(note)
        return verdicts(targets)

    def floor(self, size: str) -> float:
        """The bare hops summed: HTTP, gRPC twice, the pipe (p50s of this run)."""
        return (
            self._p50("http", size, TORNADO)
            + 2 * self._p50("bare", size, GRPC_ECHO)
            + self._p50("bare", size, PIPE)
        )

    def _rows(self, section: str, size: str, against: float, prefix: str = "") -> None:
        for (at_section, at_size, label), samples in self.latency.items():
            if (at_section, at_size) == (section, size):
                print(row(prefix + label, samples, against))

    def _p50(self, section: str, size: str, label: str) -> float:
        samples = self.latency.get((section, size, label))
        return statistics.median(samples) if samples else 0.0


if __name__ == "__main__":
    raise SystemExit(main())
