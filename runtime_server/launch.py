"""Run `fnkernel serve` as a child process and learn the address it bound.

The server announces itself with one line on stdout (``ANNOUNCEMENT``); this module is the one
place that writes and reads that line, for the demo, the benchmarks and the tests.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

LISTENING_ON = " listening on "


def announcement(runtime: str, services: str, address: str, workspace_root: Path) -> str:
    return f"fnkernel serve: {runtime} runtime ({services}){LISTENING_ON}{address}, workspace root {workspace_root}"


@dataclass
class ServeProcess:
    proc: subprocess.Popen[str]
    address: str
    workspace_root: Path
    announced: str

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (drain, then exit) and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def spawn_serve(workspace_root: Path, *args: str, listen: str = "127.0.0.1:0") -> ServeProcess:
    """Start ``fnkernel serve --listen LISTEN --workspace-root ROOT ARGS...``; wait for its line."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runtime_server.cli",
            "serve",
            "--listen",
            listen,
            "--workspace-root",
            str(workspace_root),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if LISTENING_ON not in line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"fnkernel serve {' '.join(args)} did not start: {line!r}")
    address = line.split(LISTENING_ON, 1)[1].split(", ", 1)[0]
    return ServeProcess(proc, address, workspace_root, line)
