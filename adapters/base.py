"""The Adapter protocol and the worker-backed base both built-in adapters share (docs/protocol.md, "Adapters")."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import ClassVar, Protocol

from fnkernel.adapters import _payloads
from fnkernel.adapters.calllogs import LiveLog, LogLine
from fnkernel.adapters.children import RUN_UID_ENV
from fnkernel.adapters.errors import InitError, InvalidHandler
from fnkernel.adapters.worker import Behind, WorkerCall, WorkerSupervisor
from fnkernel.system.private import private_tempdir

JSON = _payloads.JSON
SPOOL_ENV = "FNKERNEL_SPOOL"  # the worker's: where Transfer's names are (its spelling too)
# Environment variables a worker never inherits from the server: they would make bash run code
# before our runner (docs/architecture.md, "Measured facts the design rests on": clear BASH_ENV).
_SCRUBBED_ENV = ("BASH_ENV", "ENV")


@dataclass(frozen=True)
class FunctionSpec:
    """What an adapter needs to load one handler: the registration's immutable inputs."""

    run_uid: str
    working_dir: Path
    handler: str
    env: Mapping[str, str] = field(default_factory=dict)
    memory_mb: int = 0  # what each of its processes may take, in MiB (0: no limit)
    spool: Path | None = None  # the node's spool of large payloads (``Transfer``)


@dataclass(frozen=True)
class Transfer:
    """Where one call's payload and result pass when they are past one message (docs/protocol.md,
    "Large payloads"), by their names in the registration's spool (``FunctionSpec.spool``):
    the input is the file `input` (the call's bytes then empty); a result of at least
    `output_from` bytes is written to the file `output` instead of being answered inline."""

    input: str = ""
    output: str = ""
    output_from: int = 0


INLINE = Transfer()  # everything in the frames
QUEUED_MAX_BYTES = 64 << 10  # the most a call queued behind another carries (``NextCall``)


@dataclass(frozen=True)
class NextCall:
    """A call to queue behind the one being invoked, for a worker to begin as soon as it has
    answered that one, without waiting for the server to read the answer and send the next
    frame (docs/protocol.md, "Batches"). Its fields are checked already; its payload is inline
    and at most QUEUED_MAX_BYTES; `timeout` counts from when it begins; `only_after_ok`: the
    worker skips it if the call before it failed."""

    invocation_id: str
    payload: bytes
    content_type: str
    timeout: float
    only_after_ok: bool = True


@dataclass(frozen=True)
class HandlerResult:
    output: bytes
    content_type: str
    outputs: dict[str, str]
    logs: tuple[LogLine, ...] = ()
    spooled: int = -1  # the size of the output the worker wrote to Transfer.output (-1: inline)


class Adapter(Protocol):
    """One registration's handler, loaded once, invoked one call at a time. The Runtime Server
    types against this; ``adapters.runtimes`` names the class serving each runtime."""

    runtime: ClassVar[str]
    # The media types its handlers take (docs/protocol.md, "Content types").
    content_types: ClassVar[tuple[str, ...]]
    # Whether its worker reads an input from, and writes a result to, the spool (``Transfer``).
    takes_files: ClassVar[bool]
    # Whether a call can be queued behind the one in flight (``NextCall``).
    queues_calls: ClassVar[bool]

    def __init__(
        self,
        spec: FunctionSpec,
        *,
        max_output_bytes: int,
        on_fatal: Callable[[InitError], None] | None = None,
        init_timeout: float = 60.0,
    ) -> None:
        """Nothing starts yet; `on_fatal` hears of a worker that can no longer be replaced."""
        ...

    @classmethod
    def check_handler(cls, handler: str, working_dir: Path | None) -> None:
        """Raise InvalidHandler unless `handler` is well formed and stays inside working_dir;
        None: the files are not written yet (a Run's create), so the handler's text alone is
        checked, touching no disk."""
        ...

    def start(self) -> None:
        """Load the handler; raise InitError when it cannot be loaded."""
        ...

    def invoke(
        self,
        invocation_id: str,
        payload: bytes,
        deadline: float,
        traceparent: str = "",
        content_type: str = JSON,
        transfer: Transfer = INLINE,
        then: NextCall | None = None,
    ) -> HandlerResult:
        """Run one call; `deadline` is a time.monotonic() value; `traceparent`: a traced call's
        W3C context for the handler (docs/protocol.md, "Tracing"), "" for none; `content_type`:
        the payload's media type, one of `content_types`; `transfer`: where a large payload
        and result pass, if the adapter `takes_files` (else the caller inlines the input);
        `then`: the call to queue behind this one, if the adapter `queues_calls` (else it is
        sent when it is invoked). A queued call is invoked next, or cancelled."""
        ...

    def cancel(self, invocation_id: str | None = None, *, why: str = "") -> bool:
        """Kill the call in flight (only `invocation_id`, if given); the adapter stays usable.
        The call fails as cancelled, saying `why` if given."""
        ...

    def follow(self, invocation_id: str) -> LiveLog | None:
        """The live log lines of `invocation_id` while it is in flight (docs/protocol.md, "Live
        output"); None when it is not."""
        ...

    def close(self) -> None:
        """Kill everything and release resources; idempotent."""
        ...


def resolve_inside(working_dir: Path, relative: str) -> Path:
    """`working_dir/relative` with symlinks followed; InvalidHandler if that leaves working_dir."""
    stays_inside(relative)
    root = working_dir.resolve()
    target = (root / relative).resolve()
    if target != root and root not in target.parents:
        raise InvalidHandler(f"{relative!r} resolves outside the working directory")
    return target


