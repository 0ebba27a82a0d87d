"""Invoke latency through the HTTP gateway against a direct Runtime Server invoke (issue 3).

One `Stack` (a python pod and the gateway, each its own process), one trivial Run, measured in the
same run:

* direct: InvokeFunction on the Runtime Server's Unix socket with the active registration ID;
* proxy hop: InvokeFunction on runtimed's Unix socket with an empty ID (fills it in, fences);
* gateway: POST /v1/runs/NAME:invoke over a kept-alive HTTP connection on TCP loopback, through
  the client library (HTTP → gateway → runtimed → Runtime Server → worker).

To tell the cost of our code from the cost of the topology, the same run also measures the two
extra hops bare: a grpcio echo server (benchmarks.invoke's floor) and a tornado server that echoes
the POST body. direct + both bare hops is the floor the gateway path is judged against. And, to
show how low that floor is: a bare grpcio relay in front of the same Runtime Server (the least a
proxy hop of runtimed's kind costs) and a chain of bare parts — tornado relaying with grpc.aio
to a grpc.aio relay to the echo — against the same sum of bare hops. Between the bare relay and
runtimed, a *checked relay*: the bare relay plus what runtimed's hop must do on every call,
written flat (``serve_checked_relay``) — what the guarantees cost by themselves.

Targets (issue 13): the gateway's p50 <= 1.2x that floor; runtimed's proxy hop (its p50 minus
direct's) at most 0.10 ms above the bare gRPC hop. Usage: python -m benchmarks.gateway [--calls N]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import sys
import tempfile
import time
from pathlib import Path

import grpc

from benchmarks.invoke import (
    ECHO_METHOD,
    PAYLOAD,
    PY_HANDLER,
    Target,
    measure,
    p,
    serve_until_signal,
    verdicts,
)
from benchmarks.throughput import INVOKE_METHOD, floor_chain, relay
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.daemon import announcement, start
from fnkernel.runtime_server.lifecycle.stack import Stack
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS
from fnkernel.runtime_server.wire import ATTEMPT_KEY, POD_KEY, READY, TIMELINE_HEADER

ROUNDS = 10
TARGETS = {"gateway": 1.2, "proxy hop": 0.10}  # issue 13: x the floor; ms above a bare hop


# A traced call's W3C trace context (docs/protocol.md, "Tracing"): every call in one trace.
TRACED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def serve_http_echo() -> None:
    """A bare tornado server answering POST / with its body: the HTTP hop at its cheapest."""
    from tornado import httpserver, netutil, web

    class Echo(web.RequestHandler):
        def post(self) -> None:
            self.finish(self.request.body)

    async def serve() -> None:
        sockets = netutil.bind_sockets(0, "127.0.0.1")
        httpserver.HTTPServer(web.Application([(r"/", Echo)])).add_sockets(sockets)
        address = f"127.0.0.1:{sockets[0].getsockname()[1]}"
        print(announcement("bench", "tornado echo", address), flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


def serve_checked_relay(
    listen: str, upstream: str, store_path: str, pod: str, registration_id: str
) -> None:
    """runtimed's hop with none of runtimed's structure: a grpcio thread-pool server (as
    runtimed's) doing, on every InvokeFunction, what docs/protocol.md asks of the proxy hop —
    the typed request, the empty-ID check, the routing fence on the caller's pod and on the
    Run's row read fresh from the store, the registration ID filled in, the caller's deadline
    passed on, a call its caller can cancel, the attempt and the server's trailers relayed.
    The registration ID is given: runtimed registers; this relay only forwards."""
    from concurrent import futures

    from fnkernel.runtime_server.lifecycle.sqlite import SqliteRunStore
    from fnkernel.runtime_server.rpc import (
        CancellableCalls,
        caller_timeout,
        metadata_value,
        relayed_trailers,
    )

    store = SqliteRunStore(Path(store_path))
    calls = CancellableCalls(upstream, pb_grpc.FunctionRuntimeStub)

    class Checked(pb_grpc.FunctionRuntimeServicer):
        def InvokeFunction(
            self, request: pb.InvokeFunctionRequest, context: grpc.ServicerContext
        ) -> pb.InvokeFunctionResponse:
            registration = request.registration
            if registration.registration_id or not registration.run_uid:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "registration")
            routed_to = metadata_value(context, POD_KEY)
            run = store.get_uid_fresh(registration.run_uid)
            elsewhere = routed_to is not None and routed_to != pod
            if (
                elsewhere
                or run is None
                or run.status.assigned_pod != pod
                or run.status.phase != READY
            ):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "routed elsewhere")
            forwarded = pb.InvokeFunctionRequest()
            forwarded.CopyFrom(request)
            forwarded.registration.registration_id = registration_id
            timeout = caller_timeout(context)
            response, call = calls.call(
                lambda stub: stub.InvokeFunction.with_call(forwarded, timeout=timeout), context
            )
            trailers = ((ATTEMPT_KEY, str(run.status.attempt)),)
            context.set_trailing_metadata(trailers + relayed_trailers(call.trailing_metadata()))
            return response

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=CHANNEL_OPTIONS)
    pb_grpc.add_FunctionRuntimeServicer_to_server(Checked(), server)
    serve_until_signal(server, listen, "checked relay")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--http-echo", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checked-relay", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.http_echo:
        serve_http_echo()
        return 0
    if args.checked_relay:
        serve_checked_relay(*args.checked_relay)
        return 0
    with tempfile.TemporaryDirectory(prefix="fnkernel-bench-") as tmp:
        echo, chain_proxy, chain_front = floor_chain(tmp)
        echoes = [echo, start([sys.executable, "-m", "benchmarks.gateway", "--http-echo"])]
        stack = Stack(Path(tmp) / "state", {"python": 1}, gateway_listen="127.0.0.1:0")
        stack.start()
        server = stack.component("python-0-server").child
        assert server is not None
        # The measured floors of the two hops, made of the same frameworks with none of our code.
        bare_proxy = relay("sync", f"unix:{tmp}/bare.sock", server.address, INVOKE_METHOD)
        relays = [bare_proxy, chain_proxy, chain_front]
        try:
            return run(
                stack,
                args.calls,
                *(echo.address for echo in echoes),
                bare_proxy.address,
                chain_front.address,
                f"unix:{tmp}/checked.sock",
            )
        finally:
            stack.stop()
            for child in (*echoes, *relays):
                child.stop(10)


def run(
    stack: Stack,
    calls: int,
    grpc_echo: str,
    http_echo: str,
    bare_proxy: str,
    chain: str,
    checked_listen: str,
) -> int:
    client = Client(stack.gateway_address)
    client.create_run(
        "bench", runtime="python", handler="handler.handle", files={"handler.py": PY_HANDLER}
    )
    status = client.status("bench")
    registration = pb.FunctionRegistration(
        run_uid=status["uid"], registration_id=status["live"]["registrationId"]
    )
    server = stack.component("python-0-server").child
    runtimed = stack.component("python-0-runtimed").child
    assert server is not None and runtimed is not None
    store = str(stack.state_dir / "runs.db")
    relay_args = [checked_listen, server.address, store, "python-0", registration.registration_id]
    checked = start([sys.executable, "-m", "benchmarks.gateway", "--checked-relay", *relay_args])
    try:
        results = measure_cases(
            client,
            registration,
            server.address,
            runtimed.address,
            checked.address,
            grpc_echo,
            http_echo,
            bare_proxy,
            chain,
            calls,
        )
    finally:
        checked.stop(10)
    return report(results, timeline(client, calls // 4))


def measure_cases(
    client: Client,
    registration: pb.FunctionRegistration,
    server: str,
    runtimed: str,
    checked: str,
    grpc_echo: str,
    http_echo: str,
    bare_proxy: str,
    chain: str,
    calls: int,
) -> dict[str, list[float]]:
    """Every case's latencies (ms), measured in rounds, the cases in turn."""
    channels = [
        grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        for address in (server, runtimed, checked)
    ]
    direct_stub, proxy_stub, checked_stub = (pb_grpc.FunctionRuntimeStub(c) for c in channels)
    direct_request = pb.InvokeFunctionRequest(
        registration=registration, input=PAYLOAD, content_type="application/json"
    )
    proxy_request = pb.InvokeFunctionRequest(
        registration=pb.FunctionRegistration(run_uid=registration.run_uid),
        input=PAYLOAD,
        content_type="application/json",
    )
    pod = ((POD_KEY, "python-0"),)
    echo = grpc.insecure_channel(grpc_echo, options=CHANNEL_OPTIONS).unary_unary(ECHO_METHOD)
    connection = http.client.HTTPConnection(http_echo)
    chain_connection = http.client.HTTPConnection(chain)
    bare_channel = grpc.insecure_channel(bare_proxy, options=CHANNEL_OPTIONS)
    channels.append(bare_channel)
    bare_stub = pb_grpc.FunctionRuntimeStub(bare_channel)

    def echo_over_http(connection: http.client.HTTPConnection = connection) -> bytes:
        connection.request("POST", "/", body=PAYLOAD, headers={"Content-Type": "application/json"})
        return connection.getresponse().read()

    cases = {
        "direct Runtime Server": lambda: direct_stub.InvokeFunction(direct_request, timeout=30),
        "runtimed proxy hop": lambda: proxy_stub.InvokeFunction(
            proxy_request, timeout=30, metadata=pod
        ),
        "gateway (HTTP)": lambda: client.invoke("bench", data=PAYLOAD),
        "gateway (HTTP), traced": lambda: client.invoke("bench", data=PAYLOAD, traceparent=TRACED),
        "bare gRPC echo": lambda: echo(PAYLOAD, timeout=30),
        "bare HTTP echo (tornado)": echo_over_http,
        "bare relay → Runtime Server": lambda: bare_stub.InvokeFunction(direct_request, timeout=30),
        "checked relay → Runtime Server": lambda: checked_stub.InvokeFunction(
            proxy_request, timeout=30, metadata=pod
        ),
        "bare chain: HTTP → relay → echo": lambda: echo_over_http(chain_connection),
    }
    results: dict[str, list[float]] = {name: [] for name in cases}
    for call in cases.values():
        assert call() is not None
    # In rounds, the cases in turn: a slow stretch of this noisy machine falls on every case.
    for _ in range(ROUNDS):
        for name, call in cases.items():
            results[name] += measure(call, calls // ROUNDS, warmup=20)
    for channel in channels:
        channel.close()
    return results


def report(results: dict[str, list[float]], segments: dict[str, list[float]]) -> int:
    direct = p(results["direct Runtime Server"], 50)
    grpc_hop = p(results["bare gRPC echo"], 50)
    floor = direct + grpc_hop + p(results["bare HTTP echo (tornado)"], 50)
    print(f"{len(results['gateway (HTTP)'])} calls each; payload {PAYLOAD.decode()}")
    print(f"{'case':<32}{'p50 ms':>9}{'p99 ms':>9}{'/ direct':>9}")
    for name, samples in results.items():
        print(
            f"{name:<32}{p(samples, 50):>9.3f}{p(samples, 99):>9.3f}{p(samples, 50) / direct:>8.2f}x"
        )
    print(f"floor of the gateway path (direct + both bare hops): {floor:.3f} ms")
    gateway = p(results["gateway (HTTP)"], 50) / floor
    proxy_hop = p(results["runtimed proxy hop"], 50) - direct
    bare_hop = p(results["bare relay → Runtime Server"], 50) - direct
    checked_hop = p(results["checked relay → Runtime Server"], 50) - direct
    chain_ratio = p(results["bare chain: HTTP → relay → echo"], 50) / (
        p(results["bare HTTP echo (tornado)"], 50) + 2 * grpc_hop
    )
    print(
        f"runtimed's proxy hop: {proxy_hop:.3f} ms; a bare gRPC hop: {grpc_hop:.3f} ms; "
        f"a bare relay hop: {bare_hop:.3f} ms ({bare_hop - grpc_hop:+.3f} ms); "
        f"a checked relay hop (the guarantees, flat): {checked_hop:.3f} ms "
        f"({checked_hop - grpc_hop:+.3f} ms)"
    )
    print(
        f"the same floor for a chain of bare parts (HTTP echo + 2 gRPC hops): it costs "
        f"{chain_ratio:.2f}x that"
    )
    traced = p(results["gateway (HTTP), traced"], 50) - p(results["gateway (HTTP)"], 50)
    print(
        f'tracing on (docs/protocol.md, "Tracing": six spans recorded, encoded and handed '
        f"back): {traced:+.3f} ms a call"
    )
    timed = len(next(iter(segments.values())))
    print(f"where a gateway call's time goes (X-Fn-Timeline, median of {timed} calls):")
    for segment, samples in segments.items():
        print(f"  {segment:<46}{p(samples, 50):>7.3f} ms")
    return verdicts(
        [
            Target("gateway path / its floor", gateway, TARGETS["gateway"]),
            Target(
                "runtimed proxy hop above a bare gRPC hop",
                proxy_hop - grpc_hop,
                TARGETS["proxy hop"],
                unit=" ms",
            ),
        ]
    )


# Each segment of a call's path, between two clock readings (docs/protocol.md, "Timeline"); the
# client's own are "client.sent" and "client.received".
SEGMENTS = {
    "client → gateway handler (HTTP request headers)": ("client.sent", "gateway.received"),
    "gateway: the checks, then the body (streamed)": ("gateway.received", "gateway.body"),
    "gateway: routing and the gRPC request": ("gateway.body", "gateway.called"),
    "gateway → runtimed handler (gRPC request)": ("gateway.called", "runtimed.received"),
    "runtimed, before its call (fence, routing)": ("runtimed.received", "runtimed.called"),
    "runtimed → Runtime Server handler (gRPC request)": ("runtimed.called", "server.received"),
    "Runtime Server: checks, the worker, the answer": ("server.received", "server.answered"),
    "Runtime Server → runtimed (gRPC response)": ("server.answered", "runtimed.answered"),
    "runtimed → gateway (gRPC response)": ("runtimed.answered", "gateway.answered"),
    "gateway → client (HTTP response)": ("gateway.answered", "client.received"),
}


def timeline(client: Client, calls: int) -> dict[str, list[float]]:
    """`calls` gateway invokes that ask for X-Fn-Timeline; each segment's durations in ms."""
    segments: dict[str, list[float]] = {name: [] for name in SEGMENTS}
    path = "/v1/runs/bench:invoke"
    for _ in range(calls):
        sent = time.monotonic_ns()
        _, headers, _ = client.request("POST", path, PAYLOAD, {TIMELINE_HEADER: "1"})
        received = time.monotonic_ns()
        hops = json.loads(headers[TIMELINE_HEADER])
        readings = {f"{hop}.{name}": value for hop in hops for name, value in hops[hop].items()}
        readings |= {"client.sent": sent, "client.received": received}
        for name, (first, last) in SEGMENTS.items():
            segments[name].append((readings[last] - readings[first]) / 1e6)
    return segments


if __name__ == "__main__":
    raise SystemExit(main())
