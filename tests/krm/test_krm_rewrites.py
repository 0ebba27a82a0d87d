"""The builtin functions that rewrite fields by a program or by rules (starlark,
apply-replacements, set-image) and the catalog's housekeeping ones (no-op,
remove-local-config-resources, drop-comments), each case written from docs/krm.md, "Builtin
functions", and run twice where it mutates: the second run must change nothing."""

from __future__ import annotations

import textwrap

import pytest

from fnkernel.runtime_server.krm.functions.housekeeping import (
    drop_comments,
    no_op,
    remove_local_config_resources,
)
from fnkernel.runtime_server.krm.functions.replacements import apply_replacements
from fnkernel.runtime_server.krm.functions.set_image import set_image
from fnkernel.runtime_server.krm.functions.starlark import starlark_run
from fnkernel.runtime_server.krm.resources.resourcelist import ResourceList, load
from tests.krm.cases import item, rl_of, run, run_twice


def starlark_config(source: str, params: str = "") -> str:
    config = "apiVersion: fn.kpt.dev/v1alpha1\nkind: StarlarkRun\nmetadata: {name: script}\n"
    if params:
        config += f"params: {params}\n"
    return config + "source: |\n" + textwrap.indent(textwrap.dedent(source), "  ")


DEPLOYMENTS = """
- apiVersion: apps/v1
  kind: Deployment
  metadata: {name: web} # the web tier
  spec: {replicas: 1}
- apiVersion: v1
  kind: Service
  metadata: {name: web}
"""


class TestStarlark:
    def test_a_script_edits_items_through_ctx_resource_list(self) -> None:
        rl = run_twice(
            starlark_run,
            rl_of(
                DEPLOYMENTS,
                starlark_config(
                    """\
                    def set_replicas(resources, replicas):
                        for r in resources:
                            if r["kind"] == "Deployment":
                                r["spec"]["replicas"] = replicas
                    set_replicas(ctx.resource_list["items"], ctx.resource_list["functionConfig"]["params"]["replicas"])
                    """,
                    "{replicas: 3}",
                ),
            ),
        )
        assert item(rl, "Deployment")["spec"]["replicas"] == 3

    def test_top_level_loops_can_add_labels(self) -> None:
        rl = run_twice(
            starlark_run,
            rl_of(
                DEPLOYMENTS,
                starlark_config(
                    """\
                    for r in ctx.resource_list["items"]:
                        r["metadata"]["labels"] = {"managed-by": "starlark"}
                    """
                ),
            ),
        )
        assert all(i["metadata"]["labels"]["managed-by"] == "starlark" for i in rl.items)

    def test_a_script_can_add_and_remove_items(self) -> None:
        rl = run_twice(
            starlark_run,
            rl_of(
                DEPLOYMENTS,
                starlark_config(
                    """\
                    items = [r for r in ctx.resource_list["items"] if r["kind"] != "Service"]
                    if not [r for r in items if r["kind"] == "ConfigMap"]:
                        items.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "made"}})
                    ctx.resource_list["items"] = items
                    """
                ),
            ),
        )
        assert [i["kind"] for i in rl.items] == ["Deployment", "ConfigMap"]

    def test_fail_is_an_error_result_and_changes_nothing(self) -> None:
        data = rl_of(DEPLOYMENTS, starlark_config('fail("replicas too low")\n'))
        rl = run(starlark_run, data)
        assert rl.has_errors()
        assert rl.results[-1]["message"] == "fail: replicas too low"  # the catalog's words
        assert item(rl, "Deployment")["spec"]["replicas"] == 1

    def test_print_goes_to_stderr_not_results(self) -> None:
        """docs/krm.md, "starlark": print() writes the function's stderr, as the catalog's
        function does; it adds no result."""
        rl = ResourceList.parse(
            rl_of(
                DEPLOYMENTS,
                starlark_config('print("seen", len(ctx.resource_list["items"]), "items")\n'),
            )
        )
        starlark_run(rl)
        assert rl.stderr == ["seen 2 items"]
        assert rl.results == []

    def test_untouched_items_keep_their_layout_when_others_are_removed(self) -> None:
        """docs/krm.md, "starlark": a script that drops items leaves the others' nodes as they
        were (no file is rewritten for nothing)."""
        rl = ResourceList.parse(
            rl_of(
                DEPLOYMENTS,
                starlark_config('ctx.resource_list["items"] = ctx.resource_list["items"][1:]\n'),
            )
        )
        kept = rl.items[1]
        starlark_run(rl)
        assert len(rl.items) == 1 and rl.items[0] is kept

    def test_unchanged_parts_keep_their_comments(self) -> None:
        rl = run_twice(
            starlark_run,
            rl_of(
                DEPLOYMENTS,
                starlark_config('ctx.resource_list["items"][1]["metadata"]["name"] = "api"\n'),
            ),
        )
        text = rl.to_bytes().decode()
        assert "metadata: {name: web} # the web tier" in text
        assert "metadata: {name: api}" in text

    def test_a_config_without_source_is_an_error(self) -> None:
        config = "apiVersion: fn.kpt.dev/v1alpha1\nkind: StarlarkRun\nmetadata: {name: s}\n"
        rl = run(starlark_run, rl_of(DEPLOYMENTS, config))
        assert rl.has_errors() and "`source`" in rl.results[-1]["message"]


