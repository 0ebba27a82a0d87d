"""One kernel's fnkernel session (docs/protocol.md, "Kernel"): its registered functions, its runtime connection, the
trace and the last error; and the accessor that finds it on an IPython shell."""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from fnkernel.kernel import include
from fnkernel.kernel.cellspec import Spec, owner_of
from fnkernel.kernel.connection import Runtime, StackChosen, StackMisconfigured
from fnkernel.kernel.display import Detail, RegistrationCard, pretty_json
from fnkernel.kernel.functions import Function, NotOwned, RegistrationInterrupted
from fnkernel.kernel.output import HandlerFailedInCell, in_cell
from fnkernel.kernel.previous import PreviousKernel
from fnkernel.kernel.trace import Trace
from fnkernel.runtime_server.client import Client, Run
from fnkernel.runtime_server.client.errors import (
    FunctionNotFound,
    GatewayError,
    InvalidRequest,
    RegistrationFailed,
    RequestCancelled,
)

_SESSION_ATTRIBUTE = "_fnkernel_session"
HINT_SECONDS = 2  # how long a NameError's hint may ask the stack (Session.on_stack)
OWNER_ENV = "FNKERNEL_OWNER"  # who this kernel is, as its functions record it
# An owner is at most this long: with the fingerprint, a Run's spec.source stays within the
# 1024 characters the Run's schema allows.
_OWNER_CHARS = 512
_REUSABLE = ("Ready", "Idle")  # a Run in these phases is kept when its cell is run unchanged
_PROGRESS_SECONDS = 0.5  # how often a registering cell's card reads its install's progress


def kernel_owner() -> str:
    """This kernel as the functions it registers name their owner (docs/protocol.md,
    "Ownership"): $FNKERNEL_OWNER when set; else the notebook Jupyter started it for, which a
    restarted kernel keeps; else the kernel itself (its connection file's ID) — each with the
    user and host."""
    named = os.environ.get(OWNER_ENV, "").strip()
    if named:
        return named[-_OWNER_CHARS:]
    notebook = os.environ.get("JPY_SESSION_NAME", "")
    label = f"notebook {notebook}" if notebook else f"kernel {_kernel_id()}"
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid
        user = str(os.getuid())
    owner = f"{label} ({user}@{socket.gethostname()})"
    return owner if len(owner) <= _OWNER_CHARS else "…" + owner[1 - _OWNER_CHARS :]


def _kernel_id() -> str:
    try:
        from ipykernel.connect import get_connection_file

        name = os.path.basename(get_connection_file())
    except Exception:  # not in a kernel (a plain IPython): the process stands for it
        return f"process {os.getpid()}"
    return name.removeprefix("kernel-").removesuffix(".json")[:8]


# A field of POST /v1/runs as the %%function line spells it.
_FLAGS = {
    "memoryMb": "--memory",
    "idleTimeoutSeconds": "--idle-timeout",
    "replicas": "--replicas",
    "requirements": "--requirements",
    "secrets": "--secret",
    "env": "--env",
    "handler": "--handler",
    "runtime": "--runtime",
    "files": "(the cell and --include)",
    "name": "NAME",
}


