"""Built-in adapters: how a handler is loaded and called ("Built-in Runtime Requirements")."""

from __future__ import annotations

from adapters.base import Adapter, FunctionSpec, HandlerResult, WorkerAdapter
from adapters.bash import BashAdapter
from adapters.python import PythonAdapter

ADAPTERS: dict[str, type[WorkerAdapter]] = {
    PythonAdapter.runtime: PythonAdapter,
    BashAdapter.runtime: BashAdapter,
}

__all__ = [
    "ADAPTERS",
    "Adapter",
    "BashAdapter",
    "FunctionSpec",
    "HandlerResult",
    "PythonAdapter",
]