def replacements_config(replacements: str) -> str:
    return (
        "apiVersion: fn.kpt.dev/v1alpha1\nkind: ApplyReplacements\nmetadata: {name: r}\n"
        "replacements:\n" + textwrap.indent(textwrap.dedent(replacements), "")
    )


APP = """
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: settings}
  data: {image: "registry.local/cart:2.1", team: shop}
- apiVersion: apps/v1
  kind: Deployment
  metadata: {name: cart, labels: {app: cart}}
  spec:
    template:
      spec:
        containers:
        - name: cart
          image: cart:1.0 # replaced
        - name: sidecar
          image: envoy:1.0
- apiVersion: apps/v1
  kind: Deployment
  metadata: {name: other, labels: {app: other}}
  spec: {template: {spec: {containers: [{name: cart, image: cart:0.9}]}}}
"""


class TestApplyReplacements:
    def test_a_source_field_replaces_a_list_element_field(self) -> None:
        rl = run_twice(
            apply_replacements,
            rl_of(
                APP,
                replacements_config(
                    """\
                    - source: {kind: ConfigMap, name: settings, fieldPath: data.image}
                      targets:
                      - select: {kind: Deployment, name: cart}
                        fieldPaths: ["spec.template.spec.containers.[name=cart].image"]
                    """
                ),
            ),
        )
        containers = item(rl, "Deployment", "cart")["spec"]["template"]["spec"]["containers"]
        assert [c["image"] for c in containers] == ["registry.local/cart:2.1", "envoy:1.0"]
        assert "# replaced" in rl.to_bytes().decode()
        other = item(rl, "Deployment", "other")["spec"]["template"]["spec"]["containers"][0]
        assert other["image"] == "cart:0.9"

    def test_a_bracketed_key_may_hold_dots(self) -> None:
        """docs/krm.md, "Builtin functions": ``data.[app.kubernetes.io/app]`` names the key
        ``app.kubernetes.io/app``, as in kustomize's field paths."""
        rl = run_twice(
            apply_replacements,
            rl_of(
                APP,
                replacements_config(
                    """\
                    - source: {kind: ConfigMap, name: settings, fieldPath: data.image}
                      targets:
                      - select: {kind: Deployment, name: other}
                        fieldPaths: ["metadata.labels.[app.kubernetes.io/image]"]
                        options: {create: true}
                    """
                ),
            ),
        )
        labels = item(rl, "Deployment", "other")["metadata"]["labels"]
        assert labels["app.kubernetes.io/image"] == "registry.local/cart:2.1"

    def test_delimiter_and_index_replace_part_of_a_string(self) -> None:
        rl = run_twice(
            apply_replacements,
            rl_of(
                APP,
                replacements_config(
                    """\
                    - source:
                        kind: ConfigMap
                        fieldPath: data.image
                        options: {delimiter: ":", index: 1}
                      targets:
                      - select: {kind: Deployment}
                        fieldPaths: [spec.template.spec.containers.*.image]
                        options: {delimiter: ":", index: 1}
                    """
                ),
            ),
        )
        cart = item(rl, "Deployment", "cart")["spec"]["template"]["spec"]["containers"]
        assert [c["image"] for c in cart] == ["cart:2.1", "envoy:2.1"]
        assert (
            item(rl, "Deployment", "other")["spec"]["template"]["spec"]["containers"][0]["image"]
            == "cart:2.1"
        )

    def test_label_selector_and_reject(self) -> None:
        rl = run_twice(
            apply_replacements,
            rl_of(
                APP,
                replacements_config(
                    """\
                    - source: {kind: ConfigMap, fieldPath: data.team}
                      targets:
                      - select: {kind: Deployment, labelSelector: "app"}
                        reject: [{name: other}]
                        fieldPaths: [metadata.labels.team]
                        options: {create: true}
                    """
                ),
            ),
        )
        assert item(rl, "Deployment", "cart")["metadata"]["labels"]["team"] == "shop"
        assert "team" not in item(rl, "Deployment", "other")["metadata"]["labels"]

    def test_source_value_and_create(self) -> None:
        rl = run_twice(
            apply_replacements,
            rl_of(
                APP,
                replacements_config(
                    """\
                    - sourceValue: "3"
                      targets:
                      - select: {kind: Deployment, name: cart}
                        fieldPaths: [spec.replicas]
                        options: {create: true}
                    """
                ),
            ),
        )
        assert item(rl, "Deployment", "cart")["spec"]["replicas"] == "3"

    def test_a_list_position_and_the_default_metadata_name_source(self) -> None:
        rl = run_twice(
            apply_replacements,
            rl_of(
                APP,
                replacements_config(
                    """\
                    - source: {kind: ConfigMap, name: settings}
                      targets:
                      - select: {kind: Deployment, name: cart}
                        fieldPaths: [spec.template.spec.containers.1.name]
                    """
                ),
            ),
        )
        containers = item(rl, "Deployment", "cart")["spec"]["template"]["spec"]["containers"]
        assert [c["name"] for c in containers] == ["cart", "settings"]

    def test_a_missing_target_field_without_create_is_an_error(self) -> None:
        rl = run(
            apply_replacements,
            rl_of(
                APP,
                replacements_config(
                    """\
                    - sourceValue: x
                      targets:
                      - select: {kind: Deployment, name: cart}
                        fieldPaths: [spec.replicas]
                    """
                ),
            ),
        )
        assert rl.has_errors()
        assert "unable to find field spec.replicas in Deployment/cart" in rl.results[-1]["message"]

    def test_a_source_must_select_exactly_one_resource(self) -> None:
        rl = run(
            apply_replacements,
            rl_of(
                APP,
                replacements_config(
                    """\
                    - source: {kind: Deployment}
                      targets: [{select: {kind: ConfigMap}, fieldPaths: [data.team]}]
                    """
                ),
            ),
        )
        assert rl.has_errors() and "selected 2" in rl.results[-1]["message"]


