"""The test node agent — a test double of the kubelet, and of the Deployment controller, for the
Kubernetes tests; never part of the product (docs/kubernetes.md, "What is tested, and with which
doubles"). A pod's containers are processes of this machine, or (``--podman``, for ``make
test-k8s``) containers podman runs from their image as the manifest says.

As the Deployment controller: for each Deployment of its namespace that ``--deployments``
selects, it keeps ``spec.replicas`` pods of the template (named DEPLOYMENT-xxxxx, bound to its
node), replacing one that is deleted and removing the extra ones after a scale down (those with
the lowest ``controller.kubernetes.io/pod-deletion-cost`` first).

As the kubelet of its node, for each pod bound to it:

- it gives the pod its own loopback IP (PREFIX.N; ``0.0.0.0`` in a container's args is bound
  to it), so every pod listens on the same ports;
- each volume is a fresh directory (an emptyDir 0777, as the kubelet makes one; a Secret's keys
  as files) or a hostPath, the node's directory itself, and each container's mountPaths in its
  args and env name those directories;
- ``$(VAR)`` in args is expanded from the container's env, downward-API fields included;
- each container's command is its image's entrypoint (``--image NAME=ARGV``) with its args, run
  as a local process with the pod's env — as the pod's ``runAsUser``/``runAsGroup`` when this
  agent runs as root, so that the pod cannot read what the rest of the test keeps — and a
  kubeconfig holding a token of the pod's service account (from the TokenRequest API, as the
  kubelet projects one), which the API server authorizes by the account's Roles;
- it reports ``status.podIP``, phase Running and the Ready condition from the readiness probe
  (``grpc`` or ``tcpSocket``; without one, Ready while running), restarts a container that
  exits (``restartPolicy: Always``), and kills a pod's processes when the pod is deleted.

Run as a program: ``python -m tests.kubernetes.node_agent --kubeconfig F --namespace NS --root
DIR --ip-prefix 127.X.Y --image localhost/fnkernel:0.1.0='python -m fnkernel.runtime_server.cli'``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubernetes import client, config

_TICK = 0.2
_RESTART_BACKOFF = 0.5
_TERMINATION_GRACE = 3.0
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
KUBECONFIG_IN_POD = "/var/run/fnkernel-test/kubeconfig"
_UNITS = {"Ki": "k", "Mi": "m", "Gi": "g"}


def _bytes(quantity: str) -> str:
    """A Kubernetes memory quantity (``256Mi``) as podman takes it (``256m``)."""
    for suffix, unit in _UNITS.items():
        if quantity.endswith(suffix):
            return quantity[: -len(suffix)] + unit
    return quantity


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` in a container's args: VAR's value if it is defined; ``$$`` is $."""

    def value(found: re.Match[str]) -> str:
        if found.group(0) == "$$":
            return "$"
        return env.get(found.group(1), found.group(0))

    return _VAR.sub(value, text)


def _json(response: Any) -> Any:
    return json.loads(response.data)


@dataclass
class Container:
    name: str
    image: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log: IO[bytes]
    user: int | None
    group: int | None
    extra_groups: list[int]
    podman: str = ""  # the container's name, when podman runs it (argv is then `podman run`)
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    exited_at: float = 0.0

    def start(self) -> None:
        kwargs: dict[str, Any] = {}
        if self.user is not None and not self.podman:
            kwargs.update(user=self.user, group=self.group, extra_groups=self.extra_groups)
        if self.podman:  # a container of the name a restart left behind
            subprocess.run(["podman", "rm", "-f", self.podman], capture_output=True, timeout=60)
        self.proc = subprocess.Popen(
            self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=self.log,
            stderr=subprocess.STDOUT, start_new_session=True, **kwargs,
        )  # fmt: skip

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.podman:
                subprocess.run(["podman", "kill", "--signal", str(signum), self.podman],
                               capture_output=True, timeout=60)  # fmt: skip
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signum)

    def remove(self) -> None:
        if self.podman:
            subprocess.run(["podman", "rm", "-f", self.podman], capture_output=True, timeout=60)


