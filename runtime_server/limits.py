"""The limits of docs/protocol.md, "Limits", checked here.

Every check raises InvalidField naming the field, before any work is accepted.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from fnkernel.adapters import Adapter
from fnkernel.adapters._payloads import MEDIA_TYPES, media_type
from fnkernel.adapters.errors import InvalidHandler
from fnkernel.runtime_server.errors import InvalidField

MAX_RUN_UID_BYTES = 128
MAX_ENV_ENTRIES = 128
MAX_ENV_BYTES = 64 * 1024
MAX_IDLE_TIMEOUT_SECONDS = 86_400
DEFAULT_IDLE_TIMEOUT_SECONDS = 900
MAX_INVOCATION_ID_BYTES = 128
MAX_PAYLOAD_BYTES = 6 * 1024 * 1024
# docs/protocol.md, "Large payloads": a payload past one message's bound is spooled on the node,
# up to this by default (--max-payload-bytes); and from this size a caller on the same machine
# hands it over as a file it wrote once, never copied through the hops (docs/architecture.md,
# "DataFrames beside the peers": from 128 KiB a file is the quicker way, at 100 KiB the two cost
# the same).
DEFAULT_MAX_SPOOLED_BYTES = 2 << 30
SPOOL_FROM_BYTES = 128 << 10
# docs/protocol.md, "Limits": the memory each of a handler's processes may take (Lambda's
# MemorySize is the model: a default, a range, and an error that names it).
DEFAULT_MEMORY_MB = 1024
MIN_MEMORY_MB = 64  # a Python worker takes ~30 MiB before the handler
MAX_MEMORY_MB = 16384
DEFAULT_TIMEOUT_MILLIS = 30_000
MAX_TIMEOUT_MILLIS = 900_000
# No call outlives MAX_TIMEOUT_MILLIS, so no drain needs to wait longer for one.
MAX_DRAIN_TIMEOUT_MILLIS = MAX_TIMEOUT_MILLIS
DEFAULT_DRAIN_MILLIS = 5_000  # how long a delete lets the in-flight invocation finish
INT64_MAX = 2**63 - 1  # the widest integer field on the wire (int64)
MAX_OUTPUTS = 32
MAX_OUTPUT_VALUE_BYTES = 1024
MAX_OUTPUTS_BYTES = 16 * 1024
MAX_MESSAGE_BYTES = 1024  # fatal_error and handler error messages
# Live output (docs/protocol.md, "Live output"): the streams one process relays at once (each
# holds one of its 32 RPC threads), and how long a follower waits for its invocation to start.
MAX_LOG_FOLLOWERS = 8
# docs/protocol.md, "Call streams": the InvokeFunctions streams one process keeps open at once
# (each holds one of its 32 RPC threads while it is open, called or not).
MAX_CALL_STREAMS = 12
# runtimed's, served on an event loop (docs/architecture.md, "Call streams"): a stream holds no
# thread there, only its buffers, so more: as many as a client's pool keeps channels.
MAX_LOOP_CALL_STREAMS = 64
FOLLOW_WAIT_SECONDS = 5.0
# docs/protocol.md, "Batches": a batch's answers that end within this of the last sent wait to go
# with the next (a message through runtimed costs ~0.5 ms of CPU, more than a quick call); so a
# caller learns that an item ended up to this late. 100 ms, not 50: a map of 5 ms items against
# a ProcessPoolExecutor, 1.11x / 1.15x against 1.15x / 1.19x (docs/architecture.md, "A map's items
# on busy cores").
BATCH_SEND_SECONDS = 0.1
# ...but a message holds answers of at most this many bytes in all (one answer alone may be larger,
# up to its output's 6 MiB): several large answers must not pass what one message may carry.
BATCH_MESSAGE_BYTES = 8 << 20
# The invocations a registration remembers as ended: a follower of one answers at once that its
# lines are in its result, rather than waiting for it to start.
ENDED_INVOCATIONS = 64
# gRPC's own receive/send limit sits above the 6 MiB payload limit so that we, not the transport,
# reject an oversized payload, with the status docs/protocol.md, "Limits" names (docs/architecture.md, "Measured facts the design rests on").
GRPC_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_RUN_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_OUTPUT_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")
_ASCII_DIGITS = re.compile(r"[0-9]{1,19}")  # no sign, no spaces, no '_', no other scripts' digits
# A ULID's digits, built with as little Python as can be: every invocation makes one, and
# base64.b32encode (a Python loop) cost 30-45 us of each one's latency (docs/architecture.md,
# "The hot path"). The time's 10 digits are 5 lookups of a pair of digits (10 bits); the 16
# random digits are 16 random bytes, each mapped by its low 5 bits (256 is a multiple of 32, so
# every digit is equally likely).
_CROCKFORD = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_DIGIT_PAIRS = [bytes((high, low)).decode() for high in _CROCKFORD for low in _CROCKFORD]
_RANDOM_DIGIT = bytes(_CROCKFORD[byte & 31] for byte in range(256))


def check_run_uid(run_uid: str) -> str:
    if not run_uid:
        raise InvalidField("run_uid", "must not be empty")
    if len(run_uid.encode()) > MAX_RUN_UID_BYTES:
        raise InvalidField("run_uid", f"longer than {MAX_RUN_UID_BYTES} bytes")
    if not _RUN_UID.fullmatch(run_uid):
        raise InvalidField("run_uid", "must match ^[A-Za-z0-9][A-Za-z0-9._-]*$")
    return run_uid


def check_registration_id(registration_id: str) -> str:
    # docs/protocol.md: a Runtime Server itself always requires a non-empty registration ID.
    if not registration_id:
        raise InvalidField("registration_id", "must not be empty at a Runtime Server")
    return registration_id


def check_registration_attempt(attempt: int) -> int:
    if attempt < 1:
        raise InvalidField("registration_attempt", f"must be >= 1 (one-based), got {attempt}")
    return attempt


def resolve_working_dir(working_dir: str, workspace_root: Path) -> Path:
    """The working directory with symlinks resolved; it must exist inside the workspace root."""
    if not working_dir:
        raise InvalidField("working_dir", "must not be empty")
    path = Path(working_dir)
    if not path.is_absolute():
        raise InvalidField("working_dir", f"must be an absolute path, got {working_dir!r}")
    if "\0" in working_dir:
        raise InvalidField("working_dir", "contains a NUL byte")
    resolved = path.resolve()
    root = workspace_root.resolve()
    if resolved != root and root not in resolved.parents:
        raise InvalidField("working_dir", f"{working_dir} is outside the workspace root {root}")
    if not resolved.is_dir():
        raise InvalidField("working_dir", f"{working_dir} is not an existing directory")
    return resolved


def check_handler(adapter_cls: type[Adapter], handler: str, working_dir: Path | None) -> str:
    """The runtime's own handler rules (python: dotted identifiers; bash: a file inside the
    working dir and a function name), as InvalidField; `working_dir` None: before any file is
    written, by the handler's text alone."""
    try:
        adapter_cls.check_handler(handler, working_dir)
    except InvalidHandler as exc:
        raise InvalidField("handler", str(exc)) from None
    return handler


