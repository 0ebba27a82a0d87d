"""A Run and a Runtime Pod as Kubernetes objects (docs/kubernetes.md, "The object model").

A Run is an object of the custom resource ``runs.fnkernel.dev/v1alpha1``: its spec (runtime,
handler, env, idleTimeoutSeconds, memoryMb, requirements, secrets, source, and its files: inline in ``files``, or in
ConfigMaps it owns named by ``filesFrom``) is what was created; its status
(phase, attempt, assignedPod, message, ...) is written only through the status subresource.
Its UID is ``metadata.uid``. The Run's own name is ``metadata.name`` where that is a valid
object name, else (upper case, ``_``) an escaped one with the name in the annotation NAME_KEY.

A Runtime Pod is a pod labelled ROLE_LABEL=RUNTIME_POD and RUNTIME_LABEL=<runtime>, with its
runtimed's port named RUNTIMED_PORT, a pod of the Deployment ``deployment_name(runtime)``; it
is alive while it is Ready and not being deleted.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import re
import secrets
from collections.abc import Mapping
from typing import Any

from fnkernel.runtime_server import limits
from fnkernel.runtime_server.errors import RunFilesMissing, RunTooLarge
from fnkernel.runtime_server.lifecycle.runs import (
    STATUS_FIELDS,
    Pod,
    Run,
    RunSpec,
    RunStatus,
    files_digest,
    files_json,
)
from fnkernel.runtime_server.wire import NEW

GROUP = "fnkernel.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "Run"
PLURAL = "runs"
# Kept on every Run until its registration is gone: a `kubectl delete` then waits for runtimed.
FINALIZER = "fnkernel.dev/unregister"
NAME_KEY = "fnkernel.dev/name"  # annotation: the Run's name where metadata.name cannot be it
ROLE_LABEL = "app.kubernetes.io/component"
RUNTIME_POD = "runtime-pod"
RUNTIME_LABEL = "fnkernel.dev/runtime"
# On a Run: the pod it is assigned to, so that runtimed watches its own Runs alone (a label
# selector), not every Run of the namespace with its files (docs/kubernetes.md, "Reads").
POD_LABEL = "fnkernel.dev/pod"
RUNTIMED_PORT = "runtimed"  # the name of the container port runtimed listens on
RUNTIME_POD_SELECTOR = f"{ROLE_LABEL}={RUNTIME_POD}"
# The largest object the API server keeps: etcd's default request limit (1.5 MiB). A Run that
# would be larger as stored is refused before it is sent (RunTooLarge, 413 at the gateway).
MAX_OBJECT_BYTES = 1_572_864
# What the API server stores beyond what a create sends (docs/kubernetes.md, "How large a Run
# may be"): the status its writers put, at most what the CRD's schema lets it hold (a message
# of 4096, outputs of 16 KiB, the rest short), and their entries of managedFields (one for each
# writer of the status: the control plane's and runtimed's, a few hundred bytes each); the
# spec's entry, which names every file, is counted from the spec itself (``stored_size``).
STATUS_RESERVE_BYTES = 4096 + limits.MAX_OUTPUTS_BYTES + 4096 + 3 * 1024
_MANAGED_ENTRY_BYTES = 512  # an entry's manager, operation, time and apiVersion
# A Run made through the gateway keeps its files in ConfigMaps it owns, not in itself, so that
# they do not travel in every watch event of the Run (docs/kubernetes.md, "Reads"): the parts,
# in order, of one JSON object (path → text), each part the key FILES_KEY of one ConfigMap.
FILES_KEY = "files.json.part"
# The text of one part: the API server keeps at most 1 MiB of a ConfigMap's data.
FILES_PART_BYTES = 1_000_000
# The parts a Run's files may take (deploy/crd.yaml): 6 MiB of text is 7 as JSON escapes it,
# unless it is full of control characters, which JSON writes six bytes each.
MAX_FILES_PARTS = 16
RUN_LABEL = "fnkernel.dev/run"  # on a ConfigMap of a Run's files: the Run's object name
RUN_FILES = "run-files"  # its ROLE_LABEL


def deployment_name(runtime: str) -> str:
    """The Deployment whose pods serve `runtime` (deploy/runtime-pods.yaml)."""
    return f"fnkernel-{runtime}"


_OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
# RunStatus field → status key: the fields a status write may change.
STATUS_KEYS = {
    "phase": "phase",
    "attempt": "attempt",
    "message": "message",
    "outputs": "outputs",
    "assigned_pod": "assignedPod",
    "failed_at": "failedAt",
    "cancel_in_flight": "cancelInFlight",
    "drain_timeout_millis": "drainTimeoutMillis",
    "uncharged_attempts": "unchargedAttempts",
    "server_deaths": "serverDeaths",
    "traceparent": "traceparent",
    "secret_versions": "secretVersions",
}
assert set(STATUS_KEYS) == STATUS_FIELDS
# In a cached object only (``without_files``): the digest of the inline files it dropped.
_CACHED_FILES_SHA256 = "_filesSha256"


def object_name(name: str) -> str:
    """The object name of the Run named `name`: itself if Kubernetes allows it (a DNS label),
    else its lower-case spelling with ``_`` as ``-`` and a hash of the name, so that two names
    never share one object."""
    if _OBJECT_NAME.fullmatch(name):
        return name
    spelled = re.sub(r"[^a-z0-9-]", "-", name.lower()).strip("-")[:48] or "run"
    return f"{spelled}-{hashlib.sha256(name.encode()).hexdigest()[:10]}"


def _timestamp(text: str | None) -> float:
    if not text:
        return 0.0
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def run_name(obj: Mapping[str, Any]) -> str:
    """The Run's name: the annotation NAME_KEY, else the object's name."""
    meta = obj.get("metadata") or {}
    return str((meta.get("annotations") or {}).get(NAME_KEY) or meta.get("name", ""))


def _listed(value: Any) -> tuple[Any, ...]:
    """A list field as a tuple; any other value as the one item of one, for the create's
    check to name (the CRD's schema lets no other through an API server)."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def run_of(obj: Mapping[str, Any]) -> Run:
    """The Run an object of ours holds (a missing field: its default; no status: NEW)."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    return Run(
        uid=meta.get("uid", ""),
        name=run_name(obj),
        spec=RunSpec(
            runtime=str(spec.get("runtime", "")),
            handler=str(spec.get("handler", "")),
            files_sha256=files_sha256(obj),
            source=str(spec.get("source") or f"{len(spec.get('files') or {})} file(s)"),
            env=dict(spec.get("env") or {}),
            idle_timeout_seconds=int(spec.get("idleTimeoutSeconds") or 0)
            or limits.DEFAULT_IDLE_TIMEOUT_SECONDS,
            memory_mb=int(spec.get("memoryMb") or 0),
            replicas=int(spec.get("replicas") or 1),
            replica_of=str(spec.get("replicaOf", "")),
            requirements=_listed(spec.get("requirements")),
            secrets=_listed(spec.get("secrets")),
        ),
        status=RunStatus(
            phase=str(status.get("phase", NEW)),
            attempt=int(status.get("attempt", 0)),
            message=str(status.get("message", "")),
            outputs=dict(status.get("outputs") or {}),
            assigned_pod=str(status.get("assignedPod", "")),
            failed_at=float(status.get("failedAt", 0.0)),
            cancel_in_flight=bool(status.get("cancelInFlight", False)),
            drain_timeout_millis=int(status.get("drainTimeoutMillis", 0)),
            uncharged_attempts=int(status.get("unchargedAttempts", 0)),
            server_deaths=int(status.get("serverDeaths", 0)),
            traceparent=str(status.get("traceparent", "")),
            secret_versions=dict(status.get("secretVersions") or {}),
        ),
        created_at=_timestamp(meta.get("creationTimestamp")),
        delete_requested=bool(meta.get("deletionTimestamp")),
    )


def files_sha256(obj: Mapping[str, Any]) -> str:
    """The digest of a Run's files (``files_digest``): its ``filesFrom``'s, else that of its
    inline files (kept by ``without_files`` when their text is dropped)."""
    spec = obj.get("spec") or {}
    source = files_from(obj)
    if source is not None:
        return str(source.get("sha256", ""))
    return str(spec.get(_CACHED_FILES_SHA256) or files_digest(files_of(obj)))


def without_files(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` as a cache keeps it: its spec's files by name only, their text dropped — it is
    read when needed (docs/kubernetes.md, "Reads"); a copy, so `obj` keeps the text."""
    spec = obj.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("files"), dict):
        return obj
    names = dict.fromkeys(spec["files"], "")
    cached = {**spec, "files": names, _CACHED_FILES_SHA256: files_sha256(obj)}
    return {**obj, "spec": cached}


