"""kubeconform and kubeval, offline (docs/krm.md, "Builtin functions"): each resource against the
Kubernetes schemas kubernetes-validate ships, a schema directory the config names, or a CRD of
the package; one error result per problem, in each tool's own words."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fnkernel.runtime_server.krm.functions.schemas import kubeconform, kubeval, make_strict
from fnkernel.runtime_server.krm.resources.resourcelist import ResourceList
from tests.krm.cases import rl_of, run
from tests.krm.kpt_cases import fnkernel

BROKEN = """
- apiVersion: apps/v1
  kind: Deployment
  metadata:
    name: web
    namespace: prod
    annotations: {internal.config.kubernetes.io/path: deploy.yaml, internal.config.kubernetes.io/index: '1'}
  spec:
    replicas: three
    extra: true
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: fine}
  data: {a: b}
"""


def config(**data: str) -> str:
    lines = "".join(f"\n  {key}: '{value}'" for key, value in data.items())
    return f"apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: c}}\ndata:{lines or ' {}'}"


def results(rl: ResourceList) -> list[dict[str, Any]]:
    return [json.loads(json.dumps(r)) for r in rl.results]


def test_kubeconform_reports_each_problem_in_its_words() -> None:
    """The object's own problems first, then those inside it; field and file as kpt records
    them; a valid ConfigMap gives nothing."""
    rl = run(kubeconform, rl_of(BROKEN, config()))
    ref = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "namespace": "prod"}
    where = {"resourceRef": ref, "file": {"path": "deploy.yaml", "index": 1}}
    assert results(rl) == [
        {"message": "missing properties 'selector', 'template'", "severity": "error",
         "field": {"path": "spec"}, **where},
        {"message": "got string, want null or integer", "severity": "error",
         "field": {"path": "spec.replicas"}, **where},
    ]  # fmt: skip


def test_strict_refuses_fields_the_schema_does_not_name() -> None:
    rl = run(kubeconform, rl_of(BROKEN, config(strict="true")))
    messages = [r["message"] for r in rl.results]
    assert "additional properties 'extra' not allowed" in messages
    rl = run(kubeval, rl_of(BROKEN, config(strict="true")))
    assert [(r["message"], r["field"]["path"]) for r in rl.results] == [
        ("selector is required", "selector"),  # an object's required fields, then the rest
        ("template is required", "template"),
        ("Additional property extra is not allowed", "extra"),
        ("Invalid type. Expected: [integer,null], given: string", "spec.replicas"),
    ]


CUSTOM = """
- apiVersion: apiextensions.k8s.io/v1
  kind: CustomResourceDefinition
  metadata: {name: widgets.example.com}
  spec:
    group: example.com
    names: {kind: Widget, plural: widgets}
    scope: Namespaced
    versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec:
              type: object
              required: [size]
              properties:
                size: {type: integer}
- apiVersion: example.com/v1
  kind: Widget
  metadata: {name: w}
  spec: {size: big}
- apiVersion: other.io/v1
  kind: Unknown
  metadata: {name: u}
"""


def test_a_custom_resource_is_checked_against_its_crd_and_unknown_kinds_by_the_tools_rule() -> None:
    """kubeconform lets a kind without a schema pass; kubeval fails it unless told to ignore
    missing schemas or to skip the kind."""
    rl = run(kubeconform, rl_of(CUSTOM, config()))
    assert [(r["message"], r["resourceRef"]["kind"]) for r in rl.results] == [
        ("got string, want integer", "Widget")
    ]
    rl = run(kubeval, rl_of(CUSTOM, config()))
    unknown = [r for r in rl.results if r["resourceRef"]["kind"] == "Unknown"]
    assert unknown[0]["message"].startswith("Validating arbitrary CRDs is not supported yet.")
    for quiet in (config(ignore_missing_schemas="true"), config(skip_kinds="Unknown,Other")):
        rl = run(kubeval, rl_of(CUSTOM, quiet))
        assert [r["resourceRef"]["kind"] for r in rl.results] == ["Widget"]


def test_a_schema_directory_of_the_config(tmp_path: Path) -> None:
    """`schema_location: file://DIR` holds KIND-GROUP-VERSION.json files (kubeval's
    master-standalone/ below it too); their $refs are read beside them."""
    layout = tmp_path / "master-standalone"
    layout.mkdir()
    (layout / "_definitions.json").write_text(
        json.dumps({"definitions": {"count": {"type": "integer"}}})
    )
    deployment = {"type": "object", "properties": {"spec": {"type": "object", "properties": {
        "replicas": {"$ref": "_definitions.json#/definitions/count"}}}}}  # fmt: skip
    (layout / "deployment-apps-v1.json").write_text(json.dumps(deployment))
    rl = run(
        kubeval,
        rl_of(BROKEN, config(schema_location=f"file://{tmp_path}", ignore_missing_schemas="true")),
    )
    assert [(r["message"], r["field"]["path"]) for r in rl.results] == [
        ("Invalid type. Expected: integer, given: string", "spec.replicas")
    ]
    rl = run(kubeconform, rl_of(BROKEN, config(schema_location="https://example.com/schemas")))
    assert rl.results[0]["message"].startswith(
        "schema location https://example.com/schemas cannot be read"
    )


def test_fn_eval_mount_gives_a_builtin_function_the_directory_kpts_container_would_see(
    tmp_path: Path,
) -> None:
    """docs/krm.md, "Limits": with ``--mount type=bind,src=HOST,dst=PATH`` a builtin function
    reads PATH from HOST (the catalog's kubeval-mount-schema example); a bad mount is a usage
    error naming the flag, and nothing runs."""
    schemas = tmp_path / "schemas"
    schemas.mkdir()
    deployment = {"type": "object", "properties": {"spec": {"type": "object", "properties": {
        "replicas": {"type": "integer"}}}}}  # fmt: skip
    (schemas / "deployment-apps-v1.json").write_text(json.dumps(deployment))
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "deploy.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: web\nspec:\n  replicas: three\n"
    )
    argv = ["fn", "eval", str(package), "-i", "kubeval"]
    pairs = ["--", "schema_location=file:///schema-dir", "ignore_missing_schemas=true"]
    mount = f"type=bind,src={schemas},dst=/schema-dir/master-standalone"
    code, _, err = fnkernel(*argv, "--mount", mount, *pairs)
    assert code == 1
    assert "Invalid type. Expected: integer, given: string" in err
    code, _, err = fnkernel(*argv, *pairs)  # without it, /schema-dir holds nothing
    assert code == 0, err
    for bad in ("type=bind,dst=/schema-dir", "type=bind,src=x,dst=relative", "nonsense"):
        code, _, err = fnkernel(*argv, "--mount", bad, *pairs)
        assert code != 0 and "--mount" in err, (bad, err)


def test_kubeval_leaves_local_config_alone() -> None:
    items = BROKEN.replace(
        "annotations: {", "annotations: {config.kubernetes.io/local-config: 'true', "
    )
    assert [r["resourceRef"]["kind"] for r in run(kubeval, rl_of(items, config())).results] == []
    assert run(kubeconform, rl_of(items, config())).results  # kubeconform checks every resource


@pytest.mark.parametrize("root", [False, True])
def test_make_strict_keeps_unknown_fields_where_the_schema_says(root: bool) -> None:
    schema = {"properties": {"a": {"properties": {}, "x-kubernetes-preserve-unknown-fields": True}}}
    strict = make_strict(schema, root=root)
    assert strict["additionalProperties"] is False
    assert "additionalProperties" not in strict["properties"]["a"]
    assert ("metadata" in strict["properties"]) is root
