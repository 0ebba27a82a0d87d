"""Fixtures of the Kubernetes tests: the emulated API server (``tests/kubernetes/emulator.py``,
a test double) in a process of its own, and clients of it."""

from __future__ import annotations

import json
import os
import random
import secrets
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, utils

from fnkernel.runtime_server.daemon.announce import LISTENING_ON
from fnkernel.runtime_server.lifecycle.kubernetes.store import KubernetesRunStore
from tests.support import ROOT
from tests.wheelhouse import build_wheelhouse, offline_index

WHEELHOUSE = "/var/lib/fnkernel-wheelhouse"  # where a Runtime Pod mounts the test's wheelhouse


class EmulatedApi:
    """The emulated Kubernetes API server, as a running process and its URL."""

    def __init__(self, *args: str) -> None:
        """`args`: the emulator's own (``--history N``)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.kubernetes.emulator", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if " at " not in line:
            self.proc.kill()
            raise RuntimeError(f"the emulated API server did not start: {line!r}")
        self.url = line.rsplit(" at ", 1)[1].strip()

    def client(self) -> client.ApiClient:
        configuration = client.Configuration()
        configuration.host = self.url
        return client.ApiClient(configuration)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def kube_api() -> Iterator[EmulatedApi]:
    api = EmulatedApi()
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture
def api_client(kube_api: EmulatedApi) -> Iterator[client.ApiClient]:
    with kube_api.client() as api_client:
        yield api_client


STORE_NAMESPACE = "fn"  # the `store` fixture's


@pytest.fixture
def store(kube_api: EmulatedApi) -> Iterator[KubernetesRunStore]:
    """A Run store of the namespace STORE_NAMESPACE, as the controller and the gateway open it."""
    opened = KubernetesRunStore(kube_api.client(), STORE_NAMESPACE)
    try:
        yield opened
    finally:
        opened.close()


# The pods' user (the manifests' runAsUser): when the tests run as root, the test node agent runs
# the pods as it, and they cannot read the files of the test, the controller or the gateway.
POD_USER = 65532
NAMESPACE = "fnkernel"  # deploy/kustomization.yaml's
_BOOT = (
    "import runpy, site, sys; site.addsitedir({site!r}); sys.argv[0] = 'fnkernel'; "
    "runpy.run_module('fnkernel.runtime_server.cli', run_name='__main__', alter_sys=True)"
)


def pod_entrypoint() -> tuple[list[str], int | None]:
    """The image's entrypoint for the test node agent — `fnkernel` as a process of this machine
    — and the user pods run as (None: this one). An interpreter under a directory only root may
    enter (a pyenv in /root) cannot run as another user: then the system's Python of the same
    version runs with this environment's packages added."""
    purelib = sysconfig.get_paths()["purelib"]
    if os.geteuid() != 0:
        return [sys.executable, "-m", "fnkernel.runtime_server.cli"], None
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (sys.executable, shutil.which(version, path="/usr/bin:/usr/local/bin")):
        if python is None:
            continue
        argv = [python, "-c", _BOOT.format(site=purelib)]
        try:
            probe = subprocess.run(
                [*argv, "--help"], user=POD_USER, group=POD_USER, extra_groups=[],
                capture_output=True, cwd="/", timeout=60,
            )  # fmt: skip
        except PermissionError:
            continue
        if probe.returncode == 0:
            return argv, POD_USER
    reason = f"no Python this environment's packages load in runs as uid {POD_USER}"
    if os.environ.get("CI") == "true":  # CI must run the cluster tests: never a silent skip
        pytest.fail(f"{reason} (a clone in a private directory? make test-k8s runs the image)")
    pytest.skip(reason)


