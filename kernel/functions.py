"""A kernel's registered functions (docs/protocol.md, "Kernel"): the callables ``%%function`` binds."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kernel.connection import Runtime
from kernel.display import InvocationView, RegistrationCard
from runtime_server.client import Run
from runtime_server.client.errors import GatewayError, RequestCancelled

EXTENSIONS = {"python": "py", "bash": "sh"}
ORIGIN_PREFIX = "%%function cell "  # a Run's spec.source when a cell created it
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


class Status(Run):
    """``NAME.status()``: the Run with its live registration (a typed view that is still the
    gateway's JSON), shown as a registration card."""

    def card(self) -> RegistrationCard:
        return RegistrationCard.from_run(self)

    def __repr__(self) -> str:
        text = repr(self.card())
        if self.live is not None:
            text += f"\n  in flight: {self.live.in_flight}"
        return text

    def _repr_html_(self) -> str:
        return self.card()._repr_html_()


class Function:
    """A registered function: ``NAME(payload)`` returns the decoded output."""

    def __init__(
        self,
        runtime: Runtime,
        spec: Spec,
        timeout: float | None = None,
        on_unregister: Callable[[Function], None] | None = None,
    ) -> None:
        self._runtime = runtime
        self._on_unregister = on_unregister
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
    ) -> InvocationView:
        """Invoke with `payload` (JSON-encoded); `timeout` in seconds overrides ``--timeout``."""
        timeout = self.timeout if timeout is None else timeout
        client = self._runtime.client()
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
        return InvocationView(self.name, result)

    def _wait_until_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                live = self._runtime.client().status(self.name).live
            except GatewayError:
                return
            if live is None or not live.in_flight:
                return
            time.sleep(0.005)

    def status(self) -> Status:
        return Status(self._runtime.client().status(self.name))

    def unregister(self, cancel: bool = False, drain_timeout: float | None = None) -> None:
        """Unregister and delete the function: let the in-flight invocation finish (at most
        `drain_timeout` seconds), or `cancel` it."""
        self._runtime.client().delete_run(
            self.name,
            cancel_in_flight=cancel,
            drain_timeout_millis=round(drain_timeout * 1000) if drain_timeout else 0,
        )
        if self._on_unregister is not None:
            self._on_unregister(self)

    def getdoc(self) -> str:
        """What ``NAME?`` shows: runtime, handler, status and the handler source."""
        lines = [
            f"{self.spec.runtime} function {self.name!r}, handler {self.spec.handler}",
        ]
        try:
            lines.append(repr(self.status()))
        except GatewayError as exc:
            lines.append(f"status unavailable: {type(exc).__name__}: {exc}")
        if self.spec.env:
            lines.append("env: " + ", ".join(f"{k}={v}" for k, v in self.spec.env.items()))
        lines += ["", f"--- {self.spec.filename} ---", self.spec.source.rstrip()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<{self.spec.runtime} function {self.name} ({self.spec.handler})>"
