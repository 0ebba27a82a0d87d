"""Throughput: N concurrent clients over M Runs, against a chain of bare hops (issue 13).

One `Stack` (one python pod, the gateway), M trivial Runs. Each client owns M/N of them and
calls them in turn, one call at a time (a Run takes one invocation at a time), for a fixed time
split over two rounds of every case in turn:

* gateway: POST /v1/runs/NAME:invoke on kept-alive HTTP connections (HTTP → gateway → runtimed →
  Runtime Server → worker);
* runtimed: InvokeFunction on runtimed's socket, empty registration ID, ``x-fn-pod`` set;
* Runtime Server: InvokeFunction on the server's socket with each Run's registration ID;
* floor chain: the same HTTP load on bare hops — a tornado server that relays the body over
  grpc.aio to a bare grpc.aio proxy, which relays it to a bare gRPC echo (benchmarks.invoke's).
  Three processes, as many hops as gateway → runtimed → server, with none of our code;
* bare relays in front of the Runtime Server, in place of runtimed: a grpcio thread-pool server
  relaying with a blocking call (runtimed's design) and a grpc.aio one — what a proxy hop of
  each kind leaves of the server's rate (reported).

The load comes from this process: asyncio, one connection per client. Prints invokes/s, p50 and
p99 per case. Targets: the gateway at >= 2x the 424/s measured when the issue was filed, and at
>= 0.6x the floor chain. Usage: python -m benchmarks.throughput [--clients N] [--runs M]
[--seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import grpc.aio

from benchmarks.invoke import ECHO_METHOD, PAYLOAD, PY_HANDLER, Target, bench_server, p, verdicts
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.daemon import Child, announcement, start
from fnkernel.runtime_server.lifecycle.stack import Stack
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS
from fnkernel.runtime_server.wire import POD_KEY

FILED_RATE = (
    424.0  # invokes/s through the gateway, 10 clients over 50 Runs, when issue 13 was filed
)
RATE_TARGET = 2.0  # x FILED_RATE
FLOOR_TARGET = 0.6  # x the floor chain
MAX_CALLS = 200_000  # a bound on the count as well as the time
ROUNDS = 2  # each case's time is split over this many rounds of all the cases in turn
FLOOR_CHAIN = "floor chain: HTTP → gRPC proxy → gRPC echo"


INVOKE_METHOD = "/executor.v1.FunctionRuntime/InvokeFunction"


def serve_relay(listen: str, upstream: str, kind: str, method: str) -> None:
    """A bare relay hop for `method`'s bytes, with none of our code: ``http`` (tornado, POST /,
    relayed with grpc.aio, as the gateway does), ``aio`` (a grpc.aio server relaying with
    grpc.aio), ``sync`` (a grpcio thread-pool server relaying with a blocking call) or
    ``sync-stream`` (the same, `method` a bidirectional stream, as runtimed relays its calls:
    docs/architecture.md, "Call streams") or ``aio-stream`` (that stream relay on grpc.aio: one
    event loop, no thread hand-off a message). Issue 48's alternatives for the HTTP hop: ``http-uvloop`` (the same on uvloop's event
    loop), ``http-threads`` (tornado relaying with grpc's blocking call from a thread pool) and
    ``http-granian`` (granian, an HTTP server written in Rust on hyper, HTTP/1.1 and HTTP/2, in
    this process and relaying with grpc.aio; its own RSGI interface, its least per request)."""
    if kind == "http-uvloop":
        import uvloop

        uvloop.install()  # asyncio.run below now runs uvloop's loop
        kind = "http"
    if kind in ("sync", "sync-stream"):
        channel = grpc.insecure_channel(upstream, options=CHANNEL_OPTIONS)
        if kind == "sync":
            blocking = channel.unary_unary(method)
            handlers = _relay_handlers(method, lambda r, c: blocking(r, timeout=30))
        else:  # each incoming stream's messages relayed in turn on a stream of its own upstream
            handlers = _stream_relay_handlers(method, channel)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=CHANNEL_OPTIONS)
        server.add_generic_rpc_handlers((handlers,))
        server.add_insecure_port(listen)
        server.start()
        print(announcement("bench", "relay", listen), flush=True)
        signal.sigwait({signal.SIGTERM, signal.SIGINT})
        return

    async def serve() -> None:
        channel = grpc.aio.insecure_channel(upstream, options=CHANNEL_OPTIONS)
        relay = channel.unary_unary(method)
        if kind == "http-threads":
            blocking = grpc.insecure_channel(upstream, options=CHANNEL_OPTIONS).unary_unary(method)
            pool = futures.ThreadPoolExecutor(max_workers=16)

            async def relay(body: bytes, timeout: float) -> bytes:  # type: ignore[misc]
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(pool, lambda: blocking(body, timeout=timeout))

        if kind == "aio-stream":
            await _serve_aio_stream_relay(listen, channel, method)
            return
        if kind == "http-granian":
            await _serve_granian(relay)
            return
        if kind in ("http", "http-threads"):
            from tornado import httpserver, netutil, web

            class Relay(web.RequestHandler):
                async def post(self) -> None:
                    self.finish(await relay(self.request.body, timeout=30))

            sockets = netutil.bind_sockets(0, "127.0.0.1", backlog=1024)
            httpserver.HTTPServer(web.Application([(r"/", Relay)])).add_sockets(sockets)
            address = f"127.0.0.1:{sockets[0].getsockname()[1]}"
        else:

            async def proxy(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
                return await relay(request, timeout=30)

            server = grpc.aio.server(options=CHANNEL_OPTIONS)
            server.add_generic_rpc_handlers((_relay_handlers(method, proxy),))
            server.add_insecure_port(listen)
            await server.start()
            address = listen
        print(announcement("bench", "relay", address), flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


async def _serve_aio_stream_relay(listen: str, channel: grpc.aio.Channel, method: str) -> None:
    """Serve `method`, a bidirectional stream, each incoming stream's messages relayed in turn
    on a stream of its own to `channel`; announced, until it stops (SIGTERM)."""

    async def relayed(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        upstream = channel.stream_stream(method)()
        try:
            async for request in requests:
                await upstream.write(request)
                yield await upstream.read()
        finally:
            upstream.cancel()

    service, name = method.strip("/").split("/")
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                service, {name: grpc.stream_stream_rpc_method_handler(relayed)}
            ),
        )
    )
    server.add_insecure_port(listen)
    await server.start()
    print(announcement("bench", "relay", listen), flush=True)
    await asyncio.Event().wait()


async def _serve_granian(relay: Callable[..., Awaitable[bytes]]) -> None:
    """Serve POST / on granian's embedded server (this process's event loop), each body relayed
    with `relay`; announced once it accepts connections, until it stops (SIGTERM)."""
    from granian.server.embed import Server

    async def app(scope: object, protocol: Any) -> None:  # RSGI
        answer = await relay(await protocol(), timeout=30)
        protocol.response_bytes(200, [("content-type", "application/json")], answer)

    with socket.socket() as probe:  # granian announces no port it picked: pick a free one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = Server(app, address="127.0.0.1", port=port, log_enabled=False)
    serving = asyncio.create_task(server.serve())
    for _ in range(500):  # up to 5 s
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.01)
            continue
        writer.close()
        break
    print(announcement("bench", "relay", f"127.0.0.1:{port}"), flush=True)
    await serving


def _stream_relay_handlers(method: str, channel: grpc.Channel) -> grpc.GenericRpcHandler:
    def relayed(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        upstream = StreamCaller(channel, method)
        try:
            for request in requests:
                yield upstream.call(request)
        finally:
            upstream.close()

    service, name = method.strip("/").split("/")
    handler = grpc.stream_stream_rpc_method_handler(relayed)
    return grpc.method_handlers_generic_handler(service, {name: handler})


class StreamCaller:
    """Calls on one open bidirectional stream of `method`, a message in and its answer out, in
    turn: grpc's blocking API, its messages fed from a queue."""

    def __init__(self, channel: grpc.Channel, method: str) -> None:
        self._requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._answers = channel.stream_stream(method)(iter(self._requests.get, None))

    def call(self, request: bytes, timeout: float | None = None) -> bytes:
        self._requests.put(request)
        return next(self._answers)  # type: ignore[no-any-return]

    def close(self) -> None:
        self._requests.put(None)
        self._answers.cancel()


