"""`make demo`: a scripted tour of a real Runtime Server (until the kernel exists).

Starts `fnkernel serve` for each runtime on a private Unix socket, registers a Python and a Bash
function, invokes both, prints results and status, and stops the servers with SIGTERM.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import grpc

from runtime_server._proto.executor.v1 import runtime_pb2 as pb
from runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from runtime_server.launch import spawn_serve
from runtime_server.limits import sha256_digest
from runtime_server.registry import state_name
from runtime_server.server import CHANNEL_OPTIONS

FUNCTIONS: dict[str, tuple[str, str, str, object]] = {
    "python": (
        "word_count.py",
        "word_count.handle",
        """def handle(event, context):
    words = event["text"].split()
    context.set_output("words", str(len(words)))
    print(f"counted {len(words)} words")
    return {"words": len(words), "longest": max(words, key=len)}
""",
        {"text": "registered functions as callable notebook cells"},
    ),
    "bash": (
        "greet.sh",
        "greet.greet",
        """greet() {
    echo "greeting for invocation $FUNCTION_INVOCATION_ID" >&2
    echo "length=${#1}" >> "$FUNCTION_OUTPUTS"
    printf '{"greeting": "hello, %s"}' "$1"
}
""",
        "$(rm -rf /) stays a string",
    ),
}


def run(runtime: str, root: Path) -> None:
    filename, handler, source, payload = FUNCTIONS[runtime]
    workdir = root / "runs" / runtime
    workdir.mkdir(parents=True)
    (workdir / filename).write_text(source)
    socket = root / f"{runtime}.sock"
    print(f"$ fnkernel serve --runtime {runtime} --listen unix:{socket.name}")
    server = spawn_serve(root, "--runtime", runtime, listen=f"unix:{socket}")
    print("  " + server.announced)
    try:
        with grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.FunctionRuntimeStub(channel)
            started = time.perf_counter()
            registered = stub.RegisterFunction(
                pb.RegisterFunctionRequest(
                    run_uid=f"demo-{runtime}",
                    registration_attempt=1,
                    working_dir=str(workdir),
                    handler=handler,
                    registration_digest=sha256_digest(source.encode()),
                ),
                timeout=60,
            )
            ref = registered.registration
            print(
                f"  RegisterFunction {handler}: {state_name(registered.state)} "
                f"registration_id={ref.registration_id} ({(time.perf_counter() - started) * 1000:.0f} ms)"
            )
            data = json.dumps(payload).encode() if runtime == "python" else str(payload).encode()
            started = time.perf_counter()
            result, call = stub.InvokeFunction.with_call(
                pb.InvokeFunctionRequest(
                    registration=ref, input=data, content_type="application/json"
                ),
                timeout=30,
            )
            elapsed = (time.perf_counter() - started) * 1000
            print(f"  InvokeFunction input={data.decode()!r}")
            print(
                f"    output={result.output.decode()} outputs={dict(result.outputs)} "
                f"invocation_id={result.invocation_id} ({elapsed:.1f} ms)"
            )
            logs = json.loads(dict(call.trailing_metadata()).get("fn-logs-bin", b"[]"))
            for line in logs:
                print(f"    log[{line['stream']}] {line['text']}")
            status = stub.FunctionStatus(pb.FunctionStatusRequest(registration=ref), timeout=10)
            print(f"  FunctionStatus: {state_name(status.state)} in_flight={status.in_flight}")
            stub.UnregisterFunction(
                pb.UnregisterFunctionRequest(registration=ref, drain_timeout_millis=1000),
                timeout=10,
            )
            print("  UnregisterFunction: OK")
    finally:
        print(f"  SIGTERM → server exited {server.stop()}")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="fnkernel-demo-") as tmp:
        for runtime in ("python", "bash"):
            run(runtime, Path(tmp))
            print()
    print("demo finished: both functions registered, invoked and unregistered over real gRPC.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
