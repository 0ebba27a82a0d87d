"""Running fnkernel components as processes: starting one and learning the address it bound
(the announcement line), the command line of each, and the wiring of a long-running server
(signals, the child subreaper, orphan reaping, stopping with its parent).

This is the one place that writes and reads the announcement line and the one place that builds
a component's argv — for ``fnkernel up``, the kernel, the pod backend, the benchmarks and tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from adapters.worker import reap_orphans, trim_logs

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
        code = _wait_or_kill(self.proc, timeout)
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
    log = _Log.of(stderr)
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
class _Log:
    """Where a component's stderr goes, if it is a file, and how long it was before the start:
    what the component writes there from then on is its own."""

    fd: int
    start: int

    @classmethod
    def of(cls, stderr: int | IO[str]) -> _Log | None:
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


def announced(proc: subprocess.Popen[str], argv: Sequence[str], log: _Log | None = None) -> Child:
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


class Prewarmed:
    """Component processes started ahead of need, one per command (docs/architecture.md, "The
    first registration"): each has imported what ``fnkernel COMMAND`` imports and waits for its
    command line (``runtime_server.cli.prewarm``). ``spawn`` takes one when it can, so a component
    starts in tens of milliseconds rather than hundreds.

    They are started as ``spawn(die_with_parent=True)`` starts a component: their own session,
    and the parent's pid to watch once they run. Closing the pool ends those not taken.
    """

    def __init__(
        self, commands: Sequence[str] = ("serve", "runtimed", "gateway"), *, refill: bool = False
    ) -> None:
        """`refill`: each process taken is replaced at once by a new one, so that every start
        of the command (a pod backend's) is a fast one, not only the first."""
        self._refill = refill
        self._lock = threading.RLock()  # also held while a ready line is read
        self._procs: dict[str, subprocess.Popen[str]] = {}
        self._ready: set[int] = set()  # pids whose ready line was read
        for command in commands:
            self._procs[command] = self._launch(command)

    @staticmethod
    def _launch(command: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "runtime_server.cli.prewarm", command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, PARENT_ENV: str(os.getpid())},
            start_new_session=True,
        )

    def pids(self) -> dict[str, int]:
        """The waiting processes, by command."""
        with self._lock:
            return {command: proc.pid for command, proc in self._procs.items()}

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every waiting process has imported what it needs; False on `timeout`."""
        deadline = time.monotonic() + timeout
        with self._lock:
            for proc in self._procs.values():
                if not self._read_ready(proc, deadline):
                    return False
        return True

    def _read_ready(self, proc: subprocess.Popen[str], deadline: float) -> bool:
        """Read `proc`'s ready line (lock held), by `deadline`; False if it did not come."""
        if proc.pid in self._ready:
            return True
        assert proc.stdout is not None
        remaining = max(0.0, deadline - time.monotonic())
        if not select.select([proc.stdout], [], [], remaining)[0]:
            return False
        if proc.stdout.readline().strip() != READY_LINE:
            return False
        self._ready.add(proc.pid)
        return True

    def take(self, command: str) -> subprocess.Popen[str] | None:
        """The waiting process for `command` once it is ready, if there is one and it is
        alive; else None (and a caller starts a fresh process)."""
        with self._lock:
            proc = self._procs.pop(command, None)
            if proc is not None and self._refill:
                self._procs[command] = self._launch(command)
            if proc is not None and not self._read_ready(proc, time.monotonic() + 60):
                _discard(proc)
                return None
            if proc is not None:
                self._ready.discard(proc.pid)
        return proc

    def close(self) -> None:
        with self._lock:
            procs, self._procs = list(self._procs.values()), {}
            self._refill = False
        for proc in procs:
            _discard(proc)


def _discard(proc: subprocess.Popen[str]) -> None:
    """End a prewarmed process that was not used: end of stdin makes it exit."""
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    _wait_or_kill(proc, 5)


def _wait_or_kill(proc: subprocess.Popen[str], timeout: float) -> int:
    """Wait `timeout` seconds for `proc` to exit, then SIGKILL it; its exit code."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def spawn(
    args: Sequence[str],
    *,
    stderr: int | IO[str] = subprocess.DEVNULL,
    die_with_parent: bool = False,
    prewarmed: Prewarmed | None = None,
) -> Child:
    """Start ``fnkernel ARGS...`` and wait for its announcement line.

    With `die_with_parent` the child stops itself (SIGTERM, an orderly stop) when this process
    dies (``watch_parent``), so a killed parent (``fnkernel up``, a kernel) leaves no
    orphan behind; and it runs in its own session: a signal to the parent's process group
    (Ctrl-C in a terminal, a kernel interrupt, which ipykernel sends with ``killpg``) stays with
    the parent, which stops its children in order.

    From `prewarmed` (started with die_with_parent) a waiting process runs ARGS, with `stderr`
    appended to by its name; if it fails to announce itself, a fresh process is started.
    """
    argv = [sys.executable, "-m", "runtime_server.cli", *args]
    proc = prewarmed.take(args[0]) if prewarmed is not None else None
    if proc is not None and proc.stdin is not None:
        log = getattr(stderr, "name", None)
        request = {"args": list(args), "stderr": log if isinstance(log, str) else None}
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.close()
            return announced(proc, argv, _Log.of(stderr))
        except (OSError, RuntimeError):
            _discard(proc)  # it died meanwhile: start afresh
    env = None
    if die_with_parent:
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
    return start(argv, stderr=stderr, env=env, new_session=die_with_parent)


def spawn_serve(
    runtime: str, workspace_root: Path, *extra: str, listen: str = "127.0.0.1:0"
) -> ServeProcess:
    """Start ``fnkernel serve`` for `runtime` (``serve_args``), with `extra` flags."""
    child = spawn(serve_args(runtime, listen, workspace_root, *extra))
    return ServeProcess(child.argv, child.proc, child.address, child.announced, workspace_root)


_PR_SET_CHILD_SUBREAPER = 36
PARENT_ENV = "FNKERNEL_PARENT_PID"  # set by spawn(die_with_parent=True)
READY_LINE = "fnkernel prewarm: ready"  # a prewarmed process has imported what it needs


def _prctl(option: int, value: int) -> bool:
    try:
        # The C library this process already has loaded (find_library would run ldconfig).
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except OSError:
        return False


def become_subreaper() -> bool:
    """Adopt our workers' orphaned grandchildren so they can be reaped (docs/architecture.md, "Measured facts the design rests on")."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def watch_parent(interval: float = 0.25) -> threading.Thread | None:
    """In a component started with ``spawn(die_with_parent=True)``: SIGTERM ourselves
    (an orderly stop) once the parent that started us is gone — killed, even with SIGKILL.

    A parent-pid watch rather than ``PR_SET_PDEATHSIG``: that needs a ``preexec_fn``, which runs
    Python between fork and exec, where gRPC's fork handlers can crash the child of a process
    with gRPC threads. The variable is removed from our environment so that nothing we start
    inherits it.
    """
    expected = os.environ.pop(PARENT_ENV, "")
    if not expected.isdigit():
        return None
    parent = int(expected)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)

    if os.getppid() != parent:  # gone before we even started
        os.kill(os.getpid(), signal.SIGTERM)
    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def start_reaper(stop: threading.Event, interval: float = 1.0) -> threading.Thread:
    """Once a second, in a Runtime Server: reap the orphans its workers left, and free on disk
    what calls in progress logged beyond what they keep (``adapters.worker.trim_logs``)."""

    def loop() -> None:
        while not stop.wait(interval):
            reap_orphans()
            trim_logs()

    thread = threading.Thread(target=loop, name="reaper", daemon=True)
    thread.start()
    return thread


