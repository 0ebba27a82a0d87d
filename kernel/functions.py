"""A kernel's registered functions (docs/protocol.md, "Kernel"): the callables ``%%function`` binds."""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import json
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fnkernel.adapters.runtimes import RUNTIMES
from fnkernel.kernel import include
from fnkernel.kernel.connection import Runtime
from fnkernel.kernel.display import InvocationView, MapProgress, RegistrationCard
from fnkernel.runtime_server import jsoncodec, limits
from fnkernel.runtime_server.client import Run
from fnkernel.runtime_server.client.errors import (
    GatewayError,
    HandlerFailed,
    InvocationTimedOut,
    RequestCancelled,
)

ORIGIN_PREFIX = "%%function cell "  # a Run's spec.source when a cell created it
_OWNER_MARK = " by "  # then the kernel that owns it: ORIGIN_PREFIX + fingerprint + this + owner
_IDLE_WAIT_SECONDS = 2.0  # after an interrupt, for the cancelled invocation to be gone
_PROGRESS_SECONDS = 0.5  # a map's bar is updated at most this often (and at the end)


def wait_until_free(in_flight: Callable[[], bool]) -> None:
    """After an interrupt: wait (briefly) until the function's cancelled invocation is gone —
    the server kills the handler once it sees the cancel — so the next call is not refused as
    busy. `in_flight` asks the server; a GatewayError (gone, unreachable) ends the wait."""
    deadline = time.monotonic() + _IDLE_WAIT_SECONDS
    while time.monotonic() < deadline:
        try:
            if not in_flight():
                return
        except GatewayError:
            return
        time.sleep(0.005)


@dataclass(frozen=True)
class Spec:
    """What a ``%%function`` cell asks for; equal specs are the same function."""

    name: str
    runtime: str
    handler: str
    source: str
    env: Mapping[str, str] = field(default_factory=dict)
    # What --include ships beside the cell's file: {relative path: text} (kernel/include.py).
    files: Mapping[str, str] = field(default_factory=dict)
    idle_timeout: int = 0
    memory: int = 0  # MiB (0: the default)
    replicas: int = 1  # Runs serving the function (docs/protocol.md, "Replicas")

    @property
    def filename(self) -> str:
        return f"{self.name}.{RUNTIMES[self.runtime].extension}"

    @property
    def all_files(self) -> dict[str, str]:
        """The Run's files: the included ones and the cell's own."""
        return {**self.files, self.filename: self.source}

    @property
    def fingerprint(self) -> str:
        canonical = {
            "files": self.all_files,
            "handler": self.handler,
            "env": dict(self.env),
            "runtime": self.runtime,
            "idleTimeoutSeconds": self.idle_timeout,
        }
        if self.memory:  # only then: a cell without --memory keeps the fingerprint it had
            canonical["memoryMb"] = self.memory
        if self.replicas != 1:
            canonical["replicas"] = self.replicas
        text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()

    def origin(self, owner: str) -> str:
        """The Run's ``spec.source`` when the kernel `owner` registers this spec."""
        return f"{ORIGIN_PREFIX}{self.fingerprint}{_OWNER_MARK}{owner}"


def owner_of(source: str) -> str:
    """Who owns the Run whose ``spec.source`` is `source`, as a refusal names it: the kernel
    that registered it from a cell, else what created it (docs/protocol.md, "Ownership")."""
    if source.startswith(ORIGIN_PREFIX):
        _, mark, owner = source.partition(_OWNER_MARK)
        return owner if mark else "a kernel of an earlier fnkernel"
    return f"its creator ({source})" if source else "its creator (the CLI or the HTTP API)"


def cell_line(file_line: int) -> int:
    """A line of the handler file as a line of its cell: the ``%%function`` line comes first."""
    return file_line + 1


class LiveLines:
    """A call's log lines as the cell's output, each as it comes (``Client.invoke(on_log=)``,
    docs/protocol.md, "Live output"): on the stream it was written to, after `mark` (a map's
    item). What the worker logs from a traceback's first line on is held back: a failure shows
    its traceback itself, told against the cell (``fail``); a call that succeeds prints it
    after all (``release``)."""

    _FLUSH_SECONDS = 0.01  # a flush waits for ipykernel's IO thread: at most this often

    def __init__(self, runtime: str, mark: str = "") -> None:
        traceback = RUNTIMES[runtime].traceback
        self._runtime = runtime
        self._start = traceback.start if traceback is not None else None
        self._mark = mark
        self._streams = {"stdout": sys.stdout, "stderr": sys.stderr}  # this cell's
        self._held: list[dict[str, str]] = []
        self._flushed = 0.0
        self.shown = 0

    def __call__(self, line: dict[str, str]) -> None:
        if self._held or (line.get("stream") == "stderr" and line.get("text") == self._start):
            self._held.append(line)
            return
        self._print(line)
        now = time.monotonic()
        if now - self._flushed >= self._FLUSH_SECONDS:  # else ipykernel's own flush, soon
            self._flushed = now
            self._flush()

    def _print(self, line: dict[str, str]) -> None:
        stream = self._streams["stderr" if line.get("stream") == "stderr" else "stdout"]
        stream.write(f"{self._mark}{line.get('text', '')}\n")  # one write: threads interleave
        self.shown += 1

    def _flush(self) -> None:
        for stream in self._streams.values():
            stream.flush()

    def release(self) -> None:
        """The call succeeded: what was held back was the handler's own."""
        held, self._held = self._held, []
        for line in held:
            self._print(line)
        if held or self.shown:
            self._flush()

    def fail(self) -> None:
        """The call failed: print what was held back before its (last) traceback."""
        self._held = split_traceback(self._held, self._runtime)[0]
        self.release()


