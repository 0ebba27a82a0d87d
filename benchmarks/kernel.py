"""The kernel's costs against stock ipykernel, measured in the same run (issue 4):

* start: launching the kernel until its kernel_info reply, fnkernel vs stock ipykernel
  (``python3``), alternating, median of N each — target <= 1.1x;
* round trip: an ``%invoke`` cell (embedded runtime, warm) vs a plain ``1+1`` cell, each from
  jupyter_client's execute_request to the idle status and the execute_reply, the cells in turn
  in rounds — target <= 1.4x;
  and, in the kernel, what IPython's formatters take to build a small result's HTML and text
  forms — target <= 0.3 ms;
  also both without output (``x = 1+1``, ``r = bench.invoke({})``), which splits the ``%invoke``
  cell into the cell itself, its output and the invocation (kernel → gateway → runtimed →
  Runtime Server → worker, whose least cost benchmarks.gateway measures);
* cold: the first ``%%function`` in a fresh kernel, which starts the embedded runtime, once the
  processes the kernel prewarmed at its start are ready (a notebook's first cell comes some
  time after its kernel is up) — target <= 300 ms; and, reported, the same right after the
  kernel_info reply, when they are still importing;
* interrupt: from interrupt_request to the cell's error, during an invocation — reported (the
  issue asks for the call to be cancelled within 100 ms);
* the ``%invoke`` cell's floor: the ``1+1`` cell plus what the gateway path's floor parts
  (benchmarks.gateway: a direct call on the same Runtime Server, a bare gRPC echo, a bare tornado
  echo) take when called from a cell — reported beside the 1.4x target.

Usage: python -m benchmarks.kernel [--starts N] [--cells N]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks.invoke import ECHO_METHOD, PAYLOAD, Target, bench_server, p, verdicts
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.daemon import start
from tests.kernel.kernels import Kernel, install_kernelspec

START_TARGET = 1.1
ROUND_TRIP_TARGET = 1.4  # issue 13
DISPLAY_TARGET_MS = 0.3  # issue 13: the HTML and text forms of a small result
COLD_TARGET_MS = 300.0  # issue 13: the first %%function of a fresh kernel
# In the kernel: what displaying a small %invoke result costs (IPython's formatters, which
# call our _repr_html_ and __repr__), median of 7 runs of 200.
WAIT_PREWARMED = "get_ipython()._fnkernel_session.runtime.wait_prewarmed(30)"
DISPLAY_MS = (
    "__import__('statistics').median(__import__('timeit').repeat("
    "lambda: get_ipython().display_formatter.format(_fnk_result), number=200, repeat=7)) * 5"
)
FUNCTION = "%%function bench\ndef handler(event):\n    return event\n"
SLOW = "%%function slow\nimport time\ndef handler(event):\n    time.sleep(event)\n"
# In the kernel: _fnk_floor() makes the gateway path's floor calls (benchmarks.gateway), one each,
# on the embedded runtime's own Runtime Server with bench's registration. It imports grpc into the
# kernel, so it is set up after every other measurement.
FLOOR_SETUP = """
import http.client, grpc
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as _pb, runtime_pb2_grpc as _pb_grpc
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS as _OPTIONS
_runtime = get_ipython()._fnkernel_session.runtime
_live = _runtime.client().status("bench")
_server = _runtime._stack.component("python-0-server").child.address
_direct = _pb_grpc.FunctionRuntimeStub(grpc.insecure_channel(_server, options=_OPTIONS))
_request = _pb.InvokeFunctionRequest(
    registration=_pb.FunctionRegistration(
        run_uid=_live["uid"], registration_id=_live["live"]["registrationId"]
    ),
    input={payload!r},
    content_type="application/json",
)
_echo = grpc.insecure_channel({grpc_echo!r}, options=_OPTIONS).unary_unary({method!r})
_http = http.client.HTTPConnection({http_echo!r})


def _fnk_floor():
    _direct.InvokeFunction(_request, timeout=30)
    _echo({payload!r}, timeout=30)
    _http.request("POST", "/", body={payload!r}, headers={{"Content-Type": "application/json"}})
    _http.getresponse().read()
