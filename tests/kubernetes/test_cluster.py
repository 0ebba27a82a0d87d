"""fnkernel on Kubernetes end to end (docs/kubernetes.md), where no cluster can run: deploy/'s
manifests applied to the emulated API server; the Runtime Pods of its Deployments run by the
test node agent (both test doubles) as processes of another user, each on its own loopback IP;
the controller and the gateway started from the manifests' command lines. A kernel and the
client call through gateway → runtimed in a pod → Runtime Server → worker."""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.lifecycle.kubernetes import objects
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS
from tests.kubernetes.conftest import NAMESPACE, POD_USER, Cluster
from tests.kubernetes.runs import held_by
from tests.packages_and_secrets import (
    SECRET,
    a_function_brings_its_packages_and_a_secret,
    set_secret,
)
from tests.support import ECHO_PY, spooled, wait_until

pytestmark = pytest.mark.timeout(240)
G, V, P = objects.GROUP, objects.VERSION, objects.PLURAL
RUNTIME_PODS = 3  # deploy/runtime-pods.yaml: python 2, bash 1
ECHO = {name: textwrap.dedent(text) for name, text in ECHO_PY.items()}
WHO = {
    "handler.py": "import os\n"
    "def handle(event):\n"
    "    try:\n"
    "        open(event['secret']).read()\n"
    "        secret = 'read'\n"
    "    except PermissionError:\n"
    "        secret = 'denied'\n"
    "    return {'uid': os.getuid(), 'cwd': os.getcwd(), 'secret': secret}\n"
}


def up(cluster: Cluster, *, controllers: int = 1) -> Client:
    wait_until(lambda: len(cluster.runtime_pods()) == RUNTIME_PODS, timeout=60)
    for n in range(controllers):
        cluster.start_controller(f"controller-{n}")
    return Client(cluster.start_gateway(), token=cluster.token)


