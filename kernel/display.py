"""Rich display (docs/protocol.md, "Kernel"): the registration card, the invocation result, the ``%functions`` table.

Each object has ``_repr_html_`` for JupyterLab and a ``__repr__`` that reads well as plain text,
because a notebook executed headless by nbclient is read as text in a CI log.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fnkernel.runtime_server import payloads
from fnkernel.runtime_server.client import InvocationResult, Run

# One stylesheet for every fnkernel output (docs/protocol.md, "Kernel"). Text colours come from
# JupyterLab's theme variables, the variant of each that reads at WCAG AA (4.5:1) on that theme's
# background: color0 on the light theme, color1/2 on the dark one, which JupyterLab marks with
# data-jp-theme-light on <body>. Outside JupyterLab the fallbacks (the light values) apply.
STYLE = (
    "<style>"
    ".fnk{--fnk-error:var(--jp-error-color0,#b71c1c);--fnk-ok:var(--jp-success-color0,#1b5e20);"
    "--fnk-warn:#8a4b00;--fnk-info:var(--jp-brand-color0,#0d47a1);--fnk-pod:#6a1b9a;"
    "--fnk-muted:var(--jp-content-font-color2,rgba(0,0,0,.54))}"
    "[data-jp-theme-light='false'] .fnk{--fnk-error:var(--jp-error-color2,#e57373);"
    "--fnk-ok:var(--jp-success-color1,#4caf50);--fnk-warn:var(--jp-warn-color1,#ff9800);"
    "--fnk-info:var(--jp-brand-color2,#64b5f6);--fnk-pod:#ce93d8}"
    ".fnk .fnk-error{color:var(--fnk-error)}.fnk .fnk-ok{color:var(--fnk-ok)}"
    ".fnk .fnk-warn{color:var(--fnk-warn)}.fnk .fnk-info{color:var(--fnk-info)}"
    ".fnk .fnk-pod{color:var(--fnk-pod)}.fnk .fnk-muted{color:var(--fnk-muted)}"
    # JupyterLab right-aligns the cells of HTML outputs with a more specific selector.
    ".fnk table th,.fnk table td,.fnk table tr{text-align:left!important;vertical-align:top}"
    ".fnk pre{margin:2px 0;white-space:pre-wrap}"
    ".fnk .fnk-scroll{max-height:24em;overflow:auto}"
    ".fnk .fnk-card{border:1px solid var(--jp-border-color2,#e0e0e0);border-left-width:4px;"
    "border-radius:4px;padding:6px 10px;margin:2px 0;"
    "font-family:var(--jp-code-font-family,monospace);font-size:var(--jp-code-font-size,13px)}"
    ".fnk .fnk-edge-ok{border-left-color:var(--fnk-ok)}"
    ".fnk .fnk-edge-error{border-left-color:var(--fnk-error)}"
    ".fnk .fnk-edge-busy{border-left-color:var(--fnk-warn)}"
    ".fnk .fnk-edge-info{border-left-color:var(--fnk-info)}"
    ".fnk .fnk-edge-muted{border-left-color:var(--fnk-muted)}"
    # A live output no update has renewed for EXPIRES_SECONDS turns grey and says why: its
    # kernel stopped (a restart, a crash) before it could end it (MapProgress).
    ".fnk .fnk-expires{animation:fnk-expired 0s 10s forwards}"
    "@keyframes fnk-expired{to{border-left-color:var(--fnk-muted)}}"
    # (hidden by visibility, not display: an element without a box runs no animation)
    ".fnk .fnk-expires .fnk-stale{visibility:hidden;position:absolute;"
    "animation:fnk-shown 0s 10s forwards}"
    "@keyframes fnk-shown{to{visibility:visible;position:static}}"
    ".fnk .fnk-expires .fnk-live{animation:fnk-hidden 0s 10s forwards}"
    "@keyframes fnk-hidden{to{visibility:hidden;position:absolute}}"
    ".fnk .fnk-badge{border:1px solid currentColor;border-radius:3px;padding:0 4px}"
    "</style>"
)
_EDGE = {
    "READY": "ok", "Ready": "ok", "Idle": "ok", "Failed": "error", "FAILED": "error",
    "failed": "error", "refused": "error", "interrupted": "muted",
}  # fmt: skip
TEXT_LINES = 20  # the text form of a result shows this many lines, then "… N more lines"
EXPIRES_SECONDS = 10  # as in STYLE's .fnk-expires; a live output is renewed well within it


def fragment(body: str) -> str:
    """An output's HTML: `body` inside the stylesheet's scope."""
    return f"<div class='fnk'>{STYLE}{body}</div>"


def card(body: str, edge: str, expires: bool = False) -> str:
    """A bordered card whose left edge colours its state (``ok``, ``error``, ``busy``, ``info``,
    ``muted``); `expires`: turns grey unless renewed within EXPIRES_SECONDS."""
    more = " fnk-expires" if expires else ""
    return fragment(f"<div class='fnk-card fnk-edge-{edge}{more}'>{body}</div>")


def muted(text: str) -> str:
    return f"<span class='fnk-muted'>{escape(text)}</span>"


def escape(value: object) -> str:
    return html.escape(str(value))


def short(value: str, keep: int = 12) -> str:
    """An opaque ID or a digest, shortened for display (``sha256:`` is kept)."""
    prefix = "sha256:" if value.startswith("sha256:") else ""
    rest = value.removeprefix(prefix)
    return prefix + (rest[:keep] + "…" if len(rest) > keep else rest)


def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def head_lines(text: str, keep: int = TEXT_LINES) -> str:
    """`text` cut to `keep` lines, with how many more there were (as pandas does)."""
    lines = text.splitlines()
    if len(lines) <= keep:
        return text
    return "\n".join([*lines[:keep], f"… {len(lines) - keep} more lines"])


def _json_text(value: Any) -> str:
    if isinstance(value, str | bytes):
        return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return pretty_json(value)


def table_html(headers: Iterable[str], rows: Iterable[Iterable[object]]) -> str:
    """A table of HTML cells; the stylesheet aligns headers and cells alike (left)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def table_text(headers: list[str], rows: list[list[str]]) -> str:
    table = [headers, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in table
    )


