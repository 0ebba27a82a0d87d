"""Runs and Runtime Pods (docs/protocol.md, "Runs"): the control plane's record of what should
run, and ``RunStore``, the one interface through which everything reads and writes it.

A Run is the unit users create. Its spec (``RunSpec``, with its files) never changes; its status
(``RunStatus``) is written by the control plane (scheduling, retry) and by the runtimed of the
assigned pod (registration outcome, idle). Every status write is conditional on the attempt and
pod the writer saw, so a late writer can never overwrite a newer decision — the same fence
docs/protocol.md puts on registration IDs, one level up.

The store of the embedded runtime and ``fnkernel up`` is SQLite (``lifecycle/sqlite.py``); the
control plane, runtimed and the gateway see only this interface (docs/architecture.md, "Seams").
A Run's files travel in the store too: the control plane writes no directory, and the runtimed
of the assigned pod writes them into a workspace of its own (``Runtimed.working_dir``).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypedDict, Unpack

from fnkernel.runtime_server import limits
from fnkernel.runtime_server.wire import NEW

# A pod counts as gone after this long without a heartbeat from its runtimed, or with no answer
# from its Runtime Server to runtimed's health checks (docs/architecture.md, "Retries"): twice
# the longest pause of a component (5 s: a GC, a busy CPU, a VM's stolen time) that must cost
# no attempt and kill no call, with room for the heartbeat's second and a slow store write.
POD_GRACE_SECONDS = 10.0
HEARTBEAT_SECONDS = 1.0  # how often runtimed writes its pod's heartbeat


def files_json(files: Mapping[str, str]) -> bytes:
    """A Run's files (relative path → text) as the one JSON text every store keeps and every
    digest reads: keys sorted, UTF-8 as it is."""
    return json.dumps(dict(files), ensure_ascii=False, sort_keys=True).encode()


def files_digest(files: Mapping[str, str]) -> str:
    """The SHA-256 (hex) of ``files_json(files)``: a Run's files in its spec."""
    return hashlib.sha256(files_json(files)).hexdigest()


@dataclass(frozen=True)
class RunSpec:
    """What a Run was created to run; it never changes (docs/protocol.md, "Runs").

    `files_sha256` stands for its files (``files_digest``), which the store keeps beside it.
    `source` says where it came from and `replica_of` which function a replica serves: neither
    is part of what it runs, nor of its ``digest``."""

    runtime: str
    handler: str
    files_sha256: str
    env: Mapping[str, str] = field(default_factory=dict)
    idle_timeout_seconds: int = 0  # 0: limits.DEFAULT_IDLE_TIMEOUT_SECONDS
    # What each of its handler's processes may take, in MiB (0: limits.DEFAULT_MEMORY_MB;
    # docs/protocol.md, "Limits").
    memory_mb: int = 0
    # Replicas (docs/protocol.md, "Replicas"): one function served by `replicas` Runs of the
    # same spec, each with its own uid, attempt and fence. Replica 0 is named as the function;
    # replica i is FUNCTION.i (replica_name), with replica_of naming the function.
    replicas: int = 1
    replica_of: str = ""
    source: str = ""
    # The Python packages its handler imports, each a PEP 508 requirement, installed on its
    # node beside the pod's own (docs/protocol.md, "Requirements").
    requirements: tuple[str, ...] = ()
    # The names of the stack's secrets whose keys its handler sees as environment variables
    # (docs/protocol.md, "Secrets"); never a value.
    secrets: tuple[str, ...] = ()

    def digest(self) -> str:
        """``sha256:`` + the SHA-256 of what it runs, canonical: its files, runtime, handler,
        env, idle timeout, memory limit, replicas, requirements and secrets' names (each in any
        order the same set), with a default spelled as its value — and no requirements or
        secrets not spelled at all, so a spec without them has the digest it had before there
        were any.
        Equal digests are the same function: the registration digest runtimed gives the
        Runtime Server (docs/protocol.md, "Registration"), what makes a repeated create the
        same one, and the kernel's "is this cell unchanged?"."""
        canonical = {
            "runtime": self.runtime,
            "handler": self.handler,
            "files": self.files_sha256,
            "env": dict(self.env),
            "idleTimeoutSeconds": self.idle_timeout_seconds or limits.DEFAULT_IDLE_TIMEOUT_SECONDS,
            "memoryMb": self.memory_mb or limits.DEFAULT_MEMORY_MB,
            "replicas": self.replicas,
        }
        if self.requirements:
            canonical["requirements"] = sorted(self.requirements)
        if self.secrets:
            canonical["secrets"] = sorted(self.secrets)
        text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return limits.sha256_digest(text.encode())


