"""Names that cross a process boundary, spelled once (docs/protocol.md).

gRPC metadata keys, HTTP headers, Run phases, the error types a caller can branch on, and the two
status tables: our errors → gRPC status, and gRPC status → HTTP status. Standard library (and our
own stdlib-only modules) only: the kernel and the client library import this at start. Status
codes are named by their gRPC names (``"INVALID_ARGUMENT"``), so no grpc import is needed here;
``runtime_server.rpc`` turns a name into a ``grpc.StatusCode``.
"""

from __future__ import annotations

from fnkernel.adapters.errors import (
    HANDLER_NOT_FOUND,
    INITIALIZATION_ERROR,
    OUTPUT_TOO_LARGE,
    WORKER_CRASHED,
    WORKER_KILLED,
    HandlerError,
    InvalidInput,
    InvocationCancelled,
    InvocationTimeout,
    WorkerUnavailable,
)
from fnkernel.runtime_server.errors import (
    AttemptSuperseded,
    DeadlineExceeded,
    DigestConflict,
    EvaluatorSystemError,
    FunctionError,
    InvalidEvaluateRequest,
    InvalidField,
    InvocationInFlight,
    InvocationNotFound,
    NoRuntimePod,
    NotAllowedHere,
    NotFoundError,
    RegistrationLost,
    RegistrationNotFound,
    RegistrationNotReady,
    RequirementsFailed,
    RoutedElsewhere,
    RunAlreadyExists,
    RunFilesMissing,
    RunNotFound,
    RunNotReady,
    SecretNotFound,
    ShuttingDown,
    StaleRegistration,
    StorageFull,
    StoreDamaged,
    TooManyFollowers,
)

__all__ = [
    "HANDLER_NOT_FOUND",
    "INITIALIZATION_ERROR",
    "OUTPUT_TOO_LARGE",
    "WORKER_CRASHED",
    "WORKER_KILLED",
]

# gRPC metadata: runtimed's proxy hop (docs/protocol.md, "Proxy hop")
POD_KEY = "x-fn-pod"  # the pod the caller routed to (routing fence)
COLD_START_KEY = "x-fn-cold-start"  # the Run was registered again for this call
DIGEST_KEY = "x-fn-registration-digest"
ATTEMPT_KEY = "x-fn-registration-attempt"
# gRPC metadata: the per-hop timeline (docs/protocol.md, "Timeline"). Asked for with TIMELINE_KEY
# "1" on the request; each hop answers with its monotonic clock readings in a trailer of its own
# (``fn-``: runtimed relays the server's with the rest).
TIMELINE_KEY = "x-fn-timeline"
TIMELINE_RUNTIMED_KEY = "fn-timeline-runtimed"
TIMELINE_SERVER_KEY = "fn-timeline-server"
# gRPC metadata and HTTP: the spans of a traced call (docs/protocol.md, "Tracing"). W3C trace
# context in (the same name as header and as metadata); each hop hands back its spans and those
# handed to it, OTLP encoded, in a trailer that replaces the one it was handed.
TRACEPARENT_KEY = "traceparent"
SPANS_KEY = "fn-spans-bin"
# gRPC metadata: payloads past one message's bound (docs/protocol.md, "Large payloads"). On a
# request, the spooled input's name, and the size from which the caller takes an output by
# reference; in a trailer, the spooled output's name and size.
INPUT_REF_KEY = "x-fn-input-ref"
OUTPUT_REF_FROM_KEY = "x-fn-output-ref-from"
OUTPUT_REF_KEY = "fn-output-ref"  # a trailer: runtimed relays it with the server's other fn-*
# gRPC metadata: a Runtime Server's handler errors
ERROR_TYPE_KEY = "fn-error-type"
LOGS_KEY = "fn-logs-bin"  # the invocation's log lines, JSON, bounded
# gRPC metadata: FunctionEvaluator
RESULTS_KEY = "fn-results-bin"  # a failed function's results, as a ResourceList (YAML)
EXIT_CODE_KEY = "fn-exit-code"
EVALUATOR_KEY = "fn-evaluator"  # initial metadata: which evaluator of a chain served the call

