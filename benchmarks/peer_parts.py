"""The peers and bare parts `benchmarks.peers` measures fnkernel beside, none of them ours: a
pipe to a process, raw HTTP from ``http.client``, Jupyter Kernel Gateway in notebook-http mode,
Ray's actor and task, and the threads that keep IN_FLIGHT calls outstanding.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import grpc

from benchmarks.invoke import ECHO_METHOD, STREAM_METHOD, WORKER_METHOD, PipeEcho
from benchmarks.processes import children_of
from benchmarks.throughput import MAX_CALLS, StreamCaller, relay
from fnkernel.runtime_server.daemon import Child
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS

IN_FLIGHT = 10
KG_KERNELS = 2  # Kernel Gateway's pool: a kernel per core
KG_NOTEBOOK = {
    "cells": [
        {
            "cell_type": "code",
            "metadata": {},
            "execution_count": None,
            "outputs": [],
            "source": '# POST /echo\nimport json\nprint(json.dumps(json.loads(REQUEST)["body"]))\n',
        }
    ],
    "metadata": {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
    },
    "nbformat": 4,
    "nbformat_minor": 5,
}


def payload_of(size: int) -> dict[str, str]:
    """A value whose compact JSON is `size` bytes (6 MiB: the payload limit, exactly)."""
    return {"s": "x" * (size - len('{"s":""}'))}


class RawHttp:
    """One kept-alive http.client connection POSTing bytes: the same for every server."""

    def __init__(self, address: str, path: str, token: str | None = None) -> None:
        url = urlsplit(address if "//" in address else f"http://{address}")
        self.connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=120)
        self.path = path
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    def post(self, body: bytes) -> bytes:
        try:
            self.connection.request("POST", self.path, body, self.headers)
            answer = self.connection.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            # Closed by the server while it sat idle (the gateway's header timeout, between
            # rounds): as any HTTP client, reconnect and send it again — it had not begun.
            self.connection.close()
            self.connection.request("POST", self.path, body, self.headers)
            answer = self.connection.getresponse()
        data = answer.read()
        if answer.status != 200:
            raise RuntimeError(f"{self.path}: HTTP {answer.status} {data[:200]!r}")
        return data


class KernelGateway:
    """Jupyter Kernel Gateway in notebook-http mode, serving KG_NOTEBOOK on 127.0.0.1."""

    def __init__(self, root: Path) -> None:
        notebook = root / "echo.ipynb"
        notebook.write_text(json.dumps(KG_NOTEBOOK))
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "kernel_gateway",
                "--KernelGatewayApp.api=kernel_gateway.notebook_http",
                f"--KernelGatewayApp.seed_uri={notebook}",
                "--KernelGatewayApp.ip=127.0.0.1",
                f"--KernelGatewayApp.port={port}",
                f"--KernelGatewayApp.prespawn_count={KG_KERNELS}",
            ],
            cwd=root,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:  # up once a request is answered (the kernels run the notebook first)
            try:
                RawHttp(self.address, "/echo").post(b'{"s": "up"}')
                return
            except (OSError, RuntimeError, http.client.HTTPException):
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.close()
                    raise RuntimeError("Kernel Gateway did not come up") from None
                time.sleep(0.2)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_peers(
    root: Path, closers: list[Callable[[], None]]
) -> tuple[PipeEcho, KernelGateway | None, Any]:
    """The pipe echo, Kernel Gateway (serving from `root`) and Ray, each closer added to
    `closers`; None for a peer that is not installed, and the report says so."""
    pipe = PipeEcho()
    closers.append(pipe.close)
    kernel_gateway = None
    try:
        import kernel_gateway as _  # noqa: F401
    except ImportError:
        print("Jupyter Kernel Gateway is not installed: left out (pip install -e '.[peers]')")
    else:
        kernel_gateway = KernelGateway(root)
        closers.append(kernel_gateway.close)
    ray = start_ray()
    if ray is None:
        print("Ray is not installed: left out (pip install -e '.[peers]')")
    else:
        closers.append(ray.shutdown)
    return pipe, kernel_gateway, ray


def start_ray(object_store_bytes: int = 1 << 30) -> Any:
    """Ray on this machine (a local cluster of this process) with an object store of
    `object_store_bytes`, or None when it is not installed."""
    try:
        import ray
    except ImportError:
        return None
    options = dict(
        num_cpus=2,
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=False,
        object_store_memory=object_store_bytes,
    )
    # Ray's GCS server is given 30 s to bind its port, which it passed twice in a row on a
    # slow hour here while Kernel Gateway started beside it (Ray alone took 17-20 s to
    # start): Ray's own knob for that wait, unless the caller set it.
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
    try:
        ray.init(**options)
    except Exception as exc:  # Ray raises a bare Exception when its node does not start
        if not any(why in str(exc) for why in _RAY_DID_NOT_START):
            raise
        # Seen here 2 of 4 times a run began right after another: its raylet never came up.
        print(f"Ray did not start ({exc}); starting it again", file=sys.stderr)
        ray.shutdown()
        ray.init(**options)
    return ray


# What ray.init raises when its node did not come up: the raylet, or the GCS server's port.
_RAY_DID_NOT_START = ("timed out during startup", "Timed out waiting for file")


def ray_cases(ray: Any) -> tuple[dict[str, Callable[[Any], Any]], Callable[[int, float], float]]:
    """Ray's echo as an actor method and as a task, and its 10-in-flight rate of each."""

    @ray.remote
    class Echo:
        def handle(self, event: Any) -> Any:
            return event

    @ray.remote
    def handle(event: Any) -> Any:
        return event

    actor = Echo.remote()
    actors = [Echo.remote() for _ in range(IN_FLIGHT)]
    ray.get([a.handle.remote(0) for a in [actor, *actors]])

    def outstanding(kind: int, seconds: float) -> float:
        """Calls/s keeping IN_FLIGHT calls outstanding: tasks (0) or one per actor (1)."""
        submit = [
            lambda i: handle.remote({"s": "x"}),
            lambda i: actors[i].handle.remote({"s": "x"}),
        ][kind]
        refs = {submit(i): i for i in range(IN_FLIGHT)}  # each call's slot
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds and count < MAX_CALLS:
            done, _ = ray.wait(list(refs), num_returns=1)
            ray.get(done[0])
            slot = refs.pop(done[0])
            refs[submit(slot)] = slot
            count += 1
        rate = count / (time.perf_counter() - started)
        ray.get(list(refs))
        return rate

    return {
        "Ray actor call": lambda value: ray.get(actor.handle.remote(value)),
        "Ray task": lambda value: ray.get(handle.remote(value)),
    }, outstanding


