"""The fnkernel magics, exactly as docs/protocol.md, "Kernel" spells them.

``%%function NAME [--runtime python|bash] [--handler H] [--env KEY=VALUE]... [--idle-timeout S]
[--timeout S] [--memory MIB] [--replicas N]``, ``%invoke NAME [JSON]``, ``%functions [--all] [NAME...]``, ``%use NAME``, ``%fn_connect URL``, ``%fn_trace on|off|show [--all]|waterfall [INVOCATION]`` and
``%fn_debug``. Bad flags raise ``UsageError`` with a one-line message.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import functools
import inspect
import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from IPython.core.completer import (
    CompletionContext,
    SimpleCompletion,
    SimpleMatcherResult,
    context_matcher,
)
from IPython.core.error import UsageError
from IPython.core.interactiveshell import ExecutionResult, InteractiveShell
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.display import clear_output, display

from fnkernel.adapters.runtimes import RUNTIMES
from fnkernel.kernel.cellspec import Spec, owner_of
from fnkernel.kernel.display import FunctionsTable, RegistrationCard
from fnkernel.kernel.functions import Function
from fnkernel.kernel.include import IncludeError, included_files
from fnkernel.kernel.previous import name_error_handler
from fnkernel.kernel.session import _SESSION_ATTRIBUTE, Session, session_of
from fnkernel.kernel.trace import TraceTable
from fnkernel.kernel.waterfall import Waterfall
from fnkernel.runtime_server import limits
from fnkernel.runtime_server.client import parse_pairs
from fnkernel.runtime_server.client.errors import FunctionNotFound, GatewayError
from fnkernel.runtime_server.errors import InvalidField
from fnkernel.runtime_server.lifecycle.secrets import check_secret_names


class _HelpShown(Exception):
    """``--help`` was given: the parser printed it, and the magic does nothing else."""


class _Parser(argparse.ArgumentParser):
    def __init__(self, prog: str, description: str = "") -> None:
        super().__init__(
            prog=prog, description=description, exit_on_error=False, allow_abbrev=False
        )

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise _HelpShown  # argparse exits only after printing --help


def _helped(magic: Any) -> Any:
    """`magic`, which answers ``--help`` (or ``-h``), anywhere in its line (``%krm render
    --help``), by printing its own docstring (``%function --help`` is its parser's), as
    ``%magic?`` shows it."""

    @functools.wraps(magic)
    def answered(self: Any, line: str, *rest: Any) -> Any:
        if {"--help", "-h"} & set(line.split()):
            print(inspect.cleandoc(magic.__doc__ or ""))
            return None
        return magic(self, line, *rest)

    return answered


def _number(kind: type[int] | type[float], unit: str = "seconds") -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of {unit}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
        return value

    return parse


def _env_pair(text: str) -> tuple[str, str]:
    """``KEY=VALUE``, or ``KEY``: its value in this kernel's environment now, so a key set with
    ``%env`` or ``os.environ`` reaches the handler without being written in the cell."""
    if "=" not in text and text:
        if text not in os.environ:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not set in this kernel's environment (set it first, or give "
                f"{text}=VALUE)"
            )
        return text, os.environ[text]
    try:
        [(key, value)] = parse_pairs([text]).items()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return key, value


FUNCTION_PARSER = _Parser(
    "%%function",
    "Register the cell as a function's handler (NAME.py or NAME.sh, default handler "
    "NAME.handler) and bind NAME to a callable: NAME(payload) or NAME(field=value, ...), "
    "NAME.invoke(...), NAME.map(items), NAME.status(), NAME.unregister(). Its working "
    "directory holds the cell's file and what --include ships with it (docs/protocol.md, "
    "'What a handler sees').",
)
FUNCTION_PARSER.add_argument("name", help="the function's name (a Python identifier)")
FUNCTION_PARSER.add_argument(
    "--runtime", choices=RUNTIMES, default="python", help="default: python"
)
FUNCTION_PARSER.add_argument("--handler", help="MODULE.FUNCTION to call (default: NAME.handler)")
FUNCTION_PARSER.add_argument(
    "--env", type=_env_pair, action="append", default=[], metavar="KEY[=VALUE]",
    help="an environment variable of the handler; KEY alone takes its value from this "
    "kernel's environment now. Shown as its key only",
)  # fmt: skip
FUNCTION_PARSER.add_argument(
    "--include", nargs="+", action="extend", default=[], metavar="PATH",
    help="files or directories beside the notebook to ship with the function, at the same "
    "relative paths in its working directory (UTF-8 text, 6 MiB in all)",
)  # fmt: skip
FUNCTION_PARSER.add_argument(
    "--idle-timeout", type=_number(int), default=0, metavar="S",
    help="seconds without a call after which it is unregistered until the next call (0: the "
    f"default, {limits.DEFAULT_IDLE_TIMEOUT_SECONDS})",
)  # fmt: skip
FUNCTION_PARSER.add_argument(
    "--memory", type=_number(int, "MiB"), default=0, metavar="MIB",
    help="what each of its processes may take (default 1024)",
)  # fmt: skip
FUNCTION_PARSER.add_argument(
    "--timeout", type=_number(float), metavar="S", help="each invocation's timeout"
)
FUNCTION_PARSER.add_argument(
    "--krm", action="store_true", help="a KRM function: usable in pipelines as fn://NAME"
)
FUNCTION_PARSER.add_argument(
    "--replicas", type=_number(int), default=1, metavar="N", help="how many Runs serve it"
)
FUNCTION_PARSER.add_argument(
    "--requirements", nargs="+", action="extend", default=[], metavar="REQ",
    help="Python packages the handler imports, each a PEP 508 requirement ('pandas>=2.2'), "
    "installed for it on the stack (docs/protocol.md, 'Requirements')",
)  # fmt: skip
FUNCTION_PARSER.add_argument(
    "--secret", action="append", default=[], metavar="NAME",
    help="a secret of the stack (fnkernel secrets set NAME KEY=VALUE) whose keys the handler "
    "sees as environment variables; its values are never in the notebook",
)  # fmt: skip
FUNCTION_PARSER.add_argument(
    "--requirements-file", metavar="PATH",
    help="a requirements.txt beside the notebook listing more of them",
)  # fmt: skip


def _parse(parser: _Parser, line: str) -> argparse.Namespace | None:
    """The parsed line; None when it asked for --help (printed)."""
    try:
        argv = shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"{parser.prog}: {exc}") from None
    try:
        return parser.parse_args(argv)
    except argparse.ArgumentError as exc:
        raise UsageError(f"{parser.prog}: {exc}") from None
    except UsageError as exc:
        if "arguments are required" in str(exc) and argv and argv[0].startswith("-"):
            # `%%function --include a.py NAME`: the flag took NAME as one of its paths.
            raise UsageError(
                f"{exc}; give them before the flags: a flag of several values (--include) "
                "takes every word after it"
            ) from None
        raise
    except _HelpShown:
        return None


def _requirements_file(name: str, path: str, runtime: str) -> list[str]:
    """What ``--requirements-file PATH`` lists; a line that is not a requirement is a usage
    error naming the file and the line."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(
            f"%%function {name} --requirements-file: cannot read {path}: {exc}"
        ) from None
    listed = []
    for number, line in enumerate(text.splitlines(), 1):
        for requirement in limits.requirements_in(line):
            try:
                limits.check_requirements([requirement], runtime)
            except InvalidField as exc:
                raise UsageError(
                    f"%%function {name} --requirements-file {path}: line {number}: {exc.reason}"
                ) from None
            listed.append(requirement)
    return listed


