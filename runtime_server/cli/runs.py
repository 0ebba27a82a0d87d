"""The gateway's client commands: ``runs create|list|get|delete``, ``invoke`` and ``logs``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import stat
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from fnkernel.adapters import runtimes
from fnkernel.runtime_server import limits
from fnkernel.runtime_server.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    UsageError,
    add_client_flags,
    client_of,
    count,
    positive,
    print_json,
    print_table,
)


def _parse_env(pairs: Sequence[str]) -> dict[str, str]:
    from fnkernel.runtime_server.client import parse_pairs

    try:
        return parse_pairs(pairs)
    except ValueError as exc:
        raise UsageError(f"--env {exc}") from None


def requirements_of(args: argparse.Namespace) -> list[str]:
    """--requirements, then what --requirements-file lists (docs/protocol.md, "Requirements")."""
    requirements = list(args.requirements)
    if args.requirements_file:
        try:
            text = Path(args.requirements_file).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(
                f"--requirements-file: cannot read {args.requirements_file}: {exc}"
            ) from None
        requirements += limits.requirements_in(text)
    return requirements


def _runs_create(args: argparse.Namespace) -> int:
    run = client_of(args).create_run(
        args.name,
        runtime=args.runtime,
        handler=args.handler,
        source=Path(args.source),
        env=_parse_env(args.env),
        idle_timeout_seconds=args.idle_timeout,
        memory_mb=args.memory,
        replicas=args.replicas,
        requirements=requirements_of(args),
        secrets=args.secret,
    )
    print_json(run)
    if run.failed:  # why, where a script's log shows it, not only in the JSON
        print(f"fnkernel: run {run.name} failed: {run.message}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def _runs_list(args: argparse.Namespace) -> int:
    runs = client_of(args).list_runs()
    rows = [("NAME", "RUNTIME", "PHASE", "ATTEMPT", "POD", "OWNER", "MESSAGE")]
    for run in runs:
        rows.append((
            run.name, run.runtime, run.phase, str(run.attempt), run.assigned_pod,
            run.owner or "-", run.message if len(run.message) <= 60 else run.message[:59] + "…",
        ))  # fmt: skip
    print_table(rows)
    return EXIT_OK


def _runs_get(args: argparse.Namespace) -> int:
    print_json(client_of(args).status(args.name))
    return EXIT_OK


def _runs_delete(args: argparse.Namespace) -> int:
    if client_of(args).delete_run(args.name):
        print(f"deleted {args.name}")
    else:
        print(
            f"deleted {args.name}; its Runtime Server still held it (it did not answer, or "
            "the registration was still loading): its runtimed unregisters it once it lets go"
        )
    return EXIT_OK


def _map(args: argparse.Namespace) -> int:
    """``invoke NAME --map FILE.jsonl``: one call per line (a JSON payload each), the results
    as JSON lines in the same order on stdout, each as soon as those before it are; progress
    on stderr."""
    from fnkernel.runtime_server import payloads
    from fnkernel.runtime_server.client.errors import GatewayError

    try:
        data = sys.stdin.buffer.read() if args.map == "-" else Path(args.map).read_bytes()
    except OSError as exc:
        raise UsageError(f"--map {args.map}: cannot read it: {exc.strerror}") from None
    items = []
    lines = data.splitlines()
    while lines and not lines[-1].strip():  # blank lines at the end are no calls
        lines.pop()
    for number, line in enumerate(lines, 1):
        if not line.strip():  # a result line for each input line: none may be skipped
            raise UsageError(
                f"--map {args.map}: line {number} is empty; each line is one call's JSON "
                "payload, and its result the same line of the output"
            )
        try:
            items.append(json.loads(line))
        except ValueError as exc:  # UnicodeDecodeError too: bytes that are not text
            raise UsageError(f"--map {args.map}: line {number} is not JSON: {exc}") from None
    shown = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - shown[0] >= 1.0:  # a few lines, not one per item
            shown[0] = now
            print(f"{done}/{total} done", file=sys.stderr, flush=True)

    def on_log(index: int, line: dict[str, Any]) -> None:
        print(f"[{index}] {line.get('text', '')}", file=sys.stderr, flush=True)

    failed = 0

    def on_result(index: int, result: Any) -> None:
        """Item `index`'s line, written as soon as the lines before it are: a reader that
        stops reading (``| head``) stops the map."""
        nonlocal failed
        if isinstance(result, GatewayError):
            failed += 1
            result = {"error": {"code": result.code, "message": str(result)}}
        line, media = payloads.encode(result, "result")  # compact, as invoke prints a result
        if media != payloads.JSON:  # a line of JSON per item: say what came instead
            failed += 1
            message = f"the result is {media}: invoke it alone, with --output FILE"
            line, _ = payloads.encode({"error": {"code": "NOT_JSON", "message": message}})
        sys.stdout.buffer.write(line + b"\n")
        sys.stdout.flush()

    client_of(args).map(
        args.name, items, concurrency=args.concurrency, return_exceptions=True,
        timeout_millis=args.timeout_ms, progress=progress, on_result=on_result,
        on_log=on_log if args.follow else None,
    )  # fmt: skip
    if failed:
        print(f"{failed} of {len(items)} calls failed", file=sys.stderr)
    return EXIT_FAILURE if failed else EXIT_OK


# The defaults of invoke's flags for one call: with --map, one given is a usage error, not
# ignored.
_SINGLE_CALL_FLAGS = {"payload": None, "content_type": None, "output": None, "invocation_id": ""}


def _invoke(args: argparse.Namespace) -> int:
    if args.map is not None:
        given = [
            name for name, default in _SINGLE_CALL_FLAGS.items() if getattr(args, name) != default
        ]
        if given:
            flag = given[0] if given[0] == "payload" else f"--{given[0].replace('_', '-')}"
            raise UsageError(
                f"--map takes each call's JSON payload from its lines, and writes the results "
                f"as lines on stdout: {flag} is for one call"
            )
        return _map(args)
    if args.concurrency is not None:
        raise UsageError("--concurrency is for --map: one call is one call")
    from fnkernel.runtime_server import payloads
    from fnkernel.runtime_server.client.errors import InvocationTimedOut

    payload = "{}" if args.payload is None else args.payload  # none given: an empty object
    media = payloads.media_type(args.content_type or payloads.JSON)
    if media not in payloads.MEDIA_TYPES:
        raise UsageError(f"--content-type: one of {', '.join(payloads.MEDIA_TYPES)}")
    data: bytes | BinaryIO
    if media != payloads.JSON:
        if payload != "-":
            raise UsageError(f"--content-type {media}: give the payload on stdin (-)")
        data = sys.stdin.buffer  # read as it is sent: into the spool, on the stack's machine
    else:
        data = sys.stdin.buffer.read() if payload == "-" else payload.encode()
        try:
            json.loads(data)
        except ValueError as exc:
            hint = ""
            if isinstance(exc, UnicodeDecodeError):  # an Arrow stream, say
                hint = (
                    f"; bytes of another type: --content-type {payloads.ARROW} or {payloads.OCTET}"
                )
            raise UsageError(f"payload is not JSON: {exc}{hint}") from None
    if args.output == "-":  # as a payload's "-" is stdin
        args.output = None
    if args.output and not Path(args.output).absolute().parent.is_dir():  # before the call runs
        raise UsageError(f"--output {args.output}: no such directory")
    if args.output and Path(args.output).is_dir():
        raise UsageError(f"--output {args.output}: a directory; name the file to write")
    try:
        with _result_sink(args.output) as sink:
            result = client_of(args).invoke(
                args.name,
                data=data,
                content_type=media,
                timeout_millis=args.timeout_ms,
                invocation_id=args.invocation_id,
                on_log=_log_line if args.follow else None,
                write_to=sink,  # the answer's bytes as they came, not held (None: a terminal)
            )
            returned = payloads.media_type(result.content_type)
            if sink is None:  # a terminal: only text is written there
                if returned != payloads.JSON:
                    raise UsageError(
                        "the result is binary: write it to a file (--output FILE, or > FILE)"
                    )
                ended = result.output.endswith(b"\n")
                sys.stdout.buffer.write(result.output if ended else result.output + b"\n")
            elif returned == payloads.JSON and sink.last != b"\n":
                sink.write(b"\n")
    except InvocationTimedOut as exc:  # and how to give it more, as the kernel says
        raise InvocationTimedOut(
            f"{exc.message}; give it more with --timeout-ms MS", code=exc.code,
            status=exc.status, run_uid=exc.run_uid, invocation_id=exc.invocation_id,
            detail=exc.detail,
        ) from None  # fmt: skip
    except _NotWritten as exc:
        where = f"--output {args.output}" if args.output else "stdout"
        if not exc.ran:  # opening it, before the call
            raise UsageError(f"{where}: cannot be written, so nothing was called: {exc}") from None
        raise UsageError(f"{where}: the result ran but cannot be written: {exc}") from None
    sys.stdout.flush()
    if returned != payloads.JSON:
        print(f"content type: {returned} ({result.written} bytes)", file=sys.stderr)
    if result.outputs:
        print(f"outputs: {json.dumps(result.outputs, sort_keys=True)}", file=sys.stderr)
    if result.cold_start:
        print("(cold start: the function was registered again after idling)", file=sys.stderr)
    return EXIT_OK


class _NotWritten(Exception):
    """The result's destination refused it (its OSError's text): before the call (opening it:
    not `ran`), or as the result was written."""

    def __init__(self, error: OSError, *, ran: bool) -> None:
        super().__init__(error)
        self.ran = ran


class _Sink:
    """Where ``invoke`` writes a result's bytes as they come (``Client.invoke``'s `write_to`):
    the last byte written remembered (a JSON result is ended with a newline), a write that
    fails told apart from the call's own failures."""

    def __init__(self, out: BinaryIO) -> None:
        self.out, self.last = out, b""

    def write(self, data: bytes) -> int:
        try:
            self.out.write(data)
        except BrokenPipeError:
            raise  # what read it stopped (`| head`): the command ends quietly, as a pipe's do
        except OSError as exc:
            raise _NotWritten(exc, ran=True) from exc
        if data:
            self.last = data[-1:]
        return len(data)


