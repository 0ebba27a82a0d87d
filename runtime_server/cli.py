"""The ``fnkernel`` console script (SPEC §7). Exit codes: 0 ok, 1 failure, 2 usage error."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _serve(args: argparse.Namespace) -> int:
    from runtime_server import logs, process
    from runtime_server.launch import announcement
    from runtime_server.server import RuntimeServer

    logs.configure(logging.DEBUG if args.verbose else logging.INFO)
    workspace_root = Path(args.workspace_root).resolve()
    if not workspace_root.is_dir():
        print(
            f"fnkernel serve: --workspace-root {args.workspace_root} is not a directory",
            file=sys.stderr,
        )
        return EXIT_USAGE
    process.become_subreaper()
    stop_reaper = threading.Event()
    process.start_reaper(stop_reaper)
    server = RuntimeServer(args.runtime, workspace_root, oneshot_only=args.oneshot_only)
    try:
        address = server.start(args.listen)
    except RuntimeError as exc:
        print(f"fnkernel serve: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    services = "Runtime" if args.oneshot_only else "Runtime, FunctionRuntime"
    print(announcement(args.runtime, services, address, workspace_root), flush=True)
    process.wait_for_termination()
    logging.getLogger("fnkernel.runtime").info("draining for up to %ss", args.drain_timeout)
    server.stop(args.drain_timeout)
    stop_reaper.set()
    return EXIT_OK


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
    serve.add_argument("--drain-timeout", type=float, default=10.0, metavar="SECONDS")
    serve.add_argument("-v", "--verbose", action="store_true")
    serve.set_defaults(func=_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
