"""The long-running components of the stack: ``serve``, ``runtimed``, ``gateway``,
``controller``, ``up`` (and ``down``) — each one's flags beside its handler. The KRM servers,
``evaluator`` and ``wrapper-server``, are cli/krm.py's."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fnkernel.adapters import runtimes
from fnkernel.runtime_server.cli import statedir
from fnkernel.runtime_server.cli.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    add_max_payload,
    add_state_dir,
    count,
    interval,
    listen_address,
    seconds,
    state_dir_of,
)

if TYPE_CHECKING:
    from fnkernel.runtime_server.lifecycle.topology import Topology
    from fnkernel.runtime_server.tokens import GatewayToken

STORES = ("sqlite", "kubernetes")


def _add_store_flags(parser: argparse.ArgumentParser) -> None:
    """Where Runs are kept (docs/architecture.md, "Seams"; docs/kubernetes.md)."""
    parser.add_argument(
        "--store",
        choices=STORES,
        default="sqlite",
        help="sqlite: STATE_DIR/runs.db, shared by the processes of one machine (default); "
        "kubernetes: Run objects of the cluster's API server",
    )
    parser.add_argument(
        "--namespace",
        metavar="NS",
        help="with --store kubernetes: the namespace of the Runs and Runtime Pods (default: "
        "$FNKERNEL_NAMESPACE, else this pod's own, else default)",
    )


def topology_of(args: argparse.Namespace) -> Topology:
    """The deployment the flags describe (``lifecycle/topology.py``): ``--store sqlite`` is one
    machine's, in the state dir; ``--store kubernetes`` a cluster's, in ``--namespace``."""
    if args.store == "kubernetes":
        # Imported only here: one machine never loads the Kubernetes client.
        from fnkernel.runtime_server.lifecycle.kubernetes.topology import Kubernetes

        return Kubernetes(args.namespace)
    from fnkernel.runtime_server.lifecycle.topology import OneMachine

    secrets = getattr(args, "secrets_dir", None)
    return OneMachine(state_dir_of(args), Path(secrets) if secrets else None)


def _serve(args: argparse.Namespace) -> int:
    from fnkernel.adapters.children import kill_orphans
    from fnkernel.runtime_server import daemon, logs
    from fnkernel.runtime_server.daemon import announcement
    from fnkernel.runtime_server.function_runtime.server import RuntimeServer
    from fnkernel.runtime_server.function_runtime.spool import Spool

    logs.configure(logging.DEBUG if args.verbose else logging.INFO)
    daemon.keep_freed_memory()  # payloads pass through (docs/architecture.md)
    workspace_root = Path(args.workspace_root).resolve()
    if not workspace_root.is_dir():
        print(
            f"fnkernel serve: --workspace-root {args.workspace_root} is not a directory",
            file=sys.stderr,
        )
        return EXIT_USAGE
    daemon.become_subreaper()
    stop_reaper = threading.Event()
    daemon.start_reaper(stop_reaper)
    spool = Spool(Path(args.spool), args.max_payload_bytes) if args.spool else None
    server = RuntimeServer(
        args.runtime, workspace_root, oneshot_only=args.oneshot_only, spool=spool
    )
    try:
        address = server.start(args.listen)
    except RuntimeError as exc:
        print(f"fnkernel serve: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    services = "Runtime" if args.oneshot_only else "Runtime, FunctionRuntime"
    detail = f"{args.runtime} runtime ({services})"
    print(announcement("serve", detail, address, f"workspace root {workspace_root}"), flush=True)
    daemon.wait_for_termination()
    logging.getLogger("fnkernel.runtime").info("draining for up to %ss", args.drain_timeout)
    server.stop(args.drain_timeout)
    stop_reaper.set()
    kill_orphans()  # nothing a handler started outlives its server
    return EXIT_OK


def _runtimed(args: argparse.Namespace) -> int:
    from fnkernel.runtime_server import daemon, limits, logs
    from fnkernel.runtime_server.daemon import announcement
    from fnkernel.runtime_server.lifecycle.runtimed import Runtimed
    from fnkernel.runtime_server.lifecycle.runtimed.packages import PackageCache
    from fnkernel.runtime_server.lifecycle.topology import MissingWorkspace
    from fnkernel.system.private import private_dir

    logs.configure(logging.DEBUG if args.verbose else logging.INFO)
    daemon.keep_freed_memory()  # payloads pass through (docs/architecture.md)
    topology = topology_of(args)
    try:
        workspace = topology.workspace(args.pod, Path(args.workspace) if args.workspace else None)
    except MissingWorkspace as exc:
        raise UsageError(f"runtimed: --workspace is needed: {exc}") from None
    try:
        packages = topology.packages(Path(args.packages) if args.packages else None)
    except MissingWorkspace as exc:
        raise UsageError(f"runtimed: --packages is needed: {exc}") from None
    runtimed = Runtimed(
        topology.open_store(pods=False, only_pod=args.pod),
        pod=args.pod,
        runtime=args.runtime,
        server_address=args.server,
        workspace=private_dir(workspace),
        packages=PackageCache(packages, max_bytes=args.packages_max_gib << 30),
        secrets=topology.open_secrets(),
        poll_interval=args.poll_interval,
    )
    try:
        address = runtimed.start(args.listen)
    except RuntimeError as exc:
        print(f"fnkernel runtimed: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    detail = f"pod {args.pod} ({args.runtime}, server {args.server})"
    print(announcement("runtimed", detail, address), flush=True)
    daemon.wait_for_termination()
    runtimed.stop(grace=limits.STOP_DRAIN_SECONDS)
    return EXIT_OK


def _gateway_token(args: argparse.Namespace, command: str, listen: str) -> GatewayToken:
    """The token a gateway on `listen` requires (README, "Security"); where a generated one is
    saved is said (never the token: a log of this line is anyone's to read), and --no-token
    warns."""
    from fnkernel.runtime_server import tokens

    try:
        chosen = tokens.gateway_token(
            listen,
            state_dir_of(args),
            token_file=Path(args.token_file) if args.token_file else None,
            no_token=args.no_token,
        )
    except (OSError, ValueError) as exc:
        raise UsageError(f"{command}: {exc}") from None
    if args.no_token and not listen.startswith("unix:"):
        print(
            f"fnkernel {command}: WARNING: --no-token: any program or web page on this machine "
            "can call the gateway and run code as you",
            file=sys.stderr,
        )
    if chosen.generated:
        print(
            f"fnkernel {command}: a new token, saved in {chosen.path} (0600): fnkernel clients "
            "on this machine find it; another machine's need it (FNKERNEL_TOKEN)",
            file=sys.stderr,
            flush=True,
        )
    return chosen


def _gateway(args: argparse.Namespace) -> int:
    import asyncio

    from fnkernel.runtime_server import daemon, limits, logs, tokens
    from fnkernel.runtime_server.daemon import announcement
    from fnkernel.runtime_server.function_runtime.spool import spool_dir
    from fnkernel.runtime_server.lifecycle.controlplane import ControlPlane
    from fnkernel.runtime_server.lifecycle.gateway import Access, Gateway

    logs.configure(logging.DEBUG if args.verbose else logging.INFO)
    daemon.keep_freed_memory(daemon.GATEWAY_TRIM_THRESHOLD_BYTES)  # docs/architecture.md
    token = _gateway_token(args, "gateway", args.listen).token
    access = Access(
        token, frozenset(args.allow_origin), frozenset(h.lower() for h in args.allow_host)
    )
    topology = topology_of(args)
    control_plane = ControlPlane(topology.open_store())

    async def serve() -> None:
        gateway = Gateway(
            control_plane,
            access,
            secrets=topology.open_secrets(),
            body_timeout=args.body_timeout,
            header_timeout=args.header_timeout,
            max_payload_bytes=args.max_payload_bytes,
            spool=Path(args.spool) if args.spool else None,
        )
        try:
            address = gateway.listen(args.listen)
        except OSError as exc:
            print(f"fnkernel gateway: cannot listen on {args.listen}: {exc}", file=sys.stderr)
            raise SystemExit(EXIT_FAILURE) from None
        try:
            # The gateway file is for clients of this machine: none on Kubernetes, nor for a
            # Unix socket (its directory's mode guards it). It names the gateway's spool, which
            # a client trusts from nowhere else (tokens.holds).
            spool = str(spool_dir(Path(args.spool))) if args.spool else None
            gateway_file = (
                tokens.announce(address, token, spool)
                if topology.local_clients and not address.startswith("unix:")
                else None
            )
        except OSError as exc:
            print(f"fnkernel gateway: cannot write its gateway file: {exc}", file=sys.stderr)
            raise SystemExit(EXIT_FAILURE) from None
        if topology.control_plane_in_gateway:
            control_plane.start()
        detail = "control plane + HTTP" if topology.control_plane_in_gateway else "HTTP"
        print(announcement("gateway", detail, address, topology.where()), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            # First, as the stack stops: its pods stop beating as they drain, and a control
            # plane still judging them would move every Run they held, a new attempt each.
            if topology.control_plane_in_gateway:
                await asyncio.to_thread(control_plane.stop)
            if gateway_file is not None:
                tokens.withdraw(gateway_file)
        await gateway.close(drain=limits.STOP_DRAIN_SECONDS)
        control_plane.store.close()

    asyncio.run(serve())
    return EXIT_OK


def _controller(args: argparse.Namespace) -> int:
    from fnkernel.runtime_server import daemon, logs
    from fnkernel.runtime_server.lifecycle.controlplane import ControlPlane

    logs.configure(logging.DEBUG if args.verbose else logging.INFO)
    topology = topology_of(args)
    control_plane = ControlPlane(topology.open_store(), tick=args.tick)
    control_plane.start()
    print(f"fnkernel controller: scheduler and retry engine, {topology.where()}", flush=True)
    daemon.wait_for_termination()
    control_plane.stop()
    control_plane.store.close()
    return EXIT_OK


def _up(args: argparse.Namespace) -> int:
    from fnkernel.runtime_server import daemon, logs, tokens
    from fnkernel.runtime_server.errors import StoreDamaged
    from fnkernel.runtime_server.lifecycle.stack import Stack, parse_pods

    logs.configure(logging.INFO)
    try:
        pods = parse_pods(args.pods)
    except ValueError as exc:
        print(f"fnkernel up: {exc}", file=sys.stderr)
        return EXIT_USAGE
    state_dir = state_dir_of(args)
    try:
        held = statedir.hold_state_dir(state_dir)
    except statedir.StateDirInUse as exc:
        print(f"fnkernel up: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    chosen = _gateway_token(args, "up", args.gateway_listen)
    stack = Stack(
        state_dir,
        pods,
        gateway_listen=args.gateway_listen,
        token_file=chosen.path,
        no_token=chosen.token is None,
        allow_origins=args.allow_origin,
        allow_hosts=args.allow_host,
        poll_interval=args.poll_interval,
        max_payload_bytes=args.max_payload_bytes,
    )
    # SIGTERM or Ctrl-C while starting (`fnkernel down`, a CI job cancelled) stops what has
    # started: handled from before the pid file `fnkernel down` reads is written.
    starting = {sig: signal.signal(sig, _interrupted) for sig in _STOPS}
    up_file = stack.state_dir / statedir.UP_FILE  # for ``fnkernel down``: from the start, so that a
    try:
        tokens.write_private(up_file, f"{os.getpid()}\n")  # down while it starts stops it too
        stack.start()
    except RuntimeError as exc:
        print(f"fnkernel up: {exc} (logs in {stack.state_dir / 'logs'})", file=sys.stderr)
        return _stopped(stack, up_file, EXIT_FAILURE)
    except StoreDamaged as exc:
        print(f"fnkernel up: {exc}", file=sys.stderr)
        return _stopped(stack, up_file, EXIT_FAILURE)
    except StoppedWhileStarting:  # stopping now: further signals are ignored (_interrupted)
        print("fnkernel up: stopped while starting", file=sys.stderr)
        return _stopped(stack, up_file, EXIT_INTERRUPTED)
    for sig, handler in starting.items():
        signal.signal(sig, handler)
    print(f"fnkernel up: state dir {stack.state_dir}")
    for line in stack.describe():
        print(f"  {line}")
    print(
        f"fnkernel up: ready; gateway {stack.gateway_address}; Ctrl-C or `fnkernel down` stops "
        "everything",
        flush=True,
    )
    try:
        daemon.wait_for_termination()
        stack.stop()
    finally:
        up_file.unlink(missing_ok=True)
        held.close()
    return EXIT_OK


_STOPS = (signal.SIGTERM, signal.SIGINT)


class StoppedWhileStarting(KeyboardInterrupt):
    """A stop while `up` starts, raised where its start was. Not KeyboardInterrupt itself:
    landing in code Python runs from a string (the ``__init__`` a dataclass builds as it is
    imported), a KeyboardInterrupt marks the process as killed by Ctrl-C even once caught, and
    under ``python -m`` the interpreter then ends itself by SIGINT (exit status -2) instead of
    with the 130 returned (CPython's ``run_eval_code_obj``); a subclass is not marked."""


def _interrupted(signum: int, frame: Any) -> None:
    """The first stop while `up` starts: the start is interrupted, and what follows ignored
    (a second Ctrl-C, the process group's signal) while it stops what has started."""
    for sig in _STOPS:
        signal.signal(sig, signal.SIG_IGN)
    raise StoppedWhileStarting


def _stopped(stack: Any, up_file: Path, code: int) -> int:
    """Stop what of `stack` started, and say `code`."""
    stack.stop()
    up_file.unlink(missing_ok=True)
    return code


def _add_access_flags(parser: argparse.ArgumentParser) -> None:
    """Who may call the gateway (README, "Security")."""
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="require the bearer token in FILE (default on TCP: a new one, saved in "
        "STATE_DIR/token, 0600)",
    )
    parser.add_argument(
        "--no-token",
        action="store_true",
        help="require no token (loopback only; any local program or web page can then run code)",
    )
    parser.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser origin allowed to call the gateway, e.g. https://app.example "
        "(repeatable; default none)",
    )
    parser.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name the Host header may carry besides the listen address and localhost "
        "(repeatable)",
    )