"""
ROUNDS = 5
# The timed cells: an %invoke cell against a 1+1 cell, and both without output.
CELLS = ["1+1", "%invoke bench {}", "x = 1+1", "r = bench.invoke({})"]


def start_seconds(kernel_name: str) -> float:
    started = time.perf_counter()
    kernel = Kernel(kernel_name)  # returns once the kernel_info reply arrived
    elapsed = time.perf_counter() - started
    kernel.shutdown()
    return elapsed


def cell_ms(kernel: Kernel, code: str, cells: int) -> list[float]:
    for _ in range(10):
        assert kernel.run(code).ok
    samples = []
    budget = time.monotonic() + 120  # bounded in time as well as count
    for _ in range(cells):
        started = time.perf_counter()
        cell = kernel.run(code)
        samples.append((time.perf_counter() - started) * 1000)
        assert cell.ok, cell.error
        if time.monotonic() > budget:
            break
    return samples


def interrupt_ms(kernel: Kernel, times: int) -> list[float]:
    """Interrupt a 10 s invocation once it is in flight; ms until the cell's error arrives."""
    assert kernel.run(SLOW).ok
    client = Client(kernel.value("get_ipython()._fnkernel_session.runtime.address"))
    samples = []
    for _ in range(times):
        msg_id = kernel.send("slow(10)")
        deadline = time.monotonic() + 10
        while not (client.status("slow")["live"] or {}).get("inFlight"):
            assert time.monotonic() < deadline, "the invocation never started"
            time.sleep(0.005)
        started = time.perf_counter()
        kernel.manager.interrupt_kernel()
        cell = kernel.collect(msg_id, timeout=10)
        samples.append((time.perf_counter() - started) * 1000)
        assert cell.error is not None and cell.error["ename"] == "InvocationInterrupted", cell.error
    return samples


def floor_calls_ms(kernel: Kernel, cells: int) -> tuple[float, float]:
    """p50 of a cell making the gateway path's floor calls, and of ``x = 1+1``, in turn."""
    with tempfile.TemporaryDirectory(prefix="fnkernel-bench-") as tmp:
        echoes = [
            bench_server("--echo-server", f"unix:{tmp}/echo.sock"),
            start([sys.executable, "-m", "benchmarks.gateway", "--http-echo"]),
        ]
        try:
            setup = FLOOR_SETUP.format(
                payload=PAYLOAD,
                grpc_echo=echoes[0].address,
                http_echo=echoes[1].address,
                method=ECHO_METHOD,
            )
            cell = kernel.run(setup)
            assert cell.ok, cell.error
            samples = cells_in_turn(kernel, ["_fnk_floor()", "x = 1+1"], cells)
        finally:
            for echo in echoes:
                echo.stop(10)
    return p(samples["_fnk_floor()"], 50), p(samples["x = 1+1"], 50)


