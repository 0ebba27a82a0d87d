"""``FnKernel``: ipykernel's IPython kernel with the fnkernel magics preloaded (docs/protocol.md, "Kernel").

Three additions to ``IPythonKernel``: its first kernel_info reply is followed by the embedded
stack's prewarmed processes; an interrupt cancels the invocation in flight from the control
thread (the cell then raises ``KeyboardInterrupt``, the function stays registered); and shutdown
stops the embedded runtime.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ipykernel.ipkernel import IPythonKernel
from ipykernel.kernelapp import IPKernelApp

from fnkernel.kernel.session import session_of

KERNEL_NAME = "fnkernel"
DISPLAY_NAME = "Python 3 (fnkernel)"
_SHUTDOWN_SECONDS = 4.0  # within jupyter_client's shutdown wait, after which it kills the kernel


class FnKernel(IPythonKernel):
    implementation = "fnkernel"
    implementation_version = "0.1.0"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        assert self.shell is not None
        self.shell.extension_manager.load_extension("fnkernel.kernel")
        self.fn_session = session_of(self.shell)

    @property
    def banner(self) -> str:  # type: ignore[override]
        return (
            super().banner + "\nfnkernel: %%function, %invoke, %functions, %fn_trace, %fn_debug\n"
        )

    async def kernel_info_request(self, stream: Any, ident: Any, parent: Any) -> None:
        """Answer, then start the embedded stack's waiting processes: a client asks this first,
        so they import while the user writes the first cell, not while the kernel starts
        (docs/architecture.md, "The first registration")."""
        await super().kernel_info_request(stream, ident, parent)
        self.fn_session.runtime.prewarm()

    async def interrupt_request(self, stream: Any, ident: Any, parent: Any) -> None:
        """Cancel the invocation in flight, if any: its cell raises KeyboardInterrupt as soon
        as the connection is closed. Otherwise, ipykernel's SIGINT."""
        if self.fn_session.cancel_in_flight():
            assert self.session is not None
            self.session.send(stream, "interrupt_reply", {"status": "ok"}, parent, ident=ident)
            return
        await super().interrupt_request(stream, ident, parent)

    def do_shutdown(self, restart: bool) -> dict[str, Any]:  # type: ignore[override]
        self.fn_session.shutdown(_SHUTDOWN_SECONDS)
        self.fn_session.previous.ended(restart)
        result: dict[str, Any] = super().do_shutdown(restart)  # sync in IPythonKernel
        return result


class FnKernelApp(IPKernelApp):
    """ipykernel's application running FnKernel. The kernelspec starts Python with ``-P`` so
    that nothing in the notebook's directory shadows fnkernel while it loads; IPython then
    leaves that directory off ``sys.path`` too (it respects ``-P``). Plain cells must import
    from it as in the stock kernel (docs/protocol.md, "Kernel": ``import helpers`` for a
    ``helpers.py`` beside the notebook), so it is put back where IPython puts it, once the
    kernel and its extension are loaded."""

    def initialize(self, argv: Any = None) -> None:
        # grpc, once a call loads it, logs at INFO on this process's stderr — a cell's output:
        # "Got goaway ... Cancelling all calls" when a stack stops under a kernel. Its errors
        # only, unless the user asks for more.
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
        super().initialize(argv)
        if self.shell is not None:  # the kernel's own variables (MPLBACKEND) are not a cell's
            session_of(self.shell).started_environ = dict(os.environ)

    def init_path(self) -> None:
        if "" in sys.path or self.ignore_cwd:
            return
        # After the standard library, as IPython puts it.
        places = [os.path.basename(path) in ("site-packages", "dist-packages") for path in sys.path]
        sys.path.insert(places.index(True) if True in places else 0, "")
