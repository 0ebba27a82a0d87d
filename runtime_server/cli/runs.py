"""The gateway's client commands: ``runs create|list|get|delete`` and ``invoke``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fnkernel.adapters import runtimes
from fnkernel.runtime_server.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    UsageError,
    count,
    print_json,
)

if TYPE_CHECKING:
    from fnkernel.runtime_server.client import Client


def _client(args: argparse.Namespace) -> Client:
    from fnkernel.runtime_server import tokens
    from fnkernel.runtime_server.client import Client

    token = tokens.read_token_file(Path(args.token_file)) if args.token_file else None
    return Client(args.gateway, token=token)


def _parse_env(pairs: Sequence[str]) -> dict[str, str]:
    from fnkernel.runtime_server.client import parse_pairs

    try:
        return parse_pairs(pairs)
    except ValueError as exc:
        raise UsageError(f"--env {exc}") from None


def _runs_create(args: argparse.Namespace) -> int:
    run = _client(args).create_run(
        args.name,
        runtime=args.runtime,
        handler=args.handler,
        source=Path(args.source),
        env=_parse_env(args.env),
        idle_timeout_seconds=args.idle_timeout,
        memory_mb=args.memory,
    )
    print_json(run)
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
    print_json(_client(args).status(args.name))
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


def register(commands: Any) -> None:
    """Add the subcommands of this group to `commands` (argparse subparsers)."""
    runs = commands.add_parser("runs", help="create, list, get and delete Runs")
    runs_commands = runs.add_subparsers(dest="runs_command", metavar="ACTION", required=True)
    create = runs_commands.add_parser("create", help="create a function Run from a file or dir")
    create.add_argument("name")
    create.add_argument("--runtime", choices=runtimes.RUNTIMES, required=True)
    create.add_argument("--source", required=True, metavar="PATH", help="a file or a directory")
    create.add_argument(
        "--handler", required=True, metavar="H", help="module.function or file.function"
    )
    create.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    create.add_argument("--idle-timeout", type=count, default=0, metavar="SECONDS")
    create.add_argument(
        "--memory",
        type=count,
        default=0,
        metavar="MIB",
        help="what each of the handler's processes may take (default 1024)",
    )
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
    invoke.add_argument("--timeout-ms", type=count, default=0, metavar="MS")
    invoke.add_argument("--invocation-id", default="", metavar="ID")
    _add_client_flags(invoke)
    invoke.set_defaults(func=_invoke)