def files_of(obj: Mapping[str, Any]) -> dict[str, str]:
    """A Run's inline files (``spec.files``: a Run applied with kubectl)."""
    return {str(k): str(v) for k, v in ((obj.get("spec") or {}).get("files") or {}).items()}


def files_from(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """A Run's ``spec.filesFrom`` (its files' ConfigMaps and their digest), None if its files
    are inline."""
    found = (obj.get("spec") or {}).get("filesFrom")
    return dict(found) if isinstance(found, Mapping) else None


def files_parts(files: Mapping[str, str]) -> tuple[str, list[str]]:
    """The SHA-256 of `files` as one JSON text, and that text cut into parts of at most
    FILES_PART_BYTES of UTF-8, each cut between two characters."""
    text = files_json(files)
    parts, start = [], 0
    while start < len(text):
        end = min(start + FILES_PART_BYTES, len(text))
        while end < len(text) and text[end] & 0xC0 == 0x80:  # inside a character: cut before it
            end -= 1
        parts.append(text[start:end].decode())
        start = end
    return hashlib.sha256(text).hexdigest(), parts


def joined_files(run: str, source: Mapping[str, Any], parts: list[str]) -> dict[str, str]:
    """The files whose ConfigMaps' parts, in order, are `parts` (`source`: the Run's
    ``filesFrom``); RunFilesMissing if they are not what its digest says."""
    text = "".join(parts).encode()
    if hashlib.sha256(text).hexdigest() != source.get("sha256"):
        raise RunFilesMissing(
            f"run {run!r}: its files' ConfigMaps {', '.join(source.get('configMaps') or ())} do "
            "not hold what its spec.filesFrom.sha256 says (changed or replaced)"
        )
    return {str(k): str(v) for k, v in json.loads(text).items()}


def files_config_map(
    name: str, part: str, owner: Mapping[str, Any], namespace: str
) -> dict[str, Any]:
    """The ConfigMap `name` holding `part` of the files of the Run `owner` (as created): owned
    by it, so that the API server's garbage collector deletes it with the Run; immutable, so
    that nothing changes it and the kubelet need not watch it."""
    meta = owner["metadata"]
    owned_by = {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"]}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {ROLE_LABEL: RUN_FILES, RUN_LABEL: meta["name"]},
            "ownerReferences": [{**owned_by, "blockOwnerDeletion": False}],
        },
        "immutable": True,
        "data": {FILES_KEY: part},
    }


