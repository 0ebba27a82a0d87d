"""The ``fnkernel`` console script (docs/protocol.md, "CLI"). Exit codes: 0 ok, 1 failure, 2 usage error."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime_server.client import Client
    from runtime_server.tokens import GatewayToken

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _serve(args: argparse.Namespace) -> int:
    from runtime_server import daemon, logs
    from runtime_server.daemon import announcement
    from runtime_server.function_runtime.server import RuntimeServer

    logs.configure(logging.DEBUG if args.verbose else logging.INFO)
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
    server = RuntimeServer(args.runtime, workspace_root, oneshot_only=args.oneshot_only)
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
    return EXIT_OK


def _state_dir(args: argparse.Namespace) -> Path:
    return Path(args.state_dir).expanduser().resolve()


def _runtimed(args: argparse.Namespace) -> int:
    from runtime_server import daemon, logs
    from runtime_server.daemon import announcement
    from runtime_server.lifecycle.runs import RunStore
    from runtime_server.lifecycle.runtimed import Runtimed

    logs.configure(logging.DEBUG if args.verbose else logging.INFO)
    state_dir = _state_dir(args)
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    runtimed = Runtimed(
        RunStore(state_dir / "runs.db"),
        pod=args.pod,
        runtime=args.runtime,
        server_address=args.server,
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
    runtimed.stop()
    return EXIT_OK


def _gateway_token(args: argparse.Namespace, command: str, listen: str) -> GatewayToken:
    """The token a gateway on `listen` requires (README, "Security"); a generated one is
    printed once, and --no-token warns."""
    from runtime_server import tokens

    try:
        chosen = tokens.gateway_token(
            listen,
            _state_dir(args),
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
            f"fnkernel {command}: token {chosen.token} (saved in {chosen.path}; "
            "fnkernel clients on this machine find it)",
            file=sys.stderr,
            flush=True,
        )
    return chosen


def _gateway(args: argparse.Namespace) -> int:
    import asyncio

    from runtime_server import logs, tokens
    from runtime_server.daemon import announcement
    from runtime_server.lifecycle.controlplane import ControlPlane
    from runtime_server.lifecycle.gateway import Access, Gateway
    from runtime_server.lifecycle.runs import RunStore

    logs.configure(logging.DEBUG if args.verbose else logging.INFO)
    state_dir = _state_dir(args)
    token = _gateway_token(args, "gateway", args.listen).token
    access = Access(
        token, frozenset(args.allow_origin), frozenset(h.lower() for h in args.allow_host)
    )
    workspace_root = state_dir / "workspace"
    workspace_root.mkdir(mode=0o700, parents=True, exist_ok=True)
    control_plane = ControlPlane(RunStore(state_dir / "runs.db"), workspace_root)

    async def serve() -> None:
        gateway = Gateway(control_plane, access, body_timeout=args.body_timeout)
        try:
            address = gateway.listen(args.listen)
        except OSError as exc:
            print(f"fnkernel gateway: cannot listen on {args.listen}: {exc}", file=sys.stderr)
            raise SystemExit(EXIT_FAILURE) from None
        gateway_file = tokens.announce(address, token) if token is not None else None
        control_plane.start()
        print(
            announcement("gateway", "control plane + HTTP", address, f"state dir {state_dir}"),
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            if gateway_file is not None:
                tokens.withdraw(gateway_file)
        await gateway.close()
        control_plane.stop()

    asyncio.run(serve())
    return EXIT_OK


def _up(args: argparse.Namespace) -> int:
    from runtime_server import daemon, logs
    from runtime_server.lifecycle.stack import Stack, parse_pods

    logs.configure(logging.INFO)
    try:
        pods = parse_pods(args.pods)
    except ValueError as exc:
        print(f"fnkernel up: {exc}", file=sys.stderr)
        return EXIT_USAGE
    chosen = _gateway_token(args, "up", args.gateway_listen)
    stack = Stack(
        _state_dir(args),
        pods,
        gateway_listen=args.gateway_listen,
        token_file=chosen.path,
        no_token=chosen.token is None,
        allow_origins=args.allow_origin,
        allow_hosts=args.allow_host,
        poll_interval=args.poll_interval,
    )
    try:
        stack.start()
    except RuntimeError as exc:
        print(f"fnkernel up: {exc} (logs in {stack.state_dir / 'logs'})", file=sys.stderr)
        return EXIT_FAILURE
    print(f"fnkernel up: state dir {stack.state_dir}")
    for line in stack.describe():
        print(f"  {line}")
    print(
        f"fnkernel up: ready; gateway {stack.gateway_address}; Ctrl-C stops everything", flush=True
    )
    daemon.wait_for_termination()
    stack.stop()
    return EXIT_OK


def _client(args: argparse.Namespace) -> Client:
    from runtime_server import tokens
    from runtime_server.client import Client

    token = tokens.read_token_file(Path(args.token_file)) if args.token_file else None
    return Client(args.gateway, token=token)


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def _parse_env(pairs: Sequence[str]) -> dict[str, str]:
    from runtime_server.client import parse_pairs

    try:
        return parse_pairs(pairs)
    except ValueError as exc:
        raise UsageError(f"--env {exc}") from None


class UsageError(Exception):
    pass


def _runs_create(args: argparse.Namespace) -> int:
    run = _client(args).create_run(
        args.name,
        runtime=args.runtime,
        handler=args.handler,
        source=Path(args.source),
        env=_parse_env(args.env),
        idle_timeout_seconds=args.idle_timeout,
    )
    _print_json(run)
    return EXIT_FAILURE if run.failed else EXIT_OK


def _runs_list(args: argparse.Namespace) -> int:
    runs = _client(args).list_runs()
    rows = [("NAME", "RUNTIME", "PHASE", "ATTEMPT", "POD", "MESSAGE")]
    for run in runs:
        rows.append(
            (run.name, run.runtime, run.phase, str(run.attempt), run.assigned_pod, run.message[:60])
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    return EXIT_OK


def _runs_get(args: argparse.Namespace) -> int:
    _print_json(_client(args).status(args.name))
    return EXIT_OK


def _runs_delete(args: argparse.Namespace) -> int:
    _client(args).delete_run(args.name)
    print(f"deleted {args.name}")
    return EXIT_OK


def _invoke(args: argparse.Namespace) -> int:
    data = sys.stdin.buffer.read() if args.payload == "-" else args.payload.encode()
    try:
        json.loads(data)
    except ValueError as exc:
        raise UsageError(f"payload is not JSON: {exc}") from None
    result = _client(args).invoke(
        args.name, data=data, timeout_millis=args.timeout_ms, invocation_id=args.invocation_id
    )
    sys.stdout.buffer.write(result.output)
    if not result.output.endswith(b"\n"):
        sys.stdout.buffer.write(b"\n")
    sys.stdout.flush()
    if result.outputs:
        print(f"outputs: {json.dumps(result.outputs, sort_keys=True)}", file=sys.stderr)
    if result.cold_start:
        print("(cold start: the function was registered again after idling)", file=sys.stderr)
    return EXIT_OK


def _add_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway",
        default=None,
        metavar="URL",
        help="gateway address, http://HOST:PORT or unix:PATH "
        "(default: $FNKERNEL_RUNTIME or http://127.0.0.1:8080)",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="the gateway's bearer token (default: $FNKERNEL_TOKEN, or the running gateway's own "
        "on this machine)",
    )


def _add_access_flags(parser: argparse.ArgumentParser) -> None:
    """Who may call the gateway (README, "Security")."""
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="require the bearer token in FILE (default on TCP: a new one, saved in "
        "STATE_DIR/token and printed once)",
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


def _add_state_dir(parser: argparse.ArgumentParser) -> None:
    default = os.environ.get("FNKERNEL_STATE_DIR") or str(
        Path(os.environ.get("XDG_STATE_HOME") or "~/.local/state").expanduser() / "fnkernel"
    )
    parser.add_argument(
        "--state-dir",
        default=default,
        metavar="DIR",
        help="Run store, working dirs, sockets and logs (default: $FNKERNEL_STATE_DIR or %(default)s)",
    )


def _count(text: str) -> int:
    """argparse type: a non-negative integer in ASCII digits (``int()`` would also take
    ``"1_000"`` and other scripts' digits)."""
    from runtime_server import limits
    from runtime_server.errors import InvalidField

    try:
        return limits.parse_count(text, "value")
    except InvalidField as exc:
        raise argparse.ArgumentTypeError(exc.reason) from None


MAX_FLAG_SECONDS = 86_400.0


def _seconds(text: str) -> float:
    """argparse type: a duration in seconds, a plain decimal number from 0 to a day (a wait of
    1e300 s, ``inf`` or ``nan`` would break the timers it sets)."""
    if not re.fullmatch(r"[0-9]{1,6}(\.[0-9]{1,6})?", text) or float(text) > MAX_FLAG_SECONDS:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds from 0 to {MAX_FLAG_SECONDS:.0f}, got {text[:40]!r}"
        )
    return float(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fnkernel",
        description="Registered server-side functions as callable notebook cells.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = commands.add_parser(
        "serve",
        help="run a Runtime Server (executor.v1 Runtime + FunctionRuntime)",
        description="Run a Runtime Server for one built-in runtime. SIGTERM drains in-flight "
        "invocations (bounded by --drain-timeout) and exits 0.",
    )
    serve.add_argument("--runtime", choices=("python", "bash"), required=True)
    serve.add_argument(
        "--listen",
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
    serve.add_argument("--drain-timeout", type=_seconds, default=10.0, metavar="SECONDS")
    serve.add_argument("-v", "--verbose", action="store_true")
    serve.set_defaults(func=_serve)

    runtimed = commands.add_parser(
        "runtimed",
        help="run the runtimed agent of one Runtime Pod",
        description="Registers the Runs assigned to this pod with its Runtime Server, polls their "
        "status, scales idle ones to zero, and serves the proxy hop on its own port.",
    )
    runtimed.add_argument("--pod", required=True, metavar="NAME")
    runtimed.add_argument("--runtime", choices=("python", "bash"), required=True)
    runtimed.add_argument(
        "--server", required=True, metavar="ADDR", help="the colocated Runtime Server"
    )
    runtimed.add_argument("--listen", default="127.0.0.1:0", metavar="ADDR")
    runtimed.add_argument(
        "--poll-interval",
        type=_seconds,
        default=1.0,
        metavar="SECONDS",
        help="FunctionStatus cadence (default %(default)s)",
    )
    _add_state_dir(runtimed)
    runtimed.add_argument("-v", "--verbose", action="store_true")
    runtimed.set_defaults(func=_runtimed)

    gateway = commands.add_parser(
        "gateway",
        help="run the HTTP gateway and the control plane",
        description="HTTP/JSON in front of runtimed, with the control plane (Run store, "
        "scheduler, retry engine) in the same process.",
    )
    gateway.add_argument("--listen", default="127.0.0.1:8080", metavar="ADDR")
    gateway.add_argument(
        "--body-timeout",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="close a connection whose request body has not arrived whole by then "
        "(default %(default)s)",
    )
    _add_access_flags(gateway)
    _add_state_dir(gateway)
    gateway.add_argument("-v", "--verbose", action="store_true")
    gateway.set_defaults(func=_gateway)

    up = commands.add_parser(
        "up",
        help="run the whole local stack: control plane, pods and gateway",
        description="Start the control plane, the Runtime Pods (each a Runtime Server and a "
        "runtimed) and the gateway; print their addresses; Ctrl-C or SIGTERM stops them all.",
    )
    up.add_argument("--pods", default="python=1,bash=1", metavar="RUNTIME=N,...")
    up.add_argument("--gateway-listen", default="127.0.0.1:8080", metavar="ADDR")
    _add_access_flags(up)
    up.add_argument("--poll-interval", type=_seconds, default=1.0, metavar="SECONDS")
    _add_state_dir(up)
    up.set_defaults(func=_up)

    runs = commands.add_parser("runs", help="create, list, get and delete Runs")
    runs_commands = runs.add_subparsers(dest="runs_command", metavar="ACTION", required=True)
    create = runs_commands.add_parser("create", help="create a function Run from a file or dir")
    create.add_argument("name")
    create.add_argument("--runtime", choices=("python", "bash"), required=True)
    create.add_argument("--source", required=True, metavar="PATH", help="a file or a directory")
    create.add_argument(
        "--handler", required=True, metavar="H", help="module.function or file.function"
    )
    create.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    create.add_argument("--idle-timeout", type=_count, default=0, metavar="SECONDS")
    create.set_defaults(func=_runs_create)
    listing = runs_commands.add_parser("list", help="list Runs")
    listing.set_defaults(func=_runs_list)
    get = runs_commands.add_parser("get", help="a Run and its live status")
    get.add_argument("name")
    get.set_defaults(func=_runs_get)
    delete = runs_commands.add_parser("delete", help="unregister a Run and remove it")
    delete.add_argument("name")
    delete.set_defaults(func=_runs_delete)
    for sub in (create, listing, get, delete):
        _add_client_flags(sub)

    invoke = commands.add_parser("invoke", help="invoke a function: JSON payload, or - for stdin")
    invoke.add_argument("name")
    invoke.add_argument("payload", nargs="?", default="{}", metavar="JSON|-")
    invoke.add_argument("--timeout-ms", type=_count, default=0, metavar="MS")
    invoke.add_argument("--invocation-id", default="", metavar="ID")
    _add_client_flags(invoke)
    invoke.set_defaults(func=_invoke)

    evaluator = commands.add_parser(
        "evaluator",
        help="serve the evaluator chain over FunctionEvaluator (KRM functions)",
        description="Serve evaluator.FunctionEvaluator over the chain builtin → exec → pod: only "
        "NotFound falls through to the next evaluator.",
    )
    evaluator.add_argument("--listen", default="127.0.0.1:9445", metavar="ADDR")
    _add_chain_flags(evaluator)
    evaluator.add_argument("-v", "--verbose", action="store_true")
    evaluator.set_defaults(func=_evaluator)

    wrapper = commands.add_parser(
        "wrapper-server",
        help="serve one KRM function entrypoint over FunctionEvaluator (a function pod)",
        description="Run ENTRYPOINT once per EvaluateFunction request with the ResourceList on "
        "stdin. Usage: fnkernel wrapper-server --port 9446 -- ENTRYPOINT...",
    )
    wrapper.add_argument(
        "--port", type=_count, default=9446, help="loopback port (0: any free one)"
    )
    wrapper.add_argument(
        "--listen", metavar="ADDR", help="host:port or unix:PATH instead of --port"
    )
    wrapper.add_argument(
        "--max-request-body-size",
        type=_count,
        default=6 * 1024 * 1024,
        metavar="BYTES",
        help="largest ResourceList accepted (default 6 MiB)",
    )
    wrapper.add_argument("entrypoint", nargs=argparse.REMAINDER, metavar="-- ENTRYPOINT...")
    wrapper.set_defaults(func=_wrapper_server)

    render = commands.add_parser(
        "render",
        help="render a kpt package: run its Kptfile pipeline in place",
        description="kpt fn render semantics: subpackages first, mutators then validators; any "
        "failure leaves every file untouched. One progress line per step on stderr.",
    )
    render.add_argument("dir", metavar="DIR")
    render.add_argument("--allow-exec", action="store_true", help="allow `exec` pipeline steps")
    render.add_argument("--dry-run", action="store_true", help="run, but write no file")
    render.add_argument(
        "--results-dir", metavar="D", help="write results.yaml (FunctionResultList)"
    )
    render.add_argument("--output", choices=("text", "json"), default="text")
    _add_chain_flags(render)
    render.set_defaults(func=_render)

    evaluate = commands.add_parser(
        "eval",
        help="run one KRM function over the resources in a directory",
        description="kpt fn eval semantics: IMAGE over DIR's resources, configured by --fn-config "
        "or by key=value pairs after -- (a ConfigMap).",
    )
    evaluate.add_argument("image", metavar="IMAGE")
    evaluate.add_argument("dir", metavar="DIR")
    evaluate.add_argument("--fn-config", metavar="F", help="the function config (one KRM object)")
    evaluate.add_argument("--dry-run", action="store_true")
    evaluate.add_argument("--output", choices=("text", "json"), default="text")
    _add_chain_flags(evaluate)
    evaluate.add_argument("pairs", nargs=argparse.REMAINDER, metavar="-- key=value")
    evaluate.set_defaults(func=_eval)

    bench = commands.add_parser(
        "bench",
        help="run the benchmarks (each prints ratios against a floor measured in the same run)",
        description="Run benchmarks from the source checkout; exit 1 if any target is missed.",
    )
    bench.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(BENCHMARKS)}")
    bench.set_defaults(func=_bench)

    install = commands.add_parser(
        "install",
        help="install the fnkernel kernelspec",
        description="Install the 'fnkernel' kernelspec (display name 'Python 3 (fnkernel)') for "
        "this Python. Default: --sys-prefix inside a virtualenv, else --user.",
    )
    where = install.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="in the user's Jupyter data dir")
    where.add_argument("--sys-prefix", action="store_true", help=f"under {sys.prefix}")
    where.add_argument("--prefix", metavar="P", help="under P/share/jupyter/kernels")
    install.set_defaults(func=_install)
    return parser