def stays_inside(relative: str) -> None:
    """InvalidHandler if the path `relative` leaves the directory it is relative to by its
    text alone (absolute, or more ``..`` than names before them): as ``resolve_inside`` judges
    it in a directory with no symlinks, which a Run's files are (text under relative paths)."""
    path = PurePosixPath(relative)
    depth = 0
    for part in path.parts:
        depth += -1 if part == ".." else 0 if part in ("/", ".") else 1
        if depth < 0:
            break
    if path.is_absolute() or depth < 0:
        raise InvalidHandler(f"{relative!r} resolves outside the working directory")


class WorkerAdapter:
    """An Adapter whose handler runs in a worker process: one WorkerSupervisor per registration;
    subclasses speak the frames."""

    runtime: ClassVar[str]
    content_types: ClassVar[tuple[str, ...]] = (JSON,)
    takes_files: ClassVar[bool] = False
    queues_calls: ClassVar[bool] = False

    def __init__(
        self,
        spec: FunctionSpec,
        *,
        max_output_bytes: int,
        on_fatal: Callable[[InitError], None] | None = None,
        init_timeout: float = 60.0,
    ) -> None:
        self.spec = spec
        self.max_output_bytes = max_output_bytes
        self._on_fatal = on_fatal
        self._init_timeout = init_timeout
        self._supervisor: WorkerSupervisor | None = None
        # Private per-registration files: the worker's log files, Bash's stdout and outputs.
        self.scratch = private_tempdir(self.runtime)

    @classmethod
    def check_handler(cls, handler: str, working_dir: Path | None) -> None:
        raise NotImplementedError

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _exchange(
        self, call: WorkerCall, payload: bytes, content_type: str, transfer: Transfer
    ) -> tuple[bytes, str, dict[str, str], int]:
        """Send one request frame, read its response: (output, content type, outputs, the size
        of the output it spooled or -1)."""
        raise NotImplementedError

    # The worker exited mid-call with this exit code (negative: a signal); None: it crashed.
    _ended: Callable[[WorkerCall, int], tuple[bytes, str, dict[str, str], int]] | None = None

    def _environment(self) -> dict[str, str]:
        env = {**os.environ, **self.spec.env, RUN_UID_ENV: self.spec.run_uid}
        if self.spec.spool is not None:
            env[SPOOL_ENV] = str(self.spec.spool)
        # After the Run's own env, which could name them too: bash sources them before the
        # runner's first line runs.
        for name in _SCRUBBED_ENV:
            env.pop(name, None)
        return env

    def start(self) -> None:
        self._supervisor = WorkerSupervisor(
            argv=self._argv(),
            cwd=self.spec.working_dir,
            env=self._environment(),
            run_uid=self.spec.run_uid,
            scratch=self.scratch,
            memory_bytes=self.spec.memory_mb << 20,
            init_timeout=self._init_timeout,
            on_fatal=self._on_fatal,
        )
        self._supervisor.start()

    def invoke(
        self,
        invocation_id: str,
        payload: bytes,
        deadline: float,
        traceparent: str = "",
        content_type: str = JSON,
        transfer: Transfer = INLINE,
        then: NextCall | None = None,
    ) -> HandlerResult:
        assert self._supervisor is not None, "start() first"
        behind = None
        if then is not None and self.queues_calls:
            condition = b"ok" if then.only_after_ok else b"-"
            behind = Behind(
                then.invocation_id,
                then.timeout,
                lambda queued: (
                    request_frame(queued, len(then.payload), then.content_type, INLINE, condition)
                    + then.payload
                ),
                then.only_after_ok,
            )
        (output, content_type, outputs, spooled), call = self._supervisor.run(
            invocation_id,
            deadline,
            lambda call: self._exchange(call, payload, content_type, transfer),
            self._ended,
            traceparent=traceparent,
            behind=behind,
        )
        return HandlerResult(output, content_type, outputs, tuple(call.logs), spooled)

    def cancel(self, invocation_id: str | None = None, *, why: str = "") -> bool:
        if self._supervisor is None:
            return False
        return self._supervisor.cancel(invocation_id, why=why)

    def follow(self, invocation_id: str) -> LiveLog | None:
        if self._supervisor is None:
            return None
        return self._supervisor.follow(invocation_id)

    def close(self) -> None:
        if self._supervisor is not None:
            self._supervisor.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def send_request(
    call: WorkerCall, payload: bytes, content_type: str = JSON, transfer: Transfer = INLINE
) -> None:
    """Send `call`'s request frame (``request_frame``) and its input, and after them the frame
    of the call queued behind it — only that if its own was queued behind the call before."""
    if call.queued:
        if call.then:
            call.send(call.then)
        return
    head = request_frame(call, len(payload), content_type, transfer)
    if len(payload) < 65536:  # one write for the common small payload
        call.send(head + payload + call.then)
    else:
        call.send(head)
        call.send(payload)
        if call.then:
            call.send(call.then)


def request_frame(
    call: WorkerCall,
    input_len: int,
    content_type: str = JSON,
    transfer: Transfer = INLINE,
    condition: bytes = b"-",
) -> bytes:
    """The request frame both workers read, up to its input: id length, input length, time
    left, the call's ``traceparent`` ("-" for none), the input's type (``_payloads.CODES``),
    the spooled input's and output's names ("-" for none) and the size from which the output
    is spooled (``Transfer``), the condition it runs on ("ok": the call before it answered
    ok; "-": always), the call's nonce (adapters/worker.py); the id."""
    invocation_id = call.invocation_id.encode()
    return b"%d %d %d %s %s %s %s %d %s %s\n%s" % (
        len(invocation_id),
        input_len,
        call.remaining_millis(),
        call.traceparent or b"-",
        _payloads.CODES[content_type],
        transfer.input.encode() or b"-",
        transfer.output.encode() or b"-",
        transfer.output_from,
        condition,
        call.nonce,
        invocation_id,
    )
