"""Typed views of what the gateway answers (docs/protocol.md, "HTTP API"). Standard library only.

Each view is the JSON it was read from — a dict, so ``run["status"]["phase"]`` and
``json.dumps(run)`` work as they always did — with attributes named in Python on top
(``run.phase``, ``run.live.in_flight``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fnkernel.runtime_server import payloads, wire

if TYPE_CHECKING:
    from fnkernel.runtime_server.client.transport import Headers


class LiveStatus(dict[str, Any]):
    """A Run's registration as its Runtime Server reports it (FunctionStatus)."""

    @property
    def state(self) -> str:
        return str(self.get("state", ""))

    @property
    def registration_id(self) -> str:
        return str(self.get("registrationId", ""))

    @property
    def registration_attempt(self) -> int:
        return int(self.get("registrationAttempt") or 0)

    @property
    def registration_digest(self) -> str:
        return str(self.get("registrationDigest", ""))

    @property
    def in_flight(self) -> int:
        return int(self.get("inFlight") or 0)

    @property
    def last_activity_unix_nano(self) -> int:
        return int(self.get("lastActivityUnixNano") or 0)

    @property
    def fatal_error(self) -> str:
        return str(self.get("fatalError", ""))


class Run(dict[str, Any]):
    """A Run: its spec, its status, and — from ``Client.status`` — its live registration
    (``live``, None when it has none; ``live_error`` says why)."""

    def _spec(self, key: str, default: Any = "") -> Any:
        return (self.get("spec") or {}).get(key, default)

    def _status(self, key: str, default: Any = "") -> Any:
        return (self.get("status") or {}).get(key, default)

    @property
    def uid(self) -> str:
        return str(self.get("uid", ""))

    @property
    def name(self) -> str:
        return str(self.get("name", ""))

    @property
    def runtime(self) -> str:
        return str(self._spec("runtime"))

    @property
    def replica_of(self) -> str:
        """The function a replica Run serves (FUNCTION.N of a replica set); "" for a function's
        own Run."""
        return str(self._spec("replicaOf", "") or "")

    @property
    def handler(self) -> str:
        return str(self._spec("handler"))

    @property
    def source(self) -> str:
        return str(self._spec("source"))

    @property
    def owner(self) -> str:
        """The kernel that owns it, when a ``%%function`` cell made it; "" when the CLI or the
        HTTP API did (docs/protocol.md, "Ownership")."""
        return wire.cell_owner(self.source)

    @property
    def env_keys(self) -> list[str]:
        """The keys of its environment: the gateway never shows their values."""
        return list(self._spec("env", None) or [])

    @property
    def idle_timeout_seconds(self) -> int:
        return int(self._spec("idleTimeoutSeconds", 0) or 0)

    @property
    def phase(self) -> str:
        return str(self._status("phase"))

    @property
    def attempt(self) -> int:
        return int(self._status("attempt", 0) or 0)

    @property
    def message(self) -> str:
        return str(self._status("message"))

    @property
    def outputs(self) -> dict[str, str]:
        return dict(self._status("outputs", None) or {})

    @property
    def assigned_pod(self) -> str:
        return str(self._status("assignedPod"))

    @property
    def live(self) -> LiveStatus | None:
        live = self.get("live")
        return LiveStatus(live) if isinstance(live, Mapping) else None

    @property
    def live_error(self) -> str:
        return str(self.get("liveError", ""))

    @property
    def ready(self) -> bool:
        return self.phase == wire.READY

    @property
    def failed(self) -> bool:
        return self.phase == wire.FAILED


NOT_SPOOLED: Any = object()  # InvocationResult.spooled of a result that came in its answer


@dataclass(frozen=True)
class InvocationResult:
    """One invocation's answer: the raw output, its outputs and how it went."""

    output: bytes
    content_type: str
    outputs: dict[str, str]
    invocation_id: str
    duration: float
    attempt: int
    cold_start: bool
    logs: list[dict[str, str]] = field(default_factory=list)
    run: str = ""  # of a replica set: the replica that served it (docs/protocol.md, "Replicas")
    spans: bytes = b""  # a traced call's: every hop's spans, OTLP (docs/protocol.md, "Tracing")
    # A result read from the spool (docs/protocol.md, "Large payloads"): its value, `output`
    # then empty.
    spooled: Any = field(default=NOT_SPOOLED, repr=False, compare=False)
    # The bytes of the output written to ``invoke``'s `write_to` (`output` then empty); -1 when
    # the output is held.
    written: int = -1

    @classmethod
    def answered(
        cls,
        reply: Headers,
        output: bytes,
        started: float,
        spans: bytes = b"",
        spooled: Any = NOT_SPOOLED,
        written: int = -1,
    ) -> InvocationResult:
        """A call's result from the gateway's answer to it, `reply` (its headers) and `output`
        (its body), the call begun at `started` (``time.perf_counter()``)."""
        return cls(
            output=output,
            content_type=reply.get("Content-Type", ""),
            outputs=_json_header(reply, wire.OUTPUTS_HEADER, {}),
            invocation_id=reply.get(wire.INVOCATION_ID_HEADER, ""),
            duration=time.perf_counter() - started,
            attempt=int(reply.get(wire.ATTEMPT_HEADER) or 0),
            cold_start=reply.get(wire.COLD_START_HEADER) == "1",
            logs=_json_header(reply, wire.LOGS_HEADER, []),
            run=reply.get(wire.RUN_HEADER, ""),
            spans=spans,
            spooled=spooled,
            written=written,
        )

    def value(self) -> Any:
        """The output decoded by its content type (docs/protocol.md, "Content types"): the
        kind the handler returned — a DataFrame, table or array from Arrow IPC, bytes, or
        JSON. PayloadError (a ValueError) if it is not what its type says, or its kind's
        package is not installed here."""
        if self.written >= 0:
            raise payloads.PayloadError(
                f"the result was written to a file ({self.written} bytes): read it from there"
            )
        if self.spooled is not NOT_SPOOLED:
            return self.spooled
        return payloads.decode(self.output, self.content_type, "the result")

    def decoded(self) -> Any:
        """``value()``, or the output as text when it is not the JSON it claims to be."""
        try:
            return self.value()
        except payloads.PayloadError:
            if payloads.media_type(self.content_type) != payloads.JSON:
                raise
            return self.output.decode("utf-8", "replace")


def _json_header(reply: Headers, name: str, empty: Any) -> Any:
    """A header's JSON value; `empty` (a fresh ``[]`` or ``{}``) when it is absent or empty,
    as most calls' logs and outputs are, without parsing it."""
    text = reply.get(name)
    return json.loads(text) if text and text not in ("[]", "{}") else empty
