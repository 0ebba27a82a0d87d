"""fnkernel's pods as containers of its image, run as deploy/'s manifests say — read-only root,
uid 65532, no privilege escalation, no capabilities, their memory limits and volumes — against
the emulated API server (docs/kubernetes.md, "What is tested, and with which doubles")."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes import client

from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2 as pb
from fnkernel.runtime_server._proto.executor.v1 import runtime_pb2_grpc as pb_grpc
from fnkernel.runtime_server.client import Client
from fnkernel.runtime_server.client.errors import FunctionNotFound, HandlerFailed
from fnkernel.runtime_server.lifecycle.kubernetes import objects
from fnkernel.runtime_server.rpc import CHANNEL_OPTIONS
from tests.kubernetes.conftest import NAMESPACE, POD_USER, Cluster
from tests.kubernetes.node_agent import KUBECONFIG_IN_POD
from tests.kubernetes.runs import cut_short, held_by
from tests.packages_and_secrets import a_function_brings_its_packages_and_a_secret, set_secret
from tests.support import wait_until

pytestmark = pytest.mark.timeout(420)
RUNTIME_PODS = 3  # deploy/runtime-pods.yaml: python 2, bash 1
G, V, P = objects.GROUP, objects.VERSION, objects.PLURAL
WHERE = {
    "handler.py": "import os, tempfile\n"
    "def written(path):\n"
    "    try:\n"
    "        with open(path, 'w') as out:\n"
    "            out.write('x')\n"
    "        return 'written'\n"
    "    except OSError as exc:\n"
    "        return type(exc).__name__\n"
    "def handle(event):\n"
    "    return {'uid': os.getuid(), 'cwd': os.getcwd(), 'root': written('/fnkernel-was-here'),\n"
    "            'own dir': written('scratch.txt'),\n"
    "            'tmp': written(os.path.join(tempfile.gettempdir(), 'scratch.txt')),\n"
    "            'db user': os.environ.get('DB_USER')}\n"
}


def up(cluster: Cluster) -> Client:
    """Every Deployment's pods Ready (each a set of containers), and a client of the gateway in
    its pod."""

    def ready() -> bool:
        return (len(cluster.pods("controller")) == 1 and len(cluster.pods("gateway")) == 1
                and len(cluster.runtime_pods()) == RUNTIME_PODS)  # fmt: skip

    wait_until(ready, timeout=300)
    return Client(cluster.gateway_pod_address(), token=cluster.token)


def _inspect(name: str) -> dict[str, Any]:
    done = subprocess.run(["podman", "inspect", name], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)[0]
    return found


def test_every_pod_runs_its_containers_as_its_manifest_says(cluster: Cluster, image: str) -> None:
    # docs/kubernetes.md, "What is tested, and with which doubles": what the product runs is run as
    # written — each container of each Deployment's pod, of the image deploy/ names, with its
    # manifest's user, read-only root, no privilege escalation, no capabilities and memory limit.
    up(cluster)
    pods = [*cluster.pods("controller"), *cluster.pods("gateway"), *cluster.runtime_pods()]
    for pod in pods:
        spec = pod["spec"]
        for container in spec["containers"]:
            seen = _inspect(f"{pod['metadata']['name']}-{container['name']}")
            security = {**spec["securityContext"], **container["securityContext"]}
            assert seen["ImageName"] == image == container["image"]
            assert seen["Config"]["User"] == f"{security['runAsUser']}:{security['runAsGroup']}"
            host = seen["HostConfig"]
            assert host["ReadonlyRootfs"] is True and security["readOnlyRootFilesystem"] is True
            assert "no-new-privileges" in host["SecurityOpt"]
            assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            assert seen["EffectiveCaps"] in (None, [])
            limit = container["resources"]["limits"]["memory"]
            assert host["Memory"] == int(limit[:-2]) * {"Mi": 2**20, "Gi": 2**30}[limit[-2:]]
            # Only the pod's volumes (and the test's kubeconfig, standing in for the service
            # account's token) are mounted: no tmpfs of podman's own on /tmp.
            mounts = {m["Destination"] for m in seen["Mounts"]} - {KUBECONFIG_IN_POD}
            assert mounts == {m["mountPath"] for m in container.get("volumeMounts") or ()}
            assert not host.get("Tmpfs")


def test_a_run_is_created_called_and_deleted_through_the_containers(cluster: Cluster) -> None:
    # docs/kubernetes.md, "What each container may write": the gateway and the controller run
    # with a read-only root and no writable volume, and a create works (it answered 500 before:
    # its checks made a temporary directory); a handler runs as the pod's user, writes where its
    # pod lets it (its own directory, /tmp) and nowhere else.
    gateway = up(cluster)
    run = gateway.create_run("where", runtime="python", handler="handler.handle", files=WHERE)
    assert run.phase == "Ready", run.message
    seen = gateway.invoke("where", {}).decoded()
    assert seen["uid"] == POD_USER
    assert seen["cwd"].startswith("/var/lib/fnkernel/workspace/")
    assert seen["root"] in ("OSError", "PermissionError")  # read-only, and not root's
    assert seen["own dir"] == "written" and seen["tmp"] == "written"
    gateway.delete_run("where")
    # docs/protocol.md, "Large payloads": past one message, from a caller on another machine,
    # streamed through the gateway's container and runtimed's into the server's spool volume,
    # and back out.
    gateway.create_run("same", runtime="python", handler="handler.handle",
                       files={"handler.py": "def handle(event):\n    return event\n"})  # fmt: skip
    large = bytes(range(256)) * (64 * 1024)  # 16 MiB
    assert gateway.invoke("same", large).value() == large
    gateway.delete_run("same")
    assert [r.name for r in gateway.list_runs()] == []


def _phase(gateway: Client, name: str) -> tuple[str, int]:
    """The Run's phase and attempt as the gateway sees it; ("", 0) before it sees the Run."""
    try:
        run = gateway.status(name)
    except FunctionNotFound:
        return "", 0
    return run.phase, run.attempt


