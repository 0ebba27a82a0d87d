"""fnkernel's pods as containers of its image, run as deploy/'s manifests say — read-only root,
uid 65532, no privilege escalation, no capabilities, their memory limits and volumes — against
the emulated API server (docs/kubernetes.md, "What is tested, and with which doubles")."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from fnkernel.runtime_server.client import Client
from tests.kubernetes.conftest import POD_USER, Cluster
from tests.kubernetes.node_agent import KUBECONFIG_IN_POD
from tests.support import wait_until

pytestmark = pytest.mark.timeout(420)
RUNTIME_PODS = 3  # deploy/runtime-pods.yaml: python 2, bash 1
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
    "            'tmp': written(os.path.join(tempfile.gettempdir(), 'scratch.txt'))}\n"
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
    # docs/kubernetes.md, "What is tested": what the product runs is run as written — each
    # container of each Deployment's pod, of the image deploy/ names, with its manifest's user,
    # read-only root, no privilege escalation, no capabilities and memory limit.
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
    assert [r.name for r in gateway.list_runs()] == []
