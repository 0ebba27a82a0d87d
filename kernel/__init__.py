"""The fnkernel Jupyter kernel and its IPython magics (docs/protocol.md, "Kernel").

``%load_ext fnkernel.kernel`` loads the magics into any IPython; the ``fnkernel`` kernelspec runs
``kernel.kernel.FnKernel``, which preloads them. Importing this package imports nothing heavy:
no grpc, and no runtime is started until a magic needs one.
"""

from __future__ import annotations

from typing import Any


def get(name: str) -> Any:
    """The function `name` on the stack this kernel uses, as ``%use NAME`` binds it (the
    kernel's own if it registered it) — ``%use`` from code (README, "Magics")."""
    from fnkernel.kernel.session import get

    return get(name)


def __getattr__(name: str) -> Any:
    """``HandlerFailed``, what a cell catches every handler failure with (README, "Errors"),
    imported when it is first asked for."""
    if name == "HandlerFailed":
        from fnkernel.runtime_server.client.errors import HandlerFailed

        return HandlerFailed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    from fnkernel.kernel.magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from fnkernel.kernel.magics import unload

    unload(ipython)
