"""Invoke latency of the Runtime Server against floors measured in the same run (issue 2).

Every server runs in its own process (so client and server do not share a GIL), on a Unix socket:

* floor: a bare grpcio unary echo server;
* the Runtime Server (python and bash runtimes) invoking a trivial handler;
* baseline: a gRPC server that spawns `bash` per call to run the same Bash function (the naive
  design the persistent runner replaces);
* skeleton: the least our design can cost — a FunctionRuntime server whose InvokeFunction relays
  the input over two pipes to one persistent Python process that JSON-decodes and re-encodes it,
  with none of the Runtime Server's checks, fencing, deadlines, logs or cancellation. What the
  Runtime Server costs beyond it is ours; what it costs beyond the echo is the design's;
* checked skeleton: the skeleton with what every call must do in our design, written flat in
  one function with none of the Runtime Server's structure — our worker (its frames and nonce, its log
  files), the request's checks, an invocation ID, the deadline, the cancel hook, one call at a
  time, the log files' sizes. What it costs beyond the skeleton is what those guarantees cost
  by themselves (reported beside the target).

Prints p50/p99 over N calls and the ratios against the targets — issue 13's python invoke <=
1.10x the skeleton; bash <= 3x the echo and <= 0.8x the spawn baseline — and a 6 MiB payload
round-trips through both adapters (identical, or the benchmark fails). Usage: python -m benchmarks.invoke [--calls N]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import select
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import NamedTuple

import grpc

from fnkernel.adapters.calllogs import STREAMS
from fnkernel.adapters.children import spawn_limited
from fnkernel.adapters.python import WORKER_SCRIPT
from fnkernel.runtime_server import limits
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.daemon import Child, announcement, start
from fnkernel.runtime_server.limits import sha256_digest
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS
from tests.support import spawn_serve

ECHO_METHOD = "/bench.Echo/Echo"
# The same echo, each message of a bidirectional stream answered in turn (issue 48's call
# streams: docs/architecture.md, "Call streams").
STREAM_METHOD = "/bench.Echo/Stream"
# The same stream, each message answered by a process of the stream's own over pipes, the value
# read and written again there (PipeEcho): our design's last hop, a Runtime Server and its worker.
WORKER_METHOD = "/bench.Echo/Worker"
ROUNDS = 10
BASH_HANDLER = "handle() { printf '%s' \"$1\"; }\n"
PY_HANDLER = "def handle(event):\n    return event\n"
PAYLOAD = b'{"command":"status"}'
CHECKED_RUN = "bench-checked"  # the checked skeleton's run_uid
MEMORY_BYTES = limits.DEFAULT_MEMORY_MB << 20  # its worker's memory limit, as a Run's


def serve_echo(address: str, spawn_bash: str | None) -> None:
    """The floor (identity) or the spawn-bash-per-call baseline, as a bare grpcio server."""

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        if spawn_bash is None:
            return request
        return subprocess.run(
            [
                "bash",
                "--noprofile",
                "--norc",
                "-c",
                '. "$0"; handle "$1"',
                spawn_bash,
                request.decode(),
            ],
            capture_output=True,
            check=True,
        ).stdout

    def echoes(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from requests

    def through_worker(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        worker = PipeEcho(values=True)
        try:
            for request in requests:
                yield worker.call(request)
        finally:
            worker.close()

    # An open stream holds a thread: room for the streams of benchmarks.peers' three stream
    # floors (IN_FLIGHT + 1 each) and as many unary calls at once.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64), options=CHANNEL_OPTIONS)
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Stream": grpc.stream_stream_rpc_method_handler(echoes),
        "Worker": grpc.stream_stream_rpc_method_handler(through_worker),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
    serve_until_signal(server, address, "spawn-bash baseline" if spawn_bash else "grpc echo")


def serve_until_signal(server: grpc.Server, address: str, what: str) -> None:
    """Bind, announce the address the fnkernel way (runtime_server.launch), serve until SIGTERM."""
    server.add_insecure_port(address)
    server.start()
    print(announcement("bench", what, address), flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.stop(0)


SKELETON_WORKER = """\
import json, os, sys
requests, response = os.fdopen(int(sys.argv[1]), "rb"), int(sys.argv[2])
while header := requests.readline():
    os.write(response, json.dumps(json.loads(requests.read(int(header)))).encode())
