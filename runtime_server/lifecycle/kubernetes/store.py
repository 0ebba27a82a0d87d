"""The Run store over the Kubernetes API (``RunStore``; docs/kubernetes.md).

Reads come from a cache each process keeps of the namespace's Runs and Runtime Pods, filled by a
list and kept current by a watch (``informer.Informer``). Every
status write is a PUT to the Run's status subresource carrying the resourceVersion it was
computed from: if another writer got there first the API server answers 409 Conflict, the
object is read again, and the write is made again only if the Run still has the attempt and
pod (and phase) the writer saw. So a stale writer can never overwrite a newer attempt, and the
fence of ``RunStore.update`` holds across processes and machines.

Runtime Pods are the pods labelled ``objects.RUNTIME_POD_SELECTOR``; whether one is alive is its
Ready condition, kept by the kubelet from the pod's readiness probe. runtimed writes no
heartbeat (``heartbeat`` is ignored): it "never writes each activity update to Kubernetes".
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Unpack

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from fnkernel.runtime_server.errors import RunAlreadyExists, RunFilesMissing, RunNotFound
from fnkernel.runtime_server.lifecycle.kubernetes import objects
from fnkernel.runtime_server.lifecycle.kubernetes.informer import Informer, object_of, raw_answer
from fnkernel.runtime_server.lifecycle.kubernetes.objects import GROUP, PLURAL, VERSION
from fnkernel.runtime_server.lifecycle.runs import Pod, Run, StatusChanges
from fnkernel.runtime_server.wire import DELETED, FAILED, NEW
from fnkernel.system.waiting import attempts

LOG = logging.getLogger("fnkernel.kubernetes")
_CONFLICT_TRIES = 50  # a status write that keeps meeting newer versions gives up after this
_SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def connect() -> client.ApiClient:
    """A client of the cluster this process runs in (its service account), else of the
    kubeconfig's current context ($KUBECONFIG or ~/.kube/config)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    else:
        config.load_kube_config()
    return client.ApiClient()


def namespace_of(given: str | None) -> str:
    """`given`, else $FNKERNEL_NAMESPACE, else the pod's own (its service account's), else
    ``default``."""
    if given:
        return given
    if os.environ.get("FNKERNEL_NAMESPACE"):
        return os.environ["FNKERNEL_NAMESPACE"]
    try:
        return _SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