def _grants(cluster: Cluster, role: str) -> set[tuple[str, str]]:
    """(group/resource, verb) of every rule of `role` in deploy/."""
    (found,) = [
        o for o in cluster.manifests if o["kind"] == "Role" and o["metadata"]["name"] == role
    ]
    return {
        (f"{group}/{resource}" if group else resource, verb)
        for rule in found["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_each_role_grants_exactly_the_calls_its_component_makes(cluster: Cluster) -> None:
    # docs/kubernetes.md, "Who may do what": the Roles are derived from the calls. Each pod
    # calls the API server with its service account's token, which the emulated API server
    # authorizes by deploy/'s Roles and records. A team's day uses every grant of each Role,
    # and nothing is refused: a create, a call, a read of its files and a delete through the
    # gateway; a create the gateway cut short, which the controller finishes; a Run applied
    # and deleted with kubectl; a Runtime Pod deleted under a Run; a Run whose deletion the
    # gateway began and did not see through, which the controller finishes; a secret set, set
    # again, listed, used by a Run and deleted (docs/protocol.md, "Secrets").
    gateway = up(cluster)
    custom = client.CustomObjectsApi(cluster.client)
    gateway.set_secret("warehouse", {"DB_USER": "bob"})
    gateway.set_secret("warehouse", {"DB_USER": "alice"})
    assert [s["name"] for s in gateway.list_secrets()] == ["warehouse"]
    gateway.create_run("where", runtime="python", handler="handler.handle", files=WHERE,
                       secrets=["warehouse"])  # fmt: skip
    seen = gateway.invoke("where", {}).decoded()
    assert (seen["uid"], seen["db user"]) == (POD_USER, "alice")
    gateway.delete_secret("warehouse")
    assert gateway.files("where")["files"] == WHERE
    cut_short(cluster.client, NAMESPACE, "cut", WHERE)
    wait_until(lambda: _phase(gateway, "cut") == ("Ready", 1), timeout=60)
    gateway.delete_run("cut")
    custom.create_namespaced_custom_object(G, V, NAMESPACE, P, {
        "apiVersion": objects.API_VERSION, "kind": "Run", "metadata": {"name": "applied"},
        "spec": {"runtime": "python", "handler": "handler.handle", "files": WHERE},
    })  # fmt: skip
    wait_until(lambda: _phase(gateway, "applied") == ("Ready", 1), timeout=60)
    pod = gateway.status("applied")["status"]["assignedPod"]
    client.CoreV1Api(cluster.client).delete_namespaced_pod(pod, NAMESPACE)
    wait_until(lambda: _phase(gateway, "applied") == ("Ready", 2), timeout=120)
    assert gateway.invoke("applied", {}).decoded()["uid"] == POD_USER
    custom.delete_namespaced_custom_object(G, V, NAMESPACE, P, "applied")  # kubectl delete
    wait_until(lambda: _phase(gateway, "applied") == ("", 0), timeout=60)
    # The gateway sees its delete through while the controller is paused.
    (controller,) = cluster.pods("controller")
    paused = f"{controller['metadata']['name']}-controller"
    subprocess.run(["podman", "pause", paused], check=True, capture_output=True, timeout=60)
    try:
        gateway.delete_run("where")
    finally:
        subprocess.run(["podman", "unpause", paused], check=True, capture_output=True, timeout=60)
    # A delete a gateway began (the Run's phase Deleting) and did not see through.
    gateway.create_run("orphan", runtime="python", handler="handler.handle", files=WHERE)
    obj = custom.get_namespaced_custom_object(G, V, NAMESPACE, P, "orphan")
    obj["status"] = {**obj["status"], "phase": "Deleting", "message": "deleting"}
    custom.replace_namespaced_custom_object_status(G, V, NAMESPACE, P, "orphan", obj)
    wait_until(lambda: gateway.list_runs() == [], timeout=60)
    calls = json.loads(urllib.request.urlopen(f"{cluster.api.url}/emulator/calls").read())
    assert [call for call in calls if not call["allowed"]] == []
    differences = {}
    for account in ("fnkernel-runtime", "fnkernel-controller", "fnkernel-gateway"):
        user = f"system:serviceaccount:{NAMESPACE}:{account}"
        used = {
            (f"{c['group']}/{c['resource']}" if c["group"] else c["resource"], c["verb"])
            for c in calls
            if c["user"] == user
        }
        granted = _grants(cluster, account)
        if used != granted:
            differences[account] = {
                "granted, not used": sorted(granted - used),
                "used, not granted": sorted(used - granted),
            }
    assert differences == {}, json.dumps(differences, indent=1)


@pytest.mark.usefixtures("fnkernel_spec")  # the kernel it starts
def test_a_kernel_registers_invokes_and_unregisters_through_the_containers(
    cluster: Cluster,
) -> None:
    # README, "On Kubernetes": a kernel with FNKERNEL_RUNTIME at the gateway (and its token)
    # registers its cells as Runs in the cluster, calls them and unregisters them — here every
    # hop a container: gateway → runtimed → Runtime Server → worker.
    from tests.kernel.kernels import Kernel

    gateway = up(cluster)
    kernel = Kernel(env={"FNKERNEL_RUNTIME": cluster.gateway, "FNKERNEL_TOKEN": cluster.token})
    try:
        cell = kernel.run("%%function where\n" + WHERE["handler.py"].replace("handle(", "handler("))
        assert cell.ok, cell.error
        assert "state READY" in cell.texts()[-1]
        answer = kernel.value("where()")
        assert answer["uid"] == POD_USER and answer["own dir"] == "written"
        assert [r.name for r in gateway.list_runs()] == ["where"]
        cell = kernel.run("where.unregister()")
        assert cell.ok, cell.error
        assert gateway.list_runs() == []
    finally:
        kernel.shutdown()


@pytest.mark.usefixtures("fnkernel_spec")  # the kernel nbclient starts
def test_a_function_with_packages_and_a_secret_through_the_containers(
    cluster: Cluster, tmp_path: Path
) -> None:
    # docs/protocol.md, "Requirements" and "Secrets", as on every backend
    # (tests/packages_and_secrets.py): runtimed in its container, read-only root and uid
    # 65532, installs with the image's uv into the pod's package cache volume, and reads the
    # labelled Secret the gateway's container wrote.
    gateway = up(cluster)
    kernel_env = {
        "FNKERNEL_RUNTIME": cluster.gateway_pod_address(),
        "FNKERNEL_TOKEN": cluster.token,
    }
    set_secret(tmp_path, kernel_env)
    a_function_brings_its_packages_and_a_secret(tmp_path, kernel_env)
    # etl unregistered; the cell that failed left its Failed Run, to read and fix
    assert {r.name: r.phase for r in gateway.list_runs()} == {"lost": "Failed"}


def test_the_controllers_pod_deleted_mid_admission_loses_nothing(cluster: Cluster) -> None:
    # docs/kubernetes.md, "Fences at the API level": the controller holds no state the API server
    # does not. A Run applied with kubectl waits for the controller to admit it; the controller's
    # pod deleted right after the apply (before or while it admits it), the Deployment's next
    # controller takes the Run where it stands: Ready at attempt 1, admitted once.
    gateway = up(cluster)
    (controller,) = cluster.pods("controller")
    client.CustomObjectsApi(cluster.client).create_namespaced_custom_object(G, V, NAMESPACE, P, {
        "apiVersion": objects.API_VERSION, "kind": "Run", "metadata": {"name": "survivor"},
        "spec": {"runtime": "python", "handler": "handler.handle", "files": WHERE},
    })  # fmt: skip
    client.CoreV1Api(cluster.client).delete_namespaced_pod(
        controller["metadata"]["name"], NAMESPACE
    )
    wait_until(lambda: [p["metadata"]["name"] for p in cluster.pods("controller")]
               not in ([], [controller["metadata"]["name"]]), timeout=60)  # fmt: skip
    wait_until(lambda: _phase(gateway, "survivor") == ("Ready", 1), timeout=120)
    assert gateway.invoke("survivor", {}).decoded()["uid"] == POD_USER


HOG = {
    "handler.py": "def handle(event):\n    block = b'x' * (event['mib'] << 20)\n    return len(block)\n"
}


def test_a_handler_past_its_pods_memory_limit_is_killed_and_the_function_stays(
    cluster: Cluster,
) -> None:
    # docs/kubernetes.md, "What is tested, and with which doubles": the Runtime Pod's server runs
    # under its manifest's memory limit (2Gi). A handler allowed more by its own memoryMb is killed
    # inside that limit when it takes more; its call fails (WorkerCrashed), a fresh worker takes the
    # next call, and the function stays registered: nothing else of the pod is lost.
    gateway = up(cluster)
    gateway.create_run("hog", runtime="python", handler="handler.handle", memory_mb=4096,
                       files=HOG)  # fmt: skip
    assert gateway.invoke("hog", {"mib": 8}).decoded() == 8 << 20
    with pytest.raises(HandlerFailed) as killed:
        gateway.invoke("hog", {"mib": 2600}, timeout_millis=120_000)
    assert killed.value.error_type == "WorkerCrashed", killed.value
    assert gateway.invoke("hog", {"mib": 8}).decoded() == 8 << 20
    assert _phase(gateway, "hog") == ("Ready", 1)


def test_a_run_moved_by_its_pods_deletion_fences_its_old_registration_id(
    cluster: Cluster,
) -> None:
    # docs/protocol.md: a stale registration ID is FAILED_PRECONDITION. The Run's pod deleted,
    # the Run moves to another (attempt 2), the attempt-1 ID is refused where it now lives, and
    # only that pod's server holds a registration of it.
    gateway = up(cluster)
    gateway.create_run("moving", runtime="python", handler="handler.handle", files=WHERE)
    before = gateway.status("moving")
    old_pod, old_id = before["status"]["assignedPod"], before["live"]["registrationId"]
    client.CoreV1Api(cluster.client).delete_namespaced_pod(old_pod, NAMESPACE)
    wait_until(lambda: _phase(gateway, "moving") == ("Ready", 2), timeout=120)
    moved = gateway.status("moving")
    assert moved["status"]["assignedPod"] != old_pod
    new = next(p for p in cluster.runtime_pods()
               if p["metadata"]["name"] == moved["status"]["assignedPod"])  # fmt: skip
    with grpc.insecure_channel(cluster.server_socket(new), options=CHANNEL_OPTIONS) as channel:
        stale = pb.InvokeFunctionRequest(
            registration=pb.FunctionRegistration(run_uid=moved.uid, registration_id=old_id),
            input=b"{}",
        )
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.FunctionRuntimeStub(channel).InvokeFunction(stale, timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert held_by(cluster, moved.uid) == [moved["status"]["assignedPod"]]
    assert gateway.invoke("moving", {}).decoded()["uid"] == POD_USER