# HTTP headers of the gateway (docs/protocol.md, "HTTP API")
INVOCATION_ID_HEADER = "X-Invocation-Id"
TIMEOUT_HEADER = "X-Timeout-Ms"
# How a call's failure begins when no process on its path answered before its deadline
# (``rpc.status_body``): not the handler's own deadline, whose failure says how to give more.
NO_ANSWER = "no answer within the call's timeout and the hops' slack"
# The uid of the Run a call is meant for: another Run of the name is not called (RunReplaced).
RUN_UID_HEADER = "X-Fn-Run-Uid"
OUTPUTS_HEADER = "X-Fn-Outputs"
ATTEMPT_HEADER = "X-Fn-Attempt"
COLD_START_HEADER = "X-Fn-Cold-Start"
LOGS_HEADER = "X-Fn-Logs"
TIMELINE_HEADER = "X-Fn-Timeline"  # request "1": the answer's is the timeline, JSON
RUN_HEADER = "X-Fn-Run"  # a replica set's answer: the replica (Run) that served the call
TRACEPARENT_HEADER = "traceparent"  # W3C trace context: the call is traced ("Tracing")
SPANS_HEADER = "X-Fn-Spans"  # a traced call's answer: every hop's spans, OTLP, base64
# A caller on the gateway's machine hands a large payload over by its name in the spool, and
# takes a large result likewise (docs/protocol.md, "Large payloads").
INPUT_REF_HEADER = "X-Fn-Input-Ref"  # request: the input is this spooled payload (empty body)
OUTPUT_REF_FROM_HEADER = "X-Fn-Output-Ref-From"  # request: from this size, answer by reference
OUTPUT_REF_HEADER = "X-Fn-Output-Ref"  # answer: "NAME SIZE", the result spooled (empty body)
SPOOL_HEADER = "X-Fn-Spool"  # answer of a large result sent whole: where this machine's spool is


# gRPC reads a ``unix:PATH`` target as a URI: "," separates addresses, "?" and "#" begin a query
# and a fragment, "%" an escape. A socket whose path holds one binds but cannot be reached, or
# does not bind (docs/architecture.md, "Measured facts the design rests on").
UNIX_TARGET_RESERVED = ",?#%"


def unix_target_problem(path: str) -> str | None:
    """Why gRPC cannot name the socket `path` in a ``unix:`` target, or None if it can."""
    reserved = "".join(c for c in UNIX_TARGET_RESERVED if c in path)
    if not reserved:
        return None
    return f"gRPC cannot name a Unix socket whose path holds {' '.join(reserved)}: {path}"


def call_streams_target(address: str) -> str | None:
    """Where runtimed at `address` serves its call streams on an event loop, beside its other
    RPCs (docs/protocol.md, "Call streams"): a socket of its own in the same directory, for a
    runtimed on a Unix socket; None for one on TCP (its callers are on other machines)."""
    return f"{address}.calls" if address.startswith("unix:") else None


def unsupported_media(content_type: str, types: tuple[str, ...]) -> str | None:
    """Why a request body of `content_type` is not one of `types` (its Content-Type is required:
    none is not JSON here), or names a charset other than UTF-8; None if it is fine: the
    gateway's 415, and a direct call's alike (docs/protocol.md, "Calling runtimed directly")."""
    media, _, parameters = content_type.partition(";")
    if media.strip().lower() not in types:
        return f"Content-Type must be {', '.join(types)}; got {content_type[:100]!r}"
    for parameter in parameters.split(";"):
        key, _, value = parameter.partition("=")
        charset = value.strip().strip('"').lower()
        if key.strip().lower() == "charset" and charset not in ("utf-8", "utf8"):
            return f"a body's text is UTF-8 (RFC 8259 for JSON); got charset={charset[:40]!r}"
    return None


def timeline_stamps(**readings: int) -> str:
    """One hop's clock readings (``time.monotonic_ns()``, the same clock in every process of a
    machine) as a trailer value: ``received=…,called=…``."""
    return ",".join(f"{name}={value}" for name, value in readings.items())


def parse_timeline_stamps(text: str) -> dict[str, int]:
    readings = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name and value.isascii() and value.isdigit():  # isdigit alone takes "²"
            readings[name] = int(value)
    return readings