# The catalog's housekeeping functions (docs/krm.md, "Builtin functions").

HOUSEKEEPING_ITEMS = """\
- apiVersion: v1
  kind: ConfigMap
  metadata:
    name: applied # kept
    annotations:
      internal.config.kubernetes.io/path: resources.yaml
  data:
    # a comment on its own line
    foo: bar # and one at the end of a line
- apiVersion: blueprints.cloud.google.com/v1alpha3
  kind: ResourceHierarchy
  metadata:
    name: sample-hierarchy
    annotations:
      config.kubernetes.io/local-config: "TRUE"
      internal.config.kubernetes.io/path: hierarchy.yaml
"""


def test_no_op_gives_the_resources_back_with_no_result() -> None:
    data = rl_of(HOUSEKEEPING_ITEMS, "{}")
    rl = run(no_op, data)
    assert rl.to_bytes() == ResourceList.parse(data).to_bytes()
    assert rl.results == []


def test_remove_local_config_resources_prunes_and_names_each() -> None:
    """The catalog's function: local-config "true" in any case is pruned; a count, then one
    info result per resource with its file; a warning when there is nothing to prune."""
    rl = run_twice(remove_local_config_resources, rl_of(HOUSEKEEPING_ITEMS, "{}"))
    assert [item["metadata"]["name"] for item in rl.items] == ["applied"]
    first = run(remove_local_config_resources, rl_of(HOUSEKEEPING_ITEMS, "{}"))
    assert [dict(r) for r in first.results] == [
        {"message": "Number of resources pruned: 1", "severity": "info"},
        {
            "message": "Resource name: [sample-hierarchy]",
            "severity": "info",
            "file": {"path": "hierarchy.yaml"},
        },
    ]
    nothing = run(
        remove_local_config_resources,
        rl_of(HOUSEKEEPING_ITEMS.split("- apiVersion: blueprints")[0], "{}"),
    )
    assert [dict(r) for r in nothing.results] == [
        {
            "message": "Found no resources to prune with the local config annotation",
            "severity": "warning",
        }
    ]


