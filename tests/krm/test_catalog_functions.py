"""The catalog's setter, search, upsert and naming functions (apply-setters, create-setters,
list-setters, search-replace, upsert-resource, ensure-name-substring), each case written from the function's behaviour
in docs/krm.md, "Builtin functions", and run twice where it mutates: the second run must change
nothing."""

from __future__ import annotations

from typing import Any

import pytest

from fnkernel.runtime_server.krm.functions.name_substring import DEPENDS_ON, ensure_name_substring
from fnkernel.runtime_server.krm.functions.search_replace import (
    glob_matches,
    path_matches,
    search_replace,
)
from fnkernel.runtime_server.krm.functions.setters import (
    apply_setters,
    create_setters,
    current_values,
    list_setters,
)
from fnkernel.runtime_server.krm.functions.upsert_resource import upsert_resource
from fnkernel.runtime_server.krm.resources.resourcelist import FunctionFailure, ResourceList
from tests.krm.cases import rl_of, run, run_twice

DEPLOYMENT = """
- apiVersion: apps/v1
  kind: Deployment
  metadata:
    name: my-nginx
    annotations: {internal.config.kubernetes.io/path: deploy.yaml}
  spec:
    replicas: 4 # kpt-set: ${replicas}
    template:
      spec:
        containers:
          - name: nginx
            image: "nginx:1.16.1" # kpt-set: ${image}:${tag}
            args: [--port, "80"]
- apiVersion: v1
  kind: MyKind
  metadata:
    name: foo
    annotations: {internal.config.kubernetes.io/path: kind.yaml}
  environments: # kpt-set: ${env}
    - dev
    - stage
  zones: [a, b] # kpt-set: ${zones}
"""


def config(data: str) -> str:
    return f"apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: setters}}\ndata:\n{data}"


def results(rl: ResourceList) -> list[dict[str, Any]]:
    return [
        dict(r, **{k: dict(v) for k, v in r.items() if isinstance(v, dict)}) for r in rl.results
    ]


def text(rl: ResourceList) -> str:
    return rl.to_bytes().decode()


def test_apply_setters_fills_each_pattern_from_the_config_and_the_current_value() -> None:
    """`${image}` comes from the field's current value when the config leaves it out; a
    plain number stays a number, a quoted string stays quoted."""
    rl = run_twice(apply_setters, rl_of(DEPLOYMENT, config('  replicas: "3"\n  tag: 1.17.0')))
    deployment = rl.items[0]
    assert deployment["spec"]["replicas"] == 3
    assert "replicas: 3 # kpt-set: ${replicas}" in text(rl)
    assert 'image: "nginx:1.17.0" # kpt-set: ${image}:${tag}' in text(rl)
    assert results(rl) == [
        {
            "message": 'set field value to "3"',
            "field": {"path": "spec.replicas"},
            "file": {"path": "deploy.yaml"},
        },
        {
            "message": 'set field value to "nginx:1.17.0"',
            "field": {"path": "spec.template.spec.containers[0].image"},
            "file": {"path": "deploy.yaml"},
        },
    ]


def test_apply_setters_replaces_a_marked_list() -> None:
    """An array setter's value is a YAML list; written in block style under its key, and an
    empty value leaves `[]` with the comment after it."""
    rl = run_twice(apply_setters, rl_of(DEPLOYMENT, config('  env: "[prod, dev]"\n  zones: ""')))
    kind = rl.items[1]
    assert kind["environments"] == ["prod", "dev"]
    assert kind["zones"] == []
    assert "environments: # kpt-set: ${env}\n" in text(rl)
    assert "zones: [] # kpt-set: ${zones}" in text(rl)
    assert [r["message"] for r in rl.results] == [
        'set field value to "[prod, dev]"',
        'set field value to ""',
    ]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            '  env: "not a list"',
            'input to array setter must be an array of values, but found "not a list"',
        ),
        ("  image: ubuntu", "values for setters [${tag}] must be provided"),
    ],
)
def test_apply_setters_refuses_what_it_cannot_set(data: str, message: str) -> None:
    items = DEPLOYMENT.replace('"nginx:1.16.1"', "latest")  # ${tag} cannot be read from it
    rl = run(apply_setters, rl_of(items, config(data)))
    assert results(rl) == [{"message": f"failed to apply setters: {message}", "severity": "error"}]


def test_apply_setters_without_a_match_says_so() -> None:
    rl = run(apply_setters, rl_of(DEPLOYMENT, config("  other: x")))
    assert results(rl) == [{"message": "no matches for input setter(s)"}]
    assert rl.items[0]["spec"]["replicas"] == 4