@contextlib.contextmanager
def _installing(
    client: Client, spec: Spec, show: Callable[[RegistrationCard], None]
) -> Iterator[None]:
    """While a cell with requirements registers, its card shows the install's progress: the
    Run's status message, which its runtimed sets to uv's latest line (docs/protocol.md,
    "Requirements"), read every half second."""
    if not spec.requirements:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        shown = ""
        while not done.wait(_PROGRESS_SECONDS):
            with contextlib.suppress(GatewayError):
                message = client.status(spec.name).message
                if message.startswith("installing") and message != shown:
                    shown = message
                    show(RegistrationCard(spec.name, spec.runtime, "registering", note=message))

    watcher = threading.Thread(target=watch, name="fnkernel-install-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(_PROGRESS_SECONDS * 4)


def _with_flags(spec: Spec, create: Callable[..., Run]) -> Callable[..., Run]:
    """`create`, whose refusal of a field is a UsageError naming the cell's flag instead."""

    def created(*args: Any, **kwargs: Any) -> Run:
        try:
            return create(*args, **kwargs)
        except InvalidRequest as refused:
            field, colon, reason = refused.message.partition(": ")
            field = field.split("[", 1)[0]  # requirements[2]: the flag that gave it
            if not colon or field not in _FLAGS:
                raise
            raise UsageError(f"%%function {spec.name} {_FLAGS[field]}: {reason}") from None

    return created


def get(name: str) -> Function:
    """The function `name` on the stack this kernel uses, bound as ``%use NAME`` binds it
    (the kernel's own if it registered it): ``fnkernel.kernel.get``."""
    from IPython import get_ipython  # the running kernel's shell

    session = session_of(get_ipython())
    return session.functions.get(name) or session.use(name)


def session_of(shell: InteractiveShell) -> Session:
    """The shell's fnkernel session, created on first use."""
    session: Session | None = getattr(shell, _SESSION_ATTRIBUTE, None)
    if session is None:
        session = Session()
        setattr(shell, _SESSION_ATTRIBUTE, session)
    return session


class Session:
    """One kernel's (one IPython shell's) functions, runtime connection, trace and last error."""

    def __init__(self, runtime: Runtime | None = None, owner: str | None = None) -> None:
        self.owner = owner or kernel_owner()
        # The environment as the kernel started (FnKernelApp marks it again once the kernel
        # has set its own variables): what a cell sets later (%env, os.environ) is not a
        # handler's unless passed with --env, and the card says so.
        self.started_environ = dict(os.environ)
        self.trace = Trace()
        self.runtime = runtime or Runtime(trace=self.trace)
        self.functions: dict[str, Function] = {}
        self.used: dict[str, Function] = {}  # bound with %use: on the stack, not this kernel's
        self.last_error: BaseException | None = None
        # Each aborts the calls it has in flight and says how many: the gateway client's, and
        # those of any FunctionRuntime client the notebook opened (kernel.protocol).
        self.cancellers: list[Callable[[], int]] = [self.runtime.cancel]
        self.closers: list[Callable[[], None]] = []
        self.krm: Any = None  # the KRM evaluator chain, once used (kernel.krm.chain_of)
        self.previous = PreviousKernel()  # for a NameError after a restart

    def register(
        self, spec: Spec, timeout: float | None, show: Callable[[RegistrationCard], None]
    ) -> Function:
        """Register `spec` and return its callable; `show` receives each progress card.

        Unchanged (the Run's origin names the same fingerprint and it is Ready or Idle): the
        same Run and registration are kept. Changed, or Failed: the old Run is unregistered and
        a new one registered.
        """

        with self.trace.bookkeeping():  # its status reads are the kernel's, not the user's
            return self._register(spec, timeout, show)

    def _register(
        self, spec: Spec, timeout: float | None, shown: Callable[[RegistrationCard], None]
    ) -> Function:
        def show(card: RegistrationCard) -> None:  # each card names the stack, once known
            shown(dataclasses.replace(card, where=self.runtime.where()))

        def progress(note: str) -> None:
            show(RegistrationCard(spec.name, spec.runtime, state="starting", note=note))

        show(RegistrationCard(spec.name, spec.runtime, state="registering"))
        try:
            client = self.runtime.client(spec.runtime, progress)
        except StackMisconfigured:
            show(RegistrationCard(spec.name, spec.runtime, state="refused", note="not started"))
            raise
        except StackChosen:
            show(RegistrationCard(spec.name, spec.runtime, state="refused", note="another stack"))
            raise
        try:
            existing = client.status(spec.name)
        except FunctionNotFound:
            existing = None
        except GatewayError:  # unreachable, refused the token: the card ends saying so
            show(RegistrationCard(spec.name, spec.runtime, state="failed"))
            raise
        origin = spec.origin(self.owner)
        if existing is not None:
            owner = owner_of(existing.source)
            if owner != self.owner:
                show(RegistrationCard(spec.name, spec.runtime, state="refused", note=f"{owner}'s"))
                # A kernel that named its owner has nothing to learn about the variable.
                named = os.environ.get(OWNER_ENV)
                how = (
                    f"This kernel is {self.owner} ({OWNER_ENV})"
                    if named
                    else f"A kernel started by a script (nbclient, CI) is owner only as itself "
                    f"unless it sets {OWNER_ENV}, the same for each run"
                )
                raise NotOwned(
                    f'"{spec.name}" is owned by {owner}, not by this kernel, which never '
                    f"replaces or deletes another's function. Register this cell under another "
                    f"name, bind the existing one with %use {spec.name}, or unregister it where "
                    f"it was made ({spec.name}.unregister() there, or: fnkernel runs delete "
                    f"{spec.name}). {how}"
                )
            if existing.source == origin and existing.phase in _REUSABLE:
                function = self._bind(spec, timeout, existing.uid)
                show(RegistrationCard.from_run(existing, note="unchanged"))
                return function
            progress("unregistering the previous version")
            client.delete_run(spec.name)
            self.functions.pop(spec.name, None)
        # With requirements, the install comes first; its own lines follow as uv writes them.
        first = "installing its requirements" if spec.requirements else "loading the handler"
        show(RegistrationCard(spec.name, spec.runtime, state="registering", note=first))
        try:
            with _installing(client, spec, show):
                run = _with_flags(spec, client.create_run)(
                    spec.name,
                    runtime=spec.runtime,
                    handler=spec.handler,
                    files=spec.all_files,
                    env=spec.env,
                    idle_timeout_seconds=spec.idle_timeout,
                    memory_mb=spec.memory,
                    origin=origin,
                    replicas=spec.replicas,
                    requirements=spec.requirements,
                    secrets=spec.secrets,
                )
                while spec.requirements and run.phase == "Pending":
                    # An install can outlast the create's wait: the cell waits for it.
                    time.sleep(_PROGRESS_SECONDS)
                    run = client.status(spec.name)
        except (RequestCancelled, KeyboardInterrupt):
            # Interrupted while it registered: nothing half-registered stays behind (a Run left
            # Pending would make the cell's next run wait for it).
            self.runtime.cancel()
            with contextlib.suppress(GatewayError):
                client.delete_run(spec.name, cancel_in_flight=True)
            show(RegistrationCard(spec.name, spec.runtime, state="interrupted"))
            raise RegistrationInterrupted(
                f"registration of {spec.name} interrupted; nothing is registered"
            ) from None
        except (UsageError, GatewayError) as refused:
            state = "refused" if isinstance(refused, (UsageError, InvalidRequest)) else "failed"
            show(RegistrationCard(spec.name, spec.runtime, state=state))
            raise
        if run.failed:
            failed = RegistrationCard.from_run(run)
            failed.message = in_cell(run.message, spec)
            hint = include.hint(run.message, spec.source, spec.files, Path.cwd())
            if hint:
                failed.message += f"\n  hint: {hint}"
            show(failed)
            raise RegistrationFailed(
                f'"{spec.name}" did not register: {failed.message}', code="Failed", run_uid=run.uid
            )
        function = self._bind(spec, timeout, run.uid)
        show(RegistrationCard.from_run(client.status(spec.name), note=self._unpassed(spec)))
        return function

    def _unpassed(self, spec: Spec) -> str:
        """The card's note when a cell has set environment variables since the kernel started
        that the handler does not get (docs/protocol.md, "What a handler sees"); not those a
        library sets for itself as it is imported, named with a leading underscore (polars'
        _RJEM_MALLOC_CONF)."""
        keys = sorted(
            key
            for key, value in os.environ.items()
            if self.started_environ.get(key) != value
            and key not in spec.env
            and not key.startswith(("FNKERNEL_", "JPY_", "_"))
        )
        if not keys:
            return ""
        shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        return f"not passed to the handler: {shown}, set in this kernel; --env KEY passes one"

    def use(self, name: str) -> Function:
        """Bind `name`, a function on this kernel's stack that it did not register (another
        notebook's, or one created with the CLI): never registered again nor deleted by this
        kernel (``%use``). FunctionNotFound if the stack has none of that name."""
        run = self.runtime.client().status(name)  # the user's own request: traced as one
        spec = Spec(
            name, run.runtime, run.handler, source="",
            replicas=int(run.get("spec", {}).get("replicas", 1)),
        )  # fmt: skip
        function = Function(self.runtime, spec)
        self.used[name] = function
        return function

    def whose(self, run: Run) -> str:
        """Whose `run` is, as ``%functions`` says it: this kernel's, bound here with %use, or
        (for --all) its owner's."""
        if owner_of(run.source) == self.owner:
            return "this kernel"
        return "used here" if run.name in self.used else ""

    def on_stack(self, name: str) -> str | None:
        """Why `name`, a NameError's, may be a function on this kernel's shared stack, and how
        to bind it (a restarted kernel's first NameError, say); None if it is no function
        there, or the stack is this kernel's own embedded runtime (``PreviousKernel`` tells
        of those). Asked briefly: a hint, never a wait."""
        runtime = self.runtime
        if runtime.empty or runtime.embedded or not runtime.address:
            return None
        try:
            run = Client(runtime.address, timeout=HINT_SECONDS).status(name)
        except (GatewayError, ValueError):
            return None
        if owner_of(run.source) == self.owner:
            return (
                f"{name} is this notebook's function on the stack at {runtime.address}, still "
                f"registered: run its %%function cell again to bind it (unchanged, it is not "
                f"registered again), or %use {name}."
            )
        return f"{name} is a function on the stack at {runtime.address}: %use {name} binds it here."

    def _bind(self, spec: Spec, timeout: float | None, run_uid: str) -> Function:
        function = Function(
            self.runtime, spec, timeout, on_unregister=self.forget, owner=self.owner,
            run_uid=run_uid,
        )  # fmt: skip
        self.functions[spec.name] = function
        if self.runtime.embedded:  # it ends with this kernel: a later one will say so
            self.previous.remember(spec.name)
        return function

    def forget(self, function: Function) -> None:
        if self.functions.get(function.name) is function:
            del self.functions[function.name]
            self.previous.forget(function.name)

    def names(self) -> list[str]:
        """Names one can invoke: this kernel's functions, and the gateway's functions once it
        is started (not their replicas' Runs, FUNCTION.N), less those that failed."""
        names = set(self.functions)
        if self.runtime.started:
            with contextlib.suppress(GatewayError):  # completion works with the gateway down
                runs = [run for run in self.runtime.client().list_runs() if not run.replica_of]
                names.update(run.name for run in runs)
                names.difference_update(run.name for run in runs if run.failed)
        return sorted(names)

    def debug(self) -> Detail:
        """``%fn_debug``: the full detail of the last error — what it is, a handler's
        traceback (plain, and coloured for a terminal), then the call: its HTTP status and
        code, run UID, invocation ID and whole error body, and the stack it was made on."""
        error = self.last_error
        if error is None:
            return Detail("fn_debug", "no error so far")
        head = f"{type(error).__name__}: {error}"  # as the cell named it, not our module's path
        call = []
        if isinstance(error, GatewayError):
            call.append(f"HTTP status: {error.status or '(none)'}   code: {error.code or '-'}")
            if error.run_uid:
                call.append(f"run uid: {error.run_uid}")
            if error.invocation_id:
                call.append(f"invocation id: {error.invocation_id}")
            # The handler's log lines were the cell's output, and its traceback is above.
            body = {key: value for key, value in error.detail.items() if key != "logs"}
            if body:
                call += ["body:", pretty_json(body)]
        call.append(f"runtime: {self.runtime.describe()}")
        title = f"fn_debug: last error ({type(error).__name__})"
        if not (isinstance(error, HandlerFailedInCell) and error.traceback_lines):
            return Detail(title, "\n".join([head, *call]))
        return Detail(
            title,
            "\n".join([head, "", error.traceback_text(), "", *call]),
            "\n".join([head, "", error.traceback_text(colour=True), "", *call]),
        )

    def cancel_in_flight(self) -> int:
        """Abort every call in flight (a kernel interrupt); how many there were."""
        return sum(cancel() for cancel in self.cancellers)

    def shutdown(self, timeout: float = 15.0) -> None:
        """Stop whatever this session started: teaching servers, then the embedded runtime."""
        while self.closers:
            self.closers.pop()()
        self.runtime.stop(timeout)
