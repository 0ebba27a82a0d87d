"""Built-in adapters: how a handler is loaded and called (docs/protocol.md, "Adapters").

The names below load on first use (PEP 562), so that importing ``adapters.errors`` — which the
client library does at kernel start, through ``runtime_server.wire`` — does not load the worker
supervisor.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from adapters.base import Adapter, FunctionSpec, HandlerResult, WorkerAdapter
    from adapters.bash import BashAdapter
    from adapters.python import PythonAdapter

    ADAPTERS: dict[str, type[WorkerAdapter]]

_HOMES = {
    "Adapter": "adapters.base",
    "FunctionSpec": "adapters.base",
    "HandlerResult": "adapters.base",
    "WorkerAdapter": "adapters.base",
    "BashAdapter": "adapters.bash",
    "PythonAdapter": "adapters.python",
}

__all__ = [
    "ADAPTERS",
    "Adapter",
    "BashAdapter",
    "FunctionSpec",
    "HandlerResult",
    "PythonAdapter",
    "WorkerAdapter",
]


def __getattr__(name: str) -> Any:
    if name == "ADAPTERS":
        from adapters.bash import BashAdapter
        from adapters.python import PythonAdapter

        adapters = {PythonAdapter.runtime: PythonAdapter, BashAdapter.runtime: BashAdapter}
        globals()["ADAPTERS"] = adapters
        return adapters
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'adapters' has no attribute {name!r}")