def register(commands: Any) -> None:
    """Add the subcommands of this group to `commands` (argparse subparsers)."""
    from fnkernel.runtime_server import limits

    serve = commands.add_parser(
        "serve",
        help="run a Runtime Server (executor.v1 Runtime + FunctionRuntime)",
        description="Run a Runtime Server for one built-in runtime. SIGTERM drains in-flight "
        "invocations (bounded by --drain-timeout) and exits 0.",
    )
    serve.add_argument("--runtime", choices=runtimes.RUNTIMES, required=True)
    serve.add_argument(
        "--listen",
        type=listen_address,
        default="127.0.0.1:9090",
        metavar="ADDR",
        help="host:port or unix:PATH (default %(default)s)",
    )
    serve.add_argument(
        "--workspace-root",
        default=os.environ.get("FNKERNEL_WORKSPACE_ROOT", os.getcwd()),
        metavar="DIR",
        help="every working_dir must be inside DIR (default: $FNKERNEL_WORKSPACE_ROOT or the current directory)",
    )
    serve.add_argument(
        "--oneshot-only", action="store_true", help="register Runtime only (no function mode)"
    )
    serve.add_argument(
        "--drain-timeout",
        type=seconds,
        default=limits.STOP_DRAIN_SECONDS,
        metavar="SECONDS",
        help="on SIGTERM, how long the calls in flight may run on (default %(default)s)",
    )
    serve.add_argument(
        "--spool",
        metavar="DIR",
        help="where payloads past one message wait, made 0700 (docs/protocol.md, 'Large "
        "payloads'); none: only payloads of one message",
    )
    add_max_payload(serve)
    serve.add_argument("-v", "--verbose", action="store_true")
    serve.set_defaults(func=_serve)

    runtimed = commands.add_parser(
        "runtimed",
        help="run the runtimed agent of one Runtime Pod",
        description="Registers the Runs assigned to this pod with its Runtime Server, polls their "
        "status, scales idle ones to zero, and serves the proxy hop on its own port.",
    )
    runtimed.add_argument("--pod", required=True, metavar="NAME")
    runtimed.add_argument("--runtime", choices=runtimes.RUNTIMES, required=True)
    runtimed.add_argument(
        "--server",
        required=True,
        type=listen_address,
        metavar="ADDR",
        help="the colocated Runtime Server, host:port or unix:PATH",
    )
    runtimed.add_argument("--listen", type=listen_address, default="127.0.0.1:0", metavar="ADDR")
    runtimed.add_argument(
        "--poll-interval",
        type=interval,
        default=1.0,
        metavar="SECONDS",
        help="FunctionStatus cadence (default %(default)s)",
    )
    runtimed.add_argument(
        "--workspace",
        metavar="DIR",
        help="where it writes its Runs' files; inside its server's --workspace-root "
        "(default: STATE_DIR/workspace/POD)",
    )
    runtimed.add_argument(
        "--packages",
        metavar="DIR",
        help="the node's cache of the Runs' requirements, shared by the pods of a node "
        "(default: STATE_DIR/packages)",
    )
    runtimed.add_argument(
        "--packages-max-gib",
        type=count,
        default=10,
        metavar="GIB",
        help="past this, the least recently used requirement sets are removed (default 10)",
    )
    _add_store_flags(runtimed)
    add_state_dir(runtimed)
    runtimed.add_argument("-v", "--verbose", action="store_true")
    runtimed.set_defaults(func=_runtimed)

    gateway = commands.add_parser(
        "gateway",
        help="run the HTTP gateway and the control plane",
        description="HTTP/JSON in front of runtimed, with the control plane (Run store, "
        "scheduler, retry engine) in the same process.",
    )
    gateway.add_argument("--listen", type=listen_address, default="127.0.0.1:8080", metavar="ADDR")
    gateway.add_argument(
        "--body-timeout",
        type=seconds,
        default=60.0,
        metavar="SECONDS",
        help="close a connection whose request body has not arrived whole by then "
        "(default %(default)s)",
    )
    gateway.add_argument(
        "--header-timeout",
        type=seconds,
        default=10.0,
        metavar="SECONDS",
        help="close a connection whose request headers have not arrived whole this long after "
        "it opened or its last answer; also how long a kept-alive connection may idle "
        "(default %(default)s)",
    )
    gateway.add_argument(
        "--spool",
        metavar="DIR",
        help="the spool of this machine's pods, where a caller on this machine hands a large "
        "payload over as a file (docs/protocol.md, 'Large payloads'); none on Kubernetes",
    )
    add_max_payload(gateway)
    _add_access_flags(gateway)
    _add_store_flags(gateway)
    add_state_dir(gateway)
    gateway.add_argument("-v", "--verbose", action="store_true")
    gateway.set_defaults(func=_gateway)

    controller = commands.add_parser(
        "controller",
        help="run the control plane alone: the scheduler and retry engine (on Kubernetes)",
        description="Admit Runs, assign them to Runtime Pods, retry and reassign them, finish "
        "deletes: the control plane's loop, without the gateway (docs/kubernetes.md).",
    )
    controller.add_argument(
        "--tick",
        type=seconds,
        default=0.1,
        metavar="SECONDS",
        help="how often it schedules and retries (default %(default)s)",
    )
    _add_store_flags(controller)
    add_state_dir(controller)
    controller.add_argument("-v", "--verbose", action="store_true")
    controller.set_defaults(func=_controller)

    up = commands.add_parser(
        "up",
        help="run the whole local stack: control plane, pods and gateway",
        description="Start the control plane, the Runtime Pods (each a Runtime Server and a "
        "runtimed) and the gateway; print their addresses; Ctrl-C or SIGTERM stops them all.",
    )
    up.add_argument(
        "--pods",
        default=",".join(f"{name}=1" for name in runtimes.RUNTIMES),
        metavar="RUNTIME=N,...",
        help="the Runtime Pods to start (default %(default)s)",
    )
    up.add_argument(
        "--gateway-listen",
        type=listen_address,
        default="127.0.0.1:8080",
        metavar="ADDR",
        help="host:port or unix:PATH (default %(default)s)",
    )
    _add_access_flags(up)
    up.add_argument(
        "--poll-interval",
        type=interval,
        default=1.0,
        metavar="SECONDS",
        help="each runtimed's FunctionStatus cadence (default %(default)s)",
    )
    add_max_payload(up)
    add_state_dir(up)
    up.set_defaults(func=_up)

    down = commands.add_parser(
        "down",
        help="stop the stack `fnkernel up` started with this state dir",
        description="Stop the `fnkernel up` of this state dir as Ctrl-C would (its calls in "
        "flight drain first) and wait until every component is gone.",
    )
    add_state_dir(down, secrets=False)  # it stops what uses them
    down.set_defaults(func=statedir.down)
