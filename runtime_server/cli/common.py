"""What every command group of the CLI shares: exit codes, the usage error, number and duration
types, the state dir, the evaluator chain flags (docs/protocol.md, "CLI")."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what read our output went away (`| head`)


class UsageError(Exception):
    pass


if TYPE_CHECKING:
    from fnkernel.runtime_server.client import Client


def state_dir_of(args: argparse.Namespace) -> Path:
    return Path(args.state_dir).expanduser().resolve()


def add_state_dir(parser: argparse.ArgumentParser, *, secrets: bool = True) -> None:
    """--state-dir, and --secrets-dir for a command that reads or keeps the named secrets."""
    from fnkernel.runtime_server.lifecycle.topology import default_state_dir

    parser.add_argument(
        "--state-dir",
        default=str(default_state_dir()),
        metavar="DIR",
        help="Run store, working dirs, sockets and logs (default: $FNKERNEL_STATE_DIR or %(default)s)",
    )
    if not secrets:
        return
    parser.add_argument(
        "--secrets-dir",
        metavar="DIR",
        help="the named secrets (default: STATE_DIR/secrets; docs/protocol.md, 'Secrets')",
    )


def count(text: str) -> int:
    """argparse type: a non-negative integer in ASCII digits (``int()`` would also take
    ``"1_000"`` and other scripts' digits)."""
    from fnkernel.runtime_server import limits
    from fnkernel.runtime_server.errors import InvalidField

    if not (text.isascii() and text.isdigit()):
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise argparse.ArgumentTypeError(f"must be a whole number in ASCII digits, got {shown!r}")
    try:
        return limits.parse_count(text, "value")
    except InvalidField as exc:
        raise argparse.ArgumentTypeError(exc.reason) from None


def positive(text: str) -> int:
    """argparse type: a ``count`` of at least 1 (where 0 would mean nothing to do)."""
    value = count(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def port(text: str) -> int:
    """argparse type: a TCP port, 0 (any free one) to 65535."""
    value = count(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 to 65535, got {value}")
    return value


def listen_address(text: str) -> str:
    """argparse type: where a server listens, ``host:port`` (a port of 0 to 65535, 0 for a
    free one; no host for every interface) or ``unix:PATH`` — refused before anything starts,
    a usage error, not a server that fails to bind or binds where no client can reach it."""
    from fnkernel.runtime_server import wire

    if text.startswith("unix:"):
        if not text[5:]:
            raise argparse.ArgumentTypeError("unix:PATH needs a path")
        problem = wire.unix_target_problem(text[5:])
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return text
    _, colon, port = text.rpartition(":")
    if not colon or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not host:port (a port of 0 to 65535) or unix:PATH"
        )
    return text


def byte_bound(text: str) -> int:
    """argparse type: a bound in bytes (``limits.parse_byte_bound``)."""
    from fnkernel.runtime_server import limits
    from fnkernel.runtime_server.errors import InvalidField

    try:
        return limits.parse_byte_bound(text, "value")
    except InvalidField as exc:
        raise argparse.ArgumentTypeError(exc.reason) from None


def results_dir(text: str) -> str:
    """argparse type: a directory results.yaml can be written in, made if it is missing —
    checked before any function runs, not once the pipeline has."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot make {text}: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write in {text}")
    return text


MAX_FLAG_SECONDS = 86_400.0


def seconds(text: str) -> float:
    """argparse type: a duration in seconds, a plain decimal number from 0 to a day (a wait of
    1e300 s, ``inf`` or ``nan`` would break the timers it sets)."""
    if not re.fullmatch(r"[0-9]{1,6}(\.[0-9]{1,6})?", text) or float(text) > MAX_FLAG_SECONDS:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds from 0 to {MAX_FLAG_SECONDS:.0f}, got {text[:40]!r}"
        )
    return float(text)


def interval(text: str) -> float:
    """argparse type: a cadence in ``seconds``, more than 0 (0 would poll in a busy loop)."""
    value = seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text!r}")
    return value


def print_json(value: object) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """`rows`, the first its header, in columns as wide as their widest cell (``runs list``,
    ``secrets list``)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


def add_bound_flags(parser: argparse.ArgumentParser) -> None:
    """Each function's time limit and memory bound (docs/krm.md, "Limits")."""
    from fnkernel.runtime_server.krm.functions import processes

    parser.add_argument(
        "--timeout",
        type=seconds,
        default=processes.DEFAULT_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help="stop a function that runs longer (default %(default)g)",
    )
    parser.add_argument(
        "--memory",
        type=count,
        default=processes.DEFAULT_MEMORY_MB,
        metavar="MIB",
        help="what each process a function runs in may take (default %(default)s)",
    )


def bounds_from_flags(args: argparse.Namespace) -> Any:
    """The ``krm.functions.processes.Bounds`` the flags name; UsageError naming the flag for one
    out of its range."""
    from fnkernel.runtime_server.errors import InvalidField
    from fnkernel.runtime_server.krm.functions.processes import Bounds, Mount

    mounts = []
    for spec in getattr(args, "mount", None) or ():
        try:
            mount = Mount.parse(spec)
        except ValueError as exc:
            raise UsageError(f"--mount: {exc}") from None
        if mount is not None:
            mounts.append(mount)
    try:
        return Bounds(timeout=args.timeout, memory_mb=args.memory, mounts=tuple(mounts))
    except InvalidField as exc:
        flag = {"timeout": "--timeout", "memory_mb": "--memory"}[exc.field]
        raise UsageError(f"{flag}: {exc.reason}") from None


def chain_from_flags(args: argparse.Namespace, command: str) -> Any:
    """The evaluator chain the flags name (runtime_server.krm.chain); UsageError if they
    cannot be used."""
    from fnkernel.runtime_server.krm.chain import Chain

    try:
        return Chain().configure(
            functions=args.functions,
            function_config=args.function_config,
            image_catalog=args.image_catalog,
            pod_cache_config=args.pod_cache_config,
        )
    except (OSError, ValueError) as exc:
        raise UsageError(f"{command}: {exc}") from None


def add_chain_flags(parser: argparse.ArgumentParser) -> None:
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


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway",
        default=None,
        metavar="URL",
        help="gateway address, http://HOST:PORT, https://HOST[:PORT] or unix:PATH "
        "(default: $FNKERNEL_RUNTIME or http://127.0.0.1:8080)",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="the gateway's bearer token (default: $FNKERNEL_TOKEN, or the running gateway's own "
        "on this machine)",
    )


def client_of(args: argparse.Namespace) -> Client:
    """The gateway client the flags of add_client_flags name."""
    from fnkernel.runtime_server import tokens
    from fnkernel.runtime_server.client import Client
    from fnkernel.runtime_server.client.transport import check_address, default_address

    try:
        token = tokens.read_token_file(Path(args.token_file)) if args.token_file else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        check_address(args.gateway or default_address())
    except ValueError as exc:  # named by where it came from: the flag, else the variable
        raise UsageError(f"{'--gateway' if args.gateway else '$FNKERNEL_RUNTIME'}: {exc}") from None
    try:
        return Client(args.gateway, token=token)
    except ValueError as exc:  # $FNKERNEL_TOKEN's, which the message names
        raise UsageError(str(exc)) from None


def add_max_payload(parser: argparse.ArgumentParser) -> None:
    """``--max-payload-bytes``: the bound of one payload or result past one message."""
    from fnkernel.runtime_server import limits

    parser.add_argument(
        "--max-payload-bytes",
        type=byte_bound,
        default=limits.DEFAULT_MAX_SPOOLED_BYTES,
        metavar="N",
        help="the largest payload or result (default %(default)s, 2 GiB; docs/protocol.md, "
        "'Large payloads')",
    )
