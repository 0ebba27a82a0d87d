"""The HTTP gateway (docs/protocol.md, "HTTP API", "Errors"): JSON over HTTP in front of each pod's
runtimed.

Tornado (which ipykernel brings) serves it; the control plane runs in the same process. Its
parts: who may call (``access``), how a failure is answered (``failures``), where a call goes
(``routes``), the handlers of the Runs (``handlers``), of invocations (``invoke``, the hot path)
and of live output (``logs``); here, the server that puts them together.
"""

from __future__ import annotations

import asyncio
import socket
import time

from tornado import httpserver, netutil, web

from fnkernel.runtime_server import limits
from fnkernel.runtime_server.lifecycle.gateway.access import Access
from fnkernel.runtime_server.lifecycle.gateway.direct import RouteHandler
from fnkernel.runtime_server.lifecycle.gateway.failures import FailureResponse
from fnkernel.runtime_server.lifecycle.gateway.handlers import (
    FilesHandler,
    NoSuchPath,
    RunHandler,
    RunsHandler,
    log_failure,
)
from fnkernel.runtime_server.lifecycle.gateway.invoke import InvokeHandler
from fnkernel.runtime_server.lifecycle.gateway.logs import LogsHandler
from fnkernel.runtime_server.lifecycle.gateway.payloads import PayloadsHandler
from fnkernel.runtime_server.lifecycle.gateway.routes import Routes
from fnkernel.runtime_server.lifecycle.gateway.secrets import SecretHandler, SecretsHandler

DEFAULT_LISTEN = "127.0.0.1:8080"
# Tornado buffers headers up to this size (then closes the connection), so that everything
# between access.MAX_HEADER_BYTES and it gets a 431 the client can read.
_HEADER_BUFFER_BYTES = 1024 * 1024
# A burst of connections waits in the kernel's accept queue instead of being reset (the kernel
# caps it at net.core.somaxconn).
LISTEN_BACKLOG = 4096

__all__ = ["DEFAULT_LISTEN", "Access", "FailureResponse", "Gateway"]


class Gateway(Routes):
    """The gateway: its routes' state, served over HTTP once it listens."""

    def application(self) -> web.Application:
        args = {"gateway": self}
        return web.Application(
            [
                (r"/v1/runs", RunsHandler, args),
                (r"/v1/runs/([^/:]+):invoke", InvokeHandler, args),
                (r"/v1/runs/([^/:]+):route", RouteHandler, args),
                (r"/v1/runs/([^/:]+)/logs", LogsHandler, args),
                (r"/v1/runs/([^/:]+)/files", FilesHandler, args),
                (r"/v1/runs/([^/:]+)/invocations/([^/]+)/logs", LogsHandler, args),
                (r"/v1/runs/([^/:]+)", RunHandler, args),
                (r"/v1/secrets", SecretsHandler, args),
                (r"/v1/secrets/([^/:]+)", SecretHandler, args),
                (r"/v1/payloads", PayloadsHandler, args),
            ],
            log_function=log_failure,
            default_handler_class=NoSuchPath,
            default_handler_args=args,
        )

    def listen(self, listen: str) -> str:
        self._server = httpserver.HTTPServer(
            self.application(),
            max_body_size=limits.GRPC_MAX_MESSAGE_BYTES,
            max_header_size=_HEADER_BUFFER_BYTES,
            body_timeout=self.body_timeout,
            idle_connection_timeout=self.header_timeout,
            xheaders=False,
        )
        if listen.startswith("unix:"):
            self._server.add_socket(
                netutil.bind_unix_socket(listen[5:], mode=0o600, backlog=LISTEN_BACKLOG)
            )
            self.address = listen
            self.listen_host = "localhost"
        else:
            host, _, port = listen.rpartition(":")
            self.listen_host = host.strip("[]")
            sockets = netutil.bind_sockets(
                int(port), self.listen_host, family=socket.AF_UNSPEC, backlog=LISTEN_BACKLOG
            )
            self._server.add_sockets(sockets)
            bound = sockets[0].getsockname()[1]
            self.address = f"http://{host}:{bound}"
        return self.address

    async def close(self, drain: float = 0.0) -> None:
        """Stop: no new connection or request (503), the requests in progress given up to
        `drain` seconds to end (a call's answer, a log stream), then every connection closed."""
        if self._server is not None:
            self._server.stop()
            self.stopping = True
            deadline = time.monotonic() + drain
            while self.in_progress and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await self._server.close_all_connections()
