"""Run fnkernel components as child processes and learn the address each one bound.

Every server announces itself with one line on stdout (``announcement``); this module is the one
place that writes and reads that line, for ``fnkernel up``, the demo, the benchmarks and the tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from runtime_server import process

LISTENING_ON = " listening on "


def announcement(component: str, detail: str, address: str, extra: str = "") -> str:
    tail = f", {extra}" if extra else ""
    return f"fnkernel {component}: {detail}{LISTENING_ON}{address}{tail}"


@dataclass
class Child:
    """One component process, started and announced."""

    argv: list[str]
    proc: subprocess.Popen[str]
    address: str
    announced: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (drain, then exit) and wait; SIGKILL if it outlives `timeout`. The exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()  # the announcement pipe
        return code


@dataclass
class ServeProcess(Child):
    workspace_root: Path = field(default_factory=Path)


def start(
    argv: Sequence[str],
    *,
    stderr: int | IO[str] = subprocess.DEVNULL,
    env: dict[str, str] | None = None,
    new_session: bool = False,
) -> Child:
    """Start `argv`, a program that announces itself (``announcement``), and wait for that line."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=stderr,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=new_session,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if LISTENING_ON not in line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{' '.join(argv[2:])} did not start: {line!r}")
    address = line.split(LISTENING_ON, 1)[1].split(", ", 1)[0]
    return Child(list(argv), proc, address, line)


def spawn(
    args: Sequence[str],
    *,
    stderr: int | IO[str] = subprocess.DEVNULL,
    die_with_parent: bool = False,
) -> Child:
    """Start ``fnkernel ARGS...`` and wait for its announcement line.

    With `die_with_parent` the child stops itself (SIGTERM, an orderly stop) when this process
    dies (``process.watch_parent``), so a killed parent (``fnkernel up``, a kernel) leaves no
    orphan behind; and it runs in its own session: a signal to the parent's process group
    (Ctrl-C in a terminal, a kernel interrupt, which ipykernel sends with ``killpg``) stays with
    the parent, which stops its children in order.
    """
    env = None
    if die_with_parent:
        env = {**os.environ, process.PARENT_ENV: str(os.getpid())}
    argv = [sys.executable, "-m", "runtime_server.cli", *args]
    return start(argv, stderr=stderr, env=env, new_session=die_with_parent)


def spawn_serve(workspace_root: Path, *args: str, listen: str = "127.0.0.1:0") -> ServeProcess:
    """Start ``fnkernel serve --listen LISTEN --workspace-root ROOT ARGS...``."""
    child = spawn(["serve", "--listen", listen, "--workspace-root", str(workspace_root), *args])
    return ServeProcess(child.argv, child.proc, child.address, child.announced, workspace_root)
