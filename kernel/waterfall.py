"""``%fn_trace waterfall``: one traced call's spans on a shared time axis, for teaching
(docs/protocol.md, "Tracing").

The spans are the kernel's own client span and those every hop handed back (``X-Fn-Spans``),
nested by parent: a bar per span, its offset and length on the call's time axis, and each hop's
attributes on hover and, in the text form a CI log shows, on the lines under it.
"""

from __future__ import annotations

import html
from typing import Any

from fnkernel.kernel.display import fragment

BAR_WIDTH = 40  # characters of the text form's time axis
# Attributes each row shows in the text form (all of them are on hover in HTML).
SHOWN = (
    "http.response.status_code",
    "rpc.grpc.status_code",
    "fnkernel.run_uid",
    "fnkernel.registration_id",
    "fnkernel.registration_attempt",
    "fnkernel.invocation_id",
    "fnkernel.fence",
    "fnkernel.error_type",
)
_STYLE = (
    "<style>"
    ".fnk .fnk-wf{font-family:var(--jp-code-font-family,monospace);"
    "font-size:var(--jp-code-font-size,13px);min-width:36em}"
    ".fnk .fnk-wf-row{display:flex;align-items:center;margin:1px 0}"
    # border-box: a deeper row's indent must not push its axis along (one time axis for all)
    ".fnk .fnk-wf-name{flex:0 0 34em;box-sizing:border-box;overflow:hidden;"
    "text-overflow:ellipsis;white-space:nowrap}"
    ".fnk .fnk-wf-axis{flex:1;position:relative;height:1.1em;"
    "background:var(--jp-layout-color2,#eee)}"
    ".fnk .fnk-wf-bar{position:absolute;top:0;bottom:0;min-width:2px;"
    "background:var(--fnk-info)}"
    ".fnk .fnk-wf-bar.fnk-wf-failed{background:var(--fnk-error)}"
    ".fnk .fnk-wf-said{font-size:.85em;margin:0 0 2px;overflow-wrap:anywhere}"
    ".fnk .fnk-wf-ms{flex:0 0 6em;text-align:right}"
    "</style>"
)


def rows(spans: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(depth, span) in the order a waterfall draws them: each span after its parent, siblings
    by start; a span whose parent is not among them is a root."""
    ids = {span["spanId"] for span in spans}
    children: dict[str, list[dict[str, Any]]] = {}
    roots = []
    for span in sorted(spans, key=lambda s: (s["start"], s["end"])):
        if span["parentSpanId"] in ids:
            children.setdefault(span["parentSpanId"], []).append(span)
        else:
            roots.append(span)
    ordered: list[tuple[int, dict[str, Any]]] = []

    def visit(span: dict[str, Any], depth: int) -> None:
        ordered.append((depth, span))
        for child in children.get(span["spanId"], []):
            visit(child, depth + 1)

    for root in roots:
        visit(root, 0)
    return ordered


def _label(span: dict[str, Any]) -> str:
    """``hop kind: name``, an RPC's name without its package (``FunctionRuntime/InvokeFunction``)."""
    service = str(span["service"]).removeprefix("fnkernel-")
    name = str(span["name"])
    if " " not in name and "/" in name:
        rpc_service, _, method = name.rpartition("/")
        name = f"{rpc_service.rpartition('.')[2]}/{method}"
    return f"{service} {span['kind'].lower()}: {name}"


def _said(span: dict[str, Any]) -> list[str]:
    """The lines under a span's bar: its SHOWN attributes, and why it failed."""
    shown = [
        f"{key.removeprefix('fnkernel.')}={span['attributes'][key]}"
        for key in SHOWN
        if span["attributes"].get(key) not in (None, "")
    ]
    return ([" ".join(shown)] if shown else []) + (
        [f"failed: {span['status']}"] if span["status"] else []
    )


class Waterfall:
    """The spans of one call; ``_repr_html_`` draws bars, ``__repr__`` an indented timeline."""

    def __init__(self, spans: list[dict[str, Any]]) -> None:
        self.rows = rows(spans)
        self.start = min((span["start"] for span in spans), default=0)
        self.end = max((span["end"] for span in spans), default=0)

    def _place(self, span: dict[str, Any]) -> tuple[float, float]:
        """Where the span starts and how long it is, as fractions of the call's time axis."""
        total = max(self.end - self.start, 1)
        return (span["start"] - self.start) / total, (span["end"] - span["start"]) / total

    def _summary(self) -> str:
        trace_id = self.rows[0][1]["traceId"] if self.rows else ""
        return f"trace {trace_id}: {len(self.rows)} spans, {(self.end - self.start) / 1e6:.2f} ms"

    def __repr__(self) -> str:
        if not self.rows:
            return "fn_trace: no traced call (%fn_trace on, then invoke a function)"
        lines = [self._summary()]
        width = max(len("  " * depth + _label(span)) for depth, span in self.rows)
        for depth, span in self.rows:
            offset, length = self._place(span)
            first = round(offset * BAR_WIDTH)
            cells = max(1, round(length * BAR_WIDTH))
            bar = (" " * first + ("!" if span["status"] else "#") * cells).ljust(BAR_WIDTH)
            start_ms = (span["start"] - self.start) / 1e6
            took_ms = (span["end"] - span["start"]) / 1e6
            name = ("  " * depth + _label(span)).ljust(width)
            lines.append(f"{name}  |{bar[:BAR_WIDTH]}|  +{start_ms:.2f} ms  {took_ms:.2f} ms")
            indent = "  " * depth + "    "
            lines += [indent + line for line in _said(span)]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        if not self.rows:
            return "<p><code>fn_trace</code>: no traced call (<code>%fn_trace on</code>)</p>"
        body = []
        for depth, span in self.rows:
            offset, length = self._place(span)
            hover = "\n".join(
                [
                    f"{span['service']} ({span['kind'].lower()}) {span['name']}",
                    *(f"{key} = {value}" for key, value in span["attributes"].items()),
                    *([f"failed: {span['status']}"] if span["status"] else []),
                ]
            )
            failed = " fnk-wf-failed" if span["status"] else ""
            took_ms = (span["end"] - span["start"]) / 1e6
            body.append(
                f"<div class='fnk-wf-row' title='{html.escape(hover, quote=True)}'>"
                f"<span class='fnk-wf-name' style='padding-left:{depth * 1.2:.1f}em'>"
                f"{html.escape(_label(span))}</span>"
                f"<span class='fnk-wf-axis'><span class='fnk-wf-bar{failed}' "
                f"style='left:{offset * 100:.2f}%;width:{length * 100:.2f}%'></span></span>"
                f"<span class='fnk-wf-ms'>{took_ms:.2f} ms</span></div>"
            )
            # What the text says under the bar, said here too: a class sees it on the screen.
            body += [
                f"<div class='fnk-wf-said fnk-muted' style='padding-left:{depth * 1.2 + 1:.1f}em'>"
                f"{html.escape(line)}</div>"
                for line in _said(span)
            ]
        summary = html.escape(self._summary())
        return fragment(
            f"{_STYLE}<div class='fnk-wf'><div class='fnk-muted'>{summary}</div>"
            f"{''.join(body)}</div>"
        )