def split_traceback(
    logs: list[dict[str, str]], runtime: str
) -> tuple[list[dict[str, str]], list[str]]:
    """The handler's own log lines, and the traceback the worker logged after them (if any, and
    if the runtime's worker logs one: adapters/runtimes.py)."""
    traceback = RUNTIMES[runtime].traceback
    if traceback is not None:
        for index in range(len(logs) - 1, -1, -1):
            entry = logs[index]
            if entry.get("stream") == "stderr" and entry.get("text") == traceback.start:
                return logs[:index], [line.get("text", "") for line in logs[index:]]
    return logs, []


_NO_FRAME = re.compile(r"(?!)")  # matches nothing: a runtime whose failures have no frames


class HandlerFailedInCell(HandlerFailed):
    """HandlerFailed told against the handler's cell: the handler's traceback with the cell's
    line numbers, then one line naming the exception and the cell line (``ZeroDivisionError:
    division by zero (etl, cell line 4)``); ``%fn_debug`` adds the request (docs/protocol.md,
    "Kernel")."""

    def __init__(self, failed: HandlerFailed, spec: Spec) -> None:
        super().__init__(
            failed.message,
            code=failed.code,
            status=failed.status,
            run_uid=failed.run_uid,
            invocation_id=failed.invocation_id,
            detail=failed.detail,
        )
        self.spec = spec
        self.item = failed.item
        self.traceback_lines = split_traceback(failed.logs, spec.runtime)[1]
        traceback = RUNTIMES[spec.runtime].traceback
        self._frame = (traceback.frame if traceback else _NO_FRAME).match

    @property
    def line(self) -> int | None:
        """The cell line of the innermost frame in the handler's cell, if the traceback has one."""
        lines = [
            cell_line(int(frame["line"]))
            for frame in map(self._frame, self.traceback_lines)
            if frame is not None and Path(frame["path"]).name == self.spec.filename
        ]
        return lines[-1] if lines else None

    def summary(self) -> str:
        """One line: the exception and where in the cell (``KeyError: 'x' (etl, cell line 4)``)."""
        where = self.spec.name
        if self.item is not None:
            where += f", item {self.item[0]} of {self.item[1]}"
        if self.line is not None:
            where += f", cell line {self.line}"
        what = f"{self.error_type}: {self.error_message}" if self.error_type else self.message
        return f"{what} ({where})"

    def hint(self) -> str:
        """What to ship with the function, when the handler missed a module or a file that is
        beside the notebook (kernel/include.py)."""
        return include.hint(self.error_message, self.spec.source, self.spec.files, Path.cwd())

    def _render_traceback_(self) -> list[str]:
        """What the cell shows, and a headless log prints (nbconvert, papermill): the handler's
        traceback as IPython shows a local error — its frames only, with the cell's line
        numbers — then the summary line, and what to ship when it missed a file beside the
        notebook. A failure without frames is the summary alone."""
        hint = self.hint()
        lines = [self.summary(), *([f"hint: {hint}"] if hint else [])]
        if not self.traceback_lines:
            return lines
        return [*self.traceback_text(colour=True).splitlines(), *lines]

    def traceback_text(self, colour: bool = False) -> str:
        """The handler's traceback as IPython shows one: its own frames with the cell's line
        numbers and two lines of context, other frames as files; `colour`: with IPython's
        terminal colours (ANSI)."""
        red, green, cyan, reset = ("\x1b[0;31m", "\x1b[0;32m", "\x1b[0;36m", "\x1b[0m")
        if not colour:
            red = green = cyan = reset = ""
        out = [
            red + "-" * 75 + reset,
            f"{red}{self.error_type:<42}{reset}Traceback (most recent call last)",
        ]
        source = self.spec.source.splitlines()
        frame_kind = ""  # "cell" or "file" while reading a frame's lines; "" after the frames
        for text in self.traceback_lines[1:]:
            frame = self._frame(text)
            if frame is not None and Path(frame["path"]).name == self.spec.filename:
                frame_kind = "cell"
                line = cell_line(int(frame["line"]))
                out.append(
                    f"{green}Cell {self.spec.name}, line {line}{reset}, "
                    f"in {cyan}{frame['function']}{reset}"
                )
                for number in range(max(2, line - 2), line + 1):  # cell line 1 is the magic
                    code = source[number - 2] if number - 2 < len(source) else ""
                    arrow = f"{green}---->{reset}" if number == line else "     "
                    out.append(f"{arrow} {number:>2} {code}")
            elif frame is not None:
                frame_kind = "file"
                out.append(f"File {frame['path']}:{frame['line']}, in {frame['function']}")
            elif frame_kind and text.startswith("    "):
                if frame_kind == "file":  # the cell's frames show the cell's own lines instead
                    out.append(text)
            else:
                frame_kind = ""
                name, colon, rest = text.partition(":")
                out.append(f"{red}{name}{reset}{colon}{rest}" if colon else text)
        return "\n".join(out)