def _relay_handlers(method: str, behaviour: Callable[..., object]) -> grpc.GenericRpcHandler:
    service, name = method.strip("/").split("/")
    handler = grpc.unary_unary_rpc_method_handler(behaviour)
    return grpc.method_handlers_generic_handler(service, {name: handler})


def floor_chain(directory: str) -> tuple[Child, Child, Child]:
    """The floor chain's three processes (FLOOR_CHAIN), started with their sockets in
    `directory`: the bare gRPC echo, the grpc.aio relay before it, the tornado relay in front."""
    echo = bench_server("--echo-server", f"unix:{directory}/echo.sock")
    proxy = relay("aio", f"unix:{directory}/proxy.sock", echo.address)
    return echo, proxy, relay("http", "-", proxy.address)


def relay(kind: str, listen: str, upstream: str, method: str = ECHO_METHOD) -> Child:
    """Start a ``serve_relay`` process."""
    argv = [sys.executable, "-m", "benchmarks.throughput", "--relay", listen, upstream, kind]
    return start([*argv, method])


class HttpConnection:
    """One kept-alive HTTP/1.1 connection: the load generator's client (a request line, three
    headers, a Content-Length body; nothing else of HTTP is needed here)."""

    def __init__(self, address: str, token: str | None) -> None:
        self.address = address
        self.headers = "Content-Type: application/json\r\n"
        if token:
            self.headers += f"Authorization: Bearer {token}\r\n"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        if self.address.startswith("unix:"):
            self.reader, self.writer = await asyncio.open_unix_connection(self.address[5:])
            self.host = "localhost"
        else:
            parts = urlsplit(self.address if "//" in self.address else f"http://{self.address}")
            self.reader, self.writer = await asyncio.open_connection(parts.hostname, parts.port)
            self.host = parts.netloc

    async def post(self, path: str, body: bytes) -> bytes:
        request = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n{self.headers}"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        for attempt in range(2):
            assert self.reader is not None and self.writer is not None
            self.writer.write(request)
            try:
                head = await self.reader.readuntil(b"\r\n\r\n")
                break
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                # The gateway closed it while it was idle (its header timeout: between rounds,
                # a connection waits longer than that): as any HTTP client, reconnect and resend
                # — only if no answer had begun.
                self.writer.close()
                if attempt or getattr(exc, "partial", b""):
                    raise
                await self.connect()
        status = head[9:12]
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        answer = await self.reader.readexactly(length)
        if status != b"200":
            raise RuntimeError(f"{path}: HTTP {status.decode()} {answer[:200]!r}")
        return answer


