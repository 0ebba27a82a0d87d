"""Running fnkernel components as processes, by concern: ``announce`` (starting one and learning
the address it bound, from its announcement line), ``spawn`` (starting a component, from a
``prewarmed`` process when there is one), ``server`` (the wiring of a long-running one: signals,
the child subreaper, orphan reaping, stopping with its parent) and ``argv`` (the one definition
of each component's command line) — for ``fnkernel up``, the kernel, the pod backend, the
benchmarks and tests.
"""

from fnkernel.runtime_server.daemon.announce import (
    LISTENING_ON,
    Child,
    announced,
    announcement,
    start,
)
from fnkernel.runtime_server.daemon.argv import (
    gateway_args,
    runtimed_args,
    serve_args,
    wrapper_server_args,
)
from fnkernel.runtime_server.daemon.prewarmed import READY_LINE, Prewarmed
from fnkernel.runtime_server.daemon.server import (
    GATEWAY_TRIM_THRESHOLD_BYTES,
    PARENT_ENV,
    become_subreaper,
    keep_freed_memory,
    start_reaper,
    wait_for_termination,
    watch_parent,
)
from fnkernel.runtime_server.daemon.spawn import spawn

__all__ = [
    "GATEWAY_TRIM_THRESHOLD_BYTES",
    "LISTENING_ON",
    "PARENT_ENV",
    "READY_LINE",
    "Child",
    "Prewarmed",
    "announced",
    "announcement",
    "become_subreaper",
    "gateway_args",
    "keep_freed_memory",
    "runtimed_args",
    "serve_args",
    "spawn",
    "start",
    "start_reaper",
    "wait_for_termination",
    "watch_parent",
    "wrapper_server_args",
]