def test_current_values_reads_every_reference_or_none() -> None:
    assert current_values("app.${stage}.${tld}", "app.dev.com") == {"stage": "dev", "tld": "com"}
    assert current_values("${image}:${tag}", "nginx") == {}
    assert current_values("${image}:${tag}", "nginx:") == {}  # an empty value is not read


PLAIN = """
- apiVersion: apps/v1
  kind: Deployment
  metadata:
    name: nginx-nginx
    annotations: {internal.config.kubernetes.io/path: deploy.yaml}
  spec:
    replicas: 4
    image: nginx:1.16.1
    environments:
      - stage
      - dev
    multiline: |
      nginx
"""


def test_create_setters_marks_the_fields_that_hold_a_setter_value() -> None:
    """The longest value is replaced first; a list whose elements are an array setter's
    (in any order) is marked on its key; multi-line values are left alone."""
    data = '  env: "[dev, stage]"\n  image: nginx\n  ngx: nginx-nginx\n  tag: 1.16.1\n  n: "4"'
    rl = run_twice(create_setters, rl_of(PLAIN, config(data)))
    out = text(rl)
    assert "name: nginx-nginx # kpt-set: ${ngx}" in out
    assert "replicas: 4 # kpt-set: ${n}" in out
    assert "image: nginx:1.16.1 # kpt-set: ${image}:${tag}" in out
    assert "environments: # kpt-set: ${env}" in out
    assert "nginx # kpt-set" not in out.split("multiline:")[1]
    messages = [r["message"] for r in rl.results]
    assert 'Added line comment "kpt-set: ${env}" for field with value "[dev stage]"' in messages
    assert rl.results[0]["file"]["path"] == "deploy.yaml"


def test_create_setters_needs_a_config_and_a_match() -> None:
    rl = run(create_setters, rl_of(PLAIN, config("  x: absent")))
    assert results(rl) == [
        {
            "message": "failed to create setters: no matches for the input list of setters",
            "severity": "error",
        }
    ]
    rl = run(create_setters, rl_of(PLAIN, "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}"))
    assert rl.results[0]["message"] == "failed to create setters: config map cannot be empty"


def test_list_setters_reports_values_types_and_counts_with_the_kptfiles() -> None:
    """Setters found in comments, by name; the Kptfile's apply-setters values come first and
    the walk counts their fields."""
    kptfile = """
- apiVersion: kpt.dev/v1
  kind: Kptfile
  metadata:
    name: pkg
    annotations: {internal.config.kubernetes.io/path: Kptfile}
  pipeline:
    mutators:
      - image: gcr.io/kpt-fn/apply-setters:v0.2
        configMap: {tag: "1.16.1", unused: "[a, b]"}
"""
    rl = run(list_setters, rl_of(DEPLOYMENT + kptfile, "{}"))
    assert [r["message"] for r in rl.results] == [
        "Name: env, Value: [dev, stage], Type: array, Count: 1",
        "Name: image, Value: nginx, Type: str, Count: 1",
        "Name: replicas, Value: 4, Type: int, Count: 1",
        "Name: tag, Value: 1.16.1, Type: str, Count: 1",
        "Name: unused, Value: [a, b], Type: array, Count: 0",
        "Name: zones, Value: [a, b], Type: array, Count: 1",
    ]
    rl = run(list_setters, rl_of(PLAIN, "{}"))
    assert results(rl) == [{"message": "no setters found", "severity": "warning"}]


# search-replace


def test_search_replace_puts_a_value_where_path_and_value_match() -> None:
    data = "  by-path: spec.replicas\n  by-value: '4'\n  put-value: '5'"
    rl = run_twice(search_replace, rl_of(PLAIN, config(data)))
    assert rl.items[0]["spec"]["replicas"] == 5
    assert results(rl) == [
        {
            "message": 'Mutated field value to "5"',
            "field": {"path": "spec.replicas"},
            "file": {"path": "deploy.yaml"},
        }
    ]


def test_search_replace_regex_groups_and_comments() -> None:
    """`${1}` in put-value and put-comment is the regex's first group; the result shows the
    field as written, comment included."""
    data = "  by-value-regex: nginx:(.*)\n  put-value: ubuntu:${1}\n  put-comment: 'kpt-set: ubuntu:${tag}'"
    rl = run(search_replace, rl_of(PLAIN, config(data)))
    assert "image: ubuntu:1.16.1 # kpt-set: ubuntu:${tag}" in text(rl)
    assert (
        rl.results[0]["message"]
        == 'Mutated field value to "ubuntu:1.16.1 # kpt-set: ubuntu:${tag}"'
    )