@contextlib.contextmanager
def _result_sink(output: str | None) -> Iterator[_Sink | None]:
    """Where the result goes: stdout, written as it comes, or None for a terminal (the result
    held, to refuse one that is binary); with `output`, that file, whole or not at all: staged
    beside it under a name of its own and renamed over it once written, a file it replaces
    keeping its mode, a symbolic link the file it links to. What is not a file — a FIFO, a
    device such as /dev/stdout — is written to as it is, never replaced."""
    if not output:
        yield None if sys.stdout.isatty() else _Sink(sys.stdout.buffer)
        return
    target = Path(output).resolve()
    try:
        mode: int | None = target.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:  # not ours to look at, say
        raise _NotWritten(exc, ran=False) from exc
    if mode is not None and not stat.S_ISREG(mode):
        with _opened(lambda: open(target, "wb")) as out:
            yield _Sink(out)
        return
    staged = target.with_name(f".{target.name}.{secrets.token_hex(6)}.part")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        # The umask's mode, as a new file's.
        with _opened(lambda: open(os.open(staged, flags, 0o666), "wb")) as out:
            yield _Sink(out)
        with _written():
            if mode is not None:
                os.chmod(staged, stat.S_IMODE(mode))
            os.replace(staged, target)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _opened(opening: Callable[[], BinaryIO]) -> Iterator[BinaryIO]:
    """The file `opening()` opens (before the call), closed after the block: its OSErrors (not
    the block's) are _NotWritten."""
    with _written(ran=False):
        out = opening()
    try:
        yield out
    finally:
        with _written():
            out.close()