def wait_for_termination(poll: float = 0.1) -> int:
    """Block until SIGTERM or SIGINT; returns the signal number.

    The handler only appends to a list: it runs in the main thread between bytecodes, possibly
    inside a lock acquire, so taking any lock there (``Event.set()``) can deadlock the very
    thread that must stop the server — which left servers running after SIGTERM. Not sigwait
    either: that needs the signals blocked before gRPC starts its threads.
    """
    received: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        received.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    while not received:
        time.sleep(poll)  # a signal runs the handler at once; the loop sees it within `poll`
    return received[0]


# The one definition of each component's command line: every process that starts another builds
# its argv here, and tests/lifecycle/test_daemon.py parses each with the CLI's own parser.


def serve_args(runtime: str, listen: str, workspace_root: Path, *extra: str) -> list[str]:
    """``fnkernel serve``: a Runtime Server for one runtime."""
    return [
        "serve",
        "--runtime",
        runtime,
        "--listen",
        listen,
        "--workspace-root",
        str(workspace_root),
        *extra,
    ]


def runtimed_args(
    pod: str, runtime: str, server: str, listen: str, poll_interval: float, state_dir: Path
) -> list[str]:
    """``fnkernel runtimed``: the agent of one Runtime Pod, beside its server."""
    return [
        "runtimed", "--pod", pod, "--runtime", runtime, "--server", server, "--listen", listen,
        "--poll-interval", str(poll_interval), "--state-dir", str(state_dir),
    ]  # fmt: skip


def gateway_args(
    listen: str,
    state_dir: Path,
    *,
    token_file: Path | None = None,
    no_token: bool = False,
    allow_origins: Sequence[str] = (),
    allow_hosts: Sequence[str] = (),
) -> list[str]:
    """``fnkernel gateway``: the HTTP gateway with the control plane. The token travels in a
    file, never in argv, which every local user can read."""
    args = ["gateway", "--listen", listen, "--state-dir", str(state_dir)]
    if token_file is not None:
        args += ["--token-file", str(token_file)]
    if no_token:
        args += ["--no-token"]
    for origin in allow_origins:
        args += ["--allow-origin", origin]
    for host in allow_hosts:
        args += ["--allow-host", host]
    return args


def wrapper_server_args(entrypoint: Sequence[str], port: int = 0) -> list[str]:
    """``fnkernel wrapper-server``: one KRM function entrypoint over FunctionEvaluator."""
    return ["wrapper-server", "--port", str(port), "--", *entrypoint]