def check_env(env: Mapping[str, str]) -> dict[str, str]:
    if len(env) > MAX_ENV_ENTRIES:
        raise InvalidField("env", f"{len(env)} entries; at most {MAX_ENV_ENTRIES}")
    total = 0
    for key, value in env.items():
        if not ENV_KEY.fullmatch(key):
            raise InvalidField("env", f"key {key!r} must match ^[A-Za-z_][A-Za-z0-9_]*$")
        if "\0" in value:
            raise InvalidField("env", f"value of {key} contains a NUL byte")
        total += len(key.encode()) + len(value.encode())
    if total > MAX_ENV_BYTES:
        raise InvalidField("env", f"{total} bytes in all; at most {MAX_ENV_BYTES}")
    return dict(env)


def check_idle_timeout(seconds: int, field: str = "idle_timeout_seconds") -> int:
    """0 means the runtimed default; the Runtime Server only bounds it."""
    if not 0 <= seconds <= MAX_IDLE_TIMEOUT_SECONDS:
        raise InvalidField(field, f"must be 0 to {MAX_IDLE_TIMEOUT_SECONDS}, got {seconds}")
    return seconds


def check_memory_mb(memory_mb: int, field: str = "memory_mb") -> int:
    """The memory limit in MiB: 0 → DEFAULT_MEMORY_MB, else MIN_MEMORY_MB to MAX_MEMORY_MB."""
    if memory_mb == 0:
        return DEFAULT_MEMORY_MB
    if not MIN_MEMORY_MB <= memory_mb <= MAX_MEMORY_MB:
        raise InvalidField(
            field,
            f"must be 0 (the default, {DEFAULT_MEMORY_MB}) or {MIN_MEMORY_MB} to {MAX_MEMORY_MB} MiB, got {memory_mb}",
        )
    return memory_mb