@dataclass(frozen=True)
class RunStatus:
    """Where a Run stands, written by the control plane (scheduling, retry) and by the runtimed
    of its assigned pod (registration outcome, idle); every write fenced on `attempt` and
    `assigned_pod` (``RunStore.update``)."""

    phase: str = NEW  # NEW: found in the store with no status yet (made there directly)
    attempt: int = 0
    message: str = ""
    outputs: Mapping[str, str] = field(default_factory=dict)
    assigned_pod: str = ""
    failed_at: float = 0.0
    # How a delete unregisters it (set with phase Deleting): cancel the in-flight invocation, or
    # drain it for at most drain_timeout_millis (0: runtimed's default).
    cancel_in_flight: bool = False
    drain_timeout_millis: int = 0
    # How many of its failed attempts do not count against the retry budget: those that failed
    # because the pod was down or restarted (its server unreachable, or it lost the
    # registration), which say nothing about the function.
    uncharged_attempts: int = 0
    # How many times in a row its Runtime Server died while one of its calls was in flight (and
    # lost its registration): a handler that kills its server is Failed after a few, not retried
    # for ever free of charge. A call that succeeds starts the count again.
    server_deaths: int = 0
    # The W3C context of the span that asked for its current attempt's registration (a create,
    # an admission, a retry), when that was traced: runtimed's spans of the registration join
    # that trace (docs/protocol.md, "Tracing"). "" when it was not.
    traceparent: str = ""
    # The version of each of its secrets its registration has (docs/protocol.md, "Secrets"):
    # another version now, and runtimed registers it again.
    secret_versions: Mapping[str, str] = field(default_factory=dict)


class StatusChanges(TypedDict, total=False):
    """The fields of a ``RunStatus`` a status write may change (``RunStore.update``)."""

    phase: str
    attempt: int
    message: str
    outputs: Mapping[str, str]
    assigned_pod: str
    failed_at: float
    cancel_in_flight: bool
    drain_timeout_millis: int
    uncharged_attempts: int
    server_deaths: int
    traceparent: str
    secret_versions: Mapping[str, str]


STATUS_FIELDS = frozenset(StatusChanges.__annotations__)


@dataclass(frozen=True)
class Run:
    """A Run as the store keeps it: its identity, spec and status. `delete_requested`: its
    deletion was asked for in the store itself (on Kubernetes, `kubectl delete`: the object has
    a deletionTimestamp); the control plane deletes it as delete_run would."""

    uid: str
    name: str
    spec: RunSpec
    status: RunStatus = field(default_factory=RunStatus)
    created_at: float = 0.0
    delete_requested: bool = False

    @property
    def function(self) -> str:
        """The function it serves: its own name, or its replica set's."""
        return self.spec.replica_of or self.name

    @property
    def charged_attempts(self) -> int:
        return self.status.attempt - self.status.uncharged_attempts

    def with_status(self, **changes: Unpack[StatusChanges]) -> Run:
        """The Run with `changes` written to its status, as a store writes them."""
        return replace(self, status=replace(self.status, **changes))

    def to_json(self) -> dict[str, Any]:
        """The Run as the gateway shows it: spec and status, camelCase like the gRPC JSON."""
        spec, status = self.spec, self.status
        return {
            "uid": self.uid,
            "name": self.name,
            "spec": {
                "runtime": spec.runtime,
                "handler": spec.handler,
                "source": spec.source,
                # Keys only: a value never leaves the store (docs/protocol.md, "Runs").
                "env": sorted(spec.env),
                "idleTimeoutSeconds": spec.idle_timeout_seconds,
                "memoryMb": limits.check_memory_mb(spec.memory_mb),
                # Only for a replica set: one Run is shown as it always was.
                **({"replicas": spec.replicas} if spec.replicas != 1 else {}),
                **({"replicaOf": spec.replica_of} if spec.replica_of else {}),
                **({"requirements": list(spec.requirements)} if spec.requirements else {}),
                **({"secrets": list(spec.secrets)} if spec.secrets else {}),
            },
            "status": {
                "phase": status.phase,
                "attempt": status.attempt,
                "message": status.message,
                "outputs": dict(status.outputs),
                "assignedPod": status.assigned_pod,
            },
        }