def kustomize_build(token: str, target: Path) -> list[dict[str, Any]]:
    """deploy/ as `kubectl kustomize` builds it (with `token` as the gateway's token file)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail(
            "kubectl is needed to build deploy/ (Debian: apt-get install kubernetes-client)"
        )
    shutil.copytree(ROOT / "deploy", target)
    (target / "gateway-token").write_text(token + "\n")
    built = subprocess.run(
        [kubectl, "kustomize", str(target)], capture_output=True, text=True, timeout=60
    )
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


def image_of(manifests: list[dict[str, Any]]) -> str:
    """The one image every container of deploy/ runs (docs/kubernetes.md, "The image")."""
    images = {
        container["image"]
        for obj in manifests
        if obj["kind"] == "Deployment"
        for container in obj["spec"]["template"]["spec"]["containers"]
    }
    assert len(images) == 1, images
    return images.pop()


class Cluster:
    """What the Kubernetes end-to-end tests run against: the emulated API server and the test
    node agent (test doubles, in processes of their own) with deploy/'s manifests applied, and
    the controller and the gateway as processes of this machine, started from the manifests'
    command lines (`controller`, `gateway`: see ``start_controller``, ``start_gateway``)."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        containers: bool = False,
        wheelhouse: Path | None = None,
    ) -> None:
        """`containers`: every Deployment's pods — the controller's and the gateway's too — are
        containers podman runs from the image, as the manifests say (``make test-k8s``);
        otherwise the Runtime Pods are processes and the test starts the controller and the
        gateway. `wheelhouse`: a directory of the node (readable by the pods' user) every
        Runtime Pod mounts read-only at WHEELHOUSE, and runtimed's package index, as a team's
        overlay would name its own (docs/protocol.md, "Requirements")."""
        self.tmp = tmp_path
        self.containers = containers
        self.token = secrets.token_urlsafe(24)
        self.manifests = kustomize_build(self.token, tmp_path / "deploy")
        if wheelhouse is not None:
            _mount_wheelhouse(self.manifests, wheelhouse)
        self.api = EmulatedApi()
        # The node's own directory, which the pods' user may enter (the test's tmp_path is 0700).
        self.node_root = Path(tempfile.mkdtemp(prefix="fnkernel-node-"))
        self.node_root.chmod(0o711)
        self.kubeconfig = self.node_root / "kubeconfig"
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulated",
            "clusters": [{"name": "emulated", "cluster": {"server": self.api.url}}],
            "contexts": [{"name": "emulated", "context": {"cluster": "emulated", "user": "test",
                                                          "namespace": NAMESPACE}}],
            "users": [{"name": "test", "user": {}}],
        }))  # fmt: skip
        self.kubeconfig.chmod(0o644)
        self.client = self.api.client()
        self.processes: dict[str, subprocess.Popen[str]] = {}
        self.logs = tmp_path / "logs"
        self.logs.mkdir()
        try:
            for obj in self.manifests:
                if obj["kind"] == "Namespace":
                    # Every namespace exists in the emulator; KMock reads /api/v1/namespaces
                    # as the start of a namespaced path, so a Namespace cannot be created.
                    continue
                utils.create_from_dict(self.client, obj, namespace=obj["metadata"].get("namespace"))
            prefix = f"127.{random.randint(2, 254)}.{random.randint(0, 254)}"
            agent = [
                sys.executable, "-m", "tests.kubernetes.node_agent",
                "--kubeconfig", str(self.kubeconfig), "--namespace", NAMESPACE,
                "--root", str(self.node_root), "--ip-prefix", prefix,
            ]  # fmt: skip
            if containers:
                self.pod_user: int | None = POD_USER
                agent += ["--podman", "--deployments", "app.kubernetes.io/part-of=fnkernel"]
            else:
                entrypoint, self.pod_user = pod_entrypoint()
                agent += ["--image", f"{image_of(self.manifests)}=" + shlex.join(entrypoint),
                          "--deployments", "app.kubernetes.io/component=runtime-pod"]  # fmt: skip
            self._start("node-agent", agent, ready="node agent ready")
        except BaseException:
            self.stop()
            raise

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "FNKERNEL_NAMESPACE": NAMESPACE}

    def _start(self, name: str, argv: list[str], ready: str) -> str:
        log = (self.logs / f"{name}.log").open("a")
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=self.env(), stdout=subprocess.PIPE, stderr=log, text=True
        )
        log.close()
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if ready not in line:
            proc.kill()
            raise RuntimeError(f"{name} did not start: {line!r}; {self.log(name)}")
        self.processes[name] = proc
        return line

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def manifest_args(self, kind: str, name: str) -> list[str]:
        for obj in self.manifests:
            if obj["kind"] == kind and obj["metadata"]["name"] == name:
                return list(obj["spec"]["template"]["spec"]["containers"][0]["args"])
        raise KeyError(name)

    def start_controller(self, name: str = "controller") -> None:
        args = self.manifest_args("Deployment", "fnkernel-controller")
        self._start(name, [sys.executable, "-m", "fnkernel.runtime_server.cli", *args],
                    ready="fnkernel controller:")  # fmt: skip

    def start_gateway(self, listen: str = "127.0.0.1:0") -> str:
        """The gateway of the manifest, on `listen` with the token in a file of the test's own
        (0600: the pods' user cannot read it); its address."""
        token_file = self.tmp / "token"
        token_file.write_text(self.token + "\n")
        token_file.chmod(0o600)
        args = self.manifest_args("Deployment", "fnkernel-gateway")
        args[args.index("--listen") + 1] = listen
        args[args.index("--token-file") + 1] = str(token_file)
        line = self._start("gateway", [sys.executable, "-m", "fnkernel.runtime_server.cli", *args],
                           ready=LISTENING_ON)  # fmt: skip
        self.gateway = "http://" + line.split(LISTENING_ON, 1)[1].split(",", 1)[
            0
        ].strip().removeprefix("http://")
        return self.gateway

    def pods(self, component: str, *, ready: bool = True) -> list[dict[str, Any]]:
        """The pods of `component` (``controller``, ``gateway``, ``runtime-pod``), Ready ones
        only unless `ready` is False."""
        listed = client.CoreV1Api(self.client).list_namespaced_pod(
            NAMESPACE, label_selector=f"app.kubernetes.io/component={component}",
            _preload_content=False,
        )  # fmt: skip
        return [
            pod for pod in json.loads(listed.data)["items"]
            if not ready or any(c["type"] == "Ready" and c["status"] == "True"
                                for c in (pod.get("status") or {}).get("conditions") or ())
        ]  # fmt: skip

    def gateway_pod_address(self) -> str:
        """The gateway's address in its pod, once it is Ready (``containers``)."""
        port = next(
            p["containerPort"]
            for obj in self.manifests
            if obj["kind"] == "Deployment" and obj["metadata"]["name"] == "fnkernel-gateway"
            for p in obj["spec"]["template"]["spec"]["containers"][0]["ports"]
        )
        (pod,) = self.pods("gateway")
        self.gateway = f"http://{pod['status']['podIP']}:{port}"
        return self.gateway

    def kill(self, name: str) -> None:
        proc = self.processes.pop(name)
        proc.kill()
        proc.wait(10)

    def runtime_pods(self, *, ready: bool = True) -> list[dict[str, Any]]:
        return self.pods("runtime-pod", ready=ready)

    def server_socket(self, pod: dict[str, Any]) -> str:
        """The Runtime Server's socket of `pod` (in its volume, as the node agent made it)."""
        return f"unix:{self.node_root / pod['metadata']['uid'] / 'volumes' / 'sockets' / 'server.sock'}"

    def stop(self) -> None:
        stopping, self.processes = list(self.processes.values()), {}
        for proc in stopping:  # all at once, as a cluster's pods stop: each drains meanwhile
            proc.terminate()
        deadline = time.monotonic() + 20
        for proc in stopping:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.api.stop()
        shutil.rmtree(self.node_root, ignore_errors=True)