@dataclass
class RunningPod:
    uid: str
    name: str
    ip: str
    root: Path
    spec: dict[str, Any]
    containers: list[Container] = field(default_factory=list)
    reported: dict[str, Any] = field(default_factory=dict)


class NodeAgent:
    def __init__(
        self,
        api_client: client.ApiClient,
        namespace: str,
        *,
        node: str,
        root: Path,
        ip_prefix: str,
        images: dict[str, list[str]],
        kubeconfig: Path,
        deployments: str,
        podman: bool = False,
    ) -> None:
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.namespace = namespace
        self.node = node
        self.root = root
        self.images = images
        self.kubeconfig = kubeconfig
        self.deployments = deployments
        self.podman = podman  # containers run by podman from their images, not as processes
        self.free_ips = [f"{ip_prefix}.{n}" for n in range(2, 255)]
        self.running: dict[str, RunningPod] = {}
        self.stop = threading.Event()

    # The Deployment controller's part

    def sync_deployments(self, pods: list[dict[str, Any]]) -> None:
        listed = _json(self.apps.list_namespaced_deployment(
            self.namespace, label_selector=self.deployments, _preload_content=False
        ))  # fmt: skip
        for deployment in listed["items"]:
            selector = deployment["spec"]["selector"].get("matchLabels") or {}
            owned = [
                pod for pod in pods
                if not pod["metadata"].get("deletionTimestamp")
                and all((pod["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())
            ]  # fmt: skip
            wanted = deployment["spec"].get("replicas", 1)
            for _ in range(wanted - len(owned)):
                self._create_pod(deployment)
            if len(owned) > wanted:

                def cost(pod: dict[str, Any]) -> int:
                    notes = pod["metadata"].get("annotations") or {}
                    return int(notes.get("controller.kubernetes.io/pod-deletion-cost", "0"))

                for pod in sorted(owned, key=cost)[: len(owned) - wanted]:
                    with contextlib.suppress(client.ApiException):
                        self.core.delete_namespaced_pod(pod["metadata"]["name"], self.namespace)

    def _create_pod(self, deployment: dict[str, Any]) -> None:
        template = deployment["spec"]["template"]
        name = deployment["metadata"]["name"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{name}-{uuid.uuid4().hex[:5]}",
                "labels": dict(template["metadata"].get("labels") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": name,
                        "uid": deployment["metadata"]["uid"],
                        "controller": True,
                    }
                ],
            },
            "spec": {**template["spec"], "nodeName": self.node},
        }
        self.core.create_namespaced_pod(self.namespace, pod)

    # The kubelet's part

    def sync_pods(self, pods: list[dict[str, Any]]) -> None:
        mine = {
            pod["metadata"]["uid"]: pod for pod in pods if pod["spec"].get("nodeName") == self.node
        }
        self.kill([
            uid for uid in self.running
            if (pod := mine.get(uid)) is None or pod["metadata"].get("deletionTimestamp")
        ])  # fmt: skip
        for uid, pod in mine.items():
            if uid not in self.running and not pod["metadata"].get("deletionTimestamp"):
                self.start(pod)
        for running in list(self.running.values()):
            self.tend(running)

    def start(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        ip = self.free_ips.pop(0)
        root = self.root / meta["uid"]
        (root / "logs").mkdir(parents=True)
        root.chmod(0o711)
        security = spec.get("securityContext") or {}
        as_root = os.geteuid() == 0
        user = security.get("runAsUser") if as_root else None
        group = security.get("runAsGroup", user) if as_root else None
        fs_group = security.get("fsGroup")
        volumes = self._volumes(pod, root, fs_group if as_root else None)
        kubeconfig = self._kubeconfig(spec.get("serviceAccountName") or "default", root)
        running = RunningPod(meta["uid"], meta["name"], ip, root, spec)
        fields = {"metadata.name": meta["name"], "metadata.namespace": self.namespace,
                  "metadata.uid": meta["uid"], "status.podIP": ip, "spec.nodeName": self.node}  # fmt: skip
        for container in spec["containers"]:
            log = open(root / "logs" / f"{container['name']}.log", "ab")  # noqa: SIM115 — lives with the pod
            if self.podman:
                running.containers.append(
                    self._podman(pod, container, volumes, fields, kubeconfig, log)
                )
                continue
            mounts = {
                m["mountPath"]: str(volumes[m["name"]] / m.get("subPath", ""))
                for m in container.get("volumeMounts") or ()
            }
            env = self._env(container, fields, mounts, root, kubeconfig)
            argv = [*self.images[container["image"]]]
            for arg in container.get("args") or ():
                argv.append(self._substitute(_expand(arg, env), mounts, ip))
            running.containers.append(Container(
                container["name"], container["image"], argv, env, root, log, user, group,
                [fs_group] if fs_group is not None and user is not None else [],
            ))  # fmt: skip
        self.running[meta["uid"]] = running
        for container in running.containers:
            container.start()
        self.report(running, ready=False)

    def _podman(
        self,
        pod: dict[str, Any],
        container: dict[str, Any],
        volumes: dict[str, Path],
        fields: dict[str, str],
        kubeconfig: Path,
        log: IO[bytes],
    ) -> Container:
        """`container` of `pod` as podman runs it, from the manifest as written: its image,
        args and env; the user and groups, read-only root, privilege escalation and
        capabilities of its security contexts; its memory limit; its volumes at their
        mountPaths. It shares the host's network, binding the pod's own loopback IP; a
        kubeconfig holds the pod's service account token (``_kubeconfig``)."""
        pod_security = pod["spec"].get("securityContext") or {}
        security = {**pod_security, **(container.get("securityContext") or {})}
        name = f"{pod['metadata']['name']}-{container['name']}"
        argv = ["podman", "run", "--rm", "--name", name, "--network=host",
                "--stop-timeout", str(int(_TERMINATION_GRACE))]  # fmt: skip
        if "runAsUser" in security:
            argv += ["--user", f"{security['runAsUser']}:{security.get('runAsGroup', 0)}"]
        if "fsGroup" in pod_security:
            argv += ["--group-add", str(pod_security["fsGroup"])]
        if security.get("readOnlyRootFilesystem"):
            # Kubernetes mounts no tmpfs of its own on a read-only root; podman would.
            argv += ["--read-only", "--read-only-tmpfs=false"]
        if security.get("allowPrivilegeEscalation") is False:
            argv += ["--security-opt", "no-new-privileges"]
        for capability in (security.get("capabilities") or {}).get("drop") or ():
            argv += ["--cap-drop", capability]
        memory = ((container.get("resources") or {}).get("limits") or {}).get("memory")
        if memory:
            argv += ["--memory", _bytes(memory), "--memory-swap", _bytes(memory)]
        for mount in container.get("volumeMounts") or ():
            source = volumes[mount["name"]] / mount.get("subPath", "")
            read_only = ":ro" if mount.get("readOnly") else ""
            argv += ["-v", f"{source}:{mount['mountPath']}{read_only}"]
        argv += ["-v", f"{kubeconfig}:{KUBECONFIG_IN_POD}:ro"]
        env = self._env(container, fields, {}, Path("/"), kubeconfig)
        env.update(KUBECONFIG=KUBECONFIG_IN_POD, HOME="/tmp")
        for key in ("PATH", "TMPDIR"):
            env.pop(key, None)  # the image's own
        for key, value in env.items():
            argv += ["-e", f"{key}={value}"]
        argv.append(container["image"])
        argv += [_expand(arg, env).replace("0.0.0.0:", f"{fields['status.podIP']}:")
                 for arg in container.get("args") or ()]  # fmt: skip
        root = self.root / pod["metadata"]["uid"]
        return Container(container["name"], container["image"], argv, dict(os.environ), root,
                         log, None, None, [], podman=name)  # fmt: skip

    def _volumes(self, pod: dict[str, Any], root: Path, fs_group: int | None) -> dict[str, Path]:
        volumes: dict[str, Path] = {}
        for volume in pod["spec"].get("volumes") or ():
            if "hostPath" in volume:  # the node's own directory, as it is
                volumes[volume["name"]] = Path(volume["hostPath"]["path"])
                continue
            path = root / "volumes" / volume["name"]
            path.mkdir(parents=True)
            if "secret" in volume:
                secret = self.core.read_namespaced_secret(
                    volume["secret"]["secretName"], self.namespace
                )
                mode = volume["secret"].get("defaultMode", 0o644)
                for key, value in (secret.data or {}).items():
                    target = path / key
                    target.write_bytes(base64.b64decode(value))
                    target.chmod(mode)
                    if fs_group is not None:
                        os.chown(target, 0, fs_group)
                path.chmod(0o755)
            else:  # an emptyDir, as the kubelet makes one
                path.chmod(0o777)
            volumes[volume["name"]] = path
        return volumes

    def _kubeconfig(self, account: str, root: Path) -> Path:
        """The pod's kubeconfig: the API server's address, and a token of the pod's service
        account from the TokenRequest API, as the kubelet projects one into a pod (the
        components read it from a kubeconfig, not from the in-cluster files, because the
        emulated API server speaks plain HTTP)."""
        answer = _json(self.core.create_namespaced_service_account_token(
            account, self.namespace, {"spec": {}}, _preload_content=False
        ))  # fmt: skip
        config_ = json.loads(self.kubeconfig.read_text())
        config_["users"] = [{"name": "test", "user": {"token": answer["status"]["token"]}}]
        path = root / "kubeconfig"
        path.write_text(json.dumps(config_))
        path.chmod(0o644)
        return path

    def _env(
        self,
        container: dict[str, Any],
        fields: dict[str, str],
        mounts: dict[str, str],
        root: Path,
        kubeconfig: Path,
    ) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(root),
               "KUBECONFIG": str(kubeconfig), "LANG": "C.UTF-8"}  # fmt: skip
        if "/tmp" in mounts:
            env["TMPDIR"] = mounts["/tmp"]
        for item in container.get("env") or ():
            if "value" in item:
                value = item["value"]
            else:
                source = item.get("valueFrom") or {}
                if "fieldRef" in source:
                    value = fields[source["fieldRef"]["fieldPath"]]
                else:
                    ref = source["secretKeyRef"]
                    secret = self.core.read_namespaced_secret(ref["name"], self.namespace)
                    value = base64.b64decode(secret.data[ref["key"]]).decode()
            env[item["name"]] = self._substitute(value, mounts, fields["status.podIP"])
        return env

    @staticmethod
    def _substitute(text: str, mounts: dict[str, str], ip: str) -> str:
        for mount in sorted(mounts, key=len, reverse=True):
            if text == mount or text.startswith(mount + "/") or f":{mount}" in text:
                text = text.replace(mount, mounts[mount], 1)
                break
        return text.replace("0.0.0.0:", f"{ip}:")

    def tend(self, running: RunningPod) -> None:
        now = time.monotonic()
        for container in running.containers:
            if container.proc is not None and container.proc.poll() is not None:
                if not container.exited_at:
                    container.exited_at = now
                elif now - container.exited_at >= _RESTART_BACKOFF:
                    container.restarts += 1
                    container.exited_at = 0.0
                    container.start()
        self.report(running, ready=all(c.running() for c in running.containers)
                    and all(self._probe(running, spec) for spec in running.spec["containers"]))  # fmt: skip

    def _port(self, running: RunningPod, port: Any) -> int:
        if isinstance(port, int):
            return port
        for container in running.spec["containers"]:
            for named in container.get("ports") or ():
                if named.get("name") == port:
                    return int(named["containerPort"])
        raise ValueError(f"no port named {port}")

    def _probe(self, running: RunningPod, container: dict[str, Any]) -> bool:
        probe = container.get("readinessProbe")
        if not probe:
            return True
        try:
            if "grpc" in probe:
                target = f"{running.ip}:{self._port(running, probe['grpc']['port'])}"
                with grpc.insecure_channel(target) as channel:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")),
                        timeout=1,
                    )
                return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
            if "tcpSocket" in probe:
                port = self._port(running, probe["tcpSocket"]["port"])
                with socket.create_connection((running.ip, port), timeout=1):
                    return True
        except (grpc.RpcError, OSError, ValueError):
            return False
        return True

    def report(self, running: RunningPod, *, ready: bool) -> None:
        flag = "True" if ready else "False"
        status = {
            "phase": "Running",
            "podIP": running.ip,
            "podIPs": [{"ip": running.ip}],
            "hostIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": flag},
                           {"type": "ContainersReady", "status": flag}],
            "containerStatuses": [
                {"name": c.name, "ready": ready, "restartCount": c.restarts, "image": c.image,
                 "imageID": c.image,
                 "state": {"running": {}} if c.running() else {"waiting": {"reason": "CrashLoopBackOff"}}}
                for c in running.containers
            ],
        }  # fmt: skip
        if status == running.reported:
            return
        with contextlib.suppress(client.ApiException):  # deleted meanwhile
            self.core.patch_namespaced_pod_status(
                running.name, self.namespace, {"status": status}, _preload_content=False
            )
            running.reported = status

    def kill(self, uids: list[str]) -> None:
        """Stop the pods `uids` as a kubelet does, all at once: SIGTERM to each of their
        containers, SIGKILL to what still runs _TERMINATION_GRACE later."""
        pods = [self.running.pop(uid) for uid in uids]
        for running in pods:
            for container in running.containers:
                container.signal(signal.SIGTERM)
        deadline = time.monotonic() + _TERMINATION_GRACE
        for running in pods:
            for container in running.containers:
                if container.proc is not None:
                    try:
                        container.proc.wait(max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        container.signal(signal.SIGKILL)
                        container.proc.wait()
                container.remove()
                container.log.close()
            shutil.rmtree(running.root, ignore_errors=True)
            self.free_ips.append(running.ip)

    def run(self) -> None:
        while not self.stop.wait(_TICK):
            try:
                pods = _json(self.core.list_namespaced_pod(self.namespace, _preload_content=False))[
                    "items"
                ]
                self.sync_deployments(pods)
                self.sync_pods(pods)
            except Exception as exc:  # the API server went away for a moment: try again
                print(f"node agent: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        self.kill(list(self.running))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.kubernetes.node_agent")
    parser.add_argument("--kubeconfig", required=True, type=Path)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--node", default="node-1")
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--ip-prefix", required=True, help="e.g. 127.23.4: pods get .2, .3, ...")
    parser.add_argument("--image", action="append", default=[], metavar="NAME=ARGV")
    parser.add_argument(
        "--deployments", default="", metavar="SELECTOR", help="the Deployments it keeps pods of"
    )
    parser.add_argument(
        "--podman", action="store_true",
        help="run each container with podman from its image, as the manifest says",
    )  # fmt: skip
    args = parser.parse_args()
    config.load_kube_config(str(args.kubeconfig))
    images = {name: shlex.split(argv) for name, _, argv in (i.partition("=") for i in args.image)}
    agent = NodeAgent(
        client.ApiClient(), args.namespace, node=args.node, root=args.root,
        ip_prefix=args.ip_prefix, images=images, kubeconfig=args.kubeconfig,
        deployments=args.deployments, podman=args.podman,
    )  # fmt: skip
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stop.set())
    print("node agent ready", flush=True)
    agent.run()


if __name__ == "__main__":
    main()
