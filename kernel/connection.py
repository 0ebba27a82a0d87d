"""Where a kernel's functions run (docs/protocol.md, "Kernel"): the gateway at ``$FNKERNEL_RUNTIME``, or an embedded
stack started on first use.

The embedded stack is the control plane (docs/protocol.md, "Runs") (in the gateway process) plus one Runtime Pod per
runtime actually used, as child processes on Unix sockets in a private 0700 directory. It is
started by the first magic that needs it, never at kernel start (the kernel's first kernel_info
reply only starts the waiting processes it then takes: docs/architecture.md, "The first
registration"); the children get SIGTERM if the
kernel dies, and their own session, so a kernel interrupt (``killpg``) does not reach them.
Nothing here imports grpc: the kernel speaks HTTP to the gateway with the stdlib client.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from fnkernel.kernel.trace import NO_BODY, KernelSpan, Shown, Trace, decode_payload
from fnkernel.runtime_server import limits, wire
from fnkernel.runtime_server.client import Client, spans_of
from fnkernel.runtime_server.client.errors import GatewayError, GatewayUnreachable, Unauthorized
from fnkernel.runtime_server.client.files import FileBody, Sink
from fnkernel.runtime_server.client.transport import check_address
from fnkernel.runtime_server.client.views import Run
from fnkernel.runtime_server.errors import InvalidField
from fnkernel.runtime_server.tokens import TOKEN_ENV

if TYPE_CHECKING:
    from fnkernel.runtime_server.daemon import Prewarmed
    from fnkernel.runtime_server.lifecycle.stack import Stack

RUNTIME_ENV = "FNKERNEL_RUNTIME"
PREWARM_ENV = "FNKERNEL_PREWARM"  # "0": start the embedded stack's processes only when needed
# The largest payload or result of the embedded runtime, in bytes: its gateway's and servers'
# --max-payload-bytes (docs/protocol.md, "Large payloads"); 2 GiB when it is not set.
MAX_PAYLOAD_ENV = "FNKERNEL_MAX_PAYLOAD_BYTES"
PROBE_SECONDS = 5  # %fn_connect's look at its gateway: connecting and its answer


class TracedClient(Client):
    """The gateway client, recording each request in the kernel's trace."""

    def __init__(self, address: str, trace: Trace) -> None:
        super().__init__(address)
        self.trace = trace

    def _direct_allowed(self) -> bool:
        return not self.trace.on  # %fn_trace shows the gateway's requests, each in its turn

    def _map_client(self) -> Client:
        """A map's own client, its calls recorded in the same trace (docs/protocol.md,
        "Tracing": every invocation the kernel makes)."""
        sibling = TracedClient(self.address, self.trace)
        sibling.token, sibling.timeout = self.token, self.timeout
        sibling._token_found = self._token_found
        sibling._spool, sibling._max_payload = self._spool, self._max_payload
        sibling.bound_why = self.bound_why
        return sibling

    def request(
        self,
        method: str,
        path: str,
        body: bytes | FileBody | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        wait: float = 0,
        into: Sink | None = None,
    ) -> Any:
        if not self.trace.on:
            return super().request(method, path, body, headers, wait=wait, into=into)
        started = time.perf_counter()
        request: Any = NO_BODY
        if isinstance(body, FileBody):  # read as it is sent: not held to be shown
            request = Shown(f"({body.size} bytes from a file)")
        elif body:
            request = decode_payload(body, (headers or {}).get("Content-Type", ""))
        span = None
        if method == "POST" and path.endswith(":invoke"):  # traced (docs/protocol.md, "Tracing")
            invocation_id = (headers or {}).get(wire.INVOCATION_ID_HEADER, "")
            attributes = {"http.request.method": "POST", "url.path": path}
            span = KernelSpan("POST /v1/runs/{name}:invoke", attributes, invocation_id)
            headers = {**(headers or {}), wire.TRACEPARENT_HEADER: span.traceparent}
        try:
            result = super().request(method, path, body, headers, wait=wait, into=into)
        except GatewayError as exc:
            status = f"{exc.status} {exc.code}".strip() if exc.status else exc.code or "failed"
            traced = span.ended(_http_status(exc.status, exc.code), exc.spans) if span else {}
            self.trace.record(f"{method} {path}", request, status, _ms(started), **traced)
            raise
        except BaseException:
            self.trace.record(f"{method} {path}", request, "interrupted", _ms(started))
            raise
        traced = span.ended(_http_status(result[0]), spans_of(result[1])) if span else {}
        status = str(result[0])
        if method == "POST" and path == "/v1/runs" and Run(json.loads(result[2])).failed:
            status += " (Run Failed)"  # created, and failed to register: not a success
        self.trace.record(f"{method} {path}", request, status, _ms(started), **traced)
        return result

    def _records(self, connection: Any, path: str) -> Iterator[dict[str, Any]]:
        """A log stream (docs/protocol.md, "Live output"), recorded once it ends, its latency
        the stream's whole length."""
        if not self.trace.on:
            yield from super()._records(connection, path)
            return
        started, status = time.perf_counter(), "200"
        try:
            yield from super()._records(connection, path)
        except GatewayError as exc:
            status = f"{exc.status} {exc.code}".strip() if exc.status else exc.code or "failed"
            raise
        except BaseException:
            status = "interrupted"
            raise
        finally:
            self.trace.record(f"GET {path}", NO_BODY, status, _ms(started))


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def _http_status(status: int, code: str = "") -> tuple[dict[str, Any], str]:
    """A traced call's answer as its span records it: the status attribute, and the failure —
    for a call that had no answer (cancelled by an interrupt, the gateway unreachable), its
    code, as ``%fn_trace show`` names it, and no status."""
    if not status:
        return {}, code or "no answer"
    return {"http.response.status_code": status}, f"HTTP {status}" if status >= 400 else ""