def run_object(cluster: Cluster, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = client.CustomObjectsApi(cluster.client).get_namespaced_custom_object(
        G, V, NAMESPACE, P, name
    )
    return obj


@pytest.mark.usefixtures("fnkernel_spec")  # the kernel it starts, also when run alone
def test_a_kernel_registers_invokes_and_unregisters_through_a_runtime_pod(
    cluster: Cluster,
) -> None:
    from tests.kernel.kernels import Kernel

    gateway = up(cluster)
    kernel = Kernel(env={"FNKERNEL_RUNTIME": cluster.gateway, "FNKERNEL_TOKEN": cluster.token})
    try:
        cell = kernel.run("%%function who\n" + WHO["handler.py"].replace("handle(", "handler("))
        assert cell.ok, cell.error
        answer = kernel.value(f"who({{'secret': {str(cluster.tmp / 'token')!r}}})")
        obj = run_object(cluster, "who")
        assert obj["status"]["phase"] == "Ready" and obj["status"]["attempt"] == 1
        pod = obj["status"]["assignedPod"]
        assert pod in {p["metadata"]["name"] for p in cluster.runtime_pods()}
        # The handler ran in the pod, as the pod's user, in a working dir runtimed wrote there;
        # the gateway's token file (0600, this test's user) is not readable from it.
        if cluster.pod_user is not None:
            assert answer["uid"] == POD_USER and answer["secret"] == "denied"
        assert (
            answer["cwd"].startswith(str(cluster.node_root))
            and obj["metadata"]["uid"] in answer["cwd"]
        )
        cell = kernel.run("who.unregister()")
        assert cell.ok, cell.error
        with pytest.raises(ApiException) as gone:
            run_object(cluster, "who")
        assert gone.value.status == 404
        assert held_by(cluster, obj["metadata"]["uid"]) == []
        assert gateway.list_runs() == []
    finally:
        kernel.shutdown()


def test_deleting_the_runs_pod_moves_it_to_another_with_attempt_2_and_fences_the_old_id(
    cluster: Cluster,
) -> None:
    gateway = up(cluster)
    gateway.create_run("echo", runtime="python", handler="handler.handle", files=ECHO)
    before = gateway.status("echo")
    old_pod, old_id = before["status"]["assignedPod"], before["live"]["registrationId"]
    client.CoreV1Api(cluster.client).delete_namespaced_pod(old_pod, NAMESPACE)
    wait_until(lambda: gateway.status("echo")["status"]["attempt"] == 2
               and gateway.status("echo")["status"]["phase"] == "Ready", timeout=60)  # fmt: skip
    moved = gateway.status("echo")
    assert moved["status"]["assignedPod"] != old_pod
    assert gateway.invoke("echo", {"x": 1}).value()["echo"] == {"x": 1}
    # The attempt-1 ID is refused where the Run now lives (docs/protocol.md: a stale ID is
    # FAILED_PRECONDITION), and only that pod holds a registration of it.
    new = next(
        p for p in cluster.runtime_pods() if p["metadata"]["name"] == moved["status"]["assignedPod"]
    )
    with grpc.insecure_channel(cluster.server_socket(new), options=CHANNEL_OPTIONS) as channel:
        stale = pb.InvokeFunctionRequest(
            registration=pb.FunctionRegistration(run_uid=moved.uid, registration_id=old_id),
            input=b"{}",
        )
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.FunctionRuntimeStub(channel).InvokeFunction(stale, timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert held_by(cluster, moved.uid) == [moved["status"]["assignedPod"]]
    # The Deployment's replacement pod came up: the pods are whole again.
    wait_until(lambda: len(cluster.runtime_pods()) == RUNTIME_PODS, timeout=60)


def test_a_runs_files_past_an_objects_limit_are_created_called_and_read_back(
    cluster: Cluster,
) -> None:
    # docs/kubernetes.md, "Reads": a Run's files live in ConfigMaps it owns, so a Run may hold
    # what the gateway takes (6 MiB), past what one object (1.5 MiB) or ConfigMap (1 MiB) holds;
    # runtimed writes them whole into the Run's working dir; they go with the Run.
    gateway = up(cluster)
    data = "aé€𝄞\n" * 200_000  # 2.2 MB of UTF-8
    files = {
        "handler.py": "import hashlib\n"
        "def handle(event):\n"
        "    text = open('data.txt', encoding='utf-8').read()\n"
        "    return {'chars': len(text), 'sha256': hashlib.sha256(text.encode()).hexdigest()}\n",
        "data.txt": data,
    }
    gateway.create_run("big", runtime="python", handler="handler.handle", files=files)
    assert gateway.invoke("big", {}).decoded() == {
        "chars": len(data),
        "sha256": hashlib.sha256(data.encode()).hexdigest(),
    }
    assert gateway.files("big")["files"] == files
    core = client.CoreV1Api(cluster.client)
    owned = f"{objects.RUN_LABEL}=big"
    assert len(core.list_namespaced_config_map(NAMESPACE, label_selector=owned).items) == 3
    gateway.delete_run("big")
    wait_until(
        lambda: core.list_namespaced_config_map(NAMESPACE, label_selector=owned).items == [],
        timeout=30,
    )


def test_restarting_the_controller_and_the_gateway_loses_no_run(cluster: Cluster) -> None:
    gateway = up(cluster)
    for name in ("a", "b"):
        gateway.create_run(name, runtime="python", handler="handler.handle", files=ECHO)
    before = {run.name: (run.uid, run["status"]["attempt"]) for run in gateway.list_runs()}
    cluster.kill("controller-0")
    cluster.kill("gateway")
    cluster.start_controller("controller-0")
    gateway = Client(cluster.start_gateway(), token=cluster.token)
    after = {run.name: (run.uid, run["status"]["attempt"]) for run in gateway.list_runs()}
    assert after == before
    for name in ("a", "b"):
        assert gateway.invoke(name, {"n": name}).value()["echo"] == {"n": name}


def test_two_controllers_racing_never_make_two_live_registrations(cluster: Cluster) -> None:
    # docs/kubernetes.md, "Fences at the API level": both controllers see every pod death and both
    # try to move the Run; the conditional status write lets one attempt through. (That a stale
    # write cannot land is shown deterministically in test_store.py; here, the whole system.)
    gateway = up(cluster, controllers=2)
    names = ["r0", "r1", "r2"]
    for name in names:
        gateway.create_run(name, runtime="python", handler="handler.handle", files=ECHO)
    core = client.CoreV1Api(cluster.client)

    uids = [gateway.status(name).uid for name in names]
    most_held = 0

    def moved_off(doomed: set[str]) -> bool:
        # Sampled all along, not only at the end: at no moment two servers hold one Run.
        nonlocal most_held
        most_held = max(most_held, *(len(held_by(cluster, uid)) for uid in uids))
        statuses = [gateway.status(name)["status"] for name in names]
        return all(s["phase"] == "Ready" and s["assignedPod"] not in doomed for s in statuses)

    for _ in range(2):
        doomed = {gateway.status(name)["status"]["assignedPod"] for name in names}
        for pod in doomed:
            core.delete_namespaced_pod(pod, NAMESPACE)
        wait_until(lambda doomed=doomed: moved_off(doomed), timeout=90)
    assert most_held == 1
    for name in names:
        run = gateway.status(name)
        assert held_by(cluster, run.uid) == [run["status"]["assignedPod"]]
        assert gateway.invoke(name, {}).value()["echo"] == {}
        # Each pod death was one attempt, whichever controller wrote it.
        assert run["status"]["attempt"] <= 3


def test_a_run_applied_with_kubectl_is_reconciled_like_one_created_through_the_gateway(
    cluster: Cluster,
) -> None:
    gateway = up(cluster)
    custom = client.CustomObjectsApi(cluster.client)
    manifest = {
        "apiVersion": objects.API_VERSION, "kind": "Run", "metadata": {"name": "applied"},
        "spec": {"runtime": "bash", "handler": "fn.handle",
                 "files": {"fn.sh": "handle() { printf '{\"hi\": %s}' \"$1\"; }\n"}},
    }  # fmt: skip
    custom.create_namespaced_custom_object(G, V, NAMESPACE, P, manifest)
    wait_until(lambda: run_object(cluster, "applied").get("status", {}).get("phase") == "Ready",
               timeout=60)  # fmt: skip
    obj = run_object(cluster, "applied")
    assert objects.FINALIZER in obj["metadata"]["finalizers"] and obj["status"]["attempt"] == 1
    # The gateway's cache is as fresh as its watch (docs/kubernetes.md, "Fences at the API level"):
    # it serves the Run once the watch has brought it Ready, which the API server said a moment ago.
    wait_until(lambda: gateway.status("applied").phase == "Ready", timeout=30)
    assert gateway.invoke("applied", 7).value() == {"hi": 7}
    # `kubectl delete run applied`: held by the finalizer until runtimed unregistered it.
    custom.delete_namespaced_custom_object(G, V, NAMESPACE, P, "applied")
    wait_until(lambda: not custom.list_namespaced_custom_object(G, V, NAMESPACE, P)["items"],
               timeout=60)  # fmt: skip
    assert held_by(cluster, obj["metadata"]["uid"]) == []
    assert json.loads(json.dumps(gateway.list_runs())) == []
    # A bad one is Failed, naming the field, as POST /v1/runs would answer 400.
    custom.create_namespaced_custom_object(G, V, NAMESPACE, P, {
        **manifest, "metadata": {"name": "bad"}, "spec": {**manifest["spec"], "memoryMb": 1},
    })  # fmt: skip
    wait_until(lambda: run_object(cluster, "bad").get("status", {}).get("phase") == "Failed",
               timeout=30)  # fmt: skip
    assert run_object(cluster, "bad")["status"]["message"].startswith("memoryMb: ")


@pytest.mark.usefixtures("fnkernel_spec")  # the kernel nbclient starts
def test_a_function_with_packages_and_a_secret_on_the_cluster(
    tmp_path: Path, node_wheelhouse: Path
) -> None:
    # docs/protocol.md, "Requirements": on Kubernetes runtimed installs a Run's requirements into
    # the pod's package cache volume, from the index its env names (here a wheelhouse the
    # Runtime Pods mount from the node, and no index at all); "Secrets": a secret set through
    # the gateway is a labelled Secret, which runtimed reads under its own Role. The notebook
    # of every backend (tests/packages_and_secrets.py), then the Run's files on the pod.
    cluster = Cluster(tmp_path, wheelhouse=node_wheelhouse)
    try:
        gateway = up(cluster)
        kernel_env = {"FNKERNEL_RUNTIME": cluster.gateway, "FNKERNEL_TOKEN": cluster.token}
        set_secret(tmp_path, kernel_env)
        a_function_brings_its_packages_and_a_secret(tmp_path, kernel_env)
        handler = {
            "handler.py": "import fnk_alpha, os\ndef handle(event):\n"
            "    return fnk_alpha.__file__, len(os.environ['DB_PASSWORD'])\n"
        }
        run = gateway.create_run("deps", runtime="python", handler="handler.handle",
                                 files=handler, requirements=["fnk-alpha==1.0"],
                                 secrets=["warehouse"])  # fmt: skip
        assert run.phase == "Ready", run.message
        where, length = gateway.invoke("deps", {}).value()
        assert length == len(SECRET)
        # in the pod's package cache volume, as the node agent made it
        assert where.startswith(str(cluster.node_root)) and "/volumes/packages/envs/" in where
        assert SECRET not in json.dumps(run_object(cluster, "deps"))
    finally:
        cluster.stop()


def test_a_payload_past_one_message_is_streamed_through_the_cluster(cluster: Cluster) -> None:
    # docs/protocol.md, "Large payloads": on Kubernetes the caller is on another machine: the
    # gateway (no spool of its own) streams the body into the Runtime Pod's spool volume and
    # the result back out; the spool is left empty.
    gateway = up(cluster)
    gateway.create_run("same", runtime="python", handler="handler.handle",
                       files={"handler.py": "def handle(event):\n    return event\n"})  # fmt: skip
    assert gateway.local_spool() is None  # nothing of the cluster is this machine's to write
    large = bytes(range(256)) * (64 * 1024)  # 16 MiB
    result = gateway.invoke("same", large)
    assert result.value() == large and len(result.output) == len(large)
    pod = gateway.status("same")["status"]["assignedPod"]
    (found,) = [p for p in cluster.runtime_pods() if p["metadata"]["name"] == pod]
    spool = cluster.node_root / found["metadata"]["uid"] / "volumes" / "spool"
    assert spool.is_dir() and spooled(spool) == []
