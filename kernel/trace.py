"""``%fn_trace``: every call the kernel makes to the runtime, for teaching (docs/protocol.md, "Kernel").

A call is recorded with its method (``POST /v1/runs/etl:invoke`` at the gateway,
``FunctionRuntime/RegisterFunction`` at a Runtime Server), the request as JSON with JSON payloads
decoded, the status and the latency. Recording costs nothing while the trace is off.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import html
import json
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fnkernel.kernel.display import fragment

_PAYLOAD_FIELDS = ("input", "output")  # bytes fields of the FunctionRuntime messages


@dataclass(frozen=True)
class TracedCall:
    method: str
    request: Any
    status: str
    latency_ms: float
    response: Any = None
    internal: bool = False  # the kernel's own bookkeeping (a status poll), not the user's call
    # A traced invocation (docs/protocol.md, "Tracing"): the kernel's own span, and the spans
    # every hop handed back (OTLP, as X-Fn-Spans carries them).
    kernel_span: dict[str, Any] | None = None
    spans: bytes = b""
    invocation_id: str = ""

    def waterfall_spans(self) -> list[dict[str, Any]]:
        """The kernel's span and every hop's, as runtime_server.tracing.decode gives them."""
        from fnkernel.runtime_server import tracing

        handed = tracing.decode(self.spans) if self.spans else []
        return [self.kernel_span, *handed] if self.kernel_span else handed


class KernelSpan:
    """The kernel's client span of a traced invocation (docs/protocol.md, "Tracing"): W3C IDs
    made here (a trace ID and a span ID, as random as OpenTelemetry's), its times on the same
    clock as every hop's (Unix ns). The trace's root: the hops' spans are its descendants."""

    def __init__(self, name: str, attributes: dict[str, Any], invocation_id: str = "") -> None:
        self.trace_id, self.span_id = secrets.token_hex(16), secrets.token_hex(8)
        self.traceparent = f"00-{self.trace_id}-{self.span_id}-01"
        self.name = name
        self.attributes = attributes
        self.invocation_id = invocation_id
        self.start = time.time_ns()

    def ended(self, answer: tuple[dict[str, Any], str], spans: bytes) -> dict[str, Any]:
        """The call's TracedCall fields, once it answered: `answer` is its status attributes
        and its failure ("" if none); `spans`, every hop's, OTLP."""
        status_attributes, failed = answer
        kernel_span = {
            "service": "fnkernel-kernel",
            "name": self.name,
            "kind": "CLIENT",
            "traceId": self.trace_id,
            "spanId": self.span_id,
            "parentSpanId": "",
            "start": self.start,
            "end": time.time_ns(),
            "attributes": {**self.attributes, **status_attributes},
            "status": failed,
        }
        return {"kernel_span": kernel_span, "spans": spans, "invocation_id": self.invocation_id}


class Shown(str):
    """What a trace shows as it is, not as JSON: a payload's description, or text that is not
    JSON (a JSON string is shown quoted, as it was sent)."""


NO_BODY = Shown("")  # a request without one


def decode_payload(data: bytes, content_type: str = "") -> Any:
    """JSON bytes as the value they encode; other text as text; bytes of another content type
    (an Arrow stream, octets), or that are not UTF-8, as what they are and their size: never
    written into the notebook as they are."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not media.startswith("text/"):
        return Shown(f"({media}, {len(data)} bytes)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return Shown(f"({len(data)} bytes, not text)")
    try:
        return json.loads(text) if text else NO_BODY
    except ValueError:
        return Shown(text)


def decode_message(message: Any) -> Any:
    """A FunctionRuntime message as JSON (``MessageToDict``) with its base64 payloads decoded."""
    if isinstance(message, dict):
        decoded = {}
        content_type = str(message.get("contentType", ""))
        for key, value in message.items():
            if key in _PAYLOAD_FIELDS and isinstance(value, str):
                try:
                    data = base64.b64decode(value, validate=True)
                    decoded[key] = decode_payload(data, content_type)
                except (binascii.Error, ValueError):
                    decoded[key] = value
            else:
                decoded[key] = decode_message(value)
        return decoded
    if isinstance(message, list):
        return [decode_message(item) for item in message]
    return message


HIDDEN = "(hidden)"  # what a trace shows of an env value (README: env values are never shown)


def _env_keys_only(message: Any) -> Any:
    """`message` (a request or an answer, as JSON) with the value of every ``env`` entry hidden:
    a Run's env is often where a key goes (``--env KEY``), and a trace is kept in the notebook.
    A Run's ``files`` are shown by their sizes: the cell's source is above, and in full it
    would push every other field of a create out of the row."""
    if isinstance(message, dict):
        return {key: _shown_field(key, value) for key, value in message.items()}
    if isinstance(message, list):
        return [_env_keys_only(item) for item in message]
    return message


def _shown_field(key: str, value: Any) -> Any:
    if key == "env" and isinstance(value, dict):
        return {name: HIDDEN for name in value}
    if key == "files" and isinstance(value, dict):
        return {
            path: Shown(f"({len(text)} characters)") if isinstance(text, str) else text
            for path, text in value.items()
        }
    return _env_keys_only(value)


def _is_read(method: str) -> bool:
    """A call that changes nothing: a gateway GET, or FunctionRuntime's FunctionStatus."""
    return method.startswith("GET ") or method.endswith("/FunctionStatus")


class Trace:
    """The recorded calls, in order. Thread-safe: an interrupt may record from another thread."""

    def __init__(self) -> None:
        self.on = False
        self._calls: list[TracedCall] = []
        self._lock = threading.Lock()
        self._bookkeeping = threading.local()

    @contextlib.contextmanager
    def bookkeeping(self) -> Iterator[None]:
        """The reads made inside are the kernel's own (polling while it registers or waits):
        recorded as internal, shown by ``%fn_trace show --all`` only."""
        outer = getattr(self._bookkeeping, "on", False)
        self._bookkeeping.on = True
        try:
            yield
        finally:
            self._bookkeeping.on = outer

    def record(
        self,
        method: str,
        request: Any,
        status: str,
        latency_ms: float,
        response: Any = None,
        **traced: Any,
    ) -> None:
        """Record a call; `traced`: a traced invocation's TracedCall fields (kernel_span,
        spans, invocation_id)."""
        if self.on:
            internal = getattr(self._bookkeeping, "on", False) and _is_read(method)
            request, response = _env_keys_only(request), _env_keys_only(response)
            call = TracedCall(method, request, status, latency_ms, response, internal, **traced)
            with self._lock:
                self._calls.append(call)

    def traced(self, invocation_id: str = "") -> TracedCall | None:
        """The last traced invocation, or the one with `invocation_id`."""
        with self._lock:
            calls = list(self._calls)
        for call in reversed(calls):
            if call.kernel_span and (not invocation_id or call.invocation_id == invocation_id):
                return call
        return None

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
    text = value if isinstance(value, Shown) else json.dumps(value, sort_keys=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class TraceTable:
    """``%fn_trace show``: the calls as a table (HTML, and aligned text for a CI log); the
    kernel's own status polls only with ``show_all``."""

    def __init__(self, calls: list[TracedCall], show_all: bool = False) -> None:
        self.calls = [call for call in calls if show_all or not call.internal]
        self.hidden = len(calls) - len(self.calls)

    def _note(self) -> str:
        if not self.hidden:
            return ""
        return f"{self.hidden} status polls of the kernel's own not shown (%fn_trace show --all)"

    def _rows(self) -> list[tuple[str, str, str, str, str]]:
        return [
            (
                str(number),
                call.method,
                call.status,
                f"{call.latency_ms:.1f} ms",
                _compact(call.request),
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
        if self.hidden:
            lines.append(f"({self._note()})")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        if not self.calls:
            return "<p><code>fn_trace</code>: no calls recorded (<code>%fn_trace on</code>)</p>"
        body = "".join(
            "<tr>"
            f"<td>{number}</td><td><code>{html.escape(method)}</code></td>"
            f"<td>{_status_badge(status)}</td><td>{latency}</td>"
            f"<td><code>{html.escape(request)}</code></td>"
            "</tr>"
            for number, method, status, latency, request in self._rows()
        )
        note = f"<div class='fnk-muted'>{html.escape(self._note())}</div>" if self.hidden else ""
        return fragment(
            "<table class='fn-trace'><thead><tr><th>#</th><th>method</th><th>status</th>"
            f"<th>latency</th><th>request</th></tr></thead><tbody>{body}</tbody></table>{note}"
        )


def _status_badge(status: str) -> str:
    kind = "ok" if status.startswith(("OK", "2")) and "Failed" not in status else "error"
    return f"<span class='fnk-{kind}' style='font-weight:600'>{html.escape(status)}</span>"