def _chain(args: argparse.Namespace, command: str) -> Any:
    """The evaluator chain the flags name (runtime_server.krm.chain); UsageError if they
    cannot be used."""
    from runtime_server.krm.chain import Chain

    try:
        return Chain().configure(
            functions=args.functions,
            function_config=args.function_config,
            image_catalog=args.image_catalog,
            pod_cache_config=args.pod_cache_config,
        )
    except (OSError, ValueError) as exc:
        raise UsageError(f"{command}: {exc}") from None


def _add_chain_flags(parser: argparse.ArgumentParser) -> None:
    """The evaluators after builtin (docs/architecture.md, "The KRM chain")."""
    parser.add_argument(
        "--functions", metavar="DIR", help="cached function binaries (enables the exec evaluator)"
    )
    parser.add_argument(
        "--function-config",
        metavar="F",
        help="FunctionConfig store: YAML list of {image, tags, path} (path relative to --functions)",
    )
    parser.add_argument(
        "--image-catalog",
        metavar="F",
        help="local image catalog: YAML {image: [entrypoint argv]} (enables the pod evaluator)",
    )
    parser.add_argument(
        "--pod-cache-config",
        metavar="F",
        help="warm-up list: YAML [{image, timeToLive, maxParallelPods, preferredMaxQueueLength}]",
    )


