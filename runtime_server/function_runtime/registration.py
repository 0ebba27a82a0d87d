"""One registration of a Run as the Runtime Server holds it, and the snapshots it answers with
(docs/protocol.md, "Registration"); ``function_runtime.registry`` is the state machine over them."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

from fnkernel.adapters import Adapter, FunctionSpec, HandlerResult
from fnkernel.adapters.calllogs import LogLine
from fnkernel.runtime_server import limits
from fnkernel.runtime_server._proto.executor.v1.runtime_pb2 import FunctionRegistrationState

REGISTERING = FunctionRegistrationState.FUNCTION_REGISTRATION_STATE_REGISTERING
READY = FunctionRegistrationState.FUNCTION_REGISTRATION_STATE_READY
DRAINING = FunctionRegistrationState.FUNCTION_REGISTRATION_STATE_DRAINING
FAILED = FunctionRegistrationState.FUNCTION_REGISTRATION_STATE_FAILED


def state_name(state: int) -> str:
    return FunctionRegistrationState.Name(state).removeprefix("FUNCTION_REGISTRATION_STATE_")


@dataclass
class Registration:
    """One local registration generation of a Run (mutable; guarded by Registry._lock)."""

    run_uid: str
    registration_id: str
    attempt: int
    digest: str
    spec: FunctionSpec
    adapter: Adapter
    state: int = REGISTERING
    in_flight: int = 0
    invocation_id: str = ""
    last_activity_unix_nano: int = 0
    fatal_error: str = ""
    loaded: threading.Event = field(default_factory=threading.Event)
    # The last invocation that ended, and its log lines (its result's): for a follower that
    # comes when it is over (docs/protocol.md, "Live output").
    last_invocation_id: str = ""
    last_logs: tuple[LogLine, ...] = ()
    # The invocations that ended before it, the most recent ENDED_INVOCATIONS: a follower of
    # one is told at once that it is over, not kept waiting for it to start.
    ended: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=limits.ENDED_INVOCATIONS)
    )


@dataclass(frozen=True)
class RegistrationView:
    """A snapshot of a registration, as FunctionStatus reports it."""

    run_uid: str
    registration_id: str
    state: int
    in_flight: int
    last_activity_unix_nano: int
    fatal_error: str

    @classmethod
    def of(cls, reg: Registration) -> RegistrationView:
        return cls(
            reg.run_uid,
            reg.registration_id,
            reg.state,
            reg.in_flight,
            reg.last_activity_unix_nano,
            reg.fatal_error,
        )


@dataclass(frozen=True)
class InvocationOutcome:
    invocation_id: str
    result: HandlerResult
    output_ref: str = ""  # the spooled output's name (its size: result.spooled)
