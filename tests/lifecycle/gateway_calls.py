"""Creating and calling Runs through the gateway of a real stack, for the gateway tests."""

from __future__ import annotations

import http.client
import itertools

from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.lifecycle.stack import Stack
from tests.support import http_call

_names = itertools.count()

FAILING_PY = {
    "handler.py": (
        "def handle(event, context):\n"
        "    print('about to fail')\n"
        "    raise ValueError('bad order ' + str(event.get('id')))\n"
    )
}


def create(stack: Stack, files: dict[str, str], *, runtime: str = "python", **kw: object) -> str:
    name = f"fn{next(_names)}"
    handler = "handler.handle" if runtime == "python" else "fn.handle"
    run = Client(stack.gateway_address).create_run(
        name,
        runtime=runtime,
        handler=handler,
        files=files,
        **kw,  # type: ignore[arg-type]
    )
    assert run["status"]["phase"] == "Ready", run
    return name


def invoke(
    stack: Stack, name: str, body: bytes = b"{}", headers: dict[str, str] | None = None
) -> tuple[int, http.client.HTTPMessage, bytes]:
    return http_call(stack.gateway_address, "POST", f"/v1/runs/{name}:invoke", body, headers)