def _evaluator(args: argparse.Namespace) -> int:
    from runtime_server import daemon, logs
    from runtime_server.daemon import announcement
    from runtime_server.krm.evaluators.server import serve

    logs.configure(logging.DEBUG if args.verbose else logging.INFO)
    chain = _chain(args, "evaluator")
    try:
        server, address = serve(chain.evaluator(), args.listen)
    except RuntimeError as exc:
        chain.close()
        print(f"fnkernel evaluator: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(announcement("evaluator", f"chain {chain.describe()}", address), flush=True)
    daemon.wait_for_termination()
    server.stop(5).wait()
    chain.close()
    return EXIT_OK


def _wrapper_server(args: argparse.Namespace) -> int:
    from runtime_server import daemon, logs
    from runtime_server.daemon import announcement
    from runtime_server.krm.evaluators.server import serve
    from runtime_server.krm.evaluators.wrapper import WrapperEvaluator

    logs.configure(logging.INFO)
    entrypoint = args.entrypoint[1:] if args.entrypoint[:1] == ["--"] else args.entrypoint
    if not entrypoint:
        print("fnkernel wrapper-server: give the function's entrypoint after --", file=sys.stderr)
        return EXIT_USAGE
    if args.max_request_body_size <= 0:
        print("fnkernel wrapper-server: --max-request-body-size must be positive", file=sys.stderr)
        return EXIT_USAGE
    listen = args.listen or f"127.0.0.1:{args.port}"
    try:
        server, address = serve(
            WrapperEvaluator(entrypoint), listen, max_bytes=args.max_request_body_size
        )
    except RuntimeError as exc:
        print(f"fnkernel wrapper-server: cannot listen on {listen}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(announcement("wrapper-server", " ".join(entrypoint), address), flush=True)
    daemon.wait_for_termination()
    server.stop(5).wait()
    return EXIT_OK


def _step_line(step: Any, number: int) -> str:
    mark = "ok" if step.ok else "FAILED"
    where = f"{step.package}: " if step.package else ""
    line = f"[{number}] {where}{step.stage} {step.function} ({step.evaluator or '-'}) "
    line += f"{step.duration * 1000:.0f} ms {mark}"
    counts: dict[str, int] = {}
    for result in step.results:
        severity = str(result.get("severity", "info"))
        counts[severity] = counts.get(severity, 0) + 1
    if counts:
        line += " · " + ", ".join(f"{n} {severity}" for severity, n in sorted(counts.items()))
    if step.error:
        line += f"\n    {step.error}"
    return line


def _report(outcome: Any, output: str) -> None:
    if output == "json":
        print(
            json.dumps(
                {
                    "steps": [
                        {
                            "package": s.package,
                            "stage": s.stage,
                            "function": s.function,
                            "evaluator": s.evaluator,
                            "durationMs": round(s.duration * 1000, 1),
                            "results": s.results,
                            "error": s.error,
                        }
                        for s in outcome.steps
                    ],
                    "written": outcome.written,
                    "removed": outcome.removed,
                },
                indent=2,
                default=str,
            )
        )
        return
    changed = outcome.written + [f"{path} (removed)" for path in outcome.removed]
    print(f"{len(outcome.steps)} step(s); files changed: {', '.join(changed) or 'none'}")


def _render(args: argparse.Namespace) -> int:
    from runtime_server.krm.pipeline import PipelineError, render
    from runtime_server.krm.resources.package import PackageError
    from runtime_server.krm.resources.resourcelist import InvalidResourceList

    counter = iter(range(1, 10_000))
    chain = _chain(args, "render")
    try:
        outcome = render(
            Path(args.dir),
            chain.evaluator(),
            allow_exec=args.allow_exec,
            dry_run=args.dry_run,
            results_dir=Path(args.results_dir) if args.results_dir else None,
            progress=lambda step: print(_step_line(step, next(counter)), file=sys.stderr),
            diffs=False,  # a progress line per step; the files themselves show the change
        )
    except (PipelineError, PackageError) as exc:
        print(f"fnkernel render: {exc}; no file was changed", file=sys.stderr)
        return EXIT_FAILURE
    except (FileNotFoundError, InvalidResourceList) as exc:
        print(f"fnkernel render: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        chain.close()
    _report(outcome, args.output)
    return EXIT_OK


def _eval(args: argparse.Namespace) -> int:
    from runtime_server.client import parse_pairs
    from runtime_server.krm.pipeline import PipelineError, evaluate_one
    from runtime_server.krm.resources.package import PackageError, read_documents
    from runtime_server.krm.resources.resourcelist import InvalidResourceList

    pairs = args.pairs[1:] if args.pairs[:1] == ["--"] else args.pairs
    try:
        data = parse_pairs(pairs)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    config = None
    chain = _chain(args, "eval")
    try:
        if args.fn_config:
            documents = read_documents(Path(args.fn_config).read_text(), args.fn_config)
            if len(documents) != 1:
                raise UsageError(f"--fn-config {args.fn_config} must hold exactly one object")
            config = documents[0]
        outcome = evaluate_one(
            Path(args.dir),
            args.image,
            chain.evaluator(),
            config=config,
            data=data,
            dry_run=args.dry_run,
            progress=lambda step: print(_step_line(step, 1), file=sys.stderr),
        )
    except (PipelineError, PackageError) as exc:
        print(f"fnkernel eval: {exc}; no file was changed", file=sys.stderr)
        return EXIT_FAILURE
    except (OSError, InvalidResourceList) as exc:
        print(f"fnkernel eval: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        chain.close()
    _report(outcome, args.output)
    return EXIT_OK


BENCHMARKS = ("invoke", "gateway", "kernel", "krm")


def _bench(args: argparse.Namespace) -> int:
    import subprocess

    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "__init__.py").is_file():
        print("fnkernel bench: the benchmarks ship with a source checkout", file=sys.stderr)
        return EXIT_USAGE
    names = args.names or list(BENCHMARKS)
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        print(
            f"fnkernel bench: unknown benchmark {', '.join(unknown)}; "
            f"choose from {', '.join(BENCHMARKS)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    status = EXIT_OK
    for name in names:
        print(f"== benchmarks.{name}", flush=True)
        done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}"], cwd=root)
        if done.returncode != 0:
            status = EXIT_FAILURE  # a target missed (or the benchmark failed)
    return status


def _install(args: argparse.Namespace) -> int:
    from kernel.install import install

    prefix = sys.prefix if args.sys_prefix else args.prefix
    if not (args.user or prefix):
        # A virtualenv's own share/jupyter is where its Jupyter looks first; else the user's.
        in_venv = sys.prefix != sys.base_prefix
        prefix, args.user = (sys.prefix, False) if in_venv else (None, True)
    path = install(user=args.user, prefix=prefix)
    print(f"installed kernelspec fnkernel (Python 3 (fnkernel)) in {path}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    from runtime_server.client.errors import GatewayError, InvalidRequest

    args = build_parser().parse_args(argv)
    from runtime_server import daemon

    daemon.watch_parent()  # started by launch.spawn(die_with_parent=True): stop with the parent
    try:
        return int(args.func(args))
    except UsageError as exc:
        print(f"fnkernel: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, ValueError) as exc:  # a source that cannot be read
        print(f"fnkernel: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except InvalidRequest as exc:
        print(f"fnkernel: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except GatewayError as exc:
        print(f"fnkernel: {type(exc).__name__}: {exc}", file=sys.stderr)
        for line in getattr(exc, "logs", []):
            print(f"  [{line.get('stream', '')}] {line.get('text', '')}", file=sys.stderr)
        return EXIT_FAILURE