"""


PING_WORKER = """\
import os, sys
requests, answers = int(sys.argv[1]), int(sys.argv[2])
while os.read(requests, 1):
    os.write(answers, b".")
"""


F_SETPIPE_SZ = 1031
# A process at the end of two pipes of 1 MiB that keeps freed memory (both as the worker's),
# answering each length-prefixed message with its bytes — or, given "values", with the value its
# JSON holds read and written again, as the worker reads a call's input and writes the handler's
# result (msgspec and orjson, the fastest here, as the worker's: adapters/_jsonvalues.py).
PIPE_ECHO = """\
import ctypes, fcntl, os, struct, sys
ctypes.CDLL(None).mallopt(-3, 16 << 20)  # freed memory kept, as the worker's (keep_freed_memory)
ctypes.CDLL(None).mallopt(-1, 32 << 20)
for fd in (0, 1):
    fcntl.fcntl(fd, 1031, 1 << 20)  # F_SETPIPE_SZ, as the worker's pipes
if values := sys.argv[1:] == ["values"]:
    import msgspec.json, orjson
    read = msgspec.json.Decoder().decode
while header := os.read(0, 4):
    size, = struct.unpack("!I", header)
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        got += os.readv(0, [view[got:]])
    if values:
        data = orjson.dumps(read(data))
    view = memoryview(struct.pack("!I", len(data)) + data)
    while view:
        view = view[os.write(1, view):]