@magics_class
class FunctionMagics(Magics):
    @property
    def shell_(self) -> InteractiveShell:
        assert self.shell is not None  # set by register_magics
        return self.shell

    @property
    def session(self) -> Session:
        return session_of(self.shell_)

    @line_cell_magic("function")  # type: ignore[arg-type]  # IPython types it as Never
    def function(self, line: str, cell: str | None = None) -> None:
        """%%function NAME [--runtime python|bash] [--handler H] [--env KEY[=VALUE]]...
        [--include PATH...] [--idle-timeout S] [--timeout S] [--memory MIB] [--replicas N]
        [--requirements REQ...] [--requirements-file PATH] [--secret NAME]...

        Register the cell as the handler source (NAME.py / NAME.sh, default handler
        NAME.handler) and bind NAME to a callable: NAME(payload), NAME.invoke(...),
        NAME.map(items), NAME.status(), NAME.unregister(...). With --replicas N, N Runs serve
        it and a call goes to a free one. ``%function --help`` (one line) prints the flags.
        """
        args = _parse(FUNCTION_PARSER, line)
        if args is None:
            return
        if cell is None:
            raise UsageError(
                "%%function: the handler is the cell's body, after the %%function line "
                "(%function --help lists the flags)"
            )
        if not args.name.isidentifier():
            raise UsageError(f"%%function: NAME {args.name!r} must be a Python identifier")
        if not cell.strip():
            raise UsageError("%%function: the cell body (the handler source) is empty")
        try:
            files = included_files(args.include, Path.cwd())
        except IncludeError as exc:
            raise UsageError(f"%%function {args.name} {exc}") from None
        # The stack checks these too; checked here, an edited cell's bad flag leaves the
        # registered function as it was.
        requirements = list(args.requirements)
        if args.requirements_file:
            requirements += _requirements_file(args.name, args.requirements_file, args.runtime)
        checks: list[tuple[str, Callable[[], object]]] = [
            ("--requirements", lambda: limits.check_requirements(requirements, args.runtime)),
            ("--secret", lambda: check_secret_names(args.secret)),
            ("--memory", lambda: limits.check_memory_mb(args.memory)),
            ("--idle-timeout", lambda: limits.check_idle_timeout(args.idle_timeout)),
            ("--env", lambda: limits.check_env(dict(args.env))),
        ]
        for flag, check in checks:
            try:
                check()
            except InvalidField as exc:
                raise UsageError(f"%%function {args.name} {flag}: {exc.reason}") from None
        spec = Spec(
            name=args.name,
            runtime=args.runtime,
            handler=args.handler or f"{args.name}.handler",
            source=cell,
            env=dict(args.env),
            files=files,
            idle_timeout=args.idle_timeout,
            memory=args.memory,
            replicas=args.replicas,
            requirements=tuple(requirements),
            secrets=tuple(args.secret),
        )
        if problem := spec.name_problem():
            raise UsageError(f"%%function {args.name}: {problem}; name the function otherwise")
        if spec.filename in files:
            raise UsageError(
                f"%%function {args.name} --include: {spec.filename} is the cell's own file; "
                "include it under another name"
            )
        handle = display(RegistrationCard(spec.name, spec.runtime), display_id=True)
        shown: list[RegistrationCard] = []

        def show(card: RegistrationCard) -> None:
            shown[:] = [card]
            if handle is not None:
                handle.update(card)

        try:
            function = self.session.register(spec, args.timeout, show)
        finally:
            if shown and handle is not None:
                # The final state once more, as an output of its own in place of the card: a
                # log of the notebook (papermill --log-output, nbconvert) keeps outputs, not the
                # updates that moved the card to it.
                clear_output(wait=True)
                display(shown[-1])
        if args.krm:
            from fnkernel.kernel.krm import (  # loads ruamel.yaml: only when KRM is used
                chain_of,
                register,
            )

            register(chain_of(self.session), function)  # pipelines can use it as fn://NAME
        self.shell_.user_ns[spec.name] = function

    @line_magic("invoke")
    @_helped
    def invoke(self, line: str) -> None:
        """%invoke NAME [JSON] — invoke NAME with the JSON payload and show the result."""
        name, _, payload_text = line.strip().partition(" ")
        if not name:
            raise UsageError("%invoke: NAME is required: %invoke NAME [JSON]")
        payload_text = payload_text.strip()
        try:
            payload = json.loads(payload_text) if payload_text else None
        except ValueError as exc:
            raise UsageError(f"%invoke: the payload is not JSON: {exc}") from None
        function = self.session.functions.get(name)
        if function is None:
            function = self._attach(name)
        display(function.invoke(payload))

    def _attach(self, name: str) -> Function:
        """A function registered elsewhere (another kernel, the CLI) on this gateway;
        FunctionNotFound if there is none."""
        return self.session.use(name)

    @line_magic("use")
    @_helped
    def use(self, line: str) -> RegistrationCard:
        """%use NAME — bind NAME, a function on the stack this kernel uses (another notebook's,
        or one created with the CLI), as a callable. It is never registered again nor deleted
        by this kernel, and this kernel's shutdown leaves it alone."""
        name = line.strip()
        if not name:
            raise UsageError("%use: NAME is required: %use NAME")
        if not name.isidentifier():
            raise UsageError(f"%use: NAME {name!r} must be a Python identifier: %use NAME")
        if name in self.session.functions:
            raise UsageError(f"%use: {name} is this kernel's own already")
        if self.session.runtime.empty:  # not started for nothing: %fn_connect stays open
            raise UsageError(
                f"%use: no function {name!r}: this kernel's embedded runtime starts empty; to "
                "use a shared stack's, %fn_connect URL first (or set FNKERNEL_RUNTIME)"
            )
        try:
            function = self._attach(name)
        except FunctionNotFound:
            raise UsageError(
                f"%use: no function {name!r} on the {self.session.runtime.describe()}"
            ) from None
        self.shell_.user_ns[name] = function
        status = function.status()
        mine = self.session.whose(status) == "this kernel"  # its owner's, before a restart
        note = (
            "used: made by this kernel's owner; its %%function cell makes it this kernel's"
            if mine
            else "used: not this kernel's"
        )
        card = RegistrationCard.from_run(status, note=note)
        return dataclasses.replace(card, where=self.session.runtime.where())

    @line_magic("fn_connect")
    @_helped
    def fn_connect(self, line: str) -> None:
        """%fn_connect URL — use the gateway at URL (a shared stack, ``fnkernel up``) instead of
        an embedded runtime; before the first function needs a stack."""
        address = line.strip()
        if not address:
            raise UsageError("%fn_connect: URL is required: %fn_connect http://127.0.0.1:8080")
        unused = not (self.session.functions or self.session.used)
        try:
            self.session.runtime.connect(address, unused=unused)
        except ValueError as exc:
            raise UsageError(f"%fn_connect: {exc}") from None
        print(f"functions will be registered on the gateway at {address}")
        if why := self.session.runtime.unanswered(address):
            print(f"but {why}", file=sys.stderr)  # kept: the stack may be started after it

    @line_magic("functions")
    @_helped
    def functions(self, line: str) -> FunctionsTable:
        """%functions [--all] [NAME...] — this kernel's functions (those it registered and
        those bound with %use) with their live state; --all: every function on its stack,
        marking which are this kernel's."""
        words = line.split()
        every = "--all" in words
        wanted = {word for word in words if word != "--all"}
        session = self.session
        if session.runtime.empty:  # an embedded runtime not started holds nothing: not started
            return FunctionsTable([], session.runtime.describe(), tuple(sorted(wanted)))
        client = session.runtime.client()
        rows = []
        for run in client.list_runs():
            if (wanted and run.name not in wanted) or run.get("spec", {}).get("replicaOf"):
                continue  # a replica N > 0 is shown in its function's row
            owner = session.whose(run)
            if not (every or owner or wanted):
                continue  # another's: --all shows it, and whose
            if owner != "this kernel":  # another's: named, and marked if it is used here
                owner = f"{owner_of(run.source)}{' (used here)' if owner else ''}"
            replicas = int(run.get("spec", {}).get("replicas", 1))
            row = {
                "name": run.name,
                "runtime": run.runtime,
                "phase": run.phase,
                "attempt": str(run.attempt),
                "replicas": str(replicas),
                "owner": owner,
            }
            if run.ready or replicas > 1:
                try:
                    status = client.status(run.name)
                except GatewayError:
                    status = None
                live = status.live if status is not None else None
                row["state"] = live.state if live is not None else ""
                row["registration"] = live.registration_id if live is not None else ""
                row["in flight"] = str(live.in_flight) if live is not None else ""
                if status is not None and replicas > 1:
                    # The gateway's count of its calls on each replica (docs/protocol.md,
                    # "Replicas"), and how many replicas are Ready.
                    members = status.get("replicas") or []
                    busy = sum(1 for replica in members if replica.get("inFlight"))
                    ready = sum(1 for replica in members if replica.get("phase") == "Ready")
                    row["replicas"] = f"{len(members)} ({ready} ready, {busy} busy)"
                    row["in flight"] = str(sum(r.get("inFlight", 0) for r in members))
            rows.append(row)
        missing = tuple(sorted(wanted - {row["name"] for row in rows}))
        return FunctionsTable(rows, session.runtime.describe(), missing)

    @line_cell_magic("krm")
    @_helped
    def krm(self, line: str, cell: str | None = None) -> Any:
        """%krm render DIR [--dry-run] | %%krm render (the cell: a package) |
        %%krm eval IMAGE [-- key=value ...] (the cell: the input resources) |
        %krm export NAME [-o PATH]

        Run a KRM pipeline over the kernel's evaluator chain and show it step by step, or
        write the function NAME as an executable KRM function kpt can run (default
        ./NAME.pyz).
        """
        from fnkernel.kernel.krm import (  # loads ruamel.yaml: only when KRM is used
            chain_of,
            export_magic,
            krm_magic,
        )

        if line.split()[:1] == ["export"]:
            return export_magic(self.session, line, cell)
        return krm_magic(chain_of(self.session), line, cell)

    @line_magic("fn_trace")
    @_helped
    def fn_trace(self, line: str) -> TraceTable | Waterfall | None:
        """%fn_trace on|off|show [--all]|waterfall [INVOCATION] — record every call the kernel
        makes to the runtime (show: the calls your cells caused; --all: also the kernel's own
        status polls; waterfall: the spans of the last traced invocation, or INVOCATION's, on
        one time axis, every hop's: docs/protocol.md, "Tracing")."""
        trace = self.session.trace
        command = line.strip() or "show"
        words = command.split()
        if words[0] == "waterfall" and len(words) <= 2:
            call = trace.traced(words[1] if len(words) == 2 else "")
            if call is None:
                named = f" {words[1]}" if len(words) == 2 else ""
                raise UsageError(
                    f"%fn_trace waterfall: no traced invocation{named} (%fn_trace on, then "
                    "invoke a function)"
                )
            return Waterfall(call.waterfall_spans())
        if command == "on":
            trace.start()
            print("fn_trace: recording every call to the runtime (%fn_trace show to see them)")
            return None
        if command == "off":
            trace.stop()
            print(f"fn_trace: off ({len(trace.calls())} calls recorded; %fn_trace show)")
            return None
        if command in ("show", "show --all"):
            return TraceTable(trace.calls(), show_all=command.endswith("--all"))
        raise UsageError(
            f"%fn_trace: expected on, off, show, show --all or waterfall [INVOCATION], got {command!r}"
        )

    @line_magic("fn_debug")
    @_helped
    def fn_debug(self, line: str) -> Any:
        """%fn_debug — the full detail of the last error."""
        return self.session.debug()


