"""Starting a component and learning the address it bound: the announcement line, the one
place that writes and reads it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

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
        code = wait_or_kill(self.proc, timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()  # the announcement pipe
        return code


def start(
    argv: Sequence[str],
    *,
    stderr: int | IO[str] = subprocess.DEVNULL,
    env: dict[str, str] | None = None,
    new_session: bool = False,
) -> Child:
    """Start `argv`, a program that announces itself (``announcement``), and wait for that line."""
    log = Log.of(stderr)
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=stderr,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=new_session,
    )
    return announced(proc, argv, log)


@dataclass(frozen=True)
class Log:
    """Where a component's stderr goes, if it is a file, and how long it was before the start:
    what the component writes there from then on is its own."""

    fd: int
    start: int

    @classmethod
    def of(cls, stderr: int | IO[str]) -> Log | None:
        try:
            fd = stderr if isinstance(stderr, int) else stderr.fileno()
            return cls(fd, os.fstat(fd).st_size) if fd >= 0 else None
        except (OSError, ValueError, AttributeError):
            return None

    def last_line(self) -> str:
        """The last line the component wrote there (a traceback's last line names the error)."""
        with contextlib.suppress(OSError), open(f"/proc/self/fd/{self.fd}", "rb") as log:
            size = os.fstat(log.fileno()).st_size  # opened anew: ours is for appending only
            log.seek(max(self.start, size - 8192))
            lines = log.read().decode("utf-8", "replace").splitlines()
            return next((line.strip() for line in reversed(lines) if line.strip()), "")
        return ""


def announced(proc: subprocess.Popen[str], argv: Sequence[str], log: Log | None = None) -> Child:
    """Wait for the announcement line of `proc`, started as `argv`; kill it if there is none, and
    say why it did not start: what it printed instead, its exit status and the last line it
    wrote to its log (`log`), so that the reason reaches the terminal, not only the log."""
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if LISTENING_ON not in line:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(2)  # it is exiting: give its last words time to reach the log
        code = proc.poll()
        proc.kill()
        proc.wait()
        reason = [line] if line else []
        if code is not None:
            reason.append(f"exit status {code}")
        last = log.last_line() if log is not None else ""
        if last:
            reason.append(_message_of(last))
        raise RuntimeError(f"{' '.join(argv[2:])} did not start: {'; '.join(reason) or '?'}")
    address = line.split(LISTENING_ON, 1)[1].split(", ", 1)[0]
    return Child(list(argv), proc, address, line)


def _message_of(line: str) -> str:
    """A log line as a person reads it: a structured one's message (``logs``), else the line."""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        record = json.loads(line)
        return str(record["message"]) if isinstance(record, dict) else line
    return line


def wait_or_kill(proc: subprocess.Popen[str], timeout: float) -> int:
    """Wait `timeout` seconds for `proc` to exit, then SIGKILL it; its exit code."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
