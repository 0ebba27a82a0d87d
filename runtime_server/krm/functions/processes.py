"""KRM functions as processes, and what each may take (docs/krm.md, "Limits"): a time limit per
pipeline step, and a memory bound for each process a function runs in.

A pipeline (``pipeline.Runner``) runs each step within its ``Bounds``; whatever starts a process
for the step — the starlark function's interpreter, an exec function, a Kptfile ``exec`` step, a
wrapper server's entrypoint — does it through ``run_function``, which reads the step's bounds
(``current()``): they are the pipeline's, not each evaluator's, so one pair of flags
(``--timeout``, ``--memory``) bounds them all. Outside a pipeline (``fnkernel evaluator``) the
defaults hold.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from fnkernel.adapters.children import spawn_limited
from fnkernel.adapters.errors import OUT_OF_MEMORY
from fnkernel.runtime_server.errors import DeadlineExceeded, EvaluatorSystemError, InvalidField
from fnkernel.runtime_server.limits import DEFAULT_MEMORY_MB, MIN_MEMORY_MB

DEFAULT_TIMEOUT_SECONDS = 300.0


@dataclass(frozen=True)
class Mount:
    """A bind mount of kpt's ``--mount type=bind,src=HOST,dst=PATH``: what a function in a
    container would read at `target` is `source` on this machine (docs/krm.md, "Limits")."""

    source: str
    target: str

    @classmethod
    def parse(cls, spec: str) -> Mount | None:
        """Docker's ``--mount`` syntax; None for a mount that is not a bind (a volume or a
        tmpfs: nothing here to stand in for it); ValueError for one that cannot be read."""
        fields: dict[str, str] = {}
        for part in spec.split(","):
            key, equals, value = part.partition("=")
            if not equals or not key.strip():
                raise ValueError(f"{spec!r}: expected key=value pairs, got {part!r}")
            fields[key.strip().lower()] = value.strip()
        if fields.get("type", "bind") != "bind":
            return None
        source = fields.get("src") or fields.get("source")
        target = fields.get("dst") or fields.get("target") or fields.get("destination")
        if not source or not target:
            raise ValueError(f"{spec!r}: a bind mount needs src= and dst=")
        if not os.path.isabs(target):
            raise ValueError(f"{spec!r}: dst must be an absolute path")
        return cls(os.path.abspath(source), os.path.normpath(target))


@dataclass(frozen=True)
class Bounds:
    """A pipeline's: each step's time limit, and what each of its processes may take (a Run's
    default and least memory: an interpreter needs that much to start); and, standing in for a
    container's file system, the bind mounts a function's paths are read through (host_path).
    InvalidField naming ``timeout`` or ``memory_mb`` for one out of range."""

    timeout: float = DEFAULT_TIMEOUT_SECONDS
    memory_mb: int = DEFAULT_MEMORY_MB
    mounts: tuple[Mount, ...] = ()

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise InvalidField("timeout", f"must be more than 0 seconds, got {self.timeout:g}")
        if self.memory_mb < MIN_MEMORY_MB:
            raise InvalidField("memory_mb", f"at least {MIN_MEMORY_MB} MiB, got {self.memory_mb}")


@dataclass(frozen=True)
class Step:
    """The step running now: until `deadline` (``time.monotonic()``), `memory_mb` a process;
    `bounds` says where those came from, for the messages that name them."""

    deadline: float
    memory_mb: int
    bounds: Bounds


_CURRENT: ContextVar[Step | None] = ContextVar("krm_step", default=None)


def current() -> Step:
    """The running step's bounds; outside any, the defaults from now."""
    step = _CURRENT.get()
    if step is None:
        defaults = Bounds()
        return Step(time.monotonic() + defaults.timeout, defaults.memory_mb, defaults)
    return step


def host_path(path: str) -> str:
    """Where `path`, as a function in a container names it, is on this machine: below a bind
    mount's target, the same place below its source (the deepest target wins); elsewhere, the
    path itself."""
    clean = os.path.normpath(path)
    for mount in sorted(current().bounds.mounts, key=lambda m: len(m.target), reverse=True):
        if clean == mount.target or clean.startswith(mount.target.rstrip("/") + "/"):
            return os.path.join(mount.source, os.path.relpath(clean, mount.target))
    return path


@contextmanager
def running(bounds: Bounds, deadline: float | None = None) -> Iterator[Step]:
    """Run a step within `bounds` (and `deadline`, if sooner); nested, the sooner deadline and
    the smaller memory win."""
    outer = _CURRENT.get()
    until = time.monotonic() + bounds.timeout
    memory_mb = bounds.memory_mb
    if deadline is not None:
        until = min(until, deadline)
    if outer is not None:
        until, memory_mb = min(until, outer.deadline), min(memory_mb, outer.memory_mb)
        bounds = outer.bounds
    step = Step(until, memory_mb, bounds)
    token = _CURRENT.set(step)
    try:
        yield step
    finally:
        _CURRENT.reset(token)


def run_function(argv: list[str], stdin: bytes, deadline: float | None) -> tuple[int, bytes, bytes]:
    """Run `argv` with `stdin`, in its own process group, held to the running step's memory bound
    (RLIMIT_DATA, set on it as soon as it exists: what it maps before that is not counted);
    (exit code, stdout, stderr). The deadline — or the step's, if sooner — kills the whole group:
    DeadlineExceeded."""
    step = current()
    deadline = step.deadline if deadline is None else min(deadline, step.deadline)
    try:
        proc = spawn_limited(
            argv,
            step.memory_mb << 20,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        raise EvaluatorSystemError(f"failed to execute {argv[0]}: {exc}") from None
    try:
        stdout, stderr = proc.communicate(stdin, timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise DeadlineExceeded(
            f"{argv[0]} did not finish within the step's time limit of "
            f"{step.bounds.timeout:g} s (--timeout)"
        ) from None
    except BaseException:
        _kill_group(proc)
        raise
    return proc.returncode, stdout, stderr


def out_of_memory(code: int, stderr: bytes) -> bool:
    """Whether a function process that ended with `code` and `stderr` died of its memory bound."""
    tail = stderr[-4096:].decode("utf-8", "replace")
    return code != 0 and OUT_OF_MEMORY.search(tail) is not None


def memory_message(what: str) -> str:
    step = current()
    return f"{what} needed more than the step's memory bound of {step.memory_mb} MiB (--memory)"


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
