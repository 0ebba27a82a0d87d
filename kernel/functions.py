"""A kernel's registered functions (docs/protocol.md, "Kernel"): the callables ``%%function`` binds."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from fnkernel.kernel.cellspec import Spec, owner_of
from fnkernel.kernel.connection import Runtime
from fnkernel.kernel.display import InvocationView, RegistrationCard
from fnkernel.kernel.output import LiveLines, MapBar, handler_failure, in_cell
from fnkernel.runtime_server import limits, payloads, wire
from fnkernel.runtime_server.client import Run
from fnkernel.runtime_server.client.errors import (
    FunctionNotFound,
    GatewayError,
    HandlerFailed,
    InvocationTimedOut,
    RegistrationFailed,
    RequestCancelled,
)
from fnkernel.system.waiting import wait_for

_IDLE_WAIT_SECONDS = 2.0  # after an interrupt, for the cancelled invocation to be gone


def wait_until_free(in_flight: Callable[[], bool]) -> None:
    """After an interrupt: wait (briefly) until the function's cancelled invocation is gone —
    the server kills the handler once it sees the cancel — so the next call is not refused as
    busy. `in_flight` asks the server; a GatewayError (gone, unreachable) ends the wait."""

    def free() -> bool:
        try:
            return not in_flight()
        except GatewayError:
            return True

    wait_for(free, timeout=_IDLE_WAIT_SECONDS, interval=0.005)


class NotOwned(RuntimeError):
    """An action only the kernel that registered a function may take: unregistering one bound
    with ``%use``, or a ``%%function`` cell of a name another kernel owns (docs/protocol.md,
    "Ownership")."""

    def _render_traceback_(self) -> list[str]:
        return [f"NotOwned: {self}"]


class PayloadNotSent(TypeError):
    """The payload cannot be encoded as its kind travels: one line saying why, not the
    encoder's frames."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class PayloadNotJSON(PayloadNotSent):
    """The payload cannot be encoded as JSON, naming the type and where it is."""


class PayloadNotArrow(PayloadNotSent):
    """The payload is of an Arrow kind that Arrow cannot hold, with Arrow's reason."""


class MapItemsNotGiven(TypeError):
    """``NAME.map`` given one value where it takes items (a DataFrame, whose iteration gives
    its column labels): one line saying how to give its parts, not the codec's frames."""

    def _render_traceback_(self) -> list[str]:
        return [f"TypeError: {self}"]


class BadArgument(ValueError):
    """An argument a function's call cannot take (a negative timeout): one line naming it."""

    def _render_traceback_(self) -> list[str]:
        return [f"ValueError: {self}"]


class CallMisused(TypeError):
    """A function called with arguments it does not take (two payloads; a payload and keyword
    fields): one line naming the call, as Python's own TypeError would, without our frames."""

    def _render_traceback_(self) -> list[str]:
        return [f"TypeError: {self}"]


class InvocationInterrupted(KeyboardInterrupt):
    """The kernel was interrupted during an invocation: the call was cancelled and the handler
    killed; the function stays registered. Shown as one line, not a stack."""

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


class RegistrationInterrupted(KeyboardInterrupt):
    """The kernel was interrupted while a ``%%function`` cell registered: the half-made Run was
    deleted. Shown as one line."""

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