def replica_name(function: str, replica: int) -> str:
    """The name of replica `replica` of `function`: the function's own for replica 0, else
    FUNCTION.N — a name no create can take ("." is not allowed in one)."""
    return function if replica == 0 else f"{function}.{replica}"


def replica_names(run: Run) -> list[str]:
    """The names of the Runs of `run`'s replica set, replica 0 first (one Run: its own)."""
    return [replica_name(run.function, replica) for replica in range(run.spec.replicas)]


@dataclass(frozen=True)
class Pod:
    """A Runtime Pod as the store knows it: `healthy` is whether its Runtime Server answers
    health checks. `expires` is when (``time.time()``) it stops counting as alive unless it
    says so again: its runtimed's last heartbeat + POD_GRACE_SECONDS where the store keeps the
    heartbeats (``RunStore.heartbeat``), ``math.inf`` where the pod's liveness is kept by
    someone else and `healthy` says it (on Kubernetes, the Pod object's Ready condition, from
    its readiness probe)."""

    name: str
    runtime: str
    address: str  # runtimed's FunctionRuntime port
    healthy: bool
    expires: float

    def alive(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return self.healthy and now < self.expires


class Runs(Protocol):
    """The Runs of a store: their spec and files, written once, and their fenced status."""

    def insert(self, run: Run, files: Mapping[str, str]) -> Run:
        """Add a new Run with its files (relative path → text) and return it as stored (a store
        may give it its own uid); RunAlreadyExists if its name is taken, RunTooLarge if the
        store cannot hold it. Both are written or neither."""
        ...

    def files(self, uid: str) -> dict[str, str]:
        """The files the Run was created with; RunNotFound if there is no such Run."""
        ...

    def get(self, name: str) -> Run:
        """The Run named `name`; RunNotFound if there is none."""
        ...

    def get_uid(self, uid: str) -> Run | None: ...

    def get_fresh(self, name: str) -> Run:
        """``get``, from a cache emptied by every write: for reads that must be current on every
        call (the gateway's route)."""
        ...

    def get_uid_fresh(self, uid: str) -> Run | None:
        """``get_uid``, from the same cache (the proxy hop's fence)."""
        ...

    def runs(self, *, pod: str | None = None, phase: str | None = None) -> list[Run]:
        """Every Run, oldest first; only those assigned to `pod`, or in `phase`, when given."""
        ...

    def update(
        self, run: Run, *, expect_phase: str | None = None, **changes: Unpack[StatusChanges]
    ) -> Run | None:
        """The fenced write: `changes` to the Run's status if it still has `run`'s attempt and
        assigned pod (and `expect_phase`, when given). The updated Run, or None if it moved on."""
        ...

    def delete(self, uid: str) -> None: ...

    def load_by_pod(self) -> dict[str, int]:
        """How many live (not Failed/Deleted) Runs each pod holds: the scheduler's load."""
        ...


class Pods(Protocol):
    """The Runtime Pods a store knows, and whether each is alive (``Pod``)."""

    def heartbeat(self, name: str, runtime: str, address: str, healthy: bool) -> None:
        """A pod's runtimed says it is alive (and whether its Runtime Server answers); a store
        whose pods' liveness is kept elsewhere ignores it."""
        ...

    def pods(self, runtime: str | None = None) -> list[Pod]: ...

    def pod(self, name: str) -> Pod | None: ...

    def pod_fresh(self, name: str) -> Pod | None:
        """``pod``, from the cache of ``get_fresh``."""
        ...


class RunStore(Runs, Pods, Protocol):
    """Where Runs and Runtime Pods are kept; shared by every component, safe between threads.
    SQLite on one machine (``lifecycle/sqlite.py``), the API server on Kubernetes
    (``lifecycle/kubernetes/store.py``)."""

    def version(self) -> int:
        """A number that changes whenever another writer has written since this thread last
        asked: a cheap "has anything changed?" for the loops that poll the store."""
        ...

    def close(self) -> None: ...
