"""The I/O engine grpc runs on in a process that imports fnkernel first (docs/architecture.md,
"grpc's I/O engine"): its older poller, which is faster on our hops than the EventEngine grpc
turned on for Python by default.

grpc reads ``GRPC_EXPERIMENTS`` once, while it is imported. So ``install`` (run by the package's
``__init__``: before any of our modules imports grpc, and importing none itself, so a kernel's
start stays free of it) waits for that import, names the engine in the environment for its
length, and takes the name out again: the process's other programs and its children never see
it. A process that imported grpc before fnkernel, or that set ``GRPC_EXPERIMENTS`` itself (even
to ""), keeps what it chose. Standard library only.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.abc import Loader

EXPERIMENTS_ENV = "GRPC_EXPERIMENTS"
# grpc's posix EventEngine for client connections, listeners and every other endpoint, off: its
# iomgr poller (epoll) instead.
LEGACY_POLLER = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"


class _Loader:
    """grpc's own loader, run with LEGACY_POLLER in the environment (an importlib Loader; not
    one by inheritance, so that importing this module imports no ``importlib.abc``)."""

    def __init__(self, inner: Loader, finder: _FirstImport) -> None:
        self._inner = inner
        self._finder = finder

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with contextlib.suppress(ValueError):  # grpc is being imported: the finder's work is done
            sys.meta_path.remove(self._finder)
        os.environ[EXPERIMENTS_ENV] = LEGACY_POLLER
        try:
            self._inner.exec_module(module)
        finally:
            os.environ.pop(EXPERIMENTS_ENV, None)
            # grpc is grpc's own again for whatever reads its loader (resources, reloads).
            module.__loader__ = self._inner
            if module.__spec__ is not None:
                module.__spec__.loader = self._inner


class _FirstImport:
    """Finds grpc as the path would, with ``_Loader`` around its loader, until grpc is imported:
    a look that imports nothing (``importlib.util.find_spec``) leaves it in place."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != "grpc" or EXPERIMENTS_ENV in os.environ:  # set since: the process's own
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self)  # type: ignore[assignment]  # a Loader by its methods
        return spec


def install() -> None:
    """Import grpc on LEGACY_POLLER when it is first imported, unless the process has imported
    it already or chose its experiments."""
    if "grpc" in sys.modules or EXPERIMENTS_ENV in os.environ:
        return
    if not any(isinstance(finder, _FirstImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FirstImport())