class Status(Run):
    """``NAME.status()``: the Run with its live registration (a typed view that is still the
    gateway's JSON), shown as a registration card."""

    spec: Spec | None = None  # the cell it was registered from: its load failure in cell lines

    def card(self) -> RegistrationCard:
        card = RegistrationCard.from_run(self)
        if self.spec is not None and self.spec.source and card.message:
            card.message = in_cell(card.message, self.spec)
        return card

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
        *,
        owner: str = "",
        run_uid: str = "",
    ) -> None:
        """`owner`: this kernel's identity when it registered the function (``%%function``);
        "" for a function bound with ``%use``, which this kernel never deletes. `run_uid`: the
        Run it registered, the only one its calls go to (docs/protocol.md, "Ownership")."""
        self._runtime = runtime
        self._on_unregister = on_unregister
        self.owner = owner
        self.run_uid = run_uid if owner else ""
        self.spec = spec
        self.timeout = timeout  # seconds; the default for each invocation (--timeout)
        self.__name__ = spec.name
        self.__doc__ = f"The {spec.runtime} function {spec.name} ({spec.handler})."

    @property
    def owned(self) -> bool:
        return bool(self.owner)

    @property
    def name(self) -> str:
        return self.spec.name

    def __call__(self, *given: Any, **fields: Any) -> Any:
        """The decoded output of one call with `payload`, or with the keyword arguments as
        the event's fields (``etl(x=1)`` sends ``{"x": 1}``); ``etl()`` sends null."""
        if len(given) > 1:
            raise CallMisused(
                f"{self.name}() takes one payload, got {len(given)}: send several in one "
                f"list or object ({self.name}([a, b])), or call it once per item with "
                f"{self.name}.map(items)"
            )
        payload = given[0] if given else None
        if fields:
            if payload is not None:
                limit = (  # etl(x, timeout=5): the call's limit, which a call's fields are not
                    f"; a call's time limit is {self.name}.invoke(payload, timeout=S)"
                    if "timeout" in fields
                    else ""
                )
                raise CallMisused(
                    f"{self.name}() takes a payload or keyword fields, not both: "
                    f"{self.name}({{**payload, **fields}}) sends one object{limit}"
                )
            payload = fields
        return self.invoke(payload).output

    # What NAME? and a signature's tooltip show: one payload, or keyword fields.
    __call__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY),
            inspect.Parameter("payload", inspect.Parameter.POSITIONAL_ONLY, default=None),
            inspect.Parameter("fields", inspect.Parameter.VAR_KEYWORD),
        ]
    )

    def _not_sent(self, exc: TypeError | ValueError) -> PayloadNotSent:
        """A payload (or a map's item, which the message then names) that cannot be encoded
        as its kind travels, in one line."""
        if isinstance(exc, payloads.PayloadError):
            return PayloadNotJSON(f"the payload of {self.name} cannot be sent: {exc}")
        if isinstance(exc, payloads.NotArrow):
            return PayloadNotArrow(f"the payload of {self.name} cannot be sent: {exc}")
        return PayloadNotJSON(f"the payload of {self.name} is not JSON: {exc}")

    def invoke(
        self,
        payload: Any = None,
        timeout: float | None = None,
        invocation_id: str | None = None,
    ) -> InvocationView:
        """Invoke with `payload`, encoded by its kind (docs/protocol.md, "Content types": a
        DataFrame, table or array as Arrow IPC, bytes as octets, the rest as JSON); `timeout`
        in seconds overrides ``--timeout``."""
        timeout = self.timeout if timeout is None else timeout
        millis = self._millis(timeout, "invoke")
        try:
            # An Arrow kind as its table, which the client writes straight to the stack's spool
            # (docs/protocol.md, "Large payloads"): never whole in memory as bytes first.
            outgoing = payloads.Outgoing.of(payload, "payload")
        except (TypeError, ValueError) as exc:
            raise self._not_sent(exc) from None
        except KeyboardInterrupt:
            raise InvocationInterrupted(
                f"{self.name} was not called: interrupted while its payload was converted"
            ) from None
        client = self._runtime.client()
        invocation_id = invocation_id or limits.new_id("inv_")
        lines = LiveLines(self.spec.runtime)
        try:
            result = client.invoke(
                self.name,
                outgoing,
                timeout_millis=millis,
                invocation_id=invocation_id,
                on_log=lines,
                run_uid=self.run_uid,
            )
        except HandlerFailed as failed:
            lines.fail()
            raise handler_failure(failed, self.spec) from None
        except FunctionNotFound as missing:
            lines.release()
            raise self._replaced() or missing from None
        except InvocationTimedOut as exc:
            lines.release()
            raise self._timed_out(exc, timeout) from None
        except (RequestCancelled, KeyboardInterrupt) as stopped:
            # The kernel was interrupted: FnKernel cancels the request from its control thread
            # (RequestCancelled); a stock ipykernel's SIGINT lands here as KeyboardInterrupt,
            # inside the HTTP read, so the request is cancelled now. Either way the gateway
            # cancels the call and the handler is killed; the function stays registered. Wait
            # (briefly) until it is free again, so the next cell's call is not refused as busy.
            # Interrupted as its large payload was written, it was never sent; as its large
            # result was read, the call was over: nothing was killed either way.
            unsent, answered = (
                getattr(stopped, "unsent", False),
                getattr(stopped, "answered", False),
            )
            if unsent or answered:
                lines.release()
                raise InvocationInterrupted(
                    f"{self.name} was not called: interrupted while its payload was written"
                    if unsent
                    else f"invocation of {self.name} interrupted while its result was read: the "
                    f"handler had returned; {self.name} stays registered"
                ) from None
            self._runtime.cancel()
            with self._runtime.trace.bookkeeping():
                wait_until_free(self._in_flight)
                if not lines.shown:  # it was cut off before it was followed
                    self._show_cut_off(invocation_id, lines)
            lines.release()
            raise InvocationInterrupted(
                f"invocation of {self.name} cancelled; the handler was killed and "
                f"{self.name} stays registered"
            ) from None
        lines.release()
        return InvocationView(self.name, result)

    def _show_cut_off(self, invocation_id: str, lines: LiveLines) -> None:
        """What an interrupted call printed, from its server (docs/protocol.md, "Live output":
        the last invocation's lines)."""
        try:
            for record in self._runtime.client().follow_logs(
                self.name, invocation_id, follow=False
            ):
                if "stream" in record:
                    lines(record)
        except GatewayError:
            pass  # gone with its registration: nothing to show

    def map(
        self,
        items: Iterable[Any],
        concurrency: int | None = None,
        return_exceptions: bool = False,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call the function once per item, up to `concurrency` at a time (default and at
        most: its replicas; an item waits while another caller holds every replica), and
        return the outputs in input order, with a progress bar while it runs. The first
        failure is raised once the calls still running are cancelled, naming its item; with
        `return_exceptions`, every failure is returned in its item's place, as the raise would
        give it. An interrupt cancels every call in flight; the function stays registered."""
        from IPython.display import display  # the kernel's; imported when a map runs

        try:
            work = payloads.items_of(items)
        except TypeError as exc:
            raise MapItemsNotGiven(f"{self.name}.{exc}") from None
        timeout = self.timeout if timeout is None else timeout
        millis = self._millis(timeout, "map")
        client = self._runtime.client()
        # One map, one version: a function bound with %use follows its name from one call to
        # the next, and a map calls the Run it began on (docs/protocol.md, "Ownership").
        with self._runtime.trace.bookkeeping():
            run_uid = self.run_uid or (client.status(self.name).uid if work else "")
        bar = MapBar(self.name, len(work), display)
        printers: dict[int, LiveLines] = {}

        def on_log(index: int, line: dict[str, str]) -> None:
            printer = printers.get(index)
            if printer is None:
                printer = printers[index] = LiveLines(self.spec.runtime, f"[{index}] ")
            printer(line)

        forget = self._runtime.on_stop(lambda: bar.end(cancelled=True))  # a restart mid-map
        try:
            results = client.map(
                self.name, work, concurrency=concurrency,
                return_exceptions=return_exceptions,
                timeout_millis=millis, progress=bar.progress,
                on_log=on_log, run_uid=run_uid,
            )  # fmt: skip
        except HandlerFailed as failed:
            for printer in printers.values():
                printer.fail()
            bar.end(failed=1, cancelled=True)
            self._wait_replicas_free()  # the calls still running were cancelled
            raise handler_failure(failed, self.spec) from None
        except InvocationTimedOut as exc:
            for printer in printers.values():
                printer.release()
            bar.end(failed=1, cancelled=True)
            self._wait_replicas_free()  # the calls still running were cancelled
            raise self._timed_out(exc, timeout, "map(items") from None
        except (RequestCancelled, KeyboardInterrupt):
            for printer in printers.values():
                printer.release()
            bar.end(cancelled=True)
            self._wait_replicas_free()
            raise InvocationInterrupted(
                f"map of {self.name} cancelled; every call in flight was cancelled and "
                f"{self.name} stays registered"
            ) from None
        except GatewayError as failed:  # the platform's (busy past its timeout, unavailable)
            bar.end(failed=1, cancelled=True)
            if isinstance(failed, FunctionNotFound):
                raise self._replaced() or failed from None
            raise
        except (TypeError, ValueError) as unsent:
            if getattr(unsent, "item", None) is None:  # not an item's: a failure of ours
                bar.end(failed=1, cancelled=True)
                raise
            for printer in printers.values():
                printer.release()
            bar.end(failed=1, cancelled=True)
            self._wait_replicas_free()  # the calls still running were cancelled
            raise self._not_sent(unsent) from None
        except BaseException:  # whatever else stopped it: its bar ends all the same
            bar.end(cancelled=True)
            raise
        finally:
            forget()
        for index, printer in printers.items():
            if isinstance(results[index], BaseException):
                printer.fail()
            else:
                printer.release()
        results = [self._as_raised(result) for result in results]
        bar.end(failed=sum(isinstance(result, BaseException) for result in results))
        return results

    def _as_raised(self, result: Any) -> Any:
        """A map's result in its item's place (``return_exceptions``): a failure as a call of
        that item would have raised it."""
        if isinstance(result, HandlerFailed):
            return handler_failure(result, self.spec)
        if isinstance(result, TypeError | ValueError) and getattr(result, "item", None):
            return self._not_sent(result)
        return result

    def _millis(self, timeout: float | None, call: str) -> int:
        """`timeout` (seconds; None or 0: the function's own) in milliseconds; a negative one,
        or one that is not a number, is a one-line error naming the call."""
        if timeout is None or timeout == 0:
            return 0
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise BadArgument(
                f"{self.name}.{call}: timeout must be seconds above 0 (or None, for "
                f"--timeout's), got {timeout!r}"
            )
        return max(1, round(timeout * 1000))

    def _replaced(self) -> NotOwned | RegistrationFailed | None:
        """After FunctionNotFound, what replaced the Run this function calls: NotOwned if the
        name is another's Run now (this kernel's was deleted, and another made it again since),
        which its calls never reach; RegistrationFailed if it is this kernel's, Failed (its
        cell ran again, edited, and did not register: the version before was unregistered)."""
        if not self.run_uid:
            return None
        with contextlib.suppress(GatewayError), self._runtime.trace.bookkeeping():
            run = self._runtime.client().status(self.name)
            owner = owner_of(run.source)
            if owner != self.owner:
                return NotOwned(
                    f"{self.name} is no longer this kernel's: it was deleted, and made again "
                    f"since, owned by {owner}; not called (%use {self.name} calls theirs)"
                )
            if run.failed:
                return RegistrationFailed(
                    f"{self.name} did not register when its cell last ran, and the version "
                    f"before was unregistered: {in_cell(run.message, self.spec)}; not called "
                    "(fix the cell and run it again)",
                    code="Failed", run_uid=run.uid,
                )  # fmt: skip
        return None

    def _wait_replicas_free(self) -> None:
        """After a map's calls were cancelled: as after one call, wait (briefly) until every
        replica's server has let go of its cancelled call, so the next cell's calls are not
        refused as busy."""
        with self._runtime.trace.bookkeeping():
            for name in self._replica_names():
                wait_until_free(lambda name=name: self._in_flight(name))  # type: ignore[misc]

    def _timed_out(
        self, exc: InvocationTimedOut, timeout: float | None, call: str = "invoke(payload"
    ) -> InvocationTimedOut:
        """The deadline as a user can act on it: how long it was, and how to give more (what
        the handler printed until then is the cell's output already: LiveLines). `call`: the
        method it came from and its first argument, as the way to give more names it."""
        if exc.message.startswith(wire.NO_ANSWER):  # a hop's silence, not the handler's time
            return exc
        seconds = timeout or limits.DEFAULT_TIMEOUT_MILLIS / 1000
        timed_out = InvocationTimedOut(
            f"{self.name} timed out after {seconds:g} s; give it more with %%function "
            f"{self.name} --timeout S or {self.name}.{call}, timeout=S)",
            code=exc.code, status=exc.status, run_uid=exc.run_uid,
            invocation_id=exc.invocation_id, detail=exc.detail,
        )  # fmt: skip
        timed_out.item = exc.item
        return timed_out

    def _in_flight(self, name: str | None = None) -> bool:
        """Whether the server holds a call of the function (or of its replica `name`)."""
        live = self._runtime.client().status(name or self.name).live
        return live is not None and bool(live.in_flight)

    def _replica_names(self) -> list[str]:
        """The Runs serving the function, as the gateway names them ("Replicas")."""
        try:
            replicas = self._runtime.client().status(self.name).get("replicas")
        except GatewayError:
            return [self.name]
        return [str(r["name"]) for r in replicas] if replicas else [self.name]

    def status(self) -> Status:
        status = Status(self._runtime.client().status(self.name))
        status.spec = self.spec
        return status

    def unregister(self, cancel: bool = False, drain_timeout: float | None = None) -> None:
        """Unregister and delete the function: let the in-flight invocation finish (at most
        `drain_timeout` seconds), or `cancel` it. Not a function bound with ``%use``: it is
        another's (NotOwned)."""
        if not self.owned:
            raise NotOwned(
                f"{self.name} was bound with %use: this kernel does not own it, and leaves it "
                f"registered; delete it where it was created (or: fnkernel runs delete {self.name})"
            )
        client = self._runtime.client()
        try:
            owner = owner_of(client.status(self.name).source)
        except FunctionNotFound:  # gone already (unregistered before, deleted elsewhere):
            # as the protocol's unregister of an absent registration, that succeeds.
            if self._on_unregister is not None:
                self._on_unregister(self)
            return
        if owner != self.owner:  # deleted since, and made again by another
            raise NotOwned(
                f"{self.name} is no longer this kernel's: it was made again, owned by {owner}; "
                f"this kernel leaves it registered (delete it there, or: fnkernel runs delete "
                f"{self.name})"
            )
        client.delete_run(
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
        if self.spec.env:  # keys only: what NAME? shows may be saved with the notebook
            lines.append("env: " + ", ".join(sorted(self.spec.env)))
        if self.spec.secrets:  # names only (docs/protocol.md, "Secrets")
            lines.append("secrets: " + ", ".join(self.spec.secrets))
        if self.spec.requirements:
            lines.append("requirements: " + ", ".join(self.spec.requirements))
        if self.spec.files:
            lines.append("includes: " + ", ".join(sorted(self.spec.files)))
        lines += ["", f"--- {self.spec.filename} ---", self.spec.source.rstrip()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<{self.spec.runtime} function {self.name} ({self.spec.handler})>"