"""


class PipeEcho:
    """The floor of calling another process from Python (PIPE_ECHO): the bytes there and back,
    or (`values`) the value they hold, read and written again at the other end."""

    def __init__(self, values: bool = False) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", PIPE_ECHO, *(["values"] if values else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._in, self._out = self.process.stdin.fileno(), self.process.stdout.fileno()
        for fd in (self._in, self._out):
            fcntl.fcntl(fd, F_SETPIPE_SZ, 1 << 20)

    def call(self, data: bytes) -> bytes:
        view = memoryview(struct.pack("!I", len(data)) + data)
        while view:
            view = view[os.write(self._in, view) :]
        (size,) = struct.unpack("!I", os.read(self._out, 4))
        answer = bytearray(size)
        into, got = memoryview(answer), 0
        while got < size:
            got += os.readv(self._out, [into[got:]])
        return bytes(answer)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def pipe_round_trips(calls: int) -> dict[str, list[float]]:
    """One byte to another process and back over two pipes, as the scheduler places the two
    processes and with both pinned to one CPU: the difference is what waking a process on the
    other CPU costs on this machine, which every hop of every case pays (docs/architecture.md,
    "What the benchmarks compare")."""
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", PING_WORKER, str(req_r), str(resp_w)], pass_fds=(req_r, resp_w)
    )
    os.close(req_r)
    os.close(resp_w)

    def round_trip() -> None:
        os.write(req_w, b".")
        os.read(resp_r, 1)

    mine = os.sched_getaffinity(0)
    one_cpu = {min(mine)}
    samples: dict[str, list[float]] = {"free": [], "one CPU": []}
    try:
        for _ in range(ROUNDS):
            for placement, cpus in (("free", mine), ("one CPU", one_cpu)):
                os.sched_setaffinity(0, cpus)
                os.sched_setaffinity(child.pid, cpus)
                samples[placement] += measure(round_trip, calls // ROUNDS, warmup=20)
    finally:
        os.sched_setaffinity(0, mine)
        os.close(req_w)  # EOF: the child's loop ends
        child.wait(10)
        os.close(resp_r)
    return samples


def serve_skeleton(address: str) -> None:
    """The skeleton server (see the module docstring); small payloads only (one read)."""
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    worker = [sys.executable, "-c", SKELETON_WORKER, str(req_r), str(resp_w)]
    subprocess.Popen(worker, pass_fds=(req_r, resp_w))
    lock = threading.Lock()

    class Skeleton(pb_grpc.FunctionRuntimeServicer):
        def InvokeFunction(
            self, request: pb.InvokeFunctionRequest, context: grpc.ServicerContext
        ) -> pb.InvokeFunctionResponse:
            with lock:
                os.write(req_w, b"%d\n%s" % (len(request.input), request.input))
                output = os.read(resp_r, 1 << 16)  # a larger read costs its allocation
            return pb.InvokeFunctionResponse(
                registration=request.registration, output=output, content_type="application/json"
            )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    pb_grpc.add_FunctionRuntimeServicer_to_server(Skeleton(), server)
    serve_until_signal(server, address, "skeleton")


def serve_checked_skeleton(address: str, root: str) -> None:
    """The checked skeleton (see the module docstring): our worker, and the checks and guards
    of every call, in one flat function."""
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    logs = [os.open(f"{root}/checked.{stream}", flags, 0o600) for stream in STREAMS]
    fds = (str(req_r), str(resp_w))  # the worker's last arguments: its frame pipes
    worker = spawn_limited(
        [sys.executable, "-P", str(WORKER_SCRIPT), CHECKED_RUN, "handler", "handle", *fds],
        MEMORY_BYTES,
        cwd=root,
        stdin=subprocess.DEVNULL,
        stdout=logs[0],
        stderr=logs[1],
        pass_fds=(req_r, resp_w),
    )
    pidfd = os.pidfd_open(worker.pid)
    assert os.read(resp_r, 64) == b"READY\n"
    lock = threading.Lock()

    class CheckedSkeleton(pb_grpc.FunctionRuntimeServicer):
        def InvokeFunction(
            self, request: pb.InvokeFunctionRequest, context: grpc.ServicerContext
        ) -> pb.InvokeFunctionResponse:
            registration = request.registration
            limits.check_run_uid(registration.run_uid)
            limits.check_registration_id(registration.registration_id)
            invocation_id = limits.check_invocation_id(request.invocation_id)
            limits.check_input(request.input)
            limits.check_content_type(request.content_type)
            timeout = limits.effective_timeout_millis(request.timeout_millis) / 1000
            deadline = time.monotonic() + min(timeout, context.time_remaining() or timeout)
            with lock:  # one invocation at a time
                context.add_callback(lambda: None)  # the hook that cancels it if the caller goes
                nonce = os.urandom(8).hex().encode()  # the answer must echo it
                sizes = (len(invocation_id), len(request.input), timeout * 1000)
                # not traced, JSON, inline both ways, run always (adapters/base.py, request_frame)
                header = b"%d %d %d - json - - 0 - %s\n" % (*sizes, nonce)
                os.write(req_w, header + invocation_id.encode() + request.input)
                ready = select.select([resp_r, pidfd], [], [], deadline - time.monotonic())[0]
                if resp_r not in ready:
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer in time")
                answer = os.read(resp_r, 1 << 16)  # small payloads only (one read)
                for fd in logs:  # has the handler logged anything?
                    os.lseek(fd, 0, os.SEEK_END)
            head, _, body = answer.partition(b"\n")
            _, meta_len, output_len, _, _, _, _, answered = head.split(b" ")
            if answered != nonce:
                context.abort(grpc.StatusCode.UNKNOWN, "not this call's answer")
            output = body[int(meta_len) : int(meta_len) + int(output_len)]
            return pb.InvokeFunctionResponse(
                registration=registration,
                invocation_id=invocation_id,
                output=output,
                content_type="application/json",
            )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    pb_grpc.add_FunctionRuntimeServicer_to_server(CheckedSkeleton(), server)
    serve_until_signal(server, address, "checked skeleton")


def bench_server(*args: str) -> Child:
    """Start one of this module's servers (``python -m benchmarks.invoke ARGS...``)."""
    return start([sys.executable, "-m", "benchmarks.invoke", *args])


def measure(call, calls: int, warmup: int = 100) -> list[float]:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        call()
    samples = []
    budget = time.monotonic() + 120  # bound every loop in time as well as count
    for _ in range(calls):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1000)
        if time.monotonic() > budget:
            break
    return samples


class Target(NamedTuple):
    """One target of issue 13's table: `value` must stay at or under `limit` (at or over it
    with `at_least`), in `unit` ("x" for a ratio against a floor of the same run)."""

    label: str
    value: float
    limit: float
    unit: str = "x"
    at_least: bool = False

    @property
    def met(self) -> bool:
        return self.value >= self.limit if self.at_least else self.value <= self.limit


def verdicts(targets: list[Target]) -> int:
    """Print each target as met or MISSED; 0 if all were met, else 1."""
    for target in targets:
        sign = ">=" if target.at_least else "<="
        value = f"{target.value:.2f}"
        if not target.met and float(value) == target.limit:  # 2.003 is not 2.00
            value = f"{target.value:.3f}"
        value, limit = f"{value}{target.unit}", f"{target.limit:g}{target.unit}"
        verdict = "met" if target.met else "MISSED"
        print(f"{target.label}: {value} (target {sign} {limit}) {verdict}")
    return 0 if all(target.met for target in targets) else 1


