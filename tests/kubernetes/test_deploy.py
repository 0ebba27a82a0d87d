"""deploy/ (docs/kubernetes.md): it builds with `kubectl kustomize`, every object validates
against Kubernetes' OpenAPI schemas (kubernetes-validate), the CRD enforces the limits the
control plane checks, every role is the least the component needs, and every command line is
one our CLI parses."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from fnkernel.adapters import bash, python, runtimes
from fnkernel.runtime_server import limits
from fnkernel.runtime_server.cli import build_parser
from fnkernel.runtime_server.lifecycle import controlplane
from fnkernel.runtime_server.lifecycle.kubernetes import objects
from tests.kubernetes.conftest import image_of, kustomize_build
from tests.support import ROOT

KUBERNETES_VERSION = "1.30.0"  # the oldest we document (docs/kubernetes.md: gRPC probes, CEL)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return kustomize_build("a-token", tmp_path_factory.mktemp("k") / "deploy")


def one(built: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in built if o["kind"] == kind and o["metadata"]["name"] == name)


def test_every_object_validates_against_the_kubernetes_openapi_schemas(
    built: list[dict[str, Any]],
) -> None:
    kinds = sorted({obj["kind"] for obj in built})
    assert kinds == ["CustomResourceDefinition", "Deployment", "Namespace", "NetworkPolicy",
                     "Role", "RoleBinding", "Secret", "Service", "ServiceAccount"]  # fmt: skip
    for obj in built:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        if obj["kind"] != "Namespace" and obj["kind"] != "CustomResourceDefinition":
            assert obj["metadata"]["namespace"] == "fnkernel"


def test_the_run_crd_enforces_the_control_planes_limits(built: list[dict[str, Any]]) -> None:
    crd = one(built, "CustomResourceDefinition", f"{objects.PLURAL}.{objects.GROUP}")
    (version,) = crd["spec"]["versions"]
    assert version["name"] == objects.VERSION and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {"Phase": ".status.phase", "Attempt": ".status.attempt",
                       "Pod": ".status.assignedPod", "Age": ".metadata.creationTimestamp"}  # fmt: skip
    schema = version["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]["properties"]
    assert spec["runtime"]["enum"] == list(runtimes.RUNTIMES)
    assert spec["handler"]["maxLength"] == max(python.MAX_HANDLER_BYTES, bash.MAX_HANDLER_BYTES)
    assert spec["env"]["maxProperties"] == limits.MAX_ENV_ENTRIES
    assert spec["idleTimeoutSeconds"]["maximum"] == limits.MAX_IDLE_TIMEOUT_SECONDS
    assert spec["memoryMb"]["maximum"] == limits.MAX_MEMORY_MB
    assert spec["files"]["maxProperties"] == controlplane.MAX_FILES
    assert spec["filesFrom"]["properties"]["configMaps"]["maxItems"] == objects.MAX_FILES_PARTS
    status = schema["properties"]["status"]["properties"]
    assert status["outputs"]["maxProperties"] == limits.MAX_OUTPUTS
    assert set(status) == set(objects.STATUS_KEYS.values())
    # The structural part of the schema, as the API server applies it (CEL rules aside).
    good = {"apiVersion": objects.API_VERSION, "kind": "Run", "metadata": {"name": "fn"},
            "spec": {"runtime": "python", "handler": "h.handle", "files": {"h.py": ""}}}  # fmt: skip
    jsonschema.validate(good, schema)
    for bad in (
        {"runtime": "ruby"},
        {"files": {}},
        {"files": {f"f{n}.py": "" for n in range(controlplane.MAX_FILES + 1)}},
        {"memoryMb": limits.MAX_MEMORY_MB + 1},
        {"env": {"A": 1}},
        {"filesFrom": {"configMaps": ["a"], "sha256": "not hex"}},
        {"filesFrom": {"configMaps": ["a"] * (objects.MAX_FILES_PARTS + 1), "sha256": "0" * 64}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**good, "spec": {**good["spec"], **bad}}, schema)


def test_each_role_is_the_least_its_component_needs(built: list[dict[str, Any]]) -> None:
    def rules(name: str) -> dict[str, set[str]]:
        role = one(built, "Role", name)
        return {
            f"{group}/{resource}" if group else resource: set(rule["verbs"])
            for rule in role["rules"] for group in rule["apiGroups"] for resource in rule["resources"]
        }  # fmt: skip

    # Exactly what each component calls: tests_k8s/ records the calls against these Roles.
    read = {"list", "watch"}
    assert rules("fnkernel-runtime") == {
        "fnkernel.dev/runs": read,
        "fnkernel.dev/runs/status": {"update"},
        "configmaps": {"get"},  # a Run's files
        "secrets": {"get"},  # the secrets its Runs name (docs/protocol.md, "Secrets")
    }
    gateway = rules("fnkernel-gateway")
    assert gateway["pods"] == read and "apps/deployments" not in gateway
    assert gateway["secrets"] == {"get", "list", "create", "update", "delete"}
    controller = rules("fnkernel-controller")
    assert controller["pods"] == read and "apps/deployments" not in controller  # none started
    for binding in (o for o in built if o["kind"] == "RoleBinding"):
        (subject,) = binding["subjects"]
        assert subject["name"] == binding["roleRef"]["name"] == binding["metadata"]["name"]
    for deployment in (o for o in built if o["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] in {
            "fnkernel-runtime",
            "fnkernel-controller",
            "fnkernel-gateway",
        }


def test_only_the_gateway_reaches_the_runtime_service_port(built: list[dict[str, Any]]) -> None:
    policy = one(built, "NetworkPolicy", "fnkernel-runtime-pods")["spec"]
    assert policy["podSelector"]["matchLabels"] == {objects.ROLE_LABEL: objects.RUNTIME_POD}
    (rule,) = policy["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {objects.ROLE_LABEL: "gateway"}}}]
    assert rule["ports"] == [{"port": objects.RUNTIMED_PORT, "protocol": "TCP"}]


def test_every_container_is_non_root_read_only_and_its_command_line_parses(
    built: list[dict[str, Any]],
) -> None:
    parser = build_parser()
    deployments = [o for o in built if o["kind"] == "Deployment"]
    assert {d["metadata"]["name"] for d in deployments} == {
        "fnkernel-controller", "fnkernel-gateway", "fnkernel-python", "fnkernel-bash"}  # fmt: skip
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        for container in pod["containers"]:
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"] == {"drop": ["ALL"]}
            parser.parse_args(container["args"])  # SystemExit on a flag the CLI lacks
            labels = deployment["spec"]["template"]["metadata"]["labels"]
            if (
                labels.get(objects.ROLE_LABEL) == objects.RUNTIME_POD
                and container["name"] == "runtimed"
            ):
                assert [p["name"] for p in container["ports"]] == [objects.RUNTIMED_PORT]
                assert "grpc" in container["readinessProbe"]
                assert labels[objects.RUNTIME_LABEL] in runtimes.RUNTIMES


def test_the_image_is_one_full_reference_that_kustomize_images_overrides(
    built: list[dict[str, Any]], tmp_path: Path
) -> None:
    # docs/kubernetes.md, "The image": never a bare name (which a node resolves to
    # docker.io/library/...): registry, repository and tag, the same in every container, and
    # set for all of them by an overlay's `images:`.
    image = image_of(built)
    registry, _, rest = image.partition("/")
    assert registry == "localhost" or "." in registry or ":" in registry, image
    assert ":" in rest, f"{image} has no tag"
    kustomize_build("a-token", tmp_path / "deploy")
    overlay = tmp_path / "team"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "resources: [../deploy]\n"
        f"images: [{{name: {image.rpartition(':')[0]}, newName: registry.example.com/team/fnkernel,"
        " newTag: '1.2.3'}]\n"
    )
    kubectl = shutil.which("kubectl")
    assert kubectl is not None
    done = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    overridden = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    assert image_of(overridden) == "registry.example.com/team/fnkernel:1.2.3"


def test_the_image_runs_fnkernel_as_a_numeric_non_root_user() -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
    users = [line.split()[1] for line in dockerfile if line.startswith("USER ")]
    assert users == ["65532:65532"]
    assert 'ENTRYPOINT ["fnkernel"]' in dockerfile
    assert Path(ROOT / ".gitignore").read_text().count("deploy/gateway-token") == 1
