"""Runtime Pods on Kubernetes (``PodProvisioner``; docs/kubernetes.md): the pods of the
runtime's Deployment, ``objects.deployment_name(runtime)``.

``start`` scales the Deployment up by one and waits for the new pod to be Ready; ``stop`` marks
the pod the cheapest to delete (``controller.kubernetes.io/pod-deletion-cost``) and scales the
Deployment down by one, so that the ReplicaSet removes that pod and no other; whether one is
alive and where its runtimed listens is read from its Pod object.
"""

from __future__ import annotations

import time
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fnkernel.runtime_server.lifecycle.kubernetes import objects
from fnkernel.runtime_server.lifecycle.kubernetes.store import raw_answer

_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
_POLL_SECONDS = 0.2


class KubernetesProvisioner:
    def __init__(
        self, api_client: client.ApiClient, namespace: str, *, timeout: float = 120.0
    ) -> None:
        self.namespace = namespace
        self.timeout = timeout
        self._core = client.CoreV1Api(api_client)
        self._apps = client.AppsV1Api(api_client)

    def _pods(self, runtime: str | None = None) -> list[dict[str, Any]]:
        selector = objects.RUNTIME_POD_SELECTOR
        if runtime is not None:
            selector += f",{objects.RUNTIME_LABEL}={runtime}"
        listed = self._core.list_namespaced_pod(
            self.namespace, label_selector=selector, _preload_content=False
        )
        pods: list[dict[str, Any]] = raw_answer(listed)["items"]
        return sorted(
            pods, key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"])
        )

    def _pod(self, name: str) -> dict[str, Any]:
        try:
            found = self._core.read_namespaced_pod(name, self.namespace, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                raise KeyError(name) from None
            raise
        pod: dict[str, Any] = raw_answer(found)
        return pod

    def _scale(self, runtime: str, by: int) -> None:
        name = objects.deployment_name(runtime)
        found = raw_answer(
            self._apps.read_namespaced_deployment(name, self.namespace, _preload_content=False)
        )
        replicas = max(0, int(found["spec"].get("replicas", 1)) + by)
        self._apps.patch_namespaced_deployment(
            name,
            self.namespace,
            {"metadata": {"resourceVersion": found["metadata"]["resourceVersion"]},
             "spec": {"replicas": replicas}},
            _preload_content=False,
        )  # fmt: skip

    def start(self, runtime: str) -> str:
        before = {p["metadata"]["name"] for p in self._pods(runtime)}
        self._scale(runtime, +1)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            for obj in self._pods(runtime):
                pod = objects.pod_of(obj)
                if pod is not None and pod.name not in before and pod.alive():
                    return pod.name
            time.sleep(_POLL_SECONDS)
        raise RuntimeError(f"no new Ready pod of {runtime} within {self.timeout}s")

    def alive(self, pod: str) -> bool:
        try:
            found = objects.pod_of(self._pod(pod))
        except KeyError:
            return False
        return found is not None and found.alive()

    def stop(self, pod: str, timeout: float = 15.0) -> None:
        runtime = (self._pod(pod)["metadata"].get("labels") or {})[objects.RUNTIME_LABEL]
        self._core.patch_namespaced_pod(
            pod, self.namespace, {"metadata": {"annotations": {_DELETION_COST: "-1000000"}}},
            _preload_content=False,
        )  # fmt: skip
        self._scale(runtime, -1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pod not in {p["metadata"]["name"] for p in self._pods(runtime)}:
                return
            time.sleep(_POLL_SECONDS)
        raise RuntimeError(f"pod {pod} was not removed within {timeout}s")

    def address(self, pod: str) -> str:
        found = objects.pod_of(self._pod(pod))
        return found.address if found is not None else ""

    def pods(self, runtime: str | None = None) -> list[str]:
        return [p["metadata"]["name"] for p in self._pods(runtime)]