@contextlib.contextmanager
def _written(*, ran: bool = True) -> Iterator[None]:
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise _NotWritten(exc, ran=ran) from exc


def _log_line(line: dict[str, Any]) -> None:
    """A handler's line as the call runs (``--follow``): on stderr, so stdout stays the output."""
    print(line.get("text", ""), file=sys.stderr, flush=True)


def _logs(args: argparse.Namespace) -> int:
    """``logs NAME``: the log of NAME's call in flight, else of its last one (docs/protocol.md,
    "Live output"); with ``--follow``, each line as it is written until the call ends."""
    records = client_of(args).follow_logs(args.name, args.invocation_id, follow=args.follow)
    for record in records:
        if "invocationId" in record:
            state = "running" if record.get("running") else "over"
            print(f"invocation {record['invocationId']} of {record['run']} ({state})",
                  file=sys.stderr, flush=True)  # fmt: skip
        elif "stream" in record:
            print(record.get("text", ""), flush=True)
        elif "error" in record:
            print(f"the stream broke off: {record['error'].get('message', '')}", file=sys.stderr)
            return EXIT_FAILURE
    return EXIT_OK


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
    create.add_argument(
        "--idle-timeout",
        type=count,
        default=0,
        metavar="SECONDS",
        help="idle this long, it is unregistered until its next call (0: 900; at most 86400)",
    )
    create.add_argument(
        "--memory",
        type=count,
        default=0,
        metavar="MIB",
        help="what each of the handler's processes may take (default 1024)",
    )
    create.add_argument(
        "--replicas",
        type=count,
        default=1,
        metavar="N",
        help="N Runs serve the function, a call going to a free one (default 1)",
    )
    create.add_argument(
        "--requirements",
        nargs="+",
        default=[],
        metavar="REQ",
        help="Python packages the handler imports (PEP 508: 'pandas>=2.2'), installed for it",
    )
    create.add_argument(
        "--requirements-file", metavar="PATH", help="a requirements.txt of more of them"
    )
    create.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME",
        help="a secret of the stack whose keys the handler sees as environment variables",
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
        add_client_flags(sub)

    invoke = commands.add_parser("invoke", help="invoke a function: JSON payload, or - for stdin")
    invoke.add_argument("name")
    invoke.add_argument(
        "payload",
        nargs="?",
        default=_SINGLE_CALL_FLAGS["payload"],
        metavar="JSON|-",
        help="the payload, as JSON text, or - to read it from stdin (none given: {})",
    )
    invoke.add_argument(
        "--content-type",
        default=_SINGLE_CALL_FLAGS["content_type"],
        metavar="TYPE",
        help="the payload's: application/json (by default), application/vnd.apache.arrow.stream "
        "or application/octet-stream, read from stdin (docs/protocol.md, 'Content types')",
    )
    invoke.add_argument(
        "--output",
        metavar="FILE",
        help="write the result there, - for stdout (a binary one cannot go to a terminal)",
    )
    invoke.add_argument("--timeout-ms", type=count, default=0, metavar="MS")
    invoke.add_argument(
        "--invocation-id", default=_SINGLE_CALL_FLAGS["invocation_id"], metavar="ID"
    )
    invoke.add_argument(
        "--map",
        metavar="FILE.jsonl",
        help="one call per line of FILE (- for stdin), the results as lines in the same order",
    )
    invoke.add_argument(
        "--concurrency",
        type=positive,
        default=None,
        metavar="N",
        help="with --map: calls in flight at once (default: the function's replicas)",
    )
    invoke.add_argument(
        "--follow",
        action="store_true",
        help="print the handler's log lines on stderr as it writes them ([ITEM] first with --map)",
    )
    add_client_flags(invoke)
    invoke.set_defaults(func=_invoke)

    logs = commands.add_parser(
        "logs", help="the log of a function's call in flight, else of its last call"
    )
    logs.add_argument("name", help="the function, or one replica of it (NAME.1)")
    logs.add_argument("--invocation-id", default="", metavar="ID", help="that call's log")
    logs.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="print each line as it is written, until the call ends",
    )
    add_client_flags(logs)
    logs.set_defaults(func=_logs)