def _remember_error(session: Session) -> Any:
    def post_run_cell(result: ExecutionResult) -> None:
        error = result.error_in_exec or result.error_before_exec
        if error is not None:
            session.last_error = error

    return post_run_cell


def _name_matcher(session: Session) -> Any:
    """Completion after ``%invoke `` (its first word) and ``%functions ``: the registered names
    alone, typed as functions, failed ones left out (docs/protocol.md, "Kernel")."""

    @context_matcher(identifier="fnkernel.names")
    def match(context: CompletionContext) -> SimpleMatcherResult:
        words = context.text_until_cursor.lstrip().split(" ")
        ours = (words[0] == "%invoke" and len(words) == 2) or (
            words[0] == "%functions" and len(words) >= 2
        )
        if not ours:
            return {"completions": [], "suppress": False}
        names = [name for name in session.names() if name.startswith(context.token)]
        return {
            "completions": [SimpleCompletion(name, type="function") for name in names],
            "suppress": True,
        }

    return match


def load(shell: InteractiveShell) -> None:
    session = session_of(shell)
    atexit.register(session.shutdown)  # also in a stock ipykernel, which has no shutdown hook
    shell.register_magics(FunctionMagics)
    shell.events.register("post_run_cell", _remember_error(session))
    shell.Completer.custom_matchers.append(_name_matcher(session))
    shell.set_custom_exc((NameError,), name_error_handler(session.previous, session.on_stack))


def unload(shell: InteractiveShell) -> None:
    """Stop the embedded runtime (the magics stay defined: IPython cannot remove them)."""
    session: Session | None = getattr(shell, _SESSION_ATTRIBUTE, None)
    if session is not None:
        session.shutdown()