async def drive(
    calls: list[Callable[[], Awaitable[object]]], clients: int, seconds: float
) -> tuple[float, list[float]]:
    """`clients` loops, client i calling calls[i], calls[i + clients], ... in turn, for
    `seconds` after a one-second warm-up. Returns (invokes/s, latencies in ms)."""
    latencies: list[float] = []
    measuring = False
    stop = False
    count = 0

    async def client(mine: list[Callable[[], Awaitable[object]]]) -> None:
        nonlocal count
        turn = 0
        while not stop:
            call = mine[turn % len(mine)]
            turn += 1
            started = time.perf_counter()
            await call()
            if measuring:
                latencies.append((time.perf_counter() - started) * 1000)
                count += 1

    tasks = [asyncio.create_task(client(calls[i::clients])) for i in range(clients)]
    await asyncio.sleep(1.0)
    measuring, began = True, time.perf_counter()
    deadline = began + seconds
    while time.perf_counter() < deadline and count < MAX_CALLS:
        await asyncio.sleep(0.05)
    measuring = False
    elapsed = time.perf_counter() - began
    rate = count / elapsed
    stop = True
    await asyncio.gather(*tasks)
    return rate, latencies


async def load(
    address: str, token: str | None, paths: list[str], body: bytes, seconds: float
) -> tuple[float, list[float]]:
    """The load generator on `paths`: a kept-alive connection a path, one call at a time each,
    for `seconds` (``drive``). Returns (invokes/s, latencies in ms)."""
    calls = []
    for path in paths:
        connection = HttpConnection(address, token)
        await connection.connect()
        calls.append(lambda c=connection, path=path: c.post(path, body))
    return await drive(calls, len(paths), seconds)