@pytest.fixture
def node_wheelhouse() -> Iterator[Path]:
    """tests/wheelhouse.py's wheelhouse in a directory of the node the pods' user can read (not
    under /tmp: the node agent reads a path there in a pod's env as its /tmp volume's)."""
    node_dir = Path(tempfile.mkdtemp(prefix="fnkernel-wheels-", dir="/var/tmp"))
    try:
        wheelhouse = build_wheelhouse(node_dir / "wheelhouse")
        for path in (node_dir, wheelhouse, *wheelhouse.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
        yield wheelhouse
    finally:
        shutil.rmtree(node_dir, ignore_errors=True)


def _mount_wheelhouse(manifests: list[dict[str, Any]], wheelhouse: Path) -> None:
    for obj in manifests:
        if obj["kind"] != "Deployment" or not any(
            c["name"] == "runtimed" for c in _containers(obj)
        ):
            continue
        spec = obj["spec"]["template"]["spec"]
        spec["volumes"] = [*(spec.get("volumes") or []), {
            "name": "wheelhouse", "hostPath": {"path": str(wheelhouse), "type": "Directory"},
        }]  # fmt: skip
        for container in _containers(obj):
            if container["name"] == "runtimed":
                container["volumeMounts"] = [*(container.get("volumeMounts") or []), {
                    "name": "wheelhouse", "mountPath": WHEELHOUSE, "readOnly": True,
                }]  # fmt: skip
                index = offline_index(Path(WHEELHOUSE))
                container["env"] = [*(container.get("env") or []),
                                    *({"name": k, "value": v} for k, v in index.items())]  # fmt: skip


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """A Deployment's containers (none for any other object)."""
    if obj.get("kind") != "Deployment":
        return []
    return list(obj["spec"]["template"]["spec"]["containers"])


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    started = Cluster(tmp_path)
    try:
        yield started
    finally:
        started.stop()