def new_object(
    run: Run, files: Mapping[str, str], namespace: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """The object a create sends for `run`, whose files are then written as ConfigMaps
    (``filesFrom``; ``files_config_map``) — its status is written after, through /status —
    and the text of those ConfigMaps, by name. RunTooLarge if it is larger than the API server
    keeps."""
    metadata: dict[str, Any] = {
        "name": object_name(run.name),
        "namespace": namespace,
        "labels": {
            RUNTIME_LABEL: run.spec.runtime,
            **({POD_LABEL: run.status.assigned_pod} if run.status.assigned_pod else {}),
        },
        "finalizers": [FINALIZER],
    }
    if metadata["name"] != run.name:
        metadata["annotations"] = {NAME_KEY: run.name}
    spec: dict[str, Any] = {
        "runtime": run.spec.runtime,
        "handler": run.spec.handler,
        "source": run.spec.source,
        "env": dict(run.spec.env),
        "idleTimeoutSeconds": run.spec.idle_timeout_seconds,
        "memoryMb": run.spec.memory_mb,
    }
    if run.spec.replicas != 1:
        spec["replicas"] = run.spec.replicas
    if run.spec.replica_of:
        spec["replicaOf"] = run.spec.replica_of
    if run.spec.requirements:
        spec["requirements"] = list(run.spec.requirements)
    if run.spec.secrets:
        spec["secrets"] = list(run.spec.secrets)
    digest, parts = files_parts(files)
    if len(parts) > MAX_FILES_PARTS:
        raise RunTooLarge(
            f"run {run.name!r}: its files are {sum(len(p.encode()) for p in parts)} bytes as "
            f"JSON; on Kubernetes they may be at most {MAX_FILES_PARTS} ConfigMaps of "
            f"{FILES_PART_BYTES} bytes"
        )
    # A name of its own for each create: a Run deleted and made again under its name must not
    # meet the ConfigMaps of the one before, which the garbage collector may not have removed.
    stem = f"{metadata['name']}-files-{secrets.token_hex(4)}"
    named = {f"{stem}-{index}": part for index, part in enumerate(parts)}
    spec["filesFrom"] = {"configMaps": list(named), "sha256": digest}
    obj = {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec}
    size = stored_size(obj)
    if size > MAX_OBJECT_BYTES:
        raise RunTooLarge(
            f"run {run.name!r} would be {size} bytes as the API server stores it (its env, "
            f"status and managedFields); a Kubernetes object may be at most {MAX_OBJECT_BYTES} "
            "bytes (etcd's request limit)"
        )
    return obj, named


def stored_size(obj: Mapping[str, Any]) -> int:
    """At most how large `obj`, as a create sends it, becomes as the API server stores it:
    itself, the managedFields entry naming each of its fields, and the room its status and that
    status's managedFields may take."""
    sent = len(json.dumps(obj, ensure_ascii=False).encode())
    named = {key: obj[key] for key in ("metadata", "spec") if key in obj}
    fields = len(json.dumps(_field_names(named), ensure_ascii=False).encode())
    return sent + _MANAGED_ENTRY_BYTES + fields + STATUS_RESERVE_BYTES


def _field_names(value: Any) -> Any:
    """managedFields' fieldsV1 of `value`: each key as ``f:KEY``, down to the leaves."""
    if isinstance(value, Mapping):
        return {f"f:{key}": _field_names(item) for key, item in value.items()}
    return {}


def status_with(obj: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """The object's status with `changes` (``RunStatus`` field names) written over it."""
    status = dict(obj.get("status") or {})
    for field, value in changes.items():
        status[STATUS_KEYS[field]] = value  # KeyError: not a status field
    return status


def pod_of(obj: Mapping[str, Any]) -> Pod | None:
    """The Runtime Pod a pod object is (None if it is not one): alive while Ready and not being
    deleted; its address is its IP and the port named RUNTIMED_PORT."""
    meta = obj.get("metadata") or {}
    runtime = (meta.get("labels") or {}).get(RUNTIME_LABEL)
    if not runtime:
        return None
    status = obj.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )
    port = next(
        (
            p.get("containerPort")
            for c in (obj.get("spec") or {}).get("containers") or ()
            for p in c.get("ports") or ()
            if p.get("name") == RUNTIMED_PORT
        ),
        None,
    )
    ip = status.get("podIP") or ""
    address = f"{ip}:{port}" if ip and port else ""
    healthy = ready and bool(address) and not meta.get("deletionTimestamp")
    return Pod(meta.get("name", ""), runtime, address, healthy, math.inf)