@dataclass
class RegistrationCard:
    """One function's registration: name, runtime, state, attempt, short ID and digest."""

    name: str
    runtime: str
    state: str = "registering"
    attempt: int = 0
    registration_id: str = ""
    digest: str = ""
    message: str = ""
    note: str = ""
    where: str = ""  # the stack it is registered on (Runtime.where)

    @classmethod
    def from_run(cls, run: Run, note: str = "") -> RegistrationCard:
        """From a Run (``GET /v1/runs/{name}``): its live registration if any, else its phase."""
        live = run.live
        return cls(
            name=run.name,
            runtime=run.runtime,
            state=live.state if live is not None and run.ready else run.phase,
            attempt=(live.registration_attempt if live is not None else 0) or run.attempt,
            registration_id=live.registration_id if live is not None else "",
            digest=live.registration_digest if live is not None else "",
            message=run.message if run.failed else "",
            note=note,
        )

    def _fields(self) -> list[tuple[str, str]]:
        fields = [("runtime", self.runtime), ("state", self.state)]
        if self.attempt:
            fields.append(("attempt", str(self.attempt)))
        if self.registration_id:
            fields.append(("registration", short(self.registration_id)))
        if self.digest:
            fields.append(("digest", short(self.digest)))
        if self.where:
            fields.append(("on", self.where))
        return fields

    def __repr__(self) -> str:
        text = f"{self.name}: " + " · ".join(f"{key} {value}" for key, value in self._fields())
        if self.note:
            text += f" ({self.note})"
        if self.message:
            text += f"\n  {self.message}"
        return text

    def _repr_html_(self) -> str:
        fields = " &nbsp;·&nbsp; ".join(
            f"{muted(key)} <b{_full(key, self)}>{escape(value)}</b>"
            for key, value in self._fields()
        )
        body = f"<b style='font-size:1.1em'>{escape(self.name)}</b> &nbsp; {fields}"
        if self.note:
            body += f" &nbsp;<i class='fnk-muted'>({escape(self.note)})</i>"
        if self.message:
            body += f"<pre class='fnk-error'>{escape(self.message)}</pre>"
        return card(body, _EDGE.get(self.state, "busy"))


def _full(key: str, shown: RegistrationCard) -> str:
    """The whole ID or digest on hover (the card shows it shortened)."""
    value = {"registration": shown.registration_id, "digest": shown.digest}.get(key)
    return f" title='{escape(value)}'" if value else ""


@dataclass(frozen=True)
class MapProgress:
    """``NAME.map(items)`` as it goes: a bar updated in place in a notebook, a line of text in
    a log (docs/protocol.md, "Kernel")."""

    name: str
    done: int
    total: int
    failed: int = 0
    finished: bool = False
    cancelled: bool = False  # an interrupt, a failure or the kernel's end stopped it

    def __repr__(self) -> str:
        head = f"{self.name}.map: {self.done}/{self.total}"
        if self.failed:  # a failure stopped it: what ended, then what did not run
            rest = ", the rest cancelled" if self.cancelled else ""
            return f"{head} done, {self.failed} failed{rest}"
        return f"{head} {'cancelled' if self.cancelled else 'done' if self.finished else 'running'}"

    def _repr_html_(self) -> str:
        bar = f"<progress max='{self.total}' value='{self.done}' style='width:16em'></progress>"
        if not self.over:
            # Renewed while the map runs (MapBar); once its kernel is gone — a restart, which
            # JupyterLab clears before the kernel could end the bar — it reads as cancelled.
            stale = f"{self.name}.map: {self.done}/{self.total} cancelled: its kernel stopped"
            label = (
                f"<span class='fnk-live'>{escape(repr(self))}</span>"
                f"<span class='fnk-stale'>{escape(stale)}</span>"
            )
            return card(f"{bar} &nbsp;{label}", "busy", expires=True)
        if self.failed:
            edge = "error"
        elif self.cancelled:
            edge = "muted"
        else:
            edge = "ok" if self.finished else "busy"
        return card(f"{bar} &nbsp;{escape(repr(self))}", edge)

    @property
    def over(self) -> bool:
        return self.finished or self.cancelled


