"""Built-in adapters: how a handler is loaded and called (docs/protocol.md, "Adapters").

The names below load on first use (PEP 562), so that importing ``adapters.errors`` — which the
client library does at kernel start, through ``runtime_server.wire`` — does not load the worker
supervisor. Which adapter serves which runtime is ``adapters.runtimes``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fnkernel.adapters.base import (
        Adapter,
        FunctionSpec,
        HandlerResult,
        Transfer,
        WorkerAdapter,
    )
    from fnkernel.adapters.bash import BashAdapter
    from fnkernel.adapters.python import PythonAdapter

_HOMES = {
    "Adapter": "fnkernel.adapters.base",
    "FunctionSpec": "fnkernel.adapters.base",
    "HandlerResult": "fnkernel.adapters.base",
    "Transfer": "fnkernel.adapters.base",
    "WorkerAdapter": "fnkernel.adapters.base",
    "BashAdapter": "fnkernel.adapters.bash",
    "PythonAdapter": "fnkernel.adapters.python",
}

__all__ = [
    "Adapter",
    "BashAdapter",
    "FunctionSpec",
    "HandlerResult",
    "PythonAdapter",
    "Transfer",
    "WorkerAdapter",
]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fnkernel.adapters' has no attribute {name!r}")
