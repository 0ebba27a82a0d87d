"""What a call shows in its cell (docs/protocol.md, "Kernel"): its log lines as they come, a
handler's failure told against the cell it was written in, and a map's progress bar."""

from __future__ import annotations

import builtins
import dataclasses
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fnkernel.adapters.errors import MEMORY_LIMIT_EXCEEDED, MORE_MEMORY, OUTPUT_TOO_LARGE
from fnkernel.adapters.runtimes import RUNTIMES
from fnkernel.kernel import include
from fnkernel.kernel.cellspec import Spec
from fnkernel.kernel.display import MapProgress
from fnkernel.runtime_server.client.errors import HandlerFailed

_PROGRESS_SECONDS = 0.5  # a map's bar is updated at most this often (and at the end)
_RENEW_SECONDS = 2.0  # ... and at least this often, or it expires (display.EXPIRES_SECONDS)


def cell_line(file_line: int) -> int:
    """A line of the handler file as a line of its cell: the ``%%function`` line comes first."""
    return file_line + 1


def in_cell(message: str, spec: Spec) -> str:
    """A load failure's message with the handler file's lines told as cell lines (Python's
    ``NAME.py line N``, bash's ``NAME.sh: line N``)."""
    return re.sub(
        rf"\b{re.escape(spec.filename)}:? line (\d+)",
        lambda found: f"cell line {cell_line(int(found[1]))}",
        message,
    )


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
    if the runtime's worker logs one: adapters/runtimes.py) — all of it when it is a chain of
    exceptions' (``raise ... from``: every pandas KeyError), not only its last one's."""
    traceback = RUNTIMES[runtime].traceback
    if traceback is None:
        return logs, []
    texts = [entry.get("text", "") if entry.get("stream") == "stderr" else None for entry in logs]

    def last_start(before: int) -> int | None:
        starts = (index for index in range(before - 1, -1, -1) if texts[index] == traceback.start)
        return next(starts, None)

    begins = last_start(len(texts))
    while begins is not None:  # an earlier traceback of the chain, joined to this one?
        joined = begins - 1
        while joined >= 0 and texts[joined] == "":
            joined -= 1
        chained = joined >= 0 and texts[joined] in traceback.chained
        earlier = last_start(joined) if chained else None
        if earlier is None:
            break
        begins = earlier
    if begins is None:
        return logs, []
    return logs[:begins], [line.get("text", "") for line in logs[begins:]]


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
        self._chained = traceback.chained if traceback else ()

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
            where += f", {self.item_phrase()}"
        if self.line is not None:
            where += f", cell line {self.line}"
        what = f"{self.error_type}: {self.error_message}" if self.error_type else self.message
        if self.error_type == MEMORY_LIMIT_EXCEEDED:  # how to give it more, in the cell's words
            mine = f"give it more with %%function {self.spec.name} --memory MIB"
            what = what.replace(MORE_MEMORY, mine) if MORE_MEMORY in what else f"{what}; {mine}"
        elif self.error_type == OUTPUT_TOO_LARGE and self.spec.runtime == "python":
            what += (  # the stack's payload bound (a bash function answers inline, 6 MiB)
                "; the stack's bound: FNKERNEL_MAX_PAYLOAD_BYTES for the kernel's own runtime, "
                "--max-payload-bytes for fnkernel up"
            )
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
        summary = self.summary()
        hints = [f"hint: {hint}"] if hint else []
        if not self.traceback_lines:
            return [summary, *hints]
        shown = self.traceback_text(colour=True).splitlines()
        # The traceback ends with the exception's line; the summary is that line and where it
        # was, so it takes its place rather than saying it a second time.
        if self.traceback_text().splitlines()[-1] == summary.rpartition(" (")[0]:
            shown.pop()
        return [*shown, summary, *hints]

    def traceback_text(self, colour: bool = False) -> str:
        """The handler's traceback as IPython shows one: its own frames with the cell's line
        numbers and two lines of context, other frames as files; `colour`: with IPython's
        terminal colours (ANSI)."""
        red, green, cyan, reset = ("\x1b[0;31m", "\x1b[0;32m", "\x1b[0;36m", "\x1b[0m")
        if not colour:
            red = green = cyan = reset = ""
        lines = self.traceback_lines
        out = [red + "-" * 75 + reset]
        source = self.spec.source.splitlines()
        frame_kind = ""  # "cell" or "file" while reading a frame's lines; "" after the frames
        for index, text in enumerate(lines):
            frame = self._frame(text)
            if index == 0 or (text == lines[0] and not frame_kind):  # a traceback of the chain
                kind = self._exception_of(index) or self.error_type
                out.append(f"{red}{kind:<42}{reset}Traceback (most recent call last)")
            elif frame is not None and Path(frame["path"]).name == self.spec.filename:
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
                named = colon and text not in self._chained  # an exception's line
                out.append(f"{red}{name}{reset}{colon}{rest}" if named else text)
        return "\n".join(out)

    def _exception_of(self, start: int) -> str:
        """The type of the exception whose traceback starts at line `start`: its first line
        that is no frame, no frame's source and not blank."""
        for text in self.traceback_lines[start + 1 :]:
            if text and not text.startswith(" ") and self._frame(text) is None:
                return text.partition(":")[0]
        return ""


_CATCHABLE: dict[type[Exception], type[HandlerFailedInCell]] = {}


def _unquoted(failure: HandlerFailedInCell) -> str:
    """A failure's str() as GatewayError says it (a map's item named), not quoted as a
    KeyError's would be."""
    text = BaseException.__str__(failure)
    return f"{text} ({failure.item_phrase()})" if failure.item else text


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
                {"__str__": _unquoted, "__module__": __name__},
            )
        except TypeError:  # a lay-out conflict: none of Python 3.11's builtins has one
            both = HandlerFailedInCell
        _CATCHABLE[builtin] = both
    return both(failed, spec)


class MapBar:
    """A map's progress bar (docs/protocol.md, "Kernel"): updated in place while the map runs
    (renewed every _RENEW_SECONDS even when no call has finished), and ended once, however the
    map ends, so no bar is left "running" — after a failure, an interrupt, or the kernel's
    shutdown mid-map; a bar its kernel could not end expires (display.EXPIRES_SECONDS). Its
    end is one line of text for a log; the bar itself is then HTML only, so a notebook's text
    says the end once."""

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
            since = now - self._at
            changed = done != self._shown.done
            if self._shown.over or not (
                done == total or (changed and since >= _PROGRESS_SECONDS) or since >= _RENEW_SECONDS
            ):
                return
            self._at = now
            self._shown = dataclasses.replace(self._shown, done=done)
            if self._handle is not None:
                self._handle.update(self._shown)

    def end(self, failed: int = 0, cancelled: bool = False) -> None:
        with self._lock:
            if self._shown.over:
                return
            # A map stopped by a failure once every call had ended cancelled nothing: done.
            cancelled = cancelled and self._done < self._shown.total
            self._shown = dataclasses.replace(
                self._shown, done=self._done, failed=failed, finished=not cancelled,
                cancelled=cancelled,
            )  # fmt: skip
            if self._handle is not None:
                self._handle.update({"text/html": self._shown._repr_html_()}, raw=True)
        print(repr(self._shown), flush=True)
