"""Rich display (docs/protocol.md, "Kernel"): the registration card, the invocation result, the ``%functions`` table.

Each object has ``_repr_html_`` for JupyterLab and a ``__repr__`` that reads well as plain text,
because a notebook executed headless by nbclient is read as text in a CI log.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime_server.client import InvocationResult, Run

_CARD = (
    "<div class='fn-card' style='border:1px solid #d0d7de;border-left:4px solid {colour};"
    "border-radius:4px;padding:6px 10px;margin:2px 0;font-family:var(--jp-code-font-family,"
    "monospace);font-size:12px'>{body}</div>"
)
_STATE_COLOUR = {"READY": "#1a7f37", "Ready": "#1a7f37", "Idle": "#6e7781", "Failed": "#cf222e"}


def escape(value: object) -> str:
    return html.escape(str(value))


def short(value: str, keep: int = 12) -> str:
    """An opaque ID or a digest, shortened for display (``sha256:`` is kept)."""
    prefix = "sha256:" if value.startswith("sha256:") else ""
    rest = value.removeprefix(prefix)
    return prefix + (rest[:keep] + "…" if len(rest) > keep else rest)


def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def _json_text(value: Any) -> str:
    if isinstance(value, str | bytes):
        return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return pretty_json(value)


def table_html(headers: Iterable[str], rows: Iterable[Iterable[object]]) -> str:
    head = "".join(f"<th style='text-align:left'>{escape(h)}</th>" for h in headers)
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
            f"<span style='color:#6e7781'>{escape(key)}</span> <b>{escape(value)}</b>"
            for key, value in self._fields()
        )
        body = f"<b style='font-size:13px'>{escape(self.name)}</b> &nbsp; {fields}"
        if self.note:
            body += f" &nbsp;<i style='color:#6e7781'>({escape(self.note)})</i>"
        if self.message:
            body += f"<pre style='color:#cf222e;margin:4px 0 0'>{escape(self.message)}</pre>"
        colour = _STATE_COLOUR.get(self.state, "#bf8700")
        return _CARD.format(colour=colour, body=body)


@dataclass(frozen=True)
class InvocationView:
    """One invocation's result: output, outputs, invocation ID, duration and logs."""

    name: str
    result: InvocationResult = field(repr=False)

    @property
    def output(self) -> Any:
        """The handler's output, decoded from JSON (the raw text when it is not JSON)."""
        try:
            return self.result.value()
        except ValueError:
            return self.result.output.decode("utf-8", "replace")

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
        lines = [f"{self.name} → {_json_text(self.output)}"]
        if self.outputs:
            lines.append(
                "  outputs: " + ", ".join(f"{key}={value}" for key, value in self.outputs.items())
            )
        lines.append(f"  {self._timing()}")
        if self.logs:
            lines.append("  logs:")
            lines.extend(f"    {_log_line(entry)}" for entry in self.logs)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        parts = [
            f"<b>{escape(self.name)}</b> → <pre style='margin:2px 0'>{escape(_json_text(self.output))}"
            "</pre>"
        ]
        if self.outputs:
            parts.append(
                table_html(
                    ["output", "value"],
                    ([f"<code>{escape(k)}</code>", escape(v)] for k, v in self.outputs.items()),
                )
            )
        if self.logs:
            lines = "\n".join(_log_line(entry) for entry in self.logs)
            parts.append(
                f"<details><summary>logs ({len(self.logs)})</summary><pre>{escape(lines)}</pre>"
                "</details>"
            )
        parts.append(f"<div style='color:#6e7781'>{escape(self._timing())}</div>")
        return _CARD.format(colour="#0969da", body="".join(parts))


def _log_line(entry: Mapping[str, Any]) -> str:
    stream = entry.get("stream") or entry.get("level") or "log"
    return f"[{stream}] {entry.get('text', '')}"


@dataclass(frozen=True)
class FunctionsTable:
    """``%functions``: every registered function with its live state."""

    rows: list[dict[str, str]]
    where: str = ""

    _HEADERS = ("name", "runtime", "phase", "state", "attempt", "registration", "in flight")

    def _cells(self) -> list[list[str]]:
        return [[row.get(h, "") for h in self._HEADERS] for row in self.rows]

    def __repr__(self) -> str:
        if not self.rows:
            return f"no functions registered ({self.where})" if self.where else "no functions"
        text = table_text(list(self._HEADERS), self._cells())
        return f"{text}\n({self.where})" if self.where else text

    def _repr_html_(self) -> str:
        if not self.rows:
            return f"<p>no functions registered <i>({escape(self.where)})</i></p>"
        table = table_html(self._HEADERS, ([escape(c) for c in row] for row in self._cells()))
        return table + (
            f"<div style='color:#6e7781'>{escape(self.where)}</div>" if self.where else ""
        )


@dataclass(frozen=True)
class Detail:
    """A titled block of text: ``%fn_debug`` and ``NAME.status()``."""

    title: str
    text: str

    def __repr__(self) -> str:
        return f"{self.title}\n{self.text}"

    def _repr_html_(self) -> str:
        return f"<b>{escape(self.title)}</b><pre>{escape(self.text)}</pre>"
