"""Runs and Runtime Pods written into the emulated API server (a test double:
tests/kubernetes/emulator.py) for the Kubernetes tests, and which of a cluster's servers hold a
Run."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import grpc
from kubernetes import client

from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.lifecycle.controlplane import ControlPlane
from fnkernel.runtime_server.lifecycle.kubernetes import objects
from fnkernel.runtime_server.lifecycle.kubernetes.store import KubernetesRunStore
from fnkernel.runtime_server.lifecycle.runs import Run, RunSpec, files_digest
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS
from tests.kubernetes.conftest import STORE_NAMESPACE, Cluster
from tests.support import wait_until

NS = STORE_NAMESPACE
HANDLER = {"handler.py": "def handle(event):\n    return event\n"}
G, V, P = objects.GROUP, objects.VERSION, objects.PLURAL


def runtime_pod(core: client.CoreV1Api, name: str, ip: str, *, ready: bool = True) -> None:
    """A Runtime Pod as the kubelet would report it (here the test writes its status)."""
    core.create_namespaced_pod(NS, {
        "metadata": {"name": name, "labels": {objects.ROLE_LABEL: objects.RUNTIME_POD,
                                              objects.RUNTIME_LABEL: "python"}},
        "spec": {"containers": [{"name": "runtimed", "image": "fnkernel",
                                 "ports": [{"name": objects.RUNTIMED_PORT, "containerPort": 50051}]}]},
    })  # fmt: skip
    status = {"phase": "Running", "podIP": ip,
              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}  # fmt: skip
    core.patch_namespaced_pod_status(name, NS, {"status": status})


def plane_with_pod(store: KubernetesRunStore, api_client: client.ApiClient) -> ControlPlane:
    runtime_pod(client.CoreV1Api(api_client), "python-abc", "127.0.0.9")
    # Alive, not only listed: its Ready status is a second write, seen by a second event.
    wait_until(lambda: (pod := store.pod("python-abc")) is not None and pod.alive(), timeout=10)
    return ControlPlane(store)


def a_run(name: str, size: int = 0) -> Run:
    """A Run whose object would be about `size` bytes as sent (its env fills it)."""
    spec = RunSpec(runtime="python", handler="handler.handle", files_sha256=files_digest(HANDLER))
    run = Run(uid="", name=name, spec=spec)
    if size:
        base = len(json.dumps(objects.new_object(run, HANDLER, NS)[0]))
        fill = {"FILL": "x" * (size - base - len('"FILL": ""'))}
        run = dataclasses.replace(run, spec=dataclasses.replace(spec, env=fill))
    return run


def cut_short(
    api_client: client.ApiClient,
    namespace: str,
    name: str,
    files: dict[str, str],
    texts: list[str] | None = None,
) -> dict[str, Any]:
    """A Run as a create stopped before its status write leaves it (the gateway died): no
    status, and its files' ConfigMaps as written — `texts`: what each holds (None: its part of
    `files`; fewer: the rest never made)."""
    body, parts = objects.new_object(a_run(name), files, namespace)
    created: dict[str, Any] = client.CustomObjectsApi(
        api_client
    ).create_namespaced_custom_object(G, V, namespace, P, body)  # fmt: skip
    written = list(parts.values()) if texts is None else texts
    for config_map, text in zip(parts, written, strict=False):
        client.CoreV1Api(api_client).create_namespaced_config_map(
            namespace, objects.files_config_map(config_map, text, created, namespace)
        )
    return created


def held_by(cluster: Cluster, run_uid: str) -> list[str]:
    """The Runtime Pods whose server holds a registration of `run_uid` (its socket, in the pod's
    volume: this test runs as root)."""
    holders = []
    for pod in cluster.runtime_pods(ready=False):
        with grpc.insecure_channel(cluster.server_socket(pod), options=CHANNEL_OPTIONS) as channel:
            probe = pb.FunctionStatusRequest(
                registration=pb.FunctionRegistration(run_uid=run_uid, registration_id="reg_x")
            )
            try:
                pb_grpc.FunctionRuntimeStub(channel).FunctionStatus(probe, timeout=5)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION:  # holds another ID
                    holders.append(pod["metadata"]["name"])
                elif err.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                    raise
    return holders