@dataclass(frozen=True)
class InvocationView:
    """One invocation's result: output, outputs, invocation ID, duration and logs."""

    name: str
    result: InvocationResult = field(repr=False)

    @property
    def output(self) -> Any:
        """The handler's output, of the kind it returned (docs/protocol.md, "Content types"):
        decoded from JSON (the raw text when it is not JSON), a DataFrame, table or array
        from Arrow IPC, or bytes."""
        return self.result.decoded()

    def _shown(self) -> str:
        output = self.output
        return _json_text(output) if payloads.kind_of(output) is None else repr(output)

    @property
    def raw(self) -> bytes:
        return self.result.output

    @property
    def outputs(self) -> dict[str, str]:
        return self.result.outputs

    @property
    def invocation_id(self) -> str:
        return self.result.invocation_id

    @property
    def duration(self) -> float:
        """Seconds, as the kernel measured the round trip."""
        return self.result.duration

    @property
    def logs(self) -> list[dict[str, str]]:
        return self.result.logs

    def _timing(self) -> str:
        text = f"invocation {self.invocation_id} · {self.duration * 1000:.1f} ms"
        if self.result.attempt:
            text += f" · attempt {self.result.attempt}"
        if self.result.cold_start:
            text += " · cold start"
        return text

    def __repr__(self) -> str:
        lines = [f"{self.name} → {head_lines(self._shown())}"]
        if self.outputs:
            lines.append(
                "  outputs: " + ", ".join(f"{key}={value}" for key, value in self.outputs.items())
            )
        lines.append(f"  {self._timing()}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        # The handler's own prints are the cell's stream output (kernel.functions), not here.
        output = self.output
        html = getattr(output, "_repr_html_", None) if payloads.kind_of(output) else None
        shown = html() if html is not None else None  # a DataFrame's own table
        if shown is None:
            shown = f"<pre class='fnk-scroll'>{escape(self._shown())}</pre>"
        parts = [f"<b>{escape(self.name)}</b> →{shown}"]
        if self.outputs:
            parts.append(
                table_html(
                    ["output", "value"],
                    ([f"<code>{escape(k)}</code>", escape(v)] for k, v in self.outputs.items()),
                )
            )
        parts.append(f"<div>{muted(self._timing())}</div>")
        return card("".join(parts), "info")


@dataclass(frozen=True)
class FunctionsTable:
    """``%functions``: every registered function with its live state."""

    rows: list[dict[str, str]]
    where: str = ""
    missing: tuple[str, ...] = ()  # names asked for that no function has

    _HEADERS = (
        "name", "runtime", "phase", "state", "attempt", "registration", "in flight", "replicas",
        "owner",
    )  # fmt: skip

    def _cells(self) -> list[list[str]]:
        return [[row.get(h, "") for h in self._HEADERS] for row in self.rows]

    def _none(self) -> str:
        """What stands for a table without rows."""
        if self.missing:
            return f"no function named {', '.join(self.missing)}"
        return "no functions registered"

    def __repr__(self) -> str:
        if not self.rows:
            return f"{self._none()} ({self.where})" if self.where else self._none()
        text = table_text(list(self._HEADERS), self._cells())
        if self.missing:
            text += f"\n{self._none()}"
        return f"{text}\n({self.where})" if self.where else text

    def _repr_html_(self) -> str:
        if not self.rows:
            return f"<p>{escape(self._none())} <i>({escape(self.where)})</i></p>"
        registration = self._HEADERS.index("registration")
        rows = (
            [
                f"<span title='{escape(c)}'>{escape(short(c))}</span>"
                if i == registration and c
                else escape(c)
                for i, c in enumerate(row)
            ]
            for row in self._cells()
        )
        table = table_html(self._HEADERS, rows)
        if self.missing:
            table += f"<p>{escape(self._none())}</p>"
        return fragment(table + (f"<div>{muted(self.where)}</div>" if self.where else ""))


@dataclass(frozen=True)
class Detail:
    """A titled block of text: ``%fn_debug`` and ``NAME.status()``. `terminal`, when given, is
    the text with ANSI colours, for the plain-text form a terminal shows (as IPython colours a
    traceback there); the HTML form is the plain text."""

    title: str
    text: str
    terminal: str = ""

    def __repr__(self) -> str:
        return f"{self.title}\n{self.terminal or self.text}"

    def _repr_html_(self) -> str:
        return fragment(f"<b>{escape(self.title)}</b><pre>{escape(self.text)}</pre>")
