"""A component process started ahead of need (docs/architecture.md, "The first registration").

``python -m fnkernel.runtime_server.cli.prewarm COMMAND`` imports what ``fnkernel COMMAND`` imports (grpc,
protobuf, tornado, our modules: most of a component's start-up), says so on stdout
(``daemon.READY_LINE``), then waits on stdin for one JSON line ``{"args": [...], "stderr":
PATH}`` and runs ``fnkernel ARGS...`` with its stderr appended to PATH. End of stdin before that
line (the pool was closed, or its owner died) exits at once.

No fork: the process is an ordinary child of whoever started it (``daemon.Prewarmed``), so it is
stopped, watched and restarted like any other component, and gRPC's fork rules never apply.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

from fnkernel.adapters.runtimes import RUNTIMES

# What each component imports on its way to announcing itself.
MODULES = {
    "serve": ("fnkernel.runtime_server.function_runtime.server",),  # and every runtime's adapter
    "runtimed": ("fnkernel.runtime_server.lifecycle.runtimed",),
    "gateway": (
        "fnkernel.runtime_server.lifecycle.controlplane",
        "fnkernel.runtime_server.lifecycle.gateway",
        "tornado.platform.asyncio",
    ),
    "wrapper-server": (
        "fnkernel.runtime_server.krm.evaluators.server",
        "fnkernel.runtime_server.krm.evaluators.wrapper",
    ),
}
COMMON = (
    "concurrent.futures.thread",
    "grpc._channel",
    "grpc._server",
    "fnkernel.runtime_server.cli",
    "fnkernel.runtime_server.client.errors",
    "fnkernel.runtime_server.daemon",
    "fnkernel.runtime_server.logs",
    "fnkernel.runtime_server.tokens",
)


def modules(command: str) -> list[str]:
    """What `command` imports before it announces itself."""
    names = [*COMMON, *MODULES[command]]
    if command == "serve":
        names += (runtime.adapter_module for runtime in RUNTIMES.values())
    return names


def main(command: str) -> int:
    for module in modules(command):
        importlib.import_module(module)
    from fnkernel.runtime_server.cli import build_parser
    from fnkernel.runtime_server.cli import main as cli_main
    from fnkernel.runtime_server.daemon import READY_LINE

    build_parser()  # cached: cli_main uses this one
    print(READY_LINE, flush=True)  # daemon.Prewarmed reads it before it hands over a command line
    line = sys.stdin.readline()
    if not line:
        return 0
    request = json.loads(line)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # as for a component started directly: stdin is /dev/null
    os.close(devnull)
    if request.get("stderr"):
        from fnkernel.system.private import open_private

        log = open_private(Path(request["stderr"]))
        os.dup2(log, 2)
        os.close(log)
    sys.argv = ["fnkernel", *request["args"]]
    return cli_main(request["args"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