_CATCHABLE: dict[type[Exception], type[HandlerFailedInCell]] = {}


def handler_failure(failed: HandlerFailed, spec: Spec) -> HandlerFailedInCell:
    """`failed` as the cell raises it: a HandlerFailedInCell that is also an instance of the
    handler's exception type when that is a builtin one (``except KeyError`` catches a
    handler's KeyError, ``except HandlerFailed`` every handler failure, as Ray's
    ``RayTaskError`` does). The handler's own exception classes are not in this process: for
    them it is HandlerFailedInCell alone (``error_type`` names them)."""
    builtin = getattr(builtins, failed.error_type, None)
    if not (isinstance(builtin, type) and issubclass(builtin, Exception)):
        return HandlerFailedInCell(failed, spec)
    both = _CATCHABLE.get(builtin)
    if both is None:
        try:
            both = type(
                "HandlerFailedInCell",
                (HandlerFailedInCell, builtin),
                # KeyError's str() would quote the message; it reads as any failure's.
                {"__str__": BaseException.__str__, "__module__": __name__},
            )
        except TypeError:  # a lay-out conflict: none of Python 3.11's builtins has one
            both = HandlerFailedInCell
        _CATCHABLE[builtin] = both
    return both(failed, spec)


class _MapBar:
    """A map's progress bar (docs/protocol.md, "Kernel"): updated in place while the map runs,
    and ended once, however the map ends, so no bar is left "running" — after a failure, an
    interrupt, or the kernel's shutdown mid-map. Its end is one line of text for a log; the
    bar itself is then HTML only, so a notebook's text says the end once."""

    def __init__(self, name: str, total: int, display: Callable[..., Any]) -> None:
        self._lock = threading.Lock()
        self._shown = MapProgress(name, 0, total)
        self._handle = display(self._shown, display_id=True)
        self._at = 0.0
        self._done = 0  # the last count given, shown or not

    def progress(self, done: int, total: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._done = done
            if self._shown.over or (done != total and now - self._at < _PROGRESS_SECONDS):
                return
            self._at = now
            self._shown = dataclasses.replace(self._shown, done=done)
            if self._handle is not None:
                self._handle.update(self._shown)

    def end(self, failed: int = 0, cancelled: bool = False) -> None:
        with self._lock:
            if self._shown.over:
                return
            self._shown = dataclasses.replace(
                self._shown, done=self._done, failed=failed, finished=not cancelled,
                cancelled=cancelled,
            )  # fmt: skip
            if self._handle is not None:
                self._handle.update({"text/html": self._shown._repr_html_()}, raw=True)
        print(repr(self._shown), flush=True)


class NotOwned(RuntimeError):
    """An action only the kernel that registered a function may take: unregistering one bound
    with ``%use``, or a ``%%function`` cell of a name another kernel owns (docs/protocol.md,
    "Ownership")."""

    def _render_traceback_(self) -> list[str]:
        return [f"NotOwned: {self}"]


def get(name: str) -> Function:
    """The function `name` on the stack this kernel uses, bound as ``%use NAME`` binds it
    (the kernel's own if it registered it)."""
    from IPython import get_ipython  # the running kernel's shell

    from fnkernel.kernel.session import session_of  # it imports this module

    session = session_of(get_ipython())
    return session.functions.get(name) or session.use(name)


class PayloadNotJSON(TypeError):
    """The payload cannot be encoded as JSON: one line naming the type, not json's frames."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


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
        *,
        owner: str = "",
    ) -> None:
        """`owner`: this kernel's identity when it registered the function (``%%function``);
        "" for a function bound with ``%use``, which this kernel never deletes."""
        self._runtime = runtime
        self._on_unregister = on_unregister
        self.owner = owner
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

    def __call__(self, payload: Any = None, /, **fields: Any) -> Any:
        """The decoded output of one call with `payload`, or with the keyword arguments as
        the event's fields (``etl(x=1)`` sends ``{"x": 1}``); ``etl()`` sends null."""
        if fields:
            if payload is not None:
                raise TypeError(
                    f"{self.name}() takes a payload or keyword fields, not both: "
                    f"{self.name}({{**payload, **fields}}) sends one object"
                )
            payload = fields
        return self.invoke(payload).output

    def invoke(
        self,
        payload: Any = None,
        timeout: float | None = None,
        invocation_id: str | None = None,
    ) -> InvocationView:
        """Invoke with `payload` (JSON-encoded); `timeout` in seconds overrides ``--timeout``."""
        timeout = self.timeout if timeout is None else timeout
        try:
            data = jsoncodec.dumps(payload)
        except (TypeError, ValueError) as exc:
            raise PayloadNotJSON(f"the payload of {self.name} is not JSON: {exc}") from None
        client = self._runtime.client()
        invocation_id = invocation_id or limits.new_id("inv_")
        lines = LiveLines(self.spec.runtime)
        try:
            result = client.invoke(
                self.name,
                data=data,
                timeout_millis=round(timeout * 1000) if timeout else 0,
                invocation_id=invocation_id,
                on_log=lines,
            )
        except HandlerFailed as failed:
            lines.fail()
            raise handler_failure(failed, self.spec) from None
        except InvocationTimedOut as exc:
            lines.release()
            raise self._timed_out(exc, timeout) from None
        except (RequestCancelled, KeyboardInterrupt):
            # The kernel was interrupted: FnKernel cancels the request from its control thread
            # (RequestCancelled); a stock ipykernel's SIGINT lands here as KeyboardInterrupt,
            # inside the HTTP read, so the request is cancelled now. Either way the gateway
            # cancels the call and the handler is killed; the function stays registered. Wait
            # (briefly) until it is free again, so the next cell's call is not refused as busy.
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

        work = list(items)
        timeout = self.timeout if timeout is None else timeout
        bar = _MapBar(self.name, len(work), display)
        printers: dict[int, LiveLines] = {}

        def on_log(index: int, line: dict[str, str]) -> None:
            printer = printers.get(index)
            if printer is None:
                printer = printers[index] = LiveLines(self.spec.runtime, f"[{index}] ")
            printer(line)

        client = self._runtime.client()
        forget = self._runtime.on_stop(lambda: bar.end(cancelled=True))  # a restart mid-map
        try:
            results = client.map(
                self.name, work, concurrency=concurrency,
                return_exceptions=return_exceptions,
                timeout_millis=round(timeout * 1000) if timeout else 0, progress=bar.progress,
                on_log=on_log,
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
            raise self._timed_out(exc, timeout) from None
        except GatewayError:
            bar.end(failed=1, cancelled=True)
            raise
        except (RequestCancelled, KeyboardInterrupt):
            for printer in printers.values():
                printer.release()
            bar.end(cancelled=True)
            self._wait_replicas_free()
            raise InvocationInterrupted(
                f"map of {self.name} cancelled; every call in flight was cancelled and "
                f"{self.name} stays registered"
            ) from None
        finally:
            forget()
        for index, printer in printers.items():
            if isinstance(results[index], BaseException):
                printer.fail()
            else:
                printer.release()
        results = [
            handler_failure(result, self.spec) if isinstance(result, HandlerFailed) else result
            for result in results
        ]
        bar.end(failed=sum(isinstance(result, BaseException) for result in results))
        return results

    def _wait_replicas_free(self) -> None:
        """After a map's calls were cancelled: as after one call, wait (briefly) until every
        replica's server has let go of its cancelled call, so the next cell's calls are not
        refused as busy."""
        with self._runtime.trace.bookkeeping():
            for name in self._replica_names():
                wait_until_free(lambda name=name: self._in_flight(name))  # type: ignore[misc]

    def _timed_out(self, exc: InvocationTimedOut, timeout: float | None) -> InvocationTimedOut:
        """The deadline as a user can act on it: how long it was, and how to give more (what
        the handler printed until then is the cell's output already: LiveLines)."""
        seconds = timeout or limits.DEFAULT_TIMEOUT_MILLIS / 1000
        timed_out = InvocationTimedOut(
            f"{self.name} timed out after {seconds:g} s; give it more with %%function "
            f"{self.name} --timeout S or {self.name}.invoke(payload, timeout=S)",
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
        return Status(self._runtime.client().status(self.name))

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
        owner = owner_of(client.status(self.name).source)
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
        if self.spec.files:
            lines.append("includes: " + ", ".join(sorted(self.spec.files)))
        lines += ["", f"--- {self.spec.filename} ---", self.spec.source.rstrip()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<{self.spec.runtime} function {self.name} ({self.spec.handler})>"
