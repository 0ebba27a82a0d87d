"""A kernel's registered functions (SPEC §6): the callables ``%%function`` binds, and the session
that owns them, the runtime connection, the trace and the last error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kernel.display import Detail, Invocation, RegistrationCard, pretty_json
from kernel.runtime import Runtime
from kernel.trace import Trace
from runtime_server.errors import (
    FunctionError,
    FunctionNotFound,
    RegistrationFailed,
    RequestCancelled,
)

EXTENSIONS = {"python": "py", "bash": "sh"}
ORIGIN_PREFIX = "%%function cell "  # a Run's spec.source when a cell created it
_REUSABLE = ("Ready", "Idle")
_IDLE_WAIT_SECONDS = 2.0  # after an interrupt, for the cancelled invocation to be gone


@dataclass(frozen=True)
class Spec:
    """What a ``%%function`` cell asks for; equal specs are the same function."""

    name: str
    runtime: str
    handler: str
    source: str
    env: Mapping[str, str] = field(default_factory=dict)
    idle_timeout: int = 0

    @property
    def filename(self) -> str:
        return f"{self.name}.{EXTENSIONS[self.runtime]}"

    @property
    def fingerprint(self) -> str:
        canonical = {
            "files": {self.filename: self.source},
            "handler": self.handler,
            "env": dict(self.env),
            "runtime": self.runtime,
            "idleTimeoutSeconds": self.idle_timeout,
        }
        text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()

    @property
    def origin(self) -> str:
        return ORIGIN_PREFIX + self.fingerprint


class InvocationInterrupted(KeyboardInterrupt):
    """The kernel was interrupted during an invocation: the call was cancelled and the handler
    killed; the function stays registered. Shown as one line, not a stack."""

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


class Status(dict[str, Any]):
    """``NAME.status()``: the gateway's answer (Run + live FunctionStatus) as a dict, shown as a
    registration card."""

    def card(self) -> RegistrationCard:
        return RegistrationCard.from_status(str(self.get("name", "")), self)

    def __repr__(self) -> str:
        live = self.get("live") or {}
        text = repr(self.card())
        if live:
            text += f"\n  in flight: {live.get('inFlight', 0)}"
        return text

    def _repr_html_(self) -> str:
        return self.card()._repr_html_()


class Function:
    """A registered function: ``NAME(payload)`` returns the decoded output."""

    def __init__(self, session: Session, spec: Spec, timeout: float | None = None) -> None:
        self._session = session
        self.spec = spec
        self.timeout = timeout  # seconds; the default for each invocation (--timeout)
        self.__name__ = spec.name
        self.__doc__ = f"The {spec.runtime} function {spec.name} ({spec.handler})."

    @property
    def name(self) -> str:
        return self.spec.name

    def __call__(self, payload: Any = None) -> Any:
        return self.invoke(payload).output

    def invoke(
        self,
        payload: Any = None,
        timeout: float | None = None,
        invocation_id: str | None = None,
    ) -> Invocation:
        """Invoke with `payload` (JSON-encoded); `timeout` in seconds overrides ``--timeout``."""
        timeout = self.timeout if timeout is None else timeout
        client = self._session.runtime.client()
        try:
            result = client.invoke(
                self.name,
                payload,
                timeout_millis=round(timeout * 1000) if timeout else 0,
                invocation_id=invocation_id or "",
            )
        except RequestCancelled:
            # The kernel was interrupted: the gateway cancels the call and the handler is
            # killed; the function stays registered. Wait (briefly) until it is free again, so
            # the next cell's call is not refused as busy.
            self._wait_until_idle(_IDLE_WAIT_SECONDS)
            raise InvocationInterrupted(
                f"invocation of {self.name} cancelled; the handler was killed and "
                f"{self.name} stays registered"
            ) from None
        return Invocation(self.name, result)

    def _wait_until_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                live = self._session.runtime.client().status(self.name).get("live") or {}
            except FunctionError:
                return
            if not live.get("inFlight"):
                return
            time.sleep(0.005)

    def status(self) -> Status:
        return Status(self._session.runtime.client().status(self.name))

    def unregister(self, cancel: bool = False, drain_timeout: float | None = None) -> None:
        """Unregister and delete the function: let the in-flight invocation finish (at most
        `drain_timeout` seconds), or `cancel` it."""
        self._session.runtime.client().delete_run(
            self.name,
            cancel_in_flight=cancel,
            drain_timeout_millis=round(drain_timeout * 1000) if drain_timeout else 0,
        )
        self._session.forget(self)

    def getdoc(self) -> str:
        """What ``NAME?`` shows: runtime, handler, status and the handler source."""
        lines = [
            f"{self.spec.runtime} function {self.name!r}, handler {self.spec.handler}",
        ]
        try:
            lines.append(repr(self.status()))
        except FunctionError as exc:
            lines.append(f"status unavailable: {type(exc).__name__}: {exc}")
        if self.spec.env:
            lines.append("env: " + ", ".join(f"{k}={v}" for k, v in self.spec.env.items()))
        lines += ["", f"--- {self.spec.filename} ---", self.spec.source.rstrip()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<{self.spec.runtime} function {self.name} ({self.spec.handler})>"


class Session:
    """One kernel's (one IPython shell's) functions, runtime connection, trace and last error."""

    def __init__(self, runtime: Runtime | None = None) -> None:
        self.trace = Trace()
        self.runtime = runtime or Runtime(trace=self.trace)
        self.functions: dict[str, Function] = {}
        self.last_error: BaseException | None = None
        # Each aborts the calls it has in flight and says how many: the gateway client's, and
        # those of any FunctionRuntime client the notebook opened (kernel.protocol).
        self.cancellers: list[Callable[[], int]] = [self.runtime.cancel]
        self.closers: list[Callable[[], None]] = []
        self._krm: Any = None

    def register(
        self,
        spec: Spec,
        timeout: float | None,
        show: Callable[[RegistrationCard], None],
        *,
        krm: bool = False,
    ) -> Function:
        """Register `spec` and return its callable; `show` receives each progress card. With
        `krm`, pipelines can use it as ``fn://NAME``.

        Unchanged (the Run's origin names the same fingerprint and it is Ready or Idle): the
        same Run and registration are kept. Changed, or Failed: the old Run is unregistered and
        a new one registered.
        """

        def progress(note: str) -> None:
            show(RegistrationCard(spec.name, spec.runtime, state="starting", note=note))

        show(RegistrationCard(spec.name, spec.runtime, state="registering"))
        client = self.runtime.client(spec.runtime, progress)
        try:
            existing = client.status(spec.name)
        except FunctionNotFound:
            existing = None
        if existing is not None:
            same = existing.get("spec", {}).get("source") == spec.origin
            if same and existing.get("status", {}).get("phase") in _REUSABLE:
                function = self._bind(spec, timeout, krm)
                show(RegistrationCard.from_status(spec.name, existing, note="unchanged"))
                return function
            progress("unregistering the previous version")
            client.delete_run(spec.name)
            self.functions.pop(spec.name, None)
        run = client.create_run(
            spec.name,
            runtime=spec.runtime,
            handler=spec.handler,
            files={spec.filename: spec.source},
            env=spec.env,
            idle_timeout_seconds=spec.idle_timeout,
            origin=spec.origin,
        )
        if run["status"]["phase"] == "Failed":
            show(RegistrationCard.from_status(spec.name, run))
            raise RegistrationFailed(
                {
                    "code": "Failed",
                    "message": f'"{spec.name}" did not register: {run["status"]["message"]}',
                    "runUid": run["uid"],
                },
                0,
            )
        function = self._bind(spec, timeout, krm)
        show(RegistrationCard.from_status(spec.name, client.status(spec.name)))
        return function

    def _bind(self, spec: Spec, timeout: float | None, krm: bool) -> Function:
        function = Function(self, spec, timeout)
        self.functions[spec.name] = function
        if krm:
            self.krm_chain().register(function)
        return function

    def forget(self, function: Function) -> None:
        if self.functions.get(function.name) is function:
            del self.functions[function.name]

    def names(self) -> list[str]:
        """Registered names: this kernel's, and the gateway's once it is started."""
        names = set(self.functions)
        if self.runtime.started:
            with contextlib.suppress(FunctionError):  # completion works with the gateway down
                names.update(run["name"] for run in self.runtime.client().list_runs())
        return sorted(names)

    def debug(self) -> Detail:
        """``%fn_debug``: the full detail of the last error."""
        error = self.last_error
        if error is None:
            return Detail("fn_debug", "no error so far")
        lines = [f"{type(error).__module__}.{type(error).__name__}: {error}"]
        if isinstance(error, FunctionError):
            lines.append(f"HTTP status: {error.status or '(none)'}   code: {error.code or '-'}")
            if error.run_uid:
                lines.append(f"run uid: {error.run_uid}")
            if error.invocation_id:
                lines.append(f"invocation id: {error.invocation_id}")
            lines += ["body:", pretty_json(error.body)]
        lines.append(f"runtime: {self.runtime.describe()}")
        return Detail(f"fn_debug: last error ({type(error).__name__})", "\n".join(lines))

    def krm_chain(self) -> Any:
        """The KRM evaluator chain (``kernel.krm.Chain``), created on first use."""
        if self._krm is None:
            from kernel.krm import Chain  # loads ruamel.yaml: only when KRM is used

            self._krm = Chain()
            self.closers.append(self._krm.close)
        return self._krm

    def cancel_in_flight(self) -> int:
        """Abort every call in flight (a kernel interrupt); how many there were."""
        return sum(cancel() for cancel in self.cancellers)

    def shutdown(self, timeout: float = 15.0) -> None:
        """Stop whatever this session started: teaching servers, then the embedded runtime."""
        while self.closers:
            self.closers.pop()()
        self.runtime.stop(timeout)