# Run.status.phase (docs/protocol.md, "Runs")
# Created in the store directly (`kubectl apply` of a Run), not through the control plane: no
# status yet. The control plane checks it as a create would and assigns it (Pending), or fails it.
NEW = ""
PENDING = "Pending"  # assigned (or waiting for a pod); its runtimed has yet to register it
READY = "Ready"  # registered and READY on its pod
IDLE = "Idle"  # scaled to zero after the idle timeout; the next invoke re-registers it
RETRYING = "Retrying"  # an infrastructure failure; the retry engine decides what happens next
FAILED = "Failed"  # terminal: user-code failure, unsupported runtime, or retries exhausted
DELETING = "Deleting"  # delete requested; its runtimed unregisters it (bounded drain)
DELETED = "Deleted"  # unregistered; the control plane removes it from the store

# Our errors → gRPC status (docs/protocol.md, "Errors"). The first class in an exception's MRO
# that is here decides.
GRPC_STATUS: dict[type[Exception], str] = {
    InvalidField: "INVALID_ARGUMENT",
    InvalidInput: "INVALID_ARGUMENT",
    RegistrationNotFound: "NOT_FOUND",
    DigestConflict: "ALREADY_EXISTS",
    StaleRegistration: "FAILED_PRECONDITION",
    RegistrationNotReady: "FAILED_PRECONDITION",
    AttemptSuperseded: "FAILED_PRECONDITION",
    InvocationInFlight: "RESOURCE_EXHAUSTED",
    InvocationNotFound: "NOT_FOUND",
    TooManyFollowers: "RESOURCE_EXHAUSTED",
    InvocationTimeout: "DEADLINE_EXCEEDED",
    InvocationCancelled: "CANCELLED",
    WorkerUnavailable: "UNAVAILABLE",
    ShuttingDown: "UNAVAILABLE",
    HandlerError: "UNKNOWN",
    RunNotFound: "NOT_FOUND",
    RunFilesMissing: "NOT_FOUND",
    RunAlreadyExists: "ALREADY_EXISTS",
    RunNotReady: "FAILED_PRECONDITION",
    RequirementsFailed: "FAILED_PRECONDITION",
    SecretNotFound: "NOT_FOUND",
    RoutedElsewhere: "FAILED_PRECONDITION",
    NoRuntimePod: "UNAVAILABLE",
    RegistrationLost: "UNAVAILABLE",
    NotAllowedHere: "PERMISSION_DENIED",
    StoreDamaged: "INTERNAL",
    StorageFull: "UNAVAILABLE",
    # FunctionEvaluator (docs/protocol.md, "Evaluators", "Wrapper server")
    NotFoundError: "NOT_FOUND",
    InvalidEvaluateRequest: "INVALID_ARGUMENT",
    FunctionError: "INTERNAL",
    DeadlineExceeded: "DEADLINE_EXCEEDED",
    EvaluatorSystemError: "UNAVAILABLE",
}

# gRPC's status codes by number, as a span or a message names them.
GRPC_CODE_NAMES = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
    "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
)  # fmt: skip

# gRPC status → HTTP status at the gateway (docs/protocol.md, "Errors").
HTTP_STATUS: dict[str, int] = {
    "OK": 200,
    "INVALID_ARGUMENT": 400,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "RESOURCE_EXHAUSTED": 429,
    "FAILED_PRECONDITION": 503,
    "DEADLINE_EXCEEDED": 504,
    "UNKNOWN": 502,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "CANCELLED": 503,
    "INTERNAL": 500,
}
# Every 429 and 503 says when to come back.
RETRY_AFTER_CODES = frozenset(
    {"RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "UNAVAILABLE", "CANCELLED"}
)


def status_name(exc: BaseException) -> str | None:
    """The gRPC status name GRPC_STATUS gives `exc`, or None for an unexpected error."""
    for cls in type(exc).__mro__:
        if cls in GRPC_STATUS:
            return GRPC_STATUS[cls]
    return None


def http_status(code_name: str) -> int:
    return HTTP_STATUS.get(code_name, 500)


# A Run a `%%function` cell made has `spec.source` CELL_SOURCE + the cell's fingerprint +
# OWNER_MARK + the kernel that owns it (docs/protocol.md, "Ownership").
CELL_SOURCE = "%%function cell "
OWNER_MARK = " by "


def cell_owner(source: str) -> str:
    """The kernel that owns the Run whose ``spec.source`` is `source`, when a ``%%function``
    cell made it; "" when something else did (the CLI, the HTTP API)."""
    if not source.startswith(CELL_SOURCE):
        return ""
    _, mark, owner = source.partition(OWNER_MARK)
    return owner if mark else "a kernel of an earlier fnkernel"
