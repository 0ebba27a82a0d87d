"""Built-in adapters: how a handler is loaded and called (docs/protocol.md, "Adapters").

The names below load on first use (PEP 562), so that importing ``adapters.errors`` — which the
client library does at kernel start, through ``runtime_server.wire`` — does not load the worker
supervisor. Which adapter serves which runtime is ``adapters.runtimes``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from adapters.base import Adapter, FunctionSpec, HandlerResult, WorkerAdapter
    from adapters.bash import BashAdapter
    from adapters.python import PythonAdapter

_HOMES = {
    "Adapter": "adapters.base",
    "FunctionSpec": "adapters.base",
    "HandlerResult": "adapters.base",
    "WorkerAdapter": "adapters.base",
    "BashAdapter": "adapters.bash",
    "PythonAdapter": "adapters.python",
}

__all__ = [
    "Adapter",
    "BashAdapter",
    "FunctionSpec",
    "HandlerResult",
    "PythonAdapter",
    "WorkerAdapter",
]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'adapters' has no attribute {name!r}")
