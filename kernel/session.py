"""One kernel's fnkernel session (docs/protocol.md, "Kernel"): its registered functions, its runtime connection, the
trace and the last error; and the accessor that finds it on an IPython shell."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable
from typing import Any

from IPython.core.interactiveshell import InteractiveShell

from fnkernel.kernel.connection import Runtime
from fnkernel.kernel.display import Detail, RegistrationCard, pretty_json
from fnkernel.kernel.functions import (
    Function,
    HandlerFailedInCell,
    RegistrationInterrupted,
    Spec,
    cell_line,
)
from fnkernel.kernel.previous import PreviousKernel
from fnkernel.kernel.trace import Trace
from fnkernel.runtime_server.client.errors import (
    FunctionNotFound,
    GatewayError,
    RegistrationFailed,
    RequestCancelled,
)

_SESSION_ATTRIBUTE = "_fnkernel_session"
_REUSABLE = ("Ready", "Idle")  # a Run in these phases is kept when its cell is run unchanged


def in_cell(message: str, spec: Spec) -> str:
    """A load failure's message with the handler file's lines told as cell lines."""
    return re.sub(
        rf"\b{re.escape(spec.filename)} line (\d+)",
        lambda found: f"cell line {cell_line(int(found[1]))}",
        message,
    )


def session_of(shell: InteractiveShell) -> Session:
    """The shell's fnkernel session, created on first use."""
    session: Session | None = getattr(shell, _SESSION_ATTRIBUTE, None)
    if session is None:
        session = Session()
        setattr(shell, _SESSION_ATTRIBUTE, session)
    return session


class Session:
    """One kernel's (one IPython shell's) functions, runtime connection, trace and last error."""

    def __init__(self, runtime: Runtime | None = None) -> None:
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
        client = self.runtime.client(spec.runtime, progress)
        try:
            existing = client.status(spec.name)
        except FunctionNotFound:
            existing = None
        if existing is not None:
            if existing.source == spec.origin and existing.phase in _REUSABLE:
                function = self._bind(spec, timeout)
                show(RegistrationCard.from_run(existing, note="unchanged"))
                return function
            progress("unregistering the previous version")
            client.delete_run(spec.name)
            self.functions.pop(spec.name, None)
        show(
            RegistrationCard(
                spec.name, spec.runtime, state="registering", note="loading the handler"
            )
        )
        try:
            run = client.create_run(
                spec.name,
                runtime=spec.runtime,
                handler=spec.handler,
                files={spec.filename: spec.source},
                env=spec.env,
                idle_timeout_seconds=spec.idle_timeout,
                memory_mb=spec.memory,
                origin=spec.origin,
                replicas=spec.replicas,
            )
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
        if run.failed:
            failed = RegistrationCard.from_run(run)
            failed.message = in_cell(run.message, spec)
            show(failed)
            raise RegistrationFailed(
                f'"{spec.name}" did not register: {failed.message}', code="Failed", run_uid=run.uid
            )
        function = self._bind(spec, timeout)
        show(RegistrationCard.from_run(client.status(spec.name)))
        return function

    def use(self, name: str) -> Function:
        """Bind `name`, a function on this kernel's stack that it did not register (another
        notebook's, or one created with the CLI): never registered again nor deleted by this
        kernel (``%use``). FunctionNotFound if the stack has none of that name."""
        run = self.runtime.client().status(name)  # the user's own request: traced as one
        spec = Spec(
            name, run.runtime, run.handler, source="", env=run.env,
            replicas=int(run.get("spec", {}).get("replicas", 1)),
        )  # fmt: skip
        function = Function(self.runtime, spec, owned=False)
        self.used[name] = function
        return function

    def owner(self, name: str) -> str:
        """Whose `name` is, as ``%functions`` says it."""
        if name in self.functions:
            return "this kernel"
        return "used here" if name in self.used else ""

    def _bind(self, spec: Spec, timeout: float | None) -> Function:
        function = Function(self.runtime, spec, timeout, on_unregister=self.forget)
        self.functions[spec.name] = function
        if self.runtime.embedded:  # it ends with this kernel: a later one will say so
            self.previous.remember(spec.name)
        return function

    def forget(self, function: Function) -> None:
        if self.functions.get(function.name) is function:
            del self.functions[function.name]
            self.previous.forget(function.name)

    def names(self) -> list[str]:
        """Names one can invoke: this kernel's functions, and the gateway's Runs once it is
        started, less those that failed."""
        names = set(self.functions)
        if self.runtime.started:
            with contextlib.suppress(GatewayError):  # completion works with the gateway down
                runs = self.runtime.client().list_runs()
                names.update(run.name for run in runs)
                names.difference_update(run.name for run in runs if run.failed)
        return sorted(names)

    def debug(self) -> Detail:
        """``%fn_debug``: the full detail of the last error — what it is, a handler's
        traceback (plain, and coloured for a terminal), then the request."""
        error = self.last_error
        if error is None:
            return Detail("fn_debug", "no error so far")
        head = f"{type(error).__module__}.{type(error).__name__}: {error}"
        request = []
        if isinstance(error, GatewayError):
            request.append(f"HTTP status: {error.status or '(none)'}   code: {error.code or '-'}")
            if error.run_uid:
                request.append(f"run uid: {error.run_uid}")
            if error.invocation_id:
                request.append(f"invocation id: {error.invocation_id}")
            # The handler's log lines were the cell's output, and its traceback is above.
            body = {key: value for key, value in error.detail.items() if key != "logs"}
            if body:
                request += ["body:", pretty_json(body)]
        request.append(f"runtime: {self.runtime.describe()}")
        title = f"fn_debug: last error ({type(error).__name__})"
        if not (isinstance(error, HandlerFailedInCell) and error.traceback_lines):
            return Detail(title, "\n".join([head, *request]))
        return Detail(
            title,
            "\n".join([head, "", error.traceback_text(), "", *request]),
            "\n".join([head, "", error.traceback_text(colour=True), "", *request]),
        )

    def cancel_in_flight(self) -> int:
        """Abort every call in flight (a kernel interrupt); how many there were."""
        return sum(cancel() for cancel in self.cancellers)

    def shutdown(self, timeout: float = 15.0) -> None:
        """Stop whatever this session started: teaching servers, then the embedded runtime."""
        while self.closers:
            self.closers.pop()()
        self.runtime.stop(timeout)