class KubernetesRunStore:
    """Runs and Runtime Pods of one namespace, through the API server (``RunStore``)."""

    def __init__(
        self,
        api_client: client.ApiClient,
        namespace: str,
        *,
        watch_pods: bool = True,
        pod: str | None = None,
        sync_timeout: float = 30.0,
    ) -> None:
        """`watch_pods`: keep the Runtime Pods too (the scheduler and the gateway's route need
        them; runtimed does not, and its service account may not list pods). `pod`: keep only
        the Runs assigned to that pod (runtimed's), by their objects.POD_LABEL."""
        self.namespace = namespace
        self._api_client = api_client
        self._custom = client.CustomObjectsApi(api_client)
        self._core = client.CoreV1Api(api_client)
        self._version = 0
        self._version_lock = threading.Lock()
        self._names: tuple[int, dict[str, str]] = (-1, {})  # (version, name → uid): _uid_of
        self._stop = threading.Event()
        self._runs = Informer(
            "runs",
            lambda **kw: self._custom.list_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, **kw
            ),
            self._changed,
            self._stop,
            keep=objects.without_files,
            **({"label_selector": f"{objects.POD_LABEL}={pod}"} if pod else {}),
        )
        self._pods = Informer(
            "pods",
            lambda **kw: self._core.list_namespaced_pod(namespace, **kw),
            self._changed,
            self._stop,
            label_selector=objects.RUNTIME_POD_SELECTOR,
        )
        self._informers = [self._runs, self._pods] if watch_pods else [self._runs]
        for informer in self._informers:
            informer.start()
        deadline = time.monotonic() + sync_timeout
        for informer in self._informers:
            if not informer.synced.wait(max(0.0, deadline - time.monotonic())):
                self.close()
                raise RuntimeError(
                    f"cannot list the {informer.name} of namespace {namespace} from the "
                    f"Kubernetes API at {api_client.configuration.host} within {sync_timeout}s"
                )

    def _changed(self) -> None:
        with self._version_lock:
            self._version += 1

    def version(self) -> int:
        """Changes with every object the watches deliver and every write of ours."""
        return self._version

    def close(self) -> None:
        self._stop.set()
        for informer in self._informers:
            informer.close()

    # Runs

    def _all(self) -> list[Run]:
        runs = [objects.run_of(obj) for obj in self._runs.snapshot()]
        return sorted(runs, key=lambda run: (run.created_at, run.name))

    def insert(self, run: Run, files: Mapping[str, str]) -> Run:
        """Create the object, then the ConfigMaps of its files, which it owns
        (docs/kubernetes.md, "Reads"), then write its status (a create drops status): a
        controller that admits it in between (``NEW``) wins, and this returns the Run as it
        admitted it. A ConfigMap that cannot be made deletes the Run (and with it those made):
        both are written or neither. A create cut short after the Run is for the controller to
        fail (``ControlPlane._admit``)."""
        body, parts = objects.new_object(run, files, self.namespace)
        try:
            created = object_of(
                self._custom.create_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, body
                )
            )
        except ApiException as exc:
            if exc.status == 409:
                raise RunAlreadyExists(f"a run named {run.name!r} already exists") from None
            raise
        self._runs.learn(created)
        blank = objects.run_of(created)
        try:
            for name, part in parts.items():
                config_map = objects.files_config_map(name, part, created, self.namespace)
                # The client sends a dict as it is; its hints name only its model class.
                raw_answer(self._core.create_namespaced_config_map(
                    self.namespace, config_map, _preload_content=False  # type: ignore[arg-type]
                ))  # fmt: skip
        except BaseException:
            try:
                self.delete(blank.uid)
            except Exception as exc:  # the controller fails it (ControlPlane._admit)
                LOG.warning("run %s: cannot delete it after its files failed: %s", run.name, exc)
            raise
        admitted = self.update(
            blank,
            expect_phase=NEW,
            phase=run.status.phase,
            attempt=run.status.attempt,
            assigned_pod=run.status.assigned_pod,
            message=run.status.message,
            traceparent=run.status.traceparent,
        )
        return admitted or self.get_uid(blank.uid) or blank

    def files(self, uid: str) -> dict[str, str]:
        """The Run's files, read from the API server: no cache keeps them (docs/kubernetes.md,
        "Reads") — from the ConfigMaps its ``filesFrom`` names, else (a Run applied with
        kubectl) from the Run itself. They are read when runtimed writes them into a Run's
        workspace, when the control plane checks a Run it did not create, and for
        ``GET /v1/runs/NAME/files``. RunFilesMissing if a ConfigMap is gone or changed."""
        obj = self._runs.get(uid)
        if obj is None:
            raise RunNotFound(f"no run has uid {uid}")
        source = objects.files_from(obj)
        if source is None:
            full = self._read(obj["metadata"]["name"])
            if full is None or full["metadata"]["uid"] != uid:
                raise RunNotFound(f"no run has uid {uid}")
            return objects.files_of(full)
        name = objects.run_name(obj)
        parts = []
        for config_map in source.get("configMaps") or ():
            try:
                read = raw_answer(self._core.read_namespaced_config_map(
                    config_map, self.namespace, _preload_content=False
                ))  # fmt: skip
            except ApiException as exc:
                if exc.status != 404:
                    raise
                raise RunFilesMissing(
                    f"run {name!r}: the ConfigMap {config_map} of its files is gone"
                ) from None
            parts.append(str((read.get("data") or {}).get(objects.FILES_KEY, "")))
        return objects.joined_files(name, source, parts)

    def _uid_of(self, name: str) -> str | None:
        """The uid of the Run named `name`, from an index rebuilt only after a change (the
        gateway asks on every call)."""
        version, names = self._names
        if version != self._version:
            version = self._version
            names = {objects.run_name(obj): obj["metadata"]["uid"] for obj in self._runs.snapshot()}
            self._names = (version, names)
        return names.get(name)

    def get(self, name: str) -> Run:
        uid = self._uid_of(name)
        run = self.get_uid(uid) if uid is not None else None
        if run is None or run.name != name:
            raise RunNotFound(f"no run named {name!r}")
        return run

    def get_uid(self, uid: str) -> Run | None:
        obj = self._runs.get(uid)
        return None if obj is None else objects.run_of(obj)

    def get_fresh(self, name: str) -> Run:
        """``get``: the cache is as fresh as the watch (docs/kubernetes.md, "Fences at the API
        level")."""
        return self.get(name)

    def get_uid_fresh(self, uid: str) -> Run | None:
        return self.get_uid(uid)

    def runs(self, *, pod: str | None = None, phase: str | None = None) -> list[Run]:
        return [
            run
            for run in self._all()
            if (pod is None or run.status.assigned_pod == pod)
            and (phase is None or run.status.phase == phase)
        ]

    def _read(self, name: str) -> dict[str, Any] | None:
        """The Run `name` as the API server has it now (after a conflict; its files), None if
        it is gone; the cache learns it too. A list of that one name, not a get: every
        component lists and watches Runs already, so none needs the get verb
        (docs/kubernetes.md, "Who may do what")."""
        listed = raw_answer(self._custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, field_selector=f"metadata.name={name}",
            _preload_content=False,
        ))  # fmt: skip
        items = listed.get("items") or []
        if not items:
            return None
        obj: dict[str, Any] = items[0]
        self._runs.learn(obj)
        return obj

    def update(
        self, run: Run, *, expect_phase: str | None = None, **changes: Unpack[StatusChanges]
    ) -> Run | None:
        """The fenced write: a PUT of the status with the resourceVersion it was computed from;
        on 409 the object is read again and the fence checked again."""
        obj = self._runs.get(run.uid)
        for _ in attempts(_CONFLICT_TRIES):
            if obj is None:
                return None
            current = objects.run_of(obj)
            if (
                current.status.attempt != run.status.attempt
                or current.status.assigned_pod != run.status.assigned_pod
                or (expect_phase is not None and current.status.phase != expect_phase)
            ):
                return None
            if not self._held(obj):
                obj = self._hold(obj)
                continue
            pod = str(changes.get("assigned_pod", current.status.assigned_pod))
            if (obj["metadata"].get("labels") or {}).get(objects.POD_LABEL, "") != pod:
                # The label first: the new pod's runtimed sees the Run, then its status.
                obj = self._label(obj, pod)
                continue
            body = {
                "apiVersion": objects.API_VERSION,
                "kind": objects.KIND,
                "metadata": {
                    "name": obj["metadata"]["name"],
                    "namespace": self.namespace,
                    "resourceVersion": obj["metadata"]["resourceVersion"],
                },
                "status": objects.status_with(obj, changes),
            }
            try:
                written = object_of(
                    self._custom.replace_namespaced_custom_object_status(
                        GROUP, VERSION, self.namespace, PLURAL, obj["metadata"]["name"], body
                    )
                )
            except ApiException as exc:
                if exc.status == 409:  # a newer version: read it, and fence again
                    obj = self._read(obj["metadata"]["name"])
                    continue
                if exc.status == 404:
                    return None
                raise
            self._runs.learn(written)
            return objects.run_of(written)
        raise RuntimeError(f"run {run.name}: {_CONFLICT_TRIES} conflicting writes in a row")

    @staticmethod
    def _held(obj: Mapping[str, Any]) -> bool:
        meta = obj["metadata"]
        return objects.FINALIZER in (meta.get("finalizers") or ()) or bool(
            meta.get("deletionTimestamp")
        )

    def _hold(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Add our finalizer to a Run created without it (``kubectl apply``), before its first
        status write: from then on a `kubectl delete` waits until runtimed has unregistered it.
        The object as it is after (None if it is gone)."""
        finalizers = [*(obj["metadata"].get("finalizers") or ()), objects.FINALIZER]
        return self._patch_metadata(obj, {"finalizers": finalizers})

    def _label(self, obj: dict[str, Any], pod: str) -> dict[str, Any] | None:
        """Label the Run with the pod it is being assigned to (objects.POD_LABEL; none: no
        pod); the object as it is after (None: gone)."""
        return self._patch_metadata(obj, {"labels": {objects.POD_LABEL: pod or None}})

    def _patch_metadata(
        self, obj: dict[str, Any], metadata: dict[str, Any]
    ) -> dict[str, Any] | None:
        """A merge patch of the Run's metadata, fenced on the version `obj` was read at
        (docs/kubernetes.md, "Fences at the API level"); the object as it is after — as the
        API server has it now if another writer came first (409) — None if it is gone."""
        meta = obj["metadata"]
        patch = {"metadata": {**metadata, "resourceVersion": meta["resourceVersion"]}}
        try:
            patched = object_of(self._custom.patch_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, meta["name"], patch
            ))  # fmt: skip
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
            return self._read(meta["name"])
        self._runs.learn(patched)
        return patched

    def delete(self, uid: str) -> None:
        """Remove our finalizer and delete the object (both: whichever of them comes last
        removes it). The finalizer patch carries the resourceVersion its list of finalizers
        was computed from: if another writer changed the object meanwhile (another finalizer),
        the patch is a 409, and it is computed again from the object as it is."""
        obj = self._runs.get(uid)
        if obj is None:
            return
        name = obj["metadata"]["name"]
        last = obj  # the latest version of ours: the cache forgets every version up to it
        try:
            for _ in attempts(_CONFLICT_TRIES):
                meta = last["metadata"]
                finalizers = [f for f in meta.get("finalizers") or () if f != objects.FINALIZER]
                patch = {"metadata": {"finalizers": finalizers or None,
                                      "resourceVersion": meta["resourceVersion"]}}  # fmt: skip
                try:
                    last = object_of(self._custom.patch_namespaced_custom_object(
                        GROUP, VERSION, self.namespace, PLURAL, name, patch
                    ))  # fmt: skip
                    break
                except ApiException as exc:
                    if exc.status != 409:
                        raise
                current = self._read(name)
                if current is None or current["metadata"]["uid"] != uid:
                    return
                last = current
            if last.get("metadata", {}).get("deletionTimestamp") and not finalizers:
                self._runs.learn(last, deleted=True)
                return
            self._custom.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name,
                body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
            )  # fmt: skip
        except ApiException as exc:
            if exc.status != 404:
                raise
        self._runs.learn(last, deleted=True)

    def load_by_pod(self) -> dict[str, int]:
        load: dict[str, int] = {}
        for run in self._all():
            if run.status.phase not in (FAILED, DELETED) and run.status.assigned_pod:
                load[run.status.assigned_pod] = load.get(run.status.assigned_pod, 0) + 1
        return load

    # Runtime Pods

    def heartbeat(self, name: str, runtime: str, address: str, healthy: bool) -> None:
        """Ignored: a Runtime Pod's liveness is its Pod object's Ready condition."""

    def pods(self, runtime: str | None = None) -> list[Pod]:
        found = [objects.pod_of(obj) for obj in self._pods.snapshot()]
        return sorted(
            (p for p in found if p is not None and runtime in (None, p.runtime)),
            key=lambda p: p.name,
        )

    def pod(self, name: str) -> Pod | None:
        return next((pod for pod in self.pods() if pod.name == name), None)

    def pod_fresh(self, name: str) -> Pod | None:
        return self.pod(name)