def threaded(call: Callable[[int], object], seconds: float) -> float:
    """Calls/s of IN_FLIGHT threads, thread i calling call(i) one call at a time, for `seconds`."""
    counts = [0] * IN_FLIGHT
    deadline = time.perf_counter() + seconds

    def caller(slot: int) -> None:
        while time.perf_counter() < deadline and counts[slot] < MAX_CALLS:
            call(slot)
            counts[slot] += 1

    workers = [threading.Thread(target=caller, args=(slot,)) for slot in range(IN_FLIGHT)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(counts) / (time.perf_counter() - started)


class StreamFloor(NamedTuple):
    """One floor on streams: its one-call case's label and its IN_FLIGHT threads' case's, its
    callers (the first for the one call, one each for the threads) and its processes."""

    latency: str
    threads: str
    callers: list[StreamCaller]
    processes: dict[str, int]


# The floors on call streams (docs/architecture.md, "Call streams"): the relay as runtimed's
# (a grpcio thread-pool server), and the same relay on grpc.aio's event loop.
STREAM_RELAYS = {"sync-stream": "", "aio-stream": ", grpc.aio relay"}
# The floor of our design's path (docs/architecture.md, "Where the hot path stands"): a caller on
# call streams to a grpc.aio relay (runtimed), on to a grpcio server (the Runtime Server) and a
# worker process over pipes that reads the value and writes it again — each our design's own
# process, with bare parts in them and none of our code.
FLOOR_DESIGN = "design floor: grpc.aio relay, gRPC server, a worker over pipes"
FLOOR_DESIGN_THREADS = f"design floor, {IN_FLIGHT} threads on {IN_FLIGHT} workers"


class NoHttpFloor:
    """The floor under the Client's direct calls (no HTTP hop, no worker): a blocking gRPC call
    to a thread-pool relay, on to the bare `echo` (started with its socket in `directory`) — as
    unary calls, and as the messages of streams already open, as our hops make them
    (docs/architecture.md, "Call streams"), through a relay of each of STREAM_RELAYS' kinds;
    with the callers IN_FLIGHT threads use, and each case's processes. And the floor of the
    design's path on the same echo (FLOOR_DESIGN), which has a worker."""

    def __init__(self, directory: str, echo: Child) -> None:
        self.relay = relay("sync", f"unix:{directory}/sync-proxy.sock", echo.address)
        self.children = [self.relay]

        def unary() -> Callable[..., bytes]:  # a channel each, as the Client's calls have
            channel = grpc.insecure_channel(self.relay.address, options=CHANNEL_OPTIONS)
            return channel.unary_unary(ECHO_METHOD)  # type: ignore[no-any-return]

        self.call, self.threads = unary(), [unary() for _ in range(IN_FLIGHT)]
        self.processes = {
            "floor without HTTP: gRPC relay (sync)": self.relay.pid,
            "floor chain: gRPC echo": echo.pid,
        }
        self.streams: list[StreamFloor] = []
        for kind, which in STREAM_RELAYS.items():
            streams = relay(
                kind, f"unix:{directory}/{kind}-proxy.sock", echo.address, STREAM_METHOD
            )
            self.children.append(streams)
            channel = grpc.insecure_channel(streams.address, options=CHANNEL_OPTIONS)
            self.streams.append(StreamFloor(
                f"floor without the HTTP hop, on call streams{which}",
                f"floor without the HTTP hop, {IN_FLIGHT} threads on call streams{which}",
                [StreamCaller(channel, STREAM_METHOD) for _ in range(IN_FLIGHT + 1)],
                {f"floor on streams: gRPC relay ({kind})": streams.pid,
                 "floor chain: gRPC echo": echo.pid},
            ))  # fmt: skip
        # The design's floor: our path's processes (runtimed's relay on grpc.aio, a grpcio server
        # and a worker of each stream's own over pipes), none of our code in them.
        design = relay("aio-stream", f"unix:{directory}/design-proxy.sock", echo.address,
                       WORKER_METHOD)  # fmt: skip
        self.children.append(design)
        channel = grpc.insecure_channel(design.address, options=CHANNEL_OPTIONS)
        callers = [StreamCaller(channel, WORKER_METHOD) for _ in range(IN_FLIGHT + 1)]
        for caller in callers:  # each stream's worker started
            caller.call(b"{}")
        self.design = StreamFloor(
            FLOOR_DESIGN,
            FLOOR_DESIGN_THREADS,
            callers,
            {
                "design floor: gRPC relay (aio)": design.pid,
                "design floor: gRPC server": echo.pid,
                **{
                    f"design floor: gRPC server-worker-{number}": pid
                    for number, pid in enumerate(children_of(echo.pid), start=1)
                },
            },
        )

    def close(self) -> None:
        for floor in (*self.streams, self.design):
            for caller in floor.callers:
                caller.close()