def test_search_replace_creates_a_field_at_an_absolute_path() -> None:
    data = "  by-path: metadata.labels.team\n  put-value: data"
    rl = run_twice(search_replace, rl_of(PLAIN, config(data)))
    assert rl.items[0]["metadata"]["labels"] == {"team": "data"}


def test_search_replace_matches_only_reports_and_comments_a_list() -> None:
    rl = run(search_replace, rl_of(PLAIN, config("  by-path: spec.environments[*]")))
    assert [r["message"] for r in rl.results] == [
        'Matched field value "stage"',
        'Matched field value "dev"',
    ]
    data = "  by-path: spec.environments\n  put-comment: 'kpt-set: ${env}'"
    rl = run(search_replace, rl_of(PLAIN, config(data)))
    assert "environments: # kpt-set: ${env}" in text(rl)
    assert rl.results[0]["message"] == 'Mutated field value to "[stage, dev]"'
    assert rl.results[0]["field"]["path"] == "spec.environments # kpt-set: ${env}"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            "  by-value: a\n  by-value-regex: b",
            'only one of [\\"by-value\\", \\"by-value-regex\\"] can be provided',
        ),
        ("  by-name: a", 'invalid matcher \\"by-name\\", must be one of'),
    ],
)
def test_search_replace_refuses_a_bad_config(data: str, message: str) -> None:
    rl = run(search_replace, rl_of(PLAIN, config(data)))
    assert rl.results[0]["severity"] == "error"
    assert rl.results[0]["message"].startswith(
        f'failed to perform search-replace operation: "{message}'
    )


def test_search_replace_with_no_match_and_by_file_path() -> None:
    rl = run(search_replace, rl_of(PLAIN, config("  by-value: absent")))
    assert results(rl) == [{"message": "no matches"}]
    data = "  by-file-path: '**/other.yaml'\n  by-path: spec.replicas\n  put-value: '1'"
    rl = run(search_replace, rl_of(PLAIN, config(data)))
    assert rl.items[0]["spec"]["replicas"] == 4


@pytest.mark.parametrize(
    ("path", "pattern", "matches"),
    [
        ("spec.replicas", "spec.replicas", True),
        ("spec.template.spec.containers[0].image", "spec.**.image", True),
        ("spec.containers[0].image", "spec.containers[*].image", True),
        ("spec.containers[1].image", "spec.containers[0].image", False),
        ("spec.containers[0].image", "*.*[*].image", True),
        ("metadata.name", "**", True),
        ("metadata.name", "spec.*", False),
    ],
)
def test_path_patterns(path: str, pattern: str, matches: bool) -> None:
    assert path_matches(path, pattern) is matches


@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        ("**/deploy.yaml", "deploy.yaml", True),
        ("**/deploy.yaml", "a/b/deploy.yaml", True),
        ("*.yaml", "a/deploy.yaml", False),
        ("a/{x,y}.yaml", "a/y.yaml", True),
        ("a/[!x].yaml", "a/x.yaml", False),
    ],
)
def test_file_globs(pattern: str, path: str, matches: bool) -> None:
    assert glob_matches(pattern, path) is matches


# upsert-resource

SERVICE = """
- apiVersion: v1
  kind: Service
  metadata:
    name: web
    namespace: prod
    annotations: {internal.config.kubernetes.io/path: svc.yaml, owner: old}
  spec: {selector: {app: foo}}
- apiVersion: apps/v1
  kind: Deployment
  metadata: {name: web, namespace: prod, annotations: {internal.config.kubernetes.io/path: svc.yaml}}
"""


def test_upsert_resource_replaces_the_same_resource_in_its_file() -> None:
    """Same group, kind, name and namespace: the config's resource replaces it, keeping its
    file; the config's own annotations replace the old ones."""
    wanted = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: prod\n  annotations: {team: a}\nspec: {selector: {app: bar}}"
    rl = run_twice(upsert_resource, rl_of(SERVICE, wanted))
    service, deployment = rl.items
    assert service["spec"]["selector"]["app"] == "bar"
    assert dict(service["metadata"]["annotations"]) == {
        "team": "a",
        "internal.config.kubernetes.io/path": "svc.yaml",
    }
    assert deployment["kind"] == "Deployment" and rl.results == []


def test_upsert_resource_adds_what_matches_nothing_at_its_target_path() -> None:
    """A List upserts each item; one matching nothing is added without a file (kpt picks
    one) or at `config.kubernetes.io/target-path`, which also narrows the match."""
    wanted = """apiVersion: v1
kind: List
metadata: {name: many}
items:
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: new, namespace: prod}
- apiVersion: v1
  kind: Service
  metadata:
    name: web
    namespace: prod
    annotations: {config.kubernetes.io/target-path: other/svc.yaml}
"""
    rl = run(upsert_resource, rl_of(SERVICE, wanted))
    assert [(i["kind"], dict(i["metadata"].get("annotations") or {})) for i in rl.items[2:]] == [
        ("ConfigMap", {}),
        ("Service", {"internal.config.kubernetes.io/path": "other/svc.yaml"}),
    ]
    assert rl.items[0]["spec"]["selector"]["app"] == "foo"  # another file: not replaced