MAX_REQUIREMENTS = 64
MAX_REQUIREMENT_BYTES = 512
# The runtimes whose handlers import Python packages (docs/protocol.md, "Requirements").
REQUIREMENTS_RUNTIMES = ("python",)


def check_requirements(
    requirements: Sequence[object], runtime: str, field: str = "requirements"
) -> tuple[str, ...]:
    """A Run's requirements: each a PEP 508 requirement (``pandas>=2.2``, ``pkg[extra]``,
    ``pkg @ URL``), at most MAX_REQUIREMENTS of at most MAX_REQUIREMENT_BYTES; only for a
    Python runtime. InvalidField names the first that is not."""
    if not requirements:
        return ()
    if runtime not in REQUIREMENTS_RUNTIMES:
        raise InvalidField(field, f"the {runtime} runtime takes no Python packages")
    if len(requirements) > MAX_REQUIREMENTS:
        raise InvalidField(field, f"{len(requirements)} requirements; at most {MAX_REQUIREMENTS}")
    from packaging.requirements import InvalidRequirement, Requirement

    checked = []
    for index, text in enumerate(requirements):
        where = f"{field}[{index}]"
        if not isinstance(text, str):
            raise InvalidField(where, "must be a string")
        if len(text.encode()) > MAX_REQUIREMENT_BYTES:
            raise InvalidField(where, f"is longer than {MAX_REQUIREMENT_BYTES} bytes")
        if text.strip().startswith("-"):
            raise InvalidField(
                where, f"{text!r} is an installer option; the index is the stack's to choose"
            )
        try:
            Requirement(text)
        except InvalidRequirement as exc:
            first = str(exc).splitlines()[0]
            raise InvalidField(where, f"{text!r} is not a PEP 508 requirement: {first}") from None
        checked.append(text.strip())
    return tuple(checked)