def test_drop_comments_removes_every_comment_and_nothing_else() -> None:
    data = rl_of(HOUSEKEEPING_ITEMS, "{}")
    rl = run_twice(drop_comments, data)
    text = rl.to_bytes().decode()
    assert "#" not in text
    assert load(text)["items"] == load(data.decode())["items"]


# set-image (docs/krm.md, "Builtin functions").

SET_IMAGE_ITEMS = """\
- apiVersion: v1
  kind: Pod
  metadata:
    name: app
  spec:
    initContainers:
    - name: init
      image: nginx:1.20.2
    containers:
    - name: server
      image: nginx:1.20.2 # the server
    - name: store
      image: postgres:14.1
- apiVersion: apps/v1
  kind: Deployment
  metadata:
    name: web
  spec:
    template:
      spec:
        containers:
        - name: web
          image: registry.local:5000/nginx@sha256:abc
- apiVersion: dev.example.com/v1
  kind: MyKind
  metadata:
    name: custom
  spec:
    manifest:
      images:
      - image: nginx
      - image: nginxfoo
"""


def images(rl: ResourceList) -> list[str]:
    pod, deployment, custom = rl.items
    return [
        *(c["image"] for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]),
        deployment["spec"]["template"]["spec"]["containers"][0]["image"],
        *(i["image"] for i in custom["spec"]["manifest"]["images"]),
    ]


def test_set_image_rewrites_the_pod_specs_containers_that_name_the_image() -> None:
    """Pods' and pod templates' containers; init containers are left, as the catalog's
    function leaves them; a new tag replaces the tag, the name keeps its registry port."""
    config = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata:\n  name: nginx\n  newTag: 1.21.4"
    rl = run_twice(set_image, rl_of(SET_IMAGE_ITEMS, config))
    assert images(rl) == [
        "nginx:1.20.2",
        "nginx:1.21.4",
        "postgres:14.1",
        "registry.local:5000/nginx@sha256:abc",  # another name
        "nginx",  # not a field it looks at
        "nginxfoo",
    ]
    assert "# the server" in rl.to_bytes().decode()
    first = run(set_image, rl_of(SET_IMAGE_ITEMS, config))
    assert [dict(r) for r in first.results] == [
        {"message": "summary: updated a total of 1 image(s)", "severity": "info"}
    ]


def test_set_image_digest_new_name_and_additional_fields() -> None:
    config = """\
apiVersion: fn.kpt.dev/v1alpha1
kind: SetImage
metadata: {name: c}
image:
  name: registry.local:5000/nginx
  newName: bitnami/nginx
  digest: sha256:def
additionalImageFields:
- {kind: MyKind, group: dev.example.com, version: v1, path: "spec/manifest/images[]/image"}
"""
    rl = run(set_image, rl_of(SET_IMAGE_ITEMS, config))
    assert images(rl)[3] == "bitnami/nginx@sha256:def"  # a digest replaces tag and digest
    config = config.replace("registry.local:5000/nginx", "nginx").replace(
        "digest: sha256:def", "newTag: v2"
    )
    rl = run(set_image, rl_of(SET_IMAGE_ITEMS, config))
    assert images(rl)[4:] == ["bitnami/nginx:v2", "nginxfoo"]
    assert rl.results[-1]["message"] == "summary: updated a total of 2 image(s)"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("  newTag: v2", "must specify `name`"),
        ("  name: nginx", "must specify one of `newName`, `newTag`, or `digest`"),
        ("  name: nginx\n  tag: v2", "ConfigMap has wrong field name tag"),
    ],
)
def test_set_image_refuses_an_incomplete_config(data: str, message: str) -> None:
    config = f"apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: c}}\ndata:\n{data}"
    rl = run(set_image, rl_of(SET_IMAGE_ITEMS, config))
    assert [dict(r) for r in rl.results] == [{"message": message, "severity": "error"}]
    assert images(rl)[1] == "nginx:1.20.2"