def test_upsert_resource_needs_a_resource() -> None:
    with pytest.raises(FunctionFailure):
        run(upsert_resource, rl_of(SERVICE, "{}"))


# ensure-name-substring

APP = """
- apiVersion: v1
  kind: ConfigMap
  metadata:
    name: settings
    namespace: shop
    annotations: {internal.config.kubernetes.io/path: app.yaml}
- apiVersion: apps/v1
  kind: Deployment
  metadata:
    name: web
    namespace: shop
    annotations: {config.kubernetes.io/depends-on: /namespaces/shop/ConfigMap/settings}
  spec:
    template:
      spec:
        serviceAccountName: runner
        containers:
        - name: web
          envFrom: [{configMapRef: {name: settings}}, {configMapRef: {name: elsewhere}}]
- apiVersion: rbac.authorization.k8s.io/v1
  kind: RoleBinding
  metadata: {name: bind, namespace: shop}
  roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: reader}
  subjects: [{kind: ServiceAccount, name: runner, namespace: shop}]
- apiVersion: rbac.authorization.k8s.io/v1
  kind: Role
  metadata: {name: reader, namespace: shop}
- apiVersion: v1
  kind: ServiceAccount
  metadata: {name: runner, namespace: shop}
- apiVersion: v1
  kind: Namespace
  metadata: {name: shop}
"""


def names(rl: ResourceList) -> list[str]:
    return [item["metadata"]["name"] for item in rl.items]


def test_ensure_name_substring_renames_and_references_follow() -> None:
    """Each name gets the prefix once (a Namespace never); a reference to a renamed resource
    of the right kind follows it, one to a resource not in the package or of another kind
    does not; depends-on follows; the file annotations go, as kustomize drops them."""
    rl = run_twice(ensure_name_substring, rl_of(APP, config("  prepend: prod-")))
    assert names(rl) == [
        "prod-settings",
        "prod-web",
        "prod-bind",
        "prod-reader",
        "prod-runner",
        "shop",
    ]
    deployment, binding = rl.items[1], rl.items[2]
    pod = deployment["spec"]["template"]["spec"]
    assert [ref["configMapRef"]["name"] for ref in pod["containers"][0]["envFrom"]] == [
        "prod-settings",
        "elsewhere",
    ]
    assert pod["serviceAccountName"] == "prod-runner"
    assert binding["subjects"][0]["name"] == "prod-runner"
    assert binding["roleRef"]["name"] == "reader"  # a ClusterRole: the Role renamed is another kind
    assert (
        deployment["metadata"]["annotations"][DEPENDS_ON]
        == "/namespaces/shop/ConfigMap/prod-settings"
    )
    assert "annotations" not in rl.items[0]["metadata"]


def test_ensure_name_substring_appends_and_takes_additional_fields() -> None:
    wanted = """apiVersion: fn.kpt.dev/v1alpha1
kind: EnsureNameSubstring
metadata: {name: c}
substring: -prod
editMode: append
additionalNameFields: [{kind: Deployment, path: spec/template/spec/serviceAccountName}]
"""
    rl = run(ensure_name_substring, rl_of(APP, wanted))
    assert names(rl)[:2] == ["settings-prod", "web-prod"]
    # The additional field gets the suffix; then, as a reference, it names nothing renamed.
    assert rl.items[1]["spec"]["template"]["spec"]["serviceAccountName"] == "runner-prod"


@pytest.mark.parametrize(
    ("wanted", "message"),
    [
        (
            config("  prepend: a\n  append: b"),
            "only 1 entry is allowed in the ConfigMap, but got: 2",
        ),
        (config("  middle: a"), "unknown editMode: middle, only prepend and append are allowed"),
        (config("  prepend: ''"), "substring must not be empty"),
        ("apiVersion: v2\nkind: Other\nmetadata: {name: c}", "but we got: /v2, Kind=Other"),
    ],
)
def test_ensure_name_substring_refuses_a_bad_config(wanted: str, message: str) -> None:
    rl = ResourceList.parse(rl_of(APP, wanted))
    with pytest.raises(FunctionFailure):
        ensure_name_substring(rl)
    assert message in rl.stderr[0] and rl.stderr[0].startswith(
        "failed to load the `functionConfig`"
    )
    assert names(rl)[0] == "settings"