def requirements_in(text: str) -> list[str]:
    """The requirements a requirements file lists: a line each, without comments (``#`` to the
    line's end) and blank lines. An option line (``-r``, ``--index-url``) is kept, for
    ``check_requirements`` to refuse by name."""
    lines = (line.split(" #", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def check_digest(digest: str) -> str:
    if not _DIGEST.fullmatch(digest):
        raise InvalidField(
            "registration_digest", "must be 'sha256:' followed by 64 lowercase hex digits"
        )
    return digest


def sha256_digest(data: bytes) -> str:
    """``data``'s digest in the form registration_digest takes."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_invocation_id(invocation_id: str) -> str:
    """Empty → a fresh opaque ID (docs/protocol.md: the response always returns the ID in use)."""
    if not invocation_id:
        return new_id("inv_")
    if len(invocation_id.encode()) > MAX_INVOCATION_ID_BYTES:
        raise InvalidField("invocation_id", f"longer than {MAX_INVOCATION_ID_BYTES} bytes")
    if not _PRINTABLE_ASCII.fullmatch(invocation_id):
        raise InvalidField("invocation_id", "must be printable ASCII")
    return invocation_id


def body_too_large(size: int | str, bound: int, why: str = "", what: str = "request body") -> str:
    """A 413's message (the gateway's, and the client's for a payload it would hand over as a
    file: `what` names it): the body's size (or what is known of it: "more than N"), the
    bound, and what sets it."""
    return f"{what} is {size} bytes; at most {bound}{why}"


# What sets the bound, as a 413 names it: a stack's flag, or the kernel's embedded runtime's
# variable (kernel/connection.py: MAX_PAYLOAD_ENV).
MAX_PAYLOAD_WHY = (
    " (the gateway's --max-payload-bytes; a kernel's own runtime: FNKERNEL_MAX_PAYLOAD_BYTES)"
)


def check_input(payload: bytes, why: str = "") -> bytes:
    """`payload`, if one message may carry it; InvalidField naming its size, the bound and
    `why` that bound holds, if not."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise InvalidField("input", f"{len(payload)} bytes; at most {MAX_PAYLOAD_BYTES}{why}")
    return payload


def check_content_type(
    content_type: str, accepted: Sequence[str] = MEDIA_TYPES, runtime: str = ""
) -> str:
    """The media type of `content_type` (its parameters dropped; empty means JSON, the gateway's
    first encoding), one of `accepted`: a runtime's (docs/protocol.md, "Content types")."""
    media = media_type(content_type)
    if media not in accepted:
        takes = f"the {runtime} runtime takes" if runtime else "the built-in runtimes take"
        raise InvalidField(
            "content_type", f"{content_type!r} is not supported; {takes} {', '.join(accepted)}"
        )
    return media


def effective_timeout_millis(timeout_millis: int) -> int:
    """docs/protocol.md: zero means the bounded default, never unlimited work."""
    if timeout_millis < 0:
        raise InvalidField("timeout_millis", f"must not be negative, got {timeout_millis}")
    if timeout_millis == 0:
        return DEFAULT_TIMEOUT_MILLIS
    return min(timeout_millis, MAX_TIMEOUT_MILLIS)


# What a hop waits for an invocation's answer beyond the call's own timeout, for each hop below
# it: a cold start (the registration) and the hop's own work (docs/protocol.md, "Limits").
HOP_SLACK_SECONDS = 10.0


def wait_seconds(timeout_millis: int, hops_below: int) -> float:
    """How long a caller waits for the answer to an invocation of `timeout_millis`, with
    `hops_below` hops between it and the Runtime Server (the gateway: runtimed; a client of the
    gateway: the gateway and runtimed) — derived from the call's own timeout, never a literal."""
    return effective_timeout_millis(timeout_millis) / 1000 + HOP_SLACK_SECONDS * hops_below


# What a hop waits for a FunctionStatus answer, for each hop below it: the server answers from
# memory, so this is room for a busy machine, not for work (docs/protocol.md, "Limits").
STATUS_HOP_SECONDS = 2.5


def status_wait_seconds(hops_below: int) -> float:
    """How long a caller waits for FunctionStatus, `hops_below` hops above the server (runtimed
    and the teaching client: 1; the gateway: 2)."""
    return STATUS_HOP_SECONDS * hops_below


# How long RegisterFunction waits for the handler to load before it answers (READY, FAILED, or
# REGISTERING past this: docs/protocol.md, "Registration").
REGISTER_LOAD_SECONDS = 60.0


def register_wait_seconds(hops_below: int) -> float:
    """How long a caller waits for RegisterFunction's answer, `hops_below` hops above the server
    (runtimed: 1): the load's bound, and the hop's slack."""
    return REGISTER_LOAD_SECONDS + HOP_SLACK_SECONDS * hops_below


# What a stopping component (SIGTERM: `fnkernel down`, a pod's end) gives the calls in flight
# before it closes their connections: the gateway, runtimed and the server alike, so that a call
# drains end to end (`fnkernel serve --drain-timeout`'s default).
STOP_DRAIN_SECONDS = 10.0


def delete_wait_seconds(drain_timeout_millis: int, hops_below: int) -> float:
    """How long a caller waits for a delete that drains for `drain_timeout_millis` (0: the
    default) to be seen through, `hops_below` hops above runtimed."""
    drain = drain_timeout_millis or DEFAULT_DRAIN_MILLIS
    return drain / 1000 + HOP_SLACK_SECONDS * hops_below


def check_drain_timeout(drain_timeout_millis: int, field: str = "drain_timeout_millis") -> int:
    if not 0 <= drain_timeout_millis <= MAX_DRAIN_TIMEOUT_MILLIS:
        raise InvalidField(
            field, f"must be 0 to {MAX_DRAIN_TIMEOUT_MILLIS} ms, got {drain_timeout_millis}"
        )
    return drain_timeout_millis


def parse_count(text: str, field: str, maximum: int = INT64_MAX) -> int:
    """A non-negative integer written in ASCII digits, at most `maximum` — for numbers that arrive
    as text (HTTP headers, query strings, CLI flags). ``int()`` alone would also take ``" 7"``,
    ``"1_000"`` and other scripts' digits, and ``str.isdigit()`` takes ``"²"``."""
    if not _ASCII_DIGITS.fullmatch(text) or int(text) > maximum:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise InvalidField(field, f"must be an integer from 0 to {maximum}, got {shown!r}")
    return int(text)


def parse_byte_bound(text: str, field: str) -> int:
    """A bound in bytes (``--max-payload-bytes``, FNKERNEL_MAX_PAYLOAD_BYTES): ``parse_count``'s,
    and at least 1 — 0 would refuse every payload, and was taken as the default by some of a
    stack's processes and not by others."""
    bound = parse_count(text, field)
    if not bound:
        raise InvalidField(field, f"must be at least 1 byte, got {text!r}")
    return bound


def outputs_problem(outputs: Mapping[str, str]) -> str | None:
    """Why `outputs` breaks the Run.status.outputs bounds, or None if it is fine."""
    if len(outputs) > MAX_OUTPUTS:
        return f"{len(outputs)} outputs; at most {MAX_OUTPUTS}"
    total = 0
    for key, value in outputs.items():
        if not _OUTPUT_KEY.fullmatch(key):
            return f"output key {key!r} must match ^[A-Za-z0-9][A-Za-z0-9_.-]{{0,62}}$"
        size = len(value.encode())
        if size > MAX_OUTPUT_VALUE_BYTES:
            return f"output {key!r} is {size} bytes; at most {MAX_OUTPUT_VALUE_BYTES}"
        total += len(key.encode()) + size
    if total > MAX_OUTPUTS_BYTES:
        return f"outputs total {total} bytes; at most {MAX_OUTPUTS_BYTES}"
    return None


def bounded(text: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """Truncate to `limit` UTF-8 bytes (fatal_error, handler error messages)."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode("utf-8", "ignore") + "..."


def new_id(prefix: str) -> str:
    """An unguessable, time-ordered ID: a ULID (48-bit ms time + 80 random bits), Crockford base32."""
    ms = time.time_ns() // 1_000_000  # 48 bits in 10 digits: the top two bits are zero
    pairs = _DIGIT_PAIRS
    return (
        prefix
        + pairs[ms >> 40 & 1023]
        + pairs[ms >> 30 & 1023]
        + pairs[ms >> 20 & 1023]
        + pairs[ms >> 10 & 1023]
        + pairs[ms & 1023]
        + secrets.token_bytes(16).translate(_RANDOM_DIGIT).decode()
    )
