"""``%fn_trace``: every call the kernel makes to the runtime, for teaching (docs/protocol.md, "Kernel").

A call is recorded with its method (``POST /v1/runs/etl:invoke`` at the gateway,
``FunctionRuntime/RegisterFunction`` at a Runtime Server), the request as JSON with JSON payloads
decoded, the status and the latency. Recording costs nothing while the trace is off.
"""

from __future__ import annotations

import base64
import binascii
import html
import json
import threading
from dataclasses import dataclass
from typing import Any

_PAYLOAD_FIELDS = ("input", "output")  # bytes fields of the FunctionRuntime messages


@dataclass(frozen=True)
class TracedCall:
    method: str
    request: Any
    status: str
    latency_ms: float
    response: Any = None


def decode_payload(data: bytes) -> Any:
    """JSON bytes as the value they encode; other bytes as text."""
    text = data.decode("utf-8", "replace")
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


def decode_message(message: Any) -> Any:
    """A FunctionRuntime message as JSON (``MessageToDict``) with its base64 payloads decoded."""
    if isinstance(message, dict):
        decoded = {}
        for key, value in message.items():
            if key in _PAYLOAD_FIELDS and isinstance(value, str):
                try:
                    decoded[key] = decode_payload(base64.b64decode(value, validate=True))
                except (binascii.Error, ValueError):
                    decoded[key] = value
            else:
                decoded[key] = decode_message(value)
        return decoded
    if isinstance(message, list):
        return [decode_message(item) for item in message]
    return message


class Trace:
    """The recorded calls, in order. Thread-safe: an interrupt may record from another thread."""

    def __init__(self) -> None:
        self.on = False
        self._calls: list[TracedCall] = []
        self._lock = threading.Lock()

    def record(
        self, method: str, request: Any, status: str, latency_ms: float, response: Any = None
    ) -> None:
        if self.on:
            with self._lock:
                self._calls.append(TracedCall(method, request, status, latency_ms, response))

    def start(self) -> None:
        with self._lock:
            self._calls.clear()
        self.on = True

    def stop(self) -> None:
        self.on = False

    def calls(self) -> list[TracedCall]:
        with self._lock:
            return list(self._calls)


def _compact(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class TraceTable:
    """``%fn_trace show``: the calls as a table (HTML, and aligned text for a CI log)."""

    def __init__(self, calls: list[TracedCall]) -> None:
        self.calls = calls

    def _rows(self) -> list[tuple[str, str, str, str, str]]:
        return [
            (
                str(number),
                call.method,
                call.status,
                f"{call.latency_ms:.1f} ms",
                _compact(call.request) if call.request is not None else "",
            )
            for number, call in enumerate(self.calls, 1)
        ]

    def __repr__(self) -> str:
        if not self.calls:
            return "fn_trace: no calls recorded (turn it on with %fn_trace on)"
        header = ("#", "method", "status", "latency", "request")
        rows = [header, *self._rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = []
        for row in rows:
            cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
            lines.append("  ".join([*cells, row[4]]).rstrip())
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        if not self.calls:
            return "<p><code>fn_trace</code>: no calls recorded (<code>%fn_trace on</code>)</p>"
        body = "".join(
            "<tr>"
            f"<td>{number}</td><td><code>{html.escape(method)}</code></td>"
            f"<td>{_status_badge(status)}</td><td style='text-align:right'>{latency}</td>"
            f"<td><code>{html.escape(request)}</code></td>"
            "</tr>"
            for number, method, status, latency, request in self._rows()
        )
        return (
            "<table class='fn-trace'><thead><tr><th>#</th><th>method</th><th>status</th>"
            f"<th>latency</th><th>request</th></tr></thead><tbody>{body}</tbody></table>"
        )


def _status_badge(status: str) -> str:
    ok = status.startswith(("OK", "2"))
    colour = "#1a7f37" if ok else "#cf222e"
    return f"<span style='color:{colour};font-weight:600'>{html.escape(status)}</span>"