def p(samples: list[float], q: float) -> float:
    return (
        statistics.quantiles(samples, n=100, method="inclusive")[int(q) - 1]
        if q < 100
        else max(samples)
    )


def row(label: str, samples: list[float], against: float) -> str:
    median = statistics.median(samples)
    return f"{label:<48}{median:>9.2f}{p(samples, 99):>9.2f}" + ratio(median, against)


def ratio(value: float, against: float) -> str:
    return f"{value / against:8.2f}x" if against else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--echo-server", metavar="ADDR", help=argparse.SUPPRESS)
    parser.add_argument("--spawn-bash", metavar="FILE", help=argparse.SUPPRESS)
    parser.add_argument("--skeleton-server", metavar="ADDR", help=argparse.SUPPRESS)
    parser.add_argument("--checked-skeleton-server", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo_server:
        serve_echo(args.echo_server, args.spawn_bash)
        return 0
    if args.skeleton_server:
        serve_skeleton(args.skeleton_server)
        return 0
    if args.checked_skeleton_server:
        serve_checked_skeleton(*args.checked_skeleton_server)
        return 0

    with tempfile.TemporaryDirectory(prefix="fnkernel-bench-") as tmp:
        root = Path(tmp)
        (root / "fn.sh").write_text(BASH_HANDLER)
        (root / "handler.py").write_text(PY_HANDLER)
        children = [
            bench_server("--echo-server", f"unix:{root}/echo.sock"),
            bench_server(
                "--echo-server", f"unix:{root}/spawn.sock", "--spawn-bash", f"{root}/fn.sh"
            ),
            bench_server("--skeleton-server", f"unix:{root}/skeleton.sock"),
            bench_server("--checked-skeleton-server", f"unix:{root}/checked.sock", str(root)),
        ]
        for runtime in ("python", "bash"):
            children.append(spawn_serve(runtime, root, listen=f"unix:{root}/{runtime}.sock"))
        try:
            rows = run(root, args.calls)
        finally:
            for child in children:
                child.stop()
    return report(rows)


def run(root: Path, calls: int) -> dict[str, object]:
    results: dict[str, object] = {}
    echo = grpc.insecure_channel(f"unix:{root}/echo.sock", options=CHANNEL_OPTIONS).unary_unary(
        ECHO_METHOD
    )
    skeleton = pb_grpc.FunctionRuntimeStub(
        grpc.insecure_channel(f"unix:{root}/skeleton.sock", options=CHANNEL_OPTIONS)
    )
    skeleton_request = pb.InvokeFunctionRequest(input=PAYLOAD, content_type="application/json")
    answer = skeleton.InvokeFunction(skeleton_request, timeout=10).output
    assert json.loads(answer) == json.loads(PAYLOAD)
    spawn = grpc.insecure_channel(f"unix:{root}/spawn.sock", options=CHANNEL_OPTIONS).unary_unary(
        ECHO_METHOD
    )
    assert spawn(PAYLOAD, timeout=10) == PAYLOAD
    results["spawn"] = measure(lambda: spawn(PAYLOAD, timeout=10), max(200, calls // 4), warmup=20)
    checked = pb_grpc.FunctionRuntimeStub(
        grpc.insecure_channel(f"unix:{root}/checked.sock", options=CHANNEL_OPTIONS)
    )
    checked_request = pb.InvokeFunctionRequest(
        registration=pb.FunctionRegistration(run_uid=CHECKED_RUN, registration_id="reg_bench"),
        input=PAYLOAD,
        content_type="application/json",
    )
    answer = checked.InvokeFunction(checked_request, timeout=10).output
    assert json.loads(answer) == json.loads(PAYLOAD)
    cases = {
        "echo": lambda: echo(PAYLOAD, timeout=10),
        "skeleton": lambda: skeleton.InvokeFunction(skeleton_request, timeout=10),
        "checked": lambda: checked.InvokeFunction(checked_request, timeout=10),
    }
    big = json.dumps("x" * (6 * 1024 * 1024 - 2)).encode()
    for runtime, handler in (("python", "handler.handle"), ("bash", "fn.handle")):
        stub = pb_grpc.FunctionRuntimeStub(
            grpc.insecure_channel(f"unix:{root}/{runtime}.sock", options=CHANNEL_OPTIONS)
        )
        reg = stub.RegisterFunction(
            pb.RegisterFunctionRequest(
                run_uid=f"bench-{runtime}",
                registration_attempt=1,
                working_dir=str(root),
                handler=handler,
                registration_digest=sha256_digest(handler.encode()),
            ),
            timeout=60,
        ).registration
        request = pb.InvokeFunctionRequest(
            registration=reg, input=PAYLOAD, content_type="application/json"
        )
        cases[runtime] = lambda stub=stub, request=request: stub.InvokeFunction(request, timeout=10)
        started = time.perf_counter()
        out = stub.InvokeFunction(
            pb.InvokeFunctionRequest(registration=reg, input=big), timeout=60
        ).output
        results[f"{runtime}-6mib"] = ((time.perf_counter() - started) * 1000, out == big)
    # In rounds, the cases in turn: a slow stretch of this noisy machine falls on every case
    # rather than on whichever was being measured (benchmarks.gateway does the same).
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(ROUNDS):
        for name, call in cases.items():
            samples[name] += measure(call, calls // ROUNDS, warmup=20)
    results.update(samples)
    results["pipe"] = pipe_round_trips(calls)
    return results


def report(results: dict[str, object]) -> int:
    floor = statistics.median(results["echo"])  # type: ignore[arg-type]
    spawn = statistics.median(results["spawn"])  # type: ignore[arg-type]
    skeleton = statistics.median(results["skeleton"])  # type: ignore[arg-type]
    print(f"{'case':<34}{'calls':>7}{'p50 ms':>9}{'p99 ms':>9}{'ratio':>9}  against")

    def row(name: str, key: str, ratio: float | None, against: str) -> None:
        samples: list[float] = results[key]  # type: ignore[assignment]
        ratio_text = f"{ratio:.2f}x" if ratio is not None else ""
        print(
            f"{name:<34}{len(samples):>7}{statistics.median(samples):>9.3f}{p(samples, 99):>9.3f}{ratio_text:>9}  {against}"
        )

    row("grpc echo (floor)", "echo", None, "")
    row("bash spawned per call (baseline)", "spawn", spawn / floor, "echo")
    row("skeleton: gRPC + pipes + json", "skeleton", skeleton / floor, "echo (the design's least)")
    checked = statistics.median(results["checked"])  # type: ignore[arg-type]
    row("checked skeleton: + every check", "checked", checked / skeleton, "skeleton")
    python = statistics.median(results["python"]) / skeleton  # type: ignore[arg-type]
    row("python invoke", "python", python, "skeleton")
    print(
        f"{'python invoke / checked skeleton':<34}{'':>7}{'':>9}{'':>9}"
        f"{statistics.median(results['python']) / checked:>8.2f}x"  # type: ignore[arg-type]
        "  (what our structure costs above the guarantees themselves)"
    )
    bash = statistics.median(results["bash"]) / floor  # type: ignore[arg-type]
    row("bash invoke", "bash", bash, "echo")
    bash_vs_spawn = statistics.median(results["bash"]) / spawn  # type: ignore[arg-type]
    print(f"{'bash invoke / spawn baseline':<34}{'':>7}{'':>9}{'':>9}{bash_vs_spawn:>8.2f}x")
    for runtime in ("python", "bash"):
        elapsed, ok = results[f"{runtime}-6mib"]  # type: ignore[misc]
        print(
            f"{runtime + ' 6 MiB round trip':<34}{1:>7}{elapsed:>9.1f}{'':>9}{'':>9}  {'identical' if ok else 'MISMATCH'}"
        )
        assert ok, f"the {runtime} 6 MiB payload came back changed"
    pipe: dict[str, list[float]] = results["pipe"]  # type: ignore[assignment]
    free, pinned = (statistics.median(pipe[key]) for key in ("free", "one CPU"))
    print(
        f"pipe round trip between two processes: {free:.3f} ms as placed, {pinned:.3f} ms on one "
        f"CPU (p90 {p(pipe['free'], 90):.3f} / {p(pipe['one CPU'], 90):.3f}): waking a process on "
        f"the other CPU costs ~{(free - pinned) / 2:.3f} ms here, on every hop"
    )
    return verdicts(
        [
            Target("python invoke / skeleton", python, 1.10),
            Target("bash invoke / echo", bash, 3.0),
            Target("bash invoke / spawn baseline", bash_vs_spawn, 0.8),
        ]
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