class StackChosen(Exception):
    """``$FNKERNEL_RUNTIME`` names another stack than the one this kernel chose at its first
    function (a cell's ``%env`` after it): a function is not registered where it was not
    meant to be. Shown as one line."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class StackMisconfigured(StackChosen):
    """The stack cannot be had as the environment names it (a ``$FNKERNEL_RUNTIME`` that is
    no address a client can call, a ``$FNKERNEL_MAX_PAYLOAD_BYTES`` that is no number of
    bytes): nothing is started. Shown as one line."""


class Runtime:
    """The kernel's connection to a gateway; embedded unless `address` or $FNKERNEL_RUNTIME."""

    def __init__(self, address: str | None = None, trace: Trace | None = None) -> None:
        self.address = address or os.environ.get(RUNTIME_ENV) or ""
        self.trace = trace or Trace()
        self._client: TracedClient | None = None
        self._stack: Stack | None = None
        self._prewarmed: Prewarmed | None = None
        self._lock = threading.RLock()
        self._on_stop: list[Callable[[], None]] = []
        self._wanted_at_choice = ""  # $FNKERNEL_RUNTIME when the stack was chosen

    @property
    def started(self) -> bool:
        return self._client is not None

    @property
    def empty(self) -> bool:
        """Its stack would be an embedded runtime not started yet: it holds no function, and
        asking it would start it (and tie this kernel to it)."""
        return self._client is None and not (self.address or os.environ.get(RUNTIME_ENV))

    @property
    def embedded(self) -> bool:
        """Its stack is the embedded runtime, which ends with this kernel."""
        return self._stack is not None

    def connect(self, address: str, *, unused: bool = False) -> None:
        """Use the gateway at `address` (``%fn_connect``): ValueError if it is no address a
        client can call, or once a stack is in use — but for another gateway this kernel has
        `unused` (no function registered or bound there: a mistyped address, say)."""
        check_address(address)
        with self._lock:
            if self._client is not None and self.address != address:
                if not unused or self._stack is not None:
                    raise ValueError(
                        f"this kernel already uses the {self.describe()}; restart the kernel "
                        "to use another stack"
                    )
                client, self._client = self._client, None
                client.close()
            self.address = address
            self._drop_prewarmed()

    @staticmethod
    def unanswered(address: str) -> str:
        """What keeps the gateway at `address` from taking this kernel's functions now, with
        what to do — nothing answers there, or it refuses this kernel's token — or "" if
        nothing does. Asked once, at ``%fn_connect``: a mistyped port is told there, not at
        the first function."""
        probe = Client(address, timeout=PROBE_SECONDS)
        try:
            probe.list_runs()
        except GatewayUnreachable as exc:
            return (
                f"nothing answers there now ({exc}): start it before the first %%function, "
                "or %fn_connect the right URL"
            )
        except Unauthorized as exc:
            return (
                f"it refuses this kernel's token ({exc}): %env {TOKEN_ENV}=... (its token) "
                "before the first %%function"
            )
        except GatewayError as exc:
            if not exc.code:  # not the JSON every answer of a gateway's is
                return f"{exc}: %fn_connect the gateway's URL (fnkernel up prints it)"
        except (ValueError, KeyError, TypeError):  # a 200 that is no gateway's list of Runs
            return (
                "what answers there is not an fnkernel gateway: %fn_connect the gateway's URL "
                "(fnkernel up prints it)"
            )
        finally:
            probe.close()
        return ""

    def _drop_prewarmed(self) -> None:
        """The kernel uses a stack of its own choosing: the embedded stack's waiting processes
        will never serve it, so they end now rather than idle until the kernel does."""
        prewarmed, self._prewarmed = self._prewarmed, None
        if prewarmed is not None:
            prewarmed.close()

    def client(
        self, runtime: str | None = None, progress: Callable[[str], None] | None = None
    ) -> TracedClient:
        """The gateway client; starts the embedded stack, and a pod of `runtime`, if needed.
        The stack is chosen now, from the environment as it is now (a cell's ``%env
        FNKERNEL_RUNTIME=...`` before the first function counts)."""
        with self._lock:
            wanted = os.environ.get(RUNTIME_ENV) or ""
            if (
                runtime is not None
                and self._client is not None
                and wanted not in ("", self.address, self._wanted_at_choice)
            ):
                # A function about to register where the user no longer means it to.
                raise StackChosen(
                    f"{RUNTIME_ENV} is {wanted}, but this kernel already uses the "
                    f"{self.describe()}: the stack is chosen at the first function; restart the "
                    "kernel to use another"
                )
            if self._client is None:
                if not self.address:
                    self.address = wanted
                if not self.address:
                    if progress:
                        progress("starting the embedded runtime")
                    self._start_embedded()
                else:
                    self._drop_prewarmed()
                try:  # %fn_connect checks its own: the environment's
                    check_address(self.address)
                except ValueError as exc:
                    raise StackMisconfigured(f"{RUNTIME_ENV}: {exc}") from None
                try:
                    self._client = TracedClient(self.address, self.trace)
                except ValueError as exc:  # $FNKERNEL_TOKEN's, which the message names
                    raise StackMisconfigured(str(exc)) from None
                # A payload past the bound names the one knob that sets it for this kernel.
                self._client.bound_why = (
                    f" ({MAX_PAYLOAD_ENV}, read as this kernel starts its runtime: set it, then "
                    "restart the kernel)"
                    if self._stack is not None
                    else " (the gateway's --max-payload-bytes)"
                )
                self._wanted_at_choice = wanted  # a later change of it is the user's
            if runtime is not None and self._stack is not None and runtime not in self.pods():
                if progress:
                    progress(f"starting a {runtime} Runtime Pod")
                self._stack.add_pod(runtime)
            return self._client

    def prewarm(self) -> None:
        """Start the embedded stack's processes ahead of the first ``%%function``: they import
        what they need and wait (docs/architecture.md, "The first registration"). Nothing to
        do for an external gateway, or once started."""
        with self._lock:
            if self.address or self._prewarmed is not None or os.environ.get(PREWARM_ENV) == "0":
                return
            from fnkernel.runtime_server.daemon import Prewarmed

            self._prewarmed = Prewarmed()

    def wait_prewarmed(self, timeout: float) -> bool:
        """Whether the waiting processes have imported what they need (waits up to `timeout`)."""
        prewarmed = self._prewarmed
        return prewarmed is not None and prewarmed.wait_ready(timeout)

    def pods(self) -> dict[str, int]:
        return dict(self._stack.pods) if self._stack is not None else {}

    def _start_embedded(self) -> None:
        from fnkernel.runtime_server.lifecycle.secrets import SECRETS_DIR
        from fnkernel.runtime_server.lifecycle.stack import (
            Stack,  # only now: plain cells never pay for it
        )
        from fnkernel.runtime_server.lifecycle.topology import PACKAGES_DIR, default_state_dir
        from fnkernel.system.private import private_tempdir, sweep

        bound = os.environ.get(MAX_PAYLOAD_ENV, "")
        try:
            max_payload = (
                limits.parse_byte_bound(bound, MAX_PAYLOAD_ENV)
                if bound
                else limits.DEFAULT_MAX_SPOOLED_BYTES
            )
        except InvalidField as bad:
            raise StackMisconfigured(
                f"{bad} (bytes; unset, {limits.DEFAULT_MAX_SPOOLED_BYTES}): the embedded "
                "runtime was not started"
            ) from None
        sweep("kernel")  # what a SIGKILLed kernel left behind
        state_dir = private_tempdir("kernel")
        stack = Stack(
            state_dir,
            {},
            gateway_listen=f"unix:{state_dir / 'gateway.sock'}",
            poll_interval=1.0,
            prewarmed=self._prewarmed,
            # The user's secrets, which outlive this kernel (docs/protocol.md, "Secrets"), and
            # the machine's installed requirements, which every kernel's Runs share
            # ("Requirements"): not installed again by each kernel.
            secrets_dir=default_state_dir() / SECRETS_DIR,
            packages_dir=default_state_dir() / PACKAGES_DIR,
            max_payload_bytes=max_payload,
        )
        try:
            stack.start()
        except BaseException:
            shutil.rmtree(state_dir, ignore_errors=True)
            raise
        self._stack = stack
        self.address = stack.gateway_address

    def cancel(self) -> int:
        """Abort the requests in flight (an interrupt); how many there were."""
        client = self._client
        return client.cancel() if client is not None else 0

    def where(self) -> str:
        """The stack, briefly, as a registration card names it."""
        if self._stack is not None:
            return "embedded runtime (ends with this kernel)"
        return f"gateway {self.address}" if self.address else ""

    def describe(self) -> str:
        if self._stack is not None:
            pods = ", ".join(f"{runtime}={count}" for runtime, count in self.pods().items())
            return f"embedded runtime at {self.address} (pods: {pods or 'none yet'})"
        if self.address:
            return f"gateway at {self.address}"
        return "embedded runtime (not started: it starts with the first %%function)"

    def on_stop(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` when the kernel stops using its stack (its shutdown, a restart);
        returns what forgets it again."""
        self._on_stop.append(callback)
        return lambda: self._on_stop.remove(callback) if callback in self._on_stop else None

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the embedded stack (nothing to do for an external gateway)."""
        for callback in list(self._on_stop):
            callback()
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
            stack, self._stack = self._stack, None
            prewarmed, self._prewarmed = self._prewarmed, None
            if prewarmed is not None:
                prewarmed.close()
            if stack is not None:
                self.address = ""
                stack.stop(timeout)
                shutil.rmtree(stack.state_dir, ignore_errors=True)
