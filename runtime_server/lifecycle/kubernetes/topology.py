"""The Kubernetes deployment's topology (``lifecycle/topology.py``; docs/kubernetes.md): Run
objects of the API server; the ``controller`` runs the control plane's loop and the gateway only
creates, deletes and routes; a pod's workspace is a volume of the pod, named by its manifest; the
Deployments of ``deploy/`` keep the pods (no component of ours starts one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fnkernel.runtime_server.lifecycle.kubernetes.secrets import KubernetesSecrets
from fnkernel.runtime_server.lifecycle.kubernetes.store import (
    KubernetesRunStore,
    connect,
    namespace_of,
)
from fnkernel.runtime_server.lifecycle.runs import RunStore
from fnkernel.runtime_server.lifecycle.secrets import Secrets
from fnkernel.runtime_server.lifecycle.topology import MissingWorkspace


@dataclass(frozen=True)
class Kubernetes:
    """Runs as objects of the namespace `namespace` (None: ``store.namespace_of``'s choice)."""

    namespace: str | None = None
    control_plane_in_gateway = False
    local_clients = False

    def open_store(self, *, pods: bool = True, only_pod: str | None = None) -> RunStore:
        namespace = namespace_of(self.namespace)
        return KubernetesRunStore(connect(), namespace, watch_pods=pods, pod=only_pod)

    def workspace(self, pod: str, given: Path | None = None) -> Path:
        if given is None:
            raise MissingWorkspace("on Kubernetes a pod's workspace is its own volume: name it")
        return given

    def packages(self, given: Path | None = None) -> Path:
        if given is None:
            raise MissingWorkspace(
                "on Kubernetes the package cache is a volume of the pod: name it"
            )
        return given

    def open_secrets(self) -> Secrets:
        return KubernetesSecrets(connect(), namespace_of(self.namespace))

    def where(self) -> str:
        return f"Runs in namespace {self.namespace or '(its own)'}"