def cells_in_turn(kernel: Kernel, codes: list[str], cells: int) -> dict[str, list[float]]:
    """`cells` runs of each cell, in ROUNDS rounds of all of them in turn: a slow stretch of
    this noisy machine falls on every one."""
    samples: dict[str, list[float]] = {code: [] for code in codes}
    for _ in range(ROUNDS):
        for code in codes:
            samples[code] += cell_ms(kernel, code, cells // ROUNDS)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # 15 of each: with 7, this machine's noise alone moved the ratio by more than the 10% margin.
    parser.add_argument("--starts", type=int, default=15)
    parser.add_argument("--cells", type=int, default=300)
    args = parser.parse_args()
    spec = install_kernelspec()
    try:
        return measure(args.starts, args.cells)
    finally:
        shutil.rmtree(spec.parents[1], ignore_errors=True)


def measure(start_count: int, cell_count: int) -> int:

    starts: dict[str, list[float]] = {"python3": [], "fnkernel": []}
    for _ in range(start_count):
        for name in starts:
            starts[name].append(start_seconds(name))
    start_ratio = statistics.median(starts["fnkernel"]) / statistics.median(starts["python3"])

    # The first %%function of a notebook comes some time after its kernel started: by then the
    # embedded stack's waiting processes have imported what they need (WAIT_PREWARMED).
    # Right after kernel_info they have not, and the first %%function waits for them (reported).
    first = Kernel()
    try:
        cold_started = time.perf_counter()
        assert first.run(FUNCTION).ok
        at_once_ms = (time.perf_counter() - cold_started) * 1000
    finally:
        first.shutdown()
    kernel = Kernel()
    try:
        assert kernel.value(WAIT_PREWARMED) is True
        cold_started = time.perf_counter()
        assert kernel.run(FUNCTION).ok
        cold_ms = (time.perf_counter() - cold_started) * 1000
        cells = cells_in_turn(kernel, CELLS, cell_count)
        plain, invoke, silent, silent_invoke = (cells[code] for code in CELLS)
        assert kernel.run("_fnk_result = %invoke bench {}").ok
        display_ms = float(kernel.value(DISPLAY_MS))
        interrupts = interrupt_ms(kernel, 5)
        floor_cell, silent_again = floor_calls_ms(kernel, cell_count)
    finally:
        kernel.shutdown()
    trip_ratio = p(invoke, 50) / p(plain, 50)

    print(f"{'case':<38}{'median/p50':>12}{'p99':>10}{'ratio':>8}")
    for name, samples in starts.items():
        label = f"start → kernel_info ({name})"
        print(f"{label:<38}{statistics.median(samples) * 1000:>9.0f} ms{'':>10}", end="")
        print(f"{statistics.median(samples) / statistics.median(starts['python3']):>7.2f}x")
    print(f"{'1+1 cell':<38}{p(plain, 50):>9.2f} ms{p(plain, 99):>7.2f} ms{1:>7.2f}x")
    print(
        f"{'%invoke cell':<38}{p(invoke, 50):>9.2f} ms{p(invoke, 99):>7.2f} ms{trip_ratio:>7.2f}x"
    )
    for label, samples in (
        ("x = 1+1 (no output)", silent),
        ("r = bench.invoke({})", silent_invoke),
    ):
        ratio = p(samples, 50) / p(plain, 50)
        print(f"{label:<38}{p(samples, 50):>9.2f} ms{p(samples, 99):>7.2f} ms{ratio:>7.2f}x")
    print(f"{'  of which the invocation':<38}{p(silent_invoke, 50) - p(silent, 50):>9.2f} ms")
    print(f"{'  display of its result (formatters)':<38}{display_ms:>9.3f} ms")
    print(f"{'first %%function (cold runtime)':<38}{cold_ms:>9.0f} ms")
    print(f"{'  the same, right after kernel_info':<38}{at_once_ms:>9.0f} ms")
    floor_calls = floor_cell - silent_again
    cell_floor = p(plain, 50) + floor_calls
    print(f"{'_fnk_floor() (the floor calls, no output)':<38}{floor_cell:>9.2f} ms")
    print(f"{'  x = 1+1 in turn with it':<38}{silent_again:>9.2f} ms")
    print(f"{'  of which the floor calls':<38}{floor_calls:>9.2f} ms")
    print(
        f"floor of the %invoke cell (1+1 cell + the floor calls): {cell_floor:.2f} ms, "
        f"{cell_floor / p(plain, 50):.2f}x the 1+1 cell; %invoke cell / its floor: "
        f"{p(invoke, 50) / cell_floor:.2f}x"
    )
    label = "interrupt → KeyboardInterrupt in cell"
    print(f"{label:<38}{statistics.median(interrupts):>9.1f} ms{max(interrupts):>7.1f} ms (max)")
    return verdicts(
        [
            Target("start fnkernel / ipykernel", start_ratio, START_TARGET),
            Target("%invoke / 1+1 p50", trip_ratio, ROUND_TRIP_TARGET),
            Target("display of a small %invoke result", display_ms, DISPLAY_TARGET_MS, " ms"),
            Target("first %%function, cold embedded runtime", cold_ms, COLD_TARGET_MS, " ms"),
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
