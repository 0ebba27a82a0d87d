"""The whole local stack as child processes (docs/protocol.md, "Runs" ``fnkernel up``; the kernel's embedded runtime).

Each Runtime Pod is a Runtime Server process plus its runtimed process (``LocalProvisioner``, the
local ``PodProvisioner``); the gateway process hosts the control plane. Like a kubelet with ``restartPolicy: Always``, the supervisor restarts any
component that dies; stopping the stack stops them all, and every child also stops itself if the
supervising process dies (it watches its parent), so nothing is left behind.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from fnkernel.adapters import runtimes
from fnkernel.runtime_server import daemon, limits, logs, tokens, wire
from fnkernel.runtime_server.daemon import Child, spawn
from fnkernel.runtime_server.lifecycle.topology import OneMachine
from fnkernel.system.private import (
    memory_base,
    open_private,
    private_dir,
    private_tempdir,
    sweep,
)
from fnkernel.system.waiting import Backoff

LOG = logging.getLogger("fnkernel.up")
_MAX_UNIX_PATH = 100  # sockaddr_un holds 108 bytes; leave room for the longest file name
_RESTART_BACKOFF = Backoff(0.25, 1.0)  # by restarts in a row: 0, 0.25, 0.5, 1, 1, ...
_STABLE_SECONDS = 5.0  # up this long, a component's next restart is immediate again


def parse_pods(text: str) -> dict[str, int]:
    """``python=1,bash=1`` → {"python": 1, "bash": 1}."""
    pods: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        runtime, sep, count = item.partition("=")
        if not sep or runtime not in runtimes.RUNTIMES:
            raise ValueError(
                f"--pods: {item!r} is not RUNTIME=COUNT with RUNTIME one of {', '.join(runtimes.RUNTIMES)}"
            )
        if not (count.isascii() and count.isdigit()):
            raise ValueError(f"--pods: {item!r}: COUNT is a number of pods, got {count!r}")
        pods[runtime] = int(count)
    if not any(pods.values()):
        raise ValueError("--pods: start at least one pod")
    return pods


@dataclass
class Component:
    """One supervised process: how to start it, and the running child."""

    name: str
    args: list[str]
    child: Child | None = None
    log: IO[str] | None = None
    restarts: int = 0
    died_at: float = 0.0
    started_at: float = 0.0

    def log_file(self, log_dir: Path) -> Path:
        return log_dir / f"{self.name}.log"

    def start(self, log_dir: Path, prewarmed: daemon.Prewarmed | None = None) -> Child:
        if self.child is not None and self.child.proc.stdout is not None:
            self.child.proc.stdout.close()  # the exited child's announcement pipe
        if self.log is None:
            # 0600: a log may hold what a handler printed (README, "Security").
            self.log = open(self.log_file(log_dir), "a", opener=open_private)  # noqa: SIM115 — lives with the component
        self.child = spawn(self.args, stderr=self.log, die_with_parent=True, prewarmed=prewarmed)
        self.started_at = time.monotonic()
        return self.child


class LocalProvisioner:
    """Runtime Pods as processes of this machine (``PodProvisioner``): pod NAME is the
    components NAME-server and NAME-runtimed, supervised with the rest of the stack. Each pod
    has a workspace of its own, WORKSPACE/NAME: its runtimed writes its Runs' files there, and
    its server loads nothing from anywhere else."""

    def __init__(
        self,
        state_dir: Path,
        workspace_root: Path,
        sockets: Callable[[], Path],
        poll_interval: float,
        components: list[Component],
        launch: Callable[[Component], None],
        secrets_dir: Path | None = None,
        spool: Callable[[], Path] = lambda: Path(),
        max_payload_bytes: int = limits.DEFAULT_MAX_SPOOLED_BYTES,
        packages_dir: Path | None = None,
    ) -> None:
        """`components`: the supervised list its components join; `launch`: starts one;
        `spool`: the directory every pod spools large payloads in, each at most
        `max_payload_bytes`."""
        self._spool = spool
        self._max_payload = max_payload_bytes
        self.state_dir = state_dir
        self.secrets_dir = secrets_dir
        self.packages_dir = packages_dir
        self.workspace_root = workspace_root
        self._sockets = sockets
        self.poll_interval = poll_interval
        self._components = components
        self._launch = launch
        self._pods: dict[str, str] = {}  # pod → runtime, in the order started

    def start(self, runtime: str) -> str:
        pod = f"{runtime}-{len(self.pods(runtime))}"
        sockets = self._sockets()
        server = f"unix:{sockets / pod}.sock"
        workspace = private_dir(self.workspace_root / pod)
        serve = daemon.serve_args(
            runtime, server, workspace,
            "--spool", str(self._spool()), "--max-payload-bytes", str(self._max_payload),
        )  # fmt: skip
        listen = f"unix:{sockets / pod}.rtd.sock"
        runtimed = daemon.runtimed_args(
            pod, runtime, server, listen, self.poll_interval, self.state_dir, workspace,
            self.secrets_dir, self.packages_dir,
        )  # fmt: skip
        self._pods[pod] = runtime
        self._launch(Component(f"{pod}-server", serve))
        self._launch(Component(f"{pod}-runtimed", runtimed))
        return pod

    def _parts(self, pod: str) -> list[Component]:
        if pod not in self._pods:
            raise KeyError(pod)
        names = (f"{pod}-runtimed", f"{pod}-server")  # the order they stop in
        return sorted(
            (c for c in self._components if c.name in names), key=lambda c: names.index(c.name)
        )

    def alive(self, pod: str) -> bool:
        parts = self._parts(pod)
        return len(parts) == 2 and all(
            c.child is not None and c.child.proc.poll() is None for c in parts
        )

    def stop(self, pod: str, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        for component in self._parts(pod):
            self._components.remove(component)  # not restarted
            if component.child is not None:
                component.child.stop(max(0.1, deadline - time.monotonic()))
            if component.log is not None:
                component.log.close()
                component.log = None

    def address(self, pod: str) -> str:
        runtimed = next(c for c in self._parts(pod) if c.name.endswith("-runtimed"))
        return runtimed.child.address if runtimed.child is not None else ""

    def pods(self, runtime: str | None = None) -> list[str]:
        return [pod for pod, of in self._pods.items() if runtime in (None, of)]


class Stack:
    def __init__(
        self,
        state_dir: Path,
        pods: Mapping[str, int],
        *,
        gateway_listen: str = "127.0.0.1:8080",
        token_file: Path | None = None,
        no_token: bool = False,
        allow_origins: Sequence[str] = (),
        allow_hosts: Sequence[str] = (),
        poll_interval: float = 1.0,
        prewarmed: daemon.Prewarmed | None = None,
        secrets_dir: Path | None = None,
        max_payload_bytes: int = limits.DEFAULT_MAX_SPOOLED_BYTES,
        packages_dir: Path | None = None,
    ) -> None:
        """`token_file`: the gateway's bearer token; without one, a gateway on TCP gets a new
        token in STATE_DIR/token unless `no_token` (README, "Security"). `prewarmed`: processes
        the first start of each component may take (``daemon.Prewarmed``). `secrets_dir`: where
        the named secrets are (default STATE_DIR/secrets). `max_payload_bytes`: the largest
        payload or result (docs/protocol.md, "Large payloads"). `packages_dir`: the machine's
        cache of the Runs' requirements (default STATE_DIR/packages; "Requirements")."""
        self.max_payload_bytes = max_payload_bytes
        self.state_dir = state_dir.resolve()
        self.secrets_dir = secrets_dir
        self.topology = OneMachine(self.state_dir, secrets_dir)
        self.pods = dict(pods)
        self.gateway_listen = gateway_listen
        self.token_file = token_file
        self.no_token = no_token
        self.allow_origins = list(allow_origins)
        self.allow_hosts = list(allow_hosts)
        self.token: str | None = None
        self.poll_interval = poll_interval
        self.prewarmed = prewarmed
        self.components: list[Component] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._sockets = self.state_dir
        self._private_sockets: Path | None = None  # a temp dir of ours (_socket_dir)
        # docs/protocol.md, "Large payloads": one spool for every pod and the gateway, in memory
        # (a tmpfs) where there is one, made when the stack starts and removed when it stops.
        self.spool = Path()
        self.provisioner = LocalProvisioner(
            self.state_dir,
            self.workspace_root,
            lambda: self._sockets,
            poll_interval,
            self.components,
            self._start,
            secrets_dir,
            lambda: self.spool,
            max_payload_bytes,
            packages_dir,
        )

    @property
    def workspace_root(self) -> Path:
        """Where each pod's workspace is (WORKSPACE/POD/RUN_UID: ``LocalProvisioner``)."""
        return self.topology.workspace_root

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def gateway_address(self) -> str:
        gateway = self.component("gateway").child
        return gateway.address if gateway is not None else ""

    def _socket_dir(self) -> Path:
        """STATE_DIR/sock, unless a socket there could not be bound or named in a gRPC target
        (too long, or a character gRPC reads as syntax): then a private temp dir of ours."""
        sockets = self.state_dir / "sock"
        if len(str(sockets)) > _MAX_UNIX_PATH - 24 or wire.unix_target_problem(str(sockets)):
            sweep("sock")
            sockets = self._private_sockets = private_tempdir("sock")  # 0700, short enough to bind
        return private_dir(sockets)

    def start(self) -> None:
        """Start every pod, then the gateway; each is announced before the next starts.
        NotPrivate (before anything is written) if the state dir or one of its directories is
        not this user's alone (README, "Security")."""
        for directory in (self.state_dir, self.workspace_root, self.log_dir):
            private_dir(directory)
        self._sockets = self._socket_dir()
        sweep("spool", memory_base())  # what a stack that was killed left
        self.spool = private_tempdir("spool", memory_base())
        # StoreDamaged, said here, before any component starts on a store it cannot use.
        self.topology.open_store().close()
        chosen = tokens.gateway_token(
            self.gateway_listen, self.state_dir, token_file=self.token_file, no_token=self.no_token
        )
        self.token = chosen.token
        gateway = daemon.gateway_args(
            self.gateway_listen,
            self.state_dir,
            token_file=chosen.path,
            no_token=chosen.token is None and not self.gateway_listen.startswith("unix:"),
            allow_origins=self.allow_origins,
            allow_hosts=self.allow_hosts,
            secrets_dir=self.secrets_dir,
            spool=self.spool,
            max_payload_bytes=self.max_payload_bytes,
        )
        try:
            for runtime, count in self.pods.items():
                for _ in range(count):
                    self.provisioner.start(runtime)
            self._start(Component("gateway", gateway))
        except BaseException:
            self.stop()
            raise
        self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._supervisor.start()

    def add_pod(self, runtime: str) -> str:
        """Start one more Runtime Pod of `runtime` on a started stack; its name. The gateway's
        scheduler sees it at its first heartbeat, which precedes its announcement."""
        with self._lock:
            if self._stopping.is_set():
                raise RuntimeError("the stack is stopping")
            pod = self.provisioner.start(runtime)
            self.pods[runtime] = self.pods.get(runtime, 0) + 1
            return pod

    def _start(self, component: Component) -> None:
        self.components.append(component)
        child = component.start(self.log_dir, self.prewarmed)
        if component.name == "gateway":
            # Restart the gateway where it was, not on a fresh ephemeral port.
            listen = component.args.index("--listen") + 1
            component.args[listen] = child.address.removeprefix("http://")

    def component(self, name: str) -> Component:
        for component in self.components:
            if component.name == name:
                return component
        raise KeyError(name)

    def describe(self) -> list[str]:
        lines = []
        for component in self.components:
            child = component.child
            if child is not None:
                lines.append(f"{component.name}: {child.address} (pid {child.pid})")
        return lines

    def _supervise(self) -> None:
        # Restart any component that exited, with a growing backoff; once a second, keep each
        # component's log bounded (logs.rotate).
        next_rotation = 0.0
        while not self._stopping.wait(0.1):
            if time.monotonic() >= next_rotation:
                next_rotation = time.monotonic() + 1.0
                for component in self.components:
                    logs.rotate(component.log_file(self.log_dir))
            for component in self.components:
                child = component.child
                now = time.monotonic()
                if child is None or child.proc.poll() is None:
                    if component.restarts and now - component.started_at > _STABLE_SECONDS:
                        component.restarts = 0  # it recovered: the back-off starts over
                    continue
                if not component.died_at:
                    component.died_at = now
                    LOG.warning("%s exited (%s); restarting", component.name, child.proc.returncode)
                delay = _RESTART_BACKOFF.delay(component.restarts)
                if now - component.died_at < delay:
                    continue
                with self._lock:
                    if self._stopping.is_set():
                        return
                    try:
                        component.start(self.log_dir)
                        component.restarts += 1
                        component.died_at = 0.0
                        LOG.warning("%s restarted (pid %d)", component.name, component.child.pid)  # type: ignore[union-attr]
                    except RuntimeError as exc:
                        component.restarts += 1
                        component.died_at = now
                        LOG.error("%s did not restart: %s", component.name, exc)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the gateway, then the runtimeds, then the servers (they drain); nothing survives."""
        with self._lock:
            self._stopping.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(5)
        # The gateway first (no new calls), then the pods, each runtimed before its server.
        order = sorted(reversed(self.components), key=lambda c: c.name != "gateway")
        for component in order:
            if component.child is not None and component.child.proc.poll() is None:
                component.child.proc.terminate()
        deadline = time.monotonic() + timeout
        for component in order:
            if component.child is not None:
                component.child.stop(max(0.1, deadline - time.monotonic()))
            if component.log is not None:
                component.log.close()
                component.log = None
        if self._private_sockets is not None:
            shutil.rmtree(self._private_sockets, ignore_errors=True)
        if self.spool != Path():
            shutil.rmtree(self.spool, ignore_errors=True)