async def run_cases(
    stack: Stack,
    runs: list[dict[str, str]],
    floor_http: str,
    bare: dict[str, Child],
    clients: int,
    seconds: float,
) -> dict[str, tuple[float, list[float]]]:
    async def http_calls(address: str, paths: list[str], token: str | None) -> list:  # type: ignore[type-arg]
        connections = [HttpConnection(address, token) for _ in range(clients)]
        for connection in connections:
            await connection.connect()
        # client i owns paths i, i + clients, ...: give each path its owner's connection
        return [
            (lambda c=connections[i % clients], path=path: c.post(path, PAYLOAD))
            for i, path in enumerate(paths)
        ]

    cases = {
        "gateway (HTTP)": await http_calls(
            stack.gateway_address, [f"/v1/runs/{run['name']}:invoke" for run in runs], stack.token
        )
    }

    runtimed = stack.component("python-0-runtimed").child
    server = stack.component("python-0-server").child
    assert runtimed is not None and server is not None
    channels = []
    for label, address, with_id in (
        ("runtimed (gRPC)", runtimed.address, False),
        ("Runtime Server (gRPC)", server.address, True),
        ("  bare grpcio relay → Runtime Server", bare["sync"].address, True),
        ("  bare grpc.aio relay → Runtime Server", bare["aio"].address, True),
    ):
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        channels.append(channel)
        stub = pb_grpc.FunctionRuntimeStub(channel)
        calls = []
        for run in runs:
            request = pb.InvokeFunctionRequest(
                registration=pb.FunctionRegistration(
                    run_uid=run["uid"], registration_id=run["registrationId"] if with_id else ""
                ),
                input=PAYLOAD,
                content_type="application/json",
            )
            metadata = () if with_id else ((POD_KEY, "python-0"),)
            calls.append(
                lambda request=request, metadata=metadata, stub=stub: stub.InvokeFunction(
                    request, timeout=30, metadata=metadata
                )
            )
        cases[label] = calls
    cases[FLOOR_CHAIN] = await http_calls(floor_http, ["/"] * len(runs), None)
    # In rounds, the cases in turn: a slow stretch of this noisy machine falls on every case.
    rates: dict[str, list[float]] = {label: [] for label in cases}
    latencies: dict[str, list[float]] = {label: [] for label in cases}
    for _ in range(ROUNDS):
        for label, calls in cases.items():
            rate, samples = await drive(calls, clients, seconds / ROUNDS)
            rates[label].append(rate)
            latencies[label] += samples
    for channel in channels:
        await channel.close()
    return {label: (statistics.mean(rates[label]), latencies[label]) for label in cases}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--relay", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.relay:
        listen, upstream, kind, method = args.relay
        serve_relay(listen, upstream, kind, method)
        return 0
    with tempfile.TemporaryDirectory(prefix="fnkernel-bench-") as tmp:
        echo, proxy, front = floor_chain(tmp)
        stack = Stack(Path(tmp) / "state", {"python": 1}, gateway_listen="127.0.0.1:0")
        stack.start()
        server = stack.component("python-0-server").child
        assert server is not None
        bare = {
            kind: relay(kind, f"unix:{tmp}/{kind}.sock", server.address, INVOKE_METHOD)
            for kind in ("sync", "aio")
        }
        try:
            client = Client(stack.gateway_address, token=stack.token)
            runs = []
            for i in range(args.runs):
                name = f"bench-{i}"
                files = {"handler.py": PY_HANDLER}
                client.create_run(name, runtime="python", handler="handler.handle", files=files)
                status = client.status(name)
                runs.append(
                    {
                        "name": name,
                        "uid": status["uid"],
                        "registrationId": status["live"]["registrationId"],
                    }
                )
            results = asyncio.run(
                run_cases(stack, runs, front.address, bare, args.clients, args.seconds)
            )
        finally:
            stack.stop()
            for child in (front, proxy, echo, *bare.values()):
                child.stop(10)
    return report(results, args.clients, args.runs, args.seconds)


def report(
    results: dict[str, tuple[float, list[float]]], clients: int, runs: int, seconds: float
) -> int:
    print(
        f"{clients} clients over {runs} Runs, {seconds:g} s each in {ROUNDS} rounds of every case; "
        f"payload {PAYLOAD.decode()}"
    )
    floor_rate = results[FLOOR_CHAIN][0]
    print(f"{'case':<44}{'invokes/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'of floor':>10}")
    for name, (rate, latencies) in results.items():
        print(
            f"{name:<44}{rate:>10.0f}{statistics.median(latencies):>9.2f}"
            f"{p(latencies, 99):>9.2f}{rate / floor_rate:>9.2f}x"
        )
    gateway_rate = results["gateway (HTTP)"][0]
    print(f"floor chain: {floor_rate:.0f}/s; as filed: {FILED_RATE:.0f}/s")
    return verdicts(
        [
            Target(
                "gateway invokes/s / as filed",
                gateway_rate / FILED_RATE,
                RATE_TARGET,
                at_least=True,
            ),
            Target(
                "gateway invokes/s / floor chain",
                gateway_rate / floor_rate,
                FLOOR_TARGET,
                at_least=True,
            ),
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
