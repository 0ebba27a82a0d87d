"""docs/architecture.md, "grpc's I/O engine": a process that imports fnkernel before grpc runs
grpc on its legacy poller, with nothing left in its environment; a process that chose its own
experiments, or imported grpc first, keeps grpc's default.

Which engine carried a call is read from grpc's own ``tcp`` trace: the legacy poller's
endpoints log from ``tcp_posix.cc``, the EventEngine's from ``endpoint.cc``.
"""

from __future__ import annotations

import os
import subprocess
import sys

# A call through a Unix socket to a server of the same process, then what the environment says.
PROBE = """
import os, subprocess, sys
{first}
from concurrent import futures
server = grpc.server(futures.ThreadPoolExecutor(2))
server.add_insecure_port("unix:" + sys.argv[1])
server.start()
try:
    grpc.insecure_channel("unix:" + sys.argv[1]).unary_unary("/no.Such/Method")(b"", timeout=10)
except grpc.RpcError:
    pass
server.stop(None)
print("env:", os.environ.get("GRPC_EXPERIMENTS"))
child = [sys.executable, "-c", "import os; print('child:', os.environ.get('GRPC_EXPERIMENTS'))"]
print(subprocess.run(child, capture_output=True, text=True).stdout.strip())
"""
FNKERNEL_FIRST = "import fnkernel.runtime_server\nimport grpc"
GRPC_FIRST = "import grpc\nimport fnkernel.runtime_server"
# A library that looks for grpc before it imports it (``importlib.util.find_spec``).
LOOKED_FOR_FIRST = (
    "import fnkernel.runtime_server, importlib.util\n"
    "assert importlib.util.find_spec('grpc') is not None\n"
    "import grpc"
)


def probe(tmp_path: object, first: str, **env: str) -> tuple[str, str]:
    """Run PROBE; its stdout, and which engine's endpoints grpc's trace names."""
    environment = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    environment.update(GRPC_TRACE="tcp", GRPC_VERBOSITY="debug", **env)
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first), f"{tmp_path}/probe.sock"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=60,
        check=True,
    )
    engines = {
        name
        for name, marker in (("legacy poller", "tcp_posix.cc"), ("EventEngine", "endpoint.cc"))
        if marker in done.stderr
    }
    assert len(engines) == 1, done.stderr[-2000:]
    return done.stdout, engines.pop()


def test_fnkernel_imported_first_runs_grpc_on_the_legacy_poller_and_leaves_no_trace(
    tmp_path: object,
) -> None:
    stdout, engine = probe(tmp_path, FNKERNEL_FIRST)
    assert engine == "legacy poller"
    assert "env: None" in stdout  # taken out once grpc was imported
    assert "child: None" in stdout  # so a child never sees it


def test_looking_for_grpc_before_importing_it_changes_nothing(tmp_path: object) -> None:
    stdout, engine = probe(tmp_path, LOOKED_FOR_FIRST)
    assert engine == "legacy poller"
    assert "env: None" in stdout


def test_a_process_that_chose_its_experiments_keeps_them(tmp_path: object) -> None:
    stdout, engine = probe(tmp_path, FNKERNEL_FIRST, GRPC_EXPERIMENTS="")
    assert engine == "EventEngine"  # grpc's default, as chosen
    assert stdout.startswith("env: \n")  # left as it was


def test_a_process_that_imported_grpc_first_keeps_its_engine(tmp_path: object) -> None:
    stdout, engine = probe(tmp_path, GRPC_FIRST)
    assert engine == "EventEngine"
    assert "env: None" in stdout
