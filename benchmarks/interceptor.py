"""What owning a hop's call pipeline in a gRPC server interceptor costs per call (``pipeline.Pipeline``,
what the Runtime Server and runtimed run), against the same pipeline written in the handler
(how both hops served a call before it), measured in one run (issue 45).

Three FunctionRuntime servers, each in its own process on a Unix socket, answer InvokeFunction
with the request's input:

* bare: the handler alone, no pipeline — the floor;
* in-handler: the handler builds its ``ServedCall`` (timeline, spans), answers it, and turns
  its errors into statuses itself;
* intercepted: the handler alone, behind ``pipeline.Pipeline``, which does all of that around it.

Calls carry no timeline and no traceparent (the common call): what is measured is the pipeline's
own cost. Rounds are interleaved; prints each server's p50 and what each adds to bare, per call,
in µs. Usage: python -m benchmarks.interceptor [--calls N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.pipeline import Pipeline, ServedCall, served_call
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS, answer_failure
from fnkernel.runtime_server.wire import TIMELINE_SERVER_KEY

VARIANTS = ("bare", "in-handler", "intercepted")
ROUNDS = 10


class Bare(pb_grpc.FunctionRuntimeServicer):
    def InvokeFunction(self, request: Any, context: Any) -> Any:
        return pb.InvokeFunctionResponse(output=request.input, content_type=request.content_type)


class InHandler(pb_grpc.FunctionRuntimeServicer):
    def InvokeFunction(self, request: Any, context: Any) -> Any:
        call = ServedCall("runtime-server", TIMELINE_SERVER_KEY, request, context)
        try:
            response = pb.InvokeFunctionResponse(
                output=request.input, content_type=request.content_type
            )
        except Exception as exc:
            call.failed(exc, "passed")
            answer_failure(exc, context, "InvokeFunction")
        call.answer()
        return response


class Intercepted(pb_grpc.FunctionRuntimeServicer):
    def InvokeFunction(self, request: Any, context: Any) -> Any:
        served_call()  # where the handler finds its call
        return pb.InvokeFunctionResponse(output=request.input, content_type=request.content_type)


def serve(variant: str, address: str) -> None:
    service = pb.DESCRIPTOR.services_by_name["FunctionRuntime"].full_name
    pipeline = Pipeline([service], component="runtime-server", timeline_key=TIMELINE_SERVER_KEY)
    interceptors: list[grpc.ServerInterceptor] = [pipeline] if variant == "intercepted" else []
    servicer = {"bare": Bare, "in-handler": InHandler, "intercepted": Intercepted}[variant]()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        interceptors=interceptors,
        options=CHANNEL_OPTIONS,
    )
    pb_grpc.add_FunctionRuntimeServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


def _round(stub: Any, calls: int) -> list[float]:
    request = pb.InvokeFunctionRequest(input=b'{"n":1}', content_type="application/json")
    taken = []
    for _ in range(calls):
        started = time.perf_counter()
        stub.InvokeFunction(request, timeout=10)
        taken.append(time.perf_counter() - started)
    return taken


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--serve", nargs=2, metavar=("VARIANT", "ADDRESS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(*args.serve)
        return 0
    with tempfile.TemporaryDirectory(prefix="fnk-intercept-") as tmp:
        servers, stubs, channels = [], {}, []
        try:
            for variant in VARIANTS:
                address = f"unix:{Path(tmp) / variant}.sock"
                argv = [sys.executable, "-m", "benchmarks.interceptor", "--serve", variant, address]
                server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
                servers.append(server)
                assert server.stdout is not None and server.stdout.readline() == "ready\n"
                channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                grpc.channel_ready_future(channel).result(timeout=30)
                channels.append(channel)
                stubs[variant] = pb_grpc.FunctionRuntimeStub(channel)
            for stub in stubs.values():
                _round(stub, 200)  # warm-up
            taken: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
            for _ in range(ROUNDS):
                for variant in VARIANTS:
                    taken[variant] += _round(stubs[variant], args.calls // ROUNDS)
        finally:
            for channel in channels:
                channel.close()
            for server in servers:
                server.terminate()
                server.wait(timeout=10)
    p50 = {variant: statistics.median(times) * 1e6 for variant, times in taken.items()}
    print(f"{'server':<12} {'p50 µs':>8} {'over bare µs':>13}")
    for variant in VARIANTS:
        print(f"{variant:<12} {p50[variant]:8.1f} {p50[variant] - p50['bare']:13.1f}")
    print(f"interceptor vs in-handler: {p50['intercepted'] - p50['in-handler']:+.1f} µs per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
